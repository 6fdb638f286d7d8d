//! Reading files that may come from anyone: a checkpoint or export
//! downloaded from a stranger, a run directory shared or reused. Nothing is
//! read before its kind and size are known: symbolic links and special
//! files (`/dev/zero`, a FIFO) are refused, and a file is read only up to
//! the size that its kind allows, so that a lie costs an error, not the
//! machine's memory or a hang.

use std::io::Read;
use std::path::Path;

/// The most bytes a JSON file of a checkpoint or export may hold
/// (`manifest.json`, `trainer.json`, an export's info): thousands of times
/// what tvq writes.
pub(crate) const JSON_LIMIT: u64 = 16 << 20;

/// The size of the regular file at `path`, read from its metadata without
/// following a symbolic link; an error for a link, a directory or a
/// special file.
pub(crate) fn regular_file_len(path: &Path) -> std::io::Result<u64> {
    let meta = std::fs::symlink_metadata(path)?;
    if meta.file_type().is_symlink() {
        return Err(std::io::Error::other(
            "is a symbolic link (tvq reads only plain files here)",
        ));
    }
    if !meta.is_file() {
        return Err(std::io::Error::other("is not a regular file"));
    }
    Ok(meta.len())
}

/// The bytes of the regular file at `path`, refused unread when it is
/// larger than `limit` bytes (and never more than `limit` read, should it
/// grow meanwhile).
pub(crate) fn read_at_most(path: &Path, limit: u64) -> std::io::Result<Vec<u8>> {
    let len = regular_file_len(path)?;
    if len > limit {
        return Err(std::io::Error::other(format!(
            "holds {len} bytes, more than the {limit} such a file may"
        )));
    }
    let mut bytes = Vec::with_capacity(len as usize);
    std::fs::File::open(path)?
        .take(limit.saturating_add(1))
        .read_to_end(&mut bytes)?;
    if bytes.len() as u64 > limit {
        return Err(std::io::Error::other("grew while it was read"));
    }
    Ok(bytes)
}

/// The bytes of the regular file at `path`, which must hold exactly
/// `bytes` bytes (as a manifest states).
pub(crate) fn read_exactly(path: &Path, bytes: u64) -> std::io::Result<Vec<u8>> {
    let len = regular_file_len(path)?;
    if len != bytes {
        return Err(std::io::Error::other(format!(
            "holds {len} bytes, its manifest says {bytes}"
        )));
    }
    read_at_most(path, bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(unix)]
    #[test]
    fn links_special_files_and_oversized_files_are_refused_unread() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("f");
        std::fs::write(&file, b"0123456789").unwrap();
        assert_eq!(read_at_most(&file, 10).unwrap(), b"0123456789");
        assert!(
            read_at_most(&file, 9)
                .unwrap_err()
                .to_string()
                .contains("more than")
        );
        assert_eq!(read_exactly(&file, 10).unwrap().len(), 10);
        assert!(
            read_exactly(&file, 11)
                .unwrap_err()
                .to_string()
                .contains("says 11")
        );
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&file, &link).unwrap();
        assert!(
            read_at_most(&link, 100)
                .unwrap_err()
                .to_string()
                .contains("symbolic link")
        );
        let err = read_at_most(Path::new("/dev/zero"), 100).unwrap_err();
        assert!(err.to_string().contains("not a regular file"), "{err}");
        assert!(read_at_most(dir.path(), 100).is_err());
    }
}
