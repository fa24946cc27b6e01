//! The processes this node hosts for others: trees migrated here and programs started here by
//! `ferry run`. `ferry ps` asks every node for its list. Each guest is also a record in the
//! daemon's state directory (crate::state), so a restarted daemon takes up the guests that still
//! run (the same PID with the same start time). Programs started by `ferry run` are not
//! recorded: they die with the daemon that started them (their parent-death signal), so there
//! is nothing to take up, and a record (two fsyncs) would sit on every remote run's path.

use crate::state::{self, Store};
use ferry_transport::message::ProcInfo;
use serde::{Deserialize, Serialize};
use std::sync::{Arc, Mutex};

/// Whether a guest of this kind has a durable record (see the module's doc).
fn recorded(p: &ProcInfo) -> bool {
    p.kind != "remote-exec"
}

#[derive(Default)]
pub struct Guests {
    list: Mutex<Vec<ProcInfo>>,
    store: Option<Arc<Store>>,
}

/// A guest as recorded: who it is, and which process (its start time pins the PID).
#[derive(Serialize, Deserialize)]
struct Record {
    info: ProcInfo,
    start_time: u64,
}

impl Guests {
    /// The guests recorded in `store` whose processes still run; records of the others go.
    pub fn recover(store: Arc<Store>) -> Guests {
        let mut list = Vec::new();
        for (key, r) in store.load::<Record>(state::GUEST) {
            if state::start_time(r.info.pid) == Some(r.start_time) {
                tracing::info!(event = "guest-recovered", pid = r.info.pid,
                    home = %r.info.home_node, home_pid = r.info.home_pid);
                list.push(r.info);
            } else {
                tracing::info!(event = "guest-ended", pid = r.info.pid,
                    home = %r.info.home_node, home_pid = r.info.home_pid,
                    status = "gone while the daemon was down");
                store.remove_or_log(state::GUEST, &key);
            }
        }
        Guests {
            list: Mutex::new(list),
            store: Some(store),
        }
    }

    pub fn add(&self, p: ProcInfo) {
        if let Some(s) = self.store.as_ref().filter(|_| recorded(&p)) {
            match state::start_time(p.pid) {
                Some(start_time) => s.put_or_log(
                    state::GUEST,
                    &p.pid.to_string(),
                    &Record {
                        info: p.clone(),
                        start_time,
                    },
                ),
                None => tracing::warn!(
                    event = "guest-unrecorded",
                    pid = p.pid,
                    "no start time: already gone?"
                ),
            }
        }
        let mut l = self.list.lock().expect("guests lock");
        l.retain(|g| g.pid != p.pid);
        l.push(p);
    }

    fn unrecord(&self, pid: i32) {
        if let Some(s) = &self.store {
            s.remove_or_log(state::GUEST, &pid.to_string());
        }
    }

    /// Forgets the guest whose PID here is `pid` (it ended, or moved on).
    pub fn remove(&self, pid: i32) -> Option<ProcInfo> {
        let mut l = self.list.lock().expect("guests lock");
        let i = l.iter().position(|g| g.pid == pid)?;
        if recorded(&l[i]) {
            self.unrecord(pid);
        }
        Some(l.remove(i))
    }

    /// Forgets the guests whose process is gone, and returns them. A migrated tree's root is
    /// the child of its guest namespace's init, not ours: its end is never reaped here, only
    /// seen in /proc.
    pub fn prune(&self) -> Vec<ProcInfo> {
        let mut l = self.list.lock().expect("guests lock");
        let (gone, alive): (Vec<ProcInfo>, Vec<ProcInfo>) = std::mem::take(&mut *l)
            .into_iter()
            .partition(|g| !std::path::Path::new(&format!("/proc/{}", g.pid)).exists());
        *l = alive;
        for g in gone.iter().filter(|g| recorded(g)) {
            self.unrecord(g.pid);
        }
        gone
    }

    /// The guest known by `pid`: its PID here first, else its home PID.
    pub fn find(&self, pid: i32) -> Option<ProcInfo> {
        let l = self.list.lock().expect("guests lock");
        l.iter()
            .find(|g| g.pid == pid)
            .or_else(|| l.iter().find(|g| g.home_pid == pid))
            .cloned()
    }

    /// Marks a guest "migrating" or "running" again (not recorded: a restart finds it running).
    pub fn set_state(&self, pid: i32, state: &str) {
        let mut l = self.list.lock().expect("guests lock");
        if let Some(g) = l.iter_mut().find(|g| g.pid == pid) {
            g.state = state.to_string();
        }
    }

    pub fn list(&self) -> Vec<ProcInfo> {
        self.list.lock().expect("guests lock").clone()
    }

    pub fn count(&self) -> u32 {
        self.list.lock().expect("guests lock").len() as u32
    }
}
