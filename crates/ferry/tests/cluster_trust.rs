//! A node speaks only for itself (docs/security.md, "Nodes: who may say what"), on real local
//! clusters: real daemons on loopback, and a hostile node built here from the same pieces a
//! daemon is made of (ferry-transport's mutual TLS with a certificate of the cluster's own CA,
//! and foca speaking the daemons' gossip), which lies about its name, forges another node's
//! load, or answers at another node's address. Also: a revoked certificate, a flood of idle
//! connections, and a daemon restarted with `kill`.
//!
//! These clusters share one network stack (`--isolation shared`): the hostile node, here, must
//! reach every node and be reached at its own loopback address, and a killed daemon is
//! restarted from here.

mod common;

use common::cluster::{Cluster, Isolation, FERRY};
use ferry_daemon::membership::NodeId;
use ferry_transport::{read_msg, tls, write_msg, Credentials, Msg};
use foca::{BroadcastHandler, Foca, Invalidates, PostcardCodec};
use serde::Serialize;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::process::{Command, Output};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

fn out_text(o: &Output) -> String {
    format!(
        "status {:?}\nstdout: {}\nstderr: {}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// The credentials of a new node `name`, issued by the cluster's own CA (`ferry cluster
/// issue`): a certificate as valid as any member's. Its connections come from `ip`.
fn issue(c: &Cluster, name: &str, ip: &str) -> Credentials {
    let certs = c.dir.join("certs");
    let out = Command::new(FERRY)
        .args(["cluster", "issue", name, "--dir"])
        .arg(&certs)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", out_text(&out));
    let mut creds = Credentials::load(&ferry_transport::CredentialPaths {
        ca_cert: certs.join("ca.pem"),
        cert: certs.join(format!("{name}.pem")),
        key: certs.join(format!("{name}.key")),
    })
    .unwrap();
    creds.local_ip = Some(ip.parse().unwrap());
    creds
}

fn addr(c: &Cluster, node: &str) -> SocketAddr {
    let i = node.as_bytes()[0] - b'a';
    format!("127.0.0.{}:{}", 11 + i, c.port).parse().unwrap()
}

/// What a node's load record looks like on the wire (`membership.rs`: `LoadItem`).
#[derive(Serialize)]
struct ForgedKey {
    node: String,
    incarnation: u64,
    seq: u64,
}
#[derive(Serialize)]
struct ForgedItem {
    key: ForgedKey,
    load: ferry_policy::NodeLoad,
}

/// Custom broadcasts as the liar handles them: it relays nothing, and its own items (the
/// forged records) are each new.
struct Items;
#[derive(Clone, PartialEq)]
struct ItemKey(u64);
impl Invalidates for ItemKey {
    fn invalidates(&self, other: &Self) -> bool {
        self.0 > other.0
    }
}
#[derive(Debug)]
struct Never;
impl std::fmt::Display for Never {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("never")
    }
}
impl std::error::Error for Never {}
static ITEM: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
impl BroadcastHandler<NodeId> for Items {
    type Key = ItemKey;
    type Error = Never;
    fn receive_item(
        &mut self,
        _data: &[u8],
        sender: Option<&NodeId>,
    ) -> Result<Option<ItemKey>, Never> {
        Ok(sender
            .is_none()
            .then(|| ItemKey(ITEM.fetch_add(1, std::sync::atomic::Ordering::Relaxed))))
    }
}

/// A hostile node: a certificate of the cluster, a foca instance gossiping under identity `id`
/// (whatever name it likes), and a listener at `id.addr` that records the first message of
/// every connection that is not gossip (a `Run`, a `MigrateOffer`). It can also gossip a
/// custom broadcast of its making (`forge`), and updates claiming that other members have the
/// identities `lies` (alive, with an incarnation that keeps growing so they keep spreading).
struct Liar {
    rt: tokio::runtime::Runtime,
    got: Arc<Mutex<Vec<String>>>,
}

impl Liar {
    fn start(
        creds: Credentials,
        id: NodeId,
        join: SocketAddr,
        forge: Option<Vec<u8>>,
        lies: Vec<NodeId>,
    ) -> Liar {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let got: Arc<Mutex<Vec<String>>> = Arc::default();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Vec<u8>>();
        let listener = rt.block_on(tokio::net::TcpListener::bind(id.addr)).unwrap();
        {
            let (creds, got, tx) = (creds.clone(), got.clone(), tx.clone());
            rt.spawn(async move {
                loop {
                    let Ok((tcp, _)) = listener.accept().await else {
                        continue;
                    };
                    let (creds, got, tx) = (creds.clone(), got.clone(), tx.clone());
                    tokio::spawn(async move {
                        let Ok(mut conn) = tls::accept(&creds, tcp).await else {
                            return;
                        };
                        loop {
                            match read_msg(&mut conn.stream).await {
                                Ok(Msg::Gossip { packet }) => {
                                    let _ = tx.send(packet.into_vec());
                                }
                                Ok(other) => {
                                    got.lock()
                                        .unwrap()
                                        .push(ferry_transport::message::kind(&other));
                                    let _ = write_msg(
                                        &mut conn.stream,
                                        &Msg::Refused {
                                            reason: "a liar".into(),
                                        },
                                    )
                                    .await;
                                    return;
                                }
                                Err(_) => return,
                            }
                        }
                    });
                }
            });
        }
        rt.spawn(async move {
            let mut config = foca::Config::new_lan(std::num::NonZeroU32::new(16).unwrap());
            config.probe_period = Duration::from_millis(500);
            config.probe_rtt = Duration::from_millis(250);
            let rng: rand::rngs::StdRng = rand::make_rng();
            let mut foca = Foca::with_custom_broadcast(id, config, rng, PostcardCodec, Items);
            let mut runtime = foca::AccumulatingRuntime::new();
            let mut links: HashMap<SocketAddr, ferry_transport::Conn> = HashMap::new();
            let (timer_tx, mut timers) = tokio::sync::mpsc::unbounded_channel();
            let _ = foca.announce(
                NodeId {
                    name: String::new(),
                    addr: join,
                    bump: 0,
                },
                &mut runtime,
            );
            let mut tick = tokio::time::interval(Duration::from_millis(200));
            let mut lie_incarnation: u16 = 0;
            loop {
                tokio::select! {
                    Some(p) = rx.recv() => { let _ = foca.handle_data(&p, &mut runtime); }
                    Some(t) = timers.recv() => { let _ = foca.handle_timer(t, &mut runtime); }
                    _ = tick.tick() => {
                        if let Some(f) = &forge {
                            let _ = foca.add_broadcast(f);
                        }
                        lie_incarnation = lie_incarnation.wrapping_add(1);
                        let _ = foca.apply_many(
                            lies.iter().map(|l| {
                                foca::Member::new(l.clone(), lie_incarnation, foca::State::Alive)
                            }),
                            true,
                            &mut runtime,
                        );
                        let _ = foca.gossip(&mut runtime);
                    }
                }
                while let Some((after, t)) = runtime.to_schedule() {
                    let tx = timer_tx.clone();
                    tokio::spawn(async move {
                        tokio::time::sleep(after).await;
                        let _ = tx.send(t);
                    });
                }
                while runtime.to_notify().is_some() {}
                while let Some((to, data)) = runtime.to_send() {
                    #[allow(clippy::map_entry)] // the insert follows an await
                    if !links.contains_key(&to.addr) {
                        match tls::connect(&creds, None, to.addr, Duration::from_secs(1)).await {
                            Ok(c) => {
                                links.insert(to.addr, c);
                            }
                            Err(_) => continue,
                        }
                    }
                    let c = links.get_mut(&to.addr).unwrap();
                    let msg = Msg::Gossip {
                        packet: serde_bytes::ByteBuf::from(data.to_vec()),
                    };
                    if write_msg(&mut c.stream, &msg).await.is_err() {
                        links.remove(&to.addr);
                    }
                }
            }
        });
        Liar { rt, got }
    }

    fn got(&self) -> Vec<String> {
        self.got.lock().unwrap().clone()
    }
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// Starts `sleep 600` in a session of its own, for migrations to be attempted on.
fn sleeper() -> std::process::Child {
    use std::os::unix::process::CommandExt;
    Command::new("sleep")
        .arg("600")
        .process_group(0)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap()
}

fn nodes_json(c: &Cluster, on: &str) -> Vec<serde_json::Value> {
    let o = c.run(on, &["nodes", "--json"]);
    serde_json::from_slice(&o.stdout).unwrap_or_default()
}

/// What node `on` believes of node `of`'s load, if it knows it.
fn load_seen(c: &Cluster, on: &str, of: &str) -> Option<serde_json::Value> {
    nodes_json(c, on)
        .into_iter()
        .find(|n| n["name"] == of)
        .and_then(|n| (!n["load"].is_null()).then(|| n["load"].clone()))
}

fn wait_for(what: &str, deadline: Duration, mut f: impl FnMut() -> bool) {
    let end = Instant::now() + deadline;
    while !f() {
        assert!(Instant::now() < end, "{what}: not within {deadline:?}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// A node with a valid certificate for `z` that gossips under the name `b` is not believed:
/// `ferry run --on b` and `ferry migrate --to b` never reach it. A node whose `Hello` claims a
/// name its certificate does not carry is refused before it says anything else.
#[test]
fn a_node_cannot_take_another_name() {
    let c = Cluster::up_isolated("trust-name", 1, Isolation::Shared);
    let creds = issue(&c, "z", "127.0.0.61");
    let liar_addr: SocketAddr = format!("127.0.0.61:{}", c.port).parse().unwrap();
    let liar = Liar::start(
        creds.clone(),
        NodeId {
            name: "b".into(),
            addr: liar_addr,
            bump: now_ms(),
        },
        addr(&c, "a"),
        None,
        vec![],
    );
    // Time for a to hear it (several probe periods, announcements and feeds).
    std::thread::sleep(Duration::from_secs(4));
    let run = c.run("a", &["run", "--on", "b", "--", "true"]);
    let mut victim = sleeper();
    let pid = victim.id().to_string();
    let mig = c.run("a", &["migrate", &pid, "--to", "b"]);
    assert!(
        Command::new("kill")
            .args(["-0", &pid])
            .status()
            .unwrap()
            .success(),
        "the process attempted to move died"
    );
    let _ = victim.kill();
    let _ = victim.wait();
    assert!(
        liar.got().is_empty(),
        "the impostor received {:?}; run: {}; migrate: {}",
        liar.got(),
        out_text(&run),
        out_text(&mig)
    );
    assert!(!run.status.success(), "{}", out_text(&run));
    assert!(!mig.status.success(), "{}", out_text(&mig));
    assert!(
        c.log("a").contains("claims to come from \"b\""),
        "a did not log the lie: {}",
        c.log("a")
    );
    let listed: Vec<String> = nodes_json(&c, "a")
        .iter()
        .map(|n| n["name"].as_str().unwrap_or("").to_string())
        .collect();
    assert_eq!(listed, ["a"], "a lists a node that lied about its name");

    // The same certificate with a `Hello` that names b: refused at the door.
    let mut lying = creds.clone();
    lying.node = "b".into();
    let refused = liar.rt.block_on(async {
        let mut conn = tls::connect(&lying, Some("a"), addr(&c, "a"), Duration::from_secs(5))
            .await
            .expect("the TLS handshake itself is valid");
        let _ = write_msg(&mut conn.stream, &Msg::LocalProcesses).await;
        read_msg(&mut conn.stream).await
    });
    assert!(refused.is_err(), "a answered a lying Hello: {refused:?}");
    wait_for("a logs the lying Hello", Duration::from_secs(10), || {
        c.log("a")
            .contains("peer says it is \"b\" but its certificate names \"z\"")
    });
}

/// A node cannot rewrite who another node is: its gossip claiming that b has a later start
/// (which would supersede b's real identity), or that b's address belongs to another name, is
/// not believed, and b stays reachable.
#[test]
fn a_node_cannot_rewrite_another_nodes_identity() {
    let c = Cluster::up_isolated("trust-ident", 2, Isolation::Shared);
    let creds = issue(&c, "z", "127.0.0.64");
    let b_addr = addr(&c, "b");
    let _liar = Liar::start(
        creds,
        NodeId {
            name: "z".into(),
            addr: format!("127.0.0.64:{}", c.port).parse().unwrap(),
            bump: now_ms(),
        },
        addr(&c, "a"),
        None,
        vec![
            NodeId {
                name: "b".into(),
                addr: b_addr,
                bump: u64::MAX,
            },
            NodeId {
                name: "y".into(),
                addr: b_addr,
                bump: u64::MAX,
            },
        ],
    );
    wait_for("a sees z", Duration::from_secs(20), || {
        nodes_json(&c, "a").iter().any(|n| n["name"] == "z")
    });
    std::thread::sleep(Duration::from_secs(4));
    // b is still b, at its address. (On a machine loaded enough, b can be declared down for a
    // moment by mistake, and rejoins; a lie believed would keep it out or rename it for good.)
    let deadline = Instant::now() + Duration::from_secs(15);
    let nodes = loop {
        let nodes = nodes_json(&c, "a");
        let has_b = nodes
            .iter()
            .any(|n| n["name"] == "b" && n["addr"] == b_addr.to_string());
        if has_b || Instant::now() > deadline {
            break nodes;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(
        nodes
            .iter()
            .any(|n| n["name"] == "b" && n["addr"] == b_addr.to_string()),
        "a lost b: {nodes:?}"
    );
    assert!(!nodes.iter().any(|n| n["name"] == "y"), "{nodes:?}");
    let run = c.run("a", &["run", "--on", "b", "--", "echo", "b-is-b"]);
    assert!(run.status.success(), "{}", out_text(&run));
    assert_eq!(String::from_utf8_lossy(&run.stdout).trim(), "b-is-b");
}

/// A node that answers at the address of node b (b having died) with a certificate that is
/// not b's is refused by the node dialling b: nothing is sent to it.
#[test]
fn a_dialler_refuses_an_impostor_at_the_address_it_dials() {
    let c = Cluster::up_isolated("trust-dial", 2, Isolation::Shared);
    let creds = issue(&c, "z", "127.0.0.62");
    let b_addr = addr(&c, "b");
    assert!(Command::new("kill")
        .args(["-KILL", &c.daemon_pid("b").to_string()])
        .status()
        .unwrap()
        .success());
    // An impostor takes b's address at once, while a still counts b alive (a dead node is
    // declared down only after a few seconds of silence).
    let got: Arc<Mutex<Vec<String>>> = Arc::default();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let listener = {
        let mut tries = 0;
        loop {
            match rt.block_on(tokio::net::TcpListener::bind(b_addr)) {
                Ok(l) => break l,
                Err(e) if tries < 50 => {
                    tries += 1;
                    let _ = e;
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => panic!("bind {b_addr}: {e}"),
            }
        }
    };
    {
        let got = got.clone();
        rt.spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    continue;
                };
                let (creds, got) = (creds.clone(), got.clone());
                tokio::spawn(async move {
                    let Ok(mut conn) = tls::accept(&creds, tcp).await else {
                        return;
                    };
                    while let Ok(m) = read_msg(&mut conn.stream).await {
                        if !matches!(m, Msg::Gossip { .. }) {
                            got.lock().unwrap().push(ferry_transport::message::kind(&m));
                        }
                    }
                });
            }
        });
    }
    let run = c.run("a", &["run", "--on", "b", "--", "true"]);
    std::thread::sleep(Duration::from_millis(300));
    let got = got.lock().unwrap().clone();
    assert!(
        got.is_empty(),
        "the impostor at b's address received {got:?}; run: {}",
        out_text(&run)
    );
    assert!(!run.status.success(), "{}", out_text(&run));
    let err = String::from_utf8_lossy(&run.stderr);
    // Either a dialled and refused the certificate, or it had already found b dead.
    assert!(
        err.contains("presents the certificate of \"z\", not of \"b\"")
            || err.contains("no live node named \"b\""),
        "{}",
        out_text(&run)
    );
}

/// A load record about b sent by another node (with a certificate of its own, as valid as
/// b's) is ignored: c keeps seeing b's own load.
#[test]
fn a_forged_load_record_is_ignored() {
    let c = Cluster::up_isolated("trust-load", 3, Isolation::Shared);
    let creds = issue(&c, "z", "127.0.0.63");
    let forged = ForgedItem {
        key: ForgedKey {
            node: "b".into(),
            incarnation: u64::MAX,
            seq: u64::MAX,
        },
        load: ferry_policy::NodeLoad {
            runnable: 0,
            cpus: 64,
            cpu_idle_pct: 100.0,
            free_memory_bytes: 1 << 50,
            console_idle_secs: None,
            guests: 0,
            accepting: false,
            stale: false,
            ..Default::default()
        },
    };
    let _liar = Liar::start(
        creds,
        NodeId {
            name: "z".into(),
            addr: format!("127.0.0.63:{}", c.port).parse().unwrap(),
            bump: now_ms(),
        },
        addr(&c, "a"),
        Some(postcard::to_allocvec(&forged).unwrap()),
        vec![],
    );
    // z is a member (its certificate is the cluster's), and has been gossiping its forgery to
    // everyone for a while.
    wait_for("c sees z", Duration::from_secs(20), || {
        nodes_json(&c, "c").iter().any(|n| n["name"] == "z")
    });
    std::thread::sleep(Duration::from_secs(4));
    for on in ["a", "c"] {
        let l = load_seen(&c, on, "b").expect("b's load is known");
        assert_eq!(l["accepting"], true, "{on} believes the forgery: {l}");
        assert!(
            l["free_memory_bytes"].as_u64().unwrap() < (1 << 50),
            "{on} believes the forgery: {l}"
        );
    }
    // And b's own word still comes through.
    let o = c.run("b", &["accept", "no"]);
    assert!(o.status.success(), "{}", out_text(&o));
    wait_for("c sees b refuse guests", Duration::from_secs(20), || {
        load_seen(&c, "c", "b").is_some_and(|l| l["accepting"] == false)
    });
}

/// `ferry cluster revoke c`: the daemons reload the list, drop c's open connections (a
/// remote program c started on a loses its caller) and refuse c from then on; b is unharmed.
#[test]
fn a_revoked_certificate_is_refused_and_dropped() {
    let c = Cluster::up_isolated("trust-revoke", 3, Isolation::Shared);
    let mut run = c
        .ferry("c")
        .args(["run", "--on", "a", "--", "sleep", "120"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    wait_for("the remote program starts", Duration::from_secs(20), || {
        c.log("a").contains("run-started")
    });
    let o = Command::new(FERRY)
        .args(["cluster", "revoke", "c", "--dir"])
        .arg(c.dir.join("certs"))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", out_text(&o));
    let end = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(s) = run.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > end {
            let _ = run.kill();
            panic!(
                "`ferry run` from c kept its connection to a after c's revocation; a's log:\n{}",
                c.log("a")
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(!status.success());
    assert!(
        c.log("a").contains("revoked-connection-dropped"),
        "{}",
        c.log("a")
    );
    let again = c.run("c", &["run", "--on", "a", "--", "true"]);
    assert!(!again.status.success(), "{}", out_text(&again));
    wait_for(
        "a refuses c at the handshake",
        Duration::from_secs(10),
        || c.log("a").contains("is revoked"),
    );
    // SIGHUP reloads too, and changes nothing more.
    assert!(Command::new("kill")
        .args(["-HUP", &c.daemon_pid("a").to_string()])
        .status()
        .unwrap()
        .success());
    let b = c.run("b", &["run", "--on", "a", "--", "echo", "still-here"]);
    assert!(b.status.success(), "{}", out_text(&b));
    assert_eq!(String::from_utf8_lossy(&b.stdout).trim(), "still-here");
    wait_for(
        "c says its own certificate is revoked",
        Duration::from_secs(10),
        || c.log("c").contains("own-certificate-revoked"),
    );
    wait_for("a no longer lists c", Duration::from_secs(20), || {
        !nodes_json(&c, "a").iter().any(|n| n["name"] == "c")
    });
}

fn fd_count(pid: i32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

/// 2,000 plain TCP connections held open, idle, on a's peer port: a's descriptors stay
/// bounded and `ferry run --on a` from b still works.
#[test]
fn idle_connections_cannot_exhaust_a_daemon() {
    let c = Cluster::up_isolated("trust-flood", 2, Isolation::Shared);
    let pid = c.daemon_pid("a");
    let before = fd_count(pid);
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit write and read one struct we own.
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim);
        lim.rlim_cur = lim.rlim_max.min(8192);
        libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
    }
    let target = addr(&c, "a");
    let mut held = Vec::new();
    for _ in 0..2000 {
        match std::net::TcpStream::connect_timeout(&target, Duration::from_secs(2)) {
            Ok(s) => held.push(s),
            Err(_) => std::thread::sleep(Duration::from_millis(5)),
        }
    }
    std::thread::sleep(Duration::from_millis(500));
    let during = fd_count(pid);
    let run = c.run("b", &["run", "--on", "a", "--", "echo", "through"]);
    let after_run = fd_count(pid);
    drop(held);
    assert!(
        during < before + 100 && after_run < before + 100,
        "a held {during} descriptors with the connections open ({before} before, {after_run} \
         after the run)"
    );
    assert!(run.status.success(), "{}", out_text(&run));
    assert_eq!(String::from_utf8_lossy(&run.stdout).trim(), "through");
    assert!(c.log("a").contains("connections-shed"), "{}", c.log("a"));
}

/// After `kill -9` and a restart of b's daemon, `ferry accept no` on b is seen by the others
/// within seconds (its load records carry a new incarnation, not a sequence number that starts
/// over below the one its previous life reached).
#[test]
fn a_restarted_daemon_is_heard_at_once() {
    let c = Cluster::up_isolated("trust-restart", 3, Isolation::Shared);
    // Let b publish a few dozen records first.
    std::thread::sleep(Duration::from_secs(30));
    assert!(Command::new("kill")
        .args(["-KILL", &c.daemon_pid("b").to_string()])
        .status()
        .unwrap()
        .success());
    std::thread::sleep(Duration::from_millis(500));
    let restarted = {
        use std::os::unix::process::CommandExt;
        let log = std::fs::OpenOptions::new()
            .append(true)
            .open(c.dir.join("b").join("daemon.log"))
            .unwrap();
        let child = Command::new(FERRY)
            .arg("daemon")
            .arg("--config")
            .arg(c.dir.join("b").join("ferry.toml"))
            .stdin(std::process::Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .process_group(0)
            .spawn()
            .unwrap();
        std::fs::write(c.dir.join("b").join("daemon.pid"), child.id().to_string()).unwrap();
        child
    };
    wait_for("b answers again", Duration::from_secs(20), || {
        c.run("b", &["nodes"]).status.success()
    });
    let o = c.run("b", &["accept", "no"]);
    assert!(o.status.success(), "{}", out_text(&o));
    for on in ["a", "c"] {
        wait_for(
            &format!("{on} sees b refuse guests"),
            Duration::from_secs(15),
            || load_seen(&c, on, "b").is_some_and(|l| l["accepting"] == false),
        );
    }
    drop(c);
    let mut restarted = restarted;
    let _ = restarted.wait();
}
