//! Process-wide identity and limits: credentials, capabilities, rlimits, cwd and root, umask,
//! personality, no_new_privs, and the kernel's address-space bookkeeping (PR_SET_MM_MAP).

use crate::error::{Context, Result};
use crate::husk::Husk;
use crate::procfs;
use ferry_image::{Creds, MmLayout, PrctlState, Process, Rlimit};
use ferry_inject::batch::Call;
use ferry_inject::Injector;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;

const PR_GET_SECUREBITS: u64 = 27;
const PR_SET_SECUREBITS: u64 = 28;
const PR_SET_MM: u64 = 35;
const PR_SET_MM_MAP: u64 = 14;
const PR_SET_NO_NEW_PRIVS: u64 = 38;
const PR_CAP_AMBIENT: u64 = 47;
const PR_CAP_AMBIENT_RAISE: u64 = 2;
const PR_CAPBSET_DROP: u64 = 24;
const PR_SET_KEEPCAPS: u64 = 8;
const RLIMIT_COUNT: u32 = 16;

fn ids(s: &str) -> [u32; 4] {
    let v: Vec<u32> = s
        .split_whitespace()
        .filter_map(|x| x.parse().ok())
        .collect();
    [
        v.first().copied().unwrap_or(0),
        v.get(1).copied().unwrap_or(0),
        v.get(2).copied().unwrap_or(0),
        v.get(3).copied().unwrap_or(0),
    ]
}

/// Fills the identity fields of `p` from /proc and from calls injected through `inj`.
/// The resource limits of every process of `injs` (ours PIDs and main threads' injectors),
/// asked of all at once (`asked::ask_all`). Asked from inside: prlimit64 on another process
/// with other credentials would need CAP_SYS_RESOURCE.
pub fn capture_rlimits(injs: &[(i32, &Injector)]) -> Result<Vec<Vec<Rlimit>>> {
    let answers = crate::resources::asked::ask_all(injs, RLIMIT_COUNT as usize, 16, |k, inj| {
        (
            "prlimit64",
            libc::SYS_prlimit64,
            [0, k as u64, 0, inj.scratch(0), 0, 0],
        )
    })?;
    Ok(answers
        .into_iter()
        .map(|per| {
            per.into_iter()
                .enumerate()
                .map(|(k, b)| Rlimit {
                    resource: k as _,
                    cur: u64::from_ne_bytes(b[0..8].try_into().expect("8 bytes")),
                    max: u64::from_ne_bytes(b[8..16].try_into().expect("8 bytes")),
                })
                .collect()
        })
        .collect())
}

/// A process's own state; its resource limits (`capture_rlimits`) given.
pub fn capture(
    pid: i32,
    stat: &procfs::Stat,
    inj: &Injector,
    p: &mut Process,
    rlimits: Vec<Rlimit>,
) -> Result<()> {
    let status = procfs::status(pid)?;
    p.pid = pid;
    p.ppid = stat.ppid;
    p.pgid = stat.pgid;
    p.sid = stat.sid;
    p.comm = stat.comm.clone();
    p.exit_signal = stat.exit_signal;
    p.cmdline = procfs::read_bytes(pid, "cmdline")?
        .split(|b| *b == 0)
        .filter(|s| !s.is_empty())
        .map(|s| String::from_utf8_lossy(s).into_owned())
        .collect();
    p.exe = procfs::readlink(pid, "exe")?;
    p.cwd = procfs::readlink(pid, "cwd")?;
    // Also for a removed working directory: its mode is what comes back of it.
    p.cwd_identity = std::fs::metadata(format!("/proc/{pid}/cwd"))
        .ok()
        .map(|md| crate::reopen::identity_of(&md));
    p.root = procfs::readlink(pid, "root")?;
    if p.root != "/" {
        p.root_identity = std::fs::metadata(format!("/proc/{pid}/root"))
            .ok()
            .map(|md| crate::reopen::identity_of(&md));
    }
    p.umask = u32::from_str_radix(procfs::field(&status, "Umask"), 8).unwrap_or(0o022);
    p.no_new_privs = procfs::field(&status, "NoNewPrivs") == "1";
    p.personality = u32::from_str_radix(procfs::read(pid, "personality")?.trim(), 16).unwrap_or(0);
    p.creds = Creds {
        uids: ids(procfs::field(&status, "Uid")),
        gids: ids(procfs::field(&status, "Gid")),
        groups: procfs::field(&status, "Groups")
            .split_whitespace()
            .filter_map(|g| g.parse().ok())
            .collect(),
        cap_inh: procfs::hex_field(&status, "CapInh"),
        cap_prm: procfs::hex_field(&status, "CapPrm"),
        cap_eff: procfs::hex_field(&status, "CapEff"),
        cap_bnd: procfs::hex_field(&status, "CapBnd"),
        cap_amb: procfs::hex_field(&status, "CapAmb"),
        securebits: inj.syscall(
            "prctl(PR_GET_SECUREBITS)",
            libc::SYS_prctl,
            &[PR_GET_SECUREBITS],
        )? as u32,
    };
    p.rlimits = rlimits;
    if procfs::field(&status, "Seccomp") == "1" {
        return Err(crate::Error::Unsupported {
            pid,
            what: "seccomp strict mode".into(),
            why: "a process in strict mode may make no system call but read, write, exit and \
                  sigreturn, and its rebuilding needs many more"
                .into(),
        });
    }
    p.prctl = capture_prctl(inj)?;
    p.oom_score_adj = procfs::read(pid, "oom_score_adj")?.trim().parse().ok();
    p.loginuid = procfs::read(pid, "loginuid")
        .ok()
        .and_then(|s| s.trim().parse().ok());
    // Linux 6.3+; older kernels cannot tell (EINVAL): nothing is kept then.
    p.membarrier = inj
        .syscall(
            "membarrier(MEMBARRIER_CMD_GET_REGISTRATIONS)",
            libc::SYS_membarrier,
            &[MEMBARRIER_CMD_GET_REGISTRATIONS, 0, 0],
        )
        .unwrap_or(0) as u32;
    let auxv = procfs::read_bytes(pid, "auxv")?;
    p.mm = MmLayout {
        start_code: stat.start_code,
        end_code: stat.end_code,
        start_data: stat.start_data,
        end_data: stat.end_data,
        start_brk: stat.start_brk,
        brk: inj.syscall("brk(0)", libc::SYS_brk, &[0])?,
        start_stack: stat.start_stack,
        arg_start: stat.arg_start,
        arg_end: stat.arg_end,
        env_start: stat.env_start,
        env_end: stat.env_end,
        auxv: auxv
            .chunks_exact(8)
            .map(|c| u64::from_ne_bytes(c.try_into().expect("8 bytes")))
            .collect(),
    };
    Ok(())
}

/// Restores cwd, root, umask, personality, rlimits and the mm bookkeeping. Run after memory
/// and descriptors are in place, before credentials are dropped.
/// `memfd_exe`: the recreated memfd the process runs from, when its executable is one
/// (`memory::memfd_exe`).
pub fn restore_environment(
    h: &Husk,
    p: &Process,
    rights: &crate::reopen::Rights<'_>,
    memfd_exe: Option<std::fs::File>,
) -> Result<()> {
    let inj = h.injector();
    let pid = h.pid;
    let path = |s: &str| -> Result<u64> {
        let mut b = s.as_bytes().to_vec();
        b.push(0);
        Ok(inj.write_scratch(0, &b)?)
    };
    restore_audit_and_oom(h, p)?;
    // Both paths are as we see them: the working directory is entered before the root
    // changes (a chroot leaves it where it was), else it would be looked up under the new root.
    let removed = p.cwd.strip_suffix(" (deleted)");
    let cwd = removed.unwrap_or(&p.cwd);
    if let Some(cwd) = removed {
        // Made again, entered and removed (resources/removed.rs).
        let how = "working directory";
        let mode = p.cwd_identity.as_ref().map_or(0o700, |i| i.mode);
        let made = crate::resources::removed::make(
            pid,
            how,
            crate::resources::removed::Node::Dir,
            cwd,
            mode,
            &rights.process,
        )?;
        inj.syscall("chdir", libc::SYS_chdir, &[path(&made.path)?])
            .map_err(|e| crate::Error::Restore {
                pid,
                what: format!("cannot enter removed working directory {cwd}: {e}"),
            })?;
        made.remove(pid, how)?;
    } else {
        enter_cwd(h, p, cwd, rights)?;
    }
    if p.root != "/" {
        // As for the working directory: looked up as the process, without links, the
        // directory captured, and checked again once entered.
        let dir = crate::reopen::open(
            pid,
            "root directory",
            &p.root,
            libc::O_PATH | libc::O_DIRECTORY,
            p.root_identity.as_ref(),
            crate::reopen::Match::Inode,
            rights,
        )?;
        let want = std::fs::metadata(format!("/proc/self/fd/{}", dir.as_raw_fd()))
            .ctx(pid, || format!("stat root directory {}", p.root))?;
        inj.syscall("chroot", libc::SYS_chroot, &[path(&p.root)?])
            .map_err(|e| crate::Error::Restore {
                pid,
                what: format!("cannot change root to {}: {e}", p.root),
            })?;
        let now = std::fs::metadata(format!("/proc/{}/root", h.host))
            .ctx(pid, || format!("stat its root directory {}", p.root))?;
        if (now.dev(), now.ino()) != (want.dev(), want.ino()) {
            return Err(crate::Error::Restore {
                pid,
                what: format!(
                    "root directory: {}: not the directory that was looked up (it changed \
                     meanwhile); refused",
                    p.root
                ),
            });
        }
    }
    for bit in 0..32 {
        let cmd = 1u64 << bit;
        if p.membarrier as u64 & cmd != 0 {
            inj.syscall("membarrier(register)", libc::SYS_membarrier, &[cmd, 0, 0])
                .map_err(|e| crate::Error::Restore {
                    pid,
                    what: format!("register for membarrier command {cmd:#x}: {e}"),
                })?;
        }
    }
    // (umask and personality answer the previous value: never taken for an error.)
    h.batch(
        &[
            Call::new("umask", libc::SYS_umask, &[p.umask as u64]),
            Call::new(
                "personality",
                libc::SYS_personality,
                &[p.personality as u64],
            ),
        ],
        |i| ["set its umask", "set its personality"][i.min(1)].to_string(),
    )?;
    for r in &p.rlimits {
        ferry_sys::fdops::set_rlimit(h.host, r.resource, r.cur, r.max).ctx(pid, || {
            format!("set rlimit {} to {}/{}", r.resource, r.cur, r.max)
        })?;
    }
    set_mm_map(h, p, rights, memfd_exe)
}

const MEMBARRIER_CMD_GET_REGISTRATIONS: u64 = 1 << 9;

/// oom_score_adj (written by us, root) and the audit login uid, which only the process itself
/// may set (with CAP_AUDIT_CONTROL, which the husk still has): through /proc/self, so before
/// any chroot.
fn restore_audit_and_oom(h: &Husk, p: &Process) -> Result<()> {
    if let Some(adj) = p.oom_score_adj {
        std::fs::write(format!("/proc/{}/oom_score_adj", h.host), adj.to_string())
            .ctx(h.pid, || format!("set oom_score_adj to {adj}"))?;
    }
    let Some(uid) = p.loginuid else {
        return Ok(());
    };
    let now: Option<u32> = procfs::read(h.host, "loginuid")
        .ok()
        .and_then(|s| s.trim().parse().ok());
    if now == Some(uid) {
        return Ok(());
    }
    let inj = h.injector();
    let name = inj.write_scratch(0, b"/proc/self/loginuid\0")?;
    let fd = inj
        .syscall(
            "open(/proc/self/loginuid)",
            libc::SYS_open,
            &[name, (libc::O_WRONLY | libc::O_CLOEXEC) as u64],
        )
        .map_err(|e| crate::Error::Restore {
            pid: h.pid,
            what: format!("open /proc/self/loginuid to set the login uid {uid}: {e}"),
        })?;
    let text = uid.to_string();
    let buf = inj.write_scratch(64, text.as_bytes())?;
    let wrote = inj.syscall(
        "write(loginuid)",
        libc::SYS_write,
        &[fd, buf, text.len() as u64],
    );
    inj.syscall("close", libc::SYS_close, &[fd])?;
    wrote.map_err(|e| crate::Error::Restore {
        pid: h.pid,
        what: format!(
            "set the login uid to {uid} (from {}): {e}",
            now.map(|n| n.to_string()).unwrap_or_else(|| "?".into())
        ),
    })?;
    Ok(())
}

fn set_mm_map(
    h: &Husk,
    p: &Process,
    rights: &crate::reopen::Rights<'_>,
    memfd_exe: Option<std::fs::File>,
) -> Result<()> {
    let inj = h.injector();
    let mm = &p.mm;
    let auxv: Vec<u8> = mm.auxv.iter().flat_map(|w| w.to_ne_bytes()).collect();
    let auxv_addr = inj.write_scratch(1024, &auxv)?;
    // Opened as the process, and only if it is the file it maps as its executable.
    let exe_path = p.exe.strip_suffix(" (deleted)").unwrap_or(&p.exe);
    let want = p.vmas.iter().find_map(|v| match &v.backing {
        ferry_image::Backing::File {
            path,
            dev,
            ino,
            size,
            ghost: None,
        } if path == exe_path => Some(ferry_image::FileIdentity {
            dev: *dev,
            ino: *ino,
            mode: libc::S_IFREG,
            size: *size,
            ..Default::default()
        }),
        _ => None,
    });
    let exe = match memfd_exe {
        Some(f) => std::os::fd::OwnedFd::from(f),
        None => crate::reopen::open(
            p.pid,
            "executable",
            exe_path,
            libc::O_RDONLY,
            want.as_ref(),
            crate::reopen::Match::Mapped,
            rights,
        )?,
    };
    // A deputy taken over at home (`Husk::adopt`) has its executable already, and the kernel
    // refuses to replace one that is mapped (as the image maps it again): -1 keeps it.
    let same_exe = {
        use std::os::unix::fs::MetadataExt;
        let here = std::fs::metadata(format!("/proc/{}/exe", h.host));
        let there = std::fs::File::from(exe.try_clone().map_err(|e| crate::Error::Restore {
            pid: h.pid,
            what: format!("duplicate its executable's descriptor: {e}"),
        })?)
        .metadata();
        matches!((here, there), (Ok(a), Ok(b)) if a.dev() == b.dev() && a.ino() == b.ino())
    };
    let exe_fd = if same_exe {
        -1
    } else {
        h.install_fd(&exe, None)?
    };
    let mut map: Vec<u8> = [
        mm.start_code,
        mm.end_code,
        mm.start_data,
        mm.end_data,
        mm.start_brk,
        mm.brk,
        mm.start_stack,
        mm.arg_start,
        mm.arg_end,
        mm.env_start,
        mm.env_end,
        auxv_addr,
    ]
    .iter()
    .flat_map(|w| w.to_ne_bytes())
    .collect();
    map.extend_from_slice(&(auxv.len() as u32).to_ne_bytes());
    map.extend_from_slice(&(exe_fd as u32).to_ne_bytes());
    let map_addr = inj.write_scratch(512, &map)?;
    let r = inj.syscall(
        "prctl(PR_SET_MM_MAP)",
        libc::SYS_prctl,
        &[PR_SET_MM, PR_SET_MM_MAP, map_addr, map.len() as u64, 0],
    );
    if exe_fd >= 0 {
        inj.syscall("close", libc::SYS_close, &[exe_fd as u64])?;
    }
    r.map_err(|e| crate::Error::Restore {
        pid: h.pid,
        what: format!("set the address-space layout (PR_SET_MM_MAP): {e}"),
    })?;
    Ok(())
}

/// Drops every thread of a process to its credentials, and sets its prctl attributes: the
/// last injected calls of a restore (afterwards the process may no longer be allowed to do
/// what the earlier steps needed). Credentials belong to each thread (glibc's setuid and
/// friends change every thread's in turn): every thread of a rebuilt process, made by root, is
/// dropped, not only the main one. `threads`: the injectors of the threads other than the
/// husk's own (its main thread). Every thread runs the same batch at the same time (one round
/// of stops for all of them); the main thread's starts with `first` (closing the husk's
/// handle on ferry) and goes on with the prctl attributes, which come after the credentials
/// since changing them resets `dumpable`.
pub fn restore_creds_all(
    h: &Husk,
    p: &Process,
    threads: &[&Injector],
    first: Option<Call>,
) -> Result<()> {
    let creds = creds_calls(h, p)?;
    let mut main: Vec<Call> = first.into_iter().collect();
    main.extend_from_slice(&creds);
    main.extend(prctl_calls(p));
    let slot = (main.len().max(creds.len()) as u64 * ferry_inject::batch::ENTRY_LEN)
        .next_multiple_of(64)
        .max(64);
    let fail = || crate::Error::Restore {
        pid: p.pid,
        what: format!(
            "{} calls to drop its threads' credentials do not fit the trampoline",
            main.len()
        ),
    };
    let main_site = h.batch_slot(0, slot).ok_or_else(fail)?;
    let threads_site = h.batch_slot(1, slot).ok_or_else(fail)?;
    let mut items: Vec<(&Injector, ferry_inject::batch::BatchSite, &[Call])> =
        vec![(h.injector(), main_site, &main[..])];
    items.extend(threads.iter().map(|inj| (*inj, threads_site, &creds[..])));
    let results = ferry_inject::batch::run_batches(&items)?;
    for ((inj, _, _), r) in items.iter().zip(results) {
        if let Err(stopped) = r {
            return Err(crate::Error::Restore {
                pid: p.pid,
                what: format!(
                    "thread (TID {} here): drop to the process's credentials: {stopped}",
                    inj.tid
                ),
            });
        }
    }
    Ok(())
}

/// The calls that drop a thread to `p`'s credentials, their data (groups, capabilities)
/// written into the husk's trampoline, where every thread of it reads them.
fn creds_calls(h: &Husk, p: &Process) -> Result<Vec<Call>> {
    let c = &p.creds;
    let mut calls = Vec::new();
    let last = last_cap();
    for cap in 0..64u64 {
        if c.cap_bnd & (1 << cap) == 0 && cap <= last {
            calls.push(Call::new(
                "prctl(PR_CAPBSET_DROP)",
                libc::SYS_prctl,
                &[PR_CAPBSET_DROP, cap],
            ));
        }
    }
    // Securebits go first, while we are still root, with KEEP_CAPS on so that the
    // capabilities survive the change of uid; KEEP_CAPS is put right at the end.
    const SECBIT_KEEP_CAPS: u64 = 1 << 4;
    let bits = c.securebits as u64;
    calls.push(Call::new(
        "prctl(PR_SET_SECUREBITS)",
        libc::SYS_prctl,
        &[PR_SET_SECUREBITS, bits | SECBIT_KEEP_CAPS],
    ));
    // struct __user_cap_header_struct (version 3) and two __user_cap_data_struct, then the
    // groups.
    let mut data = Vec::new();
    data.extend_from_slice(&0x2008_0522u32.to_ne_bytes());
    data.extend_from_slice(&0i32.to_ne_bytes());
    for half in [0u32, 32] {
        data.extend_from_slice(&((c.cap_eff >> half) as u32).to_ne_bytes());
        data.extend_from_slice(&((c.cap_prm >> half) as u32).to_ne_bytes());
        data.extend_from_slice(&((c.cap_inh >> half) as u32).to_ne_bytes());
    }
    let groups_at = data.len() as u64;
    data.extend(c.groups.iter().flat_map(|g| g.to_ne_bytes()));
    let caddr = h.write_data(0, &data)?;
    calls.push(Call::new(
        "setgroups",
        libc::SYS_setgroups,
        &[c.groups.len() as u64, caddr + groups_at],
    ));
    calls.push(Call::new(
        "setresgid",
        libc::SYS_setresgid,
        &[c.gids[0] as u64, c.gids[1] as u64, c.gids[2] as u64],
    ));
    // (setfsgid and setfsuid answer the previous value, a 32-bit one: never taken for an
    // error.)
    calls.push(Call::new(
        "setfsgid",
        libc::SYS_setfsgid,
        &[c.gids[3] as u64],
    ));
    calls.push(Call::new(
        "setresuid",
        libc::SYS_setresuid,
        &[c.uids[0] as u64, c.uids[1] as u64, c.uids[2] as u64],
    ));
    calls.push(Call::new(
        "setfsuid",
        libc::SYS_setfsuid,
        &[c.uids[3] as u64],
    ));
    calls.push(Call::new("capset", libc::SYS_capset, &[caddr, caddr + 8]));
    for cap in 0..64u64 {
        if c.cap_amb & (1 << cap) != 0 {
            calls.push(Call::new(
                "prctl(PR_CAP_AMBIENT_RAISE)",
                libc::SYS_prctl,
                &[PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE, cap, 0, 0],
            ));
        }
    }
    if bits & SECBIT_KEEP_CAPS == 0 {
        calls.push(Call::new(
            "prctl(PR_SET_KEEPCAPS)",
            libc::SYS_prctl,
            &[PR_SET_KEEPCAPS, 0],
        ));
    }
    if p.no_new_privs {
        calls.push(Call::new(
            "prctl(PR_SET_NO_NEW_PRIVS)",
            libc::SYS_prctl,
            &[PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0],
        ));
    }
    Ok(calls)
}

fn last_cap() -> u64 {
    std::fs::read_to_string("/proc/sys/kernel/cap_last_cap")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(40)
}

const PR_SET_PDEATHSIG: u64 = 1;
const PR_GET_PDEATHSIG: u64 = 2;
const PR_GET_DUMPABLE: u64 = 3;
const PR_SET_DUMPABLE: u64 = 4;
const PR_SET_CHILD_SUBREAPER: u64 = 36;
const PR_GET_CHILD_SUBREAPER: u64 = 37;
const PR_SET_THP_DISABLE: u64 = 41;
const PR_GET_THP_DISABLE: u64 = 42;
const PR_SET_MDWE: u64 = 65;
const PR_GET_MDWE: u64 = 66;

fn capture_prctl(inj: &Injector) -> Result<PrctlState> {
    let int_at = |off: u64| -> Result<i32> {
        Ok(i32::from_ne_bytes(
            inj.read_scratch(off, 4)?.try_into().expect("4 bytes"),
        ))
    };
    inj.syscall(
        "prctl(PR_GET_PDEATHSIG)",
        libc::SYS_prctl,
        &[PR_GET_PDEATHSIG, inj.scratch(0)],
    )?;
    let pdeathsig = int_at(0)?;
    inj.syscall(
        "prctl(PR_GET_CHILD_SUBREAPER)",
        libc::SYS_prctl,
        &[PR_GET_CHILD_SUBREAPER, inj.scratch(8)],
    )?;
    let child_subreaper = int_at(8)? != 0;
    Ok(PrctlState {
        pdeathsig,
        dumpable: inj.syscall(
            "prctl(PR_GET_DUMPABLE)",
            libc::SYS_prctl,
            &[PR_GET_DUMPABLE],
        )? as u32,
        child_subreaper,
        thp_disable: inj.syscall(
            "prctl(PR_GET_THP_DISABLE)",
            libc::SYS_prctl,
            &[PR_GET_THP_DISABLE, 0, 0, 0, 0],
        )? != 0,
        // Older kernels have no MDWE: nothing to keep then.
        mdwe: inj
            .syscall(
                "prctl(PR_GET_MDWE)",
                libc::SYS_prctl,
                &[PR_GET_MDWE, 0, 0, 0, 0],
            )
            .unwrap_or(0) as u32,
    })
}

/// The calls that set prctl attributes; after the credentials, since changing them resets
/// `dumpable`.
fn prctl_calls(p: &Process) -> Vec<Call> {
    let s = &p.prctl;
    let mut calls = Vec::new();
    if s.pdeathsig != 0 {
        calls.push(Call::new(
            "prctl(PR_SET_PDEATHSIG)",
            libc::SYS_prctl,
            &[PR_SET_PDEATHSIG, s.pdeathsig as u64],
        ));
    }
    calls.push(Call::new(
        "prctl(PR_SET_DUMPABLE)",
        libc::SYS_prctl,
        &[PR_SET_DUMPABLE, s.dumpable as u64],
    ));
    if s.child_subreaper {
        calls.push(Call::new(
            "prctl(PR_SET_CHILD_SUBREAPER)",
            libc::SYS_prctl,
            &[PR_SET_CHILD_SUBREAPER, 1],
        ));
    }
    if s.thp_disable {
        calls.push(Call::new(
            "prctl(PR_SET_THP_DISABLE)",
            libc::SYS_prctl,
            &[PR_SET_THP_DISABLE, 1, 0, 0, 0],
        ));
    }
    if s.mdwe != 0 {
        calls.push(Call::new(
            "prctl(PR_SET_MDWE)",
            libc::SYS_prctl,
            &[PR_SET_MDWE, s.mdwe as u64, 0, 0, 0],
        ));
    }
    calls
}

/// Enters the working directory `cwd` (not removed) in the rebuilt process, if it is the one
/// captured.
fn enter_cwd(h: &Husk, p: &Process, cwd: &str, rights: &crate::reopen::Rights<'_>) -> Result<()> {
    let inj = h.injector();
    let pid = h.pid;
    let path = |s: &str| -> Result<u64> {
        let mut b = s.as_bytes().to_vec();
        b.push(0);
        Ok(inj.write_scratch(0, &b)?)
    };
    if let Some(want) = &p.cwd_identity {
        // Looked up by us as the process, without links, and only if it is the directory
        // captured (the rebuilt process still has root's rights when it enters it).
        crate::reopen::open(
            pid,
            "working directory",
            cwd,
            libc::O_PATH | libc::O_DIRECTORY,
            Some(want),
            crate::reopen::Match::Inode,
            rights,
        )?;
    }
    inj.syscall("chdir", libc::SYS_chdir, &[path(cwd)?])
        .map_err(|e| crate::Error::Restore {
            pid,
            what: format!("cannot enter working directory {cwd}: {e}"),
        })?;
    if let Some(want) = &p.cwd_identity {
        // And it is the one it entered (the path may have changed meanwhile).
        let now = std::fs::metadata(format!("/proc/{}/cwd", h.host)).map_err(|e| {
            crate::Error::Restore {
                pid,
                what: format!("stat its working directory {cwd}: {e}"),
            }
        })?;
        if (now.dev(), now.ino()) != (want.dev, want.ino) {
            return Err(crate::Error::Restore {
                pid,
                what: format!(
                    "working directory: {cwd}: not the directory that was captured (inode {} \
                     on device {:#x} now, inode {} on device {:#x} captured); refused",
                    now.ino(),
                    now.dev(),
                    want.ino,
                    want.dev
                ),
            });
        }
    }
    Ok(())
}
