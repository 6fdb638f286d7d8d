//! Training, evaluation, sampling and checkpoints for Transformer-VQ.
//!
//! [`RunConfig`] is the TOML config; [`train`] runs or resumes a run in a run
//! directory, one [`Trainer::step`] at a time; [`evaluate()`] streams a split
//! through the model; [`sample()`] generates with the recurrent form;
//! [`export`] writes safetensors.

pub mod batch;
pub mod checkpoint;
pub mod collective;
pub mod config;
pub mod error;
pub mod evaluate;
pub mod export;
mod fault;
#[cfg(test)]
mod gpu_under_test;
pub mod lock;
pub mod metrics;
pub mod mfu;
pub mod optim;
pub mod plot;
mod progress;
pub mod recompute;
pub mod run;
pub mod sample;
pub mod shard;
pub mod step;
pub mod trainer;
pub mod workers;

pub use config::RunConfig;
pub use error::TrainError;
pub use evaluate::{AttentionShare, EvalOptions, EvalReport, PositionBucket, evaluate};
pub use metrics::StepMetrics;
pub use run::{TrainOptions, TrainSummary, train};
pub use sample::{SampleOptions, sample};
pub use trainer::Trainer;
