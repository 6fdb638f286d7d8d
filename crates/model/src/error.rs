//! Error types of the model crate.

use thiserror::Error;

/// A configuration value the model cannot be built with.
#[derive(Debug, Error, Clone, PartialEq)]
#[error("invalid model config: `{key}` {reason}")]
pub struct ConfigError {
    /// The offending key, as spelled in the config.
    pub key: String,
    /// What is wrong with it.
    pub reason: String,
}

impl ConfigError {
    pub(crate) fn new(key: &str, reason: impl Into<String>) -> Self {
        Self {
            key: key.to_string(),
            reason: reason.into(),
        }
    }
}

/// An input the model cannot run on.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum ModelError {
    /// A segment without rows or without tokens: nothing to compute.
    #[error("empty input: {rows} rows of {len} tokens")]
    EmptyInput {
        /// Rows in the batch.
        rows: usize,
        /// Tokens per row.
        len: usize,
    },
    /// The block-parallel form needs whole blocks.
    #[error("segment length {len} is not a multiple of the block length {block_len}")]
    SegmentNotBlockAligned {
        /// Tokens in the segment.
        len: usize,
        /// Block length `L`.
        block_len: usize,
    },
    /// The carried state ends inside a block (after token-by-token decoding),
    /// so a block-parallel segment cannot start from it.
    #[error(
        "the carried state is at position {pos}, inside a block of length {block_len}; \
         feed tokens one at a time until the block is complete"
    )]
    StateNotBlockAligned {
        /// Tokens the state has seen.
        pos: usize,
        /// Block length `L`.
        block_len: usize,
    },
    /// The state belongs to another model shape or batch size.
    #[error("the carried state does not match the input: {0}")]
    StateMismatch(String),
    /// Dropout masks drawn for another model or input shape.
    #[error("the dropout masks do not match the input: {0}")]
    MaskMismatch(String),
    /// The quadratic baseline keeps no state between segments.
    #[error("the quadratic attention form has no recurrent form and carries no state")]
    QuadraticIsStateless,
}
