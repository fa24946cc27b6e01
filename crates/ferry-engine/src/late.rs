//! System calls made inside a fully rebuilt process just before it runs (at resume), when its
//! trampoline is gone and its registers are final: what could only be done once the original
//! of a migration was dead (a lock it held, a name it had). The call runs at a `syscall`
//! instruction of the process's own code with scratch space below its stack; the injector
//! holds every signal back meanwhile (an injected call would otherwise swallow a pending one)
//! and puts registers, stack bytes and signal mask back afterwards.

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
    let regs = ptrace::get_regs(host).map_err(|e| Error::Restore {
        pid,
        what: format!("{what} at resume: read registers: {e}"),
    })?;
    let at = ferry_inject::find_syscall_insn(host)?;
    let inj = Injector::on_stack(host, host, regs, at)?;
    let out = f(&inj);
    let put_back = inj.finish().map_err(Error::from);
    let out = out?;
    put_back?;
    Ok(out)
}
