//! The `[data]` table of a run config: where the corpus is and how training
//! batches are cut from it.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::recall::{MqarConfig, PasskeyConfig};

/// What kind of corpus a path holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CorpusKind {
    /// enwik8, raw (`enwik8`) or zipped (`enwik8.zip`), byte-level; bytes
    /// [0, 90M) train, [90M, 95M) validation, [95M, 100M) test.
    Enwik8,
    /// A text file, or a directory of `.txt` files (name order, recursively;
    /// an end-of-document token after each), split 90/5/5 by bytes.
    Text,
    /// PG-19's layout: `train/`, `validation/`, `test/` of `<id>.txt` books.
    Pg19,
    /// Multi-query associative recall, generated from `[data.mqar]`
    /// ([`crate::recall`]); no `path`.
    Mqar,
    /// Passkey retrieval from `[data.passkey]` ([`crate::recall`]), its
    /// filler from the byte-level text file at `path` (split 90/5/5).
    Passkey,
}

/// Where a corpus is, how to read it, and the layout of training batches.
/// Missing keys take the defaults below; unknown keys are an error.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataConfig {
    /// `enwik8`, `text`, `pg19`, `mqar` or `passkey`.
    pub kind: CorpusKind,
    /// Corpus file or directory (relative paths are relative to the working
    /// directory); required but for the synthetic `mqar`.
    #[serde(default)]
    pub path: PathBuf,
    /// A `tokenizer.json` for tokenized text; byte-level when absent.
    #[serde(default)]
    pub tokenizer: Option<PathBuf>,
    /// Accept an `enwik8` of another size and split it 90/5/5.
    #[serde(default)]
    pub allow_proportional_split: bool,
    /// Where token caches go (default: beside the corpus); created if missing.
    #[serde(default)]
    pub cache_dir: Option<PathBuf>,
    /// Rows per optimizer step (the global batch).
    #[serde(default = "defaults::batch_size")]
    pub batch_size: usize,
    /// Tokens per row per step (one segment, `T`); a multiple of the model's `block_len`.
    #[serde(default = "defaults::update_len")]
    pub update_len: usize,
    /// Tokens per sequence: the state is carried across its segments; a multiple of `update_len`.
    #[serde(default = "defaults::update_len")]
    pub sequence_len: usize,
    /// Reset the state at every sequence (false: only at epoch starts).
    #[serde(default = "defaults::yes")]
    pub reset_each_sequence: bool,
    /// The task of `kind = "mqar"` (its defaults when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mqar: Option<MqarConfig>,
    /// The task of `kind = "passkey"` (its defaults when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub passkey: Option<PasskeyConfig>,
}

mod defaults {
    pub fn batch_size() -> usize {
        8
    }
    pub fn update_len() -> usize {
        512
    }
    pub fn yes() -> bool {
        true
    }
}

impl DataConfig {
    /// A corpus of `kind` at `path`, byte-level, with the default batch layout.
    pub fn new(kind: CorpusKind, path: impl AsRef<Path>) -> Self {
        Self {
            kind,
            path: path.as_ref().to_path_buf(),
            tokenizer: None,
            allow_proportional_split: false,
            cache_dir: None,
            batch_size: defaults::batch_size(),
            update_len: defaults::update_len(),
            sequence_len: defaults::update_len(),
            reset_each_sequence: defaults::yes(),
            mqar: None,
            passkey: None,
        }
    }

    /// The MQAR task of `[data.mqar]`, its defaults where the table is
    /// missing.
    pub fn mqar_task(&self) -> MqarConfig {
        self.mqar.clone().unwrap_or_default()
    }
}
