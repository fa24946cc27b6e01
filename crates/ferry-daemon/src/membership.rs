//! Cluster membership and failure detection by the `foca` SWIM implementation; this module
//! carries its packets (over the same mutual-TLS connections as everything else, so gossip is
//! authenticated and encrypted too), runs its timers, and holds every node to speaking only for
//! itself (docs/security.md, "Nodes: who may say what"):
//!
//! - a packet is taken only if its sender identity bears the name of the certificate of the
//!   connection it came on;
//! - what a packet says about *other* members (SWIM's piggybacked updates) may change their
//!   state (alive, suspect, down) but never who they are: an update that would give a known
//!   name another address or incarnation, or a known address another name, is dropped, and a
//!   member's identity changes only by its own word ([`NodeId::win_addr_conflict`] keeps an
//!   address with the name that holds it);
//! - a member is shown to the daemon ([`Membership::members`]) only once it has spoken to us
//!   itself under that identity;
//! - each node's load rides on foca's custom broadcasts, but a load record is taken only
//!   first-hand, from a packet its node sent, and never relayed. Records are ordered by
//!   (incarnation, sequence): the incarnation is new at each start of the daemon.

use bytes::Bytes;
use bytes::{Buf, BufMut};
use ferry_policy::NodeLoad;
use ferry_transport::{tls, write_msg, Credentials, Msg};
use foca::{
    Codec, Config, Foca, Header, Invalidates, Message, OwnedNotification, PostcardCodec, Timer,
};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};

/// A node's identity in the membership protocol. `bump` is greater at each start (the node's
/// incarnation, see [`incarnation`]), so a restarted node supersedes its previous identity.
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
    /// Whether the identity foca knows at an address (`self`) keeps it against another
    /// claiming it. A name keeps its address: another name gets it only once foca has
    /// forgotten the holder (down for `REMOVE_DOWN_AFTER`). A node's own later start (a higher
    /// `bump`, which only that node announces first-hand) replaces its earlier one.
    fn win_addr_conflict(&self, adversary: &Self) -> bool {
        self.name != adversary.name || self.bump > adversary.bump
    }
}

/// How long a member that is down stays known (and keeps its address from other names).
const REMOVE_DOWN_AFTER: Duration = Duration::from_secs(120);

#[derive(Serialize, Deserialize)]
struct LoadItem {
    key: LoadKey,
    load: NodeLoad,
}

/// Which load record this is: a node's records are ordered by (incarnation, seq). The
/// incarnation is new at each start of the node's daemon (`Membership::start`), so a restarted
/// node's first record supersedes its previous life's last.
#[derive(Serialize, Deserialize, Clone, PartialEq, Eq)]
struct LoadKey {
    node: String,
    incarnation: u64,
    seq: u64,
}

impl LoadKey {
    fn version(&self) -> (u64, u64) {
        (self.incarnation, self.seq)
    }
}

impl Invalidates for LoadKey {
    fn invalidates(&self, other: &Self) -> bool {
        self.node == other.node && self.version() > other.version()
    }
}

type Loads = Arc<Mutex<HashMap<String, ((u64, u64), NodeLoad)>>>;

struct LoadHandler {
    loads: Loads,
    me: String,
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
    /// `sender` is None for our own records (`add_broadcast`), which are disseminated; else
    /// the packet's sender, whose name `Membership::deliver` checked against the certificate
    /// of the connection. A record is taken only from the node it describes, and not relayed
    /// (returning None): every node hears every other's load first-hand.
    fn receive_item(
        &mut self,
        data: &[u8],
        sender: Option<&NodeId>,
    ) -> Result<Option<LoadKey>, BadBroadcast> {
        let item: LoadItem = postcard_decode(data)?;
        let own = match sender {
            None => item.key.node == self.me,
            Some(s) => {
                if s.name != item.key.node {
                    tracing::debug!(event = "load-refused", from = %s.name,
                        about = %item.key.node, "a load record relayed or forged: ignored");
                    return Ok(None);
                }
                if s.name == self.me {
                    return Ok(None);
                }
                false
            }
        };
        let mut loads = self.loads.lock().expect("loads lock");
        let newer = loads
            .get(&item.key.node)
            .is_none_or(|(v, _)| *v < item.key.version());
        if newer {
            loads.insert(item.key.node.clone(), (item.key.version(), item.load));
        }
        Ok((own && newer).then_some(item.key))
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
    /// A packet, and the name in the certificate of the connection it came on.
    Data(String, Bytes),
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

/// Members declared down (and not seen up again since), by name: the identity declared down
/// and when.
type DownSet = Arc<Mutex<HashMap<String, (NodeId, Instant)>>>;

#[derive(Clone)]
pub struct Membership {
    input: mpsc::UnboundedSender<Input>,
    members: Arc<Mutex<Vec<NodeId>>>,
    /// Names of the members the membership has declared down (and not seen up again since).
    down: DownSet,
    /// The identity each name last spoke to us under, first-hand (its own packet, on a
    /// connection with its certificate).
    heard: Arc<Mutex<HashMap<String, NodeId>>>,
    loads: Loads,
    me: NodeId,
}

impl Membership {
    /// `incarnation` must be greater at each start of this node (see `incarnation`).
    pub fn start(
        me: NodeId,
        incarnation: u64,
        creds: Credentials,
        seeds: Vec<SocketAddr>,
    ) -> Membership {
        let (input, mut rx) = mpsc::unbounded_channel::<Input>();
        let members = Arc::new(Mutex::new(Vec::new()));
        let down: DownSet = Arc::default();
        let heard: Arc<Mutex<HashMap<String, NodeId>>> = Arc::default();
        let loads: Loads = Arc::default();
        let links = Links::new(creds);
        let this = Membership {
            input: input.clone(),
            members: members.clone(),
            down: down.clone(),
            heard: heard.clone(),
            loads: loads.clone(),
            me: me.clone(),
        };
        let mut config = Config::new_lan(std::num::NonZeroU32::new(16).expect("nonzero"));
        // Quicker than the LAN defaults: a dead node is noticed in a few seconds.
        config.probe_period = Duration::from_millis(500);
        config.probe_rtt = Duration::from_millis(250);
        config.suspect_to_down_after = Duration::from_secs(2);
        config.remove_down_after = Some(REMOVE_DOWN_AFTER);
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
                me: me.name.clone(),
            },
        );
        let timers = input.clone();
        let name = me.name.clone();
        tokio::spawn(async move {
            let mut runtime = foca::AccumulatingRuntime::new();
            let mut seq = 0u64;
            while let Some(msg) = rx.recv().await {
                let result = match msg {
                    Input::Data(peer, d) => match screen(&d, &peer, &me, &foca) {
                        Ok((src, packet)) => {
                            heard
                                .lock()
                                .expect("heard lock")
                                .insert(src.name.clone(), src);
                            foca.handle_data(&packet, &mut runtime)
                        }
                        Err(e) => {
                            tracing::warn!(event = "gossip-refused", from = %peer, error = %e);
                            Ok(())
                        }
                    },
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
                                incarnation,
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
                        drain(&mut runtime, &links, &timers, (&members, &down), &foca);
                        links.flush(Duration::from_millis(300)).await;
                        let _ = done.send(());
                        r.map(|_| ())
                    }
                };
                if let Err(e) = result {
                    tracing::debug!(error = %e, "membership");
                }
                drain(&mut runtime, &links, &timers, (&members, &down), &foca);
            }
        });
        for s in seeds {
            let _ = input.send(Input::Announce(s));
        }
        this
    }

    /// A gossip packet arrived from `peer` (the name its connection's certificate bears). A
    /// packet whose sender is anyone else is an error: the connection should be dropped.
    pub fn deliver(&self, peer: &str, packet: Vec<u8>) -> Result<(), String> {
        let src = sender(&packet)?;
        if src.name != peer {
            return Err(format!(
                "a gossip packet from the node whose certificate names {peer:?} claims to \
                 come from {:?}",
                src.name
            ));
        }
        let _ = self
            .input
            .send(Input::Data(peer.to_string(), Bytes::from(packet)));
        Ok(())
    }

    pub fn publish(&self, load: NodeLoad) {
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

    /// Live members other than ourselves that have spoken to us themselves under the identity
    /// foca knows them by, with the load each last sent us.
    pub fn members(&self) -> Vec<Member> {
        let loads = self.loads.lock().expect("loads lock");
        let heard = self.heard.lock().expect("heard lock");
        self.members
            .lock()
            .expect("members lock")
            .iter()
            .filter(|id| heard.get(&id.name) == Some(*id))
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

    /// Whether the membership has declared `name` down (SWIM: suspected, then not refuted in
    /// time) and not seen it up again since. A node merely not heard of yet is not down.
    pub fn is_down(&self, name: &str) -> bool {
        self.down.lock().expect("down lock").contains_key(name)
    }

    /// How long `name` has been declared down without being seen up since, if it is.
    pub fn down_for(&self, name: &str) -> Option<Duration> {
        let down = self.down.lock().expect("down lock");
        down.get(name).map(|(_, since)| since.elapsed())
    }

    /// The address `name` last spoke to us from (first-hand), down or not.
    pub fn last_addr(&self, name: &str) -> Option<SocketAddr> {
        let heard = self.heard.lock().expect("heard lock");
        heard.get(name).map(|id| id.addr)
    }

    /// Whether the membership knows of `name` at all (alive, suspect or declared down).
    pub fn is_known(&self, name: &str) -> bool {
        self.is_down(name)
            || self
                .members
                .lock()
                .expect("members lock")
                .iter()
                .any(|id| id.name == name)
    }

    pub fn find(&self, name: &str) -> Option<Member> {
        self.members().into_iter().find(|m| m.id.name == name)
    }
}

/// The sender a gossip packet names in its header.
fn sender(packet: &[u8]) -> Result<NodeId, String> {
    let mut buf = packet;
    PostcardCodec
        .decode_header(&mut buf)
        .map(|h| h.src)
        .map_err(|e| format!("undecodable gossip packet: {e}"))
}

type OurFoca = Foca<NodeId, PostcardCodec, rand::rngs::StdRng, LoadHandler>;

/// Checks a packet from `peer` before foca reads it: its sender must be `peer`, and what it
/// says about others may change their state but not their identity. Returns the sender and
/// the packet, without the updates that fail that test.
fn screen(
    packet: &[u8],
    peer: &str,
    me: &NodeId,
    foca: &OurFoca,
) -> Result<(NodeId, Bytes), String> {
    let mut codec = PostcardCodec;
    let mut buf = packet;
    let header: Header<NodeId> = codec
        .decode_header(&mut buf)
        .map_err(|e| format!("undecodable gossip packet: {e}"))?;
    if header.src.name != peer {
        return Err(format!(
            "packet from {peer:?} claims to come from {:?}",
            header.src.name
        ));
    }
    let head_len = packet.len() - buf.len();
    // The same test as foca's: only these packets carry an updates section.
    if buf.len() < 2 || matches!(header.message, Message::Broadcast | Message::Announce) {
        return Ok((header.src, Bytes::copy_from_slice(packet)));
    }
    let count = buf.get_u16();
    let mut kept = Vec::with_capacity(count as usize);
    let mut dropped = 0usize;
    for _ in 0..count {
        let m: foca::Member<NodeId> = codec
            .decode_member(&mut buf)
            .map_err(|e| format!("undecodable member update: {e}"))?;
        if may_tell(&header.src, m.id(), me, foca) {
            kept.push(m);
        } else {
            dropped += 1;
        }
    }
    if dropped == 0 {
        return Ok((header.src, Bytes::copy_from_slice(packet)));
    }
    tracing::debug!(event = "updates-dropped", from = %peer, dropped,
        "updates that would change another member's identity");
    let mut out = Vec::with_capacity(packet.len());
    out.extend_from_slice(&packet[..head_len]);
    out.put_u16(kept.len() as u16);
    for m in &kept {
        codec
            .encode_member(m, &mut out)
            .map_err(|e| format!("re-encode a member update: {e}"))?;
    }
    out.extend_from_slice(buf);
    Ok((header.src, Bytes::from(out)))
}

/// Whether `src` may tell us about member `id`: about itself, anything; about us, only our
/// own identity (a suspicion we refute); about a third node, only an identity that does not
/// contradict one we know (same name with another address or start, or another name at the
/// same address). A node that changed is believed when it says so itself.
fn may_tell(src: &NodeId, id: &NodeId, me: &NodeId, foca: &OurFoca) -> bool {
    if id.name == src.name {
        return true;
    }
    if id.name == me.name || id.addr == me.addr {
        return id == me;
    }
    !foca
        .iter_membership_state()
        .any(|m| m.id() != id && (m.id().name == id.name || m.id().addr == id.addr))
}

/// This start's incarnation: greater than any earlier start's on this node. Kept in
/// `DATA_DIR/incarnation`; the clock (nanoseconds since the epoch) covers a lost file.
pub fn incarnation(data_dir: &std::path::Path) -> anyhow::Result<u64> {
    use anyhow::Context;
    let path = data_dir.join("incarnation");
    let old = match std::fs::read_to_string(&path) {
        Ok(s) => s
            .trim()
            .parse::<u64>()
            .with_context(|| format!("{} holds {:?}, not a number", path.display(), s.trim()))?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => 0,
        Err(e) => return Err(e).with_context(|| format!("read {}", path.display())),
    };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let next = now.max(old.saturating_add(1));
    let tmp = data_dir.join("incarnation.tmp");
    {
        use std::io::Write;
        let mut f =
            std::fs::File::create(&tmp).with_context(|| format!("create {}", tmp.display()))?;
        writeln!(f, "{next}").with_context(|| format!("write {}", tmp.display()))?;
        f.sync_all()
            .with_context(|| format!("sync {}", tmp.display()))?;
    }
    std::fs::rename(&tmp, &path).with_context(|| format!("rename to {}", path.display()))?;
    Ok(next)
}

fn drain(
    runtime: &mut foca::AccumulatingRuntime<NodeId>,
    links: &Arc<Links>,
    timers: &mpsc::UnboundedSender<Input>,
    (members, down): (&Arc<Mutex<Vec<NodeId>>>, &DownSet),
    foca: &OurFoca,
) {
    while let Some((to, data)) = runtime.to_send() {
        links.send(to, data);
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
                down.lock().expect("down lock").remove(&id.name);
                changed = true;
            }
            OwnedNotification::MemberDown(id) => {
                // A node declared down while alive rejoins under a renewed identity (a higher
                // bump); the old identity's end may be heard after the new one's start: that
                // node is not down.
                let renewed = foca
                    .iter_members()
                    .any(|m| m.id().name == id.name && m.id().bump > id.bump);
                tracing::warn!(event = "member-down", node = %id.name, addr = %id.addr,
                    bump = id.bump, renewed);
                if !renewed {
                    down.lock()
                        .expect("down lock")
                        .insert(id.name.clone(), (id.clone(), Instant::now()));
                }
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
    /// By name and address: the link checks that the node it reaches bears that name (an
    /// empty name: a seed we know only by address, to which we only announce ourselves).
    queues: Mutex<HashMap<(String, SocketAddr), mpsc::Sender<Bytes>>>,
}

impl Links {
    fn new(creds: Credentials) -> Arc<Links> {
        Arc::new(Links {
            creds,
            queues: Mutex::default(),
        })
    }

    fn send(self: &Arc<Self>, to: NodeId, data: Bytes) {
        let mut queues = self.queues.lock().expect("links lock");
        let key = (to.name, to.addr);
        let tx = queues.entry(key.clone()).or_insert_with(|| {
            let (tx, rx) = mpsc::channel(64);
            tokio::spawn(link(self.creds.clone(), key.0, key.1, rx));
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

async fn link(creds: Credentials, name: String, to: SocketAddr, mut rx: mpsc::Receiver<Bytes>) {
    let mut conn: Option<ferry_transport::Conn> = None;
    let mut failed_at: Option<Instant> = None;
    while let Some(packet) = rx.recv().await {
        if conn.is_none() {
            if failed_at.is_some_and(|t| t.elapsed() < Duration::from_millis(500)) {
                continue;
            }
            let expect = (!name.is_empty()).then_some(name.as_str());
            match tls::connect(&creds, expect, to, Duration::from_secs(1)).await {
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

/// Fuzz target for gossip: what a peer's `Gossip` message carries is read by [`sender`]
/// (`Membership::deliver`), [`screen`] and foca. Whatever the packet, that ends in an error or
/// in foca's state changing, never in a panic. The packets are edits of real ones: an announce,
/// the answer to it, and a load broadcast, exchanged by two members made here. Runs for a few
/// seconds under `cargo test` (see `crates/ferry-fuzz`).
#[cfg(test)]
mod fuzz {
    use super::*;
    use bolero::TypeGenerator;
    use ferry_fuzz::{apply, Edit};
    use foca::AccumulatingRuntime;

    fn member(name: &str, port: u16) -> (NodeId, OurFoca) {
        let id = NodeId {
            name: name.into(),
            addr: SocketAddr::from(([127, 0, 0, 11], port)),
            bump: 1,
        };
        let mut config = Config::new_lan(std::num::NonZeroU32::new(16).expect("nonzero"));
        config.remove_down_after = Some(REMOVE_DOWN_AFTER);
        let foca = Foca::with_custom_broadcast(
            id.clone(),
            config,
            rand::make_rng(),
            PostcardCodec,
            LoadHandler {
                loads: Loads::default(),
                me: name.into(),
            },
        );
        (id, foca)
    }

    /// Real packets from b to a: b's announce, b's answer to a's, b's load broadcast.
    fn seeds() -> Vec<Vec<u8>> {
        let (a_id, mut a) = member("a", 7070);
        let (b_id, mut b) = member("b", 7071);
        let mut rt = AccumulatingRuntime::new();
        let mut out = Vec::new();
        let item = LoadItem {
            key: LoadKey {
                node: "b".into(),
                incarnation: 1,
                seq: 1,
            },
            load: NodeLoad::default(),
        };
        b.add_broadcast(&foca_postcard::to_allocvec(&item).unwrap())
            .unwrap();
        b.announce(a_id.clone(), &mut rt).unwrap();
        while let Some((_, p)) = rt.to_send() {
            out.push(p.to_vec());
        }
        a.announce(b_id, &mut rt).unwrap();
        let mut to_b = Vec::new();
        while let Some((_, p)) = rt.to_send() {
            to_b.push(p);
        }
        for p in to_b {
            b.handle_data(&p, &mut rt).unwrap();
        }
        while let Some((_, p)) = rt.to_send() {
            out.push(p.to_vec());
        }
        assert!(out.len() >= 2, "b sent {} packets", out.len());
        out
    }

    /// Everything that reads a packet from `b` at node a.
    fn receive(
        packet: &[u8],
        a_id: &NodeId,
        a: &mut OurFoca,
        rt: &mut AccumulatingRuntime<NodeId>,
    ) {
        if sender(packet).is_err() {
            return;
        }
        if let Ok((_, screened)) = screen(packet, "b", a_id, a) {
            let _ = a.handle_data(&screened, &mut *rt);
        }
        while rt.to_send().is_some() {}
        while rt.to_schedule().is_some() {}
        while rt.to_notify().is_some() {}
    }

    #[test]
    fn seeds_are_taken() {
        let (a_id, mut a) = member("a", 7070);
        let mut rt = AccumulatingRuntime::new();
        for p in seeds() {
            let (_, screened) = screen(&p, "b", &a_id, &a).expect("a real packet is refused");
            a.handle_data(&screened, &mut rt)
                .expect("foca refuses a real packet");
        }
        assert!(a.iter_members().any(|m| m.id().name == "b"));
    }

    #[derive(Debug, TypeGenerator)]
    struct PacketEdits {
        seed: u8,
        edits: Vec<Edit>,
    }

    #[test]
    fn fuzz_gossip() {
        let seeds = seeds();
        let (a_id, mut a) = member("a", 7070);
        let mut rt = AccumulatingRuntime::new();
        bolero::check!()
            .with_type::<PacketEdits>()
            .with_test_time(Duration::from_secs(3))
            .with_shrink_time(Duration::from_secs(10))
            .for_each(|e| {
                let edits = &e.edits[..e.edits.len().min(1 + e.seed as usize / 2 % 4)];
                let packet = apply(&seeds[e.seed as usize % seeds.len()], edits);
                receive(&packet, &a_id, &mut a, &mut rt);
            });
    }
}
