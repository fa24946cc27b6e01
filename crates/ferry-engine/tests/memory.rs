//! Private anonymous memory goes back through userfaultfd (UFFDIO_COPY) and arrives intact: a
//! real python3 process holding random bytes, checkpointed, killed and restored.

use ferry_engine::checkpoint::capture;
use ferry_engine::freeze::FrozenTree;
use ferry_engine::restore::{open, restore};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn wait_file(path: &Path, what: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok(s) = std::fs::read_to_string(path) {
            if s.ends_with('\n') {
                return s;
            }
        }
        assert!(Instant::now() < deadline, "{what}: no {}", path.display());
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn anonymous_memory_is_filled_by_uffd_and_intact() {
    let dir = std::env::temp_dir().join(format!("ferry-memory-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    // 48 MiB of random bytes (no zero page among them), with zero pages between two halves,
    // and a digest of all of it; after the restore it digests the same memory again.
    let script = "import hashlib,os,sys,time\n\
                  d=sys.argv[1]\n\
                  a=bytearray(os.urandom(24<<20)); z=bytearray(8<<20); b=bytearray(os.urandom(24<<20))\n\
                  dig=lambda: hashlib.sha256(a+z+b).hexdigest()\n\
                  open(d+'/before.tmp','w').write(dig()+'\\n'); os.rename(d+'/before.tmp',d+'/before')\n\
                  while not os.path.exists(d+'/go'): time.sleep(0.02)\n\
                  open(d+'/after.tmp','w').write(dig()+'\\n'); os.rename(d+'/after.tmp',d+'/after')\n";
    let mut child = Command::new("python3")
        .args(["-c", script])
        .arg(&dir)
        .stdin(Stdio::null())
        .spawn()
        .expect("start python3");
    let pid = child.id() as i32;
    let before = wait_file(&dir.join("before"), "the child did not start");

    let frozen = FrozenTree::freeze(pid).unwrap();
    let image = std::fs::File::create(dir.join("image")).unwrap();
    let (_, captured) = capture(&frozen, image).unwrap();
    frozen.kill();
    let _ = child.wait();
    assert!(captured.memory_bytes >= 48 << 20, "{captured:?}");

    let mut img = open(std::fs::File::open(dir.join("image")).unwrap()).unwrap();
    let report = restore(&mut img).unwrap();
    assert!(
        report.memory_filled_by_uffd,
        "the memory went in without userfaultfd: {report:?}"
    );
    std::fs::write(dir.join("go"), "").unwrap();
    let after = wait_file(&dir.join("after"), "the restored process did not answer");
    assert_eq!(before, after, "the restored memory differs");
    std::fs::remove_dir_all(&dir).unwrap();
}
