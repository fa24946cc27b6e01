//! One node's daemon: accepts peers (mutual TLS) and its own CLI (a root-only UNIX socket),
//! gossips membership and load, reaps what it starts, and stops cleanly on SIGTERM.

use crate::config::Config;
use crate::guests::Guests;
use crate::load::LoadSampler;
use crate::membership::{Membership, NodeId};
use crate::reaper::Reaper;
use crate::{exec, migrate};
use anyhow::{bail, Context, Result};
use ferry_transport::message::{kind, NodeInfo, ProcInfo};
use ferry_transport::{
    read_msg, tls, write_msg, Conn, Credentials, FrameError, Msg, RevocationList,
};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::{TcpListener, UnixListener, UnixStream};
use tokio::signal::unix::{signal, SignalKind};

pub struct Node {
    pub config: Config,
    pub creds: Credentials,
    pub membership: Membership,
    pub reaper: Reaper,
    pub guests: Guests,
    /// This daemon's durable records (crate::state).
    pub store: Arc<crate::state::Store>,
    /// How each migration this node sent ended, for destinations that lost us between
    /// `Rebuilt` and `Commit` (durable).
    pub outcomes: crate::outcomes::Outcomes,
    /// Trees that left this home, kept here as deputies.
    pub deputies: crate::deputies::Deputies,
    /// Trees running here whose home is elsewhere.
    pub bodies: crate::deputies::Bodies,
    /// The home's ends of pipes relayed to bodies (crate::relay).
    pub relays: Arc<crate::relay::HomeRelays>,
    /// The relays of the bodies this node runs, which follow a body moving on
    /// (crate::relay_pipe).
    pub body_relays: crate::relay_pipe::BodyRelays,
    /// Whether this node takes guests now: the owner's policy (crate::hosts) keeps it.
    pub accepting: AtomicBool,
    /// The owner's policy and this host's grants (crate::hosts).
    pub hosts: crate::hosts::Hosts,
    /// The ferry binary, run as engine workers.
    pub exe: PathBuf,
    /// The mount namespace programs run here for other nodes enter (crate::confine).
    pub guest_mounts: crate::confine::GuestMounts,
    /// What this daemon counts (crate::metrics), and the CPU use of its guests.
    pub metrics: crate::metrics::Metrics,
    pub cpu: crate::metrics::CpuMeter,
    /// Connections to peers opened ahead of the remote runs that will use them.
    pub exec_spares: crate::exec::Spares,
    /// What this node must tell the callers of the `ferry run` programs it runs.
    pub run_notices: crate::exec::Notices,
    /// Automatic load balancing (crate::balancer).
    pub balancer: crate::balancer::Balancer,
    /// The speed (bytes/s) memory last moved at to each node (crate::migrate::send::learn_link):
    /// what `--memory auto` weighs an eager move's freeze by. Kept durably (crate::links).
    pub links: crate::links::Links,
}

impl Node {
    /// The processes under Ferry on this node (its guests), with what each body costs.
    pub fn local_processes(&self) -> Vec<ProcInfo> {
        let mut list = self.guests.list();
        for p in &mut list {
            let (calls, nanos) = self.bodies.forwarded(p.pid);
            p.forwarded_calls = calls;
            p.forwarded_us = nanos / 1000;
        }
        list
    }

    pub fn name(&self) -> &str {
        &self.config.name
    }

    /// A migration id: random, so that ids never repeat across restarts (outcomes are kept
    /// by id, durably).
    pub fn next_id(&self) -> u64 {
        rand::random()
    }

    /// Connects to the live member called `name`.
    pub async fn dial(&self, name: &str) -> Result<Conn> {
        let Some(m) = self.membership.find(name) else {
            let known: Vec<String> = self
                .membership
                .members()
                .into_iter()
                .map(|m| m.id.name)
                .collect();
            bail!(
                "no live node named {name:?} (live: {})",
                if known.is_empty() {
                    "none besides this one".to_string()
                } else {
                    known.join(", ")
                }
            );
        };
        tls::connect(&self.creds, Some(name), m.id.addr, Duration::from_secs(5))
            .await
            .with_context(|| format!("reach node {name}"))
    }

    /// Whether node `name` may be taken for dead, and what it ran for lost: the membership has
    /// declared it down, kept that verdict for the config's `dead_after` (a daemon starved of
    /// CPU for a few seconds is declared down and back within that), and it does not answer a
    /// connection at the address it last spoke from. A daemon that answers is alive whatever
    /// the gossip says, and so are the processes it runs.
    pub async fn is_dead(&self, name: &str) -> bool {
        let Some(down) = self.membership.down_for(name) else {
            return false;
        };
        if down < self.config.dead_after() {
            return false;
        }
        let Some(addr) = self.membership.last_addr(name) else {
            return true;
        };
        match tls::connect(&self.creds, Some(name), addr, Duration::from_secs(1)).await {
            Ok(_) => {
                tracing::warn!(event = "down-but-answers", node = %name,
                    down_secs = down.as_secs_f64(), "not taken for dead");
                false
            }
            Err(_) => true,
        }
    }

    /// Fault injection for the test suite (fail points of the `fail` crate, built with the
    /// `failpoints` feature only): when the fail point `NAME:POINT` (NAME: this node's) is set to
    /// `return` (`FAILPOINTS=b:exit-after-rebuilt=return`) and `point` is reached, the daemon
    /// dies on the spot, as if the machine had crashed there.
    /// Points, source: `exit-before-outcome` (the destination has rebuilt, nothing decided),
    /// `exit-after-outcome` (committed durably, the original not yet killed), `exit-after-kill`
    /// (the original killed or deputized, `Commit` not sent), `exit-after-commit` (after
    /// sending Commit); destination: `exit-after-rebuilt` (after sending Rebuilt),
    /// `exit-before-resume` (the decision heard, the copy not yet resumed).
    pub fn fault(&self, point: &str) {
        if self.fault_at(point) {
            std::process::exit(137);
        }
    }

    /// Whether the fail point `NAME:POINT` returns (logged when it does): for points where
    /// the daemon does something other than die. `abort-after-rebuilt` (destination): the
    /// tree is rebuilt, then thrown away, and the migration aborted, as if the destination had
    /// run out of something at the last moment. `cut-link-after-rebuilt` (destination): after
    /// sending Rebuilt it shuts the migration's connection and reads nothing more from it, as
    /// if the link were cut there (gossip goes on); `cut-link-after-kill` (source): after the
    /// kill, it neither sends `Commit` nor waits for `Resumed`; `pause-after-outcome` and `pause-after-kill` (source): 3 s
    /// after the outcome is recorded, or between the kill and `Commit`, for a test to kill the
    /// worker or cut the link there. `stall-image-send` (source) and `stall-image-read`
    /// (destination): after the first frame of the image, the side stops sending (for twice
    /// `stream_stall_secs`) or reading (five times), its connection open. `advertise-accepting`:
    /// the node's published load says it is idle and takes guests whatever its policy (gossip
    /// that lags behind an `accept no`), while it refuses them. `relay-dial-late` (a body's
    /// node): its relays are dialled home 2 s after the body runs, as on a node under load.
    /// `lazy-push-late` (a lazy move's destination): the background push starts 2 s after
    /// the tree runs, so that what the tree does first meets pages still owed.
    pub fn fault_at(&self, point: &str) -> bool {
        fail::fail_point!(&format!("{}:{point}", self.name()), |_| {
            tracing::error!(event = "fault-injected", point);
            true
        });
        let _ = point;
        false
    }

    /// This node's load as last published, with its owner's state and grants as they are now.
    pub fn own_load(&self) -> ferry_policy::NodeLoad {
        let mut l = self.membership.own_load().unwrap_or_default();
        self.hosts.annotate(&mut l);
        l
    }
}

/// Runs the daemon until SIGTERM or SIGINT.
pub async fn run(config: Config, exe: PathBuf) -> Result<()> {
    std::fs::create_dir_all(&config.data_dir)
        .with_context(|| format!("create data directory {}", config.data_dir.display()))?;
    ferry_sys::fdops::set_child_subreaper().context("become the subreaper of our guests")?;
    if let Some(shared) = &config.shared {
        if !shared.is_dir() {
            bail!(
                "the shared tree {} (`shared` in the config) is not a directory on this node",
                shared.display()
            );
        }
    }
    let mut creds = Credentials::load(&config.credentials).context("load cluster credentials")?;
    creds.local_ip = Some(config.listen.ip());
    let revocations = match &config.revoked {
        Some(path) => {
            let list = RevocationList::load(path)?;
            if list.contains(&creds.fingerprint) {
                tracing::error!(event = "own-certificate-revoked", path = %path.display(),
                    "this node's own certificate is revoked: every peer will refuse it");
            }
            tracing::info!(event = "revocations", path = %path.display(), revoked = list.len());
            creds.set_revoked(list.clone());
            Some((path.clone(), list))
        }
        None => None,
    };
    if creds.node != config.name {
        bail!(
            "config names this node {:?} but its certificate {} is for {:?}",
            config.name,
            config.credentials.cert.display(),
            creds.node
        );
    }
    let tcp = TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("listen on {}", config.listen))?;
    let sock_path = config.control_socket();
    if UnixStream::connect(&sock_path).await.is_ok() {
        bail!(
            "another daemon already serves {}; stop it first",
            sock_path.display()
        );
    }
    let _ = std::fs::remove_file(&sock_path);
    let control = UnixListener::bind(&sock_path)
        .with_context(|| format!("bind control socket {}", sock_path.display()))?;
    {
        // Root's only unless the config opens it to a group or to everyone; each caller is
        // then served as who they are (serve_cli).
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&sock_path, std::fs::Permissions::from_mode(0o600))
            .with_context(|| format!("restrict {}", sock_path.display()))?;
        if let Some(gid) = config.control_gid()? {
            std::os::unix::fs::chown(&sock_path, None, Some(gid))
                .with_context(|| format!("give {} to group {gid}", sock_path.display()))?;
        }
        std::fs::set_permissions(
            &sock_path,
            std::fs::Permissions::from_mode(config.control_mode()?),
        )
        .with_context(|| format!("set the mode of {}", sock_path.display()))?;
    }
    // Greater at each start, even if the clock went back: a restarted node's identity
    // supersedes its previous one, and its load records the previous ones.
    let incarnation = crate::membership::incarnation(&config.data_dir)?;
    let me = NodeId {
        name: config.name.clone(),
        addr: config.listen,
        bump: incarnation,
    };
    let membership = Membership::start(me, incarnation, creds.clone(), config.peers.clone());
    let hosts = crate::hosts::Hosts::new(&config);
    let accepting = hosts.accepts().is_ok();
    let store = Arc::new(crate::state::Store::open(&config.data_dir)?);
    let balancer = crate::balancer::Balancer::new(config.balance.clone());
    let links = crate::links::Links::recover(store.clone());
    // Before the reaper runs: the helper that makes it is waited for here.
    let guest_mounts = crate::confine::GuestMounts::make(&config, &exe);
    let node = Arc::new(Node {
        creds,
        membership,
        config,
        reaper: Reaper::default(),
        guests: Guests::recover(store.clone()),
        outcomes: crate::outcomes::Outcomes::recover(store.clone()),
        store,
        deputies: Default::default(),
        bodies: Default::default(),
        relays: Default::default(),
        body_relays: Default::default(),
        accepting: AtomicBool::new(accepting),
        hosts,
        exe,
        guest_mounts,
        metrics: Default::default(),
        cpu: Default::default(),
        exec_spares: Default::default(),
        run_notices: Default::default(),
        balancer,
        links,
    });
    tracing::info!(event = "started", node = %node.name(), listen = %node.config.listen,
        control = %sock_path.display(), peers = ?node.config.peers,
        shared = ?node.config.shared, hostname = %hostname());

    // What the last run of this daemon left undone, before any peer can ask.
    crate::migrate::recover(&node);
    crate::deputies::recover(&node);
    crate::relay_keep::recover(&node);
    // Guest inits report here the end of every child they reap (see crate::deputies).
    let reports_path = node.config.data_dir.join(crate::deputies::REPORT_SOCKET);
    let _ = std::fs::remove_file(&reports_path);
    let reports = tokio::net::UnixDatagram::bind(&reports_path)
        .with_context(|| format!("bind {}", reports_path.display()))?;
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&reports_path, std::fs::Permissions::from_mode(0o600))
            .with_context(|| format!("restrict {}", reports_path.display()))?;
    }
    tokio::spawn(crate::deputies::serve_reports(node.clone(), reports));
    tokio::spawn(publish_load(node.clone()));
    tokio::spawn(crate::hosts::watch(node.clone()));
    tokio::spawn(crate::balancer::run(node.clone()));
    tokio::spawn(reap(node.clone()));
    tokio::spawn(rejoin(node.clone()));
    tokio::spawn(crate::recovery::fence(node.clone()));
    if let Some((path, list)) = revocations {
        tokio::spawn(watch_revocations(node.clone(), path, list));
    }
    start_web(&node).await?;
    let peers = tokio::spawn(accept_peers(node.clone(), tcp));
    let cli = tokio::spawn(accept_cli(node.clone(), control));

    let mut term = signal(SignalKind::terminate()).context("watch SIGTERM")?;
    let mut int = signal(SignalKind::interrupt()).context("watch SIGINT")?;
    let why = tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
    };
    tracing::info!(event = "stopping", node = %node.name(), signal = why,
        guests = node.guests.count());
    peers.abort();
    cli.abort();
    node.membership.leave().await;
    let _ = std::fs::remove_file(&sock_path);
    tracing::info!(event = "stopped", node = %node.name());
    Ok(())
}

/// Opens the web page and metrics (crate::web). A configured address that cannot be had stops
/// the daemon; the default one is only warned about (the daemon works without its page).
async fn start_web(node: &Arc<Node>) -> Result<()> {
    let Some((addr, configured)) = node.config.web_addr()? else {
        return Ok(());
    };
    match crate::web::bind(addr).await {
        Ok(l) => {
            let tls = !addr.ip().is_loopback();
            let addr = l.local_addr().unwrap_or(addr);
            tracing::info!(event = "web", addr = %addr, mutual_tls = tls);
            tokio::spawn(crate::web::serve(node.clone(), l));
            Ok(())
        }
        Err(e) if !configured => {
            tracing::warn!(event = "web-unavailable", addr = %addr, error = %format!("{e:#}"),
                "no page or metrics (set `web` in the config to choose an address)");
            Ok(())
        }
        Err(e) => Err(e),
    }
}

/// This node's host name (that of its UTS namespace).
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_default()
}

/// Measures and publishes this node's load every second. A measure that fails is never
/// published as a number: the last good load goes out again marked `stale` (which policy
/// treats as unknown), or nothing if there was none.
async fn publish_load(node: Arc<Node>) {
    let mut sampler = LoadSampler::default();
    let mut last: Option<ferry_policy::NodeLoad> = None;
    let mut failing = false;
    loop {
        let accepting = node.accepting.load(Ordering::Relaxed);
        match sampler.sample(node.guests.count(), accepting) {
            Ok(mut load) => {
                node.hosts.annotate(&mut load);
                if node.fault_at("advertise-accepting") {
                    // Gossip behind the node's policy: others take it for idle and open.
                    load.accepting = true;
                    (load.runnable, load.cpu_idle_pct, load.guests) = (0, 100.0, 0);
                }
                (load.demand, load.capacity) = node.balancer.figures();
                if failing {
                    tracing::info!(event = "load-measured-again");
                    failing = false;
                }
                last = Some(load.clone());
                node.membership.publish(load);
            }
            Err(e) => {
                if !failing {
                    tracing::warn!(event = "load-unmeasurable", error = %format!("{e:#}"));
                    failing = true;
                }
                if let Some(l) = &last {
                    let mut l = l.clone();
                    l.stale = true;
                    l.accepting = accepting;
                    l.guests = node.guests.count();
                    node.hosts.annotate(&mut l);
                    node.membership.publish(l);
                }
            }
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// Reloads the revocation list when it changes (its modification time, size or inode, checked
/// every second) or on SIGHUP, and shuts the connections of newly revoked certificates. A
/// list that cannot be read or parsed leaves the previous one in force, and says so.
async fn watch_revocations(node: Arc<Node>, path: PathBuf, mut list: RevocationList) {
    let stamp = |p: &std::path::Path| {
        std::fs::metadata(p).ok().map(|m| {
            use std::os::unix::fs::MetadataExt;
            (m.mtime(), m.mtime_nsec(), m.size(), m.ino())
        })
    };
    let mut seen = stamp(&path);
    let mut hup = signal(SignalKind::hangup()).ok();
    loop {
        let hangup = async {
            match hup.as_mut() {
                Some(h) => {
                    h.recv().await;
                }
                None => std::future::pending().await,
            }
        };
        let asked = tokio::select! {
            _ = hangup => true,
            _ = tokio::time::sleep(Duration::from_secs(1)) => false,
        };
        let now = stamp(&path);
        if !asked && now == seen {
            continue;
        }
        seen = now;
        match RevocationList::load(&path) {
            Ok(new) => {
                if new != list || asked {
                    if new.contains(&node.creds.fingerprint) {
                        tracing::error!(event = "own-certificate-revoked", path = %path.display(),
                            "this node's own certificate is revoked: every peer will refuse it");
                    }
                    let dropped = node.creds.set_revoked(new.clone());
                    tracing::info!(event = "revocations-reloaded", path = %path.display(),
                        revoked = new.len(), dropped = dropped.len());
                    for (peer, addr) in dropped {
                        tracing::warn!(event = "revoked-connection-dropped", peer = %peer,
                            addr = %addr);
                    }
                    list = new;
                }
            }
            Err(e) => {
                tracing::error!(event = "revocations-unreadable", path = %path.display(),
                    error = %format!("{e:#}"), "the previous list stays in force")
            }
        }
    }
}

/// Keeps knocking on the configured peers while we know nobody: a node started before its
/// peers, or cut off from them, finds its way back.
async fn rejoin(node: Arc<Node>) {
    loop {
        tokio::time::sleep(Duration::from_secs(2)).await;
        if node.membership.members().is_empty() {
            for p in &node.config.peers {
                node.membership.announce(*p);
            }
        }
    }
}

async fn reap(node: Arc<Node>) {
    let mut chld = match signal(SignalKind::child()) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "cannot watch SIGCHLD; reaping by polling only");
            return poll_reap(node).await;
        }
    };
    loop {
        tokio::select! {
            _ = chld.recv() => {}
            _ = tokio::time::sleep(Duration::from_millis(500)) => {}
        }
        reap_now(&node);
    }
}

async fn poll_reap(node: Arc<Node>) {
    loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        reap_now(&node);
    }
}

fn reap_now(node: &Node) {
    for (pid, status) in node.reaper.reap() {
        if let Some(g) = node.guests.remove(pid) {
            tracing::info!(event = "guest-ended", pid, home_pid = g.home_pid,
                home = %g.home_node, status = %describe_status(status));
        } else {
            tracing::debug!(event = "reaped", pid, status = %describe_status(status));
        }
    }
    for g in node.guests.prune() {
        tracing::info!(event = "guest-ended", pid = g.pid, home_pid = g.home_pid,
            home = %g.home_node, status = "gone");
    }
}

pub fn describe_status(status: i32) -> String {
    if libc::WIFSIGNALED(status) {
        format!("killed by signal {}", libc::WTERMSIG(status))
    } else {
        format!("exit {}", libc::WEXITSTATUS(status))
    }
}

/// At most this many connections may be waiting for their handshake at once...
pub const MAX_HANDSHAKES: usize = 256;
/// ... and at most this many from one source address. Beyond these, a connection is closed as
/// soon as it is accepted: idle or slow strangers cannot exhaust the daemon's descriptors and
/// memory (each also has `tls::HANDSHAKE_TIMEOUT` to finish).
pub const MAX_HANDSHAKES_PER_SOURCE: usize = 16;

/// Connections waiting for their handshake, by source address.
#[derive(Default)]
struct Handshakes {
    by_source: Mutex<HashMap<std::net::IpAddr, usize>>,
}

/// A slot among [`MAX_HANDSHAKES`], freed when dropped.
struct HandshakeSlot {
    table: Arc<Handshakes>,
    source: std::net::IpAddr,
}

impl Handshakes {
    fn take(self: &Arc<Self>, source: std::net::IpAddr) -> Option<HandshakeSlot> {
        let mut t = self.by_source.lock().expect("handshakes lock");
        let total: usize = t.values().sum();
        let here = t.get(&source).copied().unwrap_or(0);
        if total >= MAX_HANDSHAKES || here >= MAX_HANDSHAKES_PER_SOURCE {
            return None;
        }
        *t.entry(source).or_insert(0) += 1;
        Some(HandshakeSlot {
            table: self.clone(),
            source,
        })
    }
}

impl Drop for HandshakeSlot {
    fn drop(&mut self) {
        let mut t = self.table.by_source.lock().expect("handshakes lock");
        if let Some(n) = t.get_mut(&self.source) {
            *n -= 1;
            if *n == 0 {
                t.remove(&self.source);
            }
        }
    }
}

async fn accept_peers(node: Arc<Node>, tcp: TcpListener) {
    let handshakes = Arc::new(Handshakes::default());
    let mut shed = 0u64;
    let mut shed_logged: Option<std::time::Instant> = None;
    loop {
        let (stream, from) = match tcp.accept().await {
            Ok(x) => x,
            Err(e) => {
                tracing::warn!(error = %e, "accept");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Some(slot) = handshakes.take(from.ip()) else {
            drop(stream);
            shed += 1;
            if shed_logged.is_none_or(|t| t.elapsed() >= Duration::from_secs(10)) {
                tracing::warn!(event = "connections-shed", count = shed, last_from = %from,
                    per_source = MAX_HANDSHAKES_PER_SOURCE, total = MAX_HANDSHAKES,
                    "too many connections waiting for their handshake: closed at once");
                shed = 0;
                shed_logged = Some(std::time::Instant::now());
            }
            continue;
        };
        let node = node.clone();
        tokio::spawn(async move {
            let conn = match tls::accept(&node.creds, stream).await {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!(event = "refused", from = %from, error = %format!("{e:#}"));
                    return;
                }
            };
            drop(slot);
            let peer = conn.peer.clone();
            if let Err(e) = serve_peer(&node, conn).await {
                tracing::warn!(event = "peer-error", peer = %peer, from = %from,
                    error = %format!("{e:#}"));
            }
        });
    }
}

async fn serve_peer(node: &Arc<Node>, mut conn: Conn) -> Result<()> {
    let first = match read_msg(&mut conn.stream).await {
        Ok(m) => m,
        Err(FrameError::Closed) => return Ok(()),
        Err(e) => return Err(e).context("first message"),
    };
    match first {
        Msg::Gossip { packet } => {
            let peer = conn.peer.clone();
            let deliver = |packet: serde_bytes::ByteBuf| {
                node.membership
                    .deliver(&peer, packet.into_vec())
                    .map_err(|e| anyhow::anyhow!("{e}: dropping the gossip connection"))
            };
            deliver(packet)?;
            loop {
                match read_msg(&mut conn.stream).await {
                    Ok(Msg::Gossip { packet }) => deliver(packet)?,
                    Ok(other) => bail!("{} message on a gossip connection", kind(&other)),
                    Err(FrameError::Closed) => return Ok(()),
                    Err(e) => return Err(e).context("gossip connection"),
                }
            }
        }
        Msg::MigrateOffer(offer) => migrate::receive(node.clone(), conn, offer).await,
        Msg::Run(spec) => {
            node.metrics.remote_exec("host");
            exec::serve(node.clone(), conn, spec).await
        }
        Msg::OutcomeQuery { id } => {
            // Unanswered (the connection closes) if the answer cannot be recorded: the
            // destination asks again.
            // Asked by the source of a copy held or run here: whether it ran (the source
            // restarted before deciding).
            let committed = match crate::migrate::copy_state(node, id, &conn.peer) {
                Some(ran) => ran,
                None => node.outcomes.answer(id, &conn.peer).with_context(|| {
                    format!(
                        "record the outcome of migration {id} asked by {}",
                        conn.peer
                    )
                })?,
            };
            write_msg(&mut conn.stream, &Msg::Outcome { id, committed }).await?;
            Ok(())
        }
        m @ (Msg::SignalBody { .. }
        | Msg::FenceBody { .. }
        | Msg::BodyStatus { .. }
        | Msg::BodyMoved { .. }
        | Msg::ForkDeputy { .. }
        | Msg::BodyIds { .. }) => {
            let peer = conn.peer.clone();
            let reply = crate::deputies::serve_peer(node, &peer, m).await;
            write_msg(&mut conn.stream, &reply).await?;
            Ok(())
        }
        m @ Msg::HomeCall { .. } => crate::deputies::serve_calls(node, conn, m).await,
        Msg::CheckpointBody { pid } => {
            crate::recovery::serve_checkpoint(node, &mut conn, pid).await
        }
        Msg::RelayOpen { pid, pipe, at } => {
            crate::relay::serve_open(node, conn, pid, pipe, at).await
        }
        Msg::LocalProcesses => {
            write_msg(&mut conn.stream, &Msg::Processes(node.local_processes())).await?;
            Ok(())
        }
        Msg::LocalView => {
            let v = crate::view::local_view(node);
            write_msg(&mut conn.stream, &Msg::View(v)).await?;
            Ok(())
        }
        m @ (Msg::GrantHost { .. } | Msg::ReleaseHost { .. }) => {
            let reply = crate::hosts::serve_peer(node, &conn.peer, m);
            write_msg(&mut conn.stream, &reply).await?;
            Ok(())
        }
        Msg::Evict {
            node: target,
            drain,
        } => {
            let peer = conn.peer.clone();
            let reply = crate::evict::serve(node, &target, drain, Some(&peer)).await;
            write_msg(&mut conn.stream, &reply).await?;
            Ok(())
        }
        Msg::BalanceAdopt {
            home_node,
            home_pid,
        } => {
            let reply = crate::balancer::adopt(node, &conn.peer, &home_node, home_pid);
            write_msg(&mut conn.stream, &reply).await?;
            Ok(())
        }
        other => bail!("unexpected {} message from a peer", kind(&other)),
    }
}

async fn accept_cli(node: Arc<Node>, control: UnixListener) {
    loop {
        let stream = match control.accept().await {
            Ok((s, _)) => s,
            Err(e) => {
                tracing::warn!(error = %e, "accept on control socket");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let node = node.clone();
        tokio::spawn(async move {
            if let Err(e) = serve_cli(&node, stream).await {
                tracing::debug!(error = %format!("{e:#}"), "cli connection");
            }
        });
    }
}

async fn serve_cli(node: &Arc<Node>, mut s: UnixStream) -> Result<()> {
    // This is the door to ptrace: who is calling decides what is served.
    let cred = s.peer_cred().context("peer credentials")?;
    let request = read_msg(&mut s).await?;
    // A caller who is not root may run a command as itself (exec::relay checks what it
    // claims), list its own processes, and checkpoint, restore and migrate its own; the
    // engine's commands check that with `--owner` (docs/security.md, "Users who are not
    // root"). Everything else is root's.
    let owner = if cred.uid() == 0 {
        None
    } else {
        let groups = ferry_sys::spawn::peer_groups(std::os::fd::AsRawFd::as_raw_fd(&s))
            .context("the caller's groups")?;
        Some(ferry_sys::owner::Owner::of_caller(
            cred.uid(),
            cred.gid(),
            groups,
            cred.pid(),
        ))
    };
    if owner.is_some()
        && !matches!(
            request,
            Msg::Run(_)
                | Msg::ListProcesses
                | Msg::Migrate { .. }
                | Msg::Checkpoint { .. }
                | Msg::Restore { .. }
        )
    {
        write_msg(
            &mut s,
            &Msg::error(format!(
                "uid {} may not ask for {}: only root may (a user may run, ps, checkpoint, \
                 restore and migrate their own processes)",
                cred.uid(),
                kind(&request)
            )),
        )
        .await?;
        return Ok(());
    }
    match request {
        Msg::ListNodes => write_msg(&mut s, &Msg::Nodes(nodes(node))).await?,
        Msg::LocalProcesses => write_msg(&mut s, &Msg::Processes(node.local_processes())).await?,
        Msg::ListProcesses => {
            let mut all = processes(node).await;
            // A user sees only their own processes.
            if let Some(o) = &owner {
                all.retain(|p| p.uid == o.uid);
            }
            write_msg(&mut s, &Msg::Processes(all)).await?
        }
        m @ (Msg::Checkpoint { .. } | Msg::Restore { .. }) => {
            let reply = crate::engine_cmd::serve(node, &mut s, m, owner.as_ref())
                .await
                .unwrap_or_else(|e| Msg::error(format!("{e:#}")));
            write_msg(&mut s, &reply).await?
        }
        Msg::Migrate { pid, to, memory } => {
            let reply = match migrate::send(node.clone(), &mut s, pid, &to, &memory, owner.as_ref())
                .await
            {
                Ok(report) => Msg::Migrated(report),
                Err(e) => {
                    let message = format!("{e:#}");
                    tracing::warn!(event = "migrate-failed", pid, to = %to, error = %message);
                    Msg::Error { message }
                }
            };
            write_msg(&mut s, &reply).await?
        }
        Msg::Cluster => {
            let v = crate::view::cluster_view(node).await;
            write_msg(&mut s, &Msg::View(v)).await?
        }
        Msg::Run(spec) => {
            node.metrics.remote_exec("caller");
            exec::relay(node.clone(), s, spec).await?
        }
        m @ (Msg::SetAccepting { .. }
        | Msg::SetAcceptPolicy { .. }
        | Msg::HostsGet { .. }
        | Msg::HostsRelease { .. }) => {
            let reply = crate::hosts::serve_cli(node, m).await;
            write_msg(&mut s, &reply).await?
        }
        Msg::Evict {
            node: target,
            drain,
        } => {
            let reply = crate::evict::serve(node, &target, drain, None).await;
            write_msg(&mut s, &reply).await?
        }
        Msg::BalanceAdd { pid } => {
            let reply = match node
                .balancer
                .add(pid, "handed over with `ferry balance add`", false)
            {
                Ok(()) => Msg::Done,
                Err(e) => Msg::error(format!("{e:#}")),
            };
            write_msg(&mut s, &reply).await?
        }
        Msg::BalanceLog => write_msg(&mut s, &Msg::BalanceDecisions(node.balancer.log())).await?,
        Msg::BalanceSet { settings } => {
            let reply = match node
                .balancer
                .set(&settings)
                .and_then(|c| Ok(toml::to_string(&c)?))
            {
                Ok(toml) => Msg::BalanceSettings { toml },
                Err(e) => Msg::error(format!("{e:#}")),
            };
            write_msg(&mut s, &reply).await?
        }
        other => {
            write_msg(
                &mut s,
                &Msg::error(format!("the daemon does not serve {}", kind(&other))),
            )
            .await?
        }
    }
    Ok(())
}

/// Every node this node knows, itself first among equals (sorted by name).
pub fn nodes(node: &Node) -> Vec<NodeInfo> {
    // The published load lags by up to a sample; whether this node takes guests is known now
    // (a `ferry accept no` shows at once).
    let mut own = node.membership.own_load();
    if let Some(l) = own.as_mut() {
        l.accepting = node.accepting.load(std::sync::atomic::Ordering::Relaxed);
    }
    let mut v = vec![NodeInfo {
        name: node.name().to_string(),
        addr: node.config.listen.to_string(),
        state: "self".into(),
        load: own,
    }];
    for m in node.membership.members() {
        v.push(NodeInfo {
            name: m.id.name,
            addr: m.id.addr.to_string(),
            state: "alive".into(),
            load: m.load,
        });
    }
    v.sort_by(|a, b| a.name.cmp(&b.name));
    v
}

/// Every node's guests, asked in parallel; a node that does not answer in time is skipped.
async fn processes(node: &Arc<Node>) -> Vec<ProcInfo> {
    let mut all = node.local_processes();
    let mut asks = Vec::new();
    for m in node.membership.members() {
        let node = node.clone();
        asks.push(tokio::spawn(async move {
            let work = async {
                let mut c = tls::connect(
                    &node.creds,
                    Some(&m.id.name),
                    m.id.addr,
                    Duration::from_secs(2),
                )
                .await?;
                write_msg(&mut c.stream, &Msg::LocalProcesses).await?;
                match read_msg(&mut c.stream).await? {
                    Msg::Processes(p) => Ok(p),
                    other => bail!("unexpected {}", kind(&other)),
                }
            };
            tokio::time::timeout(Duration::from_secs(3), work)
                .await
                .unwrap_or_else(|_| bail!("timed out"))
                .unwrap_or_else(|e: anyhow::Error| {
                    tracing::debug!(node = %m.id.name, error = %e, "ps");
                    Vec::new()
                })
        }));
    }
    for a in asks {
        if let Ok(p) = a.await {
            all.extend(p);
        }
    }
    // The trees whose home is here: their deputies (those forked since they left too).
    for p in &mut all {
        if p.home_node == node.name() && p.kind == "migrated" {
            p.deputies = node
                .deputies
                .tree_of(&p.node, p.home_pid)
                .unwrap_or_default();
        }
    }
    all.sort_by(|a, b| (&a.home_node, a.home_pid).cmp(&(&b.home_node, b.home_pid)));
    all
}
