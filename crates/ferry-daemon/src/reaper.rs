//! The daemon is the subreaper of everything it starts or rebuilds: engine workers, programs
//! run for remote callers, and migrated trees (whose restorer exits, leaving them to us). One
//! loop reaps them all and hands each exit status to whoever waits for that PID.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

#[derive(Default)]
pub struct Reaper {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    waiters: HashMap<i32, Vec<oneshot::Sender<i32>>>,
    /// Statuses nobody asked for yet (a child may exit before its waiter registers).
    unclaimed: HashMap<i32, (i32, Instant)>,
}

impl Reaper {
    /// Waits for `pid`, a child of this daemon, to end; returns its wait status.
    pub async fn wait(&self, pid: i32) -> i32 {
        let rx = {
            let mut g = self.inner.lock().expect("reaper lock");
            if let Some((status, _)) = g.unclaimed.remove(&pid) {
                return status;
            }
            let (tx, rx) = oneshot::channel();
            g.waiters.entry(pid).or_default().push(tx);
            rx
        };
        rx.await.unwrap_or(-1)
    }

    /// Reaps every child that has ended. Returns the PIDs reaped.
    pub fn reap(&self) -> Vec<(i32, i32)> {
        let mut done = Vec::new();
        while let Some((pid, status)) = ferry_sys::wait::reap_any() {
            done.push((pid, status));
        }
        let mut g = self.inner.lock().expect("reaper lock");
        for &(pid, status) in &done {
            match g.waiters.remove(&pid) {
                Some(txs) => {
                    for tx in txs {
                        let _ = tx.send(status);
                    }
                }
                None => {
                    g.unclaimed.insert(pid, (status, Instant::now()));
                }
            }
        }
        let now = Instant::now();
        g.unclaimed
            .retain(|_, (_, at)| now.duration_since(*at) < Duration::from_secs(120));
        done
    }
}
