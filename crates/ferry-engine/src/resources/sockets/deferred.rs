//! What the rebuild of the sockets leaves until the tree is about to run ([`Deferred`]).

use super::*;

thread_local! {
    /// What the last build of the sockets left for [`Deferred::complete`].
    pub(super) static DEFERRED: RefCell<Deferred> = RefCell::new(Deferred::default());
}

/// What the rebuild of the sockets had to leave until the tree is about to run, because
/// another socket held the address: the tree's original, which a migration between two nodes
/// of one machine (they share its network stack) keeps frozen until the commit point, after
/// the rebuild; or a running original beside a clone (`ferry restore --pid-namespace` of an
/// image taken with `--leave-running`). [`Deferred::complete`] does it, waiting a little for
/// the address to be freed; `RestoredTree::resume` calls it before letting any thread go.
#[derive(Default)]
pub struct Deferred {
    /// TCP listeners, bound (forced, see `ferry_sys::sockets::bind_forced`) but not listening:
    /// listen() checks the address again, and a listener cannot leave repair mode.
    pub(super) listens: Vec<DeferredListen>,
    /// UDP sockets that could not be bound (UDP has no repair mode, and sharing the port with
    /// SO_REUSEADDR or SO_REUSEPORT would need the original's consent and split its traffic),
    /// with the peer each is to be connected to once bound (connecting first would bind it
    /// to another port).
    pub(super) binds: Vec<DeferredBind>,
    /// Datagrams for the UDP sockets' queues, sent once every UDP socket of the tree has its
    /// address (the senders among them included).
    pub(super) datagrams: Vec<DeferredDatagram>,
    /// Established TCP connections: sockets in repair mode, made (bound, connected, refilled)
    /// only here, once the original's sockets are gone (see `Builder::tcp_conn`); they leave
    /// repair mode once every connection is made (leaving it sends a window probe to the other
    /// end, which would draw a reset from a port with no socket), and then send what had never
    /// been sent.
    pub(super) repairs: Vec<DeferredRepair>,
    /// UNIX sockets named (and listening, with their waiting connections made) only here: see
    /// [`DeferredName`].
    pub(super) names: Vec<DeferredName>,
    /// TCP clients whose connection waited in a listener's queue: connected afresh, once the
    /// tree's listeners listen (see [`DeferredHandshake`]).
    pub(super) handshakes: Vec<DeferredHandshake>,
    /// UDP sockets shut down, once bound and their datagrams sent.
    pub(super) shutdowns: Vec<(OwnedFd, Shutdown)>,
    /// Echo replies for ping sockets, once they have their identifiers.
    pub(super) pings: Vec<ping::DeferredPings>,
    /// Messages for UNIX sockets' queues that carry pidfds, or follow one, once the processes
    /// exist (see `scm`).
    pub(super) sends: Vec<scm::DeferredSend>,
}

impl Deferred {
    /// The work left by the sockets just rebuilt on this thread (nothing if none was).
    pub fn take() -> Deferred {
        DEFERRED.with(|d| std::mem::take(&mut *d.borrow_mut()))
    }

    pub fn is_empty(&self) -> bool {
        self.listens.is_empty()
            && self.binds.is_empty()
            && self.datagrams.is_empty()
            && self.repairs.is_empty()
            && self.names.is_empty()
            && self.handshakes.is_empty()
            && self.shutdowns.is_empty()
            && self.pings.is_empty()
            && self.sends.is_empty()
    }

    /// Binds and connects the UDP sockets, makes the TCP listeners listen, makes the TCP
    /// connections, names the UNIX sockets whose abstract names were taken, and queues the
    /// datagrams, retrying while an address is still in use, until `wait` has passed.
    /// `pid`: the process named in errors; `hosts`: the tree's PIDs -> ours, for the calls
    /// made inside its processes.
    pub fn complete(
        self,
        pid: i32,
        wait: std::time::Duration,
        hosts: &HashMap<i32, i32>,
    ) -> Result<()> {
        let deadline = std::time::Instant::now() + wait;
        for n in &self.names {
            n.make(hosts, deadline, wait)?;
        }
        for s in &self.sends {
            s.send(hosts).map_err(|e| Error::Restore {
                pid,
                what: format!("{}: {e}", s.what),
            })?;
        }
        let retry = move |op: &dyn Fn() -> ferry_sys::SysResult<()>| loop {
            match op() {
                Err(e)
                    if (e.errno == libc::EADDRINUSE || e.errno == libc::EADDRNOTAVAIL)
                        && std::time::Instant::now() < deadline =>
                {
                    std::thread::sleep(std::time::Duration::from_millis(10))
                }
                r => return r,
            }
        };
        let err = |what: &str, e: ferry_sys::SysError| Error::Restore {
            pid,
            what: if e.errno == libc::EADDRINUSE || e.errno == libc::EADDRNOTAVAIL {
                format!(
                    "{what}: {e}: another socket still holds the address after {wait:?} (the \
                     original of the tree, if it still runs?)"
                )
            } else {
                format!("{what}: {e}")
            },
        };
        for b in &self.binds {
            let fd = b.fd.as_raw_fd();
            retry(&|| sk::bind(fd, &b.local)).map_err(|e| err(&b.what, e))?;
            if let Some(peer) = &b.peer {
                sk::connect(fd, peer).map_err(|e| err(&format!("{}: connect", b.what), e))?;
            }
        }
        for l in &self.listens {
            let fd = l.fd.as_raw_fd();
            retry(&|| sk::listen(fd, l.backlog)).map_err(|e| err(&l.what, e))?;
        }
        let mut handshakes: Vec<&DeferredHandshake> = self.handshakes.iter().collect();
        handshakes.sort_by_key(|h| h.order);
        for h in handshakes {
            h.make(&retry, deadline)
                .map_err(|(step, e)| err(&format!("{}: {step}", h.what), e))?;
        }
        // The connections, once the tree's listeners have their ports (a socket bound to the
        // port, even in repair mode, would keep a listener without SO_REUSEADDR from it).
        for r in &self.repairs {
            r.make(&retry)
                .map_err(|(step, e)| err(&format!("{}: {step}", r.what), e))?;
        }
        for d in &self.datagrams {
            sk::send(
                d.from.as_raw_fd(),
                &d.data,
                Some(&d.to),
                &[],
                libc::MSG_DONTWAIT,
            )
            .map_err(|e| {
                err(
                    &format!("{}: queue {} bytes again", d.what, d.data.len()),
                    e,
                )
            })?;
        }
        for p in &self.pings {
            p.deliver().map_err(|e| Error::Restore {
                pid,
                what: format!("{}: {e}", p.what),
            })?;
        }
        for (fd, sh) in &self.shutdowns {
            apply_shutdown(fd.as_raw_fd(), sh);
        }
        for r in &self.repairs {
            let fd = r.fd.as_raw_fd();
            sk::tcp_repair(fd, sk::TCP_REPAIR_OFF)
                .map_err(|e| err(&format!("{}: leave repair mode", r.what), e))?;
            sk::setsockopt_int(fd, SOL_SOCKET, libc::SO_REUSEADDR, r.reuseaddr)
                .map_err(|e| err(&format!("{}: set SO_REUSEADDR back", r.what), e))?;
        }
        for r in &self.repairs {
            let unsent = &r.conn.send_queue[r.sent..];
            if unsent.is_empty() {
                continue;
            }
            let fd = r.fd.as_raw_fd();
            bump_sndbuf(fd, unsent.len());
            let mut at = 0;
            while at < unsent.len() {
                let n =
                    sk::send(fd, &unsent[at..], None, &[], libc::MSG_DONTWAIT).map_err(|e| {
                        err(
                            &format!("{}: send the {} bytes never sent", r.what, unsent.len()),
                            e,
                        )
                    })?;
                at += n.max(1);
            }
            if let Some(b) = r.sndbuf {
                let _ = sk::setsockopt_int(fd, SOL_SOCKET, libc::SO_SNDBUFFORCE, b / 2);
            }
        }
        replay_shutdowns(&self.repairs, deadline, &err)
    }
}
