//! The page link of a lazy migration (`ferry migrate --memory lazy`): a UNIX socket between an
//! engine worker and its daemon, apart from the worker's control pipes, carrying the
//! destination's page server's requests (`Msg::PageWant`) to the source and its pages back
//! (one `Data` frame each, or `Msg::PageError`). The daemons relay it over the migration's
//! mutual-TLS connection (ferry_daemon::migrate_lazy).
//!
//! - Source: the capture worker, after the image is sent, keeps the tree frozen and answers
//!   every request from the frozen original's memory ([`serve`]), until the daemon tells it
//!   the lazy phase is over (`Kill` or `Deputize`).
//! - Destination: the restore worker's page server reads through [`RemoteSource`]; a link
//!   that closes, or a source that does not answer within the node's stall time, fails the
//!   read, and the server kills the tree (nothing waits for a page that will not come).

use anyhow::{bail, Context, Result};
use ferry_sys::proc_mem::{vm_read, ProcMem};
use ferry_transport::frame::blocking::{read_frame, write_data, write_msg};
use ferry_transport::frame::DATA_CHUNK;
use ferry_transport::{Frame, FrameError, Msg};
use std::collections::HashMap;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::time::Duration;

/// Takes this worker's end of the page link from its daemon (descriptor `fd` there, taken with
/// `pidfd_getfd`), and says so: the daemon then closes its copy, so that the link closes
/// when this worker dies.
pub fn take_link(fd: i32) -> Result<UnixStream> {
    let daemon = std::os::unix::process::parent_id() as i32;
    let pidfd = ferry_sys::pidfd::pidfd_open(daemon)
        .with_context(|| format!("open a pidfd of the daemon (PID {daemon})"))?;
    let link = ferry_sys::pidfd::pidfd_getfd(&pidfd, fd)
        .with_context(|| format!("take the page link (descriptor {fd} of PID {daemon})"))?;
    let mut link = UnixStream::from(link);
    write_msg(&mut link, &Msg::Accept).context("greet the daemon on the page link")?;
    ferry_sys::process::ignore_sigpipe();
    Ok(link)
}

/// Source side: answers the page link's requests from the memory of the frozen tree (`hosts`:
/// the tree's PIDs to ours) until the link closes. Runs on a thread of its own beside the
/// capture worker's main thread, which keeps the tree frozen meanwhile.
pub fn serve(mut link: UnixStream, hosts: HashMap<i32, i32>) {
    let mut buf = Vec::new();
    let mut mems: HashMap<i32, ProcMem> = HashMap::new();
    loop {
        let (pid, addr, len, id) = match read_frame(&mut link) {
            Ok(Frame::Msg(Msg::PageWant { pid, addr, len, id })) => (pid, addr, len as usize, id),
            Ok(_) => {
                log::warn!("page link: unexpected frame");
                return;
            }
            Err(FrameError::Closed) => return,
            Err(e) => {
                log::warn!("page link: {e}");
                return;
            }
        };
        let answer = (|| -> std::result::Result<(), String> {
            if len > DATA_CHUNK {
                return Err(format!("{len} bytes asked at once (at most {DATA_CHUNK})"));
            }
            let host = *hosts
                .get(&pid)
                .ok_or_else(|| format!("PID {pid} is no process of the tree"))?;
            buf.resize(len, 0);
            let done = vm_read(host, addr, &mut buf).unwrap_or(0);
            if done < len {
                // Pages the process may not read itself (PROT_NONE): through /proc/PID/mem.
                if let std::collections::hash_map::Entry::Vacant(v) = mems.entry(host) {
                    v.insert(ProcMem::open(host).map_err(|e| {
                        format!("PID {pid}: open its memory (PID {host} here): {e}")
                    })?);
                }
                mems[&host]
                    .read_exact(addr + done as u64, &mut buf[done..])
                    .map_err(|e| {
                        format!(
                            "PID {pid}: read its memory at {:x}-{:x}: {e}",
                            addr,
                            addr + len as u64
                        )
                    })?;
            }
            Ok(())
        })();
        let sent = match answer {
            Ok(()) => write_msg(&mut link, &Msg::PageReply { id })
                .and_then(|()| write_data(&mut link, &buf)),
            Err(message) => write_msg(&mut link, &Msg::PageError { message, id }),
        };
        if sent.is_err() {
            return;
        }
    }
}

/// Destination side: the source node's memory, read over the page link.
pub struct RemoteSource {
    link: UnixStream,
    /// The pages each process (the tree's PID) is owed: what the image names as inherited.
    extents: HashMap<i32, Vec<(u64, u64)>>,
    from: String,
    delivered: u64,
    /// The last request's number.
    id: u64,
    /// How long a request may wait for its answer in all.
    stall: Duration,
}

impl RemoteSource {
    /// `stall`: how long a request may wait for its answer before the source counts as lost.
    pub fn new(
        link: UnixStream,
        tree: &ferry_image::Tree,
        from: &str,
        stall: Duration,
    ) -> Result<RemoteSource> {
        link.set_read_timeout(Some(stall))
            .context("set the page link's timeout")?;
        link.set_write_timeout(Some(stall))
            .context("set the page link's timeout")?;
        let mut extents: HashMap<i32, Vec<(u64, u64)>> = HashMap::new();
        for p in tree.processes.iter().filter(|p| p.zombie_status.is_none()) {
            let mut v = p.inherited.clone();
            v.sort_unstable();
            let mut merged: Vec<(u64, u64)> = Vec::new();
            for (s, e) in v {
                match merged.last_mut() {
                    Some(last) if last.1 == s => last.1 = e,
                    _ => merged.push((s, e)),
                }
            }
            extents.insert(p.pid, merged);
        }
        Ok(RemoteSource {
            link,
            extents,
            from: from.to_string(),
            delivered: 0,
            id: 0,
            stall,
        })
    }

    fn read_chunk(&mut self, pid: i32, addr: u64, buf: &mut [u8]) -> Result<()> {
        self.id += 1;
        let id = self.id;
        let want = Msg::PageWant {
            pid,
            addr,
            len: buf.len() as u64,
            id,
        };
        write_msg(&mut self.link, &want).context("ask for it")?;
        let since = std::time::Instant::now();
        loop {
            // A request unanswered for a while is asked again (its answer, should it come
            // twice, is told apart by its number): a busy machine must not cost a tree.
            let ready = ferry_sys::ns::poll_in(&[self.link.as_raw_fd()], 2000)
                .map(|r| r[0])
                .unwrap_or(true);
            if !ready {
                if since.elapsed() > self.stall {
                    bail!("no answer from the source (stream_stall_secs)");
                }
                log::warn!("page request {id} unanswered for 2 s: asked again");
                write_msg(&mut self.link, &want).context("ask for it again")?;
                continue;
            }
            match self.read_answer(id, buf)? {
                true => return Ok(()),
                false => continue,
            }
        }
    }

    /// Reads one answer: true if it is request `id`'s (its data in `buf`), false if it was a
    /// late answer to an earlier request, dropped.
    fn read_answer(&mut self, id: u64, buf: &mut [u8]) -> Result<bool> {
        match read_frame(&mut self.link) {
            Ok(Frame::Msg(Msg::PageReply { id: got })) => match read_frame(&mut self.link) {
                Ok(Frame::Data(_)) if got != id => Ok(false),
                Ok(Frame::Data(d)) if d.len() == buf.len() => {
                    buf.copy_from_slice(&d);
                    self.delivered += d.len() as u64;
                    Ok(true)
                }
                Ok(Frame::Data(d)) => bail!("{} bytes came for {} asked", d.len(), buf.len()),
                Ok(_) => bail!("the link carried something else than pages"),
                Err(e) => bail!("the link to the source failed: {e}"),
            },
            Ok(Frame::Msg(Msg::PageError { id: got, .. })) if got != id => Ok(false),
            Ok(Frame::Msg(Msg::PageError { message, .. })) => bail!("{message}"),
            Ok(_) => bail!("the link carried something else than pages"),
            Err(FrameError::Closed) => bail!("the link to the source is gone"),
            Err(FrameError::Io(e))
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                bail!("no answer from the source (stream_stall_secs)")
            }
            Err(e) => bail!("the link to the source failed: {e}"),
        }
    }
}

impl ferry_memory::PageSource for RemoteSource {
    fn extents(&self, pid: i32) -> Vec<(u64, u64)> {
        self.extents.get(&pid).cloned().unwrap_or_default()
    }

    fn read(&mut self, pid: i32, addr: u64, buf: &mut [u8]) -> std::result::Result<(), String> {
        let mut done = 0;
        while done < buf.len() {
            let n = (buf.len() - done).min(DATA_CHUNK);
            let at = addr + done as u64;
            self.read_chunk(pid, at, &mut buf[done..done + n])
                .map_err(|e| {
                    format!(
                        "node {}: PID {pid}'s memory at {at:x}-{:x}: {e:#}",
                        self.from,
                        at + n as u64
                    )
                })?;
            done += n;
        }
        Ok(())
    }

    fn describe(&self) -> String {
        format!("node {}", self.from)
    }

    fn bytes_delivered(&self) -> u64 {
        self.delivered
    }

    fn check(&mut self) -> std::result::Result<(), String> {
        // Nothing is asked now: anything to read is the end of the link.
        match ferry_sys::ns::poll_in(&[self.link.as_raw_fd()], 0) {
            Ok(r) if r[0] => Err(format!(
                "the link to the source node {} is gone (its daemon, its capture worker or \
                 the network)",
                self.from
            )),
            _ => Ok(()),
        }
    }
}

/// What the page server's statistics say, for the migration's report.
pub fn report(s: &ferry_memory::Stats) -> ferry_transport::message::LazyReport {
    ferry_transport::message::LazyReport {
        owed_bytes: s.owed_bytes,
        faults: s.faults,
        faults_already_served: s.faults_already_served,
        fault_pages: s.fault_pages,
        pushed_pages: s.pushed_pages,
        zero_pages: s.zero_pages,
        forked: s.forked as u64,
        remaps: s.remaps,
        unmaps: s.unmaps,
        removes: s.removes,
        ended_owing: s.ended_owing,
        fault_service_us: s.fault_service_us,
        source_bytes: s.source_bytes,
        dependency_ms: s.dependency_ms,
        source_released_after_resume_ms: 0.0,
    }
}
