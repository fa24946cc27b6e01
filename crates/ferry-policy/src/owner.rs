//! Who may use a machine: its owner's policy (Sprite's host autonomy). A node takes guests
//! always, only while its owner is away and it is idle, or never. Idle follows Sprite (§6.2.1):
//! fewer than one runnable process averaged over the last minute, and no user input for 30 s;
//! both thresholds are the owner's to change. The daemon reads the signals (load average,
//! input devices, terminals); this module decides.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// When a node takes guests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AcceptPolicy {
    /// Whatever the owner does (a server, a build machine).
    #[default]
    Always,
    /// Only while the machine is idle; the owner's return evicts the guests.
    Idle,
    /// Never (the owner's own machine, lent to nobody).
    Never,
}

impl FromStr for AcceptPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "always" | "yes" => Ok(AcceptPolicy::Always),
            "idle" => Ok(AcceptPolicy::Idle),
            "never" | "no" => Ok(AcceptPolicy::Never),
            other => Err(format!(
                "accept policy {other:?}: always, idle or never (yes = always, no = never)"
            )),
        }
    }
}

impl fmt::Display for AcceptPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            AcceptPolicy::Always => "always",
            AcceptPolicy::Idle => "idle",
            AcceptPolicy::Never => "never",
        })
    }
}

/// What makes a machine idle (Sprite: load below 1 over a minute, no input for 30 s).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct IdleThresholds {
    /// The one-minute load average must stay below this.
    pub load_below: f64,
    /// No user input for at least this long.
    pub input_idle_secs: u64,
}

impl Default for IdleThresholds {
    fn default() -> Self {
        IdleThresholds {
            load_below: 1.0,
            input_idle_secs: 30,
        }
    }
}

/// What a node measured about its owner's use of it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct OwnerSignals {
    /// The one-minute load average (/proc/loadavg).
    pub load_avg_1m: f64,
    /// Seconds since the last user input; None: no input ever seen (no console, no terminal
    /// watched), which is idle for as long as one can tell.
    pub input_idle_secs: Option<u64>,
    /// Runnable guests here, which the load average counts but which are no owner's work.
    pub guests_runnable: u32,
}

/// The owner's state as published to the cluster (part of `NodeLoad`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct OwnerState {
    pub policy: AcceptPolicy,
    /// The machine is idle by the owner's thresholds.
    pub idle: bool,
    /// `ferry drain`: no new guests until the owner says otherwise, whatever the policy.
    pub draining: bool,
    /// The one-minute load average, as measured.
    pub load_avg_1m: f32,
}

/// Whether the owner has been away long enough and the machine is not busy with its own work.
pub fn is_idle(s: &OwnerSignals, t: &IdleThresholds) -> bool {
    input_idle(s, t) && s.load_avg_1m - f64::from(s.guests_runnable) < t.load_below
}

/// No input for the threshold (or none ever seen).
pub fn input_idle(s: &OwnerSignals, t: &IdleThresholds) -> bool {
    s.input_idle_secs.is_none_or(|i| i >= t.input_idle_secs)
}

/// Whether a node with this policy takes a new guest now.
pub fn accepts(policy: AcceptPolicy, draining: bool, idle: bool) -> Result<(), String> {
    if draining {
        return Err(
            "this node does not accept guests: it is being drained (`ferry accept` ends that)"
                .into(),
        );
    }
    match policy {
        AcceptPolicy::Always => Ok(()),
        AcceptPolicy::Never => Err(
            "this node does not accept guests: its owner lends it to nobody (accept = never)"
                .into(),
        ),
        AcceptPolicy::Idle if idle => Ok(()),
        AcceptPolicy::Idle => Err(
            "this node does not accept guests now: its owner lends it only while it is idle \
             (accept = idle), and it is not"
                .into(),
        ),
    }
}

/// Whether the guests here must leave because the owner came back: only under `idle`, only
/// on input (the guests' own load never evicts them), and only if there are guests.
pub fn owner_returned(policy: AcceptPolicy, s: &OwnerSignals, t: &IdleThresholds) -> bool {
    policy == AcceptPolicy::Idle && !input_idle(s, t)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sig(load: f64, input: Option<u64>) -> OwnerSignals {
        OwnerSignals {
            load_avg_1m: load,
            input_idle_secs: input,
            guests_runnable: 0,
        }
    }

    #[test]
    fn sprite_idleness() {
        let t = IdleThresholds::default();
        assert!(is_idle(&sig(0.5, Some(31)), &t));
        assert!(is_idle(&sig(0.0, None), &t));
        assert!(!is_idle(&sig(1.2, Some(300)), &t), "busy with its own work");
        assert!(!is_idle(&sig(0.1, Some(5)), &t), "the owner typed 5 s ago");
        let mut guests = sig(1.5, Some(300));
        guests.guests_runnable = 1;
        assert!(is_idle(&guests, &t), "a guest's own load is no owner's");
        let loose = IdleThresholds {
            load_below: 100.0,
            input_idle_secs: 2,
        };
        assert!(is_idle(&sig(3.0, Some(2)), &loose));
    }

    #[test]
    fn policies() {
        assert!(accepts(AcceptPolicy::Always, false, false).is_ok());
        assert!(accepts(AcceptPolicy::Idle, false, true).is_ok());
        assert!(accepts(AcceptPolicy::Idle, false, false)
            .unwrap_err()
            .contains("idle"));
        assert!(accepts(AcceptPolicy::Never, false, true).is_err());
        assert!(accepts(AcceptPolicy::Always, true, true)
            .unwrap_err()
            .contains("drained"));
        assert_eq!("yes".parse(), Ok(AcceptPolicy::Always));
        assert_eq!("no".parse(), Ok(AcceptPolicy::Never));
        assert_eq!("idle".parse(), Ok(AcceptPolicy::Idle));
        assert!("maybe".parse::<AcceptPolicy>().is_err());
        let t = IdleThresholds::default();
        assert!(owner_returned(AcceptPolicy::Idle, &sig(0.0, Some(1)), &t));
        assert!(!owner_returned(
            AcceptPolicy::Always,
            &sig(0.0, Some(1)),
            &t
        ));
        assert!(!owner_returned(
            AcceptPolicy::Idle,
            &sig(5.0, Some(100)),
            &t
        ));
    }
}
