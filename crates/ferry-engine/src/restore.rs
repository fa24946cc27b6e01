//! Rebuild: reads an image front to back and recreates its tree as the image streams in. The
//! tree record (read and checked by [`open`]) says what to build; the processes and their
//! mappings are made before memory is read, and each record of memory is written into its
//! process as it arrives, checked at its end. If any record is bad, or any step of the rebuild
//! fails, every process made so far is killed.
//!
//! The tree is rebuilt in our namespaces ([`restore`]) or, with [`RestoreOptions::guest`], in
//! guest namespaces ([`crate::guest_ns`]), where it gets its PIDs back even if they are taken
//! here. Either way the engine drives each process by its PID in our namespace
//! ([`Husk::host`]); injected calls that name a process inside the tree use the tree's numbers.

use crate::error::{Context, Error, Result};
use crate::guest_ns::GuestNamespaces;
use crate::husk::{Husk, Place, TRAMPOLINE_LEN};
use crate::objects::RestoreObjects;
use crate::procmake::{deputy_refork_ok, join_session, make_zombie, replace_deputy};
use crate::resources::memory::AnonFiller;
use crate::resources::sockets::Deferred;
use crate::resources::{files, jobctl, locks, memory, process, seccomp, signals, threads};
use ferry_image::stream::ObjectRef;
use ferry_image::{ImageReader, Item, Process, Tree, Vma};
use ferry_sys::proc_mem::ProcMem;
use ferry_sys::ptrace;
use ferry_sys::PAGE_SIZE;
use std::collections::{HashMap, HashSet};
use std::io::Read;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// How long `resume` waits for addresses the tree's sockets need to be freed (see
/// [`Deferred`]): in a migration between nodes of one machine, the original is killed just
/// before, and its sockets close as it exits.
const DEFERRED_WAIT: Duration = Duration::from_secs(3);

/// Image data is read, and written into the processes, in pieces of at most this many bytes,
/// through one buffer: small enough to stay in the CPU's cache between the read, the checksum
/// and the write into the process, large enough that each piece costs few system calls.
const PIECE: usize = 4 << 20;

/// An image being restored: its tree is read and checked; the contents of its shared objects
/// and its memory follow in the stream, and are read as the tree is rebuilt
/// ([`restore_with`]), each record checked as it arrives.
pub struct OpenImage<R: Read> {
    pub tree: Tree,
    records: Records<R>,
}

/// The records after the tree.
struct Records<R: Read> {
    reader: ImageReader<R>,
    /// A record whose head was read and is yet to be handled.
    pending: Option<Item>,
    /// Bytes of memory and object contents read so far.
    data_bytes: u64,
    /// Set once a restore has started reading the records after the tree.
    started: bool,
}

/// Reads an image's header and its tree (the first record), and checks the tree's consistency.
/// Nothing else is read: [`restore_with`] streams the rest.
pub fn open<R: Read>(input: R) -> Result<OpenImage<R>> {
    open_reader(ImageReader::new(input)?)
}

/// [`open`], from a reader whose header is read already.
pub fn open_reader<R: Read>(mut reader: ImageReader<R>) -> Result<OpenImage<R>> {
    let tree = reader.read_tree()?;
    Ok(OpenImage {
        tree,
        records: Records {
            reader,
            pending: None,
            data_bytes: 0,
            started: false,
        },
    })
}

impl<R: Read> OpenImage<R> {
    /// The image's format version.
    pub fn version(&self) -> u32 {
        self.records.reader.version()
    }

    /// Bytes of memory and shared-object contents read so far (all of them after a restore).
    pub fn data_bytes(&self) -> u64 {
        self.records.data_bytes
    }

    /// The byte source, positioned after what was read (after the end marker, once a restore
    /// succeeded).
    pub fn into_inner(self) -> R {
        self.records.reader.into_inner()
    }
}

impl<R: Read> Records<R> {
    fn next(&mut self) -> Result<Item> {
        if let Some(item) = self.pending.take() {
            return Ok(item);
        }
        match self.reader.next_item()? {
            Some(Item::Tree(_)) => Err(Error::BadImage("two tree records".into())),
            Some(item) => Ok(item),
            None => Err(Error::BadImage("records after the end marker".into())),
        }
    }

    /// Reads the contents of a shared object (`len` bytes at `offset`) into it, piece by piece.
    fn fill_object(
        &mut self,
        tree: &Tree,
        objects: &RestoreObjects,
        object: ObjectRef,
        offset: u64,
        len: u64,
        buf: &mut [u8],
    ) -> Result<()> {
        let size = match object {
            ObjectRef::Shmem(id) => tree.shmem.get(id as usize).map(|s| s.size),
            ObjectRef::Ghost(id) => tree.ghosts.get(id as usize).map(|g| g.size),
        };
        match size {
            Some(size) if offset.saturating_add(len) <= size.max(ferry_sys::PAGE_SIZE) => {}
            _ => {
                return Err(Error::BadImage(format!(
                    "data for {object:?} at {offset} ({len} bytes) does not fit the object"
                )))
            }
        }
        let mut done = 0;
        while done < len {
            let n = (len - done).min(buf.len() as u64) as usize;
            self.reader.read_data(&mut buf[..n])?;
            objects.fill(object, offset + done, &buf[..n])?;
            done += n as u64;
        }
        self.reader.end_record()?;
        self.data_bytes += len;
        Ok(())
    }
}

/// Checks a tree's consistency ([`ferry_image::validate`]), as [`open`] does.
pub fn validate(t: &Tree) -> Result<()> {
    ferry_image::validate(t).map_err(Error::BadImage)
}

// The image's notion of registers and pages is the kernel's.
const _: () = assert!(ferry_image::validate::GP_REGS_WORDS == ferry_sys::regs::GP_REGS_WORDS);
const _: () = assert!(ferry_image::validate::PAGE_SIZE == ferry_sys::PAGE_SIZE);

/// What is using a PID we need, for error messages.
pub fn describe_pid(pid: i32) -> String {
    match std::fs::read_to_string(format!("/proc/{pid}/comm")) {
        Ok(c) => format!("by {}", c.trim()),
        Err(_) => "by a thread of another process".into(),
    }
}

/// One rebuilt process: its PID as the tree sees it (the image's), and in our namespace.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct RestoredPid {
    pub pid: i32,
    pub host_pid: i32,
}

#[derive(Debug, Default, Clone, serde::Serialize)]
pub struct RestoreReport {
    /// The root, as the tree sees it (the image's PID).
    pub root_pid: i32,
    /// Every process, as the tree sees it, parents first.
    pub pids: Vec<i32>,
    /// The root's PID in our namespace (the same as `root_pid` unless rebuilt in a guest).
    pub root_host_pid: i32,
    /// Every process with both its PIDs, parents first.
    pub processes: Vec<RestoredPid>,
    /// The guest namespaces' init, in our namespace, when the tree was rebuilt in a guest.
    pub guest_init_host_pid: Option<i32>,
    pub threads: usize,
    pub memory_bytes: u64,
    /// Bytes of memory taken from an earlier transfer (`Process::inherited`).
    pub inherited_bytes: u64,
    /// Bytes of memory and shared-object contents in the image.
    pub data_bytes: u64,
    pub build_ms: f64,
    /// Mapping the address spaces and streaming memory into them (the image read and the
    /// writes into the processes included).
    pub memory_ms: f64,
    /// Of `memory_ms`: reading and checking the image's memory records (in a migration, this
    /// includes waiting for them to arrive).
    pub image_read_ms: f64,
    /// Of `memory_ms`: writing memory into the processes.
    pub pages_write_ms: f64,
    /// Whether every process's private anonymous memory went in with `UFFDIO_COPY` (else
    /// with `process_vm_writev`, which faults and clears each page first).
    pub memory_filled_by_uffd: bool,
    /// Whether private anonymous memory was left to a page server ([`RestoreOptions::lazy`]).
    pub memory_lazy: bool,
    pub finish_ms: f64,
    /// When each step of the rebuild ended (µs since the epoch): a migration's report puts
    /// them on its timeline.
    pub timeline: Vec<(&'static str, u64)>,
}

impl RestoreReport {
    fn stamp(&mut self, what: &'static str) {
        self.timeline.push(stamp(what));
    }
}

/// A step of the timeline: what ended, and when (µs since the epoch).
fn stamp(what: &'static str) -> (&'static str, u64) {
    let us = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64);
    (what, us)
}

impl RestoreReport {}

/// Where the pages a process inherits (`Process::inherited`: pre-copy rounds, a parent
/// image) come from: the page of image process `pid` at `addr`, if held.
pub trait InheritedPages: std::fmt::Debug {
    fn page(&self, pid: i32, addr: u64) -> Option<&[u8]>;
}

/// How and where to rebuild a tree.
#[derive(Debug, Default, Clone, Copy)]
pub struct RestoreOptions<'a> {
    /// Rebuild the tree inside these guest namespaces (its PIDs are then the guest's, and its
    /// clocks those of the guest time namespace) instead of in ours.
    pub guest: Option<&'a GuestNamespaces>,
    /// Whoever asks for the restore: `None` for Ferry itself (root, as today's CLI and
    /// daemon). Files are opened with each process's own rights; only when those are refused
    /// are the caller's tried, and then only for the very file captured (`crate::reopen`).
    /// A restore on behalf of a user passes that user's credentials here.
    pub caller: Option<&'a ferry_sys::fsid::FsCreds>,
    /// The CPU cgroup (a directory of the cgroup v1 hierarchy holding the `cpu` controller)
    /// every rebuilt process joins instead of the one the image names: the node's own, where
    /// a node is held to a CPU quota (`ferry cluster up --cpu-quota`). Other hierarchies are
    /// restored as usual.
    pub cpu_cgroup: Option<&'a std::path::Path>,
    /// The restore of a migration that relays pipes from the tree's home: the relay's ends of
    /// relayed pipes are kept ([`RestoredTree::relay_ends`]). Any other restore refuses an
    /// image with relayed pipes: their other end is on the tree's home node.
    pub relays: bool,
    /// Leave private anonymous memory to this page server (copy-on-reference, see
    /// [`crate::lazy`]) instead of reading it from the image before the tree runs.
    pub lazy: Option<&'a dyn crate::lazy::LazyMemory>,
    /// The tree is a body (its home is another node): every process gets Ferry's filter
    /// (`resources::seccomp::install_forwarding`), whose listeners
    /// [`RestoredTree::take_listeners`] hands over to the supervisor.
    pub supervised: bool,
    /// Pages that came ahead of the image (pre-copy rounds, a parent image): those the image
    /// names as `Process::inherited` are taken from here.
    pub pages: Option<&'a dyn InheritedPages>,
    /// A tree coming home: the processes of the image with these PIDs are rebuilt in place of
    /// their deputies (`husk::Husk::adopt`), keeping their PID, parent, process group, session
    /// and controlling terminal; the others are made as usual. Empty for any other restore.
    pub adopt: &'a [i32],
    /// Called once the image's tree is known fit to be rebuilt in place of `adopt` (its PIDs
    /// free but theirs), before any deputy is touched: it has them let go by their tracer, or
    /// says why not (the restore then fails, the deputies untouched).
    pub release: Option<ReleaseHook<'a>>,
}

/// See [`RestoreOptions::release`].
#[derive(Clone, Copy)]
pub struct ReleaseHook<'a>(pub &'a dyn Fn() -> std::result::Result<(), String>);

impl std::fmt::Debug for ReleaseHook<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ReleaseHook")
    }
}

/// The PIDs and TIDs of an image.
fn image_ids(tree: &Tree) -> Vec<i32> {
    tree.processes
        .iter()
        .flat_map(|p| std::iter::once(p.pid).chain(p.threads.iter().map(|t| t.tid)))
        .collect()
}

/// Waits briefly for PIDs held only by zombies that init is about to reap; then insists that
/// every PID and TID of the image is free (in the guest PID namespace, when there is one, where
/// PID 1 is always taken by its init).
fn check_pids_free(tree: &Tree, guest: Option<&GuestNamespaces>, adopt: &[i32]) -> Result<()> {
    let proc_root = guest
        .map(|g| g.proc_root())
        .unwrap_or_else(|| PathBuf::from("/proc"));
    let deadline = Instant::now() + std::time::Duration::from_secs(5);
    for id in image_ids(tree).into_iter().filter(|id| !adopt.contains(id)) {
        if guest.is_some() && id == 1 {
            return Err(Error::PidTaken {
                pid: id,
                by: "by the guest namespace's init".into(),
            });
        }
        loop {
            let path = proc_root.join(id.to_string());
            if !path.exists() {
                break;
            }
            let zombie = std::fs::read_to_string(path.join("stat"))
                .map(|s| s.contains(") Z "))
                .unwrap_or(false);
            if !zombie || Instant::now() > deadline {
                return Err(Error::PidTaken {
                    pid: id,
                    by: match guest {
                        None => describe_pid(id),
                        Some(g) => format!(
                            "by {} in the guest namespace",
                            std::fs::read_to_string(path.join("comm"))
                                .map(|c| c.trim().to_string())
                                .unwrap_or_else(|_| format!("a process of {}", g.pid_namespace()))
                        ),
                    },
                });
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }
    Ok(())
}

/// Whether `tree` can be rebuilt in place of deputies `adopt` ([`RestoreOptions::adopt`]):
/// every deputy has its live process in the image, the root among them, and every other PID
/// and TID of the image is free here. Nothing is touched.
pub fn check_in_place(tree: &Tree, adopt: &[i32]) -> Result<()> {
    check_adoption(
        tree,
        &RestoreOptions {
            adopt,
            ..Default::default()
        },
    )?;
    check_pids_free(tree, None, adopt)
}

/// A tree coming home is rebuilt in our own namespaces, its root in place of its deputy, and
/// only deputies whose processes the image holds, alive, can be taken over.
fn check_adoption(tree: &Tree, opts: &RestoreOptions<'_>) -> Result<()> {
    if opts.adopt.is_empty() {
        return Ok(());
    }
    if opts.guest.is_some() || opts.lazy.is_some() {
        return Err(Error::BadImage(
            "a tree coming home is rebuilt in its home's namespaces, eagerly".into(),
        ));
    }
    if !opts.adopt.contains(&tree.root_pid) {
        return Err(Error::BadImage(format!(
            "the tree's root {} has no deputy here",
            tree.root_pid
        )));
    }
    for &pid in opts.adopt {
        match tree.processes.iter().find(|p| p.pid == pid) {
            Some(p) if p.zombie_status.is_some() || p.leader_exited => {
                return Err(Error::BadImage(format!(
                    "PID {pid} ended over there (or its main thread did): its deputy cannot \
                     be taken over yet"
                )))
            }
            Some(_) => {}
            None => {
                return Err(Error::BadImage(format!(
                    "deputy {pid} has no process in the image"
                )))
            }
        }
    }
    Ok(())
}

/// A PID that is free in the guest namespace and not in the image, for the launcher that makes
/// the root there.
fn helper_pid(tree: &Tree, guest: &GuestNamespaces) -> i32 {
    let ids: HashSet<i32> = image_ids(tree).into_iter().collect();
    let proc_root = guest.proc_root();
    (2..)
        .find(|n| !ids.contains(n) && !proc_root.join(n.to_string()).exists())
        .expect("a free PID")
}

/// A gap for the trampoline that no process of the tree maps.
fn choose_trampoline(tree: &Tree) -> u64 {
    let mut used: Vec<(u64, u64)> = tree
        .processes
        .iter()
        .flat_map(|p| p.vmas.iter().map(|v| (v.start, v.end)))
        .collect();
    used.sort();
    let mut cand = 0x1000_0000u64;
    for (s, e) in used {
        if cand + TRAMPOLINE_LEN <= s {
            break;
        }
        cand = cand.max(e);
    }
    cand
}

/// Rebuilds the tree of `img` in our namespaces and lets it run: [`restore_with`] with the
/// default options, then [`RestoredTree::resume`].
pub fn restore<R: Read>(img: &mut OpenImage<R>) -> Result<RestoreReport> {
    restore_with(img, &RestoreOptions::default())?.resume()
}

/// A rebuilt tree, held stopped: every process and thread exists with all its state, and only
/// the final detach is left. [`RestoredTree::resume`] lets it run; [`RestoredTree::kill`] (or
/// dropping it) kills every process of it, so no half-built tree is ever left behind.
///
/// ptrace belongs to the thread that attached: only the thread that called [`restore_with`]
/// can resume or reap the tree. The type is therefore neither `Send` nor `Sync`. If that thread
/// (or ferry) dies first, PTRACE_O_EXITKILL kills the tree.
pub struct RestoredTree {
    husks: Vec<Husk>,
    /// Per live process: its PID (the tree's) and the host TIDs of its threads, leader first.
    live: Vec<(i32, Vec<i32>)>,
    /// Main threads (host TIDs) that had exited in the image while their process ran on: each
    /// is made to exit as it is let go.
    exiting_leaders: Vec<i32>,
    report: RestoreReport,
    /// Socket addresses another socket held while the tree was rebuilt.
    deferred: Deferred,
    /// File locks another holder still had while the tree was rebuilt.
    deferred_locks: locks::Deferred,
    finish_started: Instant,
    /// The relay's ends of relayed pipes (`RestoreOptions::relays`), by `Pipe::id`: held
    /// until the tree is let go or killed, for the daemon to take.
    relay_ends: Vec<(u32, std::os::fd::OwnedFd)>,
    done: bool,
    /// The listeners of Ferry's filter, one per process (`RestoreOptions::supervised`).
    listeners: Vec<std::os::fd::OwnedFd>,
    /// The relayed sockets' names at home, for the supervisor (`RestoreOptions::supervised`).
    relayed_names: Vec<crate::resources::sockets::RelayedNames>,
    _tracer_thread: std::marker::PhantomData<*const ()>,
}

impl RestoredTree {
    /// The seccomp listeners of a supervised tree (`RestoreOptions::supervised`): whoever
    /// answers them must live as long as the tree (the guest init does).
    pub fn take_listeners(&mut self) -> Vec<std::os::fd::OwnedFd> {
        std::mem::take(&mut self.listeners)
    }

    /// The names each relayed socket had at home, by the inode of the socket the tree holds
    /// now: the supervisor answers getsockname and getpeername of those with them.
    pub fn relayed_names(&self) -> &[crate::resources::sockets::RelayedNames] {
        &self.relayed_names
    }

    /// What was rebuilt (the timings so far; `finish_ms` is completed by `resume`).
    pub fn report(&self) -> &RestoreReport {
        &self.report
    }

    /// The root's PID in our namespace.
    pub fn root_host_pid(&self) -> i32 {
        self.report.root_host_pid
    }

    /// The relay's end of each relayed pipe: (`Pipe::id`, our descriptor number), valid
    /// until the tree is let go or killed.
    pub fn relay_ends(&self) -> Vec<(u32, i32)> {
        use std::os::fd::AsRawFd;
        self.relay_ends
            .iter()
            .map(|(id, fd)| (*id, fd.as_raw_fd()))
            .collect()
    }

    /// Lets every thread run, detached from us. First the sockets get the addresses that were
    /// still taken when they were rebuilt (waiting up to 3 s for them; see [`Deferred`]). If
    /// that fails or a thread cannot be let go, the whole tree is killed and the error
    /// returned.
    pub fn resume(mut self) -> Result<RestoreReport> {
        let deferred = std::mem::take(&mut self.deferred);
        let deferred_locks = std::mem::take(&mut self.deferred_locks);
        let mut hosts: HashMap<i32, i32> = self
            .live
            .iter()
            .filter_map(|(pid, tids)| Some((*pid, *tids.first()?)))
            .collect();
        // Zombies too: a pidfd in flight may name one (see `sockets::scm`).
        for h in &self.husks {
            hosts.entry(h.pid).or_insert(h.host);
        }
        if let Err(e) = deferred
            .complete(self.report.root_pid, DEFERRED_WAIT, &hosts)
            .and_then(|()| deferred_locks.complete(self.report.root_pid, DEFERRED_WAIT))
        {
            self.kill_all();
            return Err(e);
        }
        for &leader in &self.exiting_leaders {
            if let Err(e) = exit_on_release(leader) {
                self.kill_all();
                return Err(e);
            }
        }
        for (pid, tids) in &self.live {
            for tid in tids {
                if let Err(e) = ptrace::detach(*tid, 0) {
                    let err = Error::Restore {
                        pid: *pid,
                        what: format!("let thread {tid} go: {e}"),
                    };
                    self.kill_all();
                    return Err(err);
                }
            }
        }
        self.done = true;
        self.report.finish_ms += self.finish_started.elapsed().as_secs_f64() * 1e3;
        Ok(std::mem::take(&mut self.report))
    }

    /// Kills every process of the tree and waits until each of its threads is dead.
    pub fn kill(mut self) {
        self.kill_all();
    }

    fn kill_all(&mut self) {
        if self.done {
            return;
        }
        self.done = true;
        for h in self.husks.iter().rev() {
            h.kill();
        }
        // Collect our notification of each death (a leader's comes after its other threads').
        for (_, tids) in &self.live {
            for tid in tids.iter().rev() {
                while let Ok(s) = ferry_sys::wait::wait_tid(*tid, false) {
                    if matches!(
                        s,
                        ferry_sys::wait::WaitStatus::Exited(_)
                            | ferry_sys::wait::WaitStatus::Signaled(_)
                    ) {
                        break;
                    }
                }
            }
        }
    }
}

/// Points a main thread whose original had exited at an exit(0) system call (at a `syscall`
/// instruction of its process, the vDSO's), so that it exits as soon as it is let go, its
/// signals all blocked: it becomes the zombie main thread it was, its process running on.
fn exit_on_release(host: i32) -> Result<()> {
    let at = ferry_inject::find_syscall_insn(host)?;
    let mut regs =
        ptrace::get_regs(host).ctx(host, || "read the main thread's registers".into())?;
    regs.rip = at;
    regs.rax = libc::SYS_exit as u64;
    regs.orig_rax = u64::MAX;
    regs.rdi = 0;
    ptrace::set_regs(host, &regs).ctx(host, || "set the main thread to exit".into())?;
    ptrace::set_sigmask(host, u64::MAX).ctx(host, || "block the main thread's signals".into())
}

impl Drop for RestoredTree {
    fn drop(&mut self) {
        self.kill_all();
    }
}

/// Rebuilds the tree of `img` as `opts` say, reading the rest of the image as it goes, and
/// holds it stopped (see [`RestoredTree`]).
///
/// The order follows the stream: the shared objects are made and filled from their records
/// (which come first), then the processes and their mappings are made, then each record of
/// memory is read into one buffer, piece by piece, and written into its process as it
/// arrives; the image is never held whole. A record's checksum is checked at its end, after
/// its bytes went into a process being built: if it does not match (or the stream is cut
/// short, or a record does not fit), every process made so far is killed, the objects are
/// removed, and the error says what was wrong with the image.
pub fn restore_with<R: Read>(
    img: &mut OpenImage<R>,
    opts: &RestoreOptions<'_>,
) -> Result<RestoredTree> {
    if std::mem::replace(&mut img.records.started, true) {
        return Err(Error::BadImage(
            "this image was already read by a restore".into(),
        ));
    }
    let t0 = Instant::now();
    crate::digests::install(&img.tree);
    check_adoption(&img.tree, opts)?;
    check_pids_free(&img.tree, opts.guest, opts.adopt)?;
    if let (false, Some(release)) = (opts.adopt.is_empty(), opts.release) {
        (release.0)().map_err(|what| Error::Restore {
            pid: img.tree.root_pid,
            what: format!("its deputies were not let go: {what}"),
        })?;
    }
    let relayed_tty = img.tree.files.iter().find_map(|d| match &d.kind {
        ferry_image::FileKind::Tty(t) if t.relayed.is_some() => Some(t.index),
        _ => None,
    });
    let relayed_socket = img.tree.files.iter().find_map(|d| match &d.kind {
        ferry_image::FileKind::Socket(s) if s.relayed => Some(s.ino),
        _ => None,
    });
    if let (Some(ino), false) = (relayed_socket, opts.relays) {
        return Err(Error::BadImage(format!(
            "socket:[{ino}] is relayed from the tree's home node: only the migration that made \
             this image can rebuild it"
        )));
    }
    if let (Some(index), false) = (relayed_tty, opts.relays) {
        return Err(Error::BadImage(format!(
            "/dev/pts/{index} is a terminal relayed from the tree's home node: only the \
             migration that made this image can rebuild it"
        )));
    }
    if let Some(p) = img.tree.pipes.iter().find(|p| p.relayed && !opts.relays) {
        return Err(Error::BadImage(format!(
            "pipe {} (pipe:[{}]) is relayed from the tree's home node: only the migration that \
             made this image can rebuild it",
            p.id, p.ino
        )));
    }
    let mut early = vec![stamp("dest: image checked")];
    ferry_sys::fdops::raise_nofile();
    let objects = RestoreObjects::create(&img.tree, opts.caller)?;
    early.push(stamp("dest: shared objects made"));
    let mut buf = vec![0u8; PIECE];
    // The contents of shared objects come before memory (since format version 2).
    loop {
        match img.records.next()? {
            Item::Object {
                object,
                offset,
                len,
            } => img
                .records
                .fill_object(&img.tree, &objects, object, offset, len, &mut buf)?,
            other => {
                img.records.pending = Some(other);
                break;
            }
        }
    }
    early.push(stamp("dest: shared objects filled"));
    let tree = &img.tree;
    let descs = files::open_descriptions(tree, &objects, opts.guest);
    let deferred = Deferred::take();
    let (descs, relay_ends) = descs?;
    early.push(stamp("dest: descriptions opened"));
    // What the supervisor answers for the relayed sockets (`seccomp::NAMES`).
    let relayed_names = if opts.supervised {
        crate::resources::sockets::relayed_names(tree, &descs)?
    } else {
        Vec::new()
    };
    let spare_fd = tree
        .processes
        .iter()
        .flat_map(|p| p.fds.iter().map(|f| f.fd))
        .max()
        .unwrap_or(2)
        .max(2)
        + 1;
    let trampoline = choose_trampoline(tree);
    let place = match opts.guest {
        None => Place::Here,
        Some(ns) => Place::Guest {
            ns,
            helper_pid: helper_pid(tree, ns),
        },
    };
    let me = ferry_sys::ns::getpid();
    let ferry_pidfd =
        ferry_sys::pidfd::pidfd_open(me).ctx(me, || "open a pidfd of ferry itself".into())?;

    let mut husks: Vec<Husk> = Vec::new();
    let mut live = Vec::new();
    let relayed_files = crate::resources::sockets::relayed_files(tree);
    let mut cx = BuildContext {
        img,
        buf: &mut buf,
        objects: &objects,
        descs: &descs,
        trampoline,
        spare_fd,
        place,
        ferry_pidfd: &ferry_pidfd,
        cpu_cgroup: opts.cpu_cgroup,
        lazy: opts.lazy,
        supervised: opts.supervised,
        adopt: opts.adopt,
        listeners: Vec::new(),
        pages: opts.pages,
        relayed_files,
        early,
    };
    let mut exiting_leaders = Vec::new();
    match build(&mut cx, &mut husks, &mut live, &mut exiting_leaders, t0) {
        Ok((mut report, finish_started)) => {
            report.guest_init_host_pid = opts.guest.map(|g| g.init_host_pid());
            Ok(RestoredTree {
                husks,
                live,
                exiting_leaders,
                report,
                deferred,
                // Left by the descriptions' locks and by the processes' POSIX locks.
                deferred_locks: locks::Deferred::take(),
                finish_started,
                relay_ends,
                done: false,
                listeners: std::mem::take(&mut cx.listeners),
                relayed_names,
                _tracer_thread: std::marker::PhantomData,
            })
        }
        Err(e) => {
            drop(locks::Deferred::take());
            // (Memory streams in after the System V segments are made: a bad record of it
            // must not leave them behind.)
            objects.abandon();
            for h in husks.iter().rev() {
                h.kill();
            }
            Err(e)
        }
    }
}

struct BuildContext<'a, R: Read> {
    img: &'a mut OpenImage<R>,
    buf: &'a mut [u8],
    objects: &'a RestoreObjects,
    descs: &'a HashMap<u32, std::os::fd::OwnedFd>,
    trampoline: u64,
    spare_fd: i32,
    place: Place<'a>,
    ferry_pidfd: &'a std::os::fd::OwnedFd,
    cpu_cgroup: Option<&'a std::path::Path>,
    lazy: Option<&'a dyn crate::lazy::LazyMemory>,
    supervised: bool,
    adopt: &'a [i32],
    listeners: Vec<std::os::fd::OwnedFd>,
    pages: Option<&'a dyn InheritedPages>,
    /// The file ids of the relayed sockets: a process that holds one has its getsockname and
    /// getpeername answered by the supervisor.
    relayed_files: HashSet<u32>,
    /// The steps of the timeline before the build.
    early: Vec<(&'static str, u64)>,
}

fn build<R: Read>(
    cx: &mut BuildContext<'_, R>,
    husks: &mut Vec<Husk>,
    live_tids: &mut Vec<(i32, Vec<i32>)>,
    exiting_leaders: &mut Vec<i32>,
    t0: Instant,
) -> Result<(RestoreReport, Instant)> {
    let tree = &cx.img.tree;
    let mut report = RestoreReport {
        root_pid: tree.root_pid,
        timeline: std::mem::take(&mut cx.early),
        ..Default::default()
    };
    report.stamp("dest: objects and descriptors opened");
    // 1. The processes, parents first, with their sessions and process groups. A tree whose
    // children share pages with their parents copy-on-write (`Process::cow`) gets each
    // process's memory as soon as the process is made, before its children are forked from
    // it: they receive those pages by fork, shared again.
    let cow_order = tree.processes.iter().any(|p| !p.cow.is_empty());
    report.memory_filled_by_uffd = cx.lazy.is_none_or(|l| l.serves_inherited());
    let mut stand_in_groups = HashSet::new();
    for p in &tree.processes {
        // A deputy child sharing pages with its parent is made again from its parent (see
        // `replace_deputy`) where nothing else of it would change: the pages come back shared.
        let refork = cow_order
            && cx.adopt.contains(&p.pid)
            && p.pid != tree.root_pid
            && !p.cow.is_empty()
            && p.zombie_status.is_none()
            && husks
                .iter()
                .find(|x| x.pid == p.ppid)
                .is_some_and(|q| deputy_refork_ok(p, tree, q.host));
        let adopted = cx.adopt.contains(&p.pid) && !refork;
        let h = if refork {
            let parent = husks.iter().find(|x| x.pid == p.ppid).expect("checked");
            replace_deputy(parent, p.pid)?;
            parent.fork_child_sharing(p.pid, p.exit_signal, p.files_shared_with_parent)?
        } else if adopted {
            // Its deputy, in its place at home: parent, group, session and terminal are
            // already those it had there.
            let h = Husk::adopt(p.pid, cx.trampoline, cx.spare_fd)?;
            if p.pid == tree.root_pid {
                report.root_host_pid = h.host;
            }
            h
        } else if p.pid == tree.root_pid {
            let h = Husk::spawn_root(p.pid, cx.trampoline, cx.spare_fd, cx.ferry_pidfd, cx.place)?;
            // A restored tree is detached from whoever restores it: the root leads a session.
            h.injector().syscall("setsid", libc::SYS_setsid, &[])?;
            report.root_host_pid = h.host;
            h
        } else {
            let parent = husks.iter().find(|h| h.pid == p.ppid).ok_or_else(|| {
                Error::BadImage(format!("PID {}: parent {} missing", p.pid, p.ppid))
            })?;
            let h = parent.fork_child_sharing(p.pid, p.exit_signal, p.files_shared_with_parent)?;
            let inherits = !cx.adopt.is_empty()
                && tree
                    .processes
                    .iter()
                    .find(|q| q.pid == p.ppid)
                    .is_some_and(|q| q.sid == p.sid && q.pgid == p.pgid);
            // Coming home, a child in its parent's group and session (as the body saw them)
            // stays in its parent's at home, which is what the image's numbers stood for.
            if !inherits {
                join_session(&h, p, tree, parent, husks, &mut stand_in_groups)?;
            }
            h
        };
        report.pids.push(p.pid);
        report.processes.push(RestoredPid {
            pid: p.pid,
            host_pid: h.host,
        });
        husks.push(h);
        // Its deputy's cgroups and terminal are its home's (a deputy made again has its
        // parent's, which were its own).
        if !adopted && !refork {
            // Into its cgroups before its memory is charged and its CPU affinity set.
            crate::resources::cgroups::restore(
                husks.last().expect("just pushed"),
                p,
                cx.cpu_cgroup,
            )?;
            // A session leader takes its controlling terminal before it forks its session.
            crate::resources::tty::take_ctty(husks.last().expect("just pushed"), p)?;
        }
        if cow_order && p.zombie_status.is_some() && !adopted && p.pid != tree.root_pid {
            // Forked from a parent whose memory is in: it dies with nothing of it (a core it
            // dumps stays tiny).
            memory::take_inherited(husks.last().expect("just pushed"), p, &[])?;
        }
        if cow_order && p.zombie_status.is_none() {
            let h = husks.last().expect("just pushed");
            let parent = (p.pid != tree.root_pid)
                .then(|| {
                    let q = tree.processes.iter().find(|q| q.pid == p.ppid)?;
                    let host = husks.iter().find(|x| x.pid == p.ppid)?.host;
                    Some((q, host, !adopted))
                })
                .flatten();
            memory_early(
                &mut cx.img.records,
                tree,
                cx.objects,
                cx.buf,
                cx.lazy,
                cx.pages,
                p,
                h,
                parent,
                &mut report,
            )?;
        }
    }
    // 2. Zombies die now, leaving their exit status for their parents.
    for (p, h) in tree.processes.iter().zip(husks.iter()) {
        if let Some(status) = p.zombie_status {
            make_zombie(h, status)?;
        }
    }
    report.build_ms = t0.elapsed().as_secs_f64() * 1e3;
    report.stamp("dest: processes made");
    // 3. Address spaces, descriptors, environment, signals, threads.
    let t1 = Instant::now();
    let live: Vec<(&Process, &Husk)> = tree
        .processes
        .iter()
        .zip(husks.iter())
        .filter(|(p, _)| p.zombie_status.is_none())
        .collect();
    let mut thread_injectors: HashMap<i32, ferry_inject::Injector> = HashMap::new();
    if !cow_order {
        for (p, h) in &live {
            memory::restore_mappings(h, p, cx.objects)?;
        }
    }
    report.stamp("dest: mappings made");
    // (With `cow_order`, every process's mappings and the image's memory are in already: what
    // is left of the image is its end marker.)
    let streamed: &[(&Process, &Husk)] = if cow_order { &[] } else { &live };
    if let Some(lazy) = cx.lazy.filter(|l| l.serves_inherited()) {
        // A lazy migration: the image carries what is not left at the source (private pages
        // of file mappings, huge-page mappings); those go in first, the server then supplies
        // what the image names as inherited. A hybrid one: the server supplies
        // `inherited_lazily` from the source, and the inherited pages that came in the
        // pre-copy rounds from the pages it holds (those outside the registered ranges go in
        // first); or, with a server that does not hold them, they all go in first.
        let precopied = lazy.serves_precopied();
        stream_memory(
            &mut cx.img.records,
            tree,
            cx.objects,
            cx.buf,
            streamed,
            cx.pages,
            if precopied {
                InheritedHere::Unregistered
            } else {
                InheritedHere::NotLazily
            },
            false,
            &mut report,
        )?;
        report.stamp("dest: the image's memory in");
        let processes = live
            .iter()
            .map(|(p, h)| crate::lazy::prepare(h, p, precopied))
            .collect::<Result<Vec<_>>>()?;
        report.stamp("dest: userfaultfds registered");
        lazy.start(processes).map_err(|what| Error::Restore {
            pid: tree.root_pid,
            what: format!("start serving its memory lazily: {what}"),
        })?;
        report.stamp("dest: page server started");
        report.memory_lazy = true;
    } else if let Some(lazy) = cx.lazy {
        if let Some(p) = live.iter().find(|(p, _)| !p.inherited.is_empty()) {
            return Err(Error::BadImage(format!(
                "PID {}: the image takes pages from an earlier transfer (pre-copy, or a parent \
                 image), which a lazy restore does not serve yet",
                p.0.pid
            )));
        }
        let processes = live
            .iter()
            .map(|(p, h)| crate::lazy::prepare(h, p, false))
            .collect::<Result<Vec<_>>>()?;
        lazy.start(processes).map_err(|what| Error::Restore {
            pid: tree.root_pid,
            what: format!("start serving its memory lazily: {what}"),
        })?;
        report.memory_lazy = true;
    } else {
        stream_memory(
            &mut cx.img.records,
            tree,
            cx.objects,
            cx.buf,
            streamed,
            cx.pages,
            InheritedHere::All,
            false,
            &mut report,
        )?;
    }
    report.data_bytes = cx.img.records.data_bytes;
    report.memory_ms = t1.elapsed().as_secs_f64() * 1e3;
    let t2 = Instant::now();
    for (p, h) in &live {
        // A table shared with the parent is the parent's, installed by it already.
        if !p.files_shared_with_parent {
            files::install(h, p, tree, cx.descs)?;
        }
        let memfd_exe = memory::memfd_exe(p, cx.objects)?;
        process::restore_environment(h, p, &cx.objects.rights(p), memfd_exe)?;
        signals::restore_actions(h, p)?;
        // The main thread is the husk itself; one that had exited is made to exit again at
        // resume, and every thread of the image is made beside it.
        let others = if p.leader_exited {
            exiting_leaders.push(h.host);
            &p.threads[..]
        } else {
            threads::restore_inside(h, h.injector(), &p.threads[0])?;
            threads::restore_sched(p.pid, h.injector(), &p.threads[0])?;
            &p.threads[1..]
        };
        let mut tids = vec![h.host];
        let want: Vec<i32> = others.iter().map(|t| t.tid).collect();
        let made = h.create_threads(&want)?;
        // Every new thread sets its own state at once, all of them at the same time.
        let inside: Vec<(&ferry_inject::Injector, &ferry_image::Thread)> =
            made.iter().map(|(_, inj)| inj).zip(others).collect();
        threads::restore_inside_all(h, &inside)?;
        for (t, (host, inj)) in others.iter().zip(made) {
            tids.push(host);
            threads::restore_sched(p.pid, &inj, t)?;
            thread_injectors.insert(t.tid, inj);
        }
        live_tids.push((p.pid, tids));
        signals::restore_timers(h, p)?;
        report.threads += p.threads.len();
    }
    // Stopped processes stop again (every thread is there to take part); a stop their
    // parent had collected is collected again.
    let hosts: Vec<i32> = husks.iter().map(|h| h.host).collect();
    for ((p, h), (_, tids)) in live.iter().zip(live_tids.iter()) {
        jobctl::make_stopped(h, p, tids, &hosts)?;
    }
    for (p, _) in live.iter().filter(|(p, _)| p.stop_collected) {
        if let Some((_, parent)) = live.iter().find(|(q, _)| q.pid == p.ppid) {
            jobctl::collect_stop(parent, p.pid)?;
        }
    }
    // 4. The last injected calls: pending signals, credentials, then the trampoline goes.
    let mut owners_done = std::collections::HashSet::new();
    for ((p, h), (_, tids)) in live.iter().zip(live_tids.iter()) {
        if cx.supervised {
            // Still root, every thread there, before its own filters. A process that holds a
            // relayed socket (or shares the table of one that does) has its names answered.
            let holds = |q: &Process| q.fds.iter().any(|f| cx.relayed_files.contains(&f.file));
            let names = holds(p)
                || (p.files_shared_with_parent
                    && live.iter().any(|(q, _)| q.pid == p.ppid && holds(q)));
            cx.listeners.push(seccomp::install_forwarding(p, h, names)?);
        }
        signals::restore_pending(h, p, &thread_injectors)?;
        // Closed in the batch that drops its credentials; one that shares its parent's table
        // has it closed by the parent (earlier in this loop).
        let close_pidfd = if p.files_shared_with_parent {
            h.forget_ferry_pidfd();
            None
        } else {
            h.drop_ferry_pidfd_call()
        };
        let others = p
            .threads
            .iter()
            .filter(|t| t.tid != p.pid)
            .map(|t| {
                thread_injectors.get(&t.tid).ok_or_else(|| Error::Restore {
                    pid: p.pid,
                    what: format!("thread {} was not created", t.tid),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        process::restore_creds_all(h, p, &others, close_pidfd)?;
        // Every process, thread and group exists by now: its files of /proc/PID, and owners
        // of signal-driven I/O, set with the process's own credentials.
        files::install_proc_files(h, p, tree)?;
        files::restore_owners(h, p, tree, &mut owners_done)?;
        h.remove_trampoline()?;
        let thread_hosts = if p.leader_exited {
            &tids[1..]
        } else {
            &tids[..]
        };
        for (t, host) in p.threads.iter().zip(thread_hosts) {
            threads::restore_registers(p.pid, *host, t)?;
        }
        // Last, in the complete process (suspended while we trace it, they act once it runs).
        // A deputy taken over still has the filters it had when it left (they cannot be
        // removed): only those the body added since are installed.
        let kept = if cx.adopt.contains(&p.pid) {
            seccomp::installed(h.host)
        } else {
            0
        };
        seccomp::restore_from(p, h.host, kept)?;
    }
    cx.objects.finish();
    // 5. Only the commit is left (RestoredTree::resume): letting every thread run.
    report.finish_ms = t2.elapsed().as_secs_f64() * 1e3;
    report.stamp("dest: descriptors, threads and registers restored");
    Ok((report, Instant::now()))
}

/// A piece of memory for the writer thread: `len` bytes of `buf` go to `addr` in process
/// `host`.
struct Piece<'a> {
    host: i32,
    mem: &'a ProcMem,
    filler: Option<&'a AnonFiller>,
    vmas: &'a [Vma],
    addr: u64,
    buf: Vec<u8>,
    len: usize,
}

/// Which of the pages the image names as inherited (`Process::inherited`) a restore writes
/// from the pages that came before the image ([`stream_memory`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum InheritedHere {
    /// Every one (no page server, or one that supplies every page of the image).
    All,
    /// Those not `inherited_lazily` (a lazy page server supplies those; a lazy migration,
    /// which has no such list, inherits nothing else).
    NotLazily,
    /// Those not `inherited_lazily` and outside the private anonymous mappings a lazy page
    /// server registers: it supplies the others, from the source or from the pre-copied
    /// pages it holds ([`crate::lazy::LazyMemory::serves_precopied`]).
    Unregistered,
}

/// Reads the image's memory records to its end marker, writing each into its process as it
/// arrives. Two buffers take turns: while a helper thread writes one piece into its process
/// (`process_vm_writev`, which faults in and clears each page of the target first), this
/// thread reads and checksums the next. `inherited` says which of the pages the image names
/// as inherited are written here from `pages` (a lazy page server supplies the others). With
/// `stop_at_other`, it stops at the first record that is for none of `live` (or at the end
/// marker), leaving that record to be read next. (A version 1 image has its shared objects' contents
/// here, after memory: they are filled as they come, except into System V segments, which are
/// filled when they are first attached and so must come first.)
#[allow(clippy::too_many_arguments)]
fn stream_memory<R: Read>(
    records: &mut Records<R>,
    tree: &Tree,
    objects: &RestoreObjects,
    buf: &mut [u8],
    live: &[(&Process, &Husk)],
    pages: Option<&dyn InheritedPages>,
    inherited: InheritedHere,
    stop_at_other: bool,
    report: &mut RestoreReport,
) -> Result<()> {
    // Dropped (closed, which unregisters their ranges) when the memory is in place. A lazy
    // migration's page server supplies every page of the mappings a filler would register
    // (the image carries none there, and no pages come from an earlier transfer): no filler
    // for it, whose userfaultfd would be made in the process by injected calls, registered
    // and closed again in the freeze only for the server's own to be made next.
    let served = |p: &Process| inherited != InheritedHere::All && p.inherited_lazily.is_none();
    let fillers = live
        .iter()
        .map(|(p, h)| match served(p) {
            true => Ok(None),
            false => AnonFiller::open(h, &p.vmas),
        })
        .collect::<Result<Vec<_>>>()?;
    report.memory_filled_by_uffd &= fillers
        .iter()
        .zip(live)
        .all(|(f, (p, _))| f.is_some() || served(p));
    // Pages the image does not carry, from the transfer before it; the image's own records
    // come after and may overwrite them.
    // (Unless a lazy page server supplies them once the records are in.)
    for ((p, h), f) in live.iter().zip(&fillers) {
        let ranges = match (inherited, &p.inherited_lazily) {
            (InheritedHere::All, _) => p.inherited.clone(),
            (InheritedHere::NotLazily, Some(lazily)) => memory::subtract(&p.inherited, lazily),
            (InheritedHere::Unregistered, Some(lazily)) => memory::subtract(
                &memory::subtract(&p.inherited, lazily),
                &crate::lazy::source_ranges_of(&p.vmas),
            ),
            (_, None) => continue,
        };
        report.inherited_bytes += fill_inherited(p, &ranges, h, f.as_ref(), pages, buf)?;
    }
    let by_pid: HashMap<i32, (&Process, i32, &ProcMem, Option<&AnonFiller>)> = live
        .iter()
        .zip(&fillers)
        .map(|((p, h), f)| (p.pid, (*p, h.host, h.mem(), f.as_ref())))
        .collect();
    std::thread::scope(|scope| {
        let (to_writer, pieces) = std::sync::mpsc::sync_channel::<Piece<'_>>(1);
        let (give_back, written) = std::sync::mpsc::channel::<(Vec<u8>, Result<Duration>)>();
        for _ in 0..2 {
            give_back
                .send((vec![0u8; PIECE], Ok(Duration::ZERO)))
                .expect("the receiver is here");
        }
        scope.spawn(move || {
            for piece in pieces {
                let t = Instant::now();
                let r = memory::restore_pages(
                    piece.host,
                    piece.mem,
                    piece.filler,
                    piece.vmas,
                    piece.addr,
                    &piece.buf[..piece.len],
                );
                let failed = r.is_err();
                if give_back.send((piece.buf, r.map(|_| t.elapsed()))).is_err() || failed {
                    break;
                }
            }
        });
        let mut writing = Duration::ZERO;
        let mut reading = Duration::ZERO;
        // A free buffer: one whose piece is in place (or the writer's error).
        let free_buffer = |writing: &mut Duration| -> Result<Vec<u8>> {
            let (buf, r) = written.recv().map_err(|_| Error::Restore {
                pid: tree.root_pid,
                what: "the thread writing memory into the processes stopped".into(),
            })?;
            *writing += r?;
            Ok(buf)
        };
        let read = (|| -> Result<()> {
            loop {
                let t = Instant::now();
                let item = records.next()?;
                reading += t.elapsed();
                match item {
                    Item::Pages { pid, .. } if stop_at_other && !by_pid.contains_key(&pid) => {
                        records.pending = Some(item);
                        return Ok(());
                    }
                    Item::End { .. } if stop_at_other => {
                        records.pending = Some(item);
                        return Ok(());
                    }
                    Item::Pages { pid, addr, len } => {
                        let (p, host, mem, filler) = *by_pid.get(&pid).ok_or_else(|| {
                            Error::BadImage(format!(
                                "memory for PID {pid}, which is no live process of the tree"
                            ))
                        })?;
                        let end = addr.saturating_add(len);
                        if !memory::within_mappings(&p.vmas, addr, end) {
                            return Err(Error::BadImage(format!(
                                "PID {pid}: memory at {addr:x}-{end:x} lies outside its \
                                 mappings (or across a gap between them)"
                            )));
                        }
                        let mut done = 0u64;
                        while done < len {
                            let mut buf = free_buffer(&mut writing)?;
                            let n = (len - done).min(buf.len() as u64) as usize;
                            let t = Instant::now();
                            records.reader.read_data(&mut buf[..n])?;
                            reading += t.elapsed();
                            let piece = Piece {
                                host,
                                mem,
                                filler,
                                vmas: &p.vmas,
                                addr: addr + done,
                                buf,
                                len: n,
                            };
                            if to_writer.send(piece).is_err() {
                                // The writer stopped at an error, which is waiting for us.
                                free_buffer(&mut writing)?;
                            }
                            done += n as u64;
                        }
                        let t = Instant::now();
                        records.reader.end_record()?;
                        reading += t.elapsed();
                        records.data_bytes += len;
                        report.memory_bytes += len;
                    }
                    Item::Object {
                        object,
                        offset,
                        len,
                    } => {
                        if let ObjectRef::Shmem(id) = object {
                            if objects.is_sysv(id) {
                                return Err(Error::BadImage(format!(
                                    "the contents of System V segment {id} come after memory \
                                     (a version {} image): this Ferry needs them first",
                                    records.reader.version()
                                )));
                            }
                        }
                        let t = Instant::now();
                        records.fill_object(tree, objects, object, offset, len, buf)?;
                        reading += t.elapsed();
                    }
                    Item::End { data_bytes, .. } => {
                        if data_bytes != records.data_bytes {
                            return Err(Error::BadImage(format!(
                                "the end marker counts {data_bytes} bytes of data, the image \
                                 held {}",
                                records.data_bytes
                            )));
                        }
                        return Ok(());
                    }
                    Item::Tree(_) => return Err(Error::BadImage("two tree records".into())),
                }
            }
        })();
        drop(to_writer);
        // Every piece sent is in place (or failed) before we answer.
        let mut outcome = read;
        while let Ok((_, r)) = written.recv() {
            match r {
                Ok(d) => writing += d,
                Err(e) if outcome.is_ok() => outcome = Err(e),
                Err(_) => {}
            }
        }
        report.image_read_ms = reading.as_secs_f64() * 1e3;
        report.pages_write_ms = writing.as_secs_f64() * 1e3;
        outcome
    })
}

/// Gives process `p` (its husk `h` just made; with `cow_order`, see `build`) its address space
/// and memory before any child of it is forked: a child receives the pages it shares with its
/// parent (`Process::cow`) by fork. `parent` is its parent's process, PID here, and whether
/// `h` was forked from it (else it is a deputy taken over in place, which copies those pages
/// from its rebuilt parent instead). Eagerly, its records are read from the image (they come
/// in the tree's order); in a lazy migration, those the image carries (the pages its children
/// share among them); in a lazy restore, the pages its children share are taken from the page
/// server's source now, the rest left to the server.
#[allow(clippy::too_many_arguments)]
fn memory_early<R: Read>(
    records: &mut Records<R>,
    tree: &Tree,
    objects: &RestoreObjects,
    buf: &mut [u8],
    lazy: Option<&dyn crate::lazy::LazyMemory>,
    pages: Option<&dyn InheritedPages>,
    p: &Process,
    h: &Husk,
    parent: Option<(&Process, i32, bool)>,
    report: &mut RestoreReport,
) -> Result<()> {
    let kept = match parent {
        Some((q, _, true)) => {
            let kept = memory::kept_from_parent(p, q);
            memory::take_inherited(h, p, &kept)?;
            kept
        }
        _ => Vec::new(),
    };
    memory::restore_mappings_keeping(h, p, objects, &kept)?;
    let live = [(p, h)];
    match lazy {
        None => stream_memory(
            records,
            tree,
            objects,
            buf,
            &live,
            pages,
            InheritedHere::All,
            true,
            report,
        )?,
        Some(l) if l.serves_inherited() => stream_memory(
            records,
            tree,
            objects,
            buf,
            &live,
            None,
            InheritedHere::NotLazily,
            true,
            report,
        )?,
        Some(l) => {
            let mut shared: Vec<(u64, u64)> = tree
                .processes
                .iter()
                .filter(|c| c.ppid == p.pid && c.pid != tree.root_pid)
                .flat_map(|c| c.cow.iter().copied())
                .collect();
            shared.sort_unstable();
            let page = PAGE_SIZE as usize;
            let mut done_to = 0;
            for (s, e) in shared {
                let mut at = s.max(done_to);
                while at < e {
                    let n = ((e - at) as usize).min(buf.len());
                    l.read_early(p.pid, at, &mut buf[..n])
                        .map_err(|what| Error::Restore {
                            pid: p.pid,
                            what: format!(
                                "read the pages its children share at {at:x} from the page \
                                 server's source: {what}"
                            ),
                        })?;
                    for k in (0..n).step_by(page) {
                        let chunk = &buf[k..k + page];
                        if !memory::is_zero(chunk) {
                            let a = at + k as u64;
                            memory::restore_pages(h.host, h.mem(), None, &p.vmas, a, chunk)?;
                        }
                    }
                    at += n as u64;
                }
                done_to = done_to.max(e);
            }
        }
    }
    if let Some((_, parent_host, false)) = parent {
        if lazy.is_some() && !p.cow.is_empty() {
            return Err(Error::BadImage(format!(
                "PID {}: shares pages with its parent, which a lazy restore of a deputy taken \
                 over in place cannot give it",
                p.pid
            )));
        }
        report.memory_bytes += memory::copy_from_parent(h, p, parent_host, None)?;
    }
    Ok(())
}

/// Writes the pages `ranges` of `p` inherits (`Process::inherited`) from `pages` into its
/// husk, in runs of up to `buf`'s size. Returns the bytes written.
fn fill_inherited(
    p: &Process,
    ranges: &[(u64, u64)],
    h: &Husk,
    filler: Option<&AnonFiller>,
    pages: Option<&dyn InheritedPages>,
    buf: &mut [u8],
) -> Result<u64> {
    if ranges.is_empty() {
        return Ok(0);
    }
    let Some(pages) = pages else {
        return Err(Error::BadImage(format!(
            "PID {}: the image takes {} pages from an earlier transfer (pre-copy, or a parent \
             image), and none was given",
            p.pid,
            ranges.iter().map(|(s, e)| (e - s) / PAGE_SIZE).sum::<u64>()
        )));
    };
    let page = PAGE_SIZE as usize;
    let mut total = 0;
    for &(s, e) in ranges {
        let mut at = s;
        while at < e {
            let n = (((e - at) as usize).min(buf.len()) / page).max(1);
            for k in 0..n {
                let a = at + (k * page) as u64;
                let got = pages.page(p.pid, a).ok_or_else(|| {
                    Error::BadImage(format!(
                        "PID {}: page {a:x}, which the image takes from an earlier transfer, \
                         never arrived",
                        p.pid
                    ))
                })?;
                buf[k * page..(k + 1) * page].copy_from_slice(got);
            }
            memory::restore_pages(h.host, h.mem(), filler, &p.vmas, at, &buf[..n * page])?;
            at += (n * page) as u64;
            total += (n * page) as u64;
        }
    }
    Ok(total)
}
