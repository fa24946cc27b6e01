//! What a daemon must not forget when it dies: its guests, the bodies it runs for other homes,
//! the deputies it keeps at home, the outcomes of the migrations it sent, and the copies it holds
//! until a source decides. One JSON file per record under `DATA_DIR/state/` (root only), named
//! `KIND-KEY.json`, each written whole to a temporary file, fsynced, renamed into place, and the
//! directory fsynced: a record is either there complete or not at all, and once `put` returns it
//! survives a crash of the daemon or of the machine. A record that does not parse is logged
//! and skipped (never taken for something else).

use anyhow::{Context, Result};
use serde::{de::DeserializeOwned, Serialize};
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

/// The record kinds.
pub const GUEST: &str = "guest";
pub const BODY: &str = "body";
pub const DEPUTY: &str = "deputy";
pub const OUTCOME: &str = "outcome";
pub const HELD: &str = "held";
pub const SENDING: &str = "sending";
pub const RAN: &str = "ran";
/// Home side: a body given up for dead on a node, to kill there should it come back
/// (crate::recovery::fence).
pub const FENCE: &str = "fence";
/// Home side: a pipe's relay whose home end and buffer a holder process keeps
/// (crate::relay_keep).
pub const RELAY: &str = "relay";

pub struct Store {
    dir: PathBuf,
}

impl Store {
    /// Opens (and makes, 0700) `DATA_DIR/state`.
    pub fn open(data_dir: &Path) -> Result<Store> {
        use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
        let dir = data_dir.join("state");
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)
            .with_context(|| format!("create {}", dir.display()))?;
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))
            .with_context(|| format!("restrict {}", dir.display()))?;
        Ok(Store { dir })
    }

    fn path(&self, kind: &str, key: &str) -> PathBuf {
        self.dir.join(format!("{kind}-{key}.json"))
    }

    /// Writes record `kind`/`key` durably (replacing any earlier one).
    pub fn put<T: Serialize>(&self, kind: &str, key: &str, value: &T) -> Result<()> {
        let path = self.path(kind, key);
        let tmp = self.dir.join(format!(".{kind}-{key}.tmp"));
        let bytes = serde_json::to_vec(value).context("encode a state record")?;
        {
            let mut f = File::create(&tmp).with_context(|| format!("create {}", tmp.display()))?;
            f.write_all(&bytes)
                .with_context(|| format!("write {}", tmp.display()))?;
            f.sync_all()
                .with_context(|| format!("sync {}", tmp.display()))?;
        }
        std::fs::rename(&tmp, &path)
            .with_context(|| format!("rename {} to {}", tmp.display(), path.display()))?;
        self.sync_dir()
    }

    /// Removes record `kind`/`key` durably (nothing to do if it is not there).
    pub fn remove(&self, kind: &str, key: &str) -> Result<()> {
        let path = self.path(kind, key);
        match std::fs::remove_file(&path) {
            Ok(()) => self.sync_dir(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(e).with_context(|| format!("remove {}", path.display())),
        }
    }

    /// Record `kind`/`key`, if there is one that parses.
    pub fn get<T: DeserializeOwned>(&self, kind: &str, key: &str) -> Option<T> {
        let b = std::fs::read(self.path(kind, key)).ok()?;
        serde_json::from_slice(&b).ok()
    }

    /// Every record of `kind`, by key.
    pub fn load<T: DeserializeOwned>(&self, kind: &str) -> Vec<(String, T)> {
        let mut out = Vec::new();
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return out;
        };
        let prefix = format!("{kind}-");
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let Some(key) = name
                .strip_prefix(&prefix)
                .and_then(|k| k.strip_suffix(".json"))
            else {
                continue;
            };
            match std::fs::read(e.path())
                .map_err(anyhow::Error::from)
                .and_then(|b| serde_json::from_slice::<T>(&b).map_err(anyhow::Error::from))
            {
                Ok(v) => out.push((key.to_string(), v)),
                Err(err) => tracing::error!(event = "bad-state-record",
                    path = %e.path().display(), error = %format!("{err:#}")),
            }
        }
        out
    }

    fn sync_dir(&self) -> Result<()> {
        File::open(&self.dir)
            .and_then(|d| d.sync_all())
            .with_context(|| format!("sync {}", self.dir.display()))
    }

    /// Logs a failed write: the daemon goes on, but a restart would forget this record.
    pub fn put_or_log<T: Serialize>(&self, kind: &str, key: &str, value: &T) {
        if let Err(e) = self.put(kind, key, value) {
            tracing::error!(event = "state-write-failed", kind, key, error = %format!("{e:#}"));
        }
    }

    pub fn remove_or_log(&self, kind: &str, key: &str) {
        if let Err(e) = self.remove(kind, key) {
            tracing::error!(event = "state-write-failed", kind, key, error = %format!("{e:#}"));
        }
    }
}

/// The start time of process `pid` (field 22 of /proc/PID/stat, clock ticks since boot): with
/// the PID, it names one process even after the PID is reused.
pub fn start_time(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after = stat.rsplit_once(')')?.1;
    after.split_whitespace().nth(19)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_survive_a_reopen_and_bad_ones_are_skipped() {
        let dir = std::env::temp_dir().join(format!("ferry-state-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let s = Store::open(&dir).unwrap();
        s.put(OUTCOME, "7", &true).unwrap();
        s.put(OUTCOME, "8", &false).unwrap();
        s.put(GUEST, "8", &1u32).unwrap();
        std::fs::write(dir.join("state/outcome-9.json"), b"{garbage").unwrap();
        s.remove(OUTCOME, "8").unwrap();
        s.remove(OUTCOME, "10").unwrap();
        let s = Store::open(&dir).unwrap();
        let got: Vec<(String, bool)> = s.load(OUTCOME);
        assert_eq!(got, vec![("7".to_string(), true)]);
        assert!(start_time(std::process::id() as i32).is_some());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
