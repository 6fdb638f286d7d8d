//! Export to safetensors, and loading the export back.
//!
//! `FILE.safetensors` holds every parameter under its module path
//! (`sublayers.3.kvg_proj.weight`, `embedding.weight`, ...), float32,
//! linear weights stored `[in, out]` (`y = x W`; PyTorch's `nn.Linear`
//! stores the transpose). `FILE.json` beside it holds the model config and
//! the vocabulary, enough to rebuild the model.

use std::path::{Path, PathBuf};

use burn::store::{ModuleSnapshot, SafetensorsStore};
use serde::{Deserialize, Serialize};
use tvq_model::TransformerVqConfig;

use crate::error::TrainError;
use crate::optim::{B, Model};

/// The JSON written beside an export.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ExportInfo {
    /// `tvq`.
    pub format: String,
    /// Architecture.
    pub model: TransformerVqConfig,
    /// `bytes+3` or the tokenizer file used in training.
    pub vocab: String,
    /// The tokenizer file used in training, if any.
    pub tokenizer: Option<PathBuf>,
    /// Optimizer steps the weights were trained for.
    pub step: u64,
}

/// Path of the JSON beside `weights`.
pub fn info_path(weights: &Path) -> PathBuf {
    weights.with_extension("json")
}

/// Writes `model` to `weights` (safetensors) and its [`ExportInfo`] beside it.
pub fn export(model: &Model, info: &ExportInfo, weights: &Path) -> Result<(), TrainError> {
    let mut store = SafetensorsStore::from_file(weights.to_path_buf())
        .metadata("format", "tvq")
        .metadata("step", info.step.to_string())
        .overwrite(true);
    model
        .save_into(&mut store)
        .map_err(|e| TrainError::io(weights, std::io::Error::other(e.to_string())))?;
    let path = info_path(weights);
    std::fs::write(
        &path,
        serde_json::to_vec_pretty(info).expect("serializable"),
    )
    .map_err(|e| TrainError::io(&path, e))
}

/// Reads an export's info and weights into a model on `device`.
pub fn load_export(
    weights: &Path,
    device: &burn::DispatchDevice,
) -> Result<(ExportInfo, Model), TrainError> {
    let path = info_path(weights);
    let info: ExportInfo =
        serde_json::from_slice(&std::fs::read(&path).map_err(|e| TrainError::io(&path, e))?)
            .map_err(|e| TrainError::Checkpoint {
                path: path.clone(),
                reason: e.to_string(),
            })?;
    let mut model = info
        .model
        .init::<B>(device)
        .map_err(|e| TrainError::Config {
            key: format!("model.{}", e.key),
            reason: e.reason,
        })?;
    let result = model
        .load_from(&mut SafetensorsStore::from_file(weights.to_path_buf()))
        .map_err(|e| TrainError::Checkpoint {
            path: weights.to_path_buf(),
            reason: e.to_string(),
        })?;
    if !result.missing.is_empty() || !result.errors.is_empty() {
        return Err(TrainError::Checkpoint {
            path: weights.to_path_buf(),
            reason: format!(
                "missing tensors {:?}, errors {:?}",
                result.missing, result.errors
            ),
        });
    }
    Ok((info, model))
}
