//! Fuzz targets for the image reader: the stream's framing and records
//! (`ferry_image::ImageReader`, as `ferry image show` reads an image) and the restore's
//! [`open`] (header, tree, consistency check). An image is data anyone could have written:
//! whatever the bytes, reading must end in an answer (the image, or an error), never a panic,
//! and a tree that passes the check must be safe to index as restore and `ferry image show`
//! index it.
//!
//! The inputs are edits of valid seeds: a real image (a small python3 tree with a pipe, a
//! socket pair, a TCP listener and an epoll, captured by the engine, its memory cut down) and
//! a synthetic image holding one of every kind of file. Edits are applied to the bytes, with
//! or without the records' checksums recomputed afterwards, or to the decoded tree itself (its
//! CBOR values), re-encoded and resealed. Each target runs for a few seconds under `cargo
//! test` (see `crates/ferry-fuzz`).

use bolero::TypeGenerator;
use ciborium::Value;
use ferry_engine::checkpoint::capture;
use ferry_engine::freeze::FrozenTree;
use ferry_engine::restore::open;
use ferry_fuzz::{apply, image_records, replace_payload, reseal_image, Edit, Interesting};
use ferry_image::stream::ObjectRef;
use ferry_image::*;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

const RUN: Duration = Duration::from_secs(3);

/// The seeds, made once per test binary.
fn seeds() -> &'static [Vec<u8>] {
    static SEEDS: OnceLock<Vec<Vec<u8>>> = OnceLock::new();
    SEEDS.get_or_init(|| vec![real_image(), synthetic_image()])
}

/// A real image: python3 holding a pipe with bytes in it, a socket pair, a TCP listener and an
/// epoll, captured by the engine; its memory is cut down to a few pages (the reader does not
/// care what the pages are, and the targets run faster).
fn real_image() -> Vec<u8> {
    let script = "import os,select,socket,sys,time\n\
                  r,w=os.pipe(); os.write(w,b'buffered')\n\
                  a,b=socket.socketpair()\n\
                  l=socket.socket(); l.bind(('127.0.0.1',0)); l.listen()\n\
                  e=select.epoll(); e.register(a.fileno(), select.EPOLLIN)\n\
                  print('ready', flush=True)\n\
                  time.sleep(1000)\n";
    let mut child = Command::new("python3")
        .args(["-c", script])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .expect("start python3");
    let mut line = String::new();
    BufReader::new(child.stdout.as_mut().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line, "ready\n");
    let frozen = FrozenTree::freeze(child.id() as i32).expect("freeze python3");
    let (full, _) = capture(&frozen, Vec::new()).expect("capture python3");
    frozen.kill();
    let _ = child.wait();
    // Copied record by record, memory cut to the first page of a few records.
    let mut r = ImageReader::new(&full[..]).unwrap();
    let mut w = ImageWriter::new(Vec::new()).unwrap();
    let mut pages = 0;
    while let Some(rec) = r.next_record().unwrap() {
        match rec {
            Record::Tree(t) => w.write_tree(&t).unwrap(),
            Record::Pages { pid, addr, data } if pages < 3 => {
                pages += 1;
                w.write_pages(pid, addr, &data[..data.len().min(4096)])
                    .unwrap()
            }
            Record::Pages { .. } => {}
            Record::Object {
                object,
                offset,
                data,
            } => w
                .write_object(object, offset, &data[..data.len().min(4096)])
                .unwrap(),
            Record::End { .. } => {}
        }
    }
    w.finish().unwrap().0
}

/// An image whose tree holds one of every kind of file and mapping, with pages and objects.
fn synthetic_image() -> Vec<u8> {
    let thread = |tid| Thread {
        tid,
        comm: "t".into(),
        gp_regs: vec![0; validate::GP_REGS_WORDS],
        xstate: vec![0; 64],
        pending: vec![SigInfo(vec![0; 128])],
        ..Default::default()
    };
    let kinds = vec![
        FileKind::Unknown,
        FileKind::Regular {
            path: "/etc/hostname".into(),
            size: 10,
            ghost: None,
        },
        FileKind::Regular {
            path: "/tmp/gone".into(),
            size: 5,
            ghost: Some(0),
        },
        FileKind::Directory {
            path: "/".into(),
            removed: false,
        },
        FileKind::Device {
            path: "/dev/null".into(),
            rdev: 0x103,
            terminal: None,
            kmsg_seq: None,
        },
        FileKind::Device {
            path: "/dev/console".into(),
            rdev: 0x501,
            terminal: Some(0x440),
            kmsg_seq: None,
        },
        FileKind::Device {
            path: "/dev/kmsg".into(),
            rdev: 0x10b,
            terminal: None,
            kmsg_seq: Some(1234),
        },
        FileKind::Pipe { pipe: 0 },
        FileKind::EventFd {
            count: 3,
            semaphore: true,
        },
        FileKind::Memfd { object: 0 },
        FileKind::Epoll(EpollDesc {
            items: vec![EpollItem {
                fd: 5,
                events: 1,
                data: 9,
                pid: 100,
            }],
        }),
        FileKind::Timerfd(TimerfdDesc::default()),
        FileKind::Signalfd(SignalfdDesc { sigmask: 2 }),
        FileKind::Inotify(InotifyDesc {
            watches: vec![InotifyWatch {
                wd: 1,
                path: "/tmp".into(),
                mask: 2,
                handle: vec![1, 2, 3],
                ..Default::default()
            }],
        }),
        FileKind::Socket(SocketDesc::default()),
        FileKind::Tty(TtyDesc {
            index: 3,
            master: true,
            state: Some(PtyState {
                input: b"typed".to_vec(),
                ..Default::default()
            }),
            relayed: None,
        }),
        FileKind::PathOnly {
            path: "/dev/null".into(),
        },
        FileKind::Pidfd { pid: 101 },
        FileKind::ProcFile {
            pid: 101,
            rest: "/status".into(),
        },
        FileKind::Fanotify(ferry_image::FanotifyDesc {
            flags: 3,
            event_flags: 0x8000,
            marks: vec![ferry_image::FanotifyMark {
                path: "/tmp".into(),
                mask: 2,
                handle: vec![4, 5],
                ..Default::default()
            }],
        }),
    ];
    let files: Vec<FileDesc> = kinds
        .into_iter()
        .enumerate()
        .map(|(i, kind)| FileDesc {
            id: i as u32,
            flags: 2,
            pos: 1,
            kind,
            locks: vec![FileLock {
                kind: LockKind::Flock,
                write: true,
                start: 0,
                end: None,
            }],
            identity: (i % 2 == 1).then(FileIdentity::default),
            owner: (i % 3 == 0).then_some(ferry_image::FileOwner {
                kind: ferry_image::OwnerKind::Group,
                pid: 100,
            }),
            io_signal: if i % 3 == 0 { 35 } else { 0 },
        })
        .collect();
    let fds = (0..files.len() as u32)
        .map(|i| Fd {
            fd: i as i32,
            file: i,
            cloexec: i % 2 == 0,
            posix_locks: vec![],
        })
        .collect();
    let vma = |start: u64, backing| Vma {
        start,
        end: start + 0x2000,
        prot: 3,
        backing,
        ..Default::default()
    };
    let tree = Tree {
        root_pid: 100,
        processes: vec![
            Process {
                pid: 100,
                comm: "root".into(),
                exe: "/bin/sh".into(),
                cwd: "/".into(),
                root: "/".into(),
                rlimits: vec![Rlimit {
                    resource: 7,
                    cur: 1024,
                    max: 4096,
                }],
                vmas: vec![
                    vma(0x10000, Backing::Anonymous),
                    vma(
                        0x20000,
                        Backing::File {
                            path: "/bin/sh".into(),
                            dev: 1,
                            ino: 2,
                            size: 3,
                            ghost: None,
                        },
                    ),
                    vma(0x30000, Backing::Shmem { object: 0 }),
                    vma(0x40000, Backing::Vdso),
                    // Two completions, wrapping round the ring's end.
                    vma(
                        0x50000,
                        Backing::AioRing(AioRing {
                            nr: 255,
                            head: 254,
                            tail: 1,
                            events: vec![7; 64],
                            ..Default::default()
                        }),
                    ),
                ],
                threads: vec![thread(100), thread(102)],
                sigactions: vec![SigAction::default(); 64],
                fds,
                shared_pending: vec![SigInfo(vec![0; 128])],
                seccomp: vec![SeccompFilter {
                    program: vec![0; 8],
                    flags: 0,
                }],
                ..Default::default()
            },
            Process {
                pid: 101,
                ppid: 100,
                zombie_status: Some(0),
                ..Default::default()
            },
        ],
        files,
        pipes: vec![Pipe {
            buffered: b"in the pipe".to_vec(),
            packets: vec![11],
            ..Default::default()
        }],
        shmem: vec![ShmemObject {
            size: 0x2000,
            ..Default::default()
        }],
        ghosts: vec![GhostFile {
            path: "/tmp/gone".into(),
            size: 5,
            ..Default::default()
        }],
        clocks: Some(Clocks::default()),
        ..Default::default()
    };
    validate(&tree).expect("the synthetic tree is consistent");
    let mut w = ImageWriter::new(Vec::new()).unwrap();
    w.write_tree(&tree).unwrap();
    w.write_object(ObjectRef::Shmem(0), 0, &[7; 100]).unwrap();
    w.write_object(ObjectRef::Ghost(0), 0, b"ghost").unwrap();
    w.write_pages(100, 0x10000, &[1; 4096]).unwrap();
    w.finish().unwrap().0
}

/// What `ferry image show` and a restore index once the tree is checked: a tree that passes
/// [`validate`] must hold all of it.
fn index_as_readers_do(t: &Tree) {
    for p in &t.processes {
        if p.zombie_status.is_some() {
            continue;
        }
        for th in &p.threads {
            let _ = th.gp_regs[validate::GP_REG_RIP];
            let _ = ferry_sys_regs(&th.gp_regs);
            for si in &th.pending {
                let _ = si.signo();
            }
        }
        for si in &p.shared_pending {
            let _ = si.signo();
        }
        for v in &p.vmas {
            match &v.backing {
                Backing::Shmem { object } => {
                    let _ = &t.shmem[*object as usize];
                }
                Backing::File { ghost: Some(g), .. } => {
                    let _ = &t.ghosts[*g as usize];
                }
                Backing::AioRing(r) => {
                    // What the restore writes into the ring's slots lies within the mapping.
                    let pending = (r.tail as u64 + r.nr as u64 - r.head as u64) % r.nr as u64;
                    let _ = &r.events[..(pending * 32) as usize];
                    assert!(v.start + 32 + r.nr as u64 * 32 <= v.end);
                }
                _ => {}
            }
        }
        for fd in &p.fds {
            match &t.files[fd.file as usize].kind {
                FileKind::Pipe { pipe } => {
                    let _ = &t.pipes[*pipe as usize];
                }
                FileKind::Memfd { object } => {
                    let _ = &t.shmem[*object as usize];
                }
                FileKind::Regular { ghost: Some(g), .. } => {
                    let _ = &t.ghosts[*g as usize];
                }
                _ => {}
            }
        }
    }
}

/// The registers as the restore turns them into the kernel's structure.
fn ferry_sys_regs(words: &[u64]) -> usize {
    assert_eq!(words.len(), validate::GP_REGS_WORDS);
    words.len()
}

/// Everything that reads an image, on `bytes`: the restore's `open`, then the stream read to
/// its end as `ferry image show` reads it (data in pieces, each record checked at its end).
/// Errors are fine; panics are findings.
fn read_image(bytes: &[u8]) {
    if let Ok(img) = open(bytes) {
        validate(&img.tree).expect("open returned a tree that does not validate");
        index_as_readers_do(&img.tree);
    }
    let Ok(mut r) = ImageReader::new(bytes) else {
        return;
    };
    if r.read_tree().is_err() {
        return;
    }
    let mut buf = [0u8; 1000];
    while let Ok(Some(item)) = r.next_item() {
        let mut left = match item {
            Item::Pages { len, .. } | Item::Object { len, .. } => len,
            Item::Tree(_) => return,
            Item::End { .. } => continue,
        };
        while left > 0 {
            let n = left.min(buf.len() as u64) as usize;
            if r.read_data(&mut buf[..n]).is_err() {
                return;
            }
            left -= n as u64;
        }
        if r.end_record().is_err() {
            return;
        }
    }
}

#[derive(Debug, TypeGenerator)]
struct ByteEdits {
    seed: u8,
    edits: Vec<Edit>,
    /// Recompute the records' checksums after the edits.
    reseal: bool,
}

#[test]
fn seeds_are_read_whole() {
    for s in seeds() {
        let img = open(&s[..]).expect("a seed does not open");
        index_as_readers_do(&img.tree);
        read_image(s);
    }
}

#[test]
fn fuzz_image_bytes() {
    let seeds = seeds();
    bolero::check!()
        .with_type::<ByteEdits>()
        .with_test_time(RUN)
        .with_shrink_time(Duration::from_secs(10))
        .for_each(|e| {
            let edits = &e.edits[..e.edits.len().min(1 + e.seed as usize / 2 % 4)];
            let mut b = apply(&seeds[e.seed as usize % seeds.len()], edits);
            if e.reseal {
                reseal_image(&mut b);
            }
            read_image(&b);
        });
}

/// An edit of one value of the decoded tree (the `at`-th, counting every value of the CBOR
/// tree depth first).
#[derive(Debug, TypeGenerator)]
struct ValueEdit {
    at: u32,
    op: ValueOp,
}

#[derive(Debug, TypeGenerator)]
enum ValueOp {
    Integer(Interesting, bool),
    /// Keeps only the first `n` items of an array, bytes or text.
    Truncate(u8),
    /// Repeats the first item of an array.
    Repeat,
    /// Swaps in a value of another type.
    Null,
    Text(String),
}

fn count(v: &Value) -> usize {
    1 + match v {
        Value::Array(a) => a.iter().map(count).sum(),
        Value::Map(m) => m.iter().map(|(k, v)| count(k) + count(v)).sum(),
        Value::Tag(_, v) => count(v),
        _ => 0,
    }
}

/// Applies `op` to the `at`-th value of `v` (depth first); returns how many values it passed.
fn edit_value(v: &mut Value, at: usize, op: &ValueOp) -> usize {
    if at == 0 {
        match (op, &mut *v) {
            (ValueOp::Integer(i, negative), _) => {
                let n = i.value_u64();
                *v = Value::Integer(if *negative {
                    (-1 - (n >> 1) as i128).try_into().unwrap_or(0i64.into())
                } else {
                    n.into()
                });
            }
            (ValueOp::Truncate(n), Value::Array(a)) => a.truncate(*n as usize),
            (ValueOp::Truncate(n), Value::Bytes(b)) => b.truncate(*n as usize),
            (ValueOp::Truncate(n), Value::Text(t)) => {
                let keep: String = t.chars().take(*n as usize).collect();
                *t = keep;
            }
            (ValueOp::Repeat, Value::Array(a)) if !a.is_empty() => {
                let first = a[0].clone();
                a.push(first);
            }
            (ValueOp::Null, _) => *v = Value::Null,
            (ValueOp::Text(s), _) => *v = Value::Text(s.clone()),
            _ => {}
        }
        return usize::MAX;
    }
    let mut passed = 1;
    let visit = |child: &mut Value, passed: &mut usize| -> bool {
        let n = edit_value(child, at - *passed, op);
        if n == usize::MAX {
            return true;
        }
        *passed += n;
        false
    };
    match v {
        Value::Array(a) => {
            for c in a {
                if visit(c, &mut passed) {
                    return usize::MAX;
                }
            }
        }
        Value::Map(m) => {
            for (k, c) in m {
                if visit(k, &mut passed) || visit(c, &mut passed) {
                    return usize::MAX;
                }
            }
        }
        Value::Tag(_, c) => {
            let found = visit(c, &mut passed);
            if found {
                return usize::MAX;
            }
        }
        _ => {}
    }
    passed
}

trait ValueU64 {
    fn value_u64(self) -> u64;
}

impl ValueU64 for Interesting {
    fn value_u64(self) -> u64 {
        match self {
            Interesting::Zero => 0,
            Interesting::One => 1,
            Interesting::Max => u64::MAX,
            Interesting::Min => 1 << 31,
            Interesting::Half => u32::MAX as u64,
            Interesting::Small(n) => n as u64,
            Interesting::Any(n) => n,
        }
    }
}

#[derive(Debug, TypeGenerator)]
struct TreeEdits {
    seed: u8,
    edits: Vec<ValueEdit>,
}

#[test]
fn fuzz_image_tree_values() {
    let seeds = seeds();
    // Each seed's tree record, decoded.
    let trees: Vec<(Vec<u8>, usize, std::ops::Range<usize>, Value)> = seeds
        .iter()
        .map(|s| {
            let (at, _, range) = image_records(s)[0].clone();
            let v: Value = ciborium::from_reader(&s[range.clone()]).unwrap();
            (s.clone(), at, range, v)
        })
        .collect();
    bolero::check!()
        .with_type::<TreeEdits>()
        .with_test_time(RUN)
        .with_shrink_time(Duration::from_secs(10))
        .for_each(|e| {
            let (seed, at, range, value) = &trees[e.seed as usize % trees.len()];
            let mut v = value.clone();
            // A few edits at a time: a tree with one or two things wrong gets furthest.
            for edit in e.edits.iter().take(1 + e.seed as usize / 2 % 3) {
                let n = count(&v);
                edit_value(&mut v, edit.at as usize % n, &edit.op);
            }
            let mut payload = Vec::new();
            ciborium::into_writer(&v, &mut payload).unwrap();
            let mut b = seed.clone();
            replace_payload(&mut b, *at, range.clone(), &payload);
            reseal_image(&mut b);
            read_image(&b);
        });
}
