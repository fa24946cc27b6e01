//! How each migration this node sent ended, decided once and written durably before anyone acts
//! on it (crate::state). The source decides "committed" on the destination's `Rebuilt`, before
//! it tells its worker to kill (or deputize) the original; a destination that lost the source
//! asks, and a question about a migration not yet decided decides it "not committed" (the
//! source then thaws its original instead of committing). The first decision wins, so the
//! answer a destination acts on and what the source does always agree, across restarts too.

use crate::state::{self, Store};
use anyhow::Result;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Outcome {
    pub committed: bool,
    /// The destination.
    pub to: String,
    /// The original's root here and its start time: after a restart, an original still alive
    /// under a committed outcome (its worker thawed it when the daemon died) is killed.
    pub root: Option<(i32, u64)>,
}

pub struct Outcomes {
    map: Mutex<HashMap<u64, Outcome>>,
    /// Migrations under way, not decided yet: their destinations.
    pending: Mutex<HashMap<u64, String>>,
    /// Migrations a restarted daemon found under way and undecided (crate::state::SENDING).
    undecided: Mutex<Vec<(u64, Outcome)>>,
    /// Destination side: copies held here whose source has spoken since it lost us (so it
    /// is alive, whatever the membership says, and its answer must be waited for).
    sources_spoke: Mutex<std::collections::HashSet<u64>>,
    store: Arc<Store>,
}

impl Outcomes {
    pub fn recover(store: Arc<Store>) -> Outcomes {
        let map = store
            .load::<Outcome>(state::OUTCOME)
            .into_iter()
            .filter_map(|(k, o)| Some((k.parse().ok()?, o)))
            .collect::<HashMap<u64, Outcome>>();
        let mut undecided = Vec::new();
        for (k, o) in store.load::<Outcome>(state::SENDING) {
            match k.parse::<u64>() {
                Ok(id) if !map.contains_key(&id) => undecided.push((id, o)),
                _ => store.remove_or_log(state::SENDING, &k),
            }
        }
        Outcomes {
            map: Mutex::new(map),
            pending: Mutex::default(),
            undecided: Mutex::new(undecided),
            sources_spoke: Mutex::default(),
            store,
        }
    }

    /// Decides migration `id` as `want`, unless it was decided already. Returns the decision
    /// (recorded durably when it is made here).
    pub fn decide(&self, id: u64, want: Outcome) -> Result<Outcome> {
        let mut m = self.map.lock().expect("outcomes lock");
        if let Some(o) = m.get(&id) {
            return Ok(o.clone());
        }
        self.store.put(state::OUTCOME, &id.to_string(), &want)?;
        m.insert(id, want.clone());
        self.pending.lock().expect("outcomes lock").remove(&id);
        self.store.remove_or_log(state::SENDING, &id.to_string());
        Ok(want)
    }

    /// Migration `id` of the tree rooted at `root` to `to` is under way: recorded durably, so
    /// that a restart can settle it (see `undecided`).
    pub fn begin(&self, id: u64, to: &str, root: Option<(i32, u64)>) -> Result<()> {
        let o = Outcome {
            committed: false,
            to: to.to_string(),
            root,
        };
        self.store.put(state::SENDING, &id.to_string(), &o)?;
        let mut p = self.pending.lock().expect("outcomes lock");
        p.insert(id, to.to_string());
        Ok(())
    }

    /// Migration `id` ended (decided, or failed before its commit point and thawed here).
    pub fn end(&self, id: u64) {
        self.pending.lock().expect("outcomes lock").remove(&id);
        self.store.remove_or_log(state::SENDING, &id.to_string());
    }

    /// The migrations a restarted daemon found under way: the daemon died before deciding
    /// them, and their worker thawed the original. Taken once.
    pub fn take_undecided(&self) -> Vec<(u64, Outcome)> {
        std::mem::take(&mut *self.undecided.lock().expect("outcomes lock"))
    }

    /// Destination side: the source of held copy `id` has spoken.
    pub fn source_spoke(&self, id: u64) {
        self.sources_spoke.lock().expect("outcomes lock").insert(id);
    }

    pub fn has_source_spoken(&self, id: u64) -> bool {
        self.sources_spoke
            .lock()
            .expect("outcomes lock")
            .contains(&id)
    }

    /// Node `peer` asks how migration `id` ended. Only its destination learns that it was
    /// committed; the destination's question decides an undecided migration: not committed.
    /// Ids unknown here (a restart forgot migrations under way) are decided the same way.
    pub fn answer(&self, id: u64, peer: &str) -> Result<bool> {
        {
            let p = self.pending.lock().expect("outcomes lock");
            if p.get(&id).is_some_and(|to| to != peer) {
                return Ok(false);
            }
        }
        let o = self.decide(
            id,
            Outcome {
                committed: false,
                to: peer.to_string(),
                root: None,
            },
        )?;
        Ok(o.committed && o.to == peer)
    }

    /// The destination confirmed: nobody will ask about `id` again.
    pub fn settle(&self, id: u64) {
        self.map.lock().expect("outcomes lock").remove(&id);
        self.store.remove_or_log(state::OUTCOME, &id.to_string());
    }

    /// Committed migrations whose original still runs here (same PID and start time).
    pub fn originals_alive(&self) -> Vec<(u64, i32)> {
        let m = self.map.lock().expect("outcomes lock");
        m.iter()
            .filter(|(_, o)| o.committed)
            .filter_map(|(id, o)| {
                let (pid, start) = o.root?;
                (state::start_time(pid) == Some(start)).then_some((*id, pid))
            })
            .collect()
    }
}
