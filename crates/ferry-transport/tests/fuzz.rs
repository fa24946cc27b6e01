//! Fuzz targets for what a peer sends: frames (`[length u32 BE][kind u8][payload]`), the
//! messages inside them (CBOR), and a stream of data frames read as bytes (`DataReader`, as
//! the restore worker reads an image). Whatever a peer sends, reading ends in a frame, a
//! message or an error, never a panic, and never allocates more than one frame's limit.
//!
//! The inputs are edits of real frames: every message the daemons exchange, written by the
//! transport's own writers, data frames and an end frame. Edits are applied to a whole
//! conversation, or to one message's CBOR with the frame's length fixed after them, so that
//! the edited message reaches the decoder. Each target runs for a few seconds under `cargo
//! test` (see `crates/ferry-fuzz`).

use bolero::TypeGenerator;
use ferry_fuzz::{apply, Edit};
use ferry_policy::NodeLoad;
use ferry_transport::frame::blocking::{self, DataReader};
use ferry_transport::message::*;
use ferry_transport::{read_frame, Frame, FrameError, Msg};
use serde_bytes::ByteBuf;
use std::io::Read;
use std::time::Duration;

const RUN: Duration = Duration::from_secs(3);

/// One of every message, with realistic contents.
fn messages() -> Vec<Msg> {
    let spec = RunSpec {
        argv: vec!["sh".into(), "-c".into(), "echo hi".into()],
        env: vec![("PATH".into(), "/usr/bin:/bin".into())],
        cwd: "/tmp".into(),
        umask: 0o22,
        uid: 1000,
        gid: 1000,
        groups: vec![1000, 27],
        rlimits: vec![(7, 1024, 4096), (0, u64::MAX, u64::MAX)],
        tty: Some((24, 80)),
        home_node: "a".into(),
        home_pid: 4242,
        target: Some("b".into()),
        elsewhere: false,
        stderr_tty: true,
        sig_ignored: 1 << 12,
        sig_blocked: 0,
        balance: false,
        checkpoint_every_secs: None,
    };
    let proc_info = ProcInfo {
        home_node: "a".into(),
        node: "b".into(),
        home_pid: 10,
        pid: 20,
        uid: 0,
        command: "sleep 100".into(),
        state: "running".into(),
        kind: "migrated".into(),
        since_unix_ms: 1_700_000_000_000,
        home_ids: None,
        forwarded_calls: 3,
        forwarded_us: 40,
        checkpoint_every_secs: Some(2.5),
        recovered: Some("after node c died; passed over: d: full".into()),
        deputies: Vec::new(),
    };
    vec![
        Msg::Hello { node: "a".into() },
        Msg::Gossip {
            packet: ByteBuf::from(vec![1, 2, 3, 250, 0]),
        },
        Msg::MigrateOffer(MigrateOffer {
            id: 7,
            from_node: "a".into(),
            home_node: "a".into(),
            home_pid: 10,
            command: "python3".into(),
            uid: 0,
            memory_bytes: 1 << 30,
            since_unix_ms: 1,
            home_ids: Some(HomeIds {
                hostname: "a".into(),
                ppid: 9,
                pgid: 9,
                sid: 8,
            }),
            compress: vec!["lz4".into()],
            lazy: true,
            in_place: true,
            recovered: Some("after node b died".into()),
            machine_bound: Some(Box::new(MachineBound {
                boot_id: "87299fff-a8d8-4a1d-bba7-fa7becc7a01c".into(),
                what: "PID 10 fd 3 (/dev/console)".into(),
            })),
        }),
        Msg::Accept,
        Msg::PageWant {
            pid: 10,
            addr: 0x7f00_0000_0000,
            len: 4096,
            id: 3,
            holes: true,
        },
        Msg::PageReply {
            id: 3,
            holes: vec![(0x7f00_0000_1000, 0x7f00_0000_3000)],
            all_holes: false,
        },
        Msg::PageError {
            message: "gone".into(),
            id: 3,
        },
        Msg::AcceptCompressed {
            codec: "lz4".into(),
        },
        Msg::Refused {
            reason: "full".into(),
        },
        Msg::Rebuilt(Rebuilt {
            pid: 33,
            load_ms: 1.5,
            restore_ms: 2.5,
            relays: vec![(1, 40)],
            relay_names: vec![ferry_transport::message::RelayName {
                relay: 1 << 30 | 3,
                line: "12 0100 - 9\n".into(),
            }],
            timeline: vec![ferry_transport::message::Stamp::now("rebuilt")],
        }),
        Msg::RelayOpen {
            pid: 7,
            pipe: 1,
            at: None,
        },
        Msg::RelayOpen {
            pid: 7,
            pipe: 1,
            at: Some(4096),
        },
        Msg::RelayAt { at: 9 },
        Msg::RelayAck { at: 10 },
        Msg::RelayJoin { token: 11 },
        Msg::RelayMarks {
            relays: vec![(3, 4096)],
        },
        Msg::Commit,
        Msg::Resumed,
        Msg::Abort {
            reason: "no".into(),
        },
        Msg::OutcomeQuery { id: 7 },
        Msg::Outcome {
            id: 7,
            committed: true,
        },
        Msg::Run(spec),
        Msg::Started {
            node: "b".into(),
            pid: 99,
        },
        Msg::Io {
            stream: 1,
            data: ByteBuf::from(b"output".to_vec()),
        },
        Msg::IoEnd { stream: 0 },
        Msg::Signal { signal: 2 },
        Msg::Resize {
            rows: 50,
            cols: 132,
        },
        Msg::Exited {
            code: Some(3),
            signal: None,
        },
        Msg::RunFailed {
            message: "nope".into(),
            exit_code: 127,
        },
        Msg::ListNodes,
        Msg::Nodes(vec![NodeInfo {
            name: "b".into(),
            addr: "127.0.0.12:7070".into(),
            state: "alive".into(),
            load: Some(NodeLoad {
                runnable: 1,
                cpus: 2,
                cpu_idle_pct: 99.5,
                free_memory_bytes: 1 << 34,
                console_idle_secs: Some(5),
                guests: 1,
                accepting: true,
                stale: false,
                ..Default::default()
            }),
        }]),
        Msg::ListProcesses,
        Msg::Processes(vec![proc_info.clone(), proc_info.clone()]),
        Msg::LocalProcesses,
        Msg::Cluster,
        Msg::LocalView,
        Msg::Checkpoint {
            pid: 42,
            dir: "/home/u/img".into(),
            leave_running: true,
            parent: Some("/home/u/base".into()),
            json: false,
        },
        Msg::Restore {
            dir: "/home/u/img".into(),
            pid_namespace: true,
            json: true,
        },
        Msg::Output {
            code: 1,
            stdout: b"out".to_vec().into(),
            stderr: b"err".to_vec().into(),
        },
        Msg::View(ferry_transport::message::ClusterView {
            node: "a".into(),
            taken_unix_ms: 1_700_000_000_000,
            nodes: Vec::new(),
            processes: vec![ferry_transport::message::ProcView {
                info: proc_info,
                cpu_pct: Some(12.5),
                run_state: Some("R".into()),
                cost: Some(ferry_transport::message::HomeCost {
                    pids: vec![10, 11],
                    body_node: "b".into(),
                    deputies: 2,
                    signals_forwarded: 3,
                    calls_forwarded: None,
                    bytes_relayed: Some(4096),
                }),
            }],
            home_costs: Vec::new(),
            unanswered: vec!["c".into()],
        }),
        Msg::Migrate {
            pid: 10,
            to: "c".into(),
            memory: "precopy".into(),
        },
        Msg::MemoryPlan(Box::new(ferry_transport::message::MemoryPlan {
            mode: "precopy".into(),
            reason: "asked".into(),
            rounds: vec![ferry_transport::message::PrecopyRound {
                dirty_bytes: 1 << 20,
                sent_bytes: 4096,
                ms: 1.5,
            }],
            setup_stop_ms: 2.0,
            inherited_bytes: 8192,
            frozen_bytes: 4096,
        })),
        Msg::SetAccepting { accepting: false },
        Msg::Done,
        Msg::Progress {
            phase: "transfer".into(),
            bytes: 1234,
        },
        Msg::Migrated(MigrateReport {
            pid: 10,
            from: "a".into(),
            to: "b".into(),
            ..Default::default()
        }),
        Msg::error("bad"),
        Msg::Movable {
            memory_bytes: 4096,
            uid: 0,
            command: "x".into(),
            in_place: false,
            lazy: false,
            machine: Some("PID 10 fd 3 (/dev/console)".into()),
        },
        Msg::Go,
        Msg::Frozen,
        Msg::Captured {
            image_bytes: 100,
            relays: vec![],
            timeline: vec![],
        },
        Msg::Kill,
        Msg::Killed,
        Msg::Thaw,
        Msg::Thawed,
        Msg::Resume,
    ]
}

/// Each message as a frame.
fn message_frames() -> Vec<Vec<u8>> {
    messages()
        .iter()
        .map(|m| {
            let mut b = Vec::new();
            blocking::write_msg(&mut b, m).unwrap();
            b
        })
        .collect()
}

/// A conversation: a few messages, a stream of data frames and its end, another message.
fn conversation() -> Vec<u8> {
    let f = message_frames();
    let mut b = Vec::new();
    b.extend_from_slice(&f[0]);
    b.extend_from_slice(&f[2]);
    blocking::write_data(&mut b, b"the image, cut into frames").unwrap();
    blocking::write_data(&mut b, &[0u8; 300]).unwrap();
    blocking::write_end(&mut b).unwrap();
    b.extend_from_slice(&f[5]);
    b
}

/// Reads every frame of `bytes`, blocking and async; then the bytes as one data stream.
fn read_all(bytes: &[u8], rt: &tokio::runtime::Runtime) {
    let mut r = bytes;
    let mut frames = 0;
    loop {
        match blocking::read_frame(&mut r) {
            Ok(Frame::Msg(m)) => {
                let _ = kind(&m);
            }
            Ok(_) => {}
            Err(_) => break,
        }
        frames += 1;
    }
    let mut r = bytes;
    let mut async_frames = 0;
    rt.block_on(async {
        while read_frame(&mut r).await.is_ok() {
            async_frames += 1;
        }
    });
    assert_eq!(
        frames, async_frames,
        "the blocking and async readers disagree"
    );
    let mut d = DataReader::new(bytes);
    let mut buf = [0u8; 100];
    while let Ok(n) = d.read(&mut buf) {
        if n == 0 {
            let _ = d.finish();
            break;
        }
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap()
}

#[test]
fn seeds_are_read_whole() {
    let rt = runtime();
    for (m, f) in messages().iter().zip(message_frames()) {
        match blocking::read_frame(&mut &f[..]) {
            Ok(Frame::Msg(back)) => assert_eq!(kind(&back), kind(m)),
            other => panic!("{m:?} came back as {other:?}"),
        }
    }
    let c = conversation();
    let mut r = &c[..];
    let mut n = 0;
    while !matches!(blocking::read_frame(&mut r), Err(FrameError::Closed)) {
        n += 1;
    }
    assert_eq!(n, 6);
    read_all(&c, &rt);
}

#[derive(Debug, TypeGenerator)]
struct ConversationEdits {
    edits: Vec<Edit>,
}

#[test]
fn fuzz_frames() {
    let seed = conversation();
    let rt = runtime();
    bolero::check!()
        .with_type::<ConversationEdits>()
        .with_test_time(RUN)
        .with_shrink_time(Duration::from_secs(10))
        .for_each(|e| read_all(&apply(&seed, &e.edits), &rt));
}

#[derive(Debug, TypeGenerator)]
struct MessageEdits {
    message: u8,
    edits: Vec<Edit>,
}

#[test]
fn fuzz_messages() {
    // Each message's CBOR, without its frame header.
    let payloads: Vec<Vec<u8>> = message_frames()
        .into_iter()
        .map(|f| f[5..].to_vec())
        .collect();
    bolero::check!()
        .with_type::<MessageEdits>()
        .with_test_time(RUN)
        .with_shrink_time(Duration::from_secs(10))
        .for_each(|e| {
            let payload = apply(&payloads[e.message as usize % payloads.len()], &e.edits);
            let mut frame = (payload.len() as u32).to_be_bytes().to_vec();
            frame.push(1);
            frame.extend_from_slice(&payload);
            if let Ok(Frame::Msg(m)) = blocking::read_frame(&mut &frame[..]) {
                // What decodes must encode again.
                let mut again = Vec::new();
                blocking::write_msg(&mut again, &m).unwrap();
                let _ = kind(&m);
            }
        });
}
