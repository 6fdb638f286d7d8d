//! Training, evaluation, sampling and checkpoints for Transformer-VQ.
//!
//! [`RunConfig`] is the TOML config; [`train`] runs or resumes a run in a run
//! directory, one [`Trainer::step`] at a time; [`evaluate()`] streams a split
//! through the model; [`sample()`] generates with the recurrent form;
//! [`inference::export`] writes safetensors.

pub mod batch;
pub mod check;
pub mod checkpoint;
pub mod config;
pub mod error;
mod fault;
#[cfg(test)]
mod gpu_under_test;
pub mod inference;
pub mod mfu;
mod node;
pub mod parallel;
pub mod placement;
mod progress;
pub mod run;
pub mod step;
pub mod trainer;

pub use config::RunConfig;
pub use error::TrainError;
pub use inference::evaluate::{AttentionShare, EvalOptions, EvalReport, PositionBucket, evaluate};
pub use inference::sample::{SampleOptions, sample};
pub use run::metrics::StepMetrics;
pub use run::{TrainOptions, TrainSummary, train};
pub use trainer::Trainer;
