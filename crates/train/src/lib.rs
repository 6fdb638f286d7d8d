//! Training, evaluation, sampling and checkpoints for Transformer-VQ.
//!
//! [`RunConfig`] is the TOML config; [`train`] runs or resumes a run in a run
//! directory, one [`Trainer::step`] at a time; [`evaluate()`] streams a split
//! through the model; [`sample()`] generates with the recurrent form;
//! [`inference::export`] writes safetensors.
//!
//! Training with a loop of one's own around [`Trainer::step`], then
//! generating from the trained model (the examples in `examples/` do the
//! same at full size, and load runs and exports). `Trainer::new` runs on
//! `burn::Dispatch`, every device, the kernels composed;
//! `Trainer::<placement::CpuFused>::start` trains on the CPU with its fused
//! kernels (`WgpuFused` and `CudaFused` on the GPUs), as [`train`] does
//! ([`placement::TrainOn`]):
//!
//! ```
//! use tvq_data::{Corpus, Split, TrainBatches, TrainCursor};
//! use tvq_train::placement::device::DeviceSpec;
//! use tvq_train::{RunConfig, SampleOptions, Trainer, sample};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let dir = tempfile::tempdir()?;
//! let text = dir.path().join("text.txt");
//! std::fs::write(&text, "the cat sat on the mat. ".repeat(200))?;
//! // A run config (the TOML of `tvq train --config`), here a tiny model.
//! let cfg = RunConfig::parse(
//!     &format!(
//!         "[model]\nd_model = 16\nd_k = 8\nd_v = 16\nn_code = 8\nblock_len = 8\n\
//!          [data]\nkind = \"text\"\npath = {:?}\nbatch_size = 2\n\
//!          update_len = 32\nsequence_len = 32\n[train]\nworkers = 1",
//!         text.display().to_string()
//!     ),
//!     &[],
//! )?;
//! let corpus = Corpus::open(&cfg.data)?;
//! let (device, _) = DeviceSpec::Cpu.init()?;
//! let mut trainer = Trainer::new(&cfg.model_config(corpus.vocab.size()), &cfg.train, &[device])?;
//! let layout = cfg.data.train_layout(cfg.train.seed);
//! let mut batches = TrainBatches::new(corpus.split(Split::Train), layout, TrainCursor::default())?;
//! for _ in 0..3 {
//!     let batch = batches.next().expect("training batches never end");
//!     let out = trainer.step(&batch, batches.cursor())?;
//!     assert!(out.loss.is_finite()); // your metrics here
//! }
//! // Ten tokens after a prompt: the prompt read in block form, then each
//! // token from the compressed cache at constant cost.
//! let opts = SampleOptions { max_tokens: 10, temperature: 1.0, top_p: 1.0, seed: 1, progress: false };
//! let prompt = corpus.vocab.encode("the cat")?;
//! let tokens = sample(&trainer.inference_model(), &prompt, corpus.vocab.eos(), opts, |_| true)?;
//! assert_eq!(tokens.len(), 10);
//! # Ok(())
//! # }
//! ```

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
mod nofollow;
pub mod parallel;
pub mod placement;
mod progress;
pub mod run;
pub mod step;
pub mod trainer;

pub use config::RunConfig;
pub use error::TrainError;
pub use inference::attention::AttentionShare;
pub use inference::evaluate::{EvalOptions, EvalReport, PositionBucket, evaluate};
pub use inference::sample::{SampleOptions, sample};
pub use run::metrics::StepMetrics;
pub use run::{TrainOptions, TrainSummary, train};
pub use trainer::Trainer;
