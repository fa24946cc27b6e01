//! The Ferry node daemon. One per machine (several on one machine for a local cluster), each
//! with a name, a listen address and the cluster's credentials.
//!
//! - [`node`]: startup, the peer and CLI doors, shutdown.
//! - [`membership`]: who is in the cluster and how loaded (foca SWIM over mutual TLS).
//! - [`migrate`]: moving a live tree, source and destination sides, with the commit protocol.
//! - [`deputies`]: what ties a moved tree to its home: deputies at home, bodies elsewhere.
//! - [`exec`]: running a command on another node for a caller at home.
//! - [`workers`]: the single-threaded `ferry` processes that run the engine for the daemon.
//! - [`state`], [`outcomes`]: what a daemon records durably and takes up again at start.
//! - [`hosts`], [`evict`]: who may use this machine (the owner's policy), who holds it (host
//!   grants), and sending its guests away.
//! - [`balancer`], [`traffic`]: automatic load balancing, and the byte counts it weighs.
//! - [`guests`], [`load`], [`reaper`]: bookkeeping.
//! - [`view`], [`web`], [`metrics`]: the cluster's picture (`ferry top`), the read-only page,
//!   the Prometheus metrics.

#![forbid(unsafe_code)]

pub mod balancer;
pub mod config;
pub mod confine;
pub mod deputies;
pub mod engine_cmd;
pub mod evict;
pub mod exec;
pub mod guests;
pub mod hosts;
pub mod links;
pub mod load;
pub mod membership;
pub mod metrics;
pub mod migrate;
pub mod migrate_lazy;
pub mod node;
pub mod outcomes;
pub mod reaper;
pub mod recovery;
pub mod relay;
pub mod relay_join;
pub mod relay_keep;
pub mod relay_pipe;
pub mod relay_standin;
pub mod relay_tty;
pub mod state;
pub mod traffic;
pub mod view;
pub mod web;
pub mod workers;

pub use config::Config;
