//! The names of relayed sockets, for a body's supervisor.
//!
//! A relayed socket (`SocketDesc::relayed`: a TCP connection or a UNIX stream socket whose
//! other end stayed at home) is rebuilt in a body as one end of a loopback connection or of an
//! unnamed pair, whose own names are the body node's. What `getsockname(2)` and
//! `getpeername(2)` answered at home is in the image (`SocketDesc::local`, `peer`): the
//! restore hands it to the guest init with the inode of the socket the body got
//! ([`relayed_names`]), and the processes that hold such a socket get Ferry's filter with those
//! two calls ([`super::super::seccomp::NAMES`]), which the init answers for that socket.

use super::{encode_addr, OwnedFd};
use crate::error::{Error, Result};
use ferry_image::{FileKind, SockAddr, SockFamily, Tree};
use std::collections::{HashMap, HashSet};
use std::os::unix::fs::MetadataExt;

/// A relayed socket as its supervisor knows it: the inode of the socket the body holds, and
/// the names the original had at home, as getsockname(2) and getpeername(2) write them (raw
/// `struct sockaddr` bytes, as long as the kernel says they are), and its inode there (what
/// fstat(2) said at home: `SocketDesc::ino`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RelayedNames {
    /// The relay's id at home (`RelayOpen::pipe`; not in [`RelayedNames::encode`]'s lines).
    pub relay: u32,
    pub ino: u64,
    pub local: Vec<u8>,
    pub peer: Vec<u8>,
    pub home_ino: u64,
}

/// The bytes getsockname(2) or getpeername(2) gives for `a` of a socket of `family` (`None`:
/// an unnamed UNIX socket, or an unbound inet one, 0.0.0.0 port 0).
pub fn name_bytes(family: SockFamily, a: Option<&SockAddr>) -> Vec<u8> {
    let unnamed = match family {
        SockFamily::Inet => SockAddr::Inet {
            addr: [0; 4],
            port: 0,
        },
        SockFamily::Inet6 => SockAddr::Inet6 {
            addr: [0; 16],
            port: 0,
            flowinfo: 0,
            scope_id: 0,
        },
        _ => SockAddr::UnixUnnamed,
    };
    let a = a.unwrap_or(&unnamed);
    let mut raw = encode_addr(a);
    // The kernel counts a path's terminating NUL even when the path fills sun_path.
    if let SockAddr::UnixPath(p) = a {
        if p.len() >= 108 {
            raw.push(0);
        }
    }
    raw
}

/// The inode number of `fd`, a relayed descriptor's new end in the rebuilt tree; `what` names
/// the step in the error.
fn new_inode(tree: &Tree, fd: &OwnedFd, what: impl FnOnce() -> String) -> Result<u64> {
    fd.try_clone()
        .map(std::fs::File::from)
        .and_then(|f| f.metadata())
        .map(|m| m.ino())
        .map_err(|source| Error::Io {
            pid: tree.root_pid,
            what: what(),
            source,
        })
}

/// The names of every relayed socket of `tree`, whose descriptions the restore opened
/// (`descs`, by file id).
pub fn relayed_names(tree: &Tree, descs: &HashMap<u32, OwnedFd>) -> Result<Vec<RelayedNames>> {
    let mut out = Vec::new();
    for f in &tree.files {
        let FileKind::Socket(s) = &f.kind else {
            continue;
        };
        if !s.relayed {
            continue;
        }
        let Some(fd) = descs.get(&f.id) else {
            continue;
        };
        let ino = new_inode(tree, fd, || {
            format!("read the inode of relayed socket:[{}]'s new end", s.ino)
        })?;
        out.push(RelayedNames {
            relay: s.relay.unwrap_or(ferry_image::RELAY_SOCKET | f.id),
            ino,
            local: name_bytes(s.family, s.local.as_ref()),
            peer: name_bytes(s.family, s.peer.as_ref()),
            home_ino: s.ino,
        });
    }
    // Relayed pipes: the body's pipe is a new one of its node; fstat answers the home pipe's
    // inode (`Pipe::ino`). No names: an entry with neither is a pipe's.
    for p in tree
        .pipes
        .iter()
        .filter(|p| p.relayed && p.fifo_path.is_none())
    {
        let end = tree.files.iter().find_map(|f| match f.kind {
            FileKind::Pipe { pipe } if pipe == p.id => descs.get(&f.id),
            _ => None,
        });
        let Some(fd) = end else {
            continue;
        };
        let ino = new_inode(tree, fd, || {
            format!("read the inode of relayed pipe:[{}]'s new pipe", p.ino)
        })?;
        out.push(RelayedNames {
            relay: p.relay.unwrap_or(p.id),
            ino,
            local: Vec::new(),
            peer: Vec::new(),
            home_ino: p.ino,
        });
    }
    Ok(out)
}

impl RelayedNames {
    /// Whether this is a relayed pipe's entry (no names: only its inode at home).
    pub fn is_pipe(&self) -> bool {
        self.local.is_empty() && self.peer.is_empty()
    }
}

/// A body moving on: makes the capture of the body node's stand-in for a relayed socket
/// (`s`, the body's end of a loopback connection or a pair whose other end is its node's
/// daemon's) the original's at home, as `n` (given by its node: what its restore handed to the
/// supervisor) says: its inode and names there, its relay's id. What waits in it is read back
/// by its node at the handoff (docs/wire-format.md, "Moving on with relays").
pub fn as_relayed(s: &mut ferry_image::SocketDesc, n: &RelayedNames) {
    s.relayed = true;
    s.relay = Some(n.relay);
    s.ino = n.home_ino;
    s.local = super::decode_addr(&n.local);
    s.peer = super::decode_addr(&n.peer);
    s.tcp = None;
    s.queue.clear();
    s.state = ferry_image::SockState::Connected { peer_ino: 0 };
    // A far side that shut its way down says so again to the next node, after what the body
    // had not read (shut for reading, the new socket would refuse that).
    s.shutdown.read = false;
}

/// The file ids of `tree`'s relayed sockets and relayed pipes' ends (whose holders get their
/// fstat answered).
pub fn relayed_files(tree: &Tree) -> HashSet<u32> {
    let pipes: HashSet<u32> = tree
        .pipes
        .iter()
        .filter(|p| p.relayed && p.fifo_path.is_none())
        .map(|p| p.id)
        .collect();
    tree.files
        .iter()
        .filter(|f| match &f.kind {
            FileKind::Socket(s) => s.relayed,
            FileKind::Pipe { pipe } => pipes.contains(pipe),
            _ => false,
        })
        .map(|f| f.id)
        .collect()
}

fn hex(b: &[u8]) -> String {
    if b.is_empty() {
        return "-".into();
    }
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if s == "-" {
        return Some(Vec::new());
    }
    if !s.len().is_multiple_of(2) || s.len() > 2 * ferry_sys::sockets::ADDR_MAX {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

impl RelayedNames {
    /// One line per socket: "INO LOCAL PEER HOME_INO\n", the names in hex ("-" for none).
    pub fn encode(list: &[RelayedNames]) -> String {
        list.iter()
            .map(|n| {
                let (l, p) = (hex(&n.local), hex(&n.peer));
                format!("{} {l} {p} {}\n", n.ino, n.home_ino)
            })
            .collect()
    }

    /// The lines [`RelayedNames::encode`] wrote; `None` if any is not one.
    pub fn decode(text: &str) -> Option<Vec<RelayedNames>> {
        text.lines()
            .filter(|l| !l.is_empty())
            .map(|l| {
                let mut f = l.split(' ');
                let n = RelayedNames {
                    relay: 0,
                    ino: f.next()?.parse().ok()?,
                    local: unhex(f.next()?)?,
                    peer: unhex(f.next()?)?,
                    home_ino: f.next()?.parse().ok()?,
                };
                f.next().is_none().then_some(n)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_as_long_as_the_kernel_says() {
        let unix = |a: Option<SockAddr>| name_bytes(SockFamily::Unix, a.as_ref()).len();
        assert_eq!(unix(None), 2);
        assert_eq!(unix(Some(SockAddr::UnixUnnamed)), 2);
        // offsetof(sun_path) + strlen + 1, as unix_mkname_bsd counts it.
        assert_eq!(unix(Some(SockAddr::UnixPath(b"/tmp/s".to_vec()))), 9);
        assert_eq!(unix(Some(SockAddr::UnixPath(vec![b'a'; 108]))), 111);
        assert_eq!(unix(Some(SockAddr::UnixAbstract(b"x".to_vec()))), 4);
        assert_eq!(name_bytes(SockFamily::Inet, None).len(), 16);
        assert_eq!(name_bytes(SockFamily::Inet6, None).len(), 28);
    }

    #[test]
    fn names_round_trip_through_text() {
        let list = vec![
            RelayedNames {
                relay: 0,
                ino: 42,
                local: name_bytes(
                    SockFamily::Inet,
                    Some(&SockAddr::Inet {
                        addr: [127, 0, 0, 1],
                        port: 80,
                    }),
                ),
                peer: vec![1, 0],
                home_ino: 9,
            },
            RelayedNames {
                relay: 0,
                ino: 7,
                local: Vec::new(),
                peer: vec![0xff; 111],
                home_ino: u64::MAX,
            },
        ];
        let text = RelayedNames::encode(&list);
        assert_eq!(RelayedNames::decode(&text), Some(list));
        assert_eq!(RelayedNames::decode("1 zz - 2\n"), None);
        assert_eq!(RelayedNames::decode("1 00 - 2 extra\n"), None);
        assert_eq!(RelayedNames::decode("1 0 - 2\n"), None);
        assert_eq!(RelayedNames::decode("1 00 -\n"), None);
    }

    #[test]
    fn a_pipes_line_has_no_names() {
        let pipe = RelayedNames {
            relay: 0,
            ino: 5,
            local: Vec::new(),
            peer: Vec::new(),
            home_ino: 77,
        };
        let text = RelayedNames::encode(std::slice::from_ref(&pipe));
        assert_eq!(text, "5 - - 77\n");
        let back = RelayedNames::decode(&text).unwrap();
        assert!(back[0].is_pipe());
        let sock = name_bytes(SockFamily::Unix, None);
        assert!(!RelayedNames {
            local: sock,
            ..pipe
        }
        .is_pipe());
    }
}
