//! One writer per run directory.
//!
//! `tvq train` holds an exclusive advisory lock on `RUN/train.lock` for its
//! whole life: the operating system's file lock (`flock` on Unix, through
//! std's `File::try_lock`), which the kernel releases with the process's
//! file descriptors, so a process killed with `kill -9` leaves no stale
//! lock behind. A second writer finds the lock taken and stops before it
//! touches anything, naming the holder that the lock file describes.

use std::fs::{File, TryLockError};
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::error::TrainError;

/// The lock file's name inside a run directory.
pub const LOCK_FILE: &str = "train.lock";

/// The exclusive lock on a run directory; released when dropped (or when
/// the process ends, however it ends).
#[derive(Debug)]
pub struct RunLock {
    /// Holds the lock for as long as it is open.
    _file: File,
    path: PathBuf,
}

impl RunLock {
    /// Takes the lock of `run_dir` (created if missing), or fails with
    /// [`TrainError::RunDirInUse`] naming the process that holds it.
    pub fn acquire(run_dir: &Path) -> Result<Self, TrainError> {
        std::fs::create_dir_all(run_dir).map_err(|e| TrainError::io(run_dir, e))?;
        let path = run_dir.join(LOCK_FILE);
        let io = |e| TrainError::io(&path, e);
        // Opened for writing: through a link it would write elsewhere.
        if std::fs::symlink_metadata(&path).is_ok_and(|m| m.file_type().is_symlink()) {
            return Err(io(std::io::Error::other(
                "is a symbolic link; tvq follows no link in its run directory: remove it",
            )));
        }
        // Not truncated on open: the holder's description stays readable
        // for the process that is about to be refused.
        let mut file = crate::nofollow::open(
            crate::nofollow::options()
                .read(true)
                .create(true)
                .truncate(false),
            &path,
        )
        .map_err(io)?;
        match file.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                let mut holder = String::new();
                let _ = file.read_to_string(&mut holder);
                return Err(TrainError::RunDirInUse {
                    path: run_dir.to_path_buf(),
                    holder: describe(&holder),
                });
            }
            Err(TryLockError::Error(e)) => return Err(io(e)),
        }
        let since = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let me =
            serde_json::json!({"pid": std::process::id(), "host": host_name(), "since": since});
        file.set_len(0)
            .and_then(|_| file.rewind())
            .and_then(|_| writeln!(file, "{me}"))
            .and_then(|_| file.flush())
            .map_err(io)?;
        Ok(Self { _file: file, path })
    }

    /// The lock file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// "pid 1234 on host, for 42 s" from the holder's line of the lock file.
fn describe(line: &str) -> String {
    let Ok(v) = serde_json::from_str::<serde_json::Value>(line.trim()) else {
        return "a process that has not described itself yet".into();
    };
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let mut text = format!(
        "pid {} on {}",
        v["pid"].as_u64().map_or("?".into(), |p| p.to_string()),
        v["host"].as_str().unwrap_or("?")
    );
    if let Some(since) = v["since"].as_u64() {
        text += &format!(", for {} s", now.saturating_sub(since));
    }
    text
}

/// This machine's name (the holder may be on another machine sharing the
/// file system).
fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "this machine".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_lock_on_a_run_directory_is_refused_with_the_holder_named() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path().join("run");
        let held = RunLock::acquire(&run).unwrap();
        // A second open file description conflicts even in one process.
        let err = RunLock::acquire(&run).unwrap_err().to_string();
        let pid = format!("pid {}", std::process::id());
        assert!(err.contains(&pid) && err.contains("in use"), "{err}");
        assert!(err.contains(&run.display().to_string()), "{err}");
        drop(held);
        let again = RunLock::acquire(&run).unwrap();
        assert_eq!(again.path(), run.join(LOCK_FILE));
    }
}
