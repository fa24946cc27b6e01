//! Image schema of descriptors backed by anonymous inodes: epoll, timerfd, signalfd, inotify,
//! fanotify.

use serde::{Deserialize, Serialize};

/// An epoll instance and its interest list.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq, Eq)]
pub struct EpollDesc {
    /// In the order /proc/PID/fdinfo lists them.
    pub items: Vec<EpollItem>,
}

/// One entry of an epoll interest list. An item is keyed by the watched file and the
/// descriptor number it was registered under, so it is re-registered from inside a process that
/// holds both the epoll instance and, at number `fd`, that very file.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq, Eq)]
pub struct EpollItem {
    /// The descriptor number the item was registered under (fdinfo's `tfd`).
    pub fd: i32,
    /// The event mask as the kernel holds it (EPOLLIN ..., EPOLLET, EPOLLONESHOT,
    /// EPOLLEXCLUSIVE, EPOLLWAKEUP; EPOLLERR | EPOLLHUP, which the kernel always adds; a
    /// one-shot item that has fired keeps only its flag bits).
    pub events: u32,
    pub data: u64,
    /// The process whose descriptor table holds the watched file at number `fd`.
    pub pid: i32,
}

/// A timerfd with its clock, settings and remaining time.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq, Eq)]
pub struct TimerfdDesc {
    pub clockid: i32,
    /// The flags of the last timerfd_settime: TFD_TIMER_ABSTIME, TFD_TIMER_CANCEL_ON_SET.
    pub settime_flags: i32,
    /// Expirations not read yet.
    pub ticks: u64,
    /// Time to the next expiration, in nanoseconds; 0 when disarmed.
    pub value_ns: u64,
    pub interval_ns: u64,
    /// For an armed TFD_TIMER_ABSTIME timer: the next expiration, as a time of its clock.
    pub deadline_ns: u64,
}

/// A signalfd and its signal mask.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq, Eq)]
pub struct SignalfdDesc {
    /// Bit `n - 1` stands for signal `n`.
    pub sigmask: u64,
}

/// An inotify instance and its watches.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq, Eq)]
pub struct InotifyDesc {
    /// In increasing order of watch descriptor.
    pub watches: Vec<InotifyWatch>,
}

/// One inotify watch.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq, Eq)]
pub struct InotifyWatch {
    /// The watch descriptor, which the process sees in every event.
    pub wd: i32,
    /// The watched file or directory (the object itself: a symbolic link is not followed).
    pub path: String,
    /// IN_* events and IN_ONESHOT / IN_EXCL_UNLINK, as the kernel holds them.
    pub mask: u32,
    /// Device (user-space encoding) and inode of the watched object when it was captured.
    pub dev: u64,
    pub ino: u64,
    /// The object's file handle (name_to_handle_at(2)), for diagnostics (empty for a mount or
    /// filesystem mark).
    pub handle_type: i32,
    #[serde(with = "serde_bytes")]
    pub handle: Vec<u8>,
}

/// A fanotify group (of the notification class) and its inode marks.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq, Eq)]
pub struct FanotifyDesc {
    /// fanotify_init's flags (FAN_CLASS_NOTIF, FAN_CLOEXEC, FAN_NONBLOCK, FAN_UNLIMITED_QUEUE,
    /// FAN_REPORT_* ...), as fdinfo shows them.
    pub flags: u32,
    /// fanotify_init's event_f_flags: how the descriptors events carry are opened.
    pub event_flags: u32,
    /// In the order fdinfo lists them (newest first).
    pub marks: Vec<FanotifyMark>,
}

/// What a fanotify mark is on.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, Default, PartialEq, Eq)]
pub enum FanotifyTarget {
    /// A file or directory (an inode mark).
    #[default]
    Inode,
    /// The mount whose root is `path` (FAN_MARK_MOUNT).
    Mount,
    /// The filesystem of `path` (FAN_MARK_FILESYSTEM).
    Filesystem,
}

impl FanotifyTarget {
    fn is_inode(&self) -> bool {
        *self == FanotifyTarget::Inode
    }
}

/// One mark of a fanotify group.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq, Eq)]
pub struct FanotifyMark {
    /// What is marked (left out for an inode mark).
    #[serde(default, skip_serializing_if = "FanotifyTarget::is_inode")]
    pub target: FanotifyTarget,
    /// The marked file or directory; for a mount or filesystem mark, the mount's root as the
    /// process saw it (the mount point).
    pub path: String,
    /// Device (user-space encoding) and inode of the marked object when it was captured.
    pub dev: u64,
    pub ino: u64,
    /// FAN_MARK_IGNORED_SURV_MODIFY, FAN_MARK_EVICTABLE, as fdinfo's `mflags` shows them.
    pub mflags: u32,
    pub mask: u64,
    pub ignored_mask: u64,
    /// The object's file handle (name_to_handle_at(2)), for diagnostics (empty for a mount or
    /// filesystem mark).
    pub handle_type: i32,
    #[serde(with = "serde_bytes")]
    pub handle: Vec<u8>,
}
