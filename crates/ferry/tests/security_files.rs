//! Ferry acts as root on paths a user controls: each test here is such a user (uid 65534,
//! nobody) trying to make a checkpoint or a restore reach a root-only file, and checks that
//! Ferry refuses (naming the PID, the descriptor, the path and what differs) and that the root
//! file is untouched. Also: images are private to root (0600, in a 0700 directory).

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

mod common;

use common::{ferry, scratch};

const NOBODY: u32 = 65534;

/// A directory owned by nobody, mode 0755.
fn user_dir(p: &Path) -> PathBuf {
    std::fs::create_dir_all(p).unwrap();
    std::os::unix::fs::chown(p, Some(NOBODY), Some(NOBODY)).unwrap();
    std::fs::set_permissions(p, PermissionsExt::from_mode(0o755)).unwrap();
    p.to_owned()
}

/// A root-only directory (0700) with a root-only file `name` (0600) holding `text`.
fn root_secret(dir: &Path, name: &str, text: &str) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::set_permissions(dir, PermissionsExt::from_mode(0o700)).unwrap();
    let f = dir.join(name);
    std::fs::write(&f, text).unwrap();
    std::fs::set_permissions(&f, PermissionsExt::from_mode(0o600)).unwrap();
    f
}

/// `sh -c SCRIPT` as nobody in `cwd`, which ends by exec'ing `sleep`; returns once the
/// sleep runs. (The caller waits for it: `checkpoint` kills and reaps it.)
fn as_nobody(cwd: &Path, script: &str) -> Child {
    run_as_nobody(cwd, "/bin/sh", &["-c", script], "sleep")
}

/// `prog ARGS` as nobody in `cwd`; returns once its command name is `comm`.
#[allow(clippy::zombie_processes)]
fn run_as_nobody(cwd: &Path, prog: &str, args: &[&str], comm: &str) -> Child {
    let child = Command::new(prog)
        .args(args)
        .current_dir(cwd)
        .uid(NOBODY)
        .gid(NOBODY)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the user's process");
    let want = comm;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let comm = std::fs::read_to_string(format!("/proc/{}/comm", child.id()));
        if comm.is_ok_and(|c| c.trim() == want) {
            return child;
        }
        assert!(
            Instant::now() < deadline,
            "the user's process did not start"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

use std::os::unix::process::CommandExt;

/// Checkpoints `child` (killing it) into `img`.
fn checkpoint(child: &mut Child, img: &Path) {
    let (ok, _, err) = ferry(&[
        "checkpoint",
        &child.id().to_string(),
        "--dir",
        img.to_str().unwrap(),
    ]);
    assert!(ok, "checkpoint failed: {err}");
    let _ = child.wait();
}

/// `ferry restore --dir img` must fail; returns its error. If it wrongly succeeded, the
/// restored process is killed before the test fails.
fn restore_refused(img: &Path, pid: u32) -> String {
    let (ok, out, err) = ferry(&["restore", "--dir", img.to_str().unwrap()]);
    if ok {
        let _ = Command::new("kill")
            .args(["-9", out.trim().lines().last().unwrap_or(&pid.to_string())])
            .status();
        panic!("the restore was not refused (it printed {out:?})");
    }
    assert!(
        !Path::new(&format!("/proc/{pid}")).exists()
            || std::fs::read_to_string(format!("/proc/{pid}/comm"))
                .is_ok_and(|c| c.trim() != "sleep"),
        "a refused restore left PID {pid} behind"
    );
    err
}

fn assert_mentions(err: &str, wants: &[&str]) {
    for w in wants {
        assert!(err.contains(w), "{w:?} not in the error: {err}");
    }
}

/// What the owner of a checkpointed process does between the checkpoint and the restore:
/// moves its directory `dir` aside (`DIR.old`) and puts a symbolic link to `target` in its place.
fn swap_for_link(dir: &Path, target: &Path) {
    let mut aside = dir.as_os_str().to_owned();
    aside.push(".old");
    std::fs::rename(dir, &aside).unwrap();
    std::os::unix::fs::symlink(target, dir).unwrap();
}

/// Waits (10 s at most) for `child` to make the file `ready`; `child` is killed if it does not.
fn wait_ready(child: &mut Child, ready: &Path, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !ready.exists() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{what} did not start");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The names in directory `dir`.
fn names_in(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect()
}

/// The owner of a checkpointed process replaces a file it had open with a symbolic link to a
/// root-only file: the restore must not open that file for it.
#[test]
fn restore_refuses_a_file_replaced_by_a_link_to_a_root_file() {
    let d = scratch("security_files", "link-swap");
    let home = user_dir(&d.join("home"));
    let secret = root_secret(&d.join("root-only"), "secret", "root's secret\n");
    let data = home.join("data");
    std::fs::write(&data, "mine\n").unwrap();
    std::os::unix::fs::chown(&data, Some(NOBODY), Some(NOBODY)).unwrap();
    let mut child = as_nobody(&home, "exec 3<>data; exec sleep 1000");
    let pid = child.id();
    let img = d.join("img");
    checkpoint(&mut child, &img);

    std::fs::remove_file(&data).unwrap();
    std::os::unix::fs::symlink(&secret, &data).unwrap();
    let err = restore_refused(&img, pid);
    assert_mentions(
        &err,
        &[
            &format!("PID {pid}"),
            "fd 3",
            data.to_str().unwrap(),
            "not the file that was captured",
            "symbolic link",
        ],
    );
    assert_eq!(std::fs::read_to_string(&secret).unwrap(), "root's secret\n");
    assert_eq!(secret.metadata().unwrap().mode() & 0o7777, 0o600);

    // Their own file put in its place, of the same size, is not the file captured either (it
    // may even have the old inode number: then its change time tells, and its contents).
    std::fs::remove_file(&data).unwrap();
    std::fs::write(&data, "MINE\n").unwrap();
    std::os::unix::fs::chown(&data, Some(NOBODY), Some(NOBODY)).unwrap();
    let err = restore_refused(&img, pid);
    assert_mentions(
        &err,
        &[
            &format!("PID {pid}"),
            "fd 3",
            "not the file that was captured",
        ],
    );
}

/// The owner of a process with a deleted file open replaces the file's directory with a link
/// into a root-only directory: recreating the deleted file must not create anything there (nor
/// move the root file of that name aside).
#[test]
fn restore_refuses_to_recreate_a_deleted_file_through_a_linked_directory() {
    let d = scratch("security_files", "ghost-dir");
    let home = user_dir(&d.join("home"));
    let sub = user_dir(&home.join("sub"));
    let root_dir = d.join("root-only");
    let root_file = root_secret(&root_dir, "tmpfile", "root's file\n");
    let mut child = as_nobody(
        &home,
        "exec 3<>sub/tmpfile; echo planted >&3; rm sub/tmpfile; exec sleep 1000",
    );
    let pid = child.id();
    let img = d.join("img");
    checkpoint(&mut child, &img);

    swap_for_link(&sub, &root_dir);
    let err = restore_refused(&img, pid);
    assert_mentions(
        &err,
        &[
            &format!("PID {pid}"),
            "fd 3",
            sub.join("tmpfile").to_str().unwrap(),
            "symbolic link",
        ],
    );
    let left = names_in(&root_dir);
    assert_eq!(left, ["tmpfile"], "the root-only directory changed");
    assert_eq!(
        std::fs::read_to_string(&root_file).unwrap(),
        "root's file\n"
    );
    let md = root_file.metadata().unwrap();
    assert_eq!((md.uid(), md.mode() & 0o7777), (0, 0o600));
}

/// A user who owns the image directory puts symbolic links to a root file under the names the
/// checkpoint writes: the checkpoint must not write through them.
#[test]
fn checkpoint_does_not_write_through_links_in_the_image_directory() {
    let d = scratch("security_files", "image-links");
    let home = user_dir(&d.join("home"));
    let img = user_dir(&d.join("img"));
    let partial_target = root_secret(&d.join("root-only"), "partial", "root's partial\n");
    let final_target = root_secret(&d.join("root-only"), "final", "root's final\n");
    std::os::unix::fs::symlink(&partial_target, img.join("image.ferry.partial")).unwrap();
    std::os::unix::fs::symlink(&final_target, img.join("image.ferry")).unwrap();
    let mut child = as_nobody(&home, "exec sleep 1000");
    checkpoint(&mut child, &img);
    assert_eq!(
        std::fs::read_to_string(&partial_target).unwrap(),
        "root's partial\n"
    );
    assert_eq!(
        std::fs::read_to_string(&final_target).unwrap(),
        "root's final\n"
    );
    let md = std::fs::symlink_metadata(img.join("image.ferry")).unwrap();
    assert!(md.is_file(), "the image is not a file of its own");
    assert_eq!((md.uid(), md.mode() & 0o777), (0, 0o600));
    assert!(!img.join("image.ferry.partial").exists());
}

/// Images hold a process's memory: only root reads them.
#[test]
fn images_are_0600_in_a_0700_directory() {
    let d = scratch("security_files", "modes");
    let home = user_dir(&d.join("home"));
    // A directory Ferry makes is 0700.
    let mut child = as_nobody(&home, "exec sleep 1000");
    let img = d.join("new").join("img");
    checkpoint(&mut child, &img);
    assert_eq!(img.metadata().unwrap().mode() & 0o777, 0o700);
    assert_eq!(
        img.join("image.ferry").metadata().unwrap().mode() & 0o777,
        0o600
    );
    // A directory that exists is left as it is; the image in it is still 0600.
    let mut child = as_nobody(&home, "exec sleep 1000");
    let existing = d.join("existing");
    std::fs::create_dir(&existing).unwrap();
    std::fs::set_permissions(&existing, PermissionsExt::from_mode(0o755)).unwrap();
    checkpoint(&mut child, &existing);
    assert_eq!(existing.metadata().unwrap().mode() & 0o777, 0o755);
    assert_eq!(
        existing.join("image.ferry").metadata().unwrap().mode() & 0o777,
        0o600
    );
}

/// On another machine the same path names another inode: a file there is the one captured if
/// it holds what the captured one held (its SHA-256, recorded at checkpoint), as a mapping or
/// a descriptor; a file of the same size with other contents is refused, naming it.
#[test]
fn restore_takes_a_file_with_the_captured_contents_under_another_inode() {
    let d = scratch("security_files", "contents");
    let home = user_dir(&d.join("home"));
    let data = home.join("data");
    let put = |text: &str| {
        // Written aside and renamed into place: a new inode, as another machine's copy.
        let aside = home.join("data.new");
        std::fs::write(&aside, text).unwrap();
        std::os::unix::fs::chown(&aside, Some(NOBODY), Some(NOBODY)).unwrap();
        std::fs::rename(&aside, &data).unwrap();
        data.metadata().unwrap().ino()
    };
    let first = put(&"page of mine\n".repeat(400));
    // Kept, so that its inode number is not given to a later file.
    std::fs::hard_link(&data, home.join("captured")).unwrap();
    let mut child = run_as_nobody(
        &home,
        "/usr/bin/python3",
        &[
            "-c",
            "import mmap, time\nf = open('data', 'r+b')\nm = mmap.mmap(f.fileno(), 0)\n\
             open('ready', 'w').close()\ntime.sleep(1000)",
        ],
        "python3",
    );
    wait_ready(&mut child, &home.join("ready"), "python3 mapping its file");
    let pid = child.id();
    let img = d.join("img");
    checkpoint(&mut child, &img);

    // Other contents, the same size: refused.
    put(&"page of MINE\n".repeat(400));
    let err = restore_refused(&img, pid);
    assert_mentions(
        &err,
        &[
            &format!("PID {pid}"),
            data.to_str().unwrap(),
            "its contents differ from the file captured",
        ],
    );
    // The same contents under another inode: taken, as descriptor and mapping.
    let second = put(&"page of mine\n".repeat(400));
    assert_ne!(first, second);
    let (ok, out, err) = ferry(&["restore", "--dir", img.to_str().unwrap()]);
    assert!(ok, "restore failed: {err}");
    assert_eq!(out.trim(), pid.to_string());
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
    assert!(
        maps.lines()
            .any(|l| l.ends_with(data.to_str().unwrap()) && l.contains(&format!(" {second} "))),
        "the restored process does not map {} (inode {second}):\n{maps}",
        data.display()
    );
}

/// A file larger than the freeze hashes itself (64 MiB) is hashed before the freeze, and is
/// taken under another inode as a small one is.
#[test]
fn a_large_file_is_known_by_its_contents_too() {
    let d = scratch("security_files", "large");
    let home = user_dir(&d.join("home"));
    let data = home.join("data");
    let contents: Vec<u8> = (0..(80u32 << 20) / 4)
        .flat_map(|i| i.to_le_bytes())
        .collect();
    let put = || {
        let aside = home.join("data.new");
        std::fs::write(&aside, &contents).unwrap();
        std::os::unix::fs::chown(&aside, Some(NOBODY), Some(NOBODY)).unwrap();
        std::fs::rename(&aside, &data).unwrap();
        data.metadata().unwrap().ino()
    };
    let first = put();
    std::fs::hard_link(&data, home.join("captured")).unwrap();
    let mut child = as_nobody(&home, "exec 3<data; exec sleep 1000");
    let pid = child.id();
    let img = d.join("img");
    checkpoint(&mut child, &img);
    let second = put();
    assert_ne!(first, second);
    let (ok, out, err) = ferry(&["restore", "--dir", img.to_str().unwrap()]);
    assert!(ok, "restore failed: {err}");
    assert_eq!(out.trim(), pid.to_string());
    let held = std::fs::metadata(format!("/proc/{pid}/fd/3")).map(|m| m.ino());
    let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
    assert_eq!(
        held.ok(),
        Some(second),
        "fd 3 is not the file now at {}",
        data.display()
    );
}

/// A restore that is not attacked works for the user's process: the file is opened with its
/// rights and it carries on with it.
#[test]
fn a_users_process_is_restored_with_its_files() {
    let d = scratch("security_files", "legit");
    let home = user_dir(&d.join("home"));
    let data = home.join("data");
    std::fs::write(&data, "mine\n").unwrap();
    std::os::unix::fs::chown(&data, Some(NOBODY), Some(NOBODY)).unwrap();
    let mut child = as_nobody(&home, "exec 3>>data; exec sleep 1000");
    let pid = child.id();
    let img = d.join("img");
    checkpoint(&mut child, &img);
    let (ok, out, err) = ferry(&["restore", "--dir", img.to_str().unwrap()]);
    assert!(ok, "restore failed: {err}");
    assert_eq!(out.trim(), pid.to_string());
    let link = std::fs::read_link(format!("/proc/{pid}/fd/3")).unwrap();
    assert_eq!(link, data);
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    assert!(
        status
            .lines()
            .any(|l| l.starts_with("Uid:") && l.contains("65534")),
        "{status}"
    );
    let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
}

/// The owner of a process with a UNIX socket bound to a path replaces the socket's directory
/// with a link into a root-only directory: the restore must not make the socket file there.
#[test]
fn restore_does_not_bind_a_socket_through_a_linked_directory() {
    let d = scratch("security_files", "socket-dir");
    let home = user_dir(&d.join("home"));
    let sub = user_dir(&home.join("sub"));
    let root_dir = d.join("root-only");
    let root_file = root_secret(&root_dir, "secret", "root's secret\n");
    let sock = sub.join("sock");
    let script = format!(
        "import socket, time\ns = socket.socket(socket.AF_UNIX)\ns.bind({:?})\ns.listen()\n\
         open('ready', 'w').close()\ntime.sleep(1000)\n",
        sock.to_str().unwrap()
    );
    let mut child = run_as_nobody(&home, "python3", &["-c", &script], "python3");
    let pid = child.id();
    wait_ready(&mut child, &home.join("ready"), "the user's server");
    let img = d.join("img");
    checkpoint(&mut child, &img);

    swap_for_link(&sub, &root_dir);
    let err = restore_refused(&img, pid);
    assert_mentions(
        &err,
        &[&format!("PID {pid}"), sock.to_str().unwrap(), "uid 65534"],
    );
    let left = names_in(&root_dir);
    assert_eq!(left, ["secret"], "the root-only directory changed");
    assert_eq!(
        std::fs::read_to_string(&root_file).unwrap(),
        "root's secret\n"
    );
}

/// The owner of a process replaces its working directory with a link into a root-only
/// directory: the rebuilt process (which enters it while it still has root's rights) must not
/// end up there.
#[test]
fn restore_does_not_enter_a_working_directory_through_a_link() {
    let d = scratch("security_files", "cwd");
    let home = user_dir(&d.join("home"));
    let sub = user_dir(&home.join("sub"));
    let root_dir = d.join("root-only");
    root_secret(&root_dir, "secret", "root's secret\n");
    let mut child = as_nobody(&home, "cd sub && exec sleep 1000");
    let pid = child.id();
    let img = d.join("img");
    checkpoint(&mut child, &img);

    swap_for_link(&sub, &root_dir);
    let err = restore_refused(&img, pid);
    assert_mentions(
        &err,
        &[
            &format!("PID {pid}"),
            "working directory",
            sub.to_str().unwrap(),
        ],
    );
}

/// The owner of a process watching a directory with inotify replaces a directory on the
/// watch's path with a link into a root-only directory: the restore must not watch root's
/// directory for them (the events would tell them its file names).
#[test]
fn restore_does_not_watch_through_a_linked_directory() {
    let d = scratch("security_files", "inotify");
    let home = user_dir(&d.join("home"));
    let sub = user_dir(&home.join("sub"));
    let watched = user_dir(&sub.join("inner"));
    let root_dir = d.join("root-only");
    root_secret(&root_dir, "secret", "root's secret\n");
    let root_inner = root_dir.join("inner");
    std::fs::create_dir(&root_inner).unwrap();
    std::fs::set_permissions(&root_inner, PermissionsExt::from_mode(0o700)).unwrap();
    let script = format!(
        "import ctypes, time\nlibc = ctypes.CDLL(None, use_errno=True)\n\
         fd = libc.inotify_init1(0)\nassert fd >= 0\n\
         assert libc.inotify_add_watch(fd, {:?}.encode(), 0x100) >= 0\n\
         open('ready', 'w').close()\ntime.sleep(1000)\n",
        watched.to_str().unwrap()
    );
    let mut child = run_as_nobody(&home, "python3", &["-c", &script], "python3");
    let pid = child.id();
    wait_ready(&mut child, &home.join("ready"), "the user's watcher");
    let img = d.join("img");
    checkpoint(&mut child, &img);

    swap_for_link(&sub, &root_dir);
    let err = restore_refused(&img, pid);
    assert_mentions(
        &err,
        &["inotify watch", watched.to_str().unwrap(), "uid 65534"],
    );
}

/// A chrooted process of nobody's: its owner replaces the directory it is chrooted in with a
/// link into a root-only directory. The rebuilt process (which changes its root while it still
/// has root's rights) must not end up with root's directory as its root.
#[test]
fn restore_does_not_chroot_through_a_link() {
    let d = scratch("security_files", "chroot");
    let home = user_dir(&d.join("home"));
    let jail = user_dir(&home.join("jail"));
    let root_dir = d.join("root-only");
    root_secret(&root_dir, "secret", "root's secret\n");
    // Chrooted by root, then nobody (python is loaded by then and needs no file to sleep); its
    // working directory stays outside, as chroot leaves it.
    let script = format!(
        "import os, time\nos.chroot({:?})\nos.setgroups([])\n\
         os.setgid(65534)\nos.setuid(65534)\nopen('/ready', 'w').close()\ntime.sleep(1000)\n",
        jail.to_str().unwrap()
    );
    let mut child = Command::new("python3")
        .args(["-c", &script])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the chrooted process");
    let pid = child.id();
    wait_ready(&mut child, &jail.join("ready"), "the chrooted process");
    let img = d.join("img");
    checkpoint(&mut child, &img);

    swap_for_link(&jail, &root_dir);
    let err = restore_refused(&img, pid);
    assert_mentions(&err, &[&format!("PID {pid}"), jail.to_str().unwrap()]);
}
