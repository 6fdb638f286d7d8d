//! Errors of the training crate.

use std::path::PathBuf;

use thiserror::Error;

/// Why a run cannot start or continue.
#[derive(Debug, Error)]
pub enum TrainError {
    /// A file could not be read or written.
    #[error("{path}: {error}")]
    Io {
        /// The path.
        path: PathBuf,
        /// The OS error (in the message, not a separate `source`, so that
        /// an error chain prints it once).
        error: std::io::Error,
    },
    /// The config text does not parse or has unknown keys.
    #[error("config: {0}")]
    Toml(String),
    /// A config value is out of range.
    #[error("config: `{key}` {reason}")]
    Config {
        /// Offending key.
        key: String,
        /// What is wrong.
        reason: String,
    },
    /// The `--device` list cannot be used.
    #[error("--device {0}")]
    Devices(String),
    /// The corpus cannot be used.
    #[error(transparent)]
    Data(#[from] tvq_data::DataError),
    /// The model rejected its input.
    #[error(transparent)]
    Model(#[from] tvq_model::ModelError),
    /// A checkpoint is missing, corrupt or from another run.
    #[error("checkpoint {path}: {reason}")]
    Checkpoint {
        /// The checkpoint directory.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// An official checkpoint cannot be imported.
    #[error("cannot import {path}: {reason}")]
    Import {
        /// The official config or weights file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The run directory belongs to another config.
    #[error(
        "{path} holds checkpoints of a different config; use another --run-dir, or --force to train there anyway"
    )]
    ForeignRunDir {
        /// The run directory.
        path: PathBuf,
    },
    /// Another `tvq train` holds the run directory.
    #[error(
        "{path} is in use by another `tvq train` ({holder}): wait for it to end or stop it, or use another --run-dir"
    )]
    RunDirInUse {
        /// The run directory.
        path: PathBuf,
        /// The process holding it, as its lock file describes it.
        holder: String,
    },
    /// The loss curves cannot be drawn.
    #[error("plot {path}: {reason}")]
    Plot {
        /// The metrics file or the PNG.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// Another node of a run over several failed, disagrees or does not answer.
    #[error("{0}")]
    Peer(String),
    /// The loss stopped being a finite number.
    #[error("loss is {loss} at step {step}; the last good checkpoint is kept in {checkpoint}")]
    NonFinite {
        /// The step.
        step: u64,
        /// The loss value.
        loss: f64,
        /// The last checkpoint.
        checkpoint: String,
    },
    /// A command would need more memory than the device has.
    #[error(
        "{settings} needs at least {needed} of memory, more than the {available} free: \
         lower them, or pass --force to try anyway"
    )]
    Memory {
        /// The estimate.
        needed: String,
        /// The memory free.
        available: String,
        /// The settings that size it.
        settings: String,
    },
    /// A path given for inference holds no model.
    #[error(
        "{0} is neither a checkpoint, a run directory with a valid checkpoint nor a .safetensors export"
    )]
    NoModel(PathBuf),
}

/// A model config error names its key as it appears in the run config.
impl From<tvq_model::ConfigError> for TrainError {
    fn from(e: tvq_model::ConfigError) -> Self {
        Self::Config {
            key: format!("model.{}", e.key),
            reason: e.reason,
        }
    }
}

impl TrainError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            error: source,
        }
    }
}
