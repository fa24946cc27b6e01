//! Seeing the cluster, on a real local cluster of two daemons (a, b) started once for the
//! file, with a real process moved from a to b: `ferry top` live under a real pseudo-terminal
//! (keys s and q), `ferry top --once --json`, the daemon's page in a real headless browser
//! (Debian's chromium), its metrics in the Prometheus text format, whose counters follow a
//! real migration and a real refusal, and the bytes a home relays for a moved `cat`. A daemon
//! whose page is bound to an address that is not loopback serves it only to a client with a
//! certificate of the cluster.

mod common;

use common::cluster::Cluster;
use common::scratch;
use libtest_mimic::{Arguments, Failed, Trial};
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The cluster and the process moved from a to b (its home PID, which it keeps).
struct World {
    c: Cluster,
    moved: Mutex<Child>,
}

impl World {
    fn moved_pid(&self) -> u32 {
        self.moved.lock().unwrap().id()
    }
}

impl Drop for World {
    fn drop(&mut self) {
        let mut m = self.moved.lock().unwrap();
        let _ = m.kill();
        let _ = m.wait();
    }
}

fn main() {
    common::seal_inherited_fds();
    let args = Arguments::from_args();
    let world = if args.list {
        None
    } else {
        // Separate nodes: node a's address on the cluster's bridge is not loopback (the page
        // bound there must demand mutual TLS).
        let c = Cluster::up_isolated("observe", 2, common::cluster::Isolation::Separate);
        let moved = victim("moved");
        let pid = moved.id();
        let w = Arc::new(World {
            c,
            moved: Mutex::new(moved),
        });
        let o = w.c.run("a", &["migrate", &pid.to_string(), "--to", "b"]);
        assert!(
            o.status.success(),
            "move the victim to b: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        Some(w)
    };
    type Test = fn(&World) -> Result<(), Failed>;
    let tests: [(&str, Test); 6] = [
        ("top_once_json_shows_the_moved_process", top_once_json),
        ("top_live_in_a_pty_keys_s_and_q", top_live),
        ("page_in_a_headless_browser", page_in_browser),
        ("metrics_follow_a_migration_and_a_refusal", metrics),
        ("cost_of_pipes_relayed_home", relayed_cost),
        (
            "web_elsewhere_needs_a_cluster_certificate",
            web_over_mutual_tls,
        ),
    ];
    let trials = tests
        .into_iter()
        .map(|(name, f)| {
            let w = world.clone();
            Trial::test(name, move || match &w {
                Some(w) => f(w),
                None => Ok(()),
            })
        })
        .collect();
    let conclusion = libtest_mimic::run(&args, trials);
    if let Some(w) = &world {
        if conclusion.has_failed() {
            eprintln!("{}", common::cluster::daemon_logs(&w.c.dir, &["a", "b"]));
        }
    }
    drop(world);
    conclusion.exit();
}

/// A process that can move: its own session, no pipes, its cwd in the shared tree.
fn victim(name: &str) -> Child {
    let dir = scratch("observe", name);
    Command::new("sleep")
        .arg("7777")
        .current_dir(&dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn()
        .unwrap()
}

fn check(ok: bool, what: impl FnOnce() -> String) -> Result<(), Failed> {
    if ok {
        Ok(())
    } else {
        Err(what().into())
    }
}

fn wait_until(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + timeout;
    loop {
        if f() {
            return true;
        }
        if Instant::now() > end {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

// ---- ferry top ---------------------------------------------------------------------------

fn top_once_json(w: &World) -> Result<(), Failed> {
    let o = w.c.run("a", &["top", "--once", "--json"]);
    check(o.status.success(), || {
        format!("top --once --json: {}", String::from_utf8_lossy(&o.stderr))
    })?;
    let v: serde_json::Value = serde_json::from_slice(&o.stdout)?;
    let names: Vec<&str> = v["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|n| n["name"].as_str())
        .collect();
    check(names.contains(&"a") && names.contains(&"b"), || {
        format!("nodes {names:?}")
    })?;
    let pid = w.moved_pid() as i64;
    let p = v["processes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["home_pid"] == pid)
        .ok_or_else(|| format!("PID {pid} not in {v:#}"))?;
    check(p["home_node"] == "a" && p["node"] == "b", || {
        format!("{p:#}")
    })?;
    check(
        p["cpu_pct"].is_number() && p["run_state"].is_string(),
        || format!("no CPU or state: {p:#}"),
    )?;
    // What it costs its home: the deputy kept on a.
    check(
        p["cost"]["deputies"] == 1 && p["cost"]["body_node"] == "b",
        || format!("no deputy counted: {p:#}"),
    )?;
    let o = w.c.run("a", &["top", "--once"]);
    let text = String::from_utf8_lossy(&o.stdout);
    check(o.status.success() && text.contains("sleep 7777"), || {
        format!("top --once: {text}")
    })
}

/// The text a terminal of `rows` x `cols` shows after `bytes`: enough of a terminal for what
/// ratatui and crossterm send (cursor moves, text; colours, modes and erasing ignored).
fn screen(bytes: &[u8], rows: usize, cols: usize) -> Vec<String> {
    let mut grid = vec![vec![' '; cols]; rows];
    let (mut r, mut c) = (0usize, 0usize);
    let text = String::from_utf8_lossy(bytes);
    let mut it = text.chars().peekable();
    while let Some(ch) = it.next() {
        match ch {
            '\x1b' => {
                if it.peek() != Some(&'[') {
                    it.next();
                    continue;
                }
                it.next();
                let mut params = String::new();
                let mut fin = ' ';
                for p in it.by_ref() {
                    if p.is_ascii_alphabetic() || p == '@' || p == '~' {
                        fin = p;
                        break;
                    }
                    params.push(p);
                }
                let nums: Vec<usize> = params
                    .trim_start_matches('?')
                    .split(';')
                    .map(|n| n.parse().unwrap_or(1))
                    .collect();
                match fin {
                    'H' | 'f' => {
                        r = nums.first().copied().unwrap_or(1).max(1) - 1;
                        c = nums.get(1).copied().unwrap_or(1).max(1) - 1;
                    }
                    'J' if params == "2" => grid = vec![vec![' '; cols]; rows],
                    _ => {}
                }
            }
            '\r' => c = 0,
            '\n' => r += 1,
            ch if !ch.is_control() => {
                if r < rows && c < cols {
                    grid[r][c] = ch;
                }
                c += 1;
            }
            _ => {}
        }
    }
    grid.into_iter().map(|l| l.into_iter().collect()).collect()
}

fn top_live(w: &World) -> Result<(), Failed> {
    const ROWS: usize = 30;
    const COLS: usize = 160;
    let (master, slave) = ferry_sys::spawn::open_pty().unwrap();
    ferry_sys::tty::set_winsize(master.as_raw_fd(), [ROWS as u16, COLS as u16, 0, 0]).unwrap();
    let master = std::fs::File::from(master);
    let out = Arc::new(Mutex::new(Vec::<u8>::new()));
    {
        let mut m = master.try_clone().unwrap();
        let out = out.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 8192];
            while let Ok(n) = m.read(&mut buf) {
                if n == 0 {
                    break;
                }
                out.lock().unwrap().extend_from_slice(&buf[..n]);
            }
        });
    }
    // `ferry top` in a session of its own whose controlling terminal is the pty, as in a shell.
    let mut cmd = Command::new("setsid");
    cmd.args(["-c", common::cluster::FERRY, "top", "--interval", "0.3"])
        .env("FERRY_CLUSTER_DIR", &w.c.dir)
        .env("FERRY_NODE", "a")
        .stdin(slave.try_clone().unwrap())
        .stdout(slave.try_clone().unwrap())
        .stderr(slave.try_clone().unwrap());
    let mut top = cmd.spawn().unwrap();
    drop(slave);
    let shown = || screen(&out.lock().unwrap(), ROWS, COLS);
    let pid = w.moved_pid().to_string();
    // The moved process's row: home a, its home PID, running on b.
    let row_of = |lines: &[String]| -> Option<Vec<String>> {
        lines.iter().find(|l| l.contains("sleep 7777")).map(|l| {
            l.split(|c: char| c.is_whitespace() || c == '│')
                .filter(|t| !t.is_empty())
                .map(str::to_string)
                .collect()
        })
    };
    let seen = wait_until(Duration::from_secs(15), || {
        row_of(&shown()).is_some_and(|r| r.len() > 3 && r[0] == "a" && r[1] == pid && r[2] == "b")
    });
    let lines = shown();
    let result = (|| {
        check(seen, || {
            format!(
                "no row `a {pid} b ... sleep 7777` on the screen:\n{}",
                lines.join("\n")
            )
        })?;
        check(
            lines
                .iter()
                .any(|l| l.contains("NODE") && l.contains("RUNNABLE"))
                && lines
                    .iter()
                    .any(|l| l.trim_start_matches('│').trim_start().starts_with("b ")),
            || format!("no nodes pane with b:\n{}", lines.join("\n")),
        )?;
        check(lines.iter().any(|l| l.contains("sort: cpu")), || {
            format!("no sort shown:\n{}", lines.join("\n"))
        })?;
        (&master).write_all(b"s").unwrap();
        let sorted = wait_until(Duration::from_secs(10), || {
            shown().iter().any(|l| l.contains("sort: home"))
        });
        check(sorted, || {
            format!("s did not change the sort:\n{}", shown().join("\n"))
        })?;
        (&master).write_all(b"q").unwrap();
        let mut st = None;
        wait_until(Duration::from_secs(10), || {
            st = top.try_wait().unwrap();
            st.is_some()
        });
        let st = st.ok_or("ferry top did not quit on q")?;
        check(st.success(), || format!("ferry top ended with {st:?}"))?;
        // It left the alternate screen it drew on.
        let raw = String::from_utf8_lossy(&out.lock().unwrap()).into_owned();
        check(raw.contains("\x1b[?1049l"), || {
            "ferry top did not leave the alternate screen".into()
        })
    })();
    if result.is_err() {
        let _ = top.kill();
    }
    let _ = top.wait();
    result
}

// ---- The page and the metrics --------------------------------------------------------------

/// Where node `node` serves its page: the address its log announces.
fn web_addr(c: &Cluster, node: &str) -> Result<String, Failed> {
    let mut addr = None;
    wait_until(Duration::from_secs(10), || {
        addr = announced_web_addr(&c.log(node));
        addr.is_some()
    });
    addr.ok_or_else(|| format!("node {node} announced no web address:\n{}", c.log(node)).into())
}

/// The address a daemon's log says its page is served on (its `event="web"` line).
fn announced_web_addr(log: &str) -> Option<String> {
    log.lines().find_map(|l| {
        l.contains("event=\"web\"")
            .then(|| {
                l.split("addr=")
                    .nth(1)?
                    .split_whitespace()
                    .next()
                    .map(str::to_string)
            })
            .flatten()
    })
}

/// One HTTP/1.1 request; the status code and the body.
fn http(addr: &str, method: &str, path: &str) -> Result<(u16, String), Failed> {
    let mut s = std::net::TcpStream::connect(addr).map_err(|e| format!("connect {addr}: {e}"))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )?;
    let mut resp = String::new();
    s.read_to_string(&mut resp)?;
    let (head, body) = resp.split_once("\r\n\r\n").ok_or("no HTTP header end")?;
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| format!("bad status line in {head:?}"))?;
    // Bodies come whole (Content-Length) from the daemon, never chunked.
    check(!head.to_ascii_lowercase().contains("chunked"), || {
        format!("chunked: {head}")
    })?;
    Ok((code, body.to_string()))
}

/// The cells of every row of table `id` in an HTML document.
fn table_rows(html: &str, id: &str) -> Vec<Vec<String>> {
    let Some(start) = html.find(&format!("<table id=\"{id}\"")) else {
        return Vec::new();
    };
    let t = &html[start..];
    let t = &t[..t.find("</table>").unwrap_or(t.len())];
    let Some(body) = t.split("<tbody>").nth(1) else {
        return Vec::new();
    };
    body.split("<tr>")
        .skip(1)
        .map(|r| {
            r.split("<td>")
                .skip(1)
                .map(|c| c.split("</td>").next().unwrap_or("").to_string())
                .collect()
        })
        .collect()
}

fn page_in_browser(w: &World) -> Result<(), Failed> {
    let addr = web_addr(&w.c, "a")?;
    let chromium = ["chromium", "chromium-browser"]
        .into_iter()
        .find(|b| {
            Command::new(b)
                .arg("--version")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        })
        .ok_or(
            "chromium is not installed: this test needs a real headless browser \
             (scripts/install-deps.sh installs Debian's chromium)",
        )?;
    let profile = scratch("observe", "chromium-profile");
    let url = format!("http://{addr}/");
    let pid = w.moved_pid().to_string();
    let mut last = String::new();
    // The page refreshes itself; a dump taken before b's gossip arrived may lack it: try again.
    for _ in 0..5 {
        let o = Command::new(chromium)
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
            ])
            .arg(format!("--user-data-dir={}", profile.display()))
            .args(["--dump-dom", &url])
            .stdin(Stdio::null())
            .output()?;
        last = String::from_utf8_lossy(&o.stdout).into_owned();
        check(o.status.success(), || {
            format!(
                "chromium failed ({}): {}",
                o.status,
                String::from_utf8_lossy(&o.stderr)
            )
        })?;
        let nodes = table_rows(&last, "nodes");
        let procs = table_rows(&last, "processes");
        let both = ["a", "b"].iter().all(|n| {
            nodes
                .iter()
                .any(|r| r.first().map(String::as_str) == Some(*n))
        });
        let moved = procs
            .iter()
            .any(|r| r.len() > 3 && r[0] == "a" && r[1] == pid && r[2] == "b");
        if both && moved {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    Err(
        format!("the page as chromium shows it lacks node a, b or the moved PID {pid}:\n{last}")
            .into(),
    )
}

/// The samples of a Prometheus text exposition, each line checked: `# HELP`, `# TYPE`,
/// `# EOF` or `name{labels} value`.
fn parse_metrics(text: &str) -> Result<Vec<(String, f64)>, Failed> {
    let mut out = Vec::new();
    for line in text.lines() {
        if line.is_empty() || line.starts_with("# HELP ") || line.starts_with("# TYPE ") {
            continue;
        }
        if line == "# EOF" {
            break;
        }
        let (name, value) = line
            .rsplit_once(' ')
            .ok_or_else(|| format!("not a sample: {line:?}"))?;
        let v: f64 = value
            .parse()
            .map_err(|_| format!("bad value in {line:?}"))?;
        let bare = name.split('{').next().unwrap();
        check(
            !bare.is_empty()
                && bare
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
                && (!name.contains('{') || name.ends_with('}')),
            || format!("bad metric name in {line:?}"),
        )?;
        out.push((name.to_string(), v));
    }
    Ok(out)
}

fn sample(samples: &[(String, f64)], name: &str) -> f64 {
    samples
        .iter()
        .find(|(n, _)| n == name)
        .map_or(0.0, |(_, v)| *v)
}

/// Metric `key` went up by exactly one from `before` to `after` (two scrapes around `what`).
fn counted_once(
    before: &[(String, f64)],
    after: &[(String, f64)],
    key: &str,
    what: impl FnOnce() -> String,
) -> Result<(), Failed> {
    check(sample(after, key) == sample(before, key) + 1.0, || {
        format!(
            "{key}: {} before, {} after {}",
            sample(before, key),
            sample(after, key),
            what()
        )
    })
}

fn metrics(w: &World) -> Result<(), Failed> {
    let addr = web_addr(&w.c, "a")?;
    let scrape = || -> Result<Vec<(String, f64)>, Failed> {
        let (code, body) = http(&addr, "GET", "/metrics")?;
        check(code == 200, || format!("/metrics answered {code}: {body}"))?;
        parse_metrics(&body)
    };
    let before = scrape()?;
    for n in ["a", "b"] {
        check(
            before
                .iter()
                .any(|(k, _)| k == &format!("ferry_node_load1{{node=\"{n}\"}}")),
            || format!("no load for node {n}: {before:?}"),
        )?;
    }
    check(sample(&before, "ferry_deputies") >= 1.0, || {
        "the moved process's deputy is not counted".into()
    })?;

    // A real migration there and back: the out and in counters, and the counts of their
    // duration histograms, go up by one each.
    let mut second = victim("second");
    let pid = second.id().to_string();
    let o = w.c.run("a", &["migrate", &pid, "--to", "b"]);
    // Back home: a migration in, for a.
    let back = w.c.run("b", &["migrate", &pid, "--to", "a"]);
    let after = scrape();
    let _ = second.kill();
    let _ = second.wait();
    check(o.status.success() && back.status.success(), || {
        format!(
            "migrate there and back: {}{}",
            String::from_utf8_lossy(&o.stderr),
            String::from_utf8_lossy(&back.stderr)
        )
    })?;
    let after = after?;
    for name in [
        "ferry_migrations_out_total",
        "ferry_migration_out_duration_seconds_count",
        "ferry_migrations_in_total",
        "ferry_migration_in_duration_seconds_count",
    ] {
        counted_once(&before, &after, name, || "a migration".into())?;
    }

    // A refused move (b takes no guests for a moment): counted by its reason.
    let accept = |yes: &str| {
        let o = w.c.run("b", &["accept", yes]);
        check(o.status.success(), || {
            format!("accept {yes}: {}", String::from_utf8_lossy(&o.stderr))
        })
    };
    accept("no")?;
    let mut third = victim("third");
    let o =
        w.c.run("a", &["migrate", &third.id().to_string(), "--to", "b"]);
    let _ = third.kill();
    let _ = third.wait();
    accept("yes")?;
    check(!o.status.success(), || {
        "b took a guest while refusing them".into()
    })?;
    let refused = scrape()?;
    let key = "ferry_migrations_failed_total{reason=\"refused\"}";
    counted_once(&after, &refused, key, || {
        format!("a refusal ({})", String::from_utf8_lossy(&o.stderr))
    })?;

    // A remote execution asked from a.
    let o = w.c.run("a", &["run", "--on", "b", "--", "true"]);
    check(o.status.success(), || {
        format!("ferry run: {}", String::from_utf8_lossy(&o.stderr))
    })?;
    let ran = scrape()?;
    let key = "ferry_remote_execs_total{side=\"caller\"}";
    counted_once(&refused, &ran, key, || "a run".into())?;

    // Read only: nothing but GET and HEAD.
    let (code, _) = http(&addr, "POST", "/metrics")?;
    check(code == 405, || format!("POST answered {code}"))?;
    let (code, body) = http(&addr, "GET", "/cluster.json")?;
    let v: serde_json::Value = serde_json::from_str(&body)?;
    check(
        code == 200 && v["nodes"].as_array().is_some_and(|n| n.len() == 2),
        || format!("/cluster.json: {code} {body}"),
    )
}

/// A `cat` whose stdin and stdout are pipes to this test moves to b: its home relays both, and
/// the bytes relayed are its cost to its home, in `ferry top`.
fn relayed_cost(w: &World) -> Result<(), Failed> {
    let mut cat = Command::new("cat")
        .current_dir(scratch("observe", "cat"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn()?;
    let pid = cat.id() as i64;
    let result = (|| {
        let o = w.c.run("a", &["migrate", &pid.to_string(), "--to", "b"]);
        check(o.status.success(), || {
            format!("migrate cat: {}", String::from_utf8_lossy(&o.stderr))
        })?;
        let line = format!("{}\n", "relayed".repeat(100));
        cat.stdin.as_mut().unwrap().write_all(line.as_bytes())?;
        let mut back = vec![0u8; line.len()];
        cat.stdout.as_mut().unwrap().read_exact(&mut back)?;
        check(back == line.as_bytes(), || {
            "cat echoed something else".into()
        })?;
        let mut last = serde_json::Value::Null;
        let seen = wait_until(Duration::from_secs(10), || {
            let o = w.c.run("a", &["top", "--once", "--json"]);
            let Ok(v) = serde_json::from_slice::<serde_json::Value>(&o.stdout) else {
                return false;
            };
            last = v["processes"]
                .as_array()
                .and_then(|p| p.iter().find(|p| p["home_pid"] == pid).cloned())
                .unwrap_or_default();
            last["cost"]["bytes_relayed"]
                .as_u64()
                .is_some_and(|b| b >= 2 * line.len() as u64)
        });
        check(seen, || {
            format!("{} bytes went each way; top shows {last:#}", line.len())
        })
    })();
    let _ = cat.kill();
    let _ = cat.wait();
    result
}

/// A daemon with `web` on node a's bridge address (not loopback): plain HTTP gets nothing, a
/// TLS client without a certificate gets nothing, one with a certificate of the cluster (node
/// b's) gets the metrics.
fn web_over_mutual_tls(w: &World) -> Result<(), Failed> {
    let listen = w.c.listen_addr("a");
    let ip = listen.rsplit_once(':').unwrap().0.to_string();
    check(!ip.starts_with("127."), || {
        format!("node a listens on loopback ({listen})")
    })?;
    let dir = scratch("observe", "tls-daemon");
    let certs = w.c.dir.join("certs");
    // A second daemon with a's certificate, alone (no peers), on a port of the kernel's choice.
    let config = format!(
        "name = \"a\"\nlisten = \"127.0.0.1:0\"\ndata_dir = {data:?}\naccept_guests = false\n\
         web = \"{ip}:0\"\n[credentials]\nca_cert = {ca:?}\ncert = {cert:?}\nkey = {key:?}\n",
        data = dir.join("data"),
        ca = certs.join("ca.pem"),
        cert = certs.join("a.pem"),
        key = certs.join("a.key"),
    );
    std::fs::write(dir.join("ferry.toml"), config)?;
    let log = std::fs::File::create(dir.join("daemon.log"))?;
    let mut daemon = Command::new(common::cluster::FERRY)
        .args(["daemon", "--config"])
        .arg(dir.join("ferry.toml"))
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()?;
    let result = (|| {
        let mut addr = None;
        wait_until(Duration::from_secs(10), || {
            let text = std::fs::read_to_string(dir.join("daemon.log")).unwrap_or_default();
            addr = announced_web_addr(&text);
            addr.is_some()
        });
        let log = || std::fs::read_to_string(dir.join("daemon.log")).unwrap_or_default();
        let addr = addr.ok_or_else(|| format!("no web address announced:\n{}", log()))?;
        check(log().contains("mutual_tls=true"), || {
            format!("not mutual TLS:\n{}", log())
        })?;

        // Plain HTTP: no answer.
        let plain = http(&addr, "GET", "/metrics");
        check(!matches!(plain, Ok((200, _))), || {
            format!("plain HTTP answered: {plain:?}")
        })?;
        // TLS without a client certificate: refused.
        use rustls_pki_types::pem::PemObject;
        let ca = rustls_pki_types::CertificateDer::from_pem_file(certs.join("ca.pem"))?;
        let mut roots = rustls::RootCertStore::empty();
        roots.add(ca)?;
        let anonymous = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
        let r = https_get(&addr, Arc::new(anonymous), "/metrics");
        check(r.as_ref().map_or(true, |t| !t.contains(" 200 ")), || {
            format!("a client without a certificate was answered: {r:?}")
        })?;
        // With node b's certificate: the metrics.
        let b = ferry_transport::Credentials::load(&ferry_transport::CredentialPaths {
            ca_cert: certs.join("ca.pem"),
            cert: certs.join("b.pem"),
            key: certs.join("b.key"),
        })?;
        let r = https_get(&addr, b.client.clone(), "/metrics")?;
        check(
            r.starts_with("HTTP/1.1 200") && r.contains("ferry_migrations_out_total"),
            || format!("with a cluster certificate: {r}"),
        )
    })();
    let _ = daemon.kill();
    let _ = daemon.wait();
    result
}

/// GET `path` over TLS (the server named as every node's certificate names it); the whole
/// answer, or the error.
fn https_get(addr: &str, config: Arc<rustls::ClientConfig>, path: &str) -> Result<String, Failed> {
    let name = rustls_pki_types::ServerName::try_from("ferry-node.cluster")?;
    let conn = rustls::ClientConnection::new(config, name)?;
    let tcp = std::net::TcpStream::connect(addr)?;
    tcp.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut tls = rustls::StreamOwned::new(conn, tcp);
    write!(
        tls,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )?;
    let mut out = Vec::new();
    match tls.read_to_end(&mut out) {
        Ok(_) => Ok(String::from_utf8_lossy(&out).into_owned()),
        // The server closes without close_notify after answering: what came is the answer.
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof && !out.is_empty() => {
            Ok(String::from_utf8_lossy(&out).into_owned())
        }
        Err(e) => Err(format!("TLS to {addr}: {e}").into()),
    }
}
