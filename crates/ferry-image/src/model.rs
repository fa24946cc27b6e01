//! The captured state of a process tree. Every type here is CBOR-encoded into the image; fields
//! are only ever added (with `#[serde(default)]`), never renamed or reused.

use serde::{Deserialize, Serialize};

/// Everything about a tree except the bytes of its memory, which follow in `Pages` records.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
pub struct Tree {
    pub root_pid: i32,
    /// Parents come before their children.
    pub processes: Vec<Process>,
    /// Open file descriptions, shared by every fd (in any process) that refers to them.
    pub files: Vec<FileDesc>,
    /// Pipes and FIFOs, with the bytes that were buffered in them.
    pub pipes: Vec<Pipe>,
    /// Shared memory objects (MAP_SHARED anonymous memory, memfd, SysV shm) whose contents
    /// follow in `ObjectData` records.
    pub shmem: Vec<ShmemObject>,
    /// Files that were deleted while still open or mapped; their contents follow in
    /// `ObjectData` records.
    pub ghosts: Vec<GhostFile>,
    #[serde(default)]
    pub source: Source,
    /// The clocks as the tree saw them when it was captured (host clock plus the offsets of the
    /// tree's time namespace); absent in images from before this field existed. A destination
    /// that rebuilds the tree in a time namespace of its own starts it from these values, so
    /// that CLOCK_MONOTONIC and CLOCK_BOOTTIME never run backwards.
    #[serde(default)]
    pub clocks: Option<Clocks>,
    /// For an incremental checkpoint: the image its processes' `inherited` pages come from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<ParentImage>,
    /// The contents of the regular files the tree holds or maps by path, as captured: on
    /// another machine (another device and inode under the same path) a file is the one
    /// captured if its contents are these.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub digests: Vec<FileDigest>,
}

/// What a regular file held: its SHA-256 and size, for the file (`dev`, `ino`) captured.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq, Eq)]
pub struct FileDigest {
    pub dev: u64,
    pub ino: u64,
    pub size: u64,
    pub sha256: [u8; 32],
}

/// The parent of an incremental image: where it was, and what it was (a restore refuses a
/// parent whose bytes are not exactly these).
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq, Eq)]
pub struct ParentImage {
    /// The parent's image directory, absolute.
    pub dir: String,
    /// XXH3-64 of the parent's whole image file.
    pub digest: u64,
    /// Its size in bytes.
    pub bytes: u64,
}

/// A seccomp filter: a classic BPF program and the flags it was installed with.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq, Eq)]
pub struct SeccompFilter {
    /// Raw `struct sock_filter`s, 8 bytes each.
    #[serde(with = "serde_bytes")]
    pub program: Vec<u8>,
    /// SECCOMP_FILTER_FLAG_LOG / _SPEC_ALLOW.
    pub flags: u64,
}

/// Readings of the clocks that a time namespace can shift, in nanoseconds.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, Default, PartialEq, Eq)]
pub struct Clocks {
    pub monotonic_ns: u64,
    pub boottime_ns: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize, Default)]
pub struct Source {
    pub hostname: String,
    pub kernel: String,
    pub boot_id: String,
    pub captured_unix_ms: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize, Default)]
pub struct Process {
    pub pid: i32,
    pub ppid: i32,
    pub pgid: i32,
    pub sid: i32,
    pub comm: String,
    pub cmdline: Vec<String>,
    pub exe: String,
    pub cwd: String,
    /// Which directory `cwd` named when captured (absent in older images, and for a removed
    /// one): a restore enters it only if the path still names it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd_identity: Option<FileIdentity>,
    pub root: String,
    /// Which directory `root` named when captured, for a chrooted process (absent in older
    /// images and when the root is `/`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub root_identity: Option<FileIdentity>,
    pub umask: u32,
    pub personality: u32,
    pub no_new_privs: bool,
    /// Seccomp filters, oldest first (every thread has the same ones).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub seccomp: Vec<SeccompFilter>,
    pub creds: Creds,
    pub rlimits: Vec<Rlimit>,
    pub mm: MmLayout,
    pub vmas: Vec<Vma>,
    pub threads: Vec<Thread>,
    /// One entry per signal 1..=64.
    pub sigactions: Vec<SigAction>,
    pub fds: Vec<Fd>,
    pub itimers: Vec<ITimer>,
    pub posix_timers: Vec<PosixTimer>,
    /// Signals pending for the whole thread group, as raw 128-byte siginfo.
    pub shared_pending: Vec<SigInfo>,
    /// Set for a zombie: the wait status its parent will collect.
    pub zombie_status: Option<i32>,
    /// Signal sent to the parent when this process dies (usually SIGCHLD).
    pub exit_signal: i32,
    #[serde(default)]
    pub prctl: PrctlState,
    /// Set for a process stopped by job control: the signal that stopped it (SIGSTOP,
    /// SIGTSTP, SIGTTIN or SIGTTOU).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_signal: Option<i32>,
    /// For a stopped process: its parent (in the tree) had already collected the stop with
    /// `wait*(WUNTRACED)`, so it must not be reported to it again.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub stop_collected: bool,
    /// The process was continued (SIGCONT after a stop) and its parent (in the tree) has not
    /// yet collected that with `wait*(WCONTINUED)`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub continued_uncollected: bool,
    /// /proc/PID/oom_score_adj (absent in older images: left as the restorer's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oom_score_adj: Option<i32>,
    /// The audit login uid (/proc/PID/loginuid; 4294967295 when unset), where the kernel
    /// has audit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loginuid: Option<u32>,
    /// Pages of this process that the image does not carry because whoever restores it has
    /// them already from an earlier transfer: the pre-copy rounds of a migration, or the
    /// parent image of an incremental checkpoint (`Tree::parent`). Page-aligned
    /// `[start, end)` ranges inside its private mappings; every page of them must be
    /// supplied, or the restore fails.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub inherited: Vec<(u64, u64)>,
    /// A hybrid migration (pre-copy rounds, then the rest lazily): the pages of `inherited`
    /// that the source still holds and a page server fetches once the process runs (as it
    /// touches them, the rest pushed); the other inherited pages came ahead of the image, in
    /// the rounds, and are written before it runs. `None`: every inherited page comes from one
    /// place (pre-copy rounds, a parent image, or a lazy migration's source).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inherited_lazily: Option<Vec<(u64, u64)>>,
    /// Pages of this process that are its parent's, copy-on-write: when it was captured, the
    /// same physical page was mapped at the same address in its parent (shared since a fork
    /// and written by neither since). The image stores them once, in the parent's pages; a
    /// restore forks this process from its parent once the parent's memory is in, keeping the
    /// parent's mapping there, so that they are shared again. Page-aligned `[start, end)`
    /// ranges, sorted, each inside a private anonymous mapping that lies within one of the
    /// parent's with the same flags ([`cow_compatible`]). Format version 4.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cow: Vec<(u64, u64)>,
    /// membarrier(2) registrations of the address space: the MEMBARRIER_CMD_REGISTER_*
    /// commands it issued (MEMBARRIER_CMD_GET_REGISTRATIONS).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub membarrier: u32,
    /// The process shares its parent's descriptor table (made with CLONE_FILES): its `fds`
    /// are the parent's, and it is rebuilt sharing the parent's table again.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub files_shared_with_parent: bool,
    /// The cgroups the process was in, one per hierarchy (/proc/PID/cgroup).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cgroups: Vec<Cgroup>,
    /// The main thread had exited (its thread a zombie) while the others ran on: `threads`
    /// holds only those, and the main thread is made to exit again when the tree resumes.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub leader_exited: bool,
}

/// Membership of one cgroup hierarchy.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq, Eq)]
pub struct Cgroup {
    /// The hierarchy's controllers as /proc/PID/cgroup lists them ("cpu,cpuacct",
    /// "name=systemd"); empty for the unified (v2) hierarchy.
    pub controllers: String,
    /// The cgroup's path in that hierarchy.
    pub path: String,
}

fn is_zero(v: &u32) -> bool {
    *v == 0
}

/// Process attributes set with prctl(2).
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq, Eq)]
pub struct PrctlState {
    pub pdeathsig: i32,
    pub dumpable: u32,
    pub child_subreaper: bool,
    pub thp_disable: bool,
    /// Memory-deny-write-execute bits (PR_SET_MDWE).
    pub mdwe: u32,
}

/// Scheduling attributes of a thread.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq, Eq)]
pub struct Sched {
    /// Policy, with SCHED_RESET_ON_FORK when set.
    pub policy: i32,
    pub priority: i32,
    pub nice: i32,
    pub ioprio: i32,
    pub affinity: Vec<u64>,
    pub timerslack_ns: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq, Eq)]
pub struct Creds {
    /// real, effective, saved, filesystem
    pub uids: [u32; 4],
    pub gids: [u32; 4],
    pub groups: Vec<u32>,
    pub cap_inh: u64,
    pub cap_prm: u64,
    pub cap_eff: u64,
    pub cap_bnd: u64,
    pub cap_amb: u64,
    pub securebits: u32,
}

#[derive(Debug, Clone, Serialize, Deserialize, Default)]
pub struct Rlimit {
    pub resource: u32,
    pub cur: u64,
    pub max: u64,
}

/// The kernel's bookkeeping of where things are in the address space (/proc/PID/stat).
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
pub struct MmLayout {
    pub start_code: u64,
    pub end_code: u64,
    pub start_data: u64,
    pub end_data: u64,
    pub start_brk: u64,
    pub brk: u64,
    pub start_stack: u64,
    pub arg_start: u64,
    pub arg_end: u64,
    pub env_start: u64,
    pub env_end: u64,
    pub auxv: Vec<u64>,
}

#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq, Eq)]
pub struct Vma {
    pub start: u64,
    pub end: u64,
    /// PROT_READ | PROT_WRITE | PROT_EXEC
    pub prot: u32,
    pub shared: bool,
    /// Offset into the backing object, in bytes.
    pub offset: u64,
    pub backing: Backing,
    /// What /proc/PID/maps called it ("[heap]", "[stack]", a path ...).
    pub name: String,
    pub growsdown: bool,
    pub dontfork: bool,
    pub wipeonfork: bool,
    pub dontdump: bool,
    pub locked: bool,
    /// `MADV_HUGEPAGE` was given (VmFlags `hg`).
    #[serde(default)]
    pub hugepage: bool,
    /// `MADV_NOHUGEPAGE` was given (VmFlags `nh`).
    #[serde(default)]
    pub nohugepage: bool,
    /// Part of it was backed by transparent huge pages (smaps `AnonHugePages` above 0): its
    /// pages are written so that the kernel can give it huge pages again.
    #[serde(default)]
    pub huge_pages: bool,
    /// A shared mapping that may be made writable (VmFlags `mw`: its file was opened for
    /// writing), whatever its protection now.
    #[serde(default)]
    pub may_write: bool,
    /// `MADV_MERGEABLE` (VmFlags `mg`).
    #[serde(default)]
    pub mergeable: bool,
    /// `MADV_SEQUENTIAL` (VmFlags `sr`).
    #[serde(default)]
    pub sequential: bool,
    /// `MADV_RANDOM` (VmFlags `rr`).
    #[serde(default)]
    pub random: bool,
    /// Locked on fault (`mlock2(MLOCK_ONFAULT)`, `mlockall(MCL_ONFAULT)`: VmFlags `lf`).
    #[serde(default)]
    pub lock_onfault: bool,
    /// Mapped with `MAP_NORESERVE` (VmFlags `nr`): no swap is reserved for it. Made so again,
    /// which also keeps it apart from a neighbour alike in all else (the kernel merges two
    /// adjacent mappings only when their flags are the same).
    #[serde(default)]
    pub noreserve: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq, Eq)]
pub enum Backing {
    /// Private anonymous memory (heap, stacks, most data).
    #[default]
    Anonymous,
    /// A file on disk: `file` indexes `Tree::files` when the file was open, else it is
    /// identified by path (and checked by size and inode when it is mapped again).
    File {
        path: String,
        dev: u64,
        ino: u64,
        size: u64,
        ghost: Option<u32>,
    },
    /// A shared memory object in `Tree::shmem`.
    Shmem {
        object: u32,
    },
    Vdso,
    Vvar,
    VvarVclock,
    Vsyscall,
    /// The ring of a kernel AIO context (`io_setup`; `/[aio] (deleted)` in /proc/PID/maps),
    /// whose address is the context's id. Its pages are not stored: the restore makes a
    /// context with a ring of the same size, moves it here and puts back the completions the
    /// process had not reaped.
    AioRing(AioRing),
    /// The rings of packet socket `ino` (`PacketState::rx_ring`, `tx_ring`), mapped whole:
    /// mapped again from the rebuilt socket, whose rings hold the frames' contents.
    PacketRing {
        ino: u64,
    },
}

/// What a kernel AIO context's ring held at the capture: its header (`struct aio_ring`) and
/// the completions between its head and tail (`struct io_event`s, 32 bytes each, oldest
/// first). Requests still in flight are not in it (the kernel shows them nowhere).
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq, Eq)]
pub struct AioRing {
    /// `nr`: the number of `io_event` slots (the ring's size, less its 32-byte header).
    pub nr: u32,
    pub head: u32,
    pub tail: u32,
    pub magic: u32,
    pub compat_features: u32,
    pub incompat_features: u32,
    pub header_length: u32,
    /// The unreaped completions, from `head` to `tail` (wrapping at `nr`).
    #[serde(with = "serde_bytes")]
    pub events: Vec<u8>,
}

#[derive(Debug, Clone, Serialize, Deserialize, Default)]
pub struct Thread {
    pub tid: i32,
    pub comm: String,
    /// General registers in `user_regs_struct` order.
    pub gp_regs: Vec<u64>,
    /// The XSAVE area (x87, SSE, AVX ...).
    #[serde(with = "serde_bytes")]
    pub xstate: Vec<u8>,
    pub sigmask: u64,
    pub pending: Vec<SigInfo>,
    pub altstack: AltStack,
    pub robust_list: u64,
    pub robust_list_len: u64,
    pub rseq: Option<Rseq>,
    pub clear_child_tid: u64,
    /// How the thread's interrupted system call, if any, is to be resumed.
    pub syscall: SyscallState,
    #[serde(default)]
    pub sched: Sched,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, Default, PartialEq, Eq)]
pub enum SyscallState {
    /// Not in a system call: registers are resumed as they are.
    #[default]
    None,
    /// Stopped inside system call `nr`; on resume it is issued again with the same arguments.
    Restart { nr: u64 },
}

#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq, Eq)]
pub struct AltStack {
    pub sp: u64,
    pub flags: i32,
    pub size: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq, Eq)]
pub struct Rseq {
    pub addr: u64,
    pub len: u32,
    pub sig: u32,
}

#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq, Eq)]
pub struct SigAction {
    pub handler: u64,
    pub flags: u64,
    pub restorer: u64,
    pub mask: u64,
}

/// A raw `siginfo_t` (128 bytes).
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq, Eq)]
pub struct SigInfo(#[serde(with = "serde_bytes")] pub Vec<u8>);

impl SigInfo {
    pub fn signo(&self) -> i32 {
        self.0
            .get(0..4)
            .and_then(|b| b.try_into().ok())
            .map_or(0, i32::from_ne_bytes)
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq, Eq)]
pub struct ITimer {
    pub which: i32,
    pub interval_us: u64,
    pub value_us: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq, Eq)]
pub struct PosixTimer {
    pub id: i32,
    pub clock: i32,
    pub signo: i32,
    pub notify: i32,
    pub notify_tid: i32,
    pub sigev_value: u64,
    pub interval_ns: u64,
    pub value_ns: u64,
    pub overrun: i32,
}

/// One descriptor of a process.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq, Eq)]
pub struct Fd {
    pub fd: i32,
    /// Index into `Tree::files`.
    pub file: u32,
    pub cloexec: bool,
    /// POSIX (fcntl F_SETLK) locks this process holds, taken through this descriptor.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub posix_locks: Vec<FileLock>,
}

/// A file lock: flock(2) (a whole-file lock; `start`/`end` are 0/None), an OFD lock (fcntl
/// F_OFD_SETLK) or a POSIX lock (fcntl F_SETLK). flock and OFD locks belong to an open file
/// description (`FileDesc::locks`), POSIX locks to a process (`Fd::posix_locks`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct FileLock {
    pub kind: LockKind,
    /// A write (exclusive) lock; otherwise a read (shared) one.
    pub write: bool,
    pub start: u64,
    /// The last byte locked; `None`: to the end of the file, however far it grows.
    pub end: Option<u64>,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
pub enum LockKind {
    Flock,
    Ofd,
    Posix,
    /// A file lease (fcntl F_SETLEASE; `write`: F_WRLCK, else F_RDLCK), of the description
    /// (`FileDesc::locks`), taken again by the first process holding it. Absent from older
    /// images.
    Lease,
}

/// An open file description (what `dup` and `fork` share).
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq, Eq)]
pub struct FileDesc {
    pub id: u32,
    /// O_* status flags (access mode, O_APPEND, O_NONBLOCK ...).
    pub flags: i32,
    pub pos: i64,
    pub kind: FileKind,
    /// flock and OFD locks held through this description.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub locks: Vec<FileLock>,
    /// For a description opened by path (a regular file that was not deleted, a directory, a
    /// device, a FIFO, an O_PATH name): which file the path named when it was captured. A
    /// restore opens the path again and refuses a file that is not this one. Absent in images
    /// from before this field existed (then only the rights of the process are checked).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub identity: Option<FileIdentity>,
    /// Who gets the signals of signal-driven I/O (O_ASYNC; SIGURG for a socket): fcntl
    /// F_SETOWN / F_SETOWN_EX, a thread, a process or a process group of the tree (tree PIDs).
    /// Absent: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<FileOwner>,
    /// The signal sent for signal-driven I/O (fcntl F_SETSIG); 0: SIGIO, without `si_fd`.
    #[serde(default, skip_serializing_if = "is_zero_i32")]
    pub io_signal: i32,
}

fn is_zero_i32(n: &i32) -> bool {
    *n == 0
}

/// The owner of an open file description for signal-driven I/O (fcntl F_GETOWN_EX).
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
pub struct FileOwner {
    pub kind: OwnerKind,
    /// The thread's TID, the process's PID or the group's PGID, as the tree sees them.
    pub pid: i32,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
pub enum OwnerKind {
    /// F_OWNER_TID: one thread.
    Thread,
    /// F_OWNER_PID: a process (F_SETOWN with a positive PID).
    Process,
    /// F_OWNER_PGRP: a process group (F_SETOWN with a negative PID).
    Group,
}

/// What makes a file the one that was captured: its inode, and for a regular file its size
/// and last change. Read with stat(2) on the process's own descriptor while it was frozen.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, Default, PartialEq, Eq)]
pub struct FileIdentity {
    pub dev: u64,
    pub ino: u64,
    /// st_mode: the file type and permission bits.
    pub mode: u32,
    /// st_rdev of a device.
    pub rdev: u64,
    pub size: u64,
    /// st_ctime: the last change of the inode or its contents.
    pub ctime_sec: i64,
    pub ctime_nsec: i64,
}

#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq, Eq)]
pub enum FileKind {
    #[default]
    Unknown,
    Regular {
        path: String,
        size: u64,
        ghost: Option<u32>,
    },
    Directory {
        path: String,
        /// The directory had been removed (rmdir) while held: it is made again empty, opened
        /// and removed (its mode is `FileDesc::identity`'s).
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        removed: bool,
    },
    /// A character or block device opened by path (/dev/null, /dev/zero, /dev/urandom ...; the
    /// machine's own devices: the console, virtual terminals, serial ttys, /dev/vcs*).
    Device {
        path: String,
        rdev: u64,
        /// A terminal device (the console, /dev/ttyN, /dev/ttySN): the terminal it leads to
        /// (TIOCGDEV, encoded as `st_rdev`): for /dev/console the active console, for /dev/tty0
        /// the virtual terminal in the foreground when it was opened. A restore must reach the
        /// same one.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        terminal: Option<u64>,
        /// /dev/kmsg open for reading: its read position, the sequence number of the next
        /// record it reads (docs/image-format.md).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        kmsg_seq: Option<u64>,
    },
    /// One end of pipe `pipe` in `Tree::pipes` (a FIFO when `Pipe::fifo_path` is set); which
    /// end follows from the access mode in `FileDesc::flags`.
    Pipe {
        pipe: u32,
    },
    EventFd {
        count: u64,
        semaphore: bool,
    },
    /// memfd opened as a file: the shared memory object `object`.
    Memfd {
        object: u32,
    },
    Epoll(crate::EpollDesc),
    Timerfd(crate::TimerfdDesc),
    Signalfd(crate::SignalfdDesc),
    Inotify(crate::InotifyDesc),
    Socket(crate::SocketDesc),
    /// One side of a pseudo-terminal.
    Tty(crate::TtyDesc),
    /// An O_PATH descriptor of something that is neither a regular file nor a directory (a
    /// symbolic link, with O_NOFOLLOW; a device node; a socket file or FIFO): a name and
    /// nothing else. (O_PATH descriptors of files and directories are `Regular` and
    /// `Directory`; their flags say O_PATH.)
    PathOnly {
        path: String,
    },
    /// A pidfd of process `pid` of the tree (a pidfd of a process outside the tree is refused).
    Pidfd {
        pid: i32,
    },
    /// A fanotify group with its inode marks (after the others: images without one read as
    /// before).
    Fanotify(crate::FanotifyDesc),
    /// A file of /proc/PID of process (or thread) `pid` of the tree, as the tree numbers it
    /// (/proc/self/status opened by the process itself, say): `rest` is the path under
    /// /proc/PID ("/status", "/fd", "" for the directory itself; a `/task/TID` in it names a
    /// thread of the tree by the tree's number too). Opened again by the rebuilt process
    /// itself once every process of the tree exists (last: images without one read as before).
    ProcFile {
        pid: i32,
        rest: String,
    },
}

#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq, Eq)]
pub struct Pipe {
    pub id: u32,
    pub ino: u64,
    pub capacity: u64,
    #[serde(with = "serde_bytes")]
    pub buffered: Vec<u8>,
    /// Lengths of the pipe buffers holding `buffered`: packet boundaries in a packet-mode
    /// (O_DIRECT) pipe.
    #[serde(default)]
    pub packets: Vec<u64>,
    pub fifo_path: Option<String>,
    /// The FIFO had been unlinked while held: a restore makes one again under that name (its
    /// mode is the identity's of a description of it), opens it and unlinks it at once.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub fifo_removed: bool,
    /// An anonymous pipe whose other end a process outside the tree holds, at the tree's home:
    /// the home's deputy keeps that end and the daemons relay between it and a pipe made anew
    /// at the destination (see ARCHITECTURE.md, "Relays"). Rebuilt empty (what was buffered
    /// is still in the home's pipe), and only by a migration, which takes the other end.
    #[serde(default)]
    pub relayed: bool,
    /// A relayed pipe of a body moving on (B to C): the pipe is the body node's stand-in for
    /// relay `relay` of the tree's home (`RelayOpen::pipe`), captured with what is buffered in
    /// it (bytes the body has not read yet, or has written and the relay not taken yet); the
    /// restore refills it and gives the relay's end to the new node, which attaches it to the
    /// same relay at home (docs/wire-format.md, "Moving on with relays").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub relay: Option<u32>,
}

#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq, Eq)]
pub struct ShmemObject {
    pub id: u32,
    pub kind: ShmemKind,
    pub size: u64,
    pub ino: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq, Eq)]
pub enum ShmemKind {
    /// MAP_SHARED | MAP_ANONYMOUS memory, shared over fork.
    #[default]
    Anonymous,
    Memfd {
        name: String,
        seals: u32,
    },
    SysV {
        key: i32,
        shmid: i32,
        mode: u32,
    },
}

#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq, Eq)]
pub struct GhostFile {
    pub id: u32,
    pub path: String,
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub size: u64,
}

/// Whether a child's private anonymous mapping `v` can be the one it received from its
/// parent's mapping `w` by fork and still holds (so that pages shared copy-on-write there are
/// shared again when the child is forked from its rebuilt parent): `v` lies within `w`, both
/// are private anonymous, `w` is passed on by fork (no `MADV_DONTFORK`, no
/// `MADV_WIPEONFORK`), and every flag that the child could not give its inherited mapping
/// afterwards (with `mprotect` or `madvise`) is the same.
pub fn cow_compatible(v: &Vma, w: &Vma) -> bool {
    matches!(v.backing, Backing::Anonymous)
        && matches!(w.backing, Backing::Anonymous)
        && !v.shared
        && !w.shared
        && w.start <= v.start
        && v.end <= w.end
        && !w.dontfork
        && !w.wipeonfork
        && v.growsdown == w.growsdown
        && v.noreserve == w.noreserve
        && v.hugepage == w.hugepage
        && v.nohugepage == w.nohugepage
        && v.mergeable == w.mergeable
        && v.sequential == w.sequential
        && v.random == w.random
        && v.dontdump == w.dontdump
}
