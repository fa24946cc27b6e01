//! Homes and bodies: what ties a moved tree to the node it left (ferry_deputy explains the
//! deputy itself).
//!
//! At home ([`Deputies`]): the capture worker of a tree that left stays on as the tracer of its
//! deputies. Signals sent to a deputy go to the node running its body (`SignalBody`); a
//! deputy killed at home takes its body with it; the body's end, reported by its node
//! (`BodyStatus`), is passed to the worker, which makes the deputy end the same way. Only the
//! node currently running a body may speak for it; the node a body leaves says where it went
//! (`BodyMoved`).
//!
//! On the body's node ([`Bodies`]): a guest tree's PID namespace init reports every child it
//! reaps on a datagram socket in the data directory (`guests.sock`, root only); the end of a
//! process whose home is elsewhere is sent there.

use crate::node::Node;
use crate::state;
use crate::workers::Worker;
use anyhow::{anyhow, bail, Result};
use ferry_transport::{message::kind, read_msg, write_msg, Frame, Msg};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use tokio::sync::{mpsc, oneshot};

mod calls;
mod ids;
pub use calls::serve_link as serve_calls;
use ids::{body_ids, ids_report, record_ids};

/// The name of the report socket in a daemon's data directory.
pub const REPORT_SOCKET: &str = "guests.sock";

/// What the task serving a tree's deputies is asked to do.
enum Cmd {
    /// Pass this on to the worker (boxed: a `Msg` is large, a `Release` small).
    Msg(Box<Msg>),
    /// The tree is coming home: let its deputies go (`ReleaseDeputies`), and say which.
    Release(oneshot::Sender<Result<Vec<i32>>>),
    /// The body of this deputy forks: fork a deputy from it (`ForkDeputy`), and say its PID.
    Fork(i32, oneshot::Sender<Result<i32>>),
    /// The body of this deputy makes a call only its home answers (`HomeCall`, to be passed on
    /// with this deputy's PID): what it returned, or why it was not made.
    Call(i32, Box<Msg>, oneshot::Sender<calls::Answer>),
}

struct Entry {
    /// The node running the body now.
    body_node: String,
    /// The root of its tree (the deputy's PID, which the tree's own namespace numbers alike).
    root: i32,
    /// Its PID in the tree's own PID namespace, i.e. its body's: not the deputy's for a child
    /// of a `ferry run` program, which lives in a PID namespace of its own
    /// (`ferry_sys::guest_spawn`), where its children are numbered apart from the node.
    own: i32,
    /// The deputies' worker, through the task that owns it.
    to_worker: mpsc::UnboundedSender<Cmd>,
    /// Signals this deputy received and forwarded to its body.
    signals: u64,
    /// Calls this deputy made for its body: forks, and the calls only home answers
    /// (signals to processes at home, `setpgid`, `setsid`).
    calls: u64,
}

/// The deputies of this node: home PID (the deputy's, on this node) -> where its body runs.
/// The body's node speaks of a process by its PID in its tree's own namespace and the tree's
/// root (`BodyStatus`, `SignalBody`), which [`Deputies::deputy_of`] and [`Deputies::own_of`]
/// turn into the deputy's and back.
#[derive(Default)]
pub struct Deputies {
    map: Mutex<HashMap<i32, Entry>>,
}

impl Deputies {
    /// How many deputies this node keeps.
    pub fn count(&self) -> usize {
        self.map.lock().expect("deputies lock").len()
    }

    /// What each tree that left this home costs it: its deputies (one worker serves a tree)
    /// the signals they forwarded and the calls they made for their bodies.
    pub fn costs(&self) -> Vec<ferry_transport::message::HomeCost> {
        let m = self.map.lock().expect("deputies lock");
        let mut trees: Vec<(
            &mpsc::UnboundedSender<Cmd>,
            ferry_transport::message::HomeCost,
        )> = Vec::new();
        let mut pids: Vec<&i32> = m.keys().collect();
        pids.sort();
        for pid in pids {
            let e = &m[pid];
            let i = match trees.iter().position(|(w, _)| w.same_channel(&e.to_worker)) {
                Some(i) => i,
                None => {
                    trees.push((
                        &e.to_worker,
                        ferry_transport::message::HomeCost {
                            body_node: e.body_node.clone(),
                            ..Default::default()
                        },
                    ));
                    trees.len() - 1
                }
            };
            let c = &mut trees[i].1;
            c.pids.push(*pid);
            c.deputies += 1;
            c.signals_forwarded += e.signals;
            *c.calls_forwarded.get_or_insert(0) += e.calls;
        }
        trees.into_iter().map(|(_, c)| c).collect()
    }

    /// Counts a signal deputy `pid` received, to be forwarded.
    fn count_signal(&self, pid: i32) {
        if let Some(e) = self.map.lock().expect("deputies lock").get_mut(&pid) {
            e.signals += 1;
        }
    }

    /// Where the body of deputy `pid` runs, if `pid` is a deputy here.
    pub fn body_node(&self, pid: i32) -> Option<String> {
        let m = self.map.lock().expect("deputies lock");
        m.get(&pid).map(|e| e.body_node.clone())
    }

    /// The deputy of the process that is `pid` in the tree of deputy `root` as the tree numbers
    /// it in its own PID namespace (its body's number; `root` None: `pid` is the deputy's).
    fn deputy_of(m: &HashMap<i32, Entry>, root: Option<i32>, pid: i32) -> Option<i32> {
        let Some(root) = root else {
            return m.contains_key(&pid).then_some(pid);
        };
        let r = m.get(&root)?;
        m.iter()
            .find(|(_, e)| e.own == pid && e.to_worker.same_channel(&r.to_worker))
            .map(|(p, _)| *p)
    }

    /// What the body's node calls deputy `pid`: (its PID in its tree's own namespace, the
    /// tree's root).
    pub fn own_of(&self, pid: i32) -> Option<(i32, i32)> {
        let m = self.map.lock().expect("deputies lock");
        m.get(&pid).map(|e| (e.own, e.root))
    }

    /// Whether some process of the tree of deputy `root` has another PID in the tree's own
    /// namespace than its deputy's (such a tree cannot come home in place of its deputies).
    pub fn renumbered(&self, root: i32) -> bool {
        let m = self.map.lock().expect("deputies lock");
        let Some(r) = m.get(&root) else {
            return false;
        };
        m.iter()
            .any(|(p, e)| e.to_worker.same_channel(&r.to_worker) && e.own != *p)
    }

    /// The body of `pid` ended, says node `from`: its deputy ends the same way. `root`: the
    /// tree's root, `pid` then being the process's PID in the tree's own namespace.
    pub fn body_ended(&self, from: &str, pid: i32, status: i32, root: Option<i32>) -> Result<()> {
        let m = self.map.lock().expect("deputies lock");
        let pid = Self::deputy_of(&m, root, pid).ok_or_else(|| match root {
            Some(r) => anyhow!("PID {pid} of the tree of PID {r} is no deputy here"),
            None => anyhow!("PID {pid} is no deputy here"),
        })?;
        let e = &m[&pid];
        if e.body_node != from {
            bail!(
                "node {from} spoke for PID {pid}, whose body runs on {}",
                e.body_node
            );
        }
        e.to_worker
            .send(Cmd::Msg(Box::new(Msg::BodyStatus {
                pid,
                status,
                root: None,
            })))
            .map_err(|_| anyhow!("the deputies' worker of PID {pid} is gone"))
    }

    /// The deputies of the tree whose root is deputy `pid` (sorted), if its body runs on `from`.
    pub fn tree_of(&self, from: &str, pid: i32) -> Option<Vec<i32>> {
        let m = self.map.lock().expect("deputies lock");
        let e = m.get(&pid).filter(|e| e.body_node == from)?;
        let mut pids: Vec<i32> = m
            .iter()
            .filter(|(_, o)| o.to_worker.same_channel(&e.to_worker))
            .map(|(p, _)| *p)
            .collect();
        pids.sort_unstable();
        Some(pids)
    }

    /// The tree whose root is deputy `pid` is coming home from node `from` (which must be the
    /// one running its body): its deputies are let go, for the restore to rebuild each process
    /// in its place. Returns their PIDs; from then on they are no deputies here.
    pub async fn release(&self, from: &str, pid: i32) -> Result<Vec<i32>> {
        let (tx, rx) = oneshot::channel();
        {
            let m = self.map.lock().expect("deputies lock");
            let e = m
                .get(&pid)
                .ok_or_else(|| anyhow!("PID {pid} is no deputy here"))?;
            if e.body_node != from {
                bail!(
                    "node {from} brought PID {pid} home, whose body runs on {}",
                    e.body_node
                );
            }
            e.to_worker
                .send(Cmd::Release(tx))
                .map_err(|_| anyhow!("the deputies' worker of PID {pid} is gone"))?;
        }
        let pids = tokio::time::timeout(std::time::Duration::from_secs(10), rx)
            .await
            .map_err(|_| anyhow!("the deputies of PID {pid} were not let go within 10 s"))?
            .map_err(|_| anyhow!("the deputies' worker of PID {pid} is gone"))??;
        let mut m = self.map.lock().expect("deputies lock");
        for p in &pids {
            m.remove(p);
        }
        Ok(pids)
    }

    /// The body of deputy `pid`, running on node `from` (which must be the one running it), is
    /// forking: its deputy forks a deputy for the child, whose PID is returned (the body's
    /// child is to have the same one). From then on it is a deputy of the tree like the others.
    pub async fn fork(&self, from: &str, pid: i32, root: Option<i32>) -> Result<i32> {
        let (tx, rx) = oneshot::channel();
        self.to_deputy(from, pid, root, "forked from", |d| Cmd::Fork(d, tx))
            .await?;
        let child = tokio::time::timeout(std::time::Duration::from_secs(10), rx)
            .await
            .map_err(|_| anyhow!("no deputy was forked from PID {pid} within 10 s"))?
            .map_err(|_| anyhow!("the deputies' worker of PID {pid} is gone"))??;
        // The body's node numbers it as the tree's own namespace does.
        Ok(match root {
            Some(_) => self.own_of(child).map_or(child, |(own, _)| own),
            None => child,
        })
    }

    /// Sends the deputy of `pid` (as in [`Deputies::fork`]) the command `cmd` makes from its
    /// PID, once its body is known to run on `from`. A body in the lazy phase of its move calls
    /// before its home knows it there: the original is still frozen at the source, not yet a
    /// deputy (a move from home), or the deputy still names the node the body left (a move on,
    /// told by `BodyMoved` once the phase is over). The command waits for that, as long as a
    /// lazy phase may last. `what`: what the body did, for the error.
    async fn to_deputy(
        &self,
        from: &str,
        pid: i32,
        root: Option<i32>,
        what: &str,
        cmd: impl FnOnce(i32) -> Cmd,
    ) -> Result<()> {
        let mut cmd = Some(cmd);
        let waited = std::time::Instant::now();
        loop {
            let not_yet = {
                let m = self.map.lock().expect("deputies lock");
                match Self::deputy_of(&m, root, pid).map(|d| (d, &m[&d])) {
                    None => anyhow!("PID {pid} is no deputy here"),
                    Some((_, e)) if e.body_node != from => anyhow!(
                        "node {from} {what} PID {pid}, whose body runs on {}",
                        e.body_node
                    ),
                    Some((d, e)) => {
                        let make = cmd.take().expect("sent once");
                        e.to_worker
                            .send(make(d))
                            .map_err(|_| anyhow!("the deputies' worker of PID {pid} is gone"))?;
                        drop(m);
                        if let Some(e) = self.map.lock().expect("deputies lock").get_mut(&d) {
                            e.calls += 1;
                        }
                        return Ok(());
                    }
                }
            };
            if waited.elapsed() >= FORK_WAITS_FOR_HOME {
                return Err(not_yet);
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    }

    /// The tree of deputy `pid` left node `from` for `to`.
    pub fn body_moved(&self, from: &str, pid: i32, to: &str) -> Result<()> {
        let mut m = self.map.lock().expect("deputies lock");
        let e = m
            .get(&pid)
            .ok_or_else(|| anyhow!("PID {pid} is no deputy here"))?;
        if e.body_node != from {
            bail!(
                "node {from} moved PID {pid}, whose body runs on {}",
                e.body_node
            );
        }
        // The whole tree moved: every deputy served by the same worker.
        let worker = e.to_worker.clone();
        for e in m.values_mut() {
            if e.to_worker.same_channel(&worker) {
                e.body_node = to.to_string();
            }
        }
        Ok(())
    }
}

/// Takes over a capture worker that has just made deputies of `pids` (the tree of `root`, whose
/// body now runs on `body_node`), and serves them until the last one ends.
/// `every`: the tree's own checkpoint interval in seconds (0: never), overriding the node's.
pub fn adopt(
    node: Arc<Node>,
    mut worker: Worker,
    root: i32,
    mut pids: Vec<i32>,
    body_node: String,
    every: Option<f64>,
) {
    let (tx, mut rx) = mpsc::unbounded_channel();
    // Each deputy's PID in the tree's own namespace, read while it is parked (a child of a
    // `ferry run` program has another there: its body's).
    let own: Vec<(i32, i32)> = pids
        .iter()
        .filter_map(|&p| inner_pid(p).filter(|&i| i != p).map(|i| (p, i)))
        .collect();
    {
        let mut m = node.deputies.map.lock().expect("deputies lock");
        for &p in &pids {
            let own = own.iter().find(|(d, _)| *d == p).map_or(p, |(_, i)| *i);
            m.insert(
                p,
                Entry {
                    body_node: body_node.clone(),
                    root,
                    own,
                    to_worker: tx.clone(),
                    signals: 0,
                    calls: 0,
                },
            );
        }
    }
    drop(tx);
    // Recorded: should this daemon die, the worker keeps the deputies and waits for the next
    // one, which takes them up again from this record (see `recover`).
    let record = DeputyRecord {
        root,
        pids: pids.clone(),
        body_node: body_node.clone(),
        worker_pid: worker.pid,
        worker_start: state::start_time(worker.pid).unwrap_or(0),
        checkpoint_every_secs: every,
        own: own.clone(),
    };
    node.store
        .put_or_log(state::DEPUTY, &root.to_string(), &record);
    tracing::info!(event = "deputies", root, pids = ?pids, body = %body_node);
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
        let mut body_lost = false;
        let me = node.name().to_string();
        let mut checkpointed = std::time::Instant::now();
        let checkpointing = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut releasing: Option<oneshot::Sender<Result<Vec<i32>>>> = None;
        // Forks asked of the worker, answered in order.
        let mut forking: std::collections::VecDeque<(i32, oneshot::Sender<Result<i32>>)> =
            Default::default();
        // The root's parent, group and session at home, as its body's node last heard them:
        // a change (its parent died, a setpgid from home) is told there (`BodyIds`). Not for a
        // tree numbered apart from this node (a `ferry run` program's: its numbers here are
        // not those its body knows).
        // What the body's node was last told, and whether a telling is on its way (one that
        // fails is tried again at the next tick).
        let told = Arc::new(Mutex::new(
            crate::migrate::home_ids(root).filter(|_| own.is_empty()),
        ));
        let telling = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let tell_tries = Arc::new(std::sync::atomic::AtomicU32::new(0));
        // Calls asked of the worker, answered in order.
        let mut calling: std::collections::VecDeque<(i32, oneshot::Sender<calls::Answer>)> =
            Default::default();
        loop {
            tokio::select! {
                _ = tick.tick() => {
                    // The body's node dead (declared down by the membership, the verdict
                    // standing and the node silent: Node::is_dead): the body is gone, and its
                    // deputy ends as a process killed by SIGKILL would. A verdict alone is not
                    // enough: a daemon starved for a few seconds is declared down while its
                    // guests run on.
                    let body = node.deputies.body_node(root);
                    let dead = match body.as_deref() {
                        Some(b) if !body_lost && node.membership.is_down(b) => {
                            node.is_dead(b).await
                        }
                        _ => false,
                    };
                    if dead {
                        // Whatever becomes of the tree here, its body there must not run on
                        // should that node come back (crate::recovery::fence).
                        let b = body.clone().unwrap_or_default();
                        let tree = node.deputies.tree_of(&b, root).unwrap_or_else(|| pids.clone());
                        // As the body's node numbers them.
                        let tree = tree
                            .iter()
                            .map(|&p| own.iter().find(|(d, _)| *d == p).map_or(p, |(_, i)| *i))
                            .collect();
                        if let Err(e) = crate::recovery::condemn(&node, &b, root, tree) {
                            tracing::error!(event = "fence-unrecorded", root,
                                error = %format!("{e:#}"));
                        }
                        // Its last image, if it has one, runs on elsewhere or here
                        // (crate::recovery).
                        match crate::recovery::recover_anywhere(&node, root, &b).await {
                            Ok(_) => continue,
                            Err(e) => tracing::warn!(event = "recovery-failed", root,
                                error = %format!("{e:#}")),
                        }
                    }
                    let busy = telling.load(std::sync::atomic::Ordering::Relaxed);
                    if let (Some(b), false) = (&body, dead || body_lost || busy) {
                        let now = crate::migrate::home_ids(root);
                        let changed = match (&*told.lock().expect("told lock"), &now) {
                            (Some(a), Some(n)) => {
                                (a.ppid, a.pgid, a.sid) != (n.ppid, n.pgid, n.sid)
                            }
                            _ => false,
                        };
                        if let (true, Some(n)) = (changed, now) {
                            tracing::info!(event = "deputy-ids", root, ppid = n.ppid,
                                pgid = n.pgid, sid = n.sid, body = %b);
                            telling.store(true, std::sync::atomic::Ordering::Relaxed);
                            let (node, b) = (node.clone(), b.clone());
                            let (told, telling) = (told.clone(), telling.clone());
                            let tries = tell_tries.clone();
                            tokio::spawn(async move {
                                use std::sync::atomic::Ordering::Relaxed;
                                let msg = Msg::BodyIds { pid: root, ids: n.clone() };
                                match ask(&node, &b, msg).await {
                                    Ok(()) => {
                                        tries.store(0, Relaxed);
                                        *told.lock().expect("told lock") = Some(n);
                                    }
                                    Err(e) => {
                                        // Tried again each second, for half a minute.
                                        let t = tries.fetch_add(1, Relaxed) + 1;
                                        if t == 1 || t >= 30 {
                                            tracing::warn!(event = "body-ids-failed", root,
                                                tries = t, error = %format!("{e:#}"));
                                        }
                                        if t >= 30 {
                                            tries.store(0, Relaxed);
                                            *told.lock().expect("told lock") = Some(n);
                                        }
                                    }
                                }
                                telling.store(false, Relaxed);
                            });
                        }
                    }
                    let every = match every {
                        Some(s) => crate::config::interval(Some(s)),
                        None => node.config.checkpoint_every(),
                    };
                    if let (Some(every), Some(b)) = (every, &body) {
                        let busy = checkpointing.load(std::sync::atomic::Ordering::Relaxed);
                        if !dead && !body_lost && *b != me && !busy
                            && checkpointed.elapsed() >= every
                        {
                            checkpointed = std::time::Instant::now();
                            checkpointing.store(true, std::sync::atomic::Ordering::Relaxed);
                            let (node, b, flag) = (node.clone(), b.clone(), checkpointing.clone());
                            tokio::spawn(async move {
                                match crate::recovery::checkpoint(&node, root, &b).await {
                                    Ok(bytes) => tracing::info!(event = "checkpoint-taken",
                                        root, body = %b, bytes),
                                    Err(e) => tracing::warn!(event = "checkpoint-failed",
                                        root, body = %b, error = %format!("{e:#}")),
                                }
                                flag.store(false, std::sync::atomic::Ordering::Relaxed);
                            });
                        }
                    }
                    if dead {
                        body_lost = true;
                        tracing::warn!(event = "body-node-down", root, body = ?body);
                        let lost = Msg::BodyStatus { pid: root, status: libc::SIGKILL, root: None };
                        if let Err(e) = write_msg(&mut worker.tx, &lost).await {
                            tracing::warn!(event = "deputies-worker-gone", root, error = %e);
                        }
                    }
                }
                frame = worker.next_frame() => match frame {
                    Ok(Frame::Msg(Msg::DeputySignal { pid, sig, queued })) => {
                        node.deputies.count_signal(pid);
                        node.metrics.signal_forwarded();
                        let node = node.clone();
                        tokio::spawn(async move {
                            if let Err(e) = signal_body(&node, pid, sig, queued).await {
                                tracing::warn!(event = "signal-body-failed", pid, sig,
                                    error = %format!("{e:#}"));
                            }
                        });
                    }
                    Ok(Frame::Msg(Msg::DeputyEnded { pid, status, mirrored })) => {
                        tracing::info!(event = "deputy-ended", pid, status, mirrored);
                        if !mirrored {
                            // Killed at home: its body goes too.
                            if let Err(e) = signal_body(&node, pid, libc::SIGKILL, None).await {
                                tracing::warn!(event = "signal-body-failed", pid,
                                    error = %format!("{e:#}"));
                            }
                        }
                        node.deputies.map.lock().expect("deputies lock").remove(&pid);
                    }
                    Ok(Frame::Msg(Msg::DeputyForked { parent, pid })) => {
                        let asked = forking.iter().position(|(p, _)| *p == parent)
                            .and_then(|i| forking.remove(i));
                        let entry = {
                            let mut m = node.deputies.map.lock().expect("deputies lock");
                            // Numbered in the tree's own namespace as its body's child will be.
                            let own = inner_pid(pid).unwrap_or(pid);
                            let e = m.get(&parent).map(|e| Entry {
                                body_node: e.body_node.clone(),
                                root: e.root,
                                own,
                                to_worker: e.to_worker.clone(),
                                signals: 0,
                                calls: 0,
                            });
                            e.map(|e| m.insert(pid, e)).is_some()
                        };
                        if entry {
                            pids.push(pid);
                            let own = inner_pid(pid).filter(|&i| i != pid);
                            record_forked(&node, root, pid, own);
                            tracing::info!(event = "deputy-forked", root, parent, pid);
                        }
                        if let Some((_, tx)) = asked {
                            let r = if entry {
                                Ok(pid)
                            } else {
                                Err(anyhow!("deputy {parent} is gone"))
                            };
                            let _ = tx.send(r);
                        }
                    }
                    Ok(Frame::Msg(Msg::ForkRefused { parent, message })) => {
                        let asked = forking.iter().position(|(p, _)| *p == parent)
                            .and_then(|i| forking.remove(i));
                        tracing::warn!(event = "deputy-fork-refused", root, parent,
                            error = %message);
                        if let Some((_, tx)) = asked {
                            let _ = tx.send(Err(anyhow!("{message}")));
                        }
                    }
                    Ok(Frame::Msg(Msg::HomeCalled { pid, ret, error })) => {
                        let asked = calling.iter().position(|(p, _)| *p == pid)
                            .and_then(|i| calling.remove(i));
                        if let Some((_, tx)) = asked {
                            let _ = tx.send(match error {
                                None => Ok(ret),
                                Some(e) => Err(e),
                            });
                        }
                    }
                    Ok(Frame::Msg(Msg::DeputiesReleased { pids })) => {
                        tracing::info!(event = "deputies-released", root, pids = ?pids);
                        if let Some(tx) = releasing.take() {
                            let _ = tx.send(Ok(pids));
                        }
                    }
                    Ok(Frame::Msg(Msg::Error { message })) if releasing.is_some() => {
                        if let Some(tx) = releasing.take() {
                            let _ = tx.send(Err(anyhow!("{message}")));
                        }
                    }
                    Ok(other) => tracing::warn!(event = "deputies-worker", root,
                        frame = %format!("{other:?}").chars().take(60).collect::<String>()),
                    Err(_) => break,
                },
                cmd = rx.recv() => match cmd {
                    Some(Cmd::Msg(m)) => {
                        if let Err(e) = write_msg(&mut worker.tx, &m).await {
                            tracing::warn!(event = "deputies-worker-gone", root, error = %e);
                        }
                    }
                    Some(Cmd::Fork(parent, tx)) => {
                        let ask = Msg::ForkDeputy { pid: parent, root: None };
                        match write_msg(&mut worker.tx, &ask).await {
                            Ok(()) => forking.push_back((parent, tx)),
                            Err(e) => {
                                let _ = tx.send(Err(anyhow!("the deputies' worker: {e}")));
                            }
                        }
                    }
                    Some(Cmd::Call(deputy, msg, tx)) => {
                        match write_msg(&mut worker.tx, &msg).await {
                            Ok(()) => calling.push_back((deputy, tx)),
                            Err(e) => {
                                let _ = tx.send(Err(format!("the deputies' worker: {e}")));
                            }
                        }
                    }
                    Some(Cmd::Release(tx)) => {
                        match write_msg(&mut worker.tx, &Msg::ReleaseDeputies).await {
                            Ok(()) => releasing = Some(tx),
                            Err(e) => {
                                let _ = tx.send(Err(anyhow!("the deputies' worker: {e}")));
                            }
                        }
                    }
                    None => break,
                },
            }
        }
        // The worker is gone (every deputy ended, it let them go, or it died and they with it).
        if let Some(tx) = releasing.take() {
            let _ = tx.send(Err(anyhow!("the deputies' worker of PID {root} ended")));
        }
        {
            let mut m = node.deputies.map.lock().expect("deputies lock");
            for p in &pids {
                m.remove(p);
            }
        }
        node.store.remove_or_log(state::DEPUTY, &root.to_string());
        crate::recovery::forget(&node, root);
        node.relays.forget_tree(root);
        tracing::info!(event = "deputies-done", root);
    });
}

/// Where the deputies' workers of this node wait for its next daemon (`ROOT.sock`).
pub fn deputies_dir(node: &Node) -> PathBuf {
    node.config.data_dir.join("deputies")
}

/// The deputies of a tree that left this home, as recorded (crate::state::DEPUTY, by the root's
/// PID) for this daemon's successor.
#[derive(Serialize, Deserialize)]
struct DeputyRecord {
    root: i32,
    pids: Vec<i32>,
    /// Where the body runs (kept up to date as it moves on).
    body_node: String,
    /// Their worker (their tracer), and its start time.
    worker_pid: i32,
    worker_start: u64,
    /// The tree's own checkpoint interval (`ferry run --checkpoint-every`; 0: never), else
    /// the node's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    checkpoint_every_secs: Option<f64>,
    /// (deputy, its PID in the tree's own namespace) for each deputy numbered apart there.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    own: Vec<(i32, i32)>,
}

/// Deputy `pid` was forked in the tree of `root`: its record lists it, so that a restarted
/// daemon takes it up again with the others.
fn record_forked(node: &Node, root: i32, pid: i32, own: Option<i32>) {
    for (key, mut r) in node.store.load::<DeputyRecord>(state::DEPUTY) {
        if r.root == root && !r.pids.contains(&pid) {
            r.pids.push(pid);
            if let Some(own) = own {
                r.own.push((pid, own));
            }
            node.store.put_or_log(state::DEPUTY, &key, &r);
        }
    }
}

/// The tree of deputy `pid` left node `from` for `to` (see [`Deputies::body_moved`]); its
/// record follows.
pub fn moved(node: &Node, from: &str, pid: i32, to: &str) -> Result<()> {
    node.deputies.body_moved(from, pid, to)?;
    for (key, mut r) in node.store.load::<DeputyRecord>(state::DEPUTY) {
        if r.pids.contains(&pid) {
            r.body_node = to.to_string();
            node.store.put_or_log(state::DEPUTY, &key, &r);
        }
    }
    Ok(())
}

/// Takes up, at start, what an earlier run of this daemon left:
/// - bodies: every migrated guest listed again (crate::guests) is a body again, so that its
///   home can signal it and hears of its end;
/// - deputies: their worker outlived its daemon and listens on `deputies_dir/ROOT.sock`; it is
///   reached there and adopted again (what happened meanwhile, signals sent to a deputy, a
///   deputy killed, it tells first). A worker that is gone took its deputies with it
///   (PTRACE_O_EXITKILL; their parents saw SIGKILL): their bodies are killed too, as when a
///   deputy is killed at home.
pub fn recover(node: &Arc<Node>) {
    for g in node.guests.list() {
        if g.kind == "migrated" {
            node.bodies.add(g.pid, &g.home_node, g.home_pid);
            watch_supervisor(node.clone(), g.pid);
        }
    }
    for (key, r) in node.store.load::<DeputyRecord>(state::DEPUTY) {
        let node = node.clone();
        tokio::spawn(async move {
            if state::start_time(r.worker_pid) == Some(r.worker_start) {
                let sock = deputies_dir(&node).join(format!("{}.sock", r.root));
                // It listens once it has noticed its daemon's end (within half a second).
                let mut tries = 0;
                loop {
                    match Worker::connect(r.worker_pid, &sock).await {
                        Ok(w) => {
                            // Those that ended before the daemon died are no longer traced.
                            let pids: Vec<i32> = r
                                .pids
                                .iter()
                                .copied()
                                .filter(|&p| tracer_of(p) == Some(r.worker_pid))
                                .collect();
                            tracing::warn!(event = "deputies-recovered", root = r.root,
                                pids = ?pids, body = %r.body_node, worker = r.worker_pid);
                            adopt(node, w, r.root, pids, r.body_node, r.checkpoint_every_secs);
                            return;
                        }
                        Err(e) if tries >= 50 => {
                            tracing::error!(event = "deputies-unreachable", root = r.root,
                                error = %format!("{e:#}"));
                            break;
                        }
                        Err(_) => {
                            tries += 1;
                            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                        }
                    }
                }
            }
            tracing::warn!(event = "deputies-lost", root = r.root, pids = ?r.pids,
                body = %r.body_node, "their worker is gone, and they with it: their bodies go too");
            let since = std::time::Instant::now();
            while node.membership.find(&r.body_node).is_none()
                && r.body_node != node.name()
                && since.elapsed() < std::time::Duration::from_secs(20)
            {
                tokio::time::sleep(std::time::Duration::from_millis(300)).await;
            }
            for &pid in &r.pids {
                // As the body's node numbers it.
                let own = r.own.iter().find(|(d, _)| *d == pid).map(|(_, i)| *i);
                let kill = Msg::SignalBody {
                    pid: own.unwrap_or(pid),
                    sig: libc::SIGKILL,
                    queued: None,
                    root: own.map(|_| r.root),
                };
                if let Err(e) = ask(&node, &r.body_node, kill).await {
                    tracing::warn!(event = "orphan-body-unkilled", pid, body = %r.body_node,
                        error = %format!("{e:#}"));
                }
            }
            node.store.remove_or_log(state::DEPUTY, &key);
        });
    }
}

/// The tracer of `pid` (/proc/PID/status TracerPid), if it has one.
fn tracer_of(pid: i32) -> Option<i32> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix("TracerPid:"))?
        .trim()
        .parse()
        .ok()
        .filter(|&t| t != 0)
}

/// Asks the node running the body of `pid` to deliver `sig` to it.
async fn signal_body(
    node: &Node,
    pid: i32,
    sig: i32,
    queued: Option<ferry_transport::message::SigQueued>,
) -> Result<()> {
    let to = node
        .deputies
        .body_node(pid)
        .ok_or_else(|| anyhow!("PID {pid} is no deputy here"))?;
    // The body's node knows it by its PID in its tree's own namespace.
    let (own, root) = node.deputies.own_of(pid).unwrap_or((pid, pid));
    let msg = Msg::SignalBody {
        pid: own,
        sig,
        queued,
        root: (own != pid).then_some(root),
    };
    // A daemon just restarted may not know the body's node yet (its membership fills within
    // a gossip round or two): the signal waits for it rather than being dropped (a ^Z typed
    // at home right after a restart of its daemon).
    let until = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    while to != node.name()
        && node.membership.find(&to).is_none()
        && tokio::time::Instant::now() < until
    {
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    ask(node, &to, msg).await
}

/// Sends `msg` to node `to` on a connection of its own and waits for `Done` (or its error).
pub async fn ask(node: &Node, to: &str, msg: Msg) -> Result<()> {
    if to == node.name() {
        // A body back at its home node (in guest namespaces there).
        return match serve_peer(node, to, msg).await {
            Msg::Error { message } => bail!("{message}"),
            _ => Ok(()),
        };
    }
    let mut conn = node.dial(to).await?;
    write_msg(&mut conn.stream, &msg).await?;
    match read_msg(&mut conn.stream).await {
        Ok(Msg::Done) => Ok(()),
        Ok(Msg::Error { message }) => bail!("node {to}: {message}"),
        Ok(other) => bail!("node {to} answered {}", kind(&other)),
        Err(e) => bail!("node {to} did not answer: {e}"),
    }
}

/// The guest trees running here for other homes, by the PID namespace they run in.
#[derive(Default)]
pub struct Bodies {
    /// "pid:[inode]" -> (home node, home PID of the root).
    map: Mutex<HashMap<String, (String, i32)>>,
    /// (home, PID) -> the stop signal its home sent, delivered here as SIGSTOP (see
    /// [`Bodies::stop_signal`]); its stop is reported home as that signal's.
    stop_alias: Mutex<HashMap<(String, i32), i32>>,
    /// "pid:[inode]" -> per process of the tree (its PID there): the calls its supervisor
    /// answered and the nanoseconds it spent on them, as the guest init last reported.
    calls: Mutex<HashMap<String, CallCounts>>,
    /// "pid:[inode]" -> (home node, home PID of the root), kept until the namespace's guest
    /// init is gone (`map` forgets a tree as its root ends, while processes it forked may run
    /// on there): what a fence kills ([`Bodies::fence`]).
    held: Mutex<HashMap<String, (String, i32)>>,
    /// Connections to homes kept open for the bodies' calls (`HomeCall`), by home node.
    call_links: calls::Links,
    /// "pid:[inode]" -> the socket its guest init listens on for its root's new identities at
    /// home (`BodyIds`), given by the init ("NS watch").
    watchers: Mutex<HashMap<String, std::os::fd::OwnedFd>>,
}

/// Per thread of a body (its TID there): calls answered, and nanoseconds spent on them.
type CallCounts = HashMap<i32, (u64, u64)>;

fn pid_ns(pid: i32) -> Option<String> {
    std::fs::read_link(format!("/proc/{pid}/ns/pid"))
        .ok()
        .map(|p| p.to_string_lossy().into_owned())
}

/// The last number of `NSpid` in /proc/PID/status: the process's PID in its own namespace.
fn inner_pid(pid: i32) -> Option<i32> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix("NSpid:"))?
        .split_whitespace()
        .last()?
        .parse()
        .ok()
}

impl Bodies {
    /// Records the guest tree whose root runs here as `host_pid`, at home on `home` as `home_pid`.
    pub fn add(&self, host_pid: i32, home: &str, home_pid: i32) {
        if let Some(ns) = pid_ns(host_pid) {
            self.held
                .lock()
                .expect("bodies lock")
                .insert(ns.clone(), (home.to_string(), home_pid));
            self.map
                .lock()
                .expect("bodies lock")
                .insert(ns, (home.to_string(), home_pid));
        }
    }

    /// The PID namespace ("pid:[inode]") of the body of the tree whose root is `root` from
    /// `home`, while anything of it may still run here.
    pub fn namespace_of(&self, home: &str, root: i32) -> Option<String> {
        let held = self.held.lock().expect("bodies lock");
        held.iter()
            .find(|(_, (h, r))| h == home && *r == root)
            .map(|(ns, _)| ns.clone())
    }

    /// Kills the whole body of the tree whose root is `root` from `home`, as it is now: the init
    /// of its guest PID namespace, whose death takes every process of the namespace with it
    /// (the kernel's rule), those the body forked since it left home (which have no PID at
    /// home) included. Waits up to 5 s for the namespace to empty. Returns the processes (their
    /// PIDs here) that were in it. Err if no such body is known here, if it does not run in a
    /// namespace of its own (this daemon's is never killed whole), or if its init could not be
    /// killed.
    pub async fn fence(&self, home: &str, root: i32) -> Result<Vec<i32>> {
        let ns = self
            .namespace_of(home, root)
            .ok_or_else(|| anyhow!("no body of PID {root} from {home} runs here"))?;
        if pid_ns(std::process::id() as i32).as_deref() == Some(ns.as_str()) {
            bail!("the body of PID {root} from {home} runs in this node's own PID namespace");
        }
        let members = in_namespace(&ns);
        // Forgotten first: the init's death is this kill, not news for its home.
        self.map.lock().expect("bodies lock").remove(&ns);
        self.calls.lock().expect("bodies lock").remove(&ns);
        self.held.lock().expect("bodies lock").remove(&ns);
        let Some(init) = init_of(&ns) else {
            // Its init is gone: so is everything it held.
            return Ok(members);
        };
        // A namespace's name is reused once it is gone: only a guest init of ours is killed.
        let cmdline = std::fs::read(format!("/proc/{init}/cmdline")).unwrap_or_default();
        if !cmdline.split(|b| *b == 0).any(|a| a == b"__guest-init") {
            bail!(
                "PID {init}, the init of {ns} where the body of PID {root} from {home} ran, is \
                 no guest init: not killed"
            );
        }
        let fd = ferry_sys::pidfd::pidfd_open(init)
            .and_then(|fd| ferry_sys::pidfd::pidfd_send_signal(&fd, libc::SIGKILL).map(|()| fd))
            .map_err(|e| {
                anyhow!(
                    "kill the guest init (PID {init}) of the body of PID {root} from {home}: {e}"
                )
            })?;
        use std::os::fd::AsRawFd;
        // A pidfd reads as ready once its process has exited; a namespace's init exits only
        // once every other process of it has.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while !ferry_sys::ns::poll_in(&[fd.as_raw_fd()], 0).is_ok_and(|r| r[0]) {
            if std::time::Instant::now() > deadline {
                // Every process of the namespace has SIGKILL pending (the kernel sent it as
                // the init died): none runs its code again, though one stuck in the kernel
                // may take a while to go.
                tracing::warn!(event = "body-fence-slow", home = %home, pid = root, init,
                    "the body's namespace has not emptied within 5 s of SIGKILL");
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        Ok(members)
    }

    /// Forgets the tree whose root runs here as `host_pid` (it leaves, or is gone).
    pub fn forget(&self, host_pid: i32) {
        if let Some(ns) = pid_ns(host_pid) {
            self.map.lock().expect("bodies lock").remove(&ns);
            self.calls.lock().expect("bodies lock").remove(&ns);
            self.held.lock().expect("bodies lock").remove(&ns);
        }
    }

    /// A guest init's count: "NS calls PID CALLS NANOS". False if `line` is not one.
    fn count(&self, line: &str) -> bool {
        let f: Vec<&str> = line.split_whitespace().collect();
        let [ns, "calls", pid, calls, nanos] = f[..] else {
            return false;
        };
        let (Ok(pid), Ok(calls), Ok(nanos)) = (pid.parse(), calls.parse(), nanos.parse()) else {
            return true;
        };
        if self.map.lock().expect("bodies lock").contains_key(ns) {
            self.calls
                .lock()
                .expect("bodies lock")
                .entry(ns.to_string())
                .or_default()
                .insert(pid, (calls, nanos));
        }
        true
    }

    /// The calls forwarded by the tree whose root runs here as `host_pid`, and the time spent
    /// answering them (nanoseconds).
    pub fn forwarded(&self, host_pid: i32) -> (u64, u64) {
        let Some(ns) = pid_ns(host_pid) else {
            return (0, 0);
        };
        let calls = self.calls.lock().expect("bodies lock");
        calls.get(&ns).map_or((0, 0), |per| {
            per.values()
                .fold((0, 0), |(c, t), (c2, t2)| (c + c2, t + t2))
        })
    }

    /// The host PID of the process whose PID is `pid` in the guest tree at home on `home` (in
    /// the tree whose root is home PID `root` only, if given).
    pub fn host_pid(&self, home: &str, pid: i32, root: Option<i32>) -> Option<i32> {
        let namespaces: Vec<String> = {
            let m = self.map.lock().expect("bodies lock");
            m.iter()
                .filter(|(_, (h, r))| h == home && root.is_none_or(|root| root == *r))
                .map(|(ns, _)| ns.clone())
                .collect()
        };
        if namespaces.is_empty() {
            return None;
        }
        let dir = std::fs::read_dir("/proc").ok()?;
        dir.flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
            .find(|&host| {
                inner_pid(host) == Some(pid)
                    && pid_ns(host).is_some_and(|n| namespaces.contains(&n))
            })
    }

    /// The signal to deliver here for `sig` sent to the body `host` at home on `home` as `pid`.
    /// A body's process group is orphaned here (its parent is its namespace's init, in another
    /// session), and the kernel discards SIGTSTP, SIGTTIN and SIGTTOU sent to an orphaned group
    /// whose action is the default: such a stop is delivered as SIGSTOP, and reported home as
    /// the signal that was sent.
    fn stop_signal(&self, home: &str, pid: i32, host: i32, sig: i32) -> i32 {
        if ![libc::SIGTSTP, libc::SIGTTIN, libc::SIGTTOU].contains(&sig) {
            return sig;
        }
        let mask = |key: &str| -> u64 {
            std::fs::read_to_string(format!("/proc/{host}/status"))
                .ok()
                .and_then(|s| {
                    let v = s
                        .lines()
                        .find_map(|l| l.strip_prefix(key))?
                        .trim()
                        .to_string();
                    u64::from_str_radix(&v, 16).ok()
                })
                .unwrap_or(0)
        };
        let bit = 1u64 << (sig - 1);
        if (mask("SigCgt:") | mask("SigIgn:")) & bit != 0 {
            return sig;
        }
        self.stop_alias
            .lock()
            .expect("bodies lock")
            .insert((home.to_string(), pid), sig);
        libc::SIGSTOP
    }

    /// A report from a guest init: `ns pid status`. Returns the home to tell and what.
    fn report(&self, line: &str) -> Option<(String, Msg)> {
        let mut it = line.split_whitespace();
        let (ns, pid, mut status): (&str, i32, i32) = (
            it.next()?,
            it.next()?.parse().ok()?,
            it.next()?.parse().ok()?,
        );
        let mut m = self.map.lock().expect("bodies lock");
        let (home, root) = m.get(ns)?.clone();
        let ended = status & 0x7f != 0x7f && status != 0xffff;
        if pid == root && ended {
            m.remove(ns);
            self.calls.lock().expect("bodies lock").remove(ns);
            self.watchers.lock().expect("bodies lock").remove(ns);
        }
        if status & 0xff == 0x7f && (status >> 8) & 0xff == libc::SIGSTOP {
            let alias = self
                .stop_alias
                .lock()
                .expect("bodies lock")
                .remove(&(home.clone(), pid));
            if let Some(sig) = alias {
                status = 0x7f | (sig << 8);
            }
        }
        // `pid` is the process's number in its tree's namespace: its home finds its deputy by
        // it and the root.
        Some((
            home,
            Msg::BodyStatus {
                pid,
                status,
                root: Some(root),
            },
        ))
    }
}

/// Serves the report socket: every process a guest init reaps whose home is elsewhere is
/// reported to its home.
/// Sends `word` to the guest init waiting on `answer` for body `pid`, without blocking: an
/// init that no longer waits (killed, or gone on) must not hold up the reports, so its refusal
/// is only logged, under `event`.
fn answer_init(answer: &std::os::fd::OwnedFd, word: &str, event: &'static str, pid: i32) {
    use std::os::fd::AsRawFd;
    if let Err(e) = ferry_sys::sockets::send(
        answer.as_raw_fd(),
        word.as_bytes(),
        None,
        &[],
        libc::MSG_DONTWAIT,
    ) {
        tracing::warn!(event, pid, error = %e, "the guest init did not wait for its answer");
    }
}

pub async fn serve_reports(node: Arc<Node>, sock: tokio::net::UnixDatagram) {
    use std::os::fd::AsRawFd;
    loop {
        // With its descriptors: a fork's question carries the socket its answer goes to.
        let got = sock
            .async_io(tokio::io::Interest::READABLE, || {
                ferry_sys::sockets::recv(sock.as_raw_fd(), 512, libc::MSG_DONTWAIT)
                    .map_err(|e| std::io::Error::from_raw_os_error(e.errno))
            })
            .await;
        let (line, mut rights) = match got {
            Ok(r) => (String::from_utf8_lossy(&r.data).into_owned(), r.rights),
            Err(e) => {
                tracing::warn!(error = %e, "guest report socket");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                continue;
            }
        };
        if node.bodies.count(&line) {
            continue;
        }
        if let Some((ns, text)) = line.split_once(" log ") {
            // A guest init's own log (its stderr is /dev/null).
            tracing::warn!(event = "guest-init", ns = %ns, message = %text.trim());
            continue;
        }
        if let Some((ns, pid)) = fork_question(&line) {
            let Some(answer) = rights.pop() else {
                tracing::warn!(event = "body-fork", report = %line.trim(),
                    "a fork's question without the socket for its answer");
                continue;
            };
            let node = node.clone();
            tokio::spawn(async move {
                let r = fork_for_body(&node, &ns, pid).await;
                let word = match &r {
                    Ok(child) => format!("P{child}"),
                    Err(e) => {
                        tracing::warn!(event = "body-fork-refused", ns = %ns, pid,
                            error = %format!("{e:#}"));
                        format!("E{e:#}")
                    }
                };
                answer_init(&answer, &word, "body-fork", pid);
            });
            continue;
        }
        if let Some(q) = calls::question(&line) {
            let Some(answer) = rights.pop() else {
                tracing::warn!(event = "body-call", report = %line.trim(),
                    "a call's question without the socket for its answer");
                continue;
            };
            let node = node.clone();
            tokio::spawn(async move { calls::answer_body(&node, q, answer).await });
            continue;
        }
        if let Some((ns, ppid, pgid, sid)) = ids_report(&line) {
            // The root's group or session at home changed (a setpgid or setsid of its own,
            // made there too): its next move carries the new ones.
            record_ids(&node, &ns, ppid, pgid, sid);
            continue;
        }
        if let [ns, "watch"] = line.split_whitespace().collect::<Vec<_>>()[..] {
            match rights.pop() {
                Some(fd) => {
                    node.bodies
                        .watchers
                        .lock()
                        .expect("bodies lock")
                        .insert(ns.to_string(), fd);
                }
                None => tracing::warn!(event = "body-watch", ns = %ns,
                    "a guest init's watch without its socket"),
            }
            continue;
        }
        let Some((home, msg)) = node.bodies.report(&line) else {
            continue;
        };
        let node = node.clone();
        tokio::spawn(async move {
            tracing::info!(event = "body-ended", home = %home, report = %line.trim());
            if home == node.name() {
                if let Msg::BodyStatus { pid, status, root } = msg {
                    let me = node.name().to_string();
                    if let Err(e) = node.deputies.body_ended(&me, pid, status, root) {
                        tracing::debug!(error = %format!("{e:#}"), "body report");
                    }
                }
                return;
            }
            // A home restarting takes its deputies up again within a few seconds: until it
            // hears this, its deputy's parent waits for it.
            let mut tries = 0;
            while let Err(e) = ask(&node, &home, msg.clone()).await {
                tries += 1;
                if tries >= REPORT_TRIES || node.is_dead(&home).await {
                    tracing::warn!(event = "report-home-failed", home = %home,
                        error = %format!("{e:#}"));
                    break;
                }
                tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            }
        });
    }
}

/// A guest init's question "NS fork PID": process PID of its body is forking.
fn fork_question(line: &str) -> Option<(String, i32)> {
    let f: Vec<&str> = line.split_whitespace().collect();
    let [ns, "fork", pid] = f[..] else {
        return None;
    };
    Some((ns.to_string(), pid.parse().ok()?))
}

/// Asks the home of the body in PID namespace `ns` for a deputy for the child process `pid`
/// of it is forking, and returns the child's PID at home. On a connection opened ahead of time
/// (`exec::Spares`, as remote runs use) when there is one: the fork waits for no handshake.
async fn fork_for_body(node: &Arc<Node>, ns: &str, pid: i32) -> Result<i32> {
    let (home, root) = home_of(node, ns).await?;
    let me = node.name().to_string();
    if home == me {
        return node.deputies.fork(&me, pid, Some(root)).await;
    }
    let ask = Msg::ForkDeputy {
        pid,
        root: Some(root),
    };
    let limit = FORK_WAITS_FOR_HOME + std::time::Duration::from_secs(10);
    let answer = tokio::time::timeout(limit, ask_home(node, &home, ask))
        .await
        .map_err(|_| {
            anyhow!(
                "home {home} gave no deputy for a child of PID {pid} within {} s",
                limit.as_secs()
            )
        })??;
    match answer {
        Msg::DeputyForked { pid: child, .. } => Ok(child),
        other => bail!("home {home} answered {}", kind(&other)),
    }
}

/// The home node of the body in PID namespace `ns`, and its root's home PID. A tree that has
/// just been rebuilt here runs before it is recorded as a body (a recovered tree, a body just
/// moved in): its first question waits for that (10 s at most).
async fn home_of(node: &Arc<Node>, ns: &str) -> Result<(String, i32)> {
    let recorded = async {
        loop {
            if let Some(x) = node
                .bodies
                .map
                .lock()
                .expect("bodies lock")
                .get(ns)
                .cloned()
            {
                return Some(x);
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(std::time::Duration::from_secs(10), recorded)
        .await
        .ok()
        .flatten()
        .ok_or_else(|| anyhow!("no body with a home runs in {ns}"))
}

/// Asks `home` (another node) `msg` for a body here and returns its answer (an `Error` is
/// returned as an error). On a connection opened ahead of time (`exec::Spares`, as remote
/// runs use) when there is one: the question waits for no handshake.
async fn ask_home(node: &Arc<Node>, home: &str, msg: Msg) -> Result<Msg> {
    let spare = node.exec_spares.take(home);
    node.exec_spares.refill(node.clone(), home);
    // A spare the peer has closed meanwhile fails before anything was asked of it: then on a
    // fresh connection.
    if let Some(mut conn) = spare {
        if write_msg(&mut conn.stream, &msg).await.is_ok() {
            match read_msg(&mut conn.stream).await {
                Ok(Msg::Error { message }) => bail!("home {home}: {message}"),
                Ok(answer) => return Ok(answer),
                Err(_) => {}
            }
        }
    }
    let mut conn = node.dial(home).await?;
    write_msg(&mut conn.stream, &msg).await?;
    match read_msg(&mut conn.stream).await {
        Ok(Msg::Error { message }) => bail!("home {home}: {message}"),
        Ok(answer) => Ok(answer),
        Err(e) => bail!("home {home} did not answer: {e}"),
    }
}

/// How long a fork in a body waits for its home to know the body where it runs (the lazy phase
/// of its move: see `Deputies::fork`).
const FORK_WAITS_FOR_HOME: std::time::Duration = std::time::Duration::from_secs(30);

/// How many times (a second apart) a body's end is reported to a home that does not take it.
const REPORT_TRIES: u32 = 30;

/// Serves a peer's `SignalBody`, `BodyStatus`, `BodyMoved` or `ForkDeputy`; `from` is the
/// certified peer.
pub async fn serve_peer(node: &Node, from: &str, msg: Msg) -> Msg {
    if let Msg::ForkDeputy { pid, root } = msg {
        return match node.deputies.fork(from, pid, root).await {
            Ok(child) => Msg::DeputyForked {
                parent: pid,
                pid: child,
            },
            Err(e) => Msg::Error {
                message: format!("{e:#}"),
            },
        };
    }
    let r = match msg {
        Msg::SignalBody {
            pid,
            sig,
            queued,
            root,
        } => match node.bodies.host_pid(from, pid, root) {
            Some(host) => {
                let sig = node.bodies.stop_signal(from, pid, host, sig);
                ferry_sys::pidfd::pidfd_open(host)
                    .and_then(|fd| match queued {
                        // As the home saw it: its sender (a home PID, its number on the home
                        // node, not in a `ferry run` program's namespace) and value. The kernel takes only negative
                        // codes from us; a forged SI_USER or kernel code is refused there.
                        Some(q) if q.code < 0 => ferry_sys::pidfd::pidfd_send_siginfo(
                            &fd, sig, q.code, q.pid, q.uid, q.value,
                        ),
                        _ => ferry_sys::pidfd::pidfd_send_signal(&fd, sig),
                    })
                    .map_err(|e| anyhow!("signal {sig} to PID {pid} (here {host}): {e}"))
            }
            None => Err(anyhow!("no body of PID {pid} from {from} runs here")),
        },
        Msg::FenceBody { pid } => node.bodies.fence(from, pid).await.map(|killed| {
            tracing::warn!(event = "body-fenced", home = %from, pid, killed = ?killed,
                "its home took this node for dead and rebuilt the tree elsewhere: killed whole");
        }),
        Msg::BodyStatus { pid, status, root } => node.deputies.body_ended(from, pid, status, root),
        Msg::BodyMoved { pid, node: to } => moved(node, from, pid, &to),
        Msg::BodyIds { pid, ids } => body_ids(node, from, pid, &ids),
        other => Err(anyhow!("unexpected {}", kind(&other))),
    };
    match r {
        Ok(()) => Msg::Done,
        Err(e) => Msg::Error {
            message: format!("{e:#}"),
        },
    }
}

/// Whether a live init other than `old` (which has exited) has a PID namespace named `ns`: a
/// new namespace that got the old one's inode number.
fn new_init_of(ns: &str, old: i32) -> bool {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return false;
    };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .any(|p| {
            p != old && inner_pid(p) == Some(1) && pid_ns(p).as_deref() == Some(ns) && alive(p)
        })
}

/// Whether `pid` is a live process (not a zombie).
fn alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rsplit(')')
            .next()
            .and_then(|r| r.trim_start().chars().next())
            .is_some_and(|c| c != 'Z' && c != 'X')
    })
}

/// The processes (PIDs here) whose PID namespace is `ns` ("pid:[inode]").
fn in_namespace(ns: &str) -> Vec<i32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|&p| pid_ns(p).as_deref() == Some(ns))
        .collect()
}

/// The init of the PID namespace `ns` ("pid:[inode]"), by its PID here.
fn init_of(ns: &str) -> Option<i32> {
    std::fs::read_dir("/proc")
        .ok()?
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .find(|&p| inner_pid(p) == Some(1) && pid_ns(p).as_deref() == Some(ns))
}

/// Watches the guest init of the body whose root runs here as `host_pid`: it reports the
/// body's end and answers its forwarded calls. If it dies first (the kernel then kills every
/// process of its namespace, the body with it, and nobody reports it), the home is told the
/// body was killed (SIGKILL, which its deputy mirrors for its parent), with a log line here.
pub fn watch_supervisor(node: Arc<Node>, host_pid: i32) {
    let Some(ns) = pid_ns(host_pid) else {
        return;
    };
    let Some(init) = init_of(&ns) else {
        return;
    };
    let Ok(pidfd) = ferry_sys::pidfd::pidfd_open(init) else {
        return;
    };
    tokio::spawn(async move {
        use std::os::fd::AsRawFd;
        let mut tick = tokio::time::interval(std::time::Duration::from_millis(500));
        loop {
            tick.tick().await;
            // A pidfd reads as ready once its process has exited.
            if ferry_sys::ns::poll_in(&[pidfd.as_raw_fd()], 0).is_ok_and(|r| r[0]) {
                break;
            }
        }
        // Its last reports may still be on their way: the body's root ending forgets it.
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
        // The kernel gives a new namespace the lowest free inode number: once this one is
        // gone, the next body rebuilt here may get its name. Such a body, with an init of its
        // own, is not this one's to forget or report (it was, killing every body that arrived
        // as another left: its home's deputy ended as if SIGKILLed while it ran on).
        if new_init_of(&ns, init) {
            return;
        }
        let gone = node.bodies.map.lock().expect("bodies lock").remove(&ns);
        node.bodies.calls.lock().expect("bodies lock").remove(&ns);
        node.bodies
            .watchers
            .lock()
            .expect("bodies lock")
            .remove(&ns);
        node.bodies.held.lock().expect("bodies lock").remove(&ns);
        let Some((home, root)) = gone else {
            return;
        };
        tracing::error!(event = "guest-init-died", home = %home, pid = root, init,
            "the body's supervisor (its guest init) died: the kernel killed the body");
        let msg = Msg::BodyStatus {
            pid: root,
            status: libc::SIGKILL,
            root: None,
        };
        let r = if home == node.name() {
            let me = node.name().to_string();
            node.deputies.body_ended(&me, root, libc::SIGKILL, None)
        } else {
            ask(&node, &home, msg).await
        };
        if let Err(e) = r {
            tracing::warn!(event = "report-home-failed", home = %home,
                error = %format!("{e:#}"));
        }
    });
}
