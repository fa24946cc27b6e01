//! Classic BPF filters attached to sockets (SO_ATTACH_FILTER), and their lock
//! (SO_LOCK_FILTER): read back with SO_GET_FILTER at capture, attached again (then locked)
//! once the socket's queue is refilled, since what waits there had passed it already. An eBPF
//! filter (SO_ATTACH_BPF, or a classic one the kernel keeps only as eBPF) cannot be read back
//! this way: refused.

use super::*;

impl Cap<'_> {
    /// The filter attached to the socket, if any.
    pub(super) fn filter(&self) -> Result<Option<SockFilter>> {
        let insns = match sk::get_filter(self.s) {
            Ok(i) => i,
            Err(e) if e.errno == libc::EACCES => {
                return Err(self.refuse(
                    "an eBPF socket filter (SO_ATTACH_BPF) is attached to it, which cannot be \
                     read back (only classic BPF filters can)",
                ))
            }
            Err(e) => return Err(e).ctx(self.pid, || self.what("read its socket filter")),
        };
        if insns.is_empty() {
            return Ok(None);
        }
        let locked = sk::getsockopt_int(self.s, SOL_SOCKET, libc::SO_LOCK_FILTER)
            .ctx(self.pid, || self.what("read SO_LOCK_FILTER"))?
            != 0;
        Ok(Some(SockFilter { insns, locked }))
    }
}

impl Builder<'_> {
    /// Attaches (and locks) the filter of every socket that had one.
    pub(super) fn attach_filters(&self) -> Result<()> {
        for i in 0..self.socks.len() {
            let Some(f) = &self.sock(i).filter else {
                continue;
            };
            let fd = self.fd(i);
            sk::attach_filter(fd, &f.insns)
                .map_err(|e| self.err(i, format!("attach its socket filter: {e}")))?;
            if f.locked {
                sk::setsockopt_int(fd, SOL_SOCKET, libc::SO_LOCK_FILTER, 1)
                    .map_err(|e| self.err(i, format!("lock its socket filter: {e}")))?;
            }
        }
        Ok(())
    }
}
