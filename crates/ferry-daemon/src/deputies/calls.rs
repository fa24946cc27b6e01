//! Calls a body makes that only its home can answer: signals to processes at home (`kill`,
//! `tkill`, `tgkill`, `rt_sigqueueinfo`, `rt_tgsigqueueinfo` whose target is not in the body's
//! own PID namespace). The body's guest init asks its daemon ("NS call ..." on the report
//! socket, with one end of a socket pair for the answer); the daemon asks the home
//! (`HomeCall`), whose deputies' worker has the caller's deputy make the call, injected
//! (`ferry_deputy::home::Deputies::call`), and answers what it returned (`HomeCalled`).

use super::*;

/// What a deputy's call returned (a value or -errno), or why it was not made.
pub(super) type Answer = std::result::Result<i64, String>;

/// A guest init's question: process `pid` (its tree's own number) of the body in PID namespace
/// `ns` made call `nr`.
pub(super) struct Question {
    ns: String,
    pid: i32,
    nr: i64,
    args: Vec<u64>,
    uids: [u32; 3],
    data: Vec<u8>,
}

/// Reads "NS call PID NR A0 A1 A2 A3 A4 A5 RUID EUID SUID DATA" (DATA: the siginfo in hex, or
/// `-`).
pub(super) fn question(line: &str) -> Option<Question> {
    let f: Vec<&str> = line.split_whitespace().collect();
    let [ns, "call", pid, nr, a0, a1, a2, a3, a4, a5, ruid, euid, suid, data] = f[..] else {
        return None;
    };
    let args = [a0, a1, a2, a3, a4, a5]
        .iter()
        .map(|a| a.parse::<u64>().ok())
        .collect::<Option<Vec<u64>>>()?;
    let data = if data == "-" {
        Vec::new()
    } else {
        if data.len() % 2 != 0 || data.len() > 256 {
            return None;
        }
        (0..data.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&data[i..i + 2], 16).ok())
            .collect::<Option<Vec<u8>>>()?
    };
    Some(Question {
        ns: ns.to_string(),
        pid: pid.parse().ok()?,
        nr: nr.parse().ok()?,
        args,
        uids: [ruid.parse().ok()?, euid.parse().ok()?, suid.parse().ok()?],
        data,
    })
}

/// Asks the body's home to make call `q`, and answers the guest init on `answer`: `R` and what
/// the call returned, or `E` and why it was not made.
pub(super) async fn answer_body(node: &Arc<Node>, q: Question, answer: std::os::fd::OwnedFd) {
    let r = call_for_body(node, &q).await;
    let word = match &r {
        Ok(ret) => format!("R{ret}"),
        Err(e) => {
            tracing::warn!(event = "body-call-refused", ns = %q.ns, pid = q.pid, nr = q.nr,
                error = %format!("{e:#}"));
            format!("E{e:#}")
        }
    };
    answer_init(&answer, &word, "body-call", q.pid);
}

/// Connections to homes kept open for the calls of the bodies running here: a call takes one
/// (or dials), and gives it back once answered. Home serves every `HomeCall` that comes on a
/// connection that began with one ([`serve_link`]), so a call pays no handshake.
#[derive(Default)]
pub(super) struct Links {
    by_home: Mutex<HashMap<String, Vec<ferry_transport::Conn>>>,
}

impl Links {
    fn take(&self, home: &str) -> Option<ferry_transport::Conn> {
        self.by_home
            .lock()
            .expect("links lock")
            .get_mut(home)?
            .pop()
    }

    fn give_back(&self, home: &str, conn: ferry_transport::Conn) {
        let mut m = self.by_home.lock().expect("links lock");
        let list = m.entry(home.to_string()).or_default();
        // As many as calls were made at once, up to a few.
        if list.len() < 4 {
            list.push(conn);
        }
    }
}

/// Asks `home` (another node) `msg`, on a kept connection if there is one, and keeps the
/// connection for the next call. A kept connection the home has closed meanwhile (its daemon
/// restarted) fails before the home read anything: then on a fresh one.
async fn ask_linked(node: &Arc<Node>, home: &str, msg: &Msg) -> Result<Msg> {
    let links = &node.bodies.call_links;
    if let Some(mut conn) = links.take(home) {
        if write_msg(&mut conn.stream, msg).await.is_ok() {
            if let Ok(answer) = read_msg(&mut conn.stream).await {
                links.give_back(home, conn);
                return Ok(answer);
            }
        }
    }
    let mut conn = node.dial(home).await?;
    write_msg(&mut conn.stream, msg).await?;
    match read_msg(&mut conn.stream).await {
        Ok(answer) => {
            links.give_back(home, conn);
            Ok(answer)
        }
        Err(e) => bail!("home {home} did not answer: {e}"),
    }
}

/// Serves a connection whose first message was a `HomeCall` from peer `from`: that call, then
/// every other that comes on it, until the peer closes it.
pub async fn serve_link(node: &Node, mut conn: ferry_transport::Conn, first: Msg) -> Result<()> {
    let from = conn.peer.clone();
    let mut msg = first;
    loop {
        let reply = serve_peer(node, &from, msg).await;
        write_msg(&mut conn.stream, &reply).await?;
        msg = match read_msg(&mut conn.stream).await {
            Ok(m @ Msg::HomeCall { .. }) => m,
            Ok(other) => bail!("{} message on a connection of calls", kind(&other)),
            Err(ferry_transport::FrameError::Closed) => return Ok(()),
            Err(e) => return Err(e.into()),
        };
    }
}

/// How long the body's node waits for its home to make a call.
const CALL_WAITS: std::time::Duration = std::time::Duration::from_secs(40);

async fn call_for_body(node: &Arc<Node>, q: &Question) -> Result<i64> {
    let (home, root) = home_of(node, &q.ns).await?;
    let msg = Msg::HomeCall {
        pid: q.pid,
        root: Some(root),
        nr: q.nr,
        args: q.args.clone(),
        data: serde_bytes::ByteBuf::from(q.data.clone()),
        uids: q.uids,
    };
    let me = node.name().to_string();
    let answer = if home == me {
        serve_peer(node, &me, msg).await
    } else {
        tokio::time::timeout(CALL_WAITS, ask_linked(node, &home, &msg))
            .await
            .map_err(|_| {
                anyhow!(
                    "home {home} did not answer call {} of PID {} within {} s",
                    q.nr,
                    q.pid,
                    CALL_WAITS.as_secs()
                )
            })??
    };
    match answer {
        Msg::Error { message } => bail!("home {home}: {message}"),
        Msg::HomeCalled {
            ret, error: None, ..
        } => Ok(ret),
        Msg::HomeCalled { error: Some(e), .. } => bail!("home {home}: {e}"),
        other => bail!("home {home} answered {}", kind(&other)),
    }
}

/// Serves a peer's `HomeCall` (`from`: the certified peer, which must be running the body).
async fn serve_peer(node: &Node, from: &str, msg: Msg) -> Msg {
    let Msg::HomeCall {
        pid,
        root,
        nr,
        args,
        data,
        uids,
    } = msg
    else {
        return Msg::error("not a call");
    };
    match node
        .deputies
        .call(from, pid, root, nr, args, data, uids)
        .await
    {
        Ok(Ok(ret)) => Msg::HomeCalled {
            pid,
            ret,
            error: None,
        },
        Ok(Err(why)) => Msg::HomeCalled {
            pid,
            ret: -(libc::EPERM as i64),
            error: Some(why),
        },
        Err(e) => Msg::Error {
            message: format!("{e:#}"),
        },
    }
}

impl Deputies {
    /// The body of `pid` (as in [`Deputies::fork`]), running on node `from`, made call `nr`
    /// that only its home answers: its deputy makes it here. Returns what it returned, or why
    /// the worker did not make it.
    #[allow(clippy::too_many_arguments)]
    async fn call(
        &self,
        from: &str,
        pid: i32,
        root: Option<i32>,
        nr: i64,
        args: Vec<u64>,
        data: serde_bytes::ByteBuf,
        uids: [u32; 3],
    ) -> Result<Answer> {
        let (tx, rx) = oneshot::channel();
        self.to_deputy(from, pid, root, "made a call for", |d| {
            let msg = Msg::HomeCall {
                pid: d,
                root: None,
                nr,
                args,
                data,
                uids,
            };
            Cmd::Call(d, Box::new(msg), tx)
        })
        .await?;
        tokio::time::timeout(std::time::Duration::from_secs(10), rx)
            .await
            .map_err(|_| anyhow!("the deputy of PID {pid} made no call {nr} within 10 s"))?
            .map_err(|_| anyhow!("the deputies' worker of PID {pid} is gone"))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn questions_are_read_whole_or_not_at_all() {
        let q =
            super::question("pid:[4] call 12 129 7 10 4096 0 0 0 1000 1000 1000 0aff\n").unwrap();
        assert_eq!((q.ns.as_str(), q.pid, q.nr), ("pid:[4]", 12, 129));
        assert_eq!(q.args, vec![7, 10, 4096, 0, 0, 0]);
        assert_eq!(q.uids, [1000, 1000, 1000]);
        assert_eq!(q.data, vec![0x0a, 0xff]);
        let q = super::question("pid:[4] call 12 62 9 15 0 0 0 0 0 0 0 -").unwrap();
        assert!(q.data.is_empty());
        assert!(super::question("pid:[4] call 12 62 9 15 0 0 0 0 0 0 0").is_none());
        assert!(super::question("pid:[4] call 12 62 9 15 0 0 0 0 0 0 0 abc").is_none());
        assert!(super::question("pid:[4] fork 12").is_none());
    }
}
