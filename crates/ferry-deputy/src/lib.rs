//! The deputy (MOSIX's name; Sprite's home machine): what a moved process leaves at home.
//!
//! A process that migrates away from its home node does not vanish there. Its original, frozen
//! for the capture, is kept instead of killed: its memory is given back, and it stays parked,
//! traced, inside a `pause` it never returns from. It keeps what only the home has: its PID and
//! its place in the process tree (its parent's `wait` still names it, `ps` and `/proc` show it),
//! its process group, session and controlling terminal, and its open descriptors. The body (the
//! process running on another node) is its remote half:
//!
//! - a signal sent to the PID at home stops in the deputy (a signal-delivery stop of its tracer)
//!   and is forwarded to the body, whose own mask and handlers decide what it does;
//! - when the body ends, the deputy ends the same way (the same exit code, or killed by the
//!   same signal), so its parent's `wait` sees exactly what it would have seen;
//! - a deputy killed at home (SIGKILL cannot be intercepted) is reported, and its body killed.
//!
//! [`home::Deputies`] is the home side. It runs in the engine worker that captured the tree
//! (the deputies' tracer from the freeze on), driven by the daemon.

#![forbid(unsafe_code)]

pub mod home;
