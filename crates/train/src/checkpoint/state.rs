//! The model state carried between segments, one per shard of the batch,
//! as `state.safetensors`.
//!
//! Tensors are named `micro{m}/sublayer{i}/{prev|current}/{k_hat|v|codes}`
//! and `micro{m}/sublayer{i}/cache/{counts|means}` (`micro` from before
//! worker threads made shards of micro-batches; kept so older checkpoints
//! load); the metadata holds `micro_batches`, `sublayers` and each
//! sublayer's position `micro{m}/sublayer{i}/pos`. Codes are stored as
//! float32 (exact up to 2^24). `k_hat` holds the window's keys
//! ([`tvq_model::attention::CachedBlock::k_window`]): the quantized keys,
//! or the keys themselves under `window_keys = "exact"`; the name is kept so
//! older checkpoints load.

use std::collections::BTreeMap;
use std::path::Path;

use burn::prelude::*;
use tvq_model::attention::{AttentionState, CachedBlock, CompressedCache};
use tvq_model::{ModelState, TransformerVq};

use super::bad;
use super::tensor_file::{self, F32Tensor, f32_values};
use crate::error::TrainError;

/// The carried `states` as safetensors bytes (the same states, the same
/// bytes).
pub(crate) fn states_to_bytes<B: Backend>(
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
                    put(format!("{p}/{slot}/k_hat"), b.k_window.to_data());
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
///
/// The bytes are untrusted: the counts in the metadata are bounded by the
/// entries that must back them, every tensor must be F32 of its slot's
/// rank, and codes whole numbers; [`check_states`] then holds the states
/// against the model they are to feed.
pub(crate) fn states_from_bytes<B: Backend>(
    path: &Path,
    bytes: &[u8],
    device: &B::Device,
) -> Result<Vec<ModelState<B>>, TrainError> {
    let fail = |reason: String| bad(path, format!("state.safetensors: {reason}"));
    let (_, header) =
        safetensors::SafeTensors::read_metadata(bytes).map_err(|e| fail(e.to_string()))?;
    let st = safetensors::SafeTensors::deserialize(bytes).map_err(|e| fail(e.to_string()))?;
    let meta = header.metadata().clone().unwrap_or_default();
    let num = |k: &str| -> Result<usize, TrainError> {
        meta.get(k)
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| fail(format!("no `{k}`")))
    };
    let (shards, sublayers) = (num("micro_batches")?, num("sublayers")?);
    // A shard's state holds every sublayer of a model, which has one at
    // least: without this, zero sublayers would let any shard count pass
    // the check below and size the loop that builds the states.
    if shards > 0 && sublayers == 0 {
        return Err(fail(format!("{shards} shards of no sublayers")));
    }
    // Each (shard, sublayer) has its own `pos` entry: counts beyond the
    // entries are a lie, refused before anything is built from them.
    if shards.saturating_mul(sublayers) > meta.len() {
        return Err(fail(format!(
            "{shards} shards of {sublayers} sublayers, but {} metadata entries",
            meta.len()
        )));
    }
    let float = |name: &str, rank: usize| -> Result<Option<TensorData>, TrainError> {
        let Ok(v) = st.tensor(name) else {
            return Ok(None);
        };
        if v.dtype() != safetensors::Dtype::F32 || v.shape().len() != rank {
            return Err(fail(format!(
                "{name} is {:?} of shape {:?}, not F32 of rank {rank}",
                v.dtype(),
                v.shape()
            )));
        }
        Ok(Some(TensorData::new(f32_values(&v), v.shape().to_vec())))
    };
    let mut states = vec![];
    for m in 0..shards {
        let mut layers = vec![];
        for i in 0..sublayers {
            let p = format!("micro{m}/sublayer{i}");
            let block = |slot: &str| -> Result<Option<CachedBlock<B>>, TrainError> {
                let name = |t: &str| format!("{p}/{slot}/{t}");
                let (Some(codes), Some(k_window), Some(v)) = (
                    float(&name("codes"), 3)?,
                    float(&name("k_hat"), 4)?,
                    float(&name("v"), 4)?,
                ) else {
                    return Ok(None);
                };
                let shape = codes.shape.clone();
                let codes = codes.into_vec::<f32>().expect("f32");
                if let Some(c) = codes.iter().find(|c| !(c.fract() == 0.0 && **c >= 0.0)) {
                    return Err(fail(format!("{} holds {c}, not a code", name("codes"))));
                }
                let codes: Vec<i64> = codes.iter().map(|&c| c as i64).collect();
                Ok(Some(CachedBlock {
                    k_window: Tensor::from_data(k_window, device),
                    v: Tensor::from_data(v, device),
                    codes: Tensor::from_data(TensorData::new(codes, shape), device),
                }))
            };
            let cache = match (
                float(&format!("{p}/cache/counts"), 3)?,
                float(&format!("{p}/cache/means"), 4)?,
            ) {
                (Some(c), Some(m)) => Some(CompressedCache {
                    counts: Tensor::from_data(c, device),
                    means: Tensor::from_data(m, device),
                }),
                _ => None,
            };
            layers.push(AttentionState {
                pos: num(&format!("{p}/pos"))?,
                prev: block("prev")?,
                cache,
                current: block("current")?,
            });
        }
        states.push(ModelState { sublayers: layers });
    }
    Ok(states)
}

/// Whether `states` fit `model`: a state per sublayer, each tensor of the
/// sublayer's heads, block length, widths and codebook, one batch of rows
/// per state, codes within the codebook (or its empty-slot sentinel).
pub(crate) fn check_states<B: Backend>(
    states: &[ModelState<B>],
    model: &TransformerVq<B>,
) -> Result<(), String> {
    for (m, state) in states.iter().enumerate() {
        if state.sublayers.len() != model.sublayers.len() {
            return Err(format!(
                "shard {m} carries {} sublayers, the model has {}",
                state.sublayers.len(),
                model.sublayers.len()
            ));
        }
        let mut rows = None;
        for (i, (s, g)) in state.sublayers.iter().zip(&model.sublayers).enumerate() {
            let (h, l, k, v) = (g.n_head, g.block_len, g.d_k, g.d_v);
            let n_code = g.quantizer.n_code();
            let mut dims: Vec<(&str, Vec<usize>, Vec<usize>)> = vec![];
            for (slot, block) in [("prev", &s.prev), ("current", &s.current)] {
                if let Some(b) = block {
                    let r = b.codes.dims()[0];
                    dims.push((slot, b.k_window.dims().to_vec(), vec![r, h, l, k]));
                    dims.push((slot, b.v.dims().to_vec(), vec![r, h, l, v]));
                    dims.push((slot, b.codes.dims().to_vec(), vec![r, h, l]));
                    let top = match b.codes.shape().num_elements() {
                        0 => 0,
                        _ => b.codes.clone().max().into_scalar().elem::<i64>(),
                    };
                    if top > n_code as i64 {
                        return Err(format!(
                            "shard {m}, sublayer {i}: code {top} in a codebook of {n_code}"
                        ));
                    }
                }
            }
            if let Some(c) = &s.cache {
                let r = c.counts.dims()[0];
                dims.push(("cache", c.counts.dims().to_vec(), vec![r, h, n_code]));
                dims.push(("cache", c.means.dims().to_vec(), vec![r, h, n_code, v]));
            }
            for (slot, got, want) in dims {
                let rows = *rows.get_or_insert(want[0]);
                if got != want || want[0] != rows {
                    return Err(format!(
                        "shard {m}, sublayer {i}: a {slot} tensor of shape {got:?}, \
                         the model's is {:?}",
                        [&[rows][..], &want[1..]].concat()
                    ));
                }
            }
        }
    }
    Ok(())
}
