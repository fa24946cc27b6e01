//! `ferry make [-j N] [--nodes A,B,..] [--elsewhere] [--shell PATH] [MAKE ARGUMENTS]`: GNU make
//! with its recipes run across the cluster (Sprite's pmake).
//!
//! Make itself runs here, with its own semantics untouched: its dependency graph, its
//! jobserver (`-j N` recipes at once, across the cluster; recursive makes share it), its exit
//! status, `-k`, `-n`, and so on. Only its shell changes: `SHELL=DIR/ferry-make-shell`, a link
//! to this binary (`make_shell.rs`), which sends each recipe to a node through remote
//! execution and collects its output. What the recipes write is seen by make because every
//! node sees the build's files (on a local cluster the nodes share this machine's file system
//! outside /tmp, /run and /dev/shm; real machines need a shared file system: NFS and the like).
//!
//! This process is the build's **pool** of hosts (Sprite's pmake holding idle hosts): a UNIX
//! socket in DIR on which each recipe's shell asks for a node (`get [TRIED..]` -> `node NAME`
//! or `local`): the usable node running the fewest of the build's recipes, the idlest first
//! among equals. A watcher asks the daemon for the membership every [`WATCH`]: a node that dies
//! or stops taking guests (its owner came back, `ferry evict`, `ferry drain`, `ferry accept
//! no`) is told to the shells running recipes there (`leave`): they kill the recipe there and
//! run it again on another node (or here). A node a shell could not reach or lost is set aside
//! for [`SET_ASIDE`].

use super::client;
use super::make_shell::{DEFAULT_SHELL, ENV_POOL, ENV_SHELL, SHIM_NAME};
use anyhow::{bail, Context, Result};
use ferry_transport::frame::blocking::{read_frame, write_msg};
use ferry_transport::message::NodeInfo;
use ferry_transport::{Frame, Msg};
use std::collections::HashMap;
use std::ffi::OsString;
use std::io::{BufRead, BufReader, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How often the pool looks at the membership.
const WATCH: Duration = Duration::from_millis(500);
/// How long a node a recipe was lost on is left out.
const SET_ASIDE: Duration = Duration::from_secs(10);

const USAGE: &str = "usage: ferry make [-j N] [--nodes A,B,..] [--elsewhere] [--shell PATH] \
                     [MAKE ARGUMENTS...]";

/// What `ferry make` takes for itself; everything else goes to make.
#[derive(Debug, Default, PartialEq)]
pub struct Options {
    pub jobs: Option<u32>,
    pub nodes: Option<Vec<String>>,
    pub elsewhere: bool,
    pub shell: Option<OsString>,
    pub make_args: Vec<OsString>,
}

/// Parses `ferry make`'s arguments: its own options anywhere before a `--` (after which all is
/// make's), make's `-j N`/`-jN`/`--jobs=N` noted and passed on.
pub fn parse(args: Vec<OsString>) -> Result<Options> {
    let mut o = Options::default();
    let mut it = args.into_iter();
    let jobs = |v: &str| -> Result<u32> {
        match v.parse::<u32>() {
            Ok(n) if n > 0 => Ok(n),
            _ => bail!("-j wants a number of jobs above 0, not {v:?}\n{USAGE}"),
        }
    };
    while let Some(a) = it.next() {
        let s = a.to_string_lossy().into_owned();
        let mut value = |name: &str| -> Result<String> {
            it.next()
                .map(|v| v.to_string_lossy().into_owned())
                .with_context(|| format!("{name} wants a value\n{USAGE}"))
        };
        match s.as_str() {
            "--" => {
                o.make_args.extend(it.by_ref());
                break;
            }
            "-j" | "--jobs" => o.jobs = Some(jobs(&value(&s)?)?),
            "--nodes" => o.nodes = Some(split_nodes(&value(&s)?)),
            "--elsewhere" => o.elsewhere = true,
            "--shell" => o.shell = Some(value(&s)?.into()),
            "--help" | "-h" => bail!("{USAGE}"),
            _ => {
                if let Some(v) = s.strip_prefix("--jobs=") {
                    o.jobs = Some(jobs(v)?);
                } else if let Some(v) = s.strip_prefix("--nodes=") {
                    o.nodes = Some(split_nodes(v));
                } else if let Some(v) = s.strip_prefix("--shell=") {
                    o.shell = Some(v.into());
                } else if let Some(v) = s.strip_prefix("-j").filter(|v| !v.is_empty()) {
                    o.jobs = Some(jobs(v)?);
                } else {
                    o.make_args.push(a);
                }
            }
        }
    }
    Ok(o)
}

fn split_nodes(v: &str) -> Vec<String> {
    v.split(',')
        .map(str::trim)
        .filter(|n| !n.is_empty())
        .map(str::to_string)
        .collect()
}

/// Runs make and ends this process with its status: never returns.
pub fn run(args: Vec<OsString>, node: Option<&str>) -> Result<()> {
    let o = parse(args)?;
    let code = build(o, node)?;
    std::process::exit(code)
}

/// One question to this node's daemon, without an async runtime.
pub fn ask_blocking(node: Option<&str>, m: &Msg) -> Result<Msg> {
    let path = client::daemon_socket(node)?;
    let mut s = UnixStream::connect(&path).with_context(|| {
        format!(
            "reach the ferry daemon at {} (is it running?)",
            path.display()
        )
    })?;
    write_msg(&mut s, m)?;
    match read_frame(&mut s).context("read the daemon's answer")? {
        Frame::Msg(Msg::Error { message }) => bail!("{message}"),
        Frame::Msg(m) => Ok(m),
        _ => bail!("the daemon answered with stream data"),
    }
}

fn members(node: Option<&str>) -> Result<Vec<NodeInfo>> {
    match ask_blocking(node, &Msg::ListNodes)? {
        Msg::Nodes(n) => Ok(n),
        other => bail!(
            "unexpected answer {}",
            ferry_transport::message::kind(&other)
        ),
    }
}

/// A node the build may use now: alive, taking guests, its load known.
fn usable(n: &NodeInfo) -> bool {
    (n.state == "self" || n.state == "alive")
        && n.load
            .as_ref()
            .is_some_and(|l| l.accepting && !l.stale && !l.owner.draining && !l.owner_present())
}

#[derive(Debug)]
struct Slot {
    name: String,
    usable: bool,
    /// Recipes of this build running there.
    running: u32,
    /// Rank by idleness at the last look (lower: idler).
    rank: usize,
    set_aside_until: Option<Instant>,
}

#[derive(Default)]
struct PoolState {
    slots: Vec<Slot>,
    /// Each shell's connection and the node it holds.
    holders: HashMap<u64, (UnixStream, Option<String>)>,
    next_id: u64,
    /// Recipes run, and run again elsewhere, for the summary.
    assigned: u64,
    requeued: u64,
}

impl PoolState {
    fn pick(&mut self, tried: &[String]) -> Option<String> {
        let now = Instant::now();
        let best = self
            .slots
            .iter_mut()
            .filter(|s| s.usable && !tried.contains(&s.name))
            .filter(|s| s.set_aside_until.is_none_or(|t| t <= now))
            .min_by_key(|s| (s.running, s.rank))?;
        best.running += 1;
        self.assigned += 1;
        Some(best.name.clone())
    }

    fn release(&mut self, node: &str) {
        if let Some(s) = self.slots.iter_mut().find(|s| s.name == node) {
            s.running = s.running.saturating_sub(1);
        }
    }
}

fn build(o: Options, node: Option<&str>) -> Result<i32> {
    let all = members(node)?;
    let here = all
        .iter()
        .find(|n| n.state == "self")
        .map(|n| n.name.clone())
        .unwrap_or_default();
    let wanted = |n: &NodeInfo| match &o.nodes {
        Some(list) => list.contains(&n.name),
        None => !(o.elsewhere && n.name == here),
    };
    if let Some(list) = &o.nodes {
        if let Some(unknown) = list.iter().find(|w| !all.iter().any(|n| &n.name == *w)) {
            bail!(
                "no node {unknown:?} in the cluster (nodes: {})",
                all.iter()
                    .map(|n| n.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
    }
    // Without --nodes, the hosts come from the cluster's host selection (longest idle first,
    // one build per host at a time, fair between users): granted to this process, returned
    // when it ends. If none can be granted (or the daemon does not grant hosts), the build
    // uses every node that takes guests now.
    let granted = match &o.nodes {
        Some(_) => None,
        None => grant_hosts(node, &all, &here),
    };
    let wanted = |n: &NodeInfo| match &granted {
        Some(hosts) => hosts.contains(&n.name) || (n.name == here && !o.elsewhere),
        None => wanted(n),
    };
    let mut slots: Vec<Slot> = all
        .iter()
        .filter(|n| wanted(n))
        .map(|n| Slot {
            name: n.name.clone(),
            usable: usable(n),
            running: 0,
            rank: 0,
            set_aside_until: None,
        })
        .collect();
    rank(&mut slots, &all);
    let usable_now = slots.iter().filter(|s| s.usable).count();
    if usable_now == 0 {
        eprintln!("ferry make: no node takes guests now; recipes run here");
    }
    let jobs = o.jobs.unwrap_or(usable_now.max(1) as u32);

    // A private directory for the shell's link and the pool's socket.
    let dir = std::env::temp_dir().join(format!("ferry-make.{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&dir)
            .with_context(|| format!("create {}", dir.display()))?;
    }
    let _cleanup = RemoveDir(dir.clone());
    let exe = std::env::current_exe().context("find the ferry binary")?;
    let shim = dir.join(SHIM_NAME);
    std::os::unix::fs::symlink(&exe, &shim)
        .with_context(|| format!("link {} to {}", shim.display(), exe.display()))?;
    let sock = dir.join("pool.sock");
    let listener = UnixListener::bind(&sock).with_context(|| format!("bind {}", sock.display()))?;

    let state = Arc::new(Mutex::new(PoolState {
        slots,
        ..Default::default()
    }));
    {
        let state = state.clone();
        std::thread::spawn(move || serve_pool(listener, state));
    }
    {
        let state = state.clone();
        let node = node.map(str::to_string);
        let wanted_names: Vec<String> = all
            .iter()
            .filter(|n| wanted(n))
            .map(|n| n.name.clone())
            .collect();
        std::thread::spawn(move || watch(state, node.as_deref(), &wanted_names));
    }

    // SIGTERM and SIGHUP for us go on to make; SIGINT and SIGQUIT come from the terminal to
    // make too, so we let make decide and wait for it. Blocked here (make starts with a clean
    // mask: std resets it in the child), read on a signalfd.
    let mut mask = 0u64;
    for s in [libc::SIGINT, libc::SIGQUIT, libc::SIGTERM, libc::SIGHUP] {
        ferry_sys::ns::block_signal(s).with_context(|| format!("block signal {s}"))?;
        mask |= 1 << (s - 1);
    }
    let sigfd = ferry_sys::anon_fds::signalfd(mask, libc::SFD_CLOEXEC | libc::SFD_NONBLOCK)
        .map_err(|e| anyhow::anyhow!("make a signalfd: {e}"))?;

    let make = std::env::var_os("FERRY_MAKE_PROGRAM").unwrap_or_else(|| "make".into());
    let mut cmd = std::process::Command::new(&make);
    cmd.arg(format!("-j{jobs}"))
        .arg(format!("SHELL={}", shim.display()))
        .args(&o.make_args)
        .env(ENV_POOL, &sock)
        .env(
            ENV_SHELL,
            o.shell.as_deref().unwrap_or(DEFAULT_SHELL.as_ref()),
        );
    if let Some(n) = node {
        cmd.env("FERRY_NODE", n);
    }
    let started = Instant::now();
    let mut child = cmd
        .spawn()
        .with_context(|| format!("start {}", Path::new(&make).display()))?;
    let pid = child.id() as i32;
    let status = loop {
        if let Some(st) = child.try_wait().context("wait for make")? {
            break st;
        }
        if let Ok(r) = ferry_sys::ns::poll_in(&[sigfd.as_raw_fd()], 50) {
            if r[0] {
                let mut rec = [0u8; 128];
                while let Ok(128) = ferry_sys::fdops::read_fd(sigfd.as_raw_fd(), &mut rec) {
                    let sig = u32::from_ne_bytes(rec[..4].try_into().expect("4 bytes")) as i32;
                    if sig == libc::SIGTERM || sig == libc::SIGHUP {
                        let _ = ferry_sys::ptrace::kill(pid, sig);
                    }
                }
            }
        }
    };
    {
        let st = state.lock().unwrap_or_else(|p| p.into_inner());
        log::info!(
            "ferry make: {} recipes dispatched ({} run again elsewhere) in {:.1} s",
            st.assigned,
            st.requeued,
            started.elapsed().as_secs_f64()
        );
    }
    if granted.is_some() {
        let _ = ask_blocking(
            node,
            &Msg::HostsRelease {
                holder: std::process::id() as i32,
                class: Some(HOST_CLASS.to_string()),
                hosts: Vec::new(),
            },
        );
    }
    use std::os::unix::process::ExitStatusExt;
    Ok(match (status.code(), status.signal()) {
        (Some(c), _) => c,
        (None, Some(s)) => {
            drop(_cleanup);
            ferry_sys::spawn::die_by_signal(s)
        }
        _ => 2,
    })
}

/// The class `ferry make` asks hosts for: a host runs one build at a time.
const HOST_CLASS: &str = "make";

/// Asks this node's daemon for every other usable node, for this build; the hosts granted, or
/// None if none was (the caller then takes every usable node).
fn grant_hosts(node: Option<&str>, all: &[NodeInfo], here: &str) -> Option<Vec<String>> {
    let count = all.iter().filter(|n| n.name != here && usable(n)).count();
    if count == 0 {
        return None;
    }
    let uid = ferry_sys::spawn::ids().ok()?.0;
    let answer = ask_blocking(
        node,
        &Msg::HostsGet {
            count: count as u32,
            class: HOST_CLASS.to_string(),
            uid,
            holder: std::process::id() as i32,
        },
    );
    match answer {
        Ok(Msg::HostsGranted(r)) if !r.hosts.is_empty() => {
            log::info!(
                "ferry make: granted hosts {} (of {} considered, {:.1} ms)",
                r.hosts.join(", "),
                r.considered,
                r.total_ms
            );
            Some(r.hosts)
        }
        Ok(_) => None,
        Err(e) => {
            log::info!("ferry make: no hosts granted ({e:#}); using every node that takes guests");
            None
        }
    }
}

/// Ranks the slots by how idle their node is (`NodeLoad::busyness`).
fn rank(slots: &mut [Slot], all: &[NodeInfo]) {
    let mut order: Vec<(f64, &str)> = all
        .iter()
        .map(|n| {
            (
                n.load.as_ref().map_or(f64::MAX, |l| l.busyness()),
                n.name.as_str(),
            )
        })
        .collect();
    order.sort_by(|a, b| a.0.total_cmp(&b.0));
    for s in slots.iter_mut() {
        s.rank = order
            .iter()
            .position(|(_, n)| *n == s.name)
            .unwrap_or(usize::MAX);
    }
}

/// Serves the shells: a thread per shell.
fn serve_pool(listener: UnixListener, state: Arc<Mutex<PoolState>>) {
    for conn in listener.incoming() {
        let Ok(conn) = conn else { continue };
        let state = state.clone();
        std::thread::spawn(move || serve_shell(conn, state));
    }
}

fn serve_shell(conn: UnixStream, state: Arc<Mutex<PoolState>>) {
    let lock = || state.lock().unwrap_or_else(|p| p.into_inner());
    let id = {
        let mut st = lock();
        st.next_id += 1;
        let id = st.next_id;
        match conn.try_clone() {
            Ok(c) => {
                st.holders.insert(id, (c, None));
            }
            Err(_) => return,
        }
        id
    };
    let mut reader = BufReader::new(match conn.try_clone() {
        Ok(c) => c,
        Err(_) => return,
    });
    let mut line = String::new();
    loop {
        line.clear();
        match reader.read_line(&mut line) {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
        let mut words = line.split_whitespace();
        match words.next() {
            Some("get") => {
                let tried: Vec<String> = words.map(str::to_string).collect();
                let mut st = lock();
                if let Some(prev) = st.holders.get_mut(&id).and_then(|h| h.1.take()) {
                    st.release(&prev);
                }
                let pick = st.pick(&tried);
                if !tried.is_empty() {
                    st.requeued += 1;
                }
                let reply = match &pick {
                    Some(n) => format!("node {n}\n"),
                    None => "local\n".to_string(),
                };
                if let Some(h) = st.holders.get_mut(&id) {
                    h.1 = pick;
                    let _ = h.0.write_all(reply.as_bytes());
                }
            }
            Some("lost") => {
                let Some(n) = words.next() else { continue };
                let mut st = lock();
                if let Some(s) = st.slots.iter_mut().find(|s| s.name == n) {
                    s.set_aside_until = Some(Instant::now() + SET_ASIDE);
                }
                log::info!("ferry make: node {n} lost a recipe; set aside for {SET_ASIDE:?}");
            }
            _ => {}
        }
    }
    let mut st = lock();
    if let Some((_, Some(n))) = st.holders.remove(&id) {
        st.release(&n);
    }
}

/// Looks at the membership every [`WATCH`]; shells on a node that is no longer usable are told
/// to leave it.
fn watch(state: Arc<Mutex<PoolState>>, node: Option<&str>, wanted: &[String]) {
    loop {
        std::thread::sleep(WATCH);
        let Ok(all) = members(node) else { continue };
        let mut st = state.lock().unwrap_or_else(|p| p.into_inner());
        let mut leaving = Vec::new();
        for s in st.slots.iter_mut() {
            let now = all.iter().find(|n| n.name == s.name).is_some_and(usable);
            if s.usable && !now {
                log::info!("ferry make: node {} no longer takes guests", s.name);
                leaving.push(s.name.clone());
            }
            s.usable = now;
        }
        // Nodes that joined since the build started are not taken on (the set was chosen).
        let _ = wanted;
        rank(&mut st.slots, &all);
        for (conn, held) in st.holders.values_mut() {
            if held.as_ref().is_some_and(|h| leaving.contains(h)) {
                let _ = conn.write_all(b"leave\n");
            }
        }
    }
}

struct RemoveDir(PathBuf);

impl Drop for RemoveDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(a: &[&str]) -> Options {
        parse(a.iter().map(OsString::from).collect()).unwrap()
    }

    #[test]
    fn takes_its_own_options_and_passes_the_rest() {
        let o = p(&["-j", "4", "-k", "--nodes", "b,c", "all", "CFLAGS=-O2"]);
        assert_eq!(o.jobs, Some(4));
        assert_eq!(o.nodes, Some(vec!["b".to_string(), "c".to_string()]));
        assert_eq!(o.make_args, ["-k", "all", "CFLAGS=-O2"].map(OsString::from));
        assert_eq!(p(&["-j8"]).jobs, Some(8));
        assert_eq!(p(&["--jobs=3", "--elsewhere"]).jobs, Some(3));
        assert!(p(&["--elsewhere"]).elsewhere);
        let o = p(&["--", "-j", "2", "--nodes"]);
        assert_eq!(o.jobs, None);
        assert_eq!(o.make_args, ["-j", "2", "--nodes"].map(OsString::from));
        assert!(parse(vec!["-j".into(), "0".into()]).is_err());
        assert!(parse(vec!["-j".into()]).is_err());
    }
}
