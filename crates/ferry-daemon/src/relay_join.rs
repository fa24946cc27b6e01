//! The short circuit of a relayed pipe whose two ends are both bodies on one node.
//!
//! A pipe between two processes that started at home (`writer | reader`) is relayed through
//! the home daemon for each end that moved: once both have moved to one node, every byte would
//! go there, home, and back. When home sees two live relays of one pipe (by the home pipe's
//! inode), one the body writes and one the body reads, both to the same node other than
//! itself, with no relay of that pipe waiting and no process at home holding the pipe but this
//! daemon and the relays' holders ([`try_join`]), it joins them (docs/wire-format.md, "Both
//! ends on one node"):
//! 1. it sends `RelayJoin { token }` on the writer's relay; the writer's node stops reading the
//!    body's stand-in and answers with the token after its last data frame, then keeps a
//!    descriptor of the stand-in here ([`Joins::writer`]). Home writes all it received into
//!    its pipe;
//! 2. then on the reader's relay home takes what is left in its pipe (nothing else writes it),
//!    sends it, and sends `RelayJoin { token }` after its last data frame; the reader's node,
//!    once all before it is in the reader's stand-in, takes the writer's stand-in, answers with
//!    the token, and splices the one into the other itself ([`joined`]);
//! 3. home keeps both its ends of the pipe (and their holders), unread, for as long as the
//!    join lasts; nothing more of the pipe crosses home.
//!
//! Nothing is lost, duplicated or reordered: what the writer wrote before the join reaches the
//! reader through home, all of it before the marker; what it wrote after waits in its stand-in
//! and is spliced only after the marker. Either node refusing (its body being moved: token 0)
//! leaves both relays as they were: the writer's stand-in goes back to its relay, which dials
//! home again, where its end waits for it. End of file and EPIPE act as at home: the writer's
//! stand-in's end of file closes the reader's stand-in; the reader's stand-in losing its last
//! reader closes the writer's (its writer gets EPIPE, or SIGPIPE).
//!
//! Moving on: a pause of either relay (a move, a checkpoint) stops the splicing, so that each
//! stand-in holds what its body's image records. A handoff (the body committed elsewhere) ends
//! the pair: the moving body's relay takes its end at home again from where it stood
//! (`RelayOpen::at`) and hands it over as an unjoined relay would; the other body's relay dials
//! home again and goes on through it. Home joins them again if they meet on one node.

use crate::node::Node;
use crate::relay_pipe::{Ctl, HomeCtl};
use anyhow::{anyhow, Context, Result};
use std::collections::{HashMap, HashSet};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::unix::pipe;
use tokio::sync::{mpsc, oneshot};

/// Why a relay cannot follow its body while its join is under way.
const JOINING: &str = "a join of its pipe's relays on this node (both ends are bodies here) is \
    under way: try again in a moment";
/// How long home looks for the chance to join two relays after one opens (a process at home
/// may still hold the pipe for a moment).
const LOOK_FOR: Duration = Duration::from_secs(10);
/// How long both relays of a pair must have been connected before home joins them.
const SETTLED: Duration = Duration::from_secs(1);
/// How long a writer's stand-in waits here for its reader's relay.
const WAIT_FOR_READER: Duration = Duration::from_secs(10);
/// How often a joined pair looks whether the reader's stand-in still has readers.
const READERS_POLL: Duration = Duration::from_millis(200);

/// A writer's stand-in waiting here for its reader's relay.
pub struct WriterHalf {
    fd: OwnedFd,
    /// The writer's home PID (its tree's root).
    pid: i32,
    /// Told when the reader's relay takes it.
    took: oneshot::Sender<Link>,
}

/// What the writer's relay keeps of a joined pair: `back` is told when the writer's relay is
/// to go on through home again (the reader moved on), and dropped when the pair ended; `ctl`
/// carries the writer's relay's word to the pair.
pub struct Link {
    back: oneshot::Receiver<()>,
    ctl: mpsc::UnboundedSender<JoinCtl>,
}

/// The writer's relay's word to a joined pair.
pub enum JoinCtl {
    /// The writer is about to be captured: stop splicing (answered once stopped).
    Pause(oneshot::Sender<()>),
    /// Its move failed: go on.
    Resume,
    /// It moved on: the pair ends, the reader's relay goes on through home (answered once the
    /// pair stopped).
    Unjoin(oneshot::Sender<()>),
}

/// How the writer's side of a join ended.
pub enum WriterEnd {
    /// The pair ended (the writer's end of file, or the reader's readers gone).
    Ended,
    /// Not joined, or the reader moved on: the writer's relay goes on through home.
    Back,
    /// The writer moved on to `to`: its relay at home is to be handed over there.
    Handoff {
        to: String,
        done: oneshot::Sender<Result<()>>,
    },
}

/// How a joined pair ended, on the reader's side (with the bytes spliced).
pub enum JoinedEnd {
    /// The writer's end of file, or the reader's readers gone.
    Ended(u64),
    /// The writer moved on: the reader's relay goes on through home.
    Back(u64),
    /// The reader moved on to `to`: its relay at home is to be handed over there, and the
    /// writer's goes on through home.
    Handoff {
        bytes: u64,
        to: String,
        done: oneshot::Sender<Result<()>>,
    },
}

/// The writers' stand-ins waiting on a body's node, by (home, token).
#[derive(Default)]
pub struct Joins {
    waiting: Mutex<HashMap<(String, u64), WriterHalf>>,
    /// The bodies (home, home PID of the tree's root) with a joined pair running, and how many.
    active: Mutex<HashMap<(String, i32), u32>>,
}

impl Joins {
    /// The writer's side: its stand-in `fd` (a descriptor of its read end) waits under `token`
    /// from `home` for the reader's relay, up to 10 s (a pause meanwhile is refused). Joined,
    /// the writer's relay's pause stops the pair (answered with `at`, where the relay stood at
    /// home), and its handoff ends it.
    #[allow(clippy::too_many_arguments)]
    pub async fn writer(
        &self,
        home: &str,
        pid: i32,
        token: u64,
        fd: OwnedFd,
        ctl: &mut mpsc::UnboundedReceiver<Ctl>,
        at: u64,
    ) -> WriterEnd {
        let (took, mut taken) = oneshot::channel();
        let key = (home.to_string(), token);
        self.waiting
            .lock()
            .expect("joins lock")
            .insert(key.clone(), WriterHalf { fd, pid, took });
        let until = tokio::time::Instant::now() + WAIT_FOR_READER;
        let mut waited = false;
        let link = loop {
            tokio::select! {
                t = &mut taken => match t {
                    Ok(link) => break link,
                    Err(_) => return WriterEnd::Back,
                },
                c = ctl.recv() => refuse(c),
                _ = tokio::time::sleep_until(until), if !waited => {
                    waited = true;
                    if self.waiting.lock().expect("joins lock").remove(&key).is_some() {
                        return WriterEnd::Back;
                    }
                }
            }
        };
        let Link {
            mut back,
            ctl: pair,
        } = link;
        let mut open = true;
        loop {
            tokio::select! {
                b = &mut back => {
                    return if b.is_ok() { WriterEnd::Back } else { WriterEnd::Ended };
                }
                c = ctl.recv(), if open => match c {
                    Some(Ctl::Pause(ack)) => {
                        let (tx, rx) = oneshot::channel();
                        let stopped = pair.send(JoinCtl::Pause(tx)).is_ok() && rx.await.is_ok();
                        let _ = ack.send(if stopped {
                            Ok(at)
                        } else {
                            Err("its joined pipe ended meanwhile".to_string())
                        });
                    }
                    Some(Ctl::Resume) => {
                        let _ = pair.send(JoinCtl::Resume);
                    }
                    Some(Ctl::Handoff { to, done, .. }) => {
                        let (tx, rx) = oneshot::channel();
                        if pair.send(JoinCtl::Unjoin(tx)).is_ok() {
                            let _ = rx.await;
                        }
                        return WriterEnd::Handoff { to, done };
                    }
                    None => open = false,
                },
            }
        }
    }

    /// The reader's side: the writer's stand-in waiting under `token` from `home`, looked for
    /// up to `wait`.
    pub async fn take(&self, home: &str, token: u64, wait: Duration) -> Option<WriterHalf> {
        let until = tokio::time::Instant::now() + wait;
        let key = (home.to_string(), token);
        loop {
            if let Some(h) = self.waiting.lock().expect("joins lock").remove(&key) {
                return Some(h);
            }
            if tokio::time::Instant::now() > until {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Whether the body of home PID `pid` from `home` has a joined pair running here (its
    /// checkpoint is refused: its pair's two images would be taken at different moments).
    pub fn is_joined(&self, home: &str, pid: i32) -> bool {
        self.active
            .lock()
            .expect("joins lock")
            .contains_key(&(home.to_string(), pid))
    }

    fn mark(&self, home: &str, pids: [i32; 2], on: bool) {
        let mut a = self.active.lock().expect("joins lock");
        for p in pids {
            let k = (home.to_string(), p);
            let n = a.entry(k.clone()).or_insert(0);
            if on {
                *n += 1;
            } else {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    a.remove(&k);
                }
            }
        }
    }

    /// The reader's side refuses the join: the writer's stand-in goes back to its relay.
    pub fn abandon(&self, home: &str, token: u64) {
        self.waiting
            .lock()
            .expect("joins lock")
            .remove(&(home.to_string(), token));
    }
}

/// Answers a pause or a handoff of a relay whose join is under way: refused.
fn refuse(c: Option<Ctl>) {
    match c {
        Some(Ctl::Pause(ack)) => {
            let _ = ack.send(Err(JOINING.to_string()));
        }
        Some(Ctl::Handoff { done, .. }) => {
            let _ = done.send(Err(anyhow!(JOINING)));
        }
        Some(Ctl::Resume) | None => {}
    }
}

/// The reader's node, joined: splices what the writer writes into its stand-in (`half`) into
/// the reader's stand-in `to` (the bytes go from pipe to pipe in the kernel, never through this
/// daemon's memory), until the writer's end of file (the reader then sees it, once its relay
/// ends and closes `to`), the reader's readers are gone (the writer's stand-in is closed here
/// and by its relay: its writer gets EPIPE), or either body moves on. A pause of either relay
/// (the reader's `ctl` at `at`, where its relay stood at home; the writer's through its
/// [`Link`]) stops the splicing until it is resumed: what each stand-in holds is then what its
/// body's image records.
pub async fn joined(
    (joins, home, pid): (&Joins, &str, i32),
    half: WriterHalf,
    to: &mut pipe::Sender,
    ctl: &mut mpsc::UnboundedReceiver<Ctl>,
    at: u64,
) -> Result<JoinedEnd> {
    let pids = [pid, half.pid];
    joins.mark(home, pids, true);
    let r = splice_pair(half, to, ctl, at).await;
    joins.mark(home, pids, false);
    r
}

async fn splice_pair(
    half: WriterHalf,
    to: &mut pipe::Sender,
    ctl: &mut mpsc::UnboundedReceiver<Ctl>,
    at: u64,
) -> Result<JoinedEnd> {
    let (back, back_rx) = oneshot::channel::<()>();
    let (pair, mut wctl) = mpsc::unbounded_channel();
    let WriterHalf { fd, took, .. } = half;
    let _ = took.send(Link {
        back: back_rx,
        ctl: pair,
    });
    let from = pipe::Receiver::from_owned_fd(fd).context("watch the writer's stand-in")?;
    let (fr, tr) = (from.as_raw_fd(), to.as_raw_fd());
    let mut total = 0u64;
    let mut tick = tokio::time::interval(READERS_POLL);
    let (mut ctl_open, mut wctl_open) = (true, true);
    let (mut paused_r, mut paused_w) = (false, false);
    // What the last splice waited for: bytes in the writer's stand-in, or room in the reader's.
    let (mut wait_in, mut wait_out) = (false, false);
    macro_rules! word {
        ($c:expr) => {
            match $c {
                Some(Ctl::Pause(ack)) => {
                    paused_r = true;
                    let _ = ack.send(Ok(at));
                }
                Some(Ctl::Resume) => paused_r = false,
                Some(Ctl::Handoff { to, done, .. }) => {
                    // The reader moved on: the writer's relay goes on through home.
                    drop(from);
                    let _ = back.send(());
                    return Ok(JoinedEnd::Handoff {
                        bytes: total,
                        to,
                        done,
                    });
                }
                None => ctl_open = false,
            }
        };
    }
    macro_rules! wword {
        ($c:expr) => {
            match $c {
                Some(JoinCtl::Pause(ack)) => {
                    paused_w = true;
                    let _ = ack.send(());
                }
                Some(JoinCtl::Resume) => paused_w = false,
                Some(JoinCtl::Unjoin(ack)) => {
                    // The writer moved on: this relay goes on through home.
                    drop(from);
                    let _ = ack.send(());
                    return Ok(JoinedEnd::Back(total));
                }
                None => wctl_open = false,
            }
        };
    }
    let end: Result<()> = loop {
        let paused = paused_r || paused_w;
        if paused || wait_in || wait_out {
            tokio::select! {
                biased;
                c = ctl.recv(), if ctl_open => {
                    word!(c);
                    continue;
                }
                c = wctl.recv(), if wctl_open => {
                    wword!(c);
                    continue;
                }
                r = from.readable(), if wait_in && !paused => {
                    if let Err(e) = r {
                        break Err(e).context("watch the writer's stand-in");
                    }
                }
                r = to.writable(), if wait_out && !paused => {
                    if let Err(e) = r {
                        break Err(e).context("watch the reader's stand-in");
                    }
                }
                _ = tick.tick(), if !paused => if readers_gone(tr) { break Ok(()) },
            }
            (wait_in, wait_out) = (false, false);
        }
        match ferry_sys::fdops::splice(fr, tr, 1 << 16) {
            // The writer's end of file: all it wrote is in the reader's stand-in.
            Ok(0) => break Ok(()),
            Ok(n) => {
                total += n as u64;
                // A steady stream never waits: the node's other work, and a pause, get a turn.
                while let Ok(c) = ctl.try_recv() {
                    word!(Some(c));
                }
                while let Ok(c) = wctl.try_recv() {
                    wword!(Some(c));
                }
                tokio::task::yield_now().await;
            }
            Err(e) if e.errno == libc::EPIPE => break Ok(()),
            Err(e) if e.errno == libc::EAGAIN => {
                // Which side must wait: the reader's stand-in full, or the writer's empty. The
                // readiness of that side is cleared, then looked at again (a change between the
                // splice and the clearing would otherwise be missed).
                let room = ferry_sys::sockets::poll_now(tr, libc::POLLOUT)
                    .map_or(true, |ev| ev & (libc::POLLOUT | libc::POLLERR) != 0);
                let would_block =
                    || -> std::io::Result<()> { Err(std::io::ErrorKind::WouldBlock.into()) };
                if room {
                    let _ = from.try_io(would_block);
                    wait_in = ferry_sys::sockets::poll_now(fr, libc::POLLIN)
                        .is_ok_and(|ev| ev & (libc::POLLIN | libc::POLLHUP) == 0);
                } else {
                    let _ = to.try_io(would_block);
                    wait_out = ferry_sys::sockets::poll_now(tr, libc::POLLOUT)
                        .is_ok_and(|ev| ev & (libc::POLLOUT | libc::POLLERR) == 0);
                }
            }
            Err(e) => {
                break Err(std::io::Error::from_raw_os_error(e.errno))
                    .context("splice the writer's stand-in into the reader's")
            }
        }
    };
    // The writer's stand-in closes here, then with its relay (`back` dropped).
    drop(from);
    drop(back);
    end.map(|()| JoinedEnd::Ended(total))
}

/// Whether the write end `raw`'s readers are all gone.
fn readers_gone(raw: i32) -> bool {
    ferry_sys::sockets::poll_now(raw, libc::POLLOUT).map_or(true, |ev| ev & libc::POLLERR != 0)
}

/// One side of a pipe's relays at home, as [`try_join`] finds it.
struct Side {
    pid: i32,
    pipe: u32,
    ctl: mpsc::UnboundedSender<HomeCtl>,
    holder: Option<i32>,
}

/// At home, once relay `pipe` of home PID `pid` is pumped: if its pipe's other end is relayed
/// too, to the same node, and nothing at home but this daemon and the relays' holders holds the
/// pipe, joins the two relays on that node. Looked for up to 10 s (a process at home that
/// still holds the pipe may close it meanwhile).
pub fn try_join(node: &Arc<Node>, pid: i32, pipe: u32) {
    let node = node.clone();
    tokio::spawn(async move {
        let until = tokio::time::Instant::now() + LOOK_FOR;
        loop {
            let Some((ino, body, w, r, settled)) = pair_of(&node, pid, pipe) else {
                return;
            };
            if !settled {
                if tokio::time::Instant::now() > until {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
                continue;
            }
            let mut exclude = vec![std::process::id() as i32];
            exclude.extend(w.holder);
            exclude.extend(r.holder);
            match holders_of(ino, &exclude) {
                Ok(others) if others.is_empty() => {
                    if !node.relays.joining.lock().expect("relays lock").insert(ino) {
                        return;
                    }
                    let r2 = join(&node, &body, &w, &r).await;
                    node.relays
                        .joining
                        .lock()
                        .expect("relays lock")
                        .remove(&ino);
                    match r2 {
                        Ok(()) => tracing::info!(event = "relay-joined", pipe_ino = ino,
                            body = %body, writer = w.pid, writer_relay = w.pipe,
                            reader = r.pid, reader_relay = r.pipe,
                            "both ends of the pipe are bodies on one node: their bytes go \
                             straight between them"),
                        Err(e) => tracing::warn!(event = "relay-join-failed", pipe_ino = ino,
                            body = %body, writer = w.pid, reader = r.pid,
                            error = %format!("{e:#}")),
                    }
                    return;
                }
                Ok(others) => {
                    if tokio::time::Instant::now() > until {
                        tracing::info!(event = "relay-not-joined", pipe_ino = ino,
                            body = %body, held_by = ?others,
                            "processes at home still hold the pipe: relayed through home");
                        return;
                    }
                }
                Err(e) => {
                    tracing::warn!(event = "relay-not-joined", pipe_ino = ino,
                        error = %format!("{e:#}"));
                    return;
                }
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    });
}

/// The two live relays of the pipe of relay `pipe` of `pid` (its inode, their body's node, the
/// writer's and the reader's), if it has exactly those two relays here, both to one node that
/// is not this one, and no other relay of it waits; and whether both have been connected for a
/// second at least (a connection that only hands a relay over to the body's next node, or takes
/// a joined relay back, lasts moments).
fn pair_of(node: &Arc<Node>, pid: i32, pipe: u32) -> Option<(u64, String, Side, Side, bool)> {
    let relays = &node.relays;
    let live = relays.live.lock().expect("relays lock");
    let me = live.get(&(pid, pipe))?;
    let (ino, body) = (me.ino, me.node.clone());
    if ino == 0 || body == node.name() {
        return None;
    }
    let same: Vec<_> = live
        .iter()
        .filter(|(_, l)| l.ino == ino)
        .map(|(k, l)| (*k, l))
        .collect();
    if same.len() != 2 || same.iter().any(|(_, l)| l.node != body || l.ctl.is_none()) {
        return None;
    }
    let side = |k: (i32, u32), l: &crate::relay::LivePump| Side {
        pid: k.0,
        pipe: k.1,
        ctl: l.ctl.clone().expect("checked"),
        holder: l.holder,
    };
    let settled = same.iter().all(|(_, l)| l.since.elapsed() >= SETTLED);
    let (w, r) = match (same[0].1.body_reads, same[1].1.body_reads) {
        (false, true) => (side(same[0].0, same[0].1), side(same[1].0, same[1].1)),
        (true, false) => (side(same[1].0, same[1].1), side(same[0].0, same[0].1)),
        _ => return None,
    };
    drop(live);
    let waits = relays
        .waiting
        .lock()
        .expect("relays lock")
        .values()
        .any(|x| crate::relay::inode_of(&x.fd) == ino);
    if waits {
        return None;
    }
    Some((ino, body, w, r, settled))
}

/// The processes (but those in `exclude`) holding pipe `ino`.
fn holders_of(ino: u64, exclude: &[i32]) -> Result<HashSet<i32>> {
    let want = format!("pipe:[{ino}]");
    let mut found = HashSet::new();
    for e in std::fs::read_dir("/proc").context("list /proc")? {
        let Ok(e) = e else { continue };
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else {
            continue;
        };
        if exclude.contains(&pid) {
            continue;
        }
        // A process that ended meanwhile holds nothing.
        let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
            continue;
        };
        for f in fds.flatten() {
            if std::fs::read_link(f.path()).is_ok_and(|l| l.as_os_str() == want.as_str()) {
                found.insert(pid);
                break;
            }
        }
    }
    Ok(found)
}

/// Joins the writer's relay `w` and the reader's `r`, both to `body`.
async fn join(node: &Arc<Node>, body: &str, w: &Side, r: &Side) -> Result<()> {
    let token = node.relays.join_token();
    tracing::info!(event = "relay-joining", body = %body, token, writer = w.pid,
        reader = r.pid);
    let (release, release_rx) = oneshot::channel();
    let (done, done_rx) = oneshot::channel();
    w.ctl
        .send(HomeCtl::Join {
            token,
            done,
            release: Some(release_rx),
        })
        .map_err(|_| anyhow!("the writer's relay ended"))?;
    done_rx
        .await
        .map_err(|_| anyhow!("the writer's relay ended during the join"))?
        .context("the writer's relay")?;
    let (done, done_rx) = oneshot::channel();
    let r2 = match r.ctl.send(HomeCtl::Join {
        token,
        done,
        release: None,
    }) {
        Err(_) => Err(anyhow!("the reader's relay ended")),
        Ok(()) => match done_rx.await {
            Ok(r) => r.context("the reader's relay"),
            Err(_) => Err(anyhow!("the reader's relay ended during the join")),
        },
    };
    // The writer's end at home goes only if the join held; else it waits for its node again.
    let _ = release.send(r2.is_ok());
    r2
}
