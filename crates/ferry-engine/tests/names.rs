//! Socket files set aside while a tree moves: a real process bound to a real path, frozen.

use ferry_engine::freeze::FrozenTree;
use ferry_engine::names::SocketFilesAside;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// tests/victims/unix_pid_server.py serving `path` (each connection gets its PID).
fn server(path: &Path) -> Child {
    let script =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/victims/unix_pid_server.py");
    let child = Command::new("python3")
        .arg(script)
        .arg(path)
        .stdin(Stdio::null())
        .spawn()
        .expect("start python3");
    let deadline = Instant::now() + Duration::from_secs(10);
    while UnixStream::connect(path).is_err() {
        assert!(Instant::now() < deadline, "the server did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    child
}

/// Whether the process answering at `path` is `pid`.
fn answers(path: &Path, pid: i32) -> bool {
    use std::io::Read;
    let Ok(mut s) = UnixStream::connect(path) else {
        return false;
    };
    let mut got = String::new();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.read_to_string(&mut got).is_ok() && got == pid.to_string()
}

fn listing(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

#[test]
fn socket_files_go_aside_and_come_back() {
    let dir = std::env::temp_dir().join(format!("ferry-names-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("srv.sock");
    let mut child = server(&path);
    let pid = child.id() as i32;

    // Set aside, then put back: the original answers under its name again.
    let frozen = FrozenTree::freeze(pid).unwrap();
    let aside = SocketFilesAside::set_aside(&frozen).unwrap();
    assert_eq!(aside.len(), 1);
    assert!(
        !path.exists(),
        "the socket file is still there: {:?}",
        listing(&dir)
    );
    let moved = format!(".srv.sock.ferry-moving-{pid}");
    assert_eq!(listing(&dir), vec![moved.clone()]);
    // A copy binds the name meanwhile; putting back replaces its file.
    let copy = std::os::unix::net::UnixListener::bind(&path).unwrap();
    aside.put_back().unwrap();
    drop(copy);
    frozen.thaw();
    assert_eq!(listing(&dir), vec!["srv.sock".to_string()]);
    assert!(
        answers(&path, pid),
        "the original does not answer after put_back"
    );

    // Dropping it puts back too.
    let frozen = FrozenTree::freeze(pid).unwrap();
    drop(SocketFilesAside::set_aside(&frozen).unwrap());
    frozen.thaw();
    assert!(
        answers(&path, pid),
        "the original does not answer after a drop"
    );

    // Committed: the old file is gone, the name is free for the copy.
    let frozen = FrozenTree::freeze(pid).unwrap();
    let aside = SocketFilesAside::set_aside(&frozen).unwrap();
    frozen.kill();
    aside.remove();
    assert!(listing(&dir).is_empty(), "left behind: {:?}", listing(&dir));
    let _ = child.wait();
    std::fs::remove_dir_all(&dir).unwrap();
}
