//! Stopping `tvq train` from outside. SIGINT (Ctrl-C), SIGTERM (`kill`, a
//! job scheduler's stop, `timeout`) and SIGHUP (the terminal closed) each
//! ask the run to write a checkpoint and stop after the step under way; a
//! second request exits at once, without a checkpoint.
//!
//! A stop signal that `tvq train` was started ignoring stays ignored, as
//! `nohup` asks of SIGHUP, except SIGINT: a shell ignores it in every
//! background job of a script without anyone asking, and `timeout -s INT`
//! must still stop such a job.
//!
//! One request can arrive twice: GNU `timeout` signals its child and then
//! its whole process group, the child included, and a multi-threaded
//! process may handle both. A signal within [`SAME_REQUEST`] of the first
//! is that same request, not a person pressing Ctrl-C again.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

/// Signals this soon after the first are the first request delivered
/// again; a person's second Ctrl-C comes later.
pub const SAME_REQUEST: Duration = Duration::from_secs(1);

/// What a stop signal means, given when the first one arrived.
#[derive(Debug, PartialEq, Eq)]
enum Meaning {
    /// The first: checkpoint, then stop.
    Stop,
    /// The first one again (within [`SAME_REQUEST`]): nothing more to do.
    Repeated,
    /// A second request: exit now.
    Abort,
}

fn meaning(first: Option<Instant>, now: Instant) -> Meaning {
    match first {
        None => Meaning::Stop,
        Some(t) if now.duration_since(t) < SAME_REQUEST => Meaning::Repeated,
        Some(_) => Meaning::Abort,
    }
}

/// Installs the stop-signal handler; the flag it returns is set by the
/// first request (`TrainOptions::interrupt`).
pub fn install() -> Result<Arc<AtomicBool>> {
    let ignored: Vec<libc::c_int> = [libc::SIGTERM, libc::SIGHUP]
        .into_iter()
        .filter(|&sig| is_ignored(sig))
        .collect();
    let interrupt = Arc::new(AtomicBool::new(false));
    let flag = interrupt.clone();
    let mut first = None;
    // ctrlc runs the handler on one thread of its own, one signal at a time.
    ctrlc::set_handler(move || match meaning(first, Instant::now()) {
        Meaning::Stop => {
            first = Some(Instant::now());
            flag.store(true, Ordering::SeqCst);
            eprintln!("\ninterrupt: writing a checkpoint, then stopping (Ctrl-C again to abort)");
        }
        Meaning::Repeated => {}
        Meaning::Abort => std::process::exit(130),
    })
    .context("cannot install the handler of Ctrl-C and SIGTERM")?;
    for sig in ignored {
        // SAFETY: setting a signal's disposition to SIG_IGN has no
        // preconditions.
        unsafe { libc::signal(sig, libc::SIG_IGN) };
    }
    Ok(interrupt)
}

/// Whether the process ignores `sig` (inherited from its parent: `nohup`).
fn is_ignored(sig: libc::c_int) -> bool {
    // SAFETY: `sigaction` with no new action only reads the current one
    // into a plain struct owned here, for which zeroes are a valid value.
    unsafe {
        let mut current: libc::sigaction = std::mem::zeroed();
        libc::sigaction(sig, std::ptr::null(), &mut current) == 0
            && current.sa_sigaction == libc::SIG_IGN
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_repeated_at_once_stops_once_and_a_later_one_aborts() {
        let t = Instant::now();
        assert_eq!(meaning(None, t), Meaning::Stop);
        assert_eq!(meaning(Some(t), t), Meaning::Repeated);
        let just_under = t + SAME_REQUEST - Duration::from_millis(1);
        assert_eq!(meaning(Some(t), just_under), Meaning::Repeated);
        assert_eq!(meaning(Some(t), t + SAME_REQUEST), Meaning::Abort);
        assert_eq!(
            meaning(Some(t), t + Duration::from_secs(60)),
            Meaning::Abort
        );
    }
}
