//! What a panic on a thread that is not tvq's own prints. Two kinds of
//! threads belong to the engines beneath tvq and panic on conditions tvq
//! reports better itself:
//!
//! - burn-collective's network tasks panic when a peer's connection drops
//!   or a stranger sends what they cannot read; the training thread reports
//!   the lost peer as an error, so each such panic is one warning line.
//! - cubecl's device threads (`DSU-*`, `DSD-*`) panic when the GPU fails
//!   (e.g. `CUDA_ERROR_ILLEGAL_ADDRESS`); every later operation on that
//!   device then panics too, hundreds of backtraces deep. The first failure
//!   is printed as one error line, the cascade is silenced, and the first
//!   panic it causes on any other thread ends the process with one line.
//! - burn panics on the calling thread when reading a tensor back from a
//!   device fails (`into_data`, `into_scalar`: "Error while reading data"),
//!   which is how a GPU failure first shows where no device thread panicked
//!   before it: one error line, and the process exits.

use std::panic::PanicHookInfo;
use std::sync::atomic::{AtomicBool, Ordering};

use tvq_train::parallel::collective::{COORDINATOR_THREAD, ENGINE_THREAD};

/// What one panic prints.
#[derive(Debug, PartialEq, Eq)]
enum Verdict {
    /// Rust's own message and backtrace: a bug in tvq, or one not triaged.
    Default,
    /// One warning line.
    Warn(String),
    /// One error line: the device's first failure.
    DeviceFailed(String),
    /// Nothing: the cascade of a failure already printed.
    Silent,
    /// One error line, then the process exits: a thread of tvq's died of
    /// the device's failure.
    Exit(String),
}

/// How burn's panics start when reading a tensor back from a device fails.
const READ_FAILED: &str = "Error while reading data";

/// Sorts a panic by its thread, its message and whether the device already
/// failed.
fn triage(thread: Option<&str>, message: &str, where_: &str, device_failed: bool) -> Verdict {
    let thread = thread.unwrap_or("");
    let engine = thread.starts_with("tokio")
        || thread.starts_with(COORDINATOR_THREAD)
        || thread == ENGINE_THREAD;
    let device = thread.starts_with("DSU-") || thread.starts_with("DSD-");
    match (engine, device, device_failed) {
        (true, _, _) => Verdict::Warn(format!("collective engine: {message}")),
        (_, false, false) if message.starts_with(READ_FAILED) => {
            // burn's advice to call `try_into_data` is for burn's users, not tvq's.
            let cause = message
                .split_once("at runtime: ")
                .map_or(message, |(_, c)| c);
            Verdict::Exit(format!(
                "stopped: the GPU failed reading a result ({where_}): {cause}"
            ))
        }
        (_, true, false) => Verdict::DeviceFailed(format!(
            "the GPU failed ({where_}): {message}; further device errors are not shown"
        )),
        (_, true, true) => Verdict::Silent,
        (_, false, true) => Verdict::Exit(
            "stopped: the GPU failed (see above); resume from the last checkpoint with --resume"
                .to_string(),
        ),
        _ => Verdict::Default,
    }
}

/// Installs the hook over Rust's default one.
pub fn install() {
    static DEVICE_FAILED: AtomicBool = AtomicBool::new(false);
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info: &PanicHookInfo<'_>| {
        let payload = info.payload();
        let message = payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_default();
        let where_ = info
            .location()
            .map(|l| format!("{}:{}", l.file(), l.line()))
            .unwrap_or_default();
        let thread = std::thread::current();
        match triage(
            thread.name(),
            &message,
            &where_,
            DEVICE_FAILED.load(Ordering::SeqCst),
        ) {
            Verdict::Default => default(info),
            Verdict::Warn(line) => tracing::warn!("{line}"),
            Verdict::DeviceFailed(line) => {
                // Two device threads may fail at once: only the first prints.
                if !DEVICE_FAILED.swap(true, Ordering::SeqCst) {
                    eprintln!("error: {line}");
                }
            }
            Verdict::Silent => {}
            Verdict::Exit(line) => {
                eprintln!("error: {line}");
                std::process::exit(1);
            }
        }
    }));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_device_failure_prints_once_and_ends_the_run() {
        let illegal = "DriverError(CUDA_ERROR_ILLEGAL_ADDRESS, \"an illegal memory access\")";
        match triage(Some("DSD-0-0"), illegal, "fence.rs:35", false) {
            Verdict::DeviceFailed(line) => {
                assert!(
                    line.contains(illegal) && line.contains("fence.rs:35"),
                    "{line}"
                )
            }
            other => panic!("{other:?}"),
        }
        // The cascade on the device's threads says nothing more.
        assert_eq!(
            triage(Some("DSU-0-0"), "index out of bounds", "", true),
            Verdict::Silent
        );
        assert_eq!(
            triage(Some("DSD-0-0"), "CallError", "", true),
            Verdict::Silent
        );
        // tvq's own threads stop the process with one line.
        for thread in [Some("main"), Some("worker-1"), None] {
            assert!(matches!(
                triage(thread, "CallError", "", true),
                Verdict::Exit(_)
            ));
        }
    }

    #[test]
    fn a_failed_read_on_the_main_thread_is_one_line_with_its_cause() {
        // As burn 0.21's `into_data` panics when the CUDA stream has failed.
        let message = "Error while reading data: use `try_into_data` instead to catch the \
                       error at runtime: Generic { reason: \"CUDA_ERROR_ILLEGAL_ADDRESS\" }";
        match triage(Some("main"), message, "base.rs:1900", false) {
            Verdict::Exit(line) => assert_eq!(
                line,
                "stopped: the GPU failed reading a result (base.rs:1900): \
                 Generic { reason: \"CUDA_ERROR_ILLEGAL_ADDRESS\" }"
            ),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn other_panics_keep_rusts_message_and_engine_panics_warn() {
        assert_eq!(
            triage(Some("main"), "a bug", "x.rs:1", false),
            Verdict::Default
        );
        assert_eq!(triage(None, "a bug", "x.rs:1", false), Verdict::Default);
        assert_eq!(
            triage(Some("tokio-runtime-worker"), "peer gone", "", false),
            Verdict::Warn("collective engine: peer gone".into())
        );
        // A thread that merely starts with "DS" is not cubecl's.
        assert_eq!(
            triage(Some("DSP-thing"), "a bug", "", false),
            Verdict::Default
        );
    }
}
