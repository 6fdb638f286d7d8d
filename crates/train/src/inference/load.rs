//! The model a path names, ready for inference: a checkpoint directory, a
//! run directory (its newest valid checkpoint, even while the run trains
//! and prunes), a `tvq export` file, or a Hugging Face folder of `tvq
//! export --format hf`.

use std::path::Path;

use burn::DispatchDevice;
use tvq_data::Vocab;
use tvq_model::TransformerVqConfig;

use crate::checkpoint::{self, Source};
use crate::config::RunConfig;
use crate::error::TrainError;
use crate::inference::export::{ExportInfo, load_export};
use crate::inference::hf::import_hf;
use crate::placement::Model;

/// A model ready for inference and where it came from.
pub struct Loaded {
    /// The model, on the device asked for.
    pub model: Model,
    /// The run's config (the one given instead, if any; none for an export
    /// without one).
    pub config: Option<RunConfig>,
    /// The vocabulary the model reads.
    pub vocab: Vocab,
    /// The optimizer step the weights are from.
    pub step: u64,
    /// The architecture the model was built from.
    pub model_config: TransformerVqConfig,
}

/// Loads `path` onto `device`: a checkpoint directory, a run directory's
/// newest valid checkpoint, or an export ([`checkpoint::read_source`]);
/// `config` replaces the run's own.
pub fn load_for_inference(
    path: &Path,
    config: Option<&Path>,
    device: &DispatchDevice,
) -> Result<Loaded, TrainError> {
    let explicit = config.map(|c| RunConfig::load(c, &[])).transpose()?;
    checkpoint::read_source(path, |source| match source {
        Source::Export(file) => exported(file, load_export(file, device)?, explicit.clone()),
        Source::Hf(dir) => exported(dir, import_hf(dir, device)?, explicit.clone()),
        Source::Checkpoint(dir) => load_checkpoint(dir, explicit.clone(), device),
    })
}

/// The export (or Hugging Face folder) `path` read as `(info, model)`,
/// its vocabulary no larger than its model's.
fn exported(
    path: &Path,
    (info, model): (ExportInfo, Model),
    explicit: Option<RunConfig>,
) -> Result<Loaded, TrainError> {
    let vocab = match &info.tokenizer {
        Some(t) => Vocab::load_tokenizer(t)?,
        None => Vocab::Bytes,
    };
    if vocab.size() > info.model.vocab_size {
        return Err(TrainError::Checkpoint {
            path: path.to_path_buf(),
            reason: format!(
                "its vocabulary has {} tokens, more than the {} its model reads",
                vocab.size(),
                info.model.vocab_size
            ),
        });
    }
    Ok(Loaded {
        model,
        config: explicit,
        vocab,
        step: info.step,
        model_config: info.model,
    })
}

/// Loads the checkpoint directory `dir`, with the config of its run
/// unless `explicit`.
fn load_checkpoint(
    dir: &Path,
    explicit: Option<RunConfig>,
    device: &DispatchDevice,
) -> Result<Loaded, TrainError> {
    let run_dir = dir
        .parent()
        .and_then(Path::parent)
        .ok_or_else(|| TrainError::Checkpoint {
            path: dir.to_path_buf(),
            reason: "a checkpoint lives in <run>/checkpoints/".into(),
        })?;
    let cfg = match explicit {
        Some(c) => c,
        None => RunConfig::load(&run_dir.join("config.toml"), &[])?,
    };
    let vocab = match &cfg.data.tokenizer {
        Some(t) => Vocab::load_tokenizer(t)?,
        None => Vocab::Bytes,
    };
    let model_config = cfg.model_config(vocab.size());
    let model = checkpoint::model_of_checkpoint(dir, &model_config, device)?;
    Ok(Loaded {
        model,
        config: Some(cfg),
        vocab,
        step: checkpoint::read_trainer(dir)?.step,
        model_config,
    })
}
