//! The model state carried between segments, one per shard of the batch,
//! as `state.safetensors`.
//!
//! Tensors are named `micro{m}/sublayer{i}/{prev|current}/{k_hat|v|codes}`
//! and `micro{m}/sublayer{i}/cache/{counts|means}` (`micro` from before
//! worker threads made shards of micro-batches; kept so older checkpoints
//! load); the metadata holds `micro_batches`, `sublayers` and each
//! sublayer's position `micro{m}/sublayer{i}/pos`. Codes are stored as
//! float32 (exact up to 2^24).

use std::collections::BTreeMap;
use std::path::Path;

use burn::prelude::*;
use tvq_model::ModelState;
use tvq_model::attention::{AttentionState, CachedBlock, CompressedCache};

use super::bad;
use super::tensor_file::{self, F32Tensor, f32_values};
use crate::error::TrainError;
use crate::placement::B;

/// The carried `states` as safetensors bytes (the same states, the same
/// bytes).
pub(crate) fn states_to_bytes(
    path: &Path,
    states: &[ModelState<B>],
) -> Result<Vec<u8>, TrainError> {
    let mut tensors = vec![];
    let mut meta = BTreeMap::new();
    let mut put = |name: String, data: TensorData| {
        tensors.push(F32Tensor {
            name,
            shape: data.shape.to_vec(),
            values: Box::new(move || data.convert::<f32>().into_vec::<f32>().expect("f32")),
        });
    };
    for (m, state) in states.iter().enumerate() {
        for (i, s) in state.sublayers.iter().enumerate() {
            let p = format!("micro{m}/sublayer{i}");
            meta.insert(format!("{p}/pos"), s.pos.to_string());
            for (slot, block) in [("prev", &s.prev), ("current", &s.current)] {
                if let Some(b) = block {
                    put(format!("{p}/{slot}/k_hat"), b.k_hat.to_data());
                    put(format!("{p}/{slot}/v"), b.v.to_data());
                    put(format!("{p}/{slot}/codes"), b.codes.to_data());
                }
            }
            if let Some(c) = &s.cache {
                put(format!("{p}/cache/counts"), c.counts.to_data());
                put(format!("{p}/cache/means"), c.means.to_data());
            }
        }
    }
    meta.insert("micro_batches".into(), states.len().to_string());
    meta.insert(
        "sublayers".into(),
        states.first().map_or(0, |s| s.sublayers.len()).to_string(),
    );
    tensor_file::to_bytes(&meta, tensors)
        .map_err(|e| bad(path, format!("state serialization: {e}")))
}

/// The carried states in `bytes` (of [`states_to_bytes`]), on `device`.
pub(crate) fn states_from_bytes(
    path: &Path,
    bytes: &[u8],
    device: &burn::DispatchDevice,
) -> Result<Vec<ModelState<B>>, TrainError> {
    let (_, header) =
        safetensors::SafeTensors::read_metadata(bytes).map_err(|e| bad(path, e.to_string()))?;
    let st = safetensors::SafeTensors::deserialize(bytes).map_err(|e| bad(path, e.to_string()))?;
    let meta = header.metadata().clone().unwrap_or_default();
    let num = |k: &str| -> Result<usize, TrainError> {
        meta.get(k)
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| bad(path, format!("state has no `{k}`")))
    };
    let float = |name: &str| -> Option<TensorData> {
        st.tensor(name)
            .ok()
            .map(|v| TensorData::new(f32_values(&v), v.shape().to_vec()))
    };
    let mut states = vec![];
    for m in 0..num("micro_batches")? {
        let mut sublayers = vec![];
        for i in 0..num("sublayers")? {
            let p = format!("micro{m}/sublayer{i}");
            let block = |slot: &str| -> Option<CachedBlock<B>> {
                let codes = float(&format!("{p}/{slot}/codes"))?;
                let codes = TensorData::new(
                    codes
                        .to_vec::<f32>()
                        .ok()?
                        .iter()
                        .map(|&c| c as i64)
                        .collect::<Vec<_>>(),
                    codes.shape.clone(),
                );
                Some(CachedBlock {
                    k_hat: Tensor::from_data(float(&format!("{p}/{slot}/k_hat"))?, device),
                    v: Tensor::from_data(float(&format!("{p}/{slot}/v"))?, device),
                    codes: Tensor::from_data(codes, device),
                })
            };
            let cache = match (
                float(&format!("{p}/cache/counts")),
                float(&format!("{p}/cache/means")),
            ) {
                (Some(c), Some(m)) => Some(CompressedCache {
                    counts: Tensor::from_data(c, device),
                    means: Tensor::from_data(m, device),
                }),
                _ => None,
            };
            sublayers.push(AttentionState {
                pos: num(&format!("{p}/pos"))?,
                prev: block("prev"),
                cache,
                current: block("current"),
            });
        }
        states.push(ModelState { sublayers });
    }
    Ok(states)
}
