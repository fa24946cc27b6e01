//! Dirty-page tracking (ferry_memory::dirty) on a real process: python3 writes at known pages
//! of a mapping of its own; exactly those pages come back written, and each collection
//! protects them again, so the next one sees only what was written since.

use ferry_engine::freeze::FrozenTree;
use ferry_memory::dirty::private_mappings;
use ferry_memory::dirty::start_trackers;
use ferry_memory::RangeSet;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn wait_file(path: &Path) -> String {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok(s) = std::fs::read_to_string(path) {
            if s.ends_with('\n') {
                return s;
            }
        }
        assert!(Instant::now() < deadline, "no {}", path.display());
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The victim dies with the test, pass or fail.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn exactly_the_written_pages_come_back_and_are_protected_again() {
    let dir = std::env::temp_dir().join(format!("ferry-dirty-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    // A mapping of 64 pages, all touched; on each "goN" file it writes the pages listed in
    // it, then says "doneN".
    let script = "import mmap,ctypes,os,sys,time\n\
                  d=sys.argv[1]\n\
                  m=mmap.mmap(-1,64*4096,flags=mmap.MAP_PRIVATE|mmap.MAP_ANONYMOUS)\n\
                  for i in range(64): m[i*4096]=1\n\
                  a=ctypes.addressof(ctypes.c_char.from_buffer(m))\n\
                  open(d+'/addr.tmp','w').write('%d\\n'%a); os.rename(d+'/addr.tmp',d+'/addr')\n\
                  n=1\n\
                  while True:\n\
                  \x20 g=d+'/go%d'%n\n\
                  \x20 while not os.path.exists(g): time.sleep(0.005)\n\
                  \x20 for p in open(g).read().split(): m[int(p)*4096+7]=n+1\n\
                  \x20 open(d+'/done%d'%n,'w').write('ok\\n'); n+=1\n";
    let child = Command::new("python3")
        .args(["-c", script])
        .arg(&dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .expect("start python3");
    let pid = child.id() as i32;
    let mut child = KillOnDrop(child);
    let base: u64 = wait_file(&dir.join("addr")).trim().parse().unwrap();
    let area = RangeSet::from_ranges([(base, base + 64 * 4096)]);
    let pages = |r: &RangeSet| -> Vec<u64> {
        r.intersect(&area)
            .ranges()
            .iter()
            .flat_map(|&(s, e)| (s..e).step_by(4096).map(|a| (a - base) / 4096))
            .collect()
    };

    let frozen = FrozenTree::freeze(pid).unwrap();
    let mut trackers = start_trackers(&frozen);
    frozen.thaw();
    assert_eq!(trackers.len(), 1, "no tracker for PID {pid}");
    let t = &mut trackers[0];
    // The first collection registers every mapping: all of it counts as written.
    let first = t.collect(&private_mappings(pid).unwrap());
    assert_eq!(pages(&first), (0..64).collect::<Vec<_>>());

    for (n, written) in [(1, vec![3u64, 10, 11, 40]), (2, vec![5]), (3, vec![])] {
        let list: Vec<String> = written.iter().map(|p| p.to_string()).collect();
        std::fs::write(dir.join(format!("go{n}.tmp")), list.join(" ")).unwrap();
        std::fs::rename(dir.join(format!("go{n}.tmp")), dir.join(format!("go{n}"))).unwrap();
        wait_file(&dir.join(format!("done{n}")));
        let dirty = t.collect(&private_mappings(pid).unwrap());
        assert_eq!(pages(&dirty), written, "round {n}");
    }
    // Dropping the tracker leaves the process as it was: it writes on.
    drop(trackers);
    std::fs::write(dir.join("go4"), "1 2 63").unwrap();
    wait_file(&dir.join("done4"));
    assert!(child.0.try_wait().unwrap().is_none(), "the process died");
    drop(child);
    std::fs::remove_dir_all(&dir).unwrap();
}
