//! System calls made inside a fully rebuilt process just before it runs (at resume), when its
//! trampoline is gone and its registers are final: what could only be done once the original
//! of a migration was dead (a lock it held, a name it had). The call runs at a `syscall`
//! instruction of the process's own code with scratch space below its stack; every signal is
//! held back meanwhile (an injected call would otherwise swallow a pending one); registers,
//! stack bytes and signal mask are put back afterwards.

use crate::error::{Error, Result};
use ferry_inject::Injector;
use ferry_sys::ptrace;

/// Runs `f` with an injector into the stopped thread group leader `host` (the tree's `pid`).
pub fn with_injector<T>(
    pid: i32,
    host: i32,
    what: &str,
    f: impl FnOnce(&Injector) -> Result<T>,
) -> Result<T> {
    let sys = |step: &str, e: ferry_sys::SysError| Error::Restore {
        pid,
        what: format!("{what} at resume: {step}: {e}"),
    };
    let mask = ptrace::get_sigmask(host).map_err(|e| sys("read the signal mask", e))?;
    ptrace::set_sigmask(host, u64::MAX).map_err(|e| sys("hold signals back", e))?;
    let made = (|| -> Result<Injector> {
        let regs = ptrace::get_regs(host).map_err(|e| sys("read registers", e))?;
        let at = ferry_inject::find_syscall_insn(host)?;
        Ok(Injector::on_stack(host, host, regs, at)?)
    })();
    let inj = match made {
        Ok(x) => x,
        Err(e) => {
            let _ = ptrace::set_sigmask(host, mask);
            return Err(e);
        }
    };
    let out = f(&inj);
    let put_back = inj.finish().map_err(Error::from);
    let mask_back = ptrace::set_sigmask(host, mask).map_err(|e| sys("restore the signal mask", e));
    let out = out?;
    put_back?;
    mask_back?;
    Ok(out)
}
