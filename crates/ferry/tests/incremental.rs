//! Incremental checkpoints (`ferry checkpoint --parent DIR`): the image stores only the pages
//! that changed since its parent, a restore composes the chain, and a parent that is not the
//! one the image was made from is refused.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn wait_file(path: &Path) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(s) = std::fs::read_to_string(path) {
            if s.ends_with('\n') {
                return s;
            }
        }
        assert!(Instant::now() < deadline, "no {}", path.display());
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn image_len(dir: &Path) -> u64 {
    std::fs::metadata(dir.join("image.ferry")).unwrap().len()
}

#[test]
fn a_chain_restores_exactly_and_a_changed_parent_is_refused() {
    common::seal_inherited_fds();
    let dir = common::scratch("incremental", "chain");
    let (p1, p2, p3) = (dir.join("p1"), dir.join("p2"), dir.join("p3"));
    // 24 MiB of random bytes; on "mod1" and "mod2" it changes 1 MiB of them (and says its
    // digest); on "go", its digest again.
    let script = "import hashlib,os,sys,time\n\
                  d=sys.argv[1]\n\
                  a=bytearray(os.urandom(24<<20))\n\
                  def say(n):\n\
                  \x20 open(d+'/'+n+'.tmp','w').write(hashlib.sha256(a).hexdigest()+'\\n'); os.rename(d+'/'+n+'.tmp',d+'/'+n)\n\
                  def wait(n):\n\
                  \x20 while not os.path.exists(d+'/'+n): time.sleep(0.01)\n\
                  say('v0')\n\
                  for i in (1,2):\n\
                  \x20 wait('mod%d'%i); a[i<<20:(i+1)<<20]=os.urandom(1<<20); say('v%d'%i)\n\
                  wait('go'); say('after')\n";
    let mut child = Command::new("python3")
        .args(["-c", script])
        .arg(&dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .expect("start python3");
    let pid = child.id().to_string();
    wait_file(&dir.join("v0"));
    let run = |args: &[&str]| {
        let (ok, out, err) = common::ferry(args);
        assert!(ok, "ferry {args:?}: {err}");
        out
    };
    run(&[
        "checkpoint",
        &pid,
        "--dir",
        p1.to_str().unwrap(),
        "--leave-running",
    ]);
    std::fs::write(dir.join("mod1"), "").unwrap();
    wait_file(&dir.join("v1"));
    run(&[
        "checkpoint",
        &pid,
        "--dir",
        p2.to_str().unwrap(),
        "--parent",
        p1.to_str().unwrap(),
        "--leave-running",
    ]);
    std::fs::write(dir.join("mod2"), "").unwrap();
    let v2 = wait_file(&dir.join("v2"));
    run(&[
        "checkpoint",
        &pid,
        "--dir",
        p3.to_str().unwrap(),
        "--parent",
        p2.to_str().unwrap(),
    ]);
    let _ = child.wait();
    // Each child image holds about the MiB that changed, not the 24.
    for p in [&p2, &p3] {
        assert!(
            image_len(p) < image_len(&p1) / 4,
            "{} holds {} bytes against its root's {}",
            p.display(),
            image_len(p),
            image_len(&p1)
        );
    }
    let out = run(&["restore", "--dir", p3.to_str().unwrap(), "--json"]);
    let r: serde_json::Value = serde_json::from_str(&out).unwrap();
    let restored = r["root_host_pid"].as_i64().expect("root_host_pid");
    std::fs::write(dir.join("go"), "").unwrap();
    assert_eq!(
        wait_file(&dir.join("after")),
        v2,
        "the restored memory differs"
    );
    let _ = Command::new("kill")
        .args(["-9", &restored.to_string()])
        .status();
    common::wait_gone(restored as i32, Duration::from_secs(5));

    // A parent changed since (here: one byte of its image) is refused, naming it.
    let img = p1.join("image.ferry");
    let mut bytes = std::fs::read(&img).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    std::fs::write(&img, bytes).unwrap();
    let (ok, _, err) = common::ferry(&["restore", "--dir", p3.to_str().unwrap()]);
    assert!(!ok, "a chain with a changed parent was restored");
    assert!(
        err.contains("is not the one this image was made from"),
        "unclear error: {err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
