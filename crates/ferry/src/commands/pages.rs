//! The page link of a lazy or hybrid migration (`ferry migrate --memory lazy|hybrid`): a UNIX
//! socket between an engine worker and its daemon, apart from the worker's control pipes,
//! carrying the destination's page server's requests (`Msg::PageWant`) to the source and its
//! pages back (one `Data` frame each, or `Msg::PageError`). The daemons relay it over the
//! migration's mutual-TLS connection (ferry_daemon::migrate_lazy).
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
use std::time::{Duration, Instant};

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
/// capture worker's main thread, which keeps the tree frozen meanwhile. A request that takes
/// holes (`PageWant::holes`: the image names whole mappings, not their present pages, so
/// that the freeze does not walk them) is answered with the pages of the range that are
/// present or swapped out (one `PAGEMAP_SCAN` walk of the range) and the rest named as
/// holes: never sent, read as zeros there.
pub fn serve(mut link: UnixStream, hosts: HashMap<i32, i32>) {
    let mut buf = Vec::new();
    let mut mems: HashMap<i32, ProcMem> = HashMap::new();
    let mut pagemaps: HashMap<i32, std::fs::File> = HashMap::new();
    loop {
        let (pid, addr, len, id, take_holes) = match read_frame(&mut link) {
            Ok(Frame::Msg(Msg::PageWant {
                pid,
                addr,
                len,
                id,
                holes,
            })) => (pid, addr, len as usize, id, holes),
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
        let answer = (|| -> std::result::Result<Vec<(u64, u64)>, String> {
            if len > DATA_CHUNK {
                return Err(format!("{len} bytes asked at once (at most {DATA_CHUNK})"));
            }
            let host = *hosts
                .get(&pid)
                .ok_or_else(|| format!("PID {pid} is no process of the tree"))?;
            let end = addr + len as u64;
            let present = if take_holes {
                present_in(&mut pagemaps, pid, host, addr, end)?
            } else {
                vec![(addr, end)]
            };
            let bytes: u64 = present.iter().map(|(s, e)| e - s).sum();
            buf.resize(bytes as usize, 0);
            let mut at = 0usize;
            for &(s, e) in &present {
                let n = (e - s) as usize;
                read_memory(&mut mems, pid, host, s, &mut buf[at..at + n])?;
                at += n;
            }
            Ok(ferry_memory::RangeSet::from_ranges(vec![(addr, end)])
                .minus(&ferry_memory::RangeSet::from_ranges(present))
                .ranges()
                .to_vec())
        })();
        let sent = match answer {
            Ok(holes) => {
                // (A Data frame of nothing would be no frame at all.)
                let all_holes = buf.is_empty();
                write_msg(
                    &mut link,
                    &Msg::PageReply {
                        id,
                        holes,
                        all_holes,
                    },
                )
                .and_then(|()| match all_holes {
                    true => Ok(()),
                    false => write_data(&mut link, &buf),
                })
            }
            Err(message) => write_msg(&mut link, &Msg::PageError { message, id }),
        };
        if sent.is_err() {
            return;
        }
    }
}

/// The ranges of `[start, end)` of process `pid` (PID `host` here, frozen) whose pages are
/// present or swapped out, page-aligned; a scan that fails (a kernel without
/// `PAGEMAP_SCAN`) counts the whole range present.
fn present_in(
    pagemaps: &mut HashMap<i32, std::fs::File>,
    pid: i32,
    host: i32,
    start: u64,
    end: u64,
) -> std::result::Result<Vec<(u64, u64)>, String> {
    if !start.is_multiple_of(4096) || !end.is_multiple_of(4096) {
        return Ok(vec![(start, end)]);
    }
    if let std::collections::hash_map::Entry::Vacant(v) = pagemaps.entry(host) {
        let f = std::fs::File::open(format!("/proc/{host}/pagemap"))
            .map_err(|e| format!("PID {pid}: open its pagemap (PID {host} here): {e}"))?;
        v.insert(f);
    }
    Ok(
        ferry_sys::pagemap::scan_present(&pagemaps[&host], start, end)
            .map(|r| {
                r.into_iter()
                    .map(|(s, e)| (s.max(start), e.min(end)))
                    .filter(|(s, e)| s < e)
                    .collect()
            })
            .unwrap_or_else(|_| vec![(start, end)]),
    )
}

/// Reads `buf.len()` bytes of process `pid`'s memory (PID `host` here) at `addr`.
fn read_memory(
    mems: &mut HashMap<i32, ProcMem>,
    pid: i32,
    host: i32,
    addr: u64,
    buf: &mut [u8],
) -> std::result::Result<(), String> {
    let done = vm_read(host, addr, buf).unwrap_or(0);
    if done < buf.len() {
        // Pages the process may not read itself (PROT_NONE): through /proc/PID/mem.
        if let std::collections::hash_map::Entry::Vacant(v) = mems.entry(host) {
            v.insert(
                ProcMem::open(host)
                    .map_err(|e| format!("PID {pid}: open its memory (PID {host} here): {e}"))?,
            );
        }
        mems[&host]
            .read_exact(addr + done as u64, &mut buf[done..])
            .map_err(|e| {
                format!(
                    "PID {pid}: read its memory at {:x}-{:x}: {e}",
                    addr,
                    addr + buf.len() as u64
                )
            })?;
    }
    Ok(())
}

/// Destination side: the source node's memory, read over the page link. Requests are
/// pipelined: the page server keeps several outstanding ([`PageSource::ask`]) and takes their
/// answers as they come ([`PageSource::answers`]); the source answers them in order.
pub struct RemoteSource {
    link: UnixStream,
    /// The pages each process (the tree's PID) is owed: what the image names as inherited
    /// (in a hybrid migration, as inherited lazily: the rest came in the pre-copy rounds).
    extents: HashMap<i32, Vec<(u64, u64)>>,
    from: String,
    delivered: u64,
    /// The last request's number.
    id: u64,
    /// Requests not yet answered, by number.
    outstanding: HashMap<u64, Msg>,
    /// Answers read while waiting for another ([`Self::read`]), not yet collected.
    stash: Vec<(u64, Vec<u8>)>,
    /// The holes the source named in answers (by number) not yet taken by the server
    /// ([`ferry_memory::PageSource::take_holes`]).
    holes: HashMap<u64, Vec<(u64, u64)>>,
    /// When an answer last came (or the first request went out since none was outstanding),
    /// and when the outstanding requests were last asked again.
    last_answer: Instant,
    last_resend: Instant,
    /// How long a request may wait for its answer in all.
    stall: Duration,
}

/// A source that sends nothing for this long while requests are outstanding is asked them
/// again (their answers, should they come twice, are told apart by their numbers): a busy
/// machine must not cost a tree.
const ASK_AGAIN: Duration = Duration::from_secs(2);

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
            let mut v = p
                .inherited_lazily
                .clone()
                .unwrap_or_else(|| p.inherited.clone());
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
            outstanding: HashMap::new(),
            stash: Vec::new(),
            holes: HashMap::new(),
            last_answer: Instant::now(),
            last_resend: Instant::now(),
            stall,
        })
    }

    fn send(&mut self, pid: i32, addr: u64, len: usize) -> Result<u64> {
        if len > DATA_CHUNK {
            bail!("{len} bytes asked at once (at most {DATA_CHUNK})");
        }
        self.id += 1;
        let id = self.id;
        let want = Msg::PageWant {
            pid,
            addr,
            len: len as u64,
            id,
            holes: true,
        };
        write_msg(&mut self.link, &want).context("ask for it")?;
        if self.outstanding.is_empty() {
            self.last_answer = Instant::now();
            self.last_resend = self.last_answer;
        }
        self.outstanding.insert(id, want);
        Ok(id)
    }

    /// Reads the answers waiting on the link into `out` (waiting up to `wait_ms` for the
    /// first); asks again what waited too long, and fails once the source has been silent
    /// for the stall time.
    fn take(&mut self, out: &mut Vec<(u64, Vec<u8>)>, mut wait_ms: i32) -> Result<()> {
        out.append(&mut self.stash);
        loop {
            if self.outstanding.is_empty() {
                return Ok(());
            }
            let ready = ferry_sys::ns::poll_in(&[self.link.as_raw_fd()], wait_ms)
                .map(|r| r[0])
                .unwrap_or(true);
            wait_ms = 0;
            if !ready {
                break;
            }
            if let Some(answer) = self.read_answer()? {
                self.last_answer = Instant::now();
                out.push(answer);
            }
        }
        if self.last_answer.elapsed() > self.stall {
            bail!("no answer from the source (stream_stall_secs)");
        }
        if self.last_answer.elapsed() > ASK_AGAIN && self.last_resend.elapsed() > ASK_AGAIN {
            log::warn!(
                "{} page requests unanswered for {:.1} s: asked again",
                self.outstanding.len(),
                self.last_answer.elapsed().as_secs_f64()
            );
            let mut again: Vec<(u64, Msg)> = self
                .outstanding
                .iter()
                .map(|(i, m)| (*i, m.clone()))
                .collect();
            again.sort_by_key(|(i, _)| *i);
            for (_, m) in again {
                write_msg(&mut self.link, &m).context("ask for it again")?;
            }
            self.last_resend = Instant::now();
        }
        Ok(())
    }

    /// Reads one answer: `Some((number, bytes))` for an outstanding request; `None` for a
    /// late second answer to one asked again, dropped.
    fn read_answer(&mut self) -> Result<Option<(u64, Vec<u8>)>> {
        match read_frame(&mut self.link) {
            Ok(Frame::Msg(Msg::PageReply {
                id,
                holes,
                all_holes,
            })) => match if all_holes {
                Ok(Frame::Data(Vec::new()))
            } else {
                read_frame(&mut self.link)
            } {
                Ok(Frame::Data(d)) => {
                    let Some(Msg::PageWant { addr, len, .. }) = self.outstanding.remove(&id) else {
                        return Ok(None);
                    };
                    // The pages the source sent: its holes crossed no link.
                    let sent = d.len() as u64;
                    let full = with_holes(addr, len, d, &holes)?;
                    self.delivered += sent;
                    if !holes.is_empty() {
                        self.holes.insert(id, holes);
                    }
                    Ok(Some((id, full)))
                }
                Ok(_) => bail!("the link carried something else than pages"),
                Err(e) => bail!("the link to the source failed: {e}"),
            },
            Ok(Frame::Msg(Msg::PageError { id, message })) => match self.outstanding.get(&id) {
                Some(Msg::PageWant { pid, addr, len, .. }) => {
                    bail!("PID {pid}'s memory at {addr:x}-{:x}: {message}", addr + len)
                }
                _ => Ok(None),
            },
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

/// The `len` bytes at `addr` of an answer whose `Data` frame `d` carries only what is not in
/// `holes` (checked: page-aligned, sorted, disjoint ranges inside the request, and the bytes
/// exactly the rest), the holes zeros.
fn with_holes(addr: u64, len: u64, d: Vec<u8>, holes: &[(u64, u64)]) -> Result<Vec<u8>> {
    let end = addr + len;
    let mut last = addr;
    let mut hole_bytes = 0;
    for &(s, e) in holes {
        if s < last || e <= s || e > end || !s.is_multiple_of(4096) || !e.is_multiple_of(4096) {
            bail!("the source named holes outside the request {addr:x}-{end:x}: {holes:x?}");
        }
        hole_bytes += e - s;
        last = e;
    }
    if d.len() as u64 + hole_bytes != len {
        bail!(
            "{} bytes and {hole_bytes} of holes came for {len} asked",
            d.len()
        );
    }
    if holes.is_empty() {
        return Ok(d);
    }
    let mut full = vec![0u8; len as usize];
    let (mut at, mut from) = (addr, 0usize);
    for &(s, e) in holes.iter().chain(std::iter::once(&(end, end))) {
        let n = (s - at) as usize;
        full[(at - addr) as usize..(s - addr) as usize].copy_from_slice(&d[from..from + n]);
        from += n;
        at = e;
    }
    Ok(full)
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
            let got = (|| -> Result<()> {
                let id = self.send(pid, at, n)?;
                let mut answers = Vec::new();
                loop {
                    self.take(&mut answers, 100)?;
                    if let Some(k) = answers.iter().position(|(i, _)| *i == id) {
                        let (_, d) = answers.swap_remove(k);
                        self.holes.remove(&id);
                        buf[done..done + n].copy_from_slice(&d);
                        self.stash.append(&mut answers);
                        return Ok(());
                    }
                }
            })();
            got.map_err(|e| {
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

    fn ask(&mut self, pid: i32, addr: u64, len: usize) -> std::result::Result<u64, String> {
        self.send(pid, addr, len)
            .map_err(|e| format!("node {}: {e:#}", self.from))
    }

    fn answers(&mut self, out: &mut Vec<(u64, Vec<u8>)>) -> std::result::Result<(), String> {
        self.take(out, 0)
            .map_err(|e| format!("node {}: {e:#}", self.from))
    }

    fn ready_fd(&self) -> Option<std::os::fd::RawFd> {
        Some(self.link.as_raw_fd())
    }

    fn take_holes(&mut self, id: u64) -> Vec<(u64, u64)> {
        self.holes.remove(&id).unwrap_or_default()
    }

    fn max_ask(&self) -> usize {
        DATA_CHUNK
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
            Ok(r) if r[0] && self.outstanding.is_empty() => Err(format!(
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
        faults_on_the_way: s.faults_on_the_way,
        asks: s.asks,
        max_asks_in_flight: s.max_asks_in_flight,
        max_fault_window_pages: s.max_fault_window_pages,
        fault_pages: s.fault_pages,
        pushed_pages: s.pushed_pages,
        zero_pages: s.zero_pages,
        hole_pages: s.hole_pages,
        forked: s.forked as u64,
        remaps: s.remaps,
        unmaps: s.unmaps,
        removes: s.removes,
        ended_owing: s.ended_owing,
        fault_service_us: s.fault_service_us,
        source_bytes: s.source_bytes,
        dependency_ms: s.dependency_ms,
        source_released_after_resume_ms: 0.0,
        local_owed_bytes: s.local_owed_bytes,
        local_fault_pages: s.local_fault_pages,
        local_pushed_pages: s.local_pushed_pages,
        local_pending_bytes: s.local_pending_bytes,
    }
}
