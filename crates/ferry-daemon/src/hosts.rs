//! Who may use this machine, and who holds it (Sprite, chapter 6).
//!
//! **The owner** ([`watch`]): every half second the node reads its own signals, the one-minute
//! load average (/proc/loadavg) and the last user input: events read from the input devices
//! under the watched directories (`/dev/input/event*`, each read by a thread of its own, as
//! any other reader would: nothing is grabbed) and the access times of the watched terminals
//! (a terminal's access time moves when someone reads what was typed on it; the kernel keeps
//! it to 8 s). Terminals that a guest of this node holds are its, not the owner's. Under
//! `accept = idle` the node takes guests only while idle (`ferry_policy::owner`), and input
//! evicts its guests (crate::evict).
//!
//! **Host grants**: each host grants itself (ARCHITECTURE.md, "Host selection"). A requester's
//! daemon chooses hosts from its gossip view (`ferry_policy::hosts::select`), asks each one
//! (`GrantHost`), and, when none is free, asks the host fairness points at to take itself back
//! from the user holding the most. A host decides under its own lock, so two requesters never
//! both get one class of it. Grants ride in the host's `NodeLoad`. A grant ends when its holder
//! gives it back, when the holder's process ends (its node's daemon watches it), when the
//! requester's node is declared dead, or when the host stops accepting guests.

use crate::node::Node;
use anyhow::{anyhow, bail, Result};
use ferry_policy::hosts::{self as policy, Decision, HostRequest};
use ferry_policy::owner::{self, IdleThresholds, OwnerSignals};
use ferry_policy::{AcceptPolicy, HostGrant, NodeLoad, OwnerState};
use ferry_transport::message::{kind, HostsReport};
use ferry_transport::{read_msg, write_msg, Msg};
use serde::{Deserialize, Serialize};
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// `[owner]` in the node's config.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OwnerConfig {
    /// always | idle | never; absent: `accept_guests` decides (true: always, false: never).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accept: Option<AcceptPolicy>,
    /// Idle: the one-minute load average (less the guests' own) below this (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub load_below: Option<f64>,
    /// Idle: no input for this many seconds (default 30).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input_idle_secs: Option<u64>,
    /// Devices and terminals whose use is the owner's input: files, or directories of them.
    /// Default: /dev/input, /dev/pts and the virtual consoles /dev/tty1..12.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input_watch: Option<Vec<PathBuf>>,
}

impl OwnerConfig {
    pub fn is_default(&self) -> bool {
        self == &OwnerConfig::default()
    }

    fn thresholds(&self) -> IdleThresholds {
        let d = IdleThresholds::default();
        IdleThresholds {
            load_below: self.load_below.unwrap_or(d.load_below),
            input_idle_secs: self.input_idle_secs.unwrap_or(d.input_idle_secs),
        }
    }

    fn watch(&self) -> Vec<PathBuf> {
        self.input_watch.clone().unwrap_or_else(|| {
            let mut v = vec![PathBuf::from("/dev/input"), PathBuf::from("/dev/pts")];
            v.extend((1..=12).map(|n| PathBuf::from(format!("/dev/tty{n}"))));
            v
        })
    }
}

static CONFIG_PATH: OnceLock<PathBuf> = OnceLock::new();

/// Where the daemon's config lives, for reloading `[owner]` on SIGHUP.
pub fn set_config_path(p: &Path) {
    let _ = CONFIG_PATH.set(p.to_path_buf());
}

/// A grant this node's processes hold on another host.
#[derive(Debug, Clone)]
struct Held {
    host: String,
    class: String,
    holder: i32,
    /// The holder's start time: a PID reused by another process holds nothing.
    start: Option<u64>,
}

struct State {
    policy: AcceptPolicy,
    draining: bool,
    thresholds: IdleThresholds,
    watch: Vec<PathBuf>,
    idle: bool,
    /// The owner's input is recent (under `idle`, the guests must go).
    returned: bool,
    input_idle_secs: Option<u64>,
    load_avg: f64,
    /// The guests' runnable count, averaged like the kernel's load average.
    guests_runnable: f64,
    /// This host's grants.
    grants: Vec<HostGrant>,
    /// Grants held by processes of this node.
    held: Vec<Held>,
    /// Input devices being read.
    readers: HashSet<PathBuf>,
}

/// The owner's policy and the grants of this node.
pub struct Hosts {
    state: Mutex<State>,
    /// Unix ms of the last event read from an input device.
    last_event_ms: Arc<AtomicU64>,
    /// FERRY_SIMULATED_NODES: made-up nodes besides the members (benchmarks only).
    sim: Mutex<Vec<(String, NodeLoad)>>,
    evicting: std::sync::atomic::AtomicBool,
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

impl Hosts {
    pub fn new(config: &crate::Config) -> Hosts {
        let o = &config.owner;
        let sim = std::env::var("FERRY_SIMULATED_NODES")
            .ok()
            .and_then(|n| n.parse::<usize>().ok())
            .map(simulated_nodes)
            .unwrap_or_default();
        Hosts {
            state: Mutex::new(State {
                policy: policy_of(config),
                draining: false,
                thresholds: o.thresholds(),
                watch: o.watch(),
                idle: true,
                returned: false,
                input_idle_secs: None,
                load_avg: 0.0,
                guests_runnable: 0.0,
                grants: Vec::new(),
                held: Vec::new(),
                readers: HashSet::new(),
            }),
            last_event_ms: Arc::new(AtomicU64::new(0)),
            sim: Mutex::new(sim),
            evicting: Default::default(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().expect("hosts lock")
    }

    /// Whether this node takes a new guest now, and why not.
    pub fn accepts(&self) -> Result<(), String> {
        let s = self.lock();
        owner::accepts(s.policy, s.draining, s.idle)
    }

    /// The owner's policy from now on; ends a drain.
    pub fn set_policy(&self, node: &Node, policy: AcceptPolicy) {
        {
            let mut s = self.lock();
            s.policy = policy;
            s.draining = false;
        }
        self.refresh_accepting(node);
        tracing::info!(event = "accept-policy", policy = %policy);
    }

    pub fn set_draining(&self, node: &Node) {
        self.lock().draining = true;
        self.refresh_accepting(node);
        tracing::info!(event = "draining");
    }

    fn refresh_accepting(&self, node: &Node) {
        let ok = self.accepts().is_ok();
        node.accepting.store(ok, Ordering::Relaxed);
        if !ok {
            // A host that takes no guests is nobody's: its grants end.
            let gone: Vec<HostGrant> = std::mem::take(&mut self.lock().grants);
            for g in gone {
                tracing::info!(event = "grant-ended", class = %g.class, uid = g.uid,
                    requester = %g.requester, holder = g.holder, why = "not accepting guests");
            }
        }
    }

    /// Adds the owner's state and this host's grants to the load about to be published.
    pub fn annotate(&self, load: &mut NodeLoad) {
        let s = self.lock();
        load.console_idle_secs = s.input_idle_secs;
        load.owner = OwnerState {
            policy: s.policy,
            idle: s.idle,
            draining: s.draining,
            load_avg_1m: s.load_avg as f32,
        };
        load.accepting = owner::accepts(s.policy, s.draining, s.idle).is_ok();
        load.grants = s.grants.clone();
    }

    /// This node's own load as it stands now (the published one lags by up to a second).
    fn own_now(&self, node: &Node) -> NodeLoad {
        node.own_load()
    }
}

fn policy_of(config: &crate::Config) -> AcceptPolicy {
    config.owner.accept.unwrap_or(if config.accept_guests {
        AcceptPolicy::Always
    } else {
        AcceptPolicy::Never
    })
}

/// `n` made-up nodes for benchmarks: idle for various times, a tenth not accepting, a tenth
/// holding a grant of class `cc` for one of 10 users.
fn simulated_nodes(n: usize) -> Vec<(String, NodeLoad)> {
    (0..n)
        .map(|i| {
            let mut grants = Vec::new();
            if i % 10 == 3 {
                grants.push(HostGrant {
                    class: "cc".into(),
                    uid: 1000 + (i as u32 % 7),
                    requester: "sim".into(),
                    holder: i as i32,
                    since_unix_ms: i as u64,
                });
            }
            let l = NodeLoad {
                runnable: (i % 3) as u32,
                cpus: 4,
                cpu_idle_pct: 50.0 + (i % 50) as f32,
                free_memory_bytes: 8 << 30,
                // Idle for less than an hour: the real nodes (no console: forever) come first.
                console_idle_secs: Some((i as u64 * 7919) % 3600),
                accepting: i % 10 != 7,
                grants,
                ..Default::default()
            };
            (format!("sim{i:04}"), l)
        })
        .collect()
}

// ---- The owner's signals -------------------------------------------------------------------

/// Watches the owner's signals and the grants, every half second, until the daemon stops.
pub async fn watch(node: Arc<Node>) {
    let mut hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()).ok();
    let mut was_returned = false;
    loop {
        let hangup = async {
            match hup.as_mut() {
                Some(h) => {
                    h.recv().await;
                }
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = hangup => reload(&node),
            _ = tokio::time::sleep(Duration::from_millis(500)) => {}
        }
        let returned = measure(&node);
        if returned && !was_returned {
            tracing::info!(event = "owner-returned", guests = node.guests.count());
            let guests = node
                .guests
                .list()
                .iter()
                .any(|g| g.home_node != node.name());
            if guests && !node.hosts.evicting.swap(true, Ordering::SeqCst) {
                let node = node.clone();
                tokio::spawn(async move {
                    crate::evict::evict(
                        &node,
                        "owner input".into(),
                        crate::evict::LastResort::Kill,
                        |_| true,
                    )
                    .await;
                    node.hosts.evicting.store(false, Ordering::SeqCst);
                });
            }
        }
        was_returned = returned;
        expire(&node).await;
    }
}

/// Takes up the `[owner]` table of the config file again (SIGHUP).
fn reload(node: &Node) {
    let Some(path) = CONFIG_PATH.get() else {
        return;
    };
    match crate::Config::load(path) {
        Ok(c) => {
            {
                let mut s = node.hosts.lock();
                s.policy = policy_of(&c);
                s.thresholds = c.owner.thresholds();
                s.watch = c.owner.watch();
            }
            let s = node.hosts.lock();
            tracing::info!(event = "owner-config", policy = %s.policy,
                load_below = s.thresholds.load_below,
                input_idle_secs = s.thresholds.input_idle_secs, watch = ?s.watch);
        }
        Err(e) => tracing::error!(event = "owner-config-unreadable", path = %path.display(),
            error = %format!("{e:#}"), "the previous settings stay"),
    }
}

/// Reads the signals, updates the state and `node.accepting`; whether the owner's input is
/// recent under `idle` (the guests must leave).
fn measure(node: &Node) -> bool {
    let (watch, thresholds) = {
        let s = node.hosts.lock();
        (s.watch.clone(), s.thresholds)
    };
    let guests = node.guests.list();
    let last_input = last_input(node, &watch, &guests);
    let load_avg = std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split_whitespace().next()?.parse::<f64>().ok());
    let running = guests
        .iter()
        .filter(|g| g.home_node != node.name() && proc_state(g.pid) == Some('R'))
        .count();
    let now = SystemTime::now();
    let returned = {
        let mut s = node.hosts.lock();
        if let Some(l) = load_avg {
            s.load_avg = l;
        }
        // The kernel's one-minute average, sampled every half second.
        let decay = (-0.5f64 / 60.0).exp();
        s.guests_runnable = s.guests_runnable * decay + running as f64 * (1.0 - decay);
        s.input_idle_secs =
            last_input.map(|t| now.duration_since(t).map(|d| d.as_secs()).unwrap_or(0));
        let signals = OwnerSignals {
            load_avg_1m: s.load_avg,
            input_idle_secs: s.input_idle_secs,
            guests_runnable: s.guests_runnable.round() as u32,
        };
        let idle = owner::is_idle(&signals, &thresholds);
        if idle != s.idle {
            tracing::info!(event = if idle { "owner-idle" } else { "owner-busy" },
                load_avg = s.load_avg, input_idle_secs = ?s.input_idle_secs);
        }
        s.idle = idle;
        s.returned = owner::owner_returned(s.policy, &signals, &thresholds);
        s.returned
    };
    node.hosts.refresh_accepting(node);
    returned
}

fn proc_state(pid: i32) -> Option<char> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    s.rsplit_once(") ")?.1.chars().next()
}

/// The last input on the watched devices and terminals (None: nothing watched exists).
fn last_input(
    node: &Node,
    watch: &[PathBuf],
    guests: &[ferry_transport::message::ProcInfo],
) -> Option<SystemTime> {
    let mut files = Vec::new();
    for w in watch {
        match std::fs::read_dir(w) {
            Ok(d) => files.extend(d.flatten().map(|e| e.path())),
            Err(_) if w.exists() => files.push(w.clone()),
            Err(_) => {}
        }
    }
    let mut latest: Option<SystemTime> = None;
    let mut seen = false;
    for f in files {
        use std::os::unix::fs::FileTypeExt;
        let Ok(m) = std::fs::metadata(&f) else {
            continue;
        };
        if !m.file_type().is_char_device() || f.file_name().is_some_and(|n| n == "ptmx") {
            continue;
        }
        seen = true;
        let name = f.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if name.starts_with("event") {
            // An input device: its events, read as they come (its times say nothing).
            start_reader(node, &f);
            continue;
        }
        let Ok(at) = m.accessed() else { continue };
        if latest.is_some_and(|l| at <= l) {
            continue;
        }
        if held_by_guest(&f, guests) {
            continue;
        }
        latest = Some(at);
    }
    let ev = node.hosts.last_event_ms.load(Ordering::Relaxed);
    if ev > 0 {
        let t = UNIX_EPOCH + Duration::from_millis(ev);
        latest = Some(latest.map_or(t, |l| l.max(t)));
    }
    (seen || latest.is_some()).then(|| latest.unwrap_or(UNIX_EPOCH))
}

/// Whether a guest of this node has terminal `f` open (a `ferry run` program's pty: its
/// reads are the guest's, not the owner's).
fn held_by_guest(f: &Path, guests: &[ferry_transport::message::ProcInfo]) -> bool {
    guests.iter().any(|g| {
        std::fs::read_dir(format!("/proc/{}/fd", g.pid)).is_ok_and(|d| {
            d.flatten()
                .any(|e| std::fs::read_link(e.path()).is_ok_and(|l| l == f))
        })
    })
}

/// Reads input device `dev` on a thread of its own; every event read marks input.
fn start_reader(node: &Node, dev: &Path) {
    if !node.hosts.lock().readers.insert(dev.to_path_buf()) {
        return;
    }
    let last = node.hosts.last_event_ms.clone();
    let dev = dev.to_path_buf();
    let spawned = std::thread::Builder::new()
        .name("input".into())
        .spawn(move || {
            use std::io::Read;
            let mut f = match std::fs::File::open(&dev) {
                Ok(f) => f,
                Err(e) => {
                    tracing::warn!(event = "input-unreadable", device = %dev.display(), error = %e);
                    return;
                }
            };
            tracing::info!(event = "input-watched", device = %dev.display());
            let mut buf = [0u8; 24 * 64];
            while let Ok(n) = f.read(&mut buf) {
                if n == 0 {
                    break;
                }
                last.store(now_ms(), Ordering::Relaxed);
            }
            tracing::info!(event = "input-gone", device = %dev.display());
        });
    if let Err(e) = spawned {
        tracing::warn!(event = "input-unwatched", error = %e);
    }
}

// ---- Grants ---------------------------------------------------------------------------------

/// Ends grants whose requester's node is dead, and gives back those held here by processes
/// that ended.
async fn expire(node: &Arc<Node>) {
    let dead: Vec<HostGrant> = {
        let mut s = node.hosts.lock();
        let (dead, live): (Vec<_>, Vec<_>) = std::mem::take(&mut s.grants)
            .into_iter()
            .partition(|g| g.requester != node.name() && node.membership.is_down(&g.requester));
        s.grants = live;
        dead
    };
    for g in dead {
        tracing::info!(event = "grant-ended", class = %g.class, uid = g.uid,
            requester = %g.requester, holder = g.holder, why = "its requester's node is down");
    }
    let ended: Vec<Held> = {
        let mut s = node.hosts.lock();
        let (ended, live): (Vec<_>, Vec<_>) = std::mem::take(&mut s.held)
            .into_iter()
            .partition(|h| crate::state::start_time(h.holder) != h.start);
        s.held = live;
        ended
    };
    for h in ended {
        tracing::info!(event = "holder-ended", host = %h.host, class = %h.class, holder = h.holder);
        let node = node.clone();
        tokio::spawn(async move { release_on(&node, &h.host, h.holder, Some(h.class)).await });
    }
}

/// The cluster as this node sees it: itself, the live members with a load, the simulated.
fn view(node: &Node) -> Vec<(String, NodeLoad)> {
    let mut v = vec![(node.name().to_string(), node.hosts.own_now(node))];
    // What this node's processes hold, this node knows better than the gossip, which lags a
    // second: a grant of ours that we gave back is gone already.
    let held: Vec<(String, String, i32)> = node
        .hosts
        .lock()
        .held
        .iter()
        .map(|h| (h.host.clone(), h.class.clone(), h.holder))
        .collect();
    let me = node.name();
    for m in node.membership.members() {
        if let Some(mut l) = m.load {
            let host = m.id.name;
            l.grants.retain(|g| {
                g.requester != me
                    || held
                        .iter()
                        .any(|(h, c, p)| *h == host && *c == g.class && *p == g.holder)
            });
            v.push((host, l));
        }
    }
    v.extend(node.hosts.sim.lock().expect("sim lock").iter().cloned());
    v
}

/// A host's answer to `GrantHost`, decided under its lock.
fn grant_here(node: &Arc<Node>, want: HostGrant, reclaim: bool) -> Result<(), String> {
    // The cluster's holdings matter only to a fairness claim.
    let cluster = if reclaim { view(node) } else { Vec::new() };
    let refs: Vec<(&str, &NodeLoad)> = cluster.iter().map(|(n, l)| (n.as_str(), l)).collect();
    let reclaimed = {
        let own = node.hosts.own_now(node);
        let mut s = node.hosts.lock();
        // Decided on the grants as they are now, under the lock.
        let mut own = own;
        own.grants = s.grants.clone();
        match policy::decide(&own, &refs, &want, reclaim) {
            Decision::Refuse(r) => return Err(r),
            Decision::Grant { reclaimed } => {
                let again = |g: &HostGrant| {
                    g.class == want.class
                        && g.requester == want.requester
                        && g.holder == want.holder
                };
                s.grants.retain(|g| !reclaimed.contains(g) && !again(g));
                s.grants.push(want.clone());
                reclaimed
            }
        }
    };
    tracing::info!(event = "granted", class = %want.class, uid = want.uid,
        requester = %want.requester, holder = want.holder, reclaimed = reclaimed.len());
    for g in reclaimed {
        tracing::info!(event = "grant-reclaimed", class = %g.class, uid = g.uid,
            requester = %g.requester, holder = g.holder, for_uid = want.uid);
        let node = node.clone();
        tokio::spawn(async move {
            let reason = format!("reclaimed for uid {}", want.uid);
            crate::evict::evict(&node, reason, crate::evict::LastResort::Stay, |p| {
                p.home_node == g.requester && p.uid == g.uid
            })
            .await;
        });
    }
    Ok(())
}

fn release_here(node: &Node, requester: &str, holder: i32, class: Option<&str>) -> usize {
    let mut s = node.hosts.lock();
    let before = s.grants.len();
    s.grants.retain(|g| {
        !(g.requester == requester && g.holder == holder && class.is_none_or(|c| c == g.class))
    });
    let n = before - s.grants.len();
    if n > 0 {
        tracing::info!(event = "released", requester = %requester, holder, class = ?class, n);
    }
    n
}

fn is_sim(node: &Node, host: &str) -> bool {
    host.starts_with("sim")
        && node
            .hosts
            .sim
            .lock()
            .expect("sim lock")
            .iter()
            .any(|(n, _)| n == host)
}

/// Asks `host` to grant itself.
async fn grant_on(node: &Arc<Node>, host: &str, want: &HostGrant, reclaim: bool) -> Result<()> {
    if host == node.name() {
        return grant_here(node, want.clone(), reclaim).map_err(|r| anyhow!(r));
    }
    if is_sim(node, host) {
        let mut sim = node.hosts.sim.lock().expect("sim lock");
        if let Some((_, l)) = sim.iter_mut().find(|(n, _)| n == host) {
            return match policy::decide(l, &[], want, false) {
                Decision::Grant { .. } => {
                    l.grants.push(want.clone());
                    Ok(())
                }
                Decision::Refuse(r) => Err(anyhow!(r)),
            };
        }
    }
    let mut c = node.dial(host).await?;
    write_msg(
        &mut c.stream,
        &Msg::GrantHost {
            grant: want.clone(),
            reclaim,
        },
    )
    .await?;
    match read_msg(&mut c.stream).await? {
        Msg::Done => Ok(()),
        Msg::Refused { reason } => bail!("{reason}"),
        Msg::Error { message } => bail!("{message}"),
        other => bail!("answered {}", kind(&other)),
    }
}

/// Gives `host` back (what `holder` holds there, of `class` or any).
async fn release_on(node: &Arc<Node>, host: &str, holder: i32, class: Option<String>) {
    if host == node.name() {
        release_here(node, node.name(), holder, class.as_deref());
        return;
    }
    if is_sim(node, host) {
        let mut sim = node.hosts.sim.lock().expect("sim lock");
        if let Some((_, l)) = sim.iter_mut().find(|(n, _)| n == host) {
            l.grants
                .retain(|g| !(g.holder == holder && class.as_deref().is_none_or(|c| c == g.class)));
        }
        return;
    }
    let msg = Msg::ReleaseHost { holder, class };
    if let Err(e) = crate::deputies::ask(node, host, msg).await {
        tracing::warn!(event = "release-failed", host = %host, holder, error = %format!("{e:#}"),
            "the host ends the grant itself if this node dies; else it stays until then");
    }
}

/// Requests `count` hosts of `class` for `holder` (a process here) on behalf of `uid`.
/// `exclude_self`: never this node.
pub async fn request(
    node: &Arc<Node>,
    class: &str,
    uid: u32,
    count: usize,
    holder: i32,
    exclude_self: bool,
) -> HostsReport {
    let t0 = Instant::now();
    let mut report = HostsReport {
        class: class.to_string(),
        uid,
        holder,
        ..Default::default()
    };
    let want = HostGrant {
        class: class.to_string(),
        uid,
        requester: node.name().to_string(),
        holder,
        since_unix_ms: now_ms(),
    };
    let cluster = view(node);
    report.considered = cluster.len() as u32;
    let me = node.name().to_string();
    let mut tried: HashSet<String> = HashSet::new();
    for _round in 0..3 {
        let need = count.saturating_sub(report.hosts.len());
        if need == 0 {
            break;
        }
        let t = Instant::now();
        let req = HostRequest {
            class,
            uid,
            count: need,
            exclude: exclude_self.then_some(me.as_str()),
        };
        let picks: Vec<String> = policy::select(
            cluster
                .iter()
                .filter(|(n, _)| !tried.contains(n))
                .map(|(n, l)| (n.as_str(), l)),
            &req,
        )
        .into_iter()
        .map(str::to_string)
        .collect();
        report.select_us += t.elapsed().as_secs_f64() * 1e6;
        if picks.is_empty() {
            break;
        }
        let asks = picks.iter().map(|h| grant_on(node, h, &want, false));
        let answers = futures_join_all(asks).await;
        for (h, a) in picks.into_iter().zip(answers) {
            tried.insert(h.clone());
            match a {
                Ok(()) => report.hosts.push(h),
                Err(e) => report.refused.push((h, format!("{e:#}"))),
            }
        }
    }
    if report.hosts.len() < count {
        // Nothing free: fairness may give one back.
        let refs: Vec<(&str, &NodeLoad)> = cluster
            .iter()
            .filter(|(n, _)| !report.hosts.contains(n))
            .map(|(n, l)| (n.as_str(), l))
            .collect();
        let req = HostRequest {
            class,
            uid,
            count: 1,
            exclude: exclude_self.then_some(me.as_str()),
        };
        if let Some((host, victim)) = policy::reclaim_candidate(&refs, &req) {
            let host = host.to_string();
            match grant_on(node, &host, &want, true).await {
                Ok(()) => {
                    report.reclaimed.push((host.clone(), victim.uid));
                    report.hosts.push(host);
                }
                Err(e) => report.refused.push((host, format!("{e:#}"))),
            }
        }
    }
    {
        let start = crate::state::start_time(holder);
        let mut s = node.hosts.lock();
        for h in &report.hosts {
            s.held.push(Held {
                host: h.clone(),
                class: class.to_string(),
                holder,
                start,
            });
        }
    }
    report.total_ms = t0.elapsed().as_secs_f64() * 1e3;
    tracing::info!(event = "hosts-granted", class, uid, holder, hosts = ?report.hosts,
        reclaimed = ?report.reclaimed, refused = report.refused.len(),
        considered = report.considered, total_ms = report.total_ms);
    report
}

/// Runs futures at once and returns their outputs in order (the daemon has no `futures`).
async fn futures_join_all<F: std::future::Future>(fs: impl Iterator<Item = F>) -> Vec<F::Output> {
    let mut fs: Vec<_> = fs.map(Box::pin).collect();
    let mut out: Vec<Option<F::Output>> = fs.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (f, o) in fs.iter_mut().zip(out.iter_mut()) {
            if o.is_none() {
                match f.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => *o = Some(v),
                    std::task::Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            std::task::Poll::Pending
        } else {
            std::task::Poll::Ready(())
        }
    })
    .await;
    out.into_iter()
        .map(|o| o.expect("polled to the end"))
        .collect()
}

/// Gives back what `holder` holds (of `class`, on `hosts`, when given).
pub async fn release(
    node: &Arc<Node>,
    holder: i32,
    class: Option<&str>,
    hosts: &[String],
) -> usize {
    let gone: Vec<Held> = {
        let mut s = node.hosts.lock();
        let (gone, keep): (Vec<_>, Vec<_>) =
            std::mem::take(&mut s.held).into_iter().partition(|h| {
                h.holder == holder
                    && class.is_none_or(|c| c == h.class)
                    && (hosts.is_empty() || hosts.contains(&h.host))
            });
        s.held = keep;
        gone
    };
    for h in &gone {
        release_on(node, &h.host, holder, Some(h.class.clone())).await;
    }
    gone.len()
}

/// A host held for one `ferry run --auto`, given back when dropped.
pub struct RunGrant {
    node: Arc<Node>,
    host: String,
    holder: i32,
}

impl Drop for RunGrant {
    fn drop(&mut self) {
        let (node, host, holder) = (self.node.clone(), self.host.clone(), self.holder);
        tokio::spawn(async move {
            release(&node, holder, Some(RUN_CLASS), std::slice::from_ref(&host)).await;
        });
    }
}

/// The class of `ferry run --auto`'s programs.
pub const RUN_CLASS: &str = "run";

/// Where `ferry run --auto` runs: the longest-idle host free of another `run`, held until the
/// program ends; with none free, here (as Sprite did), unless `elsewhere`.
pub async fn pick_for_run(
    node: &Arc<Node>,
    uid: u32,
    holder: i32,
    elsewhere: bool,
) -> Result<(String, Option<RunGrant>)> {
    let r = request(node, RUN_CLASS, uid, 1, holder, elsewhere).await;
    if let Some(host) = r.hosts.into_iter().next() {
        let g = RunGrant {
            node: node.clone(),
            host: host.clone(),
            holder,
        };
        return Ok((host, Some(g)));
    }
    if !elsewhere {
        return Ok((node.name().to_string(), None));
    }
    let why: Vec<String> = r.refused.iter().map(|(h, w)| format!("{h}: {w}")).collect();
    bail!(
        "no node but this one accepts guests and is free for `ferry run --auto` now (of {} \
         considered){}",
        r.considered,
        if why.is_empty() {
            String::new()
        } else {
            format!("; refused: {}", why.join("; "))
        }
    )
}

// ---- Doors ------------------------------------------------------------------------------

/// A peer's `GrantHost` or `ReleaseHost`; `from` is the certified peer.
pub fn serve_peer(node: &Arc<Node>, from: &str, msg: Msg) -> Msg {
    match msg {
        Msg::GrantHost { mut grant, reclaim } => {
            // A node asks only for its own processes.
            grant.requester = from.to_string();
            match grant_here(node, grant, reclaim) {
                Ok(()) => Msg::Done,
                Err(reason) => Msg::Refused { reason },
            }
        }
        Msg::ReleaseHost { holder, class } => {
            release_here(node, from, holder, class.as_deref());
            Msg::Done
        }
        other => Msg::error(format!("unexpected {}", kind(&other))),
    }
}

/// The CLI's `SetAccepting`, `SetAcceptPolicy`, `HostsGet`, `HostsRelease`.
pub async fn serve_cli(node: &Arc<Node>, msg: Msg) -> Msg {
    match msg {
        Msg::SetAccepting { accepting } => {
            let p = if accepting {
                AcceptPolicy::Always
            } else {
                AcceptPolicy::Never
            };
            node.hosts.set_policy(node, p);
            Msg::Done
        }
        Msg::SetAcceptPolicy { policy } => match policy.parse::<AcceptPolicy>() {
            Ok(p) => {
                node.hosts.set_policy(node, p);
                Msg::Done
            }
            Err(e) => Msg::error(e),
        },
        Msg::HostsGet {
            count,
            class,
            uid,
            holder,
        } => {
            if class.is_empty() || class.len() > 64 {
                return Msg::error("a class is a name of 1 to 64 bytes");
            }
            if crate::state::start_time(holder).is_none() {
                return Msg::error(format!("no process {holder} here to hold the hosts"));
            }
            Msg::HostsGranted(request(node, &class, uid, count as usize, holder, true).await)
        }
        Msg::HostsRelease {
            holder,
            class,
            hosts,
        } => {
            let n = release(node, holder, class.as_deref(), &hosts).await;
            if n == 0 {
                Msg::error(format!("PID {holder} holds no such host"))
            } else {
                Msg::Done
            }
        }
        other => Msg::error(format!("unexpected {}", kind(&other))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(owner: &str) -> anyhow::Result<crate::Config> {
        crate::Config::parse(&format!(
            "name = \"a\"\nlisten = \"127.0.0.1:7070\"\ndata_dir = \"/tmp/x\"\n\
             [credentials]\nca_cert = \"c\"\ncert = \"d\"\nkey = \"e\"\n{owner}"
        ))
    }

    #[test]
    fn the_owner_table() {
        let c = config("").unwrap();
        assert!(c.owner.is_default());
        assert_eq!(policy_of(&c), AcceptPolicy::Always);
        assert_eq!(c.owner.thresholds(), IdleThresholds::default());
        assert!(c.owner.watch().contains(&PathBuf::from("/dev/input")));
        assert!(c.owner.watch().contains(&PathBuf::from("/dev/pts")));
        let c = config(
            "[owner]\naccept = \"idle\"\nload_below = 2.5\ninput_idle_secs = 5\n\
             input_watch = [\"/dev/pts/3\"]\n",
        )
        .unwrap();
        assert_eq!(policy_of(&c), AcceptPolicy::Idle);
        assert_eq!(c.owner.thresholds().load_below, 2.5);
        assert_eq!(c.owner.thresholds().input_idle_secs, 5);
        assert_eq!(c.owner.watch(), [PathBuf::from("/dev/pts/3")]);
        // It survives the round trip `ferry cluster up` makes.
        let again = crate::Config::parse(&c.to_toml().unwrap()).unwrap();
        assert_eq!(again.owner, c.owner);
        assert!(config("[owner]\naccept = \"sometimes\"\n").is_err());
        assert!(
            config("[owner]\nidle_secs = 5\n").is_err(),
            "unknown keys are refused"
        );
        let never = crate::Config::parse(
            "name = \"a\"\nlisten = \"127.0.0.1:7070\"\ndata_dir = \"/tmp/x\"\n\
             accept_guests = false\n[credentials]\nca_cert = \"c\"\ncert = \"d\"\nkey = \"e\"\n",
        )
        .unwrap();
        assert_eq!(policy_of(&never), AcceptPolicy::Never);
    }

    #[test]
    fn simulated_nodes_rank_below_real_ones() {
        let sim = simulated_nodes(1000);
        assert_eq!(sim.len(), 1000);
        assert!(sim
            .iter()
            .all(|(_, l)| l.console_idle_secs.is_some_and(|s| s < 3600)));
        assert!(sim.iter().any(|(_, l)| !l.grants.is_empty()));
    }
}
