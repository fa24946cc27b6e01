//! The processes this node hosts for others: trees migrated here and programs started here by
//! `ferry run`. `ferry ps` asks every node for its list.

use ferry_transport::message::ProcInfo;
use std::sync::Mutex;

#[derive(Default)]
pub struct Guests {
    list: Mutex<Vec<ProcInfo>>,
}

impl Guests {
    pub fn add(&self, p: ProcInfo) {
        let mut l = self.list.lock().expect("guests lock");
        l.retain(|g| g.pid != p.pid);
        l.push(p);
    }

    /// Forgets the guest whose PID here is `pid` (it ended, or moved on).
    pub fn remove(&self, pid: i32) -> Option<ProcInfo> {
        let mut l = self.list.lock().expect("guests lock");
        let i = l.iter().position(|g| g.pid == pid)?;
        Some(l.remove(i))
    }

    /// Forgets the guests whose process is gone, and returns them. A migrated tree's root is
    /// the child of its guest namespace's init, not ours: its end is never reaped here, only
    /// seen in /proc.
    pub fn prune(&self) -> Vec<ProcInfo> {
        let mut l = self.list.lock().expect("guests lock");
        let (gone, alive) = std::mem::take(&mut *l)
            .into_iter()
            .partition(|g| !std::path::Path::new(&format!("/proc/{}", g.pid)).exists());
        *l = alive;
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
