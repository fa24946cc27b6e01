//! The capture worker's pre-copy (V's): before the tree is frozen, its memory is copied while
//! it runs, then what it dirtied meanwhile, round after round (`ferry_memory::precopy`), as a
//! page stream ahead of the image. `auto` chooses between this and eager from the tree's size,
//! its dirty rate and the link's speed, both measured by the rounds themselves. Hybrid makes
//! the same rounds; what the tree dirtied after the last one then follows the freeze lazily.

use super::worker::next_command;
use anyhow::{Context, Result};
use ferry_engine::freeze::FrozenTree;
use ferry_image::ImageWriter;
use ferry_memory::precopy::Precopy;
use ferry_transport::frame::blocking::DataWriter;
use ferry_transport::message::{MemoryPlan, PrecopyRound};
use ferry_transport::Msg;
use std::io::{BufWriter, Read, Write};
use std::os::fd::AsRawFd;
use std::time::Instant;

/// Below this much memory `auto` moves a tree eagerly: its freeze is short already, and the
/// stop that starts tracking and the rounds would cost about as much as they save.
pub const AUTO_MIN_BYTES: u64 = 64 << 20;
/// `auto` stops the rounds once the tree dirties memory faster than this fraction of the
/// link's speed: pre-copy would not converge.
const AUTO_MAX_DIRTY_SHARE: f64 = 0.5;

/// `auto`'s rule for lazy (with the link to the destination known, `link_bps`): a tree of at
/// least [`AUTO_MIN_BYTES`] that an eager move would keep frozen for `above_ms` or more (its
/// memory at the link's speed), and that holds no shared memory (which lazy cannot serve), is
/// moved lazily; the reason is returned. Otherwise `None`: eager or pre-copy, as before.
pub fn auto_lazy(pid: i32, memory_bytes: u64, link_bps: f64, above_ms: f64) -> Option<String> {
    let eager_ms = memory_bytes as f64 / link_bps.max(1.0) * 1e3;
    if memory_bytes < AUTO_MIN_BYTES || eager_ms < above_ms {
        return None;
    }
    if let Err(e) = ferry_engine::lazy::preflight(pid) {
        log::info!("auto: not lazy: {e}");
        return None;
    }
    if let Some((p, bytes)) = ferry_engine::lazy::cow_shared(pid) {
        log::info!(
            "auto: not lazy: PID {p} shares {:.0} MiB of its memory copy-on-write, which a \
             lazy move would copy",
            mib(bytes as f64)
        );
        return None;
    }
    Some(format!(
        "auto: {:.0} MiB would stand still about {eager_ms:.0} ms at the {:.0} MiB/s measured          to this node (at least {above_ms:.0} ms: lazy): private anonymous memory stays at the          source, served as the copy touches it and pushed meanwhile",
        mib(memory_bytes as f64),
        mib(link_bps)
    ))
}

/// `auto`'s rule for hybrid, where [`auto_lazy`] did not choose lazy (with the link known, so
/// the worker has a page link): a tree of at least [`AUTO_MIN_BYTES`] that holds no shared
/// memory, nor memory shared copy-on-write between its processes, is pre-copied as pre-copy would, but what it dirtied since the last round follows
/// lazily after a short freeze instead of being sent in it (docs: ARCHITECTURE.md, "Choosing
/// how memory moves"). The reason is returned.
pub fn auto_hybrid(pid: i32, memory_bytes: u64, link_bps: f64) -> Option<String> {
    if memory_bytes < AUTO_MIN_BYTES {
        return None;
    }
    if let Err(e) = ferry_engine::lazy::preflight(pid) {
        log::info!("auto: not hybrid: {e}");
        return None;
    }
    // Its last part is lazy, whose capture does not keep pages shared copy-on-write.
    if let Some((p, bytes)) = ferry_engine::lazy::cow_shared(pid) {
        log::info!(
            "auto: not hybrid: PID {p} shares {:.0} MiB of its memory copy-on-write, which \
             the lazy remainder would copy",
            mib(bytes as f64)
        );
        return None;
    }
    Some(format!(
        "auto: {:.0} MiB over the {:.0} MiB/s measured to this node: pre-copy rounds, then \
         what was dirtied since the last round lazily",
        mib(memory_bytes as f64),
        mib(link_bps)
    ))
}

pub enum Outcome {
    /// Freeze now and send the rest; with the pre-copy, if rounds were made.
    Freeze(Option<Precopy>, MemoryPlan),
    /// The daemon said `Thaw` (`thaw`: answer `Thawed`) or went away during the rounds. The
    /// tree runs on, never frozen but for the stop that started tracking.
    Stopped { thaw: bool },
}

fn mib(b: f64) -> f64 {
    b / (1 << 20) as f64
}

/// Runs the rounds `mode` asks for ("eager", "precopy", "hybrid" or "auto"), streaming their
/// pages to `out` as data frames. `auto_hybrid`: `auto` chose hybrid for this reason (the
/// rounds are then cut short as `auto`'s are). An error leaves the tree running (tracking
/// stops as the trackers close).
pub fn run(
    pid: i32,
    mode: &str,
    auto_hybrid: Option<&str>,
    memory_bytes: u64,
    input: &mut impl Read,
    out: &mut impl Write,
) -> Result<Outcome> {
    let auto = mode == "auto" || auto_hybrid.is_some();
    let hybrid = mode == "hybrid" || auto_hybrid.is_some();
    if mode == "eager" {
        return Ok(Outcome::Freeze(
            None,
            MemoryPlan {
                mode: "eager".into(),
                reason: "asked (--memory eager)".into(),
                ..Default::default()
            },
        ));
    }
    if auto && !hybrid && memory_bytes < AUTO_MIN_BYTES {
        return Ok(Outcome::Freeze(
            None,
            MemoryPlan {
                mode: "eager".into(),
                reason: format!(
                    "auto: the tree holds {:.1} MiB, under {:.0} MiB: its freeze is short already",
                    mib(memory_bytes as f64),
                    mib(AUTO_MIN_BYTES as f64)
                ),
                ..Default::default()
            },
        ));
    }
    let t = Instant::now();
    let mut frozen = FrozenTree::freeze(pid).with_context(|| format!("stop PID {pid} briefly"))?;
    // The freeze that follows must find a sleeping thread in its own call, not in the
    // `restart_syscall` this stop would leave it in (restored, that gives EINTR).
    frozen.reissue_on_thaw = true;
    let trackers = ferry_memory::dirty::start_trackers(&frozen);
    frozen.thaw();
    let setup_stop_ms = t.elapsed().as_secs_f64() * 1e3;
    if trackers.is_empty() {
        // Hybrid without rounds is lazy: its private anonymous memory all follows the freeze.
        return Ok(Outcome::Freeze(
            None,
            MemoryPlan {
                mode: if hybrid { "lazy" } else { "eager" }.into(),
                reason: "no process of the tree could have its writes tracked (userfaultfd)".into(),
                setup_stop_ms,
                ..Default::default()
            },
        ));
    }
    let mut pre = Precopy::new(trackers);
    let mut reason = match (auto, hybrid) {
        (true, _) => String::new(),
        (false, true) => "asked (--memory hybrid)".to_string(),
        (false, false) => "asked (--memory precopy)".to_string(),
    };
    let cancel = ferry_engine::cancel::flag();
    let mut w = ImageWriter::new_pages(BufWriter::with_capacity(1 << 20, DataWriter(&mut *out)))
        .context("start the page stream")?;
    // Asked between runs of memory: the daemon may have given up (the destination failed),
    // and says so on stdin; a signal (the daemon died) sets `cancel`.
    let stdin = std::io::stdin().as_raw_fd();
    let mut go_on = || {
        !cancel.load(std::sync::atomic::Ordering::Relaxed)
            && !ferry_sys::ns::poll_in(&[stdin], 0)
                .map(|r| r[0])
                .unwrap_or(true)
    };
    loop {
        let done = match go_on() {
            true => pre.round(&mut w, &mut go_on)?,
            false => None,
        };
        if done.is_none() {
            drop(w);
            // The tree runs on; the trackers close as `pre` goes, which unregisters them.
            let thaw = !cancel.load(std::sync::atomic::Ordering::Relaxed)
                && matches!(next_command(input), Some(Msg::Thaw));
            return Ok(Outcome::Stopped { thaw });
        }
        w.flush().context("send pre-copied pages")?;
        let r = &pre.rounds;
        if auto && r.len() >= 2 {
            // The link: what the first round (everything) moved per second. The dirty rate:
            // what the tree wrote during the round before the last.
            let link = r[0].sent_bytes as f64 / (r[0].ms / 1e3).max(1e-3);
            let last = r[r.len() - 1];
            let dirty_rate = last.dirty_bytes as f64 / (r[r.len() - 2].ms / 1e3).max(1e-3);
            let share = dirty_rate / link.max(1.0);
            reason = format!(
                "{}{}: {:.0} MiB, dirtied at {:.1} MiB/s against a link of {:.0} MiB/s",
                auto_hybrid.unwrap_or("auto"),
                if auto_hybrid.is_some() {
                    "; measured"
                } else {
                    ""
                },
                mib(memory_bytes as f64),
                mib(dirty_rate),
                mib(link)
            );
            if share > AUTO_MAX_DIRTY_SHARE {
                reason += if hybrid {
                    ": pre-copy would not converge, the rest follows lazily"
                } else {
                    ": pre-copy would not converge, the rest froze"
                };
                break;
            }
        }
        if !pre.worth_another() {
            break;
        }
    }
    let (rest, _) = w.finish().context("end the page stream")?;
    rest.into_inner()
        .map_err(|e| anyhow::anyhow!("send pre-copied pages: {}", e.error()))?;
    if auto && pre.rounds.len() < 2 {
        let r = pre.rounds[0];
        reason = format!(
            "{}{}: {:.0} MiB, all sent in one round over a link of {:.0} MiB/s",
            auto_hybrid.unwrap_or("auto"),
            if auto_hybrid.is_some() {
                "; measured"
            } else {
                ""
            },
            mib(memory_bytes as f64),
            mib(r.sent_bytes as f64 / (r.ms / 1e3).max(1e-3))
        );
    }
    let plan = MemoryPlan {
        mode: if hybrid { "hybrid" } else { "precopy" }.into(),
        reason,
        rounds: pre
            .rounds
            .iter()
            .map(|r| PrecopyRound {
                dirty_bytes: r.dirty_bytes,
                sent_bytes: r.sent_bytes,
                ms: r.ms,
            })
            .collect(),
        setup_stop_ms,
        ..Default::default()
    };
    Ok(Outcome::Freeze(Some(pre), plan))
}
