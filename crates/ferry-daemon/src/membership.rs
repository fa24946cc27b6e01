//! Cluster membership and failure detection by the `foca` SWIM implementation; this module only
//! carries its packets (over the same mutual-TLS connections as everything else, so gossip is
//! authenticated and encrypted too) and runs its timers. Each node's load rides on foca's custom
//! broadcasts: a versioned item per node, newer versions replacing older ones in dissemination.

use bytes::Bytes;
use ferry_policy::NodeLoad;
use ferry_transport::{tls, write_msg, Credentials, Msg};
use foca::{Config, Foca, Invalidates, OwnedNotification, PostcardCodec, Timer};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};

/// A node's identity in the membership protocol. `bump` changes at each start, so a restarted
/// node supersedes its previous incarnation.
#[derive(Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct NodeId {
    pub name: String,
    pub addr: SocketAddr,
    pub bump: u64,
}

impl std::fmt::Debug for NodeId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}@{}", self.name, self.addr)
    }
}

impl foca::Identity for NodeId {
    type Addr = SocketAddr;
    fn renew(&self) -> Option<Self> {
        Some(NodeId {
            bump: self.bump.wrapping_add(1),
            ..self.clone()
        })
    }
    fn addr(&self) -> SocketAddr {
        self.addr
    }
    fn win_addr_conflict(&self, adversary: &Self) -> bool {
        self.bump > adversary.bump
    }
}

#[derive(Serialize, Deserialize)]
struct LoadItem {
    key: LoadKey,
    load: NodeLoad,
}

#[derive(Serialize, Deserialize, Clone, PartialEq, Eq)]
struct LoadKey {
    node: String,
    seq: u64,
}

impl Invalidates for LoadKey {
    fn invalidates(&self, other: &Self) -> bool {
        self.node == other.node && self.seq > other.seq
    }
}

type Loads = Arc<Mutex<HashMap<String, (u64, NodeLoad)>>>;

struct LoadHandler {
    loads: Loads,
}

#[derive(Debug)]
struct BadBroadcast(String);
impl std::fmt::Display for BadBroadcast {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}
impl std::error::Error for BadBroadcast {}

impl foca::BroadcastHandler<NodeId> for LoadHandler {
    type Key = LoadKey;
    type Error = BadBroadcast;
    fn receive_item(
        &mut self,
        data: &[u8],
        _sender: Option<&NodeId>,
    ) -> Result<Option<LoadKey>, BadBroadcast> {
        let item: LoadItem = postcard_decode(data)?;
        let mut loads = self.loads.lock().expect("loads lock");
        let newer = loads
            .get(&item.key.node)
            .is_none_or(|(seq, _)| *seq < item.key.seq);
        if newer {
            loads.insert(item.key.node.clone(), (item.key.seq, item.load));
            Ok(Some(item.key))
        } else {
            Ok(None)
        }
    }
}

fn postcard_decode(data: &[u8]) -> Result<LoadItem, BadBroadcast> {
    foca_postcard::from_bytes(data).map_err(|e| BadBroadcast(format!("bad load broadcast: {e}")))
}

/// foca re-exports no codec helpers; postcard is the wire format it already uses.
mod foca_postcard {
    pub use postcard::from_bytes;
    pub use postcard::to_allocvec;
}

enum Input {
    Data(Bytes),
    Timer(Timer<NodeId>),
    Announce(SocketAddr),
    Publish(NodeLoad),
    Leave(oneshot::Sender<()>),
}

/// A member as the CLI sees it.
#[derive(Debug, Clone)]
pub struct Member {
    pub id: NodeId,
    pub load: Option<NodeLoad>,
}

#[derive(Clone)]
pub struct Membership {
    input: mpsc::UnboundedSender<Input>,
    members: Arc<Mutex<Vec<NodeId>>>,
    loads: Loads,
    me: NodeId,
}

impl Membership {
    pub fn start(me: NodeId, creds: Credentials, seeds: Vec<SocketAddr>) -> Membership {
        let (input, mut rx) = mpsc::unbounded_channel::<Input>();
        let members = Arc::new(Mutex::new(Vec::new()));
        let loads: Loads = Arc::default();
        let links = Links::new(creds);
        let this = Membership {
            input: input.clone(),
            members: members.clone(),
            loads: loads.clone(),
            me: me.clone(),
        };
        let mut config = Config::new_lan(std::num::NonZeroU32::new(16).expect("nonzero"));
        // Quicker than the LAN defaults: a dead node is noticed in a few seconds.
        config.probe_period = Duration::from_millis(500);
        config.probe_rtt = Duration::from_millis(250);
        config.suspect_to_down_after = Duration::from_secs(2);
        config.periodic_announce = Some(foca::PeriodicParams {
            frequency: Duration::from_secs(5),
            num_members: std::num::NonZeroUsize::new(1).expect("nonzero"),
        });
        let rng: rand::rngs::StdRng = rand::make_rng();
        let mut foca = Foca::with_custom_broadcast(
            me.clone(),
            config,
            rng,
            PostcardCodec,
            LoadHandler {
                loads: loads.clone(),
            },
        );
        let timers = input.clone();
        let name = me.name.clone();
        tokio::spawn(async move {
            let mut runtime = foca::AccumulatingRuntime::new();
            let mut seq = 0u64;
            while let Some(msg) = rx.recv().await {
                let result = match msg {
                    Input::Data(d) => foca.handle_data(&d, &mut runtime),
                    Input::Timer(t) => foca.handle_timer(t, &mut runtime),
                    Input::Announce(addr) => foca.announce(
                        NodeId {
                            name: String::new(),
                            addr,
                            bump: 0,
                        },
                        &mut runtime,
                    ),
                    Input::Publish(load) => {
                        seq += 1;
                        let item = LoadItem {
                            key: LoadKey {
                                node: name.clone(),
                                seq,
                            },
                            load,
                        };
                        match foca_postcard::to_allocvec(&item) {
                            Ok(data) => foca.add_broadcast(&data).map(|_| ()),
                            Err(e) => {
                                tracing::warn!(error = %e, "encode load");
                                Ok(())
                            }
                        }
                    }
                    Input::Leave(done) => {
                        let r = foca.leave_cluster(&mut runtime);
                        drain(&mut runtime, &links, &timers, &members, &foca);
                        links.flush(Duration::from_millis(300)).await;
                        let _ = done.send(());
                        r.map(|_| ())
                    }
                };
                if let Err(e) = result {
                    tracing::debug!(error = %e, "membership");
                }
                drain(&mut runtime, &links, &timers, &members, &foca);
            }
        });
        for s in seeds {
            let _ = input.send(Input::Announce(s));
        }
        this
    }

    /// A gossip packet arrived from a peer.
    pub fn deliver(&self, packet: Vec<u8>) {
        let _ = self.input.send(Input::Data(Bytes::from(packet)));
    }

    pub fn publish(&self, load: NodeLoad) {
        self.loads
            .lock()
            .expect("loads lock")
            .insert(self.me.name.clone(), (0, load.clone()));
        let _ = self.input.send(Input::Publish(load));
    }

    pub fn announce(&self, addr: SocketAddr) {
        let _ = self.input.send(Input::Announce(addr));
    }

    /// Leaves the cluster (peers learn at once rather than by timeout).
    pub async fn leave(&self) {
        let (tx, rx) = oneshot::channel();
        if self.input.send(Input::Leave(tx)).is_ok() {
            let _ = tokio::time::timeout(Duration::from_secs(1), rx).await;
        }
    }

    /// Live members other than ourselves, with the load each last published.
    pub fn members(&self) -> Vec<Member> {
        let loads = self.loads.lock().expect("loads lock");
        self.members
            .lock()
            .expect("members lock")
            .iter()
            .map(|id| Member {
                load: loads.get(&id.name).map(|(_, l)| l.clone()),
                id: id.clone(),
            })
            .collect()
    }

    pub fn own_load(&self) -> Option<NodeLoad> {
        let loads = self.loads.lock().expect("loads lock");
        loads.get(&self.me.name).map(|(_, l)| l.clone())
    }

    pub fn find(&self, name: &str) -> Option<Member> {
        self.members().into_iter().find(|m| m.id.name == name)
    }
}

fn drain(
    runtime: &mut foca::AccumulatingRuntime<NodeId>,
    links: &Arc<Links>,
    timers: &mpsc::UnboundedSender<Input>,
    members: &Arc<Mutex<Vec<NodeId>>>,
    foca: &Foca<NodeId, PostcardCodec, rand::rngs::StdRng, LoadHandler>,
) {
    while let Some((to, data)) = runtime.to_send() {
        links.send(to.addr, data);
    }
    while let Some((after, timer)) = runtime.to_schedule() {
        let tx = timers.clone();
        tokio::spawn(async move {
            tokio::time::sleep(after).await;
            let _ = tx.send(Input::Timer(timer));
        });
    }
    let mut changed = false;
    while let Some(n) = runtime.to_notify() {
        match n {
            OwnedNotification::MemberUp(id) => {
                tracing::info!(event = "member-up", node = %id.name, addr = %id.addr);
                changed = true;
            }
            OwnedNotification::MemberDown(id) => {
                tracing::warn!(event = "member-down", node = %id.name, addr = %id.addr);
                changed = true;
            }
            OwnedNotification::Rename(old, new) => {
                tracing::info!(event = "member-renamed", old = ?old, new = ?new);
                changed = true;
            }
            _ => {}
        }
    }
    if changed {
        *members.lock().expect("members lock") =
            foca.iter_members().map(|m| m.id().clone()).collect();
    }
}

/// Outgoing gossip: one queue and one connection per peer, so a slow or dead peer delays nobody
/// else. Packets to a peer that cannot be reached are dropped, as UDP would drop them; noticing
/// that is foca's job.
struct Links {
    creds: Credentials,
    queues: Mutex<HashMap<SocketAddr, mpsc::Sender<Bytes>>>,
}

impl Links {
    fn new(creds: Credentials) -> Arc<Links> {
        Arc::new(Links {
            creds,
            queues: Mutex::default(),
        })
    }

    fn send(self: &Arc<Self>, to: SocketAddr, data: Bytes) {
        let mut queues = self.queues.lock().expect("links lock");
        let tx = queues.entry(to).or_insert_with(|| {
            let (tx, rx) = mpsc::channel(64);
            tokio::spawn(link(self.creds.clone(), to, rx));
            tx
        });
        let _ = tx.try_send(data);
    }

    async fn flush(&self, within: Duration) {
        let deadline = Instant::now() + within;
        loop {
            let busy = self
                .queues
                .lock()
                .expect("links lock")
                .values()
                .any(|q| q.capacity() < q.max_capacity());
            if !busy || Instant::now() > deadline {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

async fn link(creds: Credentials, to: SocketAddr, mut rx: mpsc::Receiver<Bytes>) {
    let mut conn: Option<ferry_transport::Conn> = None;
    let mut failed_at: Option<Instant> = None;
    while let Some(packet) = rx.recv().await {
        if conn.is_none() {
            if failed_at.is_some_and(|t| t.elapsed() < Duration::from_millis(500)) {
                continue;
            }
            match tls::connect(&creds, to, Duration::from_secs(1)).await {
                Ok(c) => conn = Some(c),
                Err(e) => {
                    tracing::debug!(peer = %to, error = %format!("{e:#}"), "gossip link down");
                    failed_at = Some(Instant::now());
                    continue;
                }
            }
        }
        let c = conn.as_mut().expect("connected above");
        let msg = Msg::Gossip {
            packet: serde_bytes::ByteBuf::from(packet.to_vec()),
        };
        if let Err(e) = write_msg(&mut c.stream, &msg).await {
            tracing::debug!(peer = %to, error = %e, "gossip link broke");
            conn = None;
            failed_at = Some(Instant::now());
        }
    }
}
