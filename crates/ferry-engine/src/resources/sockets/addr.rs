//! Socket addresses: the kernel's raw encoding and ours, and names for people.

use super::*;

/// Decodes a raw socket address as the kernel reports it.
pub fn decode_addr(raw: &[u8]) -> Option<SockAddr> {
    if raw.len() < 2 {
        return None;
    }
    let family = i32::from(u16::from_ne_bytes([raw[0], raw[1]]));
    match family {
        libc::AF_UNIX => {
            let path = &raw[2..];
            if path.is_empty() {
                Some(SockAddr::UnixUnnamed)
            } else if path[0] == 0 {
                Some(SockAddr::UnixAbstract(path[1..].to_vec()))
            } else {
                let end = path.iter().position(|&b| b == 0).unwrap_or(path.len());
                Some(SockAddr::UnixPath(path[..end].to_vec()))
            }
        }
        libc::AF_INET if raw.len() >= 8 => Some(SockAddr::Inet {
            port: u16::from_be_bytes([raw[2], raw[3]]),
            addr: raw[4..8].try_into().expect("4 bytes"),
        }),
        libc::AF_INET6 if raw.len() >= 28 => Some(SockAddr::Inet6 {
            port: u16::from_be_bytes([raw[2], raw[3]]),
            flowinfo: u32::from_be_bytes(raw[4..8].try_into().expect("4 bytes")),
            addr: raw[8..24].try_into().expect("16 bytes"),
            scope_id: u32::from_ne_bytes(raw[24..28].try_into().expect("4 bytes")),
        }),
        _ => None,
    }
}

/// The raw socket address for `a`, as bind(2) and connect(2) take it.
pub fn encode_addr(a: &SockAddr) -> Vec<u8> {
    let fam = |f: i32| (f as u16).to_ne_bytes().to_vec();
    match a {
        SockAddr::UnixUnnamed => fam(libc::AF_UNIX),
        SockAddr::UnixPath(p) => {
            let mut v = fam(libc::AF_UNIX);
            v.extend_from_slice(p);
            // A name that fills sun_path (108 bytes) has no terminating NUL.
            if p.len() < 108 {
                v.push(0);
            }
            v
        }
        SockAddr::UnixAbstract(n) => {
            let mut v = fam(libc::AF_UNIX);
            v.push(0);
            v.extend_from_slice(n);
            v
        }
        SockAddr::Inet { addr, port } => {
            let mut v = fam(libc::AF_INET);
            v.extend_from_slice(&port.to_be_bytes());
            v.extend_from_slice(addr);
            v.extend_from_slice(&[0; 8]);
            v
        }
        SockAddr::Inet6 {
            addr,
            port,
            flowinfo,
            scope_id,
        } => {
            let mut v = fam(libc::AF_INET6);
            v.extend_from_slice(&port.to_be_bytes());
            v.extend_from_slice(&flowinfo.to_be_bytes());
            v.extend_from_slice(addr);
            v.extend_from_slice(&scope_id.to_ne_bytes());
            v
        }
    }
}

/// A socket address for people.
pub fn describe(a: &SockAddr) -> String {
    a.to_string()
}

pub(super) fn is_unspecified(a: &SockAddr) -> bool {
    match a {
        SockAddr::Inet { addr, port } => *port == 0 && *addr == [0; 4],
        SockAddr::Inet6 { addr, port, .. } => *port == 0 && *addr == [0; 16],
        SockAddr::UnixUnnamed => true,
        _ => false,
    }
}

pub(super) fn family_name(domain: i32) -> &'static str {
    match domain {
        libc::AF_NETLINK => "netlink",
        libc::AF_PACKET => "packet",
        libc::AF_BLUETOOTH => "bluetooth",
        libc::AF_ALG => "crypto API",
        libc::AF_VSOCK => "vsock",
        libc::AF_XDP => "XDP",
        libc::AF_TIPC => "TIPC",
        libc::AF_CAN => "CAN",
        _ => "other",
    }
}

/// Whether a device number as sock_diag reports it (the kernel's own encoding) and one as stat(2)
/// reports it name the same device.
pub(crate) fn same_dev(kernel: u32, user: u64) -> bool {
    let (kmaj, kmin) = (u64::from(kernel >> 20), u64::from(kernel & 0xfffff));
    let umaj = ((user >> 8) & 0xfff) | ((user >> 32) & !0xfff);
    let umin = (user & 0xff) | ((user >> 12) & !0xff);
    (kmaj, kmin) == (umaj, umin)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_round_trip() {
        let long = vec![b'a'; 108];
        for a in [
            SockAddr::UnixUnnamed,
            SockAddr::UnixPath(b"/tmp/x.sock".to_vec()),
            SockAddr::UnixPath(b"rel.sock".to_vec()),
            SockAddr::UnixPath(long),
            SockAddr::UnixAbstract(b"name\0with\0nuls\0".to_vec()),
            SockAddr::UnixAbstract(Vec::new()),
            SockAddr::Inet {
                addr: [127, 0, 0, 1],
                port: 8080,
            },
            SockAddr::Inet6 {
                addr: std::net::Ipv6Addr::LOCALHOST.octets(),
                port: 443,
                flowinfo: 7,
                scope_id: 2,
            },
        ] {
            let raw = encode_addr(&a);
            assert!(raw.len() <= sk::ADDR_MAX);
            assert_eq!(decode_addr(&raw), Some(a));
        }
    }

    #[test]
    fn addresses_match_the_kernel_layout() {
        let raw = encode_addr(&SockAddr::Inet {
            addr: [10, 1, 2, 3],
            port: 0x1234,
        });
        assert_eq!(raw.len(), std::mem::size_of::<libc::sockaddr_in>());
        assert_eq!(&raw[2..8], &[0x12, 0x34, 10, 1, 2, 3]);
        let raw = encode_addr(&SockAddr::Inet6 {
            addr: [0; 16],
            port: 1,
            flowinfo: 0,
            scope_id: 0,
        });
        assert_eq!(raw.len(), std::mem::size_of::<libc::sockaddr_in6>());
        assert_eq!(
            encode_addr(&SockAddr::UnixAbstract(b"ab".to_vec())).len(),
            5
        );
        assert_eq!(encode_addr(&SockAddr::UnixPath(b"/a".to_vec())).len(), 5);
    }

    #[test]
    fn device_numbers_compare_across_encodings() {
        // major 8, minor 17: the kernel's MKDEV and the stat(2) encoding.
        let kernel = (8u32 << 20) | 17;
        let user = libc::makedev(8, 17);
        assert!(same_dev(kernel, user));
        assert!(!same_dev(kernel, libc::makedev(8, 18)));
        let kernel = (259u32 << 20) | 300;
        assert!(same_dev(kernel, libc::makedev(259, 300)));
    }
}
