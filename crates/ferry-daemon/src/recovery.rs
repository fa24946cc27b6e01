//! Periodic checkpoints of the trees that left this home, and their recovery when the node
//! running them dies (MOSIX-4's checkpoint and recovery).
//!
//! With `checkpoint_every_secs` in the home's config (`ferry cluster up --checkpoint-every`),
//! the task serving a tree's deputies (crate::deputies::adopt) asks the body's node that often
//! for an image of the body (`CheckpointBody`): that node's capture worker freezes the body,
//! streams its image back in data frames and lets it run on (`Thaw`), as a migration that is
//! refused at the last moment would. The home keeps the last complete image in
//! `DATA_DIR/checkpoints/ROOT/image` (written to a temporary file, fsynced, renamed). When the
//! body's node is dead (`Node::is_dead`), the home rebuilds the tree from that image on itself,
//! in guest namespaces (its PIDs, its home's identity for the forwarded calls), as a guest of
//! kind `recovered`: its deputies stay, now for a body at home, so the parent's `wait` and
//! `kill HOMEPID` work on. Without an image, the deputies end as SIGKILL, as before.

use crate::node::Node;
use crate::workers::Worker;
use anyhow::{anyhow, bail, Context, Result};
use ferry_transport::message::{kind, ProcInfo};
use ferry_transport::{read_frame, read_msg, write_data, write_end, write_msg, Conn, Frame, Msg};
use std::path::PathBuf;
use std::sync::Arc;
use tokio::io::AsyncWriteExt;

/// Where the last image of the tree whose root is home PID `root` is kept.
pub fn image_path(node: &Node, root: i32) -> PathBuf {
    node.config
        .data_dir
        .join("checkpoints")
        .join(root.to_string())
        .join("image")
}

/// Forgets the image of `root` (its tree ended, or came back).
pub fn forget(node: &Node, root: i32) {
    if let Some(dir) = image_path(node, root).parent() {
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// Home side: asks `body_node` for an image of the body of home PID `root` and keeps it.
/// Returns its size.
pub async fn checkpoint(node: &Node, root: i32, body_node: &str) -> Result<u64> {
    let path = image_path(node, root);
    let dir = path.parent().expect("an image has a directory");
    {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .with_context(|| format!("create {}", dir.display()))?;
    }
    let mut conn = node.dial(body_node).await?;
    write_msg(&mut conn.stream, &Msg::CheckpointBody { pid: root }).await?;
    let tmp = dir.join("image.tmp");
    let mut f = tokio::fs::File::create(&tmp)
        .await
        .with_context(|| format!("create {}", tmp.display()))?;
    let mut size = 0u64;
    loop {
        match read_frame(&mut conn.stream)
            .await
            .map_err(|e| anyhow!("checkpoint of PID {root} from {body_node}: {e}"))?
        {
            Frame::Data(d) => {
                size += d.len() as u64;
                f.write_all(&d)
                    .await
                    .with_context(|| format!("write {}", tmp.display()))?;
            }
            Frame::End => break,
            Frame::Msg(Msg::Error { message }) => {
                bail!("node {body_node} could not checkpoint PID {root}: {message}")
            }
            Frame::Msg(other) => bail!("node {body_node} sent {} in an image", kind(&other)),
        }
    }
    match read_msg(&mut conn.stream).await {
        Ok(Msg::Done) => {}
        Ok(Msg::Error { message }) => {
            bail!("node {body_node} could not checkpoint PID {root}: {message}")
        }
        Ok(other) => bail!("node {body_node} answered {}", kind(&other)),
        Err(e) => bail!("node {body_node}: {e}"),
    }
    f.sync_all()
        .await
        .with_context(|| format!("sync {}", tmp.display()))?;
    drop(f);
    std::fs::rename(&tmp, &path)
        .with_context(|| format!("rename {} to {}", tmp.display(), path.display()))?;
    Ok(size)
}

/// Body side: `home` asks for an image of the body of its PID `pid` running here: captured by a
/// worker, streamed on `conn`, and the body runs on.
pub async fn serve_checkpoint(node: &Arc<Node>, conn: &mut Conn, pid: i32) -> Result<()> {
    let home = conn.peer.clone();
    let r = stream_body(node, conn, &home, pid).await;
    let reply = match &r {
        Ok(()) => Msg::Done,
        Err(e) => Msg::Error {
            message: format!("{e:#}"),
        },
    };
    write_msg(&mut conn.stream, &reply).await?;
    r
}

async fn stream_body(node: &Arc<Node>, conn: &mut Conn, home: &str, pid: i32) -> Result<()> {
    let host = node
        .bodies
        .host_pid(home, pid)
        .ok_or_else(|| anyhow!("no body of PID {pid} from {home} runs here"))?;
    let args = vec![
        "__capture-worker".to_string(),
        host.to_string(),
        "--memory".into(),
        "eager".into(),
    ];
    let mut worker = Worker::spawn(&node.exe, &args)?;
    match crate::migrate::worker_msg(&mut worker).await? {
        Msg::Movable { .. } => {}
        Msg::Error { message } => bail!("{message}"),
        other => bail!("capture worker said {}", kind(&other)),
    }
    write_msg(&mut worker.tx, &Msg::Go).await?;
    let streamed: Result<()> = async {
        loop {
            match worker
                .next_frame()
                .await
                .map_err(|e| anyhow!("capture worker: {e}"))?
            {
                Frame::Data(d) => write_data(&mut conn.stream, &d).await?,
                Frame::End => write_end(&mut conn.stream).await?,
                Frame::Msg(Msg::Captured { .. }) => return Ok(()),
                Frame::Msg(Msg::Error { message }) => bail!("{message}"),
                Frame::Msg(_) => {}
            }
        }
    }
    .await;
    // The body runs on, whatever became of its image.
    let _ = write_msg(&mut worker.tx, &Msg::Thaw).await;
    loop {
        match crate::migrate::worker_msg(&mut worker).await {
            Ok(Msg::Thawed) | Err(_) => break,
            Ok(Msg::Error { message }) => {
                tracing::warn!(event = "checkpoint-thaw-failed", pid, host, error = %message);
                break;
            }
            Ok(_) => continue,
        }
    }
    streamed
}

/// Home side: the node running the body of `root` is dead; its tree is rebuilt here from its
/// last image, in guest namespaces, and runs on as a guest of kind `recovered`. Returns the
/// new body's PID here. Err if there is no image or it cannot be rebuilt.
pub async fn recover(node: &Arc<Node>, root: i32, dead: &str) -> Result<i32> {
    let path = image_path(node, root);
    let image = tokio::fs::read(&path)
        .await
        .with_context(|| format!("no checkpoint of PID {root} ({})", path.display()))?;
    // The deputy still has the root's parent, group and session at home.
    let ids = crate::migrate::home_ids(root)
        .ok_or_else(|| anyhow!("the deputy of PID {root} is gone"))?;
    let reports = node.config.data_dir.join(crate::deputies::REPORT_SOCKET);
    let mut args = vec![
        "__restore-worker".to_string(),
        "--reports".to_string(),
        reports.to_string_lossy().into_owned(),
    ];
    if let Some(cg) = &node.config.cpu_cgroup {
        args.push("--cpu-cgroup".to_string());
        args.push(cg.to_string_lossy().into_owned());
    }
    args.push(format!("--hostname={}", ids.hostname));
    args.push(format!(
        "--home={} {} {} {}",
        root, ids.ppid, ids.pgid, ids.sid
    ));
    let mut worker = Worker::spawn(&node.exe, &args)?;
    let fed = async {
        write_data(&mut worker.tx, &image).await?;
        write_end(&mut worker.tx).await
    }
    .await;
    let rebuilt = match crate::migrate::worker_msg(&mut worker).await? {
        Msg::Rebuilt(r) => r,
        Msg::Error { message } => bail!("rebuild PID {root} from {}: {message}", path.display()),
        other => bail!("restore worker said {}", kind(&other)),
    };
    fed.map_err(|e| anyhow!("feed the restore worker: {e}"))?;
    write_msg(&mut worker.tx, &Msg::Resume).await?;
    match crate::migrate::worker_msg(&mut worker).await? {
        Msg::Resumed => {}
        Msg::Error { message } => bail!("resume PID {root}: {message}"),
        other => bail!("restore worker said {}", kind(&other)),
    }
    let status = std::fs::read_to_string(format!("/proc/{root}/status")).unwrap_or_default();
    let uid = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0);
    let command = std::fs::read(format!("/proc/{root}/cmdline"))
        .map(|c| {
            String::from_utf8_lossy(&c)
                .split('\0')
                .filter(|s| !s.is_empty())
                .collect::<Vec<_>>()
                .join(" ")
        })
        .unwrap_or_default();
    let me = node.name().to_string();
    let info = ProcInfo {
        home_node: me.clone(),
        node: me.clone(),
        home_pid: root,
        pid: rebuilt.pid,
        uid,
        command,
        state: "running".into(),
        kind: "recovered".into(),
        since_unix_ms: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0),
        home_ids: Some(ids),
        forwarded_calls: 0,
        forwarded_us: 0,
    };
    node.bodies.add(rebuilt.pid, &me, root);
    crate::deputies::watch_supervisor(node.clone(), rebuilt.pid);
    node.guests.add(info);
    tracing::warn!(event = "guest-recovered", root, pid = rebuilt.pid, dead = %dead,
        image = %path.display(), "rebuilt from its last checkpoint after its node died");
    Ok(rebuilt.pid)
}
