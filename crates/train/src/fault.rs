//! Fault injection for the fault suite (`crates/cli/tests/cli/faults.rs`).
//!
//! Nothing happens unless the environment variable `TVQ_FAULT` is set to
//! `POINT:ACTION[@N]`: the `N`-th time (default the first) the process
//! reaches `POINT`, `ACTION` happens there:
//!
//! - `error`: the write fails with an I/O error (at [`Point::Loss`], the
//!   step's loss becomes NaN instead; at [`Point::Sum`], a foreign vector
//!   joins the sum, as a stranger on the network would add one; at
//!   [`Point::DeviceResult`], `tvq check` sees a wrong device result);
//! - `kill`: the process ends at once with SIGKILL, as `kill -9` would end
//!   it (no destructor runs, nothing is flushed).
//!
//! The points are the stages of the run's writes where a real fault (a
//! full disk, a crash, a power cut) can land; see [`Point`]. A malformed
//! `TVQ_FAULT` panics on first use: it is a test's mistake, not a user's.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

/// A stage of a run where a fault can be injected.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Point {
    /// Between the data files of a checkpoint (the model written, the
    /// optimizer state not yet): `checkpoint-data`.
    CheckpointData,
    /// Every data file written and synced, the manifest not yet:
    /// `checkpoint-manifest`.
    CheckpointManifest,
    /// The complete temporary directory about to be renamed into place:
    /// `checkpoint-rename`.
    CheckpointRename,
    /// An old checkpoint set aside for deletion, not yet deleted:
    /// `checkpoint-prune`.
    CheckpointPrune,
    /// A line of `metrics.jsonl` about to be appended: `metrics-append`.
    MetricsAppend,
    /// A step's loss computed, the optimizer not yet stepped: `loss`.
    Loss,
    /// A collective sum received from the engine, not yet checked: `sum`.
    Sum,
    /// A device's result in `tvq check`, about to be compared with the
    /// CPU's: `device-result` (`error` scales it by 1.01).
    DeviceResult,
}

impl Point {
    const ALL: [Point; 8] = [
        Point::CheckpointData,
        Point::CheckpointManifest,
        Point::CheckpointRename,
        Point::CheckpointPrune,
        Point::MetricsAppend,
        Point::Loss,
        Point::Sum,
        Point::DeviceResult,
    ];

    /// The point's name in `TVQ_FAULT`.
    pub fn name(self) -> &'static str {
        match self {
            Point::CheckpointData => "checkpoint-data",
            Point::CheckpointManifest => "checkpoint-manifest",
            Point::CheckpointRename => "checkpoint-rename",
            Point::CheckpointPrune => "checkpoint-prune",
            Point::MetricsAppend => "metrics-append",
            Point::Loss => "loss",
            Point::Sum => "sum",
            Point::DeviceResult => "device-result",
        }
    }
}

#[derive(Clone, Copy, Debug)]
enum Action {
    Error,
    Kill,
}

#[derive(Debug)]
struct Fault {
    point: Point,
    action: Action,
    /// Which arrival at `point` triggers it (1-based).
    nth: u64,
}

fn parse(spec: &str) -> Option<Fault> {
    let (point, rest) = spec.split_once(':')?;
    let (action, nth) = match rest.split_once('@') {
        Some((a, n)) => (a, n.parse().ok()?),
        None => (rest, 1),
    };
    Some(Fault {
        point: Point::ALL.into_iter().find(|p| p.name() == point)?,
        action: match action {
            "error" => Action::Error,
            "kill" => Action::Kill,
            _ => return None,
        },
        nth,
    })
}

fn configured() -> Option<&'static Fault> {
    static FAULT: OnceLock<Option<Fault>> = OnceLock::new();
    FAULT
        .get_or_init(|| {
            let spec = std::env::var("TVQ_FAULT").ok()?;
            Some(
                parse(&spec)
                    .unwrap_or_else(|| panic!("TVQ_FAULT={spec}: expected POINT:error|kill[@N]")),
            )
        })
        .as_ref()
}

/// Called at `point`: an I/O error, or the end of the process, where
/// `TVQ_FAULT` asks for one here and now; `Ok` otherwise.
pub(crate) fn inject(point: Point) -> std::io::Result<()> {
    static ARRIVALS: AtomicU64 = AtomicU64::new(0);
    let Some(fault) = configured().filter(|f| f.point == point) else {
        return Ok(());
    };
    if ARRIVALS.fetch_add(1, Ordering::SeqCst) + 1 != fault.nth {
        return Ok(());
    }
    match fault.action {
        Action::Error => Err(std::io::Error::other(format!(
            "injected fault at {}",
            point.name()
        ))),
        Action::Kill => kill_self(),
    }
}

#[cfg(unix)]
fn kill_self() -> ! {
    // SAFETY: sends a signal to this process; SIGKILL cannot be handled.
    unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    unreachable!("SIGKILL ends the process")
}

#[cfg(not(unix))]
fn kill_self() -> ! {
    std::process::abort()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fault_specs_parse_and_malformed_ones_do_not() {
        let f = parse("checkpoint-rename:kill@3").unwrap();
        assert_eq!((f.point, f.nth), (Point::CheckpointRename, 3));
        assert!(matches!(f.action, Action::Kill));
        let f = parse("metrics-append:error").unwrap();
        assert_eq!((f.point, f.nth), (Point::MetricsAppend, 1));
        for bad in ["", "loss", "loss:explode", "nowhere:error", "loss:error@x"] {
            assert!(parse(bad).is_none(), "{bad}");
        }
    }
}
