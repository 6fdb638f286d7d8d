//! Errors of the data crate: each names the path and what to do.

use std::path::PathBuf;

use thiserror::Error;

/// Why a corpus cannot be opened or read.
#[derive(Debug, Error)]
pub enum DataError {
    /// The path does not exist or cannot be read.
    #[error("cannot read {path}: {error}")]
    Io {
        /// The path.
        path: PathBuf,
        /// The OS error (in the message, not a separate `source`, so that
        /// an error chain prints it once).
        error: std::io::Error,
    },
    /// The corpus holds no tokens.
    #[error("{path} is empty: point the data path at a non-empty corpus")]
    Empty {
        /// The path.
        path: PathBuf,
    },
    /// An enwik8 file of the wrong size.
    #[error(
        "{path} has {len} bytes, but enwik8 is exactly 100000000 bytes: use the original file, \
         or set allow_proportional_split to split any file 90/5/5"
    )]
    NotEnwik8 {
        /// The path.
        path: PathBuf,
        /// Its size.
        len: u64,
    },
    /// A zip archive that cannot be read.
    #[error("{path} is not a readable zip archive ({reason}): download enwik8.zip again")]
    BadZip {
        /// The path.
        path: PathBuf,
        /// What failed.
        reason: String,
    },
    /// A directory without text files.
    #[error("{path} contains no .txt files")]
    NoTextFiles {
        /// The path.
        path: PathBuf,
    },
    /// A cache file that is not a tvq token cache of this version.
    #[error("{path} is not a valid tvq token cache ({reason}): delete it and it will be rebuilt")]
    BadCache {
        /// The path.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A tokenizer file that cannot be used.
    #[error("cannot use tokenizer {path}: {reason}")]
    BadTokenizer {
        /// The path.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A PG-19 directory without one of its splits.
    #[error("{path} is not a PG-19 directory: it has no `{split}/` folder of .txt books")]
    MissingSplit {
        /// The directory.
        path: PathBuf,
        /// The missing split.
        split: String,
    },
    /// A combination of settings that cannot work.
    #[error("{0}")]
    Unsupported(String),
    /// A split too small for the requested batches.
    #[error("the {split} split has {tokens} tokens, fewer than {needed} needed for {what}")]
    SplitTooSmall {
        /// The split.
        split: String,
        /// Its token count.
        tokens: usize,
        /// Tokens needed.
        needed: usize,
        /// The layout that needs them.
        what: String,
    },
    /// A batch layout that cannot work.
    #[error("invalid batch layout: {0}")]
    Layout(String),
}

impl DataError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            error: source,
        }
    }
}
