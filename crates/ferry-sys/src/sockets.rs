//! Sockets: the BSD socket calls on raw addresses, sending and peeking with ancillary data,
//! sock_diag(7) queries about UNIX sockets, and short-lived helper processes that make sockets
//! under a given PID and credentials (which a UNIX socket records as its peer's).
//!
//! Addresses are passed as the raw bytes of a `struct sockaddr_*` (as long as the kernel
//! reported or expects them), so that every family and every UNIX name round-trips exactly.

use crate::{check, SysError, SysResult};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// The largest socket address (`struct sockaddr_storage`).
pub const ADDR_MAX: usize = 128;

pub const SOL_SOCKET: i32 = libc::SOL_SOCKET;
pub const SO_PASSPIDFD: i32 = 76;
pub const SO_PASSRIGHTS: i32 = 83;
pub const SO_INQ: i32 = 84;
pub const SCM_PIDFD: i32 = 0x04;

fn own(fd: libc::c_long) -> OwnedFd {
    // SAFETY: the caller passes a descriptor the kernel just created for us; nobody else owns it.
    unsafe { OwnedFd::from_raw_fd(fd as RawFd) }
}

pub fn socket(domain: i32, ty: i32, protocol: i32) -> SysResult<OwnedFd> {
    // SAFETY: plain integer arguments.
    let r = unsafe { libc::socket(domain, ty, protocol) };
    check("socket", r as libc::c_long).map(own)
}

pub fn socketpair(domain: i32, ty: i32) -> SysResult<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as RawFd; 2];
    // SAFETY: fds has room for the two descriptors.
    let r = unsafe { libc::socketpair(domain, ty, 0, fds.as_mut_ptr()) };
    check("socketpair", r as libc::c_long)?;
    Ok((own(fds[0] as libc::c_long), own(fds[1] as libc::c_long)))
}

/// getsockopt with a buffer of `max` bytes; returns as many bytes as the kernel wrote.
pub fn getsockopt(fd: RawFd, level: i32, name: i32, max: usize) -> SysResult<Vec<u8>> {
    let mut buf = vec![0u8; max];
    let mut len = max as libc::socklen_t;
    // SAFETY: buf has `len` writable bytes; len is a valid in/out pointer.
    let r = unsafe { libc::getsockopt(fd, level, name, buf.as_mut_ptr().cast(), &mut len) };
    check("getsockopt", r as libc::c_long)?;
    buf.truncate((len as usize).min(max));
    Ok(buf)
}

/// The length getsockopt reports when given no buffer at all (for SO_GET_FILTER: the number of
/// instructions of the attached classic filter).
pub fn getsockopt_len(fd: RawFd, level: i32, name: i32) -> SysResult<usize> {
    let mut len: libc::socklen_t = 0;
    // SAFETY: a zero-length buffer: the kernel writes only `len`.
    let r = unsafe { libc::getsockopt(fd, level, name, std::ptr::null_mut(), &mut len) };
    check("getsockopt", r as libc::c_long)?;
    Ok(len as usize)
}

pub fn getsockopt_int(fd: RawFd, level: i32, name: i32) -> SysResult<i32> {
    let b = getsockopt(fd, level, name, 4)?;
    let mut w = [0u8; 4];
    w[..b.len()].copy_from_slice(&b);
    Ok(i32::from_ne_bytes(w))
}

pub fn setsockopt(fd: RawFd, level: i32, name: i32, value: &[u8]) -> SysResult<()> {
    // SAFETY: value is a valid slice of the given length.
    let r = unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            value.as_ptr().cast(),
            value.len() as libc::socklen_t,
        )
    };
    check("setsockopt", r as libc::c_long).map(drop)
}

pub fn setsockopt_int(fd: RawFd, level: i32, name: i32, value: i32) -> SysResult<()> {
    setsockopt(fd, level, name, &value.to_ne_bytes())
}

/// The classic BPF filter attached to a socket (SO_GET_FILTER): its instructions, 8 bytes each
/// (`struct sock_filter`), empty when none is. EACCES for an eBPF filter, which cannot be read
/// this way.
pub fn get_filter(fd: RawFd) -> SysResult<Vec<u8>> {
    let n = getsockopt_len(fd, libc::SOL_SOCKET, libc::SO_ATTACH_FILTER)?;
    if n == 0 {
        return Ok(Vec::new());
    }
    let mut buf = vec![0u8; n * 8];
    // The length is counted in instructions, both ways.
    let mut len = n as libc::socklen_t;
    // SAFETY: buf has room for `len` instructions of 8 bytes; len is a valid in/out pointer.
    let r = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_ATTACH_FILTER,
            buf.as_mut_ptr().cast(),
            &mut len,
        )
    };
    check("getsockopt(SO_GET_FILTER)", r as libc::c_long)?;
    buf.truncate((len as usize).min(n) * 8);
    Ok(buf)
}

/// Attaches the classic BPF filter `insns` (8 bytes per instruction) to a socket
/// (SO_ATTACH_FILTER).
pub fn attach_filter(fd: RawFd, insns: &[u8]) -> SysResult<()> {
    if insns.is_empty() || !insns.len().is_multiple_of(8) || insns.len() / 8 > u16::MAX as usize {
        return Err(SysError::new(
            "SO_ATTACH_FILTER: malformed program",
            libc::EINVAL,
        ));
    }
    let prog = libc::sock_fprog {
        len: (insns.len() / 8) as u16,
        filter: insns.as_ptr() as *mut libc::sock_filter,
    };
    // SAFETY: prog points at `len` instructions of `insns`, which outlives the call (the
    // kernel copies them; it does not write through the pointer).
    let r = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_ATTACH_FILTER,
            (&prog as *const libc::sock_fprog).cast(),
            std::mem::size_of::<libc::sock_fprog>() as libc::socklen_t,
        )
    };
    check("setsockopt(SO_ATTACH_FILTER)", r as libc::c_long).map(drop)
}

fn name_call(
    op: &'static str,
    fd: RawFd,
    f: unsafe extern "C" fn(RawFd, *mut libc::sockaddr, *mut libc::socklen_t) -> libc::c_int,
) -> SysResult<Vec<u8>> {
    let mut buf = [0u8; ADDR_MAX];
    let mut len = ADDR_MAX as libc::socklen_t;
    // SAFETY: buf has `len` writable bytes; f is getsockname or getpeername.
    let r = unsafe { f(fd, buf.as_mut_ptr().cast(), &mut len) };
    check(op, r as libc::c_long)?;
    Ok(buf[..(len as usize).min(ADDR_MAX)].to_vec())
}

/// The raw address the socket is bound to.
pub fn getsockname(fd: RawFd) -> SysResult<Vec<u8>> {
    name_call("getsockname", fd, libc::getsockname)
}

/// The raw address of the socket's peer (ENOTCONN when it has none).
pub fn getpeername(fd: RawFd) -> SysResult<Vec<u8>> {
    name_call("getpeername", fd, libc::getpeername)
}

fn addr_ptr(addr: &[u8]) -> SysResult<libc::sockaddr_storage> {
    if addr.len() > ADDR_MAX {
        return Err(SysError::new("socket address too long", libc::EINVAL));
    }
    // SAFETY: sockaddr_storage is plain old data; all zeroes is a valid value.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    // SAFETY: ss is ADDR_MAX bytes long and addr is at most that.
    unsafe {
        std::ptr::copy_nonoverlapping(
            addr.as_ptr(),
            (&mut ss as *mut libc::sockaddr_storage).cast::<u8>(),
            addr.len(),
        )
    };
    Ok(ss)
}

pub fn bind(fd: RawFd, addr: &[u8]) -> SysResult<()> {
    let ss = addr_ptr(addr)?;
    // SAFETY: ss holds addr.len() valid bytes.
    let r = unsafe {
        libc::bind(
            fd,
            (&ss as *const libc::sockaddr_storage).cast(),
            addr.len() as libc::socklen_t,
        )
    };
    check("bind", r as libc::c_long).map(drop)
}

/// Binds TCP socket `fd` to `addr` although other sockets hold that address, as TCP_REPAIR
/// allows (it needs CAP_NET_ADMIN): in repair mode the kernel marks the socket SK_FORCE_REUSE,
/// and bind() skips its conflict check. Repair mode is left at once; leaving it clears the
/// socket's SO_REUSEADDR (the kernel sets sk_reuse to SK_NO_REUSE), which is then set back to
/// `reuseaddr`.
///
/// Only the bind is forced. listen() checks the address again and fails with EADDRINUSE while
/// another socket listens there; listening inside repair mode would pass, but a listening
/// socket cannot leave repair mode (EPERM), and the connections it accepts inherit it (they
/// can neither send nor receive).
pub fn bind_forced(fd: RawFd, addr: &[u8], reuseaddr: i32) -> SysResult<()> {
    setsockopt_int(fd, libc::IPPROTO_TCP, libc::TCP_REPAIR, 1)?;
    let bound = bind(fd, addr);
    let left = setsockopt_int(fd, libc::IPPROTO_TCP, libc::TCP_REPAIR, 0);
    let reuse = setsockopt_int(fd, libc::SOL_SOCKET, libc::SO_REUSEADDR, reuseaddr);
    bound.and(left).and(reuse)
}

pub fn connect(fd: RawFd, addr: &[u8]) -> SysResult<()> {
    let ss = addr_ptr(addr)?;
    // SAFETY: ss holds addr.len() valid bytes.
    let r = unsafe {
        libc::connect(
            fd,
            (&ss as *const libc::sockaddr_storage).cast(),
            addr.len() as libc::socklen_t,
        )
    };
    check("connect", r as libc::c_long).map(drop)
}

pub fn listen(fd: RawFd, backlog: i32) -> SysResult<()> {
    // SAFETY: plain integer arguments.
    let r = unsafe { libc::listen(fd, backlog) };
    check("listen", r as libc::c_long).map(drop)
}

pub fn accept(fd: RawFd, flags: i32) -> SysResult<OwnedFd> {
    // SAFETY: null address pointers: the peer's address is not wanted.
    let r = unsafe { libc::accept4(fd, std::ptr::null_mut(), std::ptr::null_mut(), flags) };
    check("accept4", r as libc::c_long).map(own)
}

pub fn shutdown(fd: RawFd, how: i32) -> SysResult<()> {
    // SAFETY: plain integer arguments.
    let r = unsafe { libc::shutdown(fd, how) };
    check("shutdown", r as libc::c_long).map(drop)
}

/// The events among `events` that are ready on `fd` right now (poll with no timeout).
pub fn poll_now(fd: RawFd, events: i16) -> SysResult<i16> {
    poll_wait(fd, events, 0)
}

/// The events among `events` that are ready on `fd`, waiting up to `timeout_ms` for one
/// (0 when none came).
pub fn poll_wait(fd: RawFd, events: i16, timeout_ms: i32) -> SysResult<i16> {
    let mut p = libc::pollfd {
        fd,
        events,
        revents: 0,
    };
    // SAFETY: p is one valid pollfd.
    let r = unsafe { libc::poll(&mut p, 1, timeout_ms) };
    check("poll", r as libc::c_long)?;
    Ok(p.revents)
}

/// recv(2) of up to `max` bytes (no address, no control messages) appended to `v`, into its
/// spare capacity: nothing is zeroed first. Returns the bytes received (0: end of file).
pub fn recv_append(fd: RawFd, v: &mut Vec<u8>, max: usize, flags: i32) -> SysResult<usize> {
    v.reserve(max);
    let spare = v.spare_capacity_mut();
    // SAFETY: spare points at at least `max` bytes of v's allocation, which recv only writes.
    let r = unsafe { libc::recv(fd, spare.as_mut_ptr().cast(), max, flags) };
    let n = check("recv", r as libc::c_long)? as usize;
    // (With MSG_TRUNC the kernel answers the message's whole length, which may be more.)
    let n = n.min(max);
    // SAFETY: recv initialised the first n (<= max) bytes of the spare capacity.
    unsafe { v.set_len(v.len() + n) };
    Ok(n)
}

/// The length of the next message waiting in datagram or seqpacket socket `fd` (which stays
/// there): recv(MSG_PEEK | MSG_TRUNC) of nothing. EAGAIN when none waits.
pub fn next_message_len(fd: RawFd) -> SysResult<usize> {
    let flags = libc::MSG_PEEK | libc::MSG_TRUNC | libc::MSG_DONTWAIT;
    // SAFETY: a zero-length buffer: recv writes nothing.
    let r = unsafe { libc::recv(fd, std::ptr::null_mut(), 0, flags) };
    check("recv", r as libc::c_long).map(|n| n as usize)
}

/// ioctl(SIOCINQ/SIOCOUTQ/...) returning an int.
pub fn ioctl_int(fd: RawFd, req: libc::c_ulong) -> SysResult<i32> {
    let mut n: libc::c_int = 0;
    // SAFETY: the requests used here write one int.
    let r = unsafe { libc::ioctl(fd, req, &mut n) };
    check("ioctl", r as libc::c_long)?;
    Ok(n)
}

/// Sends `data` (to `to` when given), with descriptors `rights` attached as SCM_RIGHTS.
pub fn send(
    fd: RawFd,
    data: &[u8],
    to: Option<&[u8]>,
    rights: &[RawFd],
    flags: i32,
) -> SysResult<usize> {
    let ss = addr_ptr(to.unwrap_or(&[]))?;
    let mut iov = libc::iovec {
        iov_base: data.as_ptr() as *mut libc::c_void,
        iov_len: data.len(),
    };
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of_val(rights) as u32) } as usize;
    let mut control = vec![0u64; space.div_ceil(8)];
    // SAFETY: msghdr is plain old data; all zeroes is a valid value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if let Some(to) = to {
        msg.msg_name = (&ss as *const libc::sockaddr_storage) as *mut libc::c_void;
        msg.msg_namelen = to.len() as libc::socklen_t;
    }
    if !rights.is_empty() {
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = space;
        // SAFETY: the control buffer is CMSG_SPACE(rights) bytes, aligned, so the first header
        // and its data fit in it.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of_val(rights) as u32) as usize;
            std::ptr::copy_nonoverlapping(
                rights.as_ptr(),
                libc::CMSG_DATA(c).cast::<RawFd>(),
                rights.len(),
            );
        }
    }
    // SAFETY: msg points at iov, ss and control, which all outlive the call.
    let r = unsafe { libc::sendmsg(fd, &msg, flags) };
    check("sendmsg", r as libc::c_long).map(|n| n as usize)
}

/// Sends `data` on a connected socket with SCM_CREDENTIALS `creds` (pid, uid, gid): what a
/// receiver with SO_PASSCRED reads as its sender instead of us (we need CAP_SYS_ADMIN for
/// another PID, CAP_SETUID and CAP_SETGID for other ids; the PID must exist: ESRCH).
pub fn send_as(fd: RawFd, data: &[u8], creds: (i32, u32, u32), flags: i32) -> SysResult<usize> {
    let mut iov = libc::iovec {
        iov_base: data.as_ptr() as *mut libc::c_void,
        iov_len: data.len(),
    };
    let ucred = libc::ucred {
        pid: creds.0,
        uid: creds.1,
        gid: creds.2,
    };
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<libc::ucred>() as u32) } as usize;
    let mut control = vec![0u64; space.div_ceil(8)];
    // SAFETY: msghdr is plain old data; all zeroes is a valid value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space;
    // SAFETY: the control buffer is CMSG_SPACE(ucred) bytes, aligned, so the first header and
    // its data fit in it.
    unsafe {
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_CREDENTIALS;
        (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<libc::ucred>() as u32) as usize;
        std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<libc::ucred>(), ucred);
    }
    // SAFETY: msg points at iov and control, which both outlive the call.
    let r = unsafe { libc::sendmsg(fd, &msg, flags) };
    check("sendmsg", r as libc::c_long).map(|n| n as usize)
}

/// One message (or chunk of a stream) as recvmsg returned it.
#[derive(Debug, Default)]
pub struct Received {
    pub data: Vec<u8>,
    /// The sender's raw address (empty when the socket gives none).
    pub from: Vec<u8>,
    /// Descriptors that came with it (SCM_RIGHTS).
    pub rights: Vec<OwnedFd>,
    /// The sender's pidfd (SCM_PIDFD, with SO_PASSPIDFD).
    pub pidfds: Vec<OwnedFd>,
    /// SCM_CREDENTIALS: pid, uid, gid.
    pub creds: Option<(i32, u32, u32)>,
    /// MSG_TRUNC, MSG_CTRUNC ...
    pub flags: i32,
}

/// recvmsg of at most `max` bytes with `flags` (MSG_PEEK, MSG_DONTWAIT ...), collecting the
/// sender's address and ancillary data.
pub fn recv(fd: RawFd, max: usize, flags: i32) -> SysResult<Received> {
    let mut data = vec![0u8; max];
    let mut ss = addr_ptr(&[])?;
    let mut control = vec![0u64; 512];
    let mut iov = libc::iovec {
        iov_base: data.as_mut_ptr().cast(),
        iov_len: max,
    };
    // SAFETY: msghdr is plain old data; all zeroes is a valid value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_name = (&mut ss as *mut libc::sockaddr_storage).cast();
    msg.msg_namelen = ADDR_MAX as libc::socklen_t;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = control.len() * 8;
    // SAFETY: msg points at data, ss and control, which all outlive the call.
    let r = unsafe { libc::recvmsg(fd, &mut msg, flags | libc::MSG_CMSG_CLOEXEC) };
    let n = check("recvmsg", r as libc::c_long)? as usize;
    data.truncate(n.min(max));
    let mut out = Received {
        data,
        flags: msg.msg_flags,
        ..Default::default()
    };
    let namelen = (msg.msg_namelen as usize).min(ADDR_MAX);
    // SAFETY: ss is ADDR_MAX bytes; the kernel wrote namelen of them.
    let name = unsafe {
        std::slice::from_raw_parts((&ss as *const libc::sockaddr_storage).cast::<u8>(), namelen)
    };
    out.from = name.to_vec();
    // SAFETY: the kernel filled the control buffer with well-formed headers, which the CMSG
    // macros walk within msg_controllen.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            let len = (*c).cmsg_len - (libc::CMSG_DATA(c) as usize - c as usize);
            let level = (*c).cmsg_level;
            let ty = (*c).cmsg_type;
            if level == libc::SOL_SOCKET && (ty == libc::SCM_RIGHTS || ty == SCM_PIDFD) {
                let n = len / std::mem::size_of::<RawFd>();
                let p = libc::CMSG_DATA(c).cast::<RawFd>();
                for i in 0..n {
                    let fd = own(p.add(i).read_unaligned() as libc::c_long);
                    if ty == libc::SCM_RIGHTS {
                        out.rights.push(fd);
                    } else {
                        out.pidfds.push(fd);
                    }
                }
            } else if level == libc::SOL_SOCKET && ty == libc::SCM_CREDENTIALS {
                let u = libc::CMSG_DATA(c).cast::<libc::ucred>().read_unaligned();
                out.creds = Some((u.pid, u.uid, u.gid));
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    Ok(out)
}

// ---- sock_diag(7) for UNIX sockets ----

const NETLINK_SOCK_DIAG: i32 = 4;
const SOCK_DIAG_BY_FAMILY: u16 = 20;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLM_F_REQUEST: u16 = 1;
const NLM_F_DUMP: u16 = 0x300;

pub const UDIAG_SHOW_NAME: u32 = 0x01;
pub const UDIAG_SHOW_VFS: u32 = 0x02;
pub const UDIAG_SHOW_PEER: u32 = 0x04;
pub const UDIAG_SHOW_ICONS: u32 = 0x08;
pub const UDIAG_SHOW_RQLEN: u32 = 0x10;
pub const UDIAG_SHOW_ALL: u32 = 0x1f;

/// What sock_diag reports about one UNIX socket.
#[derive(Debug, Clone, Default)]
pub struct UnixDiag {
    pub ino: u32,
    pub sock_type: u8,
    /// TCP_ESTABLISHED (1), TCP_CLOSE (7) or TCP_LISTEN (10).
    pub state: u8,
    /// The bound name (sun_path bytes, a leading NUL for abstract names).
    pub name: Option<Vec<u8>>,
    /// The socket file it is bound to: (inode, device).
    pub vfs: Option<(u32, u32)>,
    /// The peer's inode (0 when the peer has no file: closed, or not yet accepted).
    pub peer: Option<u32>,
    /// For a listening socket: the inodes of the clients whose connections wait in its queue.
    pub icons: Vec<u32>,
    /// Queued bytes (for a listener: pending connections) and, for a listener, its backlog;
    /// for other sockets the bytes this socket has sent that its peer has not read yet.
    pub rqlen: Option<(u32, u32)>,
    /// RCV_SHUTDOWN (1) | SEND_SHUTDOWN (2).
    pub shutdown: u8,
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    b.get(at..at + 4)
        .map(|s| u32::from_ne_bytes(s.try_into().expect("4 bytes")))
        .unwrap_or(0)
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    b.get(at..at + 2)
        .map(|s| u16::from_ne_bytes(s.try_into().expect("2 bytes")))
        .unwrap_or(0)
}

/// Opens a sock_diag socket and sends it one request of type `ty` with `flags`: a netlink
/// header (sequence 1, to the kernel) and then `body`, the request's own struct.
fn sock_diag_request(ty: u16, flags: u16, body: &[u8]) -> SysResult<OwnedFd> {
    let nl = socket(
        libc::AF_NETLINK,
        libc::SOCK_DGRAM | libc::SOCK_CLOEXEC,
        NETLINK_SOCK_DIAG,
    )?;
    let mut req = Vec::with_capacity(16 + body.len());
    req.extend_from_slice(&(16 + body.len() as u32).to_ne_bytes());
    req.extend_from_slice(&ty.to_ne_bytes());
    req.extend_from_slice(&flags.to_ne_bytes());
    req.extend_from_slice(&1u32.to_ne_bytes()); // seq
    req.extend_from_slice(&0u32.to_ne_bytes()); // port id
    req.extend_from_slice(body);
    send(nl.as_raw_fd(), &req, None, &[], 0)?;
    Ok(nl)
}

/// Reads the answers to a sock_diag request sent on `nl` and calls `each` with the payload of
/// every SOCK_DIAG_BY_FAMILY message (the family's struct, then its attributes), until the
/// kernel says it is done. `single`: the request named one socket (no dump): its one reply is
/// all, and ENOENT (no such socket) means none rather than an error.
fn sock_diag_replies(nl: &OwnedFd, single: bool, mut each: impl FnMut(&[u8])) -> SysResult<()> {
    loop {
        let got = recv(nl.as_raw_fd(), 1 << 16, 0)?;
        let b = &got.data;
        if b.is_empty() {
            return Ok(());
        }
        let mut at = 0;
        while at + 16 <= b.len() {
            let len = u32_at(b, at) as usize;
            let ty = u16_at(b, at + 4);
            if len < 16 || at + len > b.len() {
                return Err(SysError::new("sock_diag: malformed reply", libc::EPROTO));
            }
            let payload = &b[at + 16..at + len];
            match ty {
                NLMSG_DONE => return Ok(()),
                NLMSG_ERROR => {
                    return match -(u32_at(payload, 0) as i32) {
                        0 => Ok(()),
                        libc::ENOENT if single => Ok(()),
                        e => Err(SysError::new("sock_diag", e)),
                    };
                }
                SOCK_DIAG_BY_FAMILY => each(payload),
                _ => {}
            }
            at += (len + 3) & !3;
        }
        if single {
            return Ok(());
        }
    }
}

/// Calls `each` with the type (less its nested and byte-order flags) and the value of every
/// netlink attribute of `p` from offset `at` on, stopping at one that is malformed.
fn for_each_attr(p: &[u8], mut at: usize, mut each: impl FnMut(u16, &[u8])) {
    while at + 4 <= p.len() {
        let len = u16_at(p, at) as usize;
        if len < 4 || at + len > p.len() {
            break;
        }
        each(u16_at(p, at + 2) & 0x3fff, &p[at + 4..at + len]);
        at += (len + 3) & !3;
    }
}

fn parse_unix_diag(p: &[u8]) -> UnixDiag {
    let mut d = UnixDiag {
        sock_type: p.get(1).copied().unwrap_or(0),
        state: p.get(2).copied().unwrap_or(0),
        ino: u32_at(p, 4),
        ..Default::default()
    };
    for_each_attr(p, 16, |ty, v| match ty {
        0 => d.name = Some(v.to_vec()),
        1 => d.vfs = Some((u32_at(v, 0), u32_at(v, 4))),
        2 => d.peer = Some(u32_at(v, 0)),
        3 => d.icons = v.chunks_exact(4).map(|c| u32_at(c, 0)).collect(),
        4 => d.rqlen = Some((u32_at(v, 0), u32_at(v, 4))),
        6 => d.shutdown = v.first().copied().unwrap_or(0),
        _ => {}
    });
    d
}

/// Asks sock_diag about the UNIX socket with inode `ino` (`None` if there is none), or, with
/// `ino` = `None`, about every UNIX socket of our network namespace.
pub fn unix_diag(ino: Option<u32>, show: u32) -> SysResult<Vec<UnixDiag>> {
    // struct unix_diag_req: family, protocol, pad, states, inode, what to show, cookie.
    let mut req = Vec::with_capacity(24);
    req.extend_from_slice(&[libc::AF_UNIX as u8, 0, 0, 0]);
    req.extend_from_slice(&u32::MAX.to_ne_bytes()); // all states
    req.extend_from_slice(&ino.unwrap_or(0).to_ne_bytes());
    req.extend_from_slice(&show.to_ne_bytes());
    req.extend_from_slice(&u32::MAX.to_ne_bytes()); // no cookie
    req.extend_from_slice(&u32::MAX.to_ne_bytes());
    let flags = NLM_F_REQUEST | if ino.is_none() { NLM_F_DUMP } else { 0 };
    let nl = sock_diag_request(SOCK_DIAG_BY_FAMILY, flags, &req)?;
    let mut out = Vec::new();
    sock_diag_replies(&nl, ino.is_some(), |p| out.push(parse_unix_diag(p)))?;
    Ok(out)
}

/// What sock_diag says a socket of `family` and `protocol` (IPPROTO_UDP, IPPROTO_TCP ...) with
/// inode `ino` has shut down (INET_DIAG_SHUTDOWN: RCV_SHUTDOWN 1 | SEND_SHUTDOWN 2), among the
/// sockets of our network namespace; `None` when it is not found.
pub fn inet_diag_shutdown(family: i32, protocol: i32, ino: u64) -> SysResult<Option<u8>> {
    const INET_DIAG_SHUTDOWN: u16 = 8;
    // struct inet_diag_req_v2: family, protocol, extensions, pad, states; then a zero sockid.
    let mut req = Vec::with_capacity(56);
    req.extend_from_slice(&[family as u8, protocol as u8, 0, 0]);
    req.extend_from_slice(&u32::MAX.to_ne_bytes());
    req.extend_from_slice(&[0u8; 40]);
    req.extend_from_slice(&u32::MAX.to_ne_bytes()); // no cookie
    req.extend_from_slice(&u32::MAX.to_ne_bytes());
    let nl = sock_diag_request(SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP, &req)?;
    let mut found = None;
    sock_diag_replies(&nl, false, |p| {
        // struct inet_diag_msg (72 bytes, idiag_inode at 68), then attributes.
        if p.len() >= 72 && u64::from(u32_at(p, 68)) == ino {
            let mut shut = 0;
            for_each_attr(p, 72, |ty, v| {
                if ty == INET_DIAG_SHUTDOWN {
                    shut = v.first().copied().unwrap_or(0);
                }
            });
            found = Some(shut);
        }
    })?;
    Ok(found)
}

/// The name of network interface `index` in our network namespace.
pub fn interface_name(index: u32) -> SysResult<String> {
    let mut buf = [0 as libc::c_char; libc::IF_NAMESIZE];
    // SAFETY: buf has IF_NAMESIZE bytes, as if_indextoname requires.
    let r = unsafe { libc::if_indextoname(index, buf.as_mut_ptr()) };
    if r.is_null() {
        return Err(SysError::last("if_indextoname"));
    }
    // SAFETY: on success the buffer holds a NUL-terminated name.
    let name = unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) };
    Ok(name.to_string_lossy().into_owned())
}

/// The index of network interface `name` in our network namespace.
pub fn interface_index(name: &str) -> SysResult<u32> {
    let c = std::ffi::CString::new(name)
        .map_err(|_| SysError::new("if_nametoindex: a NUL in the name", libc::EINVAL))?;
    // SAFETY: c is a NUL-terminated string.
    let r = unsafe { libc::if_nametoindex(c.as_ptr()) };
    if r == 0 {
        return Err(SysError::last("if_nametoindex"));
    }
    Ok(r)
}

/// What sock_diag says of a packet socket beyond what getsockopt can read.
#[derive(Debug, Clone, Default)]
pub struct PacketDiag {
    /// The receive ring (PACKET_RX_RING), if one is set up.
    pub rx_ring: Option<PacketRingReq>,
    /// The transmit ring (PACKET_TX_RING), if one is set up.
    pub tx_ring: Option<PacketRingReq>,
    /// Memberships taken with PACKET_ADD_MEMBERSHIP.
    pub mclist: Vec<PacketMc>,
}

/// A ring's geometry as sock_diag reports it (`struct packet_diag_ring`), the fields of
/// `struct tpacket_req3` in the same order.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PacketRingReq {
    pub block_size: u32,
    pub block_nr: u32,
    pub frame_size: u32,
    pub frame_nr: u32,
    pub retire_tmo: u32,
    pub sizeof_priv: u32,
    pub features: u32,
}

impl PacketRingReq {
    /// The bytes of the ring in a mapping of the socket.
    pub fn bytes(&self) -> usize {
        self.block_size as usize * self.block_nr as usize
    }

    /// `struct tpacket_req` (TPACKET_V1, V2) or `struct tpacket_req3` (V3), for setsockopt.
    pub fn to_setsockopt(&self, v3: bool) -> Vec<u8> {
        let mut f = vec![
            self.block_size,
            self.block_nr,
            self.frame_size,
            self.frame_nr,
        ];
        if v3 {
            f.extend([self.retire_tmo, self.sizeof_priv, self.features]);
        }
        f.iter().flat_map(|x| x.to_ne_bytes()).collect()
    }
}

/// One membership of a packet socket (`struct packet_diag_mclist`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PacketMc {
    pub ifindex: u32,
    /// How many times it was added.
    pub count: u32,
    /// PACKET_MR_MULTICAST, PACKET_MR_PROMISC, PACKET_MR_ALLMULTI, PACKET_MR_UNICAST.
    pub mr_type: u16,
    /// The address (as long as its `alen`).
    pub addr: Vec<u8>,
}

/// A shared mapping of a descriptor in this process (a packet socket's rings), unmapped when
/// dropped. The kernel may write into it at any time: it is read and written by copies only.
pub struct SharedMap {
    ptr: *mut u8,
    len: usize,
}

impl SharedMap {
    /// Maps `len` bytes of `fd` from offset 0, shared, readable (and writable if asked).
    pub fn new(fd: RawFd, len: usize, writable: bool) -> SysResult<SharedMap> {
        let prot = libc::PROT_READ | if writable { libc::PROT_WRITE } else { 0 };
        // SAFETY: a new mapping chosen by the kernel; nothing else refers to its range.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, libc::MAP_SHARED, fd, 0) };
        if p == libc::MAP_FAILED {
            return Err(SysError::last("mmap (MAP_SHARED)"));
        }
        Ok(SharedMap { ptr: p.cast(), len })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Copies `buf.len()` bytes from `offset` (panics past the end).
    pub fn read(&self, offset: usize, buf: &mut [u8]) {
        assert!(offset + buf.len() <= self.len, "read past a shared mapping");
        // SAFETY: the range is inside the mapping, which lives as long as self; the bytes are
        // copied (the kernel may change them meanwhile, which only makes the copy stale).
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(offset), buf.as_mut_ptr(), buf.len()) }
    }

    /// Copies `data` to `offset` (panics past the end; the mapping must be writable).
    pub fn write(&self, offset: usize, data: &[u8]) {
        assert!(
            offset + data.len() <= self.len,
            "write past a shared mapping"
        );
        // SAFETY: the range is inside the mapping, writable when made so (a write to a
        // read-only one faults, as any would).
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.add(offset), data.len()) }
    }

    /// The aligned 32-bit word at `offset`, read once (the kernel writes frame status words).
    pub fn load_u32(&self, offset: usize) -> u32 {
        assert!(
            offset.is_multiple_of(4) && offset + 4 <= self.len,
            "bad word offset"
        );
        // SAFETY: aligned, inside the mapping.
        unsafe { std::ptr::read_volatile(self.ptr.add(offset).cast::<u32>()) }
    }

    /// Writes the aligned 32-bit word at `offset` at once.
    pub fn store_u32(&self, offset: usize, v: u32) {
        assert!(
            offset.is_multiple_of(4) && offset + 4 <= self.len,
            "bad word offset"
        );
        // SAFETY: aligned, inside the mapping.
        unsafe { std::ptr::write_volatile(self.ptr.add(offset).cast::<u32>(), v) }
    }
}

impl Drop for SharedMap {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, unmapped once.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// The `struct packet_diag_ring` (seven 32-bit words) that attribute value `v` holds.
fn ring_at(v: &[u8]) -> Option<PacketRingReq> {
    if v.len() < 28 {
        return None;
    }
    let w = |i: usize| u32_at(v, 4 * i);
    Some(PacketRingReq {
        block_size: w(0),
        block_nr: w(1),
        frame_size: w(2),
        frame_nr: w(3),
        retire_tmo: w(4),
        sizeof_priv: w(5),
        features: w(6),
    })
}

/// Asks sock_diag about the packet socket with inode `ino` among those of our network
/// namespace; `None` when it is not found.
pub fn packet_diag(ino: u64) -> SysResult<Option<PacketDiag>> {
    const PACKET_SHOW_MCLIST: u32 = 2;
    const PACKET_SHOW_RING_CFG: u32 = 4;
    const PACKET_DIAG_MCLIST: u16 = 1;
    const PACKET_DIAG_RX_RING: u16 = 2;
    const PACKET_DIAG_TX_RING: u16 = 3;
    // struct packet_diag_req: family, protocol, pad, inode, what to show, cookie.
    let mut req = Vec::with_capacity(20);
    req.extend_from_slice(&[libc::AF_PACKET as u8, 0, 0, 0]);
    req.extend_from_slice(&(ino as u32).to_ne_bytes());
    req.extend_from_slice(&(PACKET_SHOW_MCLIST | PACKET_SHOW_RING_CFG).to_ne_bytes());
    req.extend_from_slice(&u32::MAX.to_ne_bytes());
    req.extend_from_slice(&u32::MAX.to_ne_bytes());
    let nl = sock_diag_request(SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP, &req)?;
    let mut found = None;
    sock_diag_replies(&nl, false, |p| {
        // struct packet_diag_msg (16 bytes, pdiag_ino at 4), then attributes.
        if p.len() >= 16 && u64::from(u32_at(p, 4)) == ino {
            let mut d = PacketDiag::default();
            for_each_attr(p, 16, |ty, v| match ty {
                PACKET_DIAG_RX_RING => d.rx_ring = ring_at(v),
                PACKET_DIAG_TX_RING => d.tx_ring = ring_at(v),
                // struct packet_diag_mclist: 44 bytes each.
                PACKET_DIAG_MCLIST => {
                    d.mclist = v
                        .chunks_exact(44)
                        .map(|m| {
                            let alen = (u16_at(m, 10) as usize).min(32);
                            PacketMc {
                                ifindex: u32_at(m, 0),
                                count: u32_at(m, 4),
                                mr_type: u16_at(m, 8),
                                addr: m[12..12 + alen].to_vec(),
                            }
                        })
                        .collect()
                }
                _ => {}
            });
            found = Some(d);
        }
    })?;
    Ok(found)
}

/// Closes, with a reset (SOCK_DESTROY, sock_diag(7); CONFIG_INET_DIAG_DESTROY, CAP_NET_ADMIN),
/// the TCP socket of our network namespace bound to `local` and connected to `peer` (raw
/// socket addresses, as bind(2) takes them, of one family): a connection no descriptor holds
/// any more (an orphan, in FIN_WAIT2 after close) can be reached no other way.
pub fn tcp_destroy(local: &[u8], peer: &[u8]) -> SysResult<()> {
    const SOCK_DESTROY: u16 = 21;
    const NLM_F_ACK: u16 = 4;
    let einval = || SysError::new("tcp_destroy: not an IPv4 or IPv6 address", libc::EINVAL);
    // (family, port in network order, address as four 32-bit words in network order)
    let parse = |a: &[u8]| -> SysResult<(u16, [u8; 2], [u8; 16])> {
        let family = u16_at(a, 0);
        let port = [*a.get(2).ok_or_else(einval)?, *a.get(3).ok_or_else(einval)?];
        let mut addr = [0u8; 16];
        match i32::from(family) {
            libc::AF_INET => addr[..4].copy_from_slice(a.get(4..8).ok_or_else(einval)?),
            libc::AF_INET6 => addr.copy_from_slice(a.get(8..24).ok_or_else(einval)?),
            _ => return Err(einval()),
        }
        Ok((family, port, addr))
    };
    let (family, sport, src) = parse(local)?;
    let (pfamily, dport, dst) = parse(peer)?;
    if family != pfamily {
        return Err(einval());
    }
    // struct inet_diag_req_v2
    let mut req = Vec::with_capacity(56);
    req.extend_from_slice(&[family as u8, libc::IPPROTO_TCP as u8, 0, 0]);
    req.extend_from_slice(&u32::MAX.to_ne_bytes()); // any state
                                                    // struct inet_diag_sockid
    req.extend_from_slice(&sport);
    req.extend_from_slice(&dport);
    req.extend_from_slice(&src);
    req.extend_from_slice(&dst);
    req.extend_from_slice(&0u32.to_ne_bytes()); // any interface
    req.extend_from_slice(&u32::MAX.to_ne_bytes()); // no cookie
    req.extend_from_slice(&u32::MAX.to_ne_bytes());
    let nl = sock_diag_request(SOCK_DESTROY, NLM_F_REQUEST | NLM_F_ACK, &req)?;
    let got = recv(nl.as_raw_fd(), 1 << 12, 0)?;
    let b = &got.data;
    if b.len() >= 20 && u16_at(b, 4) == NLMSG_ERROR {
        return match -(u32_at(b, 16) as i32) {
            0 => Ok(()),
            e => Err(SysError::new("sock_diag SOCK_DESTROY", e)),
        };
    }
    Err(SysError::new(
        "sock_diag SOCK_DESTROY: no answer",
        libc::EPROTO,
    ))
}

// ---- helper processes ----

/// Credentials for a helper process to take before it acts.
#[derive(Debug, Clone, Default)]
pub struct HelperCred {
    pub uid: u32,
    pub gid: u32,
    pub groups: Vec<u32>,
}

/// One thing a helper process does. Descriptors are shared with the caller.
#[derive(Debug, Clone, Copy)]
pub enum HelperOp<'a> {
    /// socketpair(AF_UNIX, ty); results: the two new descriptors.
    SocketPair {
        ty: i32,
    },
    Listen {
        fd: RawFd,
        backlog: i32,
    },
    Connect {
        fd: RawFd,
        addr: &'a [u8],
    },
    Bind {
        fd: RawFd,
        addr: &'a [u8],
    },
    /// chdir (NUL-terminated path), for binding a relative name.
    Chdir {
        path: &'a [u8],
    },
}

const PR_SET_SECUREBITS: libc::c_int = 28;
const SECBIT_NO_SETUID_FIXUP: libc::c_ulong = 1 << 2;

/// What one helper operation did.
#[derive(Debug, Default)]
pub struct HelperResult {
    /// 0, or the errno the operation failed with.
    pub errno: i32,
    /// The two descriptors `SocketPair` made.
    pub fds: Option<(OwnedFd, OwnedFd)>,
}

/// Runs `ops` in order in a short-lived child process that shares our descriptor table: under
/// PID `pid` if given, and with credentials `cred` if given (it keeps its capabilities). The
/// child exits before this returns, so `pid` is free again.
///
/// Returns `Ok(None)` if `pid` is taken, else one result per op.
pub fn run_as(
    pid: Option<i32>,
    cred: Option<&HelperCred>,
    ops: &[HelperOp],
) -> SysResult<Option<Vec<HelperResult>>> {
    let raw = run_as_raw(pid, cred, ops)?;
    Ok(raw.map(|v| {
        v.into_iter()
            .zip(ops)
            .map(|(r, op)| {
                if r[0] < 0 {
                    HelperResult {
                        errno: (-r[0]) as i32,
                        fds: None,
                    }
                } else if let HelperOp::SocketPair { .. } = op {
                    HelperResult {
                        errno: 0,
                        // The helper made these two descriptors in our (shared) table; nobody
                        // else knows them.
                        fds: Some((own(r[0] as libc::c_long), own(r[1] as libc::c_long))),
                    }
                } else {
                    HelperResult::default()
                }
            })
            .collect()
    }))
}

fn run_as_raw(
    pid: Option<i32>,
    cred: Option<&HelperCred>,
    ops: &[HelperOp],
) -> SysResult<Option<Vec<[i64; 2]>>> {
    for op in ops {
        if let HelperOp::Chdir { path } = op {
            if path.last() != Some(&0) {
                return Err(SysError::new(
                    "helper chdir (path not terminated)",
                    libc::EINVAL,
                ));
            }
        }
    }
    let size = (ops.len() * 16 + 16).next_multiple_of(4096);
    // SAFETY: a fresh shared anonymous mapping of `size` bytes, unmapped below.
    let shared = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            size,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if shared == libc::MAP_FAILED {
        return Err(SysError::last("mmap (helper results)"));
    }
    let results = shared.cast::<i64>();
    let tids = [pid.unwrap_or(0) as libc::pid_t];
    let args = crate::clone3::CloneArgs {
        flags: libc::CLONE_FILES as u64,
        exit_signal: libc::SIGCHLD as u64,
        set_tid: if pid.is_some() {
            tids.as_ptr() as u64
        } else {
            0
        },
        set_tid_size: u64::from(pid.is_some()),
        ..Default::default()
    };
    let groups: Vec<libc::gid_t> = cred.map(|c| c.groups.clone()).unwrap_or_default();
    // SAFETY: clone3 without CLONE_VM is a fork; args and tids outlive the call. The child
    // runs only raw system calls on memory that was set up before (no allocation, no locks),
    // writes to the shared mapping and exits.
    let child = unsafe {
        libc::syscall(
            libc::SYS_clone3,
            &args as *const crate::clone3::CloneArgs,
            std::mem::size_of::<crate::clone3::CloneArgs>(),
        )
    };
    if child == 0 {
        // SAFETY: in the child, see above; `results` has room for every op.
        unsafe { helper_child(cred, &groups, ops, results) };
    }
    let outcome = if child < 0 {
        let e = SysError::last("clone3 (socket helper)");
        if e.errno == libc::EEXIST {
            Ok(None)
        } else {
            Err(e)
        }
    } else {
        let mut status = 0;
        // SAFETY: status is a valid out-pointer; child is our child.
        let r = unsafe { libc::waitpid(child as libc::pid_t, &mut status, 0) };
        if r < 0 {
            Err(SysError::last("waitpid (socket helper)"))
        } else if !libc::WIFEXITED(status) || libc::WEXITSTATUS(status) != 0 {
            // SAFETY: the child wrote the failing errno to the first word before exiting.
            let e = unsafe { results.read() };
            Err(SysError::new(
                "socket helper: set credentials",
                if e < 0 { (-e) as i32 } else { libc::EIO },
            ))
        } else {
            let mut out = Vec::with_capacity(ops.len());
            for i in 0..ops.len() {
                // SAFETY: the child wrote two words per op after the first two.
                let (a, b) =
                    unsafe { (results.add(2 + 2 * i).read(), results.add(3 + 2 * i).read()) };
                out.push([a, b]);
            }
            Ok(Some(out))
        }
    };
    // SAFETY: shared is the mapping of `size` bytes made above.
    unsafe { libc::munmap(shared, size) };
    outcome
}

/// The body of a helper process: never returns.
///
/// # Safety
/// Must run in a freshly forked child only; `results` must have room for `2 + 2 * ops.len()`
/// words.
unsafe fn helper_child(
    cred: Option<&HelperCred>,
    groups: &[libc::gid_t],
    ops: &[HelperOp],
    results: *mut i64,
) -> ! {
    let fail = |_: libc::c_long| -> ! {
        // SAFETY: errno of this (only) thread; results has room for the first word; _exit
        // ends only this child.
        unsafe {
            results.write(-(*libc::__errno_location() as i64));
            libc::_exit(1)
        }
    };
    if let Some(c) = cred {
        // SAFETY: raw system calls with plain arguments or pointers to live memory.
        unsafe {
            // Keep every capability across the change of user ID.
            libc::syscall(
                libc::SYS_prctl,
                PR_SET_SECUREBITS,
                SECBIT_NO_SETUID_FIXUP,
                0,
                0,
                0,
            );
            let r = libc::syscall(libc::SYS_setgroups, groups.len(), groups.as_ptr());
            if r < 0 {
                fail(r);
            }
            let r = libc::syscall(libc::SYS_setresgid, c.gid, c.gid, c.gid);
            if r < 0 {
                fail(r);
            }
            let r = libc::syscall(libc::SYS_setresuid, c.uid, c.uid, c.uid);
            if r < 0 {
                fail(r);
            }
        }
    }
    for (i, op) in ops.iter().enumerate() {
        let mut out = [0i64; 2];
        // SAFETY: raw system calls with plain arguments or pointers to live memory.
        let r = unsafe {
            match *op {
                HelperOp::SocketPair { ty } => {
                    let mut fds = [0 as libc::c_int; 2];
                    let r =
                        libc::syscall(libc::SYS_socketpair, libc::AF_UNIX, ty, 0, fds.as_mut_ptr());
                    out = [fds[0] as i64, fds[1] as i64];
                    r
                }
                HelperOp::Listen { fd, backlog } => libc::syscall(libc::SYS_listen, fd, backlog),
                HelperOp::Connect { fd, addr } => {
                    libc::syscall(libc::SYS_connect, fd, addr.as_ptr(), addr.len())
                }
                HelperOp::Bind { fd, addr } => {
                    libc::syscall(libc::SYS_bind, fd, addr.as_ptr(), addr.len())
                }
                HelperOp::Chdir { path } => libc::syscall(libc::SYS_chdir, path.as_ptr()),
            }
        };
        if r < 0 {
            // SAFETY: errno of this (only) thread.
            out = [-(unsafe { *libc::__errno_location() } as i64), 0];
        }
        // SAFETY: results has room for two words per op after the first two.
        unsafe {
            results.add(2 + 2 * i).write(out[0]);
            results.add(3 + 2 * i).write(out[1]);
        }
    }
    // SAFETY: _exit ends only this child.
    unsafe { libc::_exit(0) }
}

// ---- TCP repair mode (TCP_REPAIR, tcp(7); needs CAP_NET_ADMIN) ----

/// TCP_REPAIR values: on, off (the kernel then sends a window probe), and off without the
/// probe.
pub const TCP_REPAIR_ON: i32 = 1;
pub const TCP_REPAIR_OFF: i32 = 0;
pub const TCP_REPAIR_OFF_NO_WP: i32 = -1;
/// TCP_REPAIR_QUEUE values: which queue TCP_QUEUE_SEQ, send and MSG_PEEK act on.
pub const TCP_NO_QUEUE: i32 = 0;
pub const TCP_RECV_QUEUE: i32 = 1;
pub const TCP_SEND_QUEUE: i32 = 2;
/// TCP_REPAIR_OPTIONS codes (the TCP option kinds).
pub const TCPOPT_MSS: u32 = 2;
pub const TCPOPT_WINDOW: u32 = 3;
pub const TCPOPT_SACK_PERM: u32 = 4;
pub const TCPOPT_TIMESTAMP: u32 = 8;
/// ioctls: bytes not yet read, bytes not yet acknowledged, bytes not yet sent.
pub const SIOCINQ: libc::c_ulong = 0x541B;
pub const SIOCOUTQ: libc::c_ulong = 0x5411;
pub const SIOCOUTQNSD: libc::c_ulong = 0x894B;

/// `struct tcp_repair_window`: the window state TCP_REPAIR_WINDOW reads and writes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TcpRepairWindow {
    pub snd_wl1: u32,
    pub snd_wnd: u32,
    pub max_window: u32,
    pub rcv_wnd: u32,
    pub rcv_wup: u32,
}

impl TcpRepairWindow {
    fn to_bytes(self) -> Vec<u8> {
        [
            self.snd_wl1,
            self.snd_wnd,
            self.max_window,
            self.rcv_wnd,
            self.rcv_wup,
        ]
        .iter()
        .flat_map(|w| w.to_ne_bytes())
        .collect()
    }
}

/// Puts TCP socket `fd` into repair mode or takes it out (`mode`: one of `TCP_REPAIR_*`).
pub fn tcp_repair(fd: RawFd, mode: i32) -> SysResult<()> {
    setsockopt_int(fd, libc::IPPROTO_TCP, libc::TCP_REPAIR, mode)
        .map_err(|e| SysError::new("setsockopt(TCP_REPAIR)", e.errno))
}

/// Selects the queue (`TCP_*_QUEUE`) that the next repair-mode calls act on.
pub fn tcp_repair_queue(fd: RawFd, queue: i32) -> SysResult<()> {
    setsockopt_int(fd, libc::IPPROTO_TCP, libc::TCP_REPAIR_QUEUE, queue)
        .map_err(|e| SysError::new("setsockopt(TCP_REPAIR_QUEUE)", e.errno))
}

/// TCP_QUEUE_SEQ of the selected queue: for the send queue the sequence number after its last
/// byte (write_seq), for the receive queue the next one expected (rcv_nxt).
pub fn tcp_queue_seq(fd: RawFd) -> SysResult<u32> {
    getsockopt_int(fd, libc::IPPROTO_TCP, libc::TCP_QUEUE_SEQ)
        .map(|v| v as u32)
        .map_err(|e| SysError::new("getsockopt(TCP_QUEUE_SEQ)", e.errno))
}

/// Sets TCP_QUEUE_SEQ of the selected queue (only before the socket is connected).
pub fn set_tcp_queue_seq(fd: RawFd, seq: u32) -> SysResult<()> {
    setsockopt_int(fd, libc::IPPROTO_TCP, libc::TCP_QUEUE_SEQ, seq as i32)
        .map_err(|e| SysError::new("setsockopt(TCP_QUEUE_SEQ)", e.errno))
}

/// Sets the options negotiated at connection time (TCP_REPAIR_OPTIONS): `(code, value)` pairs,
/// `struct tcp_repair_opt` each.
pub fn tcp_repair_options(fd: RawFd, opts: &[(u32, u32)]) -> SysResult<()> {
    let raw: Vec<u8> = opts
        .iter()
        .flat_map(|(c, v)| c.to_ne_bytes().into_iter().chain(v.to_ne_bytes()))
        .collect();
    setsockopt(fd, libc::IPPROTO_TCP, libc::TCP_REPAIR_OPTIONS, &raw)
        .map_err(|e| SysError::new("setsockopt(TCP_REPAIR_OPTIONS)", e.errno))
}

/// Reads the window state of a socket in repair mode.
pub fn tcp_repair_window(fd: RawFd) -> SysResult<TcpRepairWindow> {
    // The kernel insists on exactly the size of the structure.
    let b = getsockopt(fd, libc::IPPROTO_TCP, libc::TCP_REPAIR_WINDOW, 20)
        .map_err(|e| SysError::new("getsockopt(TCP_REPAIR_WINDOW)", e.errno))?;
    if b.len() != 20 {
        return Err(SysError::new("getsockopt(TCP_REPAIR_WINDOW)", libc::EPROTO));
    }
    let w = |i: usize| u32::from_ne_bytes(b[i * 4..i * 4 + 4].try_into().expect("4 bytes"));
    Ok(TcpRepairWindow {
        snd_wl1: w(0),
        snd_wnd: w(1),
        max_window: w(2),
        rcv_wnd: w(3),
        rcv_wup: w(4),
    })
}

/// Sets the window state of a socket in repair mode (after its queues are filled).
pub fn set_tcp_repair_window(fd: RawFd, w: &TcpRepairWindow) -> SysResult<()> {
    setsockopt(
        fd,
        libc::IPPROTO_TCP,
        libc::TCP_REPAIR_WINDOW,
        &w.to_bytes(),
    )
    .map_err(|e| SysError::new("setsockopt(TCP_REPAIR_WINDOW)", e.errno))
}

/// Reads the whole send queue of a socket in repair mode with TCP_SEND_QUEUE selected: the
/// bytes sent but not acknowledged, then those not sent yet (`len`: SIOCOUTQ). The kernel
/// copies the entire queue in one call, from its start, so the buffer must hold all of it.
pub fn tcp_peek_send_queue(fd: RawFd, len: usize) -> SysResult<Vec<u8>> {
    if len == 0 {
        return Ok(Vec::new());
    }
    let mut buf = vec![0u8; len];
    // SAFETY: buf has `len` writable bytes and the kernel copies through an iovec of that
    // length (a longer queue fails with EFAULT rather than writing past it).
    let r = unsafe {
        libc::recv(
            fd,
            buf.as_mut_ptr().cast(),
            len,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    let n = check("recv(MSG_PEEK, send queue)", r as libc::c_long)? as usize;
    buf.truncate(n.min(len));
    Ok(buf)
}

/// Whether the peer of connected UNIX datagram socket `fd` (ours) is gone: a datagram socket
/// hears nothing of its peer's close, so it is looked for with sock_diag, where a closed
/// socket no longer is. A socket sock_diag cannot see (another network namespace's) is taken
/// as alive.
pub fn unix_dgram_peer_gone(fd: RawFd) -> bool {
    let Some(ino) = std::fs::read_link(format!("/proc/self/fd/{fd}"))
        .ok()
        .and_then(|l| {
            let l = l.to_string_lossy().into_owned();
            l.strip_prefix("socket:[")?
                .strip_suffix(']')?
                .parse::<u32>()
                .ok()
        })
    else {
        return false;
    };
    let Ok(me) = unix_diag(Some(ino), UDIAG_SHOW_PEER) else {
        return false;
    };
    let Some(me) = me.first() else {
        return false;
    };
    match me.peer {
        None | Some(0) => true,
        Some(peer) => unix_diag(Some(peer), 0).is_ok_and(|p| p.is_empty()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A message sent with `send_as` reads, for a receiver with SO_PASSCRED, as sent by whom
    /// it names (here our parent, which exists and is not us), and `next_message_len` sees
    /// its length (an empty one too) before it is read.
    #[test]
    fn send_as_names_its_sender() {
        let (a, b) = socketpair(libc::AF_UNIX, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC).unwrap();
        setsockopt_int(b.as_raw_fd(), SOL_SOCKET, libc::SO_PASSCRED, 1).unwrap();
        // SAFETY: getppid, getuid, getgid have no preconditions.
        let (ppid, uid, gid) = unsafe { (libc::getppid(), libc::getuid(), libc::getgid()) };
        let who = (ppid, uid, gid);
        match send_as(a.as_raw_fd(), b"hello", who, libc::MSG_DONTWAIT) {
            // Not root (CAP_SYS_ADMIN): only our own PID may be named.
            Err(e) if e.errno == libc::EPERM => return,
            r => assert_eq!(r.unwrap(), 5),
        }
        send(a.as_raw_fd(), b"", None, &[], 0).unwrap();
        assert_eq!(next_message_len(b.as_raw_fd()).unwrap(), 5);
        let got = recv(b.as_raw_fd(), 64, 0).unwrap();
        assert_eq!(got.data, b"hello");
        assert_eq!(got.creds, Some(who));
        assert_eq!(next_message_len(b.as_raw_fd()).unwrap(), 0);
        let mut v = Vec::new();
        assert_eq!(recv_append(b.as_raw_fd(), &mut v, 16, 0).unwrap(), 0);
        assert_eq!(
            next_message_len(b.as_raw_fd()).unwrap_err().errno,
            libc::EAGAIN
        );
    }
}
