//! Files tvq writes in a run directory, opened without following a
//! symbolic link at their path. A run refuses links among its files when
//! it starts; a link placed there while it goes on ends the next write
//! there in an error instead of changing a file elsewhere (`O_NOFOLLOW`
//! on Unix: the check and the open are one step, with no window between).

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::Path;

/// Options for writing that refuse a link as the path's last component.
pub(crate) fn options() -> OpenOptions {
    let mut options = OpenOptions::new();
    options.write(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.custom_flags(libc::O_NOFOLLOW);
    }
    options
}

/// Opens `path` with `options` (from [`options`]), saying plainly when a
/// link stood there.
pub(crate) fn open(options: &OpenOptions, path: &Path) -> std::io::Result<File> {
    let link = || {
        std::io::Error::other(
            "is a symbolic link, which tvq does not write through in a run directory: remove it",
        )
    };
    // Without O_NOFOLLOW, a check just before the open.
    #[cfg(not(unix))]
    if std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink()) {
        return Err(link());
    }
    options.open(path).map_err(|e| {
        // O_NOFOLLOW's answer to a link is ELOOP.
        #[cfg(unix)]
        if e.raw_os_error() == Some(libc::ELOOP) {
            return link();
        }
        e
    })
}

/// Creates `path`, or truncates it.
pub(crate) fn create(path: &Path) -> std::io::Result<File> {
    open(options().create(true).truncate(true), path)
}

/// Opens `path` to append to it, created if missing.
pub(crate) fn append(path: &Path) -> std::io::Result<File> {
    open(options().append(true).create(true), path)
}

/// Writes `bytes` as the whole of `path` and syncs it.
pub(crate) fn write(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let mut file = create(path)?;
    file.write_all(bytes)?;
    file.sync_all()
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;

    #[test]
    fn a_link_is_refused_and_its_target_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("elsewhere.txt");
        std::fs::write(&target, "theirs").unwrap();
        let link = dir.path().join("metrics.jsonl");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let errors = [
            create(&link).err(),
            append(&link).err(),
            write(&link, b"ours").err(),
        ];
        for e in errors {
            let e = e.expect("refused").to_string();
            assert!(e.contains("symbolic link") && !e.contains('\n'), "{e}");
        }
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "theirs");
        // Plain files are written as std::fs would.
        let plain = dir.path().join("plain.txt");
        write(&plain, b"one\n").unwrap();
        append(&plain).unwrap().write_all(b"two\n").unwrap();
        assert_eq!(std::fs::read_to_string(&plain).unwrap(), "one\ntwo\n");
    }
}
