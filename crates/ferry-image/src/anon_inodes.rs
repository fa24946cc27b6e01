//! Image schema of descriptors backed by anonymous inodes: epoll, timerfd, signalfd, inotify.

use serde::{Deserialize, Serialize};

/// An epoll instance and its interest list.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq, Eq)]
pub struct EpollDesc {}

/// A timerfd with its clock, settings and remaining time.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq, Eq)]
pub struct TimerfdDesc {}

/// A signalfd and its signal mask.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq, Eq)]
pub struct SignalfdDesc {}

/// An inotify instance and its watches.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq, Eq)]
pub struct InotifyDesc {}
