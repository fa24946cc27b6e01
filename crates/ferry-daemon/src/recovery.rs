//! Periodic checkpoints of the trees that left this home, and their recovery when the node
//! running them dies (MOSIX-4's checkpoint and recovery).
//!
//! With `checkpoint_every_secs` in the home's config (`ferry cluster up --checkpoint-every`),
//! the task serving a tree's deputies (crate::deputies::adopt) asks the body's node that often
//! for an image of the body (`CheckpointBody`): that node's capture worker freezes the body,
//! streams its image back in data frames and lets it run on (`Thaw`), as a migration that is
//! refused at the last moment would. The home keeps the last complete image in
//! `DATA_DIR/checkpoints/ROOT/image` (written to a temporary file, fsynced, renamed). When the
//! body's node is dead (`Node::is_dead`), the home rebuilds the tree from that image
//! ([`recover_anywhere`]) where its `recover_on` says ([`candidates`]: by default the other
//! live nodes whose gossiped load admits it, idlest first, each offered the tree as a migrating
//! guest and free to refuse it, the next tried then; else itself). Elsewhere, the image goes there as a
//! migration from the home would (`MigrateOffer`, the image, `Rebuilt`, the outcome decided
//! durably, `Commit`), and the tree runs there as an ordinary body of its home; here, it is
//! rebuilt in guest namespaces (its PIDs, its home's identity for the forwarded calls), as a
//! guest of kind `recovered`. Either way its deputies stay and follow the new body, so the
//! parent's `wait` and `kill HOMEPID` work on. Without an image, the deputies end as SIGKILL,
//! as before.
//!
//! **Exactly one survivor** ([`fence`]): a node taken for dead may only have been cut off or
//! frozen, its body running on. Before the home acts on the death, it records durably
//! (`FENCE`) the tree's PIDs and the dead node; the first time that node is live again, the
//! home has the whole body killed there (`FenceBody`: that node kills the init of the body's
//! guest PID namespace, which takes every process of it along, those the body forked after it
//! left home included), and forgets the record once the node has
//! answered. A node that knows no such body is asked to kill each recorded PID instead
//! (`SignalBody` SIGKILL).

use crate::node::Node;
use crate::outcomes::Outcome;
use crate::state;
use crate::workers::Worker;
use anyhow::{anyhow, bail, Context, Result};
use ferry_transport::message::{kind, MigrateOffer, ProcInfo};
use ferry_transport::{read_frame, read_msg, write_data, write_end, write_msg, Conn, Frame, Msg};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
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
    // What its relays have not had acknowledged stays until this image says where it stands.
    node.relays.hold_floor(root);
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
    let mut answer = read_msg(&mut conn.stream).await;
    let mut marks = Vec::new();
    if let Ok(Msg::RelayMarks { relays }) = &answer {
        marks = relays.clone();
        answer = read_msg(&mut conn.stream).await;
    }
    match answer {
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
    let offsets = RelayOffsets {
        image_bytes: size,
        relays: marks,
    };
    write_durably(&dir.join("relays.json"), &serde_json::to_vec(&offsets)?)?;
    node.relays.set_floor(root, &offsets.relays);
    Ok(size)
}

/// Where the relays of the body stood in the image of the same size (`RelayMarks`).
#[derive(Serialize, Deserialize)]
struct RelayOffsets {
    image_bytes: u64,
    relays: Vec<(u32, u64)>,
}

/// Writes `path` whole or not at all (a temporary file, fsynced, renamed).
fn write_durably(path: &std::path::Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_extension("tmp");
    {
        use std::io::Write as _;
        let mut f =
            std::fs::File::create(&tmp).with_context(|| format!("create {}", tmp.display()))?;
        f.write_all(bytes)
            .with_context(|| format!("write {}", tmp.display()))?;
        f.sync_all()
            .with_context(|| format!("sync {}", tmp.display()))?;
    }
    std::fs::rename(&tmp, path)
        .with_context(|| format!("rename {} to {}", tmp.display(), path.display()))
}

/// Where the relays of the last image of `root` stood (an image of `image_bytes`); empty if
/// not known for that image.
fn relay_offsets(node: &Node, root: i32, image_bytes: u64) -> Vec<(u32, u64)> {
    let path = image_path(node, root).with_file_name("relays.json");
    std::fs::read(&path)
        .ok()
        .and_then(|b| serde_json::from_slice::<RelayOffsets>(&b).ok())
        .filter(|o| o.image_bytes == image_bytes)
        .map(|o| o.relays)
        .unwrap_or_default()
}

/// Before the tree of `root` is rebuilt on `to` from its last image: its relays go there,
/// from where the image stands.
/// Relays still pumped for the dead node (their connections not known broken: a dead machine
/// says nothing) are cut first, and waited for up to 3 s.
async fn relink(node: &Arc<Node>, root: i32, dead: &str, to: &str, offsets: &[(u32, u64)]) {
    node.relays.cut_tree(root, dead);
    let mut missed = node.relays.rewind_tree(root, to, offsets, None);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(3);
    while !missed.is_empty() && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
        missed = node.relays.rewind_tree(root, to, offsets, Some(&missed));
    }
    if !missed.is_empty() {
        tracing::warn!(event = "relay-not-relinked", root, to = %to, relays = ?missed,
            "not waiting here, or not in the image: the rebuilt body sees end of file or EPIPE there");
    }
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
        .host_pid(home, pid, Some(pid))
        .ok_or_else(|| anyhow!("no body of PID {pid} from {home} runs here"))?;
    let mut args = vec![
        "__capture-worker".to_string(),
        host.to_string(),
        "--memory".into(),
        "eager".into(),
    ];
    if node.body_relays.joins.is_joined(home, pid) {
        bail!(
            "PID {pid} (home {home}) has a pipe whose other end is a body on this node, joined \
             with it here: such a body cannot be checkpointed yet (its pair's images would be \
             taken at different moments; docs/limitations.md)"
        );
    }
    // Its pipes' relays stop while it is captured (their stand-ins' contents go in the image,
    // and where each relay stands goes home with it); dropped, they go on.
    let paused = node.body_relays.pause(home, pid).await?;
    if let Some(r) = paused.two_way() {
        bail!(
            "PID {pid} (home {home}) holds a relayed terminal or socket (relay {r}): such a \
             body cannot be checkpointed yet (docs/limitations.md)"
        );
    }
    args.extend(paused.worker_args());
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
                Frame::Msg(Msg::Captured { .. }) => {
                    let relays = paused.offsets();
                    if !relays.is_empty() {
                        write_msg(&mut conn.stream, &Msg::RelayMarks { relays }).await?;
                    }
                    return Ok(());
                }
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
    drop(paused);
    streamed
}

/// Home side: the node running the body of `root` is dead; its tree is rebuilt here from its
/// last image, in guest namespaces, and runs on as a guest of kind `recovered`. Returns the
/// new body's PID here. Err if there is no image or it cannot be rebuilt.
/// `skipped`: the other nodes passed over for it, and why (for the log and `ferry ps`).
pub async fn recover(
    node: &Arc<Node>,
    root: i32,
    dead: &str,
    skipped: &[(String, String)],
) -> Result<i32> {
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
    // Its relays' stand-ins: attached to their home ends here, once it runs.
    let ends = crate::relay::take_from_worker(worker.pid, &rebuilt.relays)?;
    write_msg(&mut worker.tx, &Msg::Resume).await?;
    match crate::migrate::worker_msg(&mut worker).await? {
        Msg::Resumed => {}
        Msg::Error { message } => bail!("resume PID {root}: {message}"),
        other => bail!("restore worker said {}", kind(&other)),
    }
    let (uid, command) = deputy_identity(root);
    let me = node.name().to_string();
    crate::relay::dial_home(node.clone(), me.clone(), root, ends);
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
        checkpoint_every_secs: None,
        recovered: Some(note(dead, skipped)),
        deputies: Vec::new(),
    };
    node.bodies.add(rebuilt.pid, &me, root);
    crate::deputies::watch_supervisor(node.clone(), rebuilt.pid);
    node.guests.add(info);
    tracing::warn!(event = "guest-recovered", root, pid = rebuilt.pid, dead = %dead, node = %me,
        skipped = %said(skipped), image = %path.display(),
        "rebuilt from its last checkpoint after its node died");
    Ok(rebuilt.pid)
}

/// The owner and command line of the deputy `root` (the process's own, at home).
fn deputy_identity(root: i32) -> (u32, String) {
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
    (uid, command)
}

/// Where a tree whose body's node `dead` died may be rebuilt (`recover_on` in this home's
/// config), in the order to try them, and the nodes passed over with why. "idlest" (the
/// default): every other live node whose gossiped load the admission of a guest of `bytes`
/// would take (`ferry_policy::admit`: it accepts guests, its load is fresh, its memory holds
/// the image) and whose owner is away, idlest first; "home": none; a node's name: that node if
/// it is live. This home is the last resort, after all of them (not listed).
pub fn candidates(node: &Node, dead: &str, bytes: u64) -> (Vec<String>, Vec<(String, String)>) {
    let me = node.name().to_string();
    let mut skipped = Vec::new();
    match node.config.recover_on.as_deref().unwrap_or("idlest") {
        "home" => (Vec::new(), skipped),
        "idlest" => {
            let mut open: Vec<(String, ferry_policy::NodeLoad)> = Vec::new();
            for m in node.membership.members() {
                let name = m.id.name;
                if name == dead || name == me {
                    continue;
                }
                let why = if node.membership.is_down(&name) {
                    Some("declared down".to_string())
                } else {
                    match &m.load {
                        None => Some("no load heard from it yet".to_string()),
                        Some(l) if l.owner_present() => Some("its owner is at the machine".into()),
                        Some(l) => ferry_policy::admit(l, bytes).err(),
                    }
                };
                match (why, m.load) {
                    (None, Some(l)) => open.push((name, l)),
                    (why, _) => skipped.push((name, why.unwrap_or_default())),
                }
            }
            open.sort_by(|(an, a), (bn, b)| {
                a.busyness()
                    .partial_cmp(&b.busyness())
                    .unwrap_or(std::cmp::Ordering::Equal)
                    .then_with(|| an.cmp(bn))
            });
            (open.into_iter().map(|(n, _)| n).collect(), skipped)
        }
        name if name != dead && name != me && node.membership.find(name).is_some() => {
            if node.membership.is_down(name) {
                skipped.push((name.to_string(), "declared down".to_string()));
                (Vec::new(), skipped)
            } else {
                (vec![name.to_string()], skipped)
            }
        }
        name => {
            if name != me {
                skipped.push((name.to_string(), "not a live node".to_string()));
            }
            (Vec::new(), skipped)
        }
    }
}

/// The node running the body of `root` is dead: its tree is rebuilt from its last image on the
/// first of [`candidates`] that takes it as it would take a migrating guest (its own admission
/// of the `MigrateOffer`: a node that refuses, or fails before it holds a rebuilt copy, is
/// passed over for the next), else here; its deputies then follow it (crate::deputies::moved).
/// The log says where it went and why each node before it was passed over
/// (`recovery-skipped`, and `skipped` in `guest-recovered`). Returns the node it runs on now.
pub async fn recover_anywhere(node: &Arc<Node>, root: i32, dead: &str) -> Result<String> {
    let me = node.name().to_string();
    let bytes = std::fs::metadata(image_path(node, root)).map_or(0, |m| m.len());
    let (to_try, mut skipped) = candidates(node, dead, bytes);
    for (name, why) in &skipped {
        tracing::warn!(event = "recovery-skipped", root, node = %name, reason = %why,
            "not taken for the recovery (its gossiped load)");
    }
    let offsets = relay_offsets(node, root, bytes);
    for to in to_try {
        relink(node, root, dead, &to, &offsets).await;
        match send_image(node, root, dead, &to, &skipped).await {
            Ok(pid) => {
                tracing::warn!(event = "guest-recovered", root, pid, dead = %dead, node = %to,
                    skipped = %said(&skipped),
                    "rebuilt from its last checkpoint after its node died");
                return Ok(to);
            }
            Err(e) => {
                let why = format!("{e:#}");
                tracing::warn!(event = "recovery-skipped", root, node = %to, reason = %why,
                    "it did not take the recovery: trying the next node");
                skipped.push((to, why));
            }
        }
    }
    relink(node, root, dead, &me, &offsets).await;
    recover(node, root, dead, &skipped).await?;
    if let Err(e) = crate::deputies::moved(node, dead, root, &me) {
        tracing::warn!(event = "recovered-unrecorded", root, error = %format!("{e:#}"));
    }
    Ok(me)
}

/// What `ferry ps` lists with a recovered tree: "after node DEAD died[; passed over: ...]".
fn note(dead: &str, skipped: &[(String, String)]) -> String {
    if skipped.is_empty() {
        format!("after node {dead} died")
    } else {
        format!("after node {dead} died; passed over: {}", said(skipped))
    }
}

/// "NODE: why; NODE: why" of the nodes a recovery passed over, or "none".
fn said(skipped: &[(String, String)]) -> String {
    if skipped.is_empty() {
        return "none".to_string();
    }
    skipped
        .iter()
        .map(|(n, w)| format!("{n}: {w}"))
        .collect::<Vec<_>>()
        .join("; ")
}

/// Sends the last image of `root` to node `to` as a migration from this home would go, and has
/// it run there. Err only if `to` holds no copy it may run (the caller then rebuilds it here):
/// once `to` has rebuilt it, the outcome is decided (durably, crate::outcomes) and the
/// deputies follow it before `Commit` leaves; a `to` that misses our `Commit` asks for the
/// outcome, as after any migration. Returns the copy's PID there.
/// `skipped`: the nodes passed over before `to` (listed with the tree there).
async fn send_image(
    node: &Arc<Node>,
    root: i32,
    dead: &str,
    to: &str,
    skipped: &[(String, String)],
) -> Result<i32> {
    let path = image_path(node, root);
    let image = tokio::fs::read(&path)
        .await
        .with_context(|| format!("no checkpoint of PID {root} ({})", path.display()))?;
    let home_ids = crate::migrate::home_ids(root)
        .ok_or_else(|| anyhow!("the deputy of PID {root} is gone"))?;
    let (uid, command) = deputy_identity(root);
    let id = node.next_id();
    let me = node.name().to_string();
    let offer = MigrateOffer {
        id,
        from_node: me.clone(),
        home_node: me,
        home_pid: root,
        command,
        uid,
        memory_bytes: image.len() as u64,
        since_unix_ms: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0),
        home_ids: Some(home_ids),
        compress: Vec::new(),
        lazy: false,
        in_place: false,
        recovered: Some(note(dead, skipped)),
        // A device of this machine in the image: the destination's restore refuses it if it
        // is another machine (the image's boot id).
        machine_bound: None,
    };
    node.outcomes
        .begin(id, to, None)
        .context("record the recovery")?;
    let r = offer_image(node, offer, &image, dead, to).await;
    node.outcomes.end(id);
    r
}

async fn offer_image(
    node: &Arc<Node>,
    offer: MigrateOffer,
    image: &[u8],
    dead: &str,
    to: &str,
) -> Result<i32> {
    let (id, root) = (offer.id, offer.home_pid);
    let mut conn = node.dial(to).await?;
    write_msg(&mut conn.stream, &Msg::MigrateOffer(offer)).await?;
    match read_msg(&mut conn.stream).await {
        Ok(Msg::Accept) => {}
        Ok(Msg::Refused { reason }) => bail!("node {to} refused PID {root}: {reason}"),
        Ok(other) => bail!("node {to} answered the offer with {}", kind(&other)),
        Err(e) => bail!("node {to} did not answer the offer: {e}"),
    }
    let stall = node.config.stream_stall();
    let sent = tokio::time::timeout(stall, async {
        write_data(&mut conn.stream, image).await?;
        write_end(&mut conn.stream).await
    })
    .await;
    match sent {
        Ok(Ok(())) => {}
        Ok(Err(e)) => bail!("stream the image of PID {root} to node {to}: {e}"),
        Err(_) => bail!("node {to} took nothing of the image of PID {root} for {stall:?}"),
    }
    let rebuilt =
        match tokio::time::timeout(Duration::from_secs(600), read_msg(&mut conn.stream)).await {
            Ok(Ok(Msg::Rebuilt(r))) => r,
            Ok(Ok(Msg::Abort { reason } | Msg::Refused { reason })) => {
                bail!("node {to} could not rebuild PID {root}: {reason}")
            }
            Ok(Ok(other)) => bail!("node {to} answered the image with {}", kind(&other)),
            Ok(Err(e)) => bail!("lost node {to} while it rebuilt PID {root}: {e}"),
            Err(_) => bail!("node {to} did not rebuild PID {root} within 10 minutes"),
        };
    // The commit point, as in a migration: decided durably before anyone acts on it; a
    // destination that asked first (it lost us) has decided it already: not committed.
    let decided = node.outcomes.decide(
        id,
        Outcome {
            committed: true,
            to: to.to_string(),
            root: None,
        },
    );
    let refusal = match decided {
        Ok(o) if o.committed => None,
        Ok(_) => Some(anyhow!("node {to} gave up waiting for the commit")),
        Err(e) => Some(e.context("record the commit")),
    };
    if let Some(e) = refusal {
        let abort = Msg::Abort {
            reason: format!("{e:#}"),
        };
        let _ =
            tokio::time::timeout(Duration::from_secs(5), write_msg(&mut conn.stream, &abort)).await;
        return Err(e);
    }
    // The deputies follow the copy before it may run (should this daemon die now, its
    // successor finds them pointing at it, and `to` learns the outcome by asking).
    if let Err(e) = crate::deputies::moved(node, dead, root, to) {
        tracing::warn!(event = "recovered-unrecorded", root, error = %format!("{e:#}"));
    }
    let confirmed = async {
        write_msg(&mut conn.stream, &Msg::Commit).await?;
        match tokio::time::timeout(Duration::from_secs(30), read_msg(&mut conn.stream)).await {
            Ok(Ok(Msg::Resumed)) => Ok(()),
            Ok(Ok(other)) => Err(anyhow!(
                "node {to} answered the commit with {}",
                kind(&other)
            )),
            Ok(Err(e)) => Err(anyhow!("{e}")),
            Err(_) => Err(anyhow!("no answer within 30 s")),
        }
    }
    .await;
    match confirmed {
        Ok(()) => node.outcomes.settle(id),
        Err(e) => tracing::warn!(event = "commit-unconfirmed", id, pid = root, to = %to,
            error = %format!("{e:#}"), "the copy runs once its node learns the outcome"),
    }
    Ok(rebuilt.pid)
}

/// A body this home gave up for dead on `node` (its PIDs as that node numbers them, the
/// tree's own namespace's: the deputies' at home but for children of a `ferry run` program,
/// `crate::deputies`): killed there
/// should that node ever be live again (see the module's head).
#[derive(Serialize, Deserialize)]
struct Fence {
    node: String,
    root: i32,
    pids: Vec<i32>,
}

fn fence_key(dead: &str, root: i32) -> String {
    let hex: String = dead.bytes().map(|b| format!("{b:02x}")).collect();
    format!("{root}-{hex}")
}

/// Records, before the home acts on the death of `dead`, that the body of the tree `pids`
/// (root `root`) that ran there must be killed should `dead` come back.
pub fn condemn(node: &Node, dead: &str, root: i32, pids: Vec<i32>) -> Result<()> {
    let f = Fence {
        node: dead.to_string(),
        root,
        pids,
    };
    node.store
        .put(state::FENCE, &fence_key(dead, root), &f)
        .with_context(|| format!("record the body of PID {root} on dead node {dead}"))
}

/// Kills, on each node taken for dead that is live again, the bodies this home gave up there
/// (recorded by [`condemn`]). Runs for the daemon's life.
pub async fn fence(node: Arc<Node>) {
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        for (key, f) in node.store.load::<Fence>(state::FENCE) {
            if node.membership.is_down(&f.node) || node.membership.find(&f.node).is_none() {
                continue;
            }
            if node.fault_at("hold-fence") {
                // The test of a tree sent back to that node before this kill.
                continue;
            }
            match fence_one(&node, &f).await {
                Ok(killed) => {
                    tracing::warn!(event = "stale-body-fenced", node = %f.node, root = f.root,
                        killed = %killed, "the node taken for dead is back: its old body is killed");
                    node.store.remove_or_log(state::FENCE, &key);
                }
                Err(e) => tracing::debug!(event = "stale-body-unreached", node = %f.node,
                    root = f.root, error = %format!("{e:#}")),
            }
        }
    }
}

/// Has the body of `f` killed on its node: the whole of it (`FenceBody`: its guest namespaces
/// with everything in them, the processes it forked since it left home included), or, should
/// that node know no such body, each of its PIDs. Returns what that node said it killed.
async fn fence_one(node: &Node, f: &Fence) -> Result<String> {
    let mut conn = node.dial(&f.node).await?;
    write_msg(&mut conn.stream, &Msg::FenceBody { pid: f.root }).await?;
    match tokio::time::timeout(Duration::from_secs(10), read_msg(&mut conn.stream)).await {
        Ok(Ok(Msg::Done)) => return Ok("its whole body".to_string()),
        // No such body there: its PIDs, one by one.
        Ok(Ok(Msg::Error { message })) => {
            tracing::info!(event = "fence-by-pids", node = %f.node, root = f.root,
                reason = %message);
        }
        Ok(Ok(other)) => bail!("node {} answered the fence with {}", f.node, kind(&other)),
        Ok(Err(e)) => bail!("node {}: {e}", f.node),
        Err(_) => bail!("node {} did not answer within 10 s", f.node),
    }
    Ok(format!("PIDs {:?}", fence_pids(node, f).await?))
}

/// Has every PID of `f` killed on its node. Returns those that were there.
async fn fence_pids(node: &Node, f: &Fence) -> Result<Vec<i32>> {
    let mut killed = Vec::new();
    for &pid in &f.pids {
        let mut conn = node.dial(&f.node).await?;
        // `pids` are as the body's node numbers them (its tree's own namespace).
        let kill = Msg::SignalBody {
            pid,
            sig: libc::SIGKILL,
            queued: None,
            root: Some(f.root),
        };
        write_msg(&mut conn.stream, &kill).await?;
        match tokio::time::timeout(Duration::from_secs(5), read_msg(&mut conn.stream)).await {
            Ok(Ok(Msg::Done)) => killed.push(pid),
            // No such body there (any more): nothing to kill.
            Ok(Ok(_)) => {}
            Ok(Err(e)) => bail!("node {}: {e}", f.node),
            Err(_) => bail!("node {} did not answer within 5 s", f.node),
        }
    }
    Ok(killed)
}
