//! The speed memory last moved at to each node (crate::migrate::send::learn_link), which
//! `--memory auto` weighs an eager move's freeze by: kept durably, one state record per node
//! (`DATA_DIR/state/link-NODE.json`, written whole and renamed into place by
//! crate::state::Store), read back when the daemon starts, so that a restart does not forget
//! what the last migrations measured. A speed older than [`MAX_AGE`] is stale (the link, or the
//! load of either machine, may have changed): it is not used, and its record is removed at
//! the next start.

use crate::state::Store;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// State record kind of a link's speed.
pub const LINK: &str = "link";

/// How long a measured speed is trusted.
pub const MAX_AGE: Duration = Duration::from_secs(24 * 3600);

/// One measurement.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Speed {
    /// Bytes per second.
    pub bps: f64,
    /// When it was measured (ms since the epoch).
    pub unix_ms: u64,
}

pub struct Links {
    store: Arc<Store>,
    speeds: Mutex<HashMap<String, Speed>>,
}

fn now_unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn fresh(s: &Speed, now_ms: u64) -> bool {
    // A measurement from the future (the clock went back) is taken as made now.
    now_ms.saturating_sub(s.unix_ms) <= MAX_AGE.as_millis() as u64
        && s.bps.is_finite()
        && s.bps > 0.0
}

impl Links {
    /// The speeds the store holds; stale or malformed ones are removed from it.
    pub fn recover(store: Arc<Store>) -> Links {
        let now = now_unix_ms();
        let mut speeds = HashMap::new();
        for (node, s) in store.load::<Speed>(LINK) {
            if ferry_transport::credentials::check_node_name(&node).is_ok() && fresh(&s, now) {
                speeds.insert(node, s);
            } else {
                tracing::info!(event = "link-speed-aged-out", node = %node, bps = s.bps,
                    unix_ms = s.unix_ms);
                store.remove_or_log(LINK, &node);
            }
        }
        Links {
            store,
            speeds: Mutex::new(speeds),
        }
    }

    /// The speed (bytes/s) memory last moved at to `node`, unless it is stale.
    pub fn get(&self, node: &str) -> Option<f64> {
        let speeds = self.speeds.lock().expect("not poisoned");
        speeds
            .get(node)
            .filter(|s| fresh(s, now_unix_ms()))
            .map(|s| s.bps)
    }

    /// Records that memory moved to `node` at `bps` bytes/s, durably (a failed write is
    /// logged: the speed is then known until the daemon stops).
    pub fn learn(&self, node: &str, bps: f64) {
        if ferry_transport::credentials::check_node_name(node).is_err()
            || !bps.is_finite()
            || bps <= 0.0
        {
            return;
        }
        let s = Speed {
            bps,
            unix_ms: now_unix_ms(),
        };
        self.speeds
            .lock()
            .expect("not poisoned")
            .insert(node.to_string(), s);
        self.store.put_or_log(LINK, node, &s);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn speeds_survive_a_restart_and_stale_ones_are_dropped() {
        let dir = std::env::temp_dir().join(format!("ferry-links-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let store = Arc::new(Store::open(&dir).unwrap());
        let links = Links::recover(store.clone());
        assert_eq!(links.get("b"), None);
        links.learn("b", 5e8);
        links.learn("../x", 1e9);
        assert_eq!(links.get("b"), Some(5e8));
        // Measured two days ago: stale.
        let old = Speed {
            bps: 7e8,
            unix_ms: now_unix_ms() - 2 * MAX_AGE.as_millis() as u64,
        };
        store.put(LINK, "c", &old).unwrap();
        std::fs::write(dir.join("state/link-d.json"), b"{not json").unwrap();

        let links = Links::recover(Arc::new(Store::open(&dir).unwrap()));
        assert_eq!(links.get("b"), Some(5e8), "the speed to b was forgotten");
        assert_eq!(links.get("c"), None, "a stale speed was used");
        assert!(
            !dir.join("state/link-c.json").exists(),
            "a stale speed was kept"
        );
        assert!(!dir.join("state/link-..").exists());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
