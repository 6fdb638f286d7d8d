//! Export to safetensors, and loading the export back.
//!
//! `FILE.safetensors` holds every parameter under its module path
//! (`sublayers.3.kvg_proj.weight`, `embedding.weight`, ...), float32,
//! linear weights stored `[in, out]` (`y = x W`; PyTorch's `nn.Linear`
//! stores the transpose). `FILE.json` beside it holds the model config and
//! the vocabulary, enough to rebuild the model.
//!
//! [`import_official`] reads a checkpoint of the official JAX code (its
//! parameters under their official names in a safetensors file, and its
//! config as JSON) so that it can be exported in tvq's layout.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use safetensors::{Dtype, SafeTensors};
use serde::{Deserialize, Serialize};
use tvq_model::official::{self, OfficialConfig, OfficialTensor};
use tvq_model::{RelativeBias, TransformerVqConfig};

use crate::checkpoint::{self, tensor_file, tensor_file::f32_values};
use crate::error::TrainError;
use crate::placement::{B, Model};

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
    /// Optimizer steps the weights were trained for (0 when imported from
    /// an official checkpoint: its step is not known).
    pub step: u64,
}

/// Path of the JSON beside `weights`.
pub fn info_path(weights: &Path) -> PathBuf {
    weights.with_extension("json")
}

/// Writes `model` to `weights` (safetensors) and its [`ExportInfo`] beside it.
pub fn export(model: &Model, info: &ExportInfo, weights: &Path) -> Result<(), TrainError> {
    let path = info_path(weights);
    // `--out bpe.safetensors` beside the tokenizer `bpe.json` would write
    // the config over the tokenizer the export needs.
    let same = |a: &Path, b: &Path| {
        std::fs::canonicalize(a)
            .ok()
            .is_some_and(|a| std::fs::canonicalize(b).ok() == Some(a))
    };
    if info.tokenizer.as_deref().is_some_and(|t| same(t, &path)) {
        return Err(TrainError::io(
            &path,
            std::io::Error::other(
                "is the model's tokenizer, which the export's config would replace: choose another --out",
            ),
        ));
    }
    // The channel width the weights have, whatever the config left to its
    // default (a missing key reads as an export from before the channel).
    let mut info = info.clone();
    if info.model.bias == RelativeBias::Rotary {
        info.model.rotary_channel = model.sublayers.first().map(|g| g.bias.channel());
    }
    // The same writer as checkpoints: the same weights, the same bytes.
    let meta = checkpoint::weights_metadata(info.step);
    std::fs::File::create(weights)
        .and_then(|file| tensor_file::write(file, &meta, checkpoint::model_tensors(model)))
        .map_err(|e| TrainError::io(weights, e))?;
    std::fs::write(
        &path,
        serde_json::to_vec_pretty(&info).expect("serializable"),
    )
    .map_err(|e| TrainError::io(&path, e))
}

/// Reads an export's info and weights into a model on `device`.
pub fn load_export(
    weights: &Path,
    device: &burn::DispatchDevice,
) -> Result<(ExportInfo, Model), TrainError> {
    let path = info_path(weights);
    let bad = |e: serde_json::Error| TrainError::Checkpoint {
        path: path.clone(),
        reason: e.to_string(),
    };
    let text = checkpoint::untrusted::read_at_most(&path, checkpoint::untrusted::JSON_LIMIT)
        .map_err(|e| TrainError::io(&path, e))?;
    let mut json: serde_json::Value = serde_json::from_slice(&text).map_err(bad)?;
    // Exports written before the rotary position channel existed have no
    // such key, and no channel in their weights.
    if let Some(model) = json.get_mut("model").and_then(|m| m.as_object_mut()) {
        model
            .entry("rotary_channel")
            .or_insert(serde_json::Value::from(0));
    }
    let info: ExportInfo = serde_json::from_value(json).map_err(bad)?;
    let model = checkpoint::model_of_file(weights, &info.model, device)?;
    Ok((info, model))
}

/// Builds a model from an official checkpoint: `config` is the official
/// config as JSON (the object itself, or an object holding it under
/// `config`), `weights` a safetensors file with the parameters under their
/// official names (`transformer_layers_0/scanned_attn1/q_proj/kernel`, ...,
/// optionally under `params/`; float32; other tensors in the file are
/// ignored). See [`tvq_model::official`] for the mapping.
pub fn import_official(
    config: &Path,
    weights: &Path,
    device: &burn::DispatchDevice,
) -> Result<(TransformerVqConfig, Model), TrainError> {
    let fail = |path: &Path, reason: String| TrainError::Import {
        path: path.to_path_buf(),
        reason,
    };
    let text = checkpoint::untrusted::read_at_most(config, checkpoint::untrusted::JSON_LIMIT)
        .map_err(|e| TrainError::io(config, e))?;
    let json: serde_json::Value =
        serde_json::from_slice(&text).map_err(|e| fail(config, format!("not JSON ({e})")))?;
    let json = json.get("config").cloned().unwrap_or(json);
    let official: OfficialConfig =
        serde_json::from_value(json).map_err(|e| fail(config, e.to_string()))?;
    let tensors = read_float_tensors(weights)?;
    official::import::<B>(&official, &tensors, device).map_err(|e| match e {
        official::ImportError::Missing(_) | official::ImportError::Shape { .. } => {
            fail(weights, e.to_string())
        }
        _ => fail(config, e.to_string()),
    })
}

/// Every float32 tensor of a safetensors file, by name.
fn read_float_tensors(path: &Path) -> Result<BTreeMap<String, OfficialTensor>, TrainError> {
    let bytes =
        checkpoint::untrusted::read_at_most(path, u64::MAX).map_err(|e| TrainError::io(path, e))?;
    let file = SafeTensors::deserialize(&bytes).map_err(|e| TrainError::Import {
        path: path.to_path_buf(),
        reason: format!("not a safetensors file ({e})"),
    })?;
    Ok(file
        .tensors()
        .into_iter()
        .filter(|(_, view)| view.dtype() == Dtype::F32)
        .map(|(name, view)| {
            let data = f32_values(&view);
            let shape = view.shape().to_vec();
            // A flax tree saved whole has its parameters under `params/`.
            let name = name
                .strip_prefix("params/")
                .map_or(name.clone(), String::from);
            (name, OfficialTensor { shape, data })
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::placement::device::DeviceSpec;
    use burn::prelude::*;
    use tvq_model::Pass;

    /// A rotary model's export records the channel width its weights have,
    /// also when its config left it to the default; and an export from
    /// before the position channel (its JSON without `rotary_channel`)
    /// loads as the model it was.
    #[test]
    fn rotary_exports_load_with_the_channel_they_were_saved_with() {
        let dir = tempfile::tempdir().unwrap();
        let device = DeviceSpec::Cpu.init().unwrap().0;
        let cfg = crate::checkpoint::tests::tiny_config().with_bias(RelativeBias::Rotary);
        let tokens = Tensor::<B, 2, Int>::from_data([[1, 2, 3, 4]], &device);
        let logits = |m: &Model| -> Vec<f32> {
            m.forward(tokens.clone(), m.empty_state(), Pass::new())
                .unwrap()
                .logits
                .unwrap()
                .to_data()
                .to_vec()
                .unwrap()
        };
        // (channel in the config, whether the JSON loses the key as an
        // export written before the channel would, width loaded: the
        // default is d_k)
        for (channel, old, want) in [(None, false, cfg.d_k), (Some(0), true, 0)] {
            let cfg = cfg.clone().with_rotary_channel(channel);
            let model =
                crate::placement::seeded_draw::<B, _>(&device, None, || cfg.init::<B>(&device))
                    .unwrap();
            let info = ExportInfo {
                format: "tvq".into(),
                model: cfg,
                vocab: "bytes+3".into(),
                tokenizer: None,
                step: 0,
            };
            let weights = dir.path().join("m.safetensors");
            export(&model, &info, &weights).unwrap();
            if old {
                let mut json: serde_json::Value =
                    serde_json::from_slice(&std::fs::read(info_path(&weights)).unwrap()).unwrap();
                json["model"]
                    .as_object_mut()
                    .unwrap()
                    .remove("rotary_channel")
                    .expect("exports write the key");
                std::fs::write(info_path(&weights), json.to_string()).unwrap();
            }
            let (back, loaded) = load_export(&weights, &device).unwrap();
            assert_eq!(back.model.rotary_channel, Some(want));
            assert_eq!(loaded.sublayers[0].bias.channel(), want);
            assert_eq!(logits(&loaded), logits(&model));
        }
    }
}
