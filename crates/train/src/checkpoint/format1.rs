//! Reading checkpoints of format 1, written by tvq before format 2: the
//! model (`model.bin`) and each AdamW group (`optim-decay.bin`,
//! `optim-no-decay.bin`, `optim-toeplitz.bin`) as burn 0.21 records in its
//! positional binary format (bincode, as burn's `BinFileRecorder` writes
//! it), the optimizer state keyed by the `ParamId`s stored in the model
//! record. Such a run evaluates, samples, exports and resumes as before; a
//! resumed run writes format 2 from then on.
//!
//! The records are decoded here rather than by burn's recorder, whose
//! decoder believes the lengths a file states: a length of a trillion
//! would be allocated before the bytes behind it are missed. Here every
//! length is held to the file's own size.

use std::path::Path;

use burn::module::{EmptyRecord, Module, Param};
use burn::nn::{Embedding, Linear};
use burn::optim::Optimizer;
use burn::prelude::*;
use burn::record::{BurnRecord, FullPrecisionSettings, Record};
use serde::{Deserialize, Serialize};
use tvq_model::RelativeBias;
use tvq_model::attention::Rotary;
use tvq_model::gau::GauRecordItem;
use tvq_model::model::{TransformerVqRecord, TransformerVqRecordItem};
use tvq_model::norm::RmsNorm;
use tvq_model::position::{PositionTerm, PositionTermRecordItem, XlBias};
use tvq_model::quantizer::VectorQuantizer;

use super::{bad, untrusted};
use crate::error::TrainError;
use crate::placement::{B, TrainBackend};
use crate::step::optim::Optimizers;
use tvq_model::TransformerVq;

/// Records are written and read at full precision.
type S = FullPrecisionSettings;
/// The record item of module `M`, as bincode writes it.
type Item<M> = <<M as Module<B>>::Record as Record<B>>::Item<S>;
/// The item of a field without a record (a setting): bincode writes `None`.
type Empty = <EmptyRecord as Record<B>>::Item<S>;

/// The model's record as format 1 laid it out. bincode is positional, so
/// this is every field of the model as it was then, in order; the model
/// has changed since (one position term type), and this layout is read
/// here and converted rather than kept in the model. The parts unchanged
/// since (embedding, norms, projections, quantizer, XL terms) are read as
/// their modules' records: the committed format-1 run (the CLI's tests)
/// fails to load if one of them changes.
#[derive(Serialize, Deserialize)]
struct ModelV1 {
    embedding: Item<Embedding<B>>,
    sublayers: Vec<GauV1>,
    final_norm: Item<Option<RmsNorm<B>>>,
    output: Item<Option<Linear<B>>>,
    output_bias: Item<Option<Param<Tensor<B, 1>>>>,
    logit_scale: Empty,
    layer_drop: Empty,
}

/// A sublayer's record in format 1.
#[derive(Serialize, Deserialize)]
struct GauV1 {
    input_norm: Item<RmsNorm<B>>,
    q_proj: Item<Linear<B>>,
    kvg_proj: Item<Linear<B>>,
    out_proj: Item<Linear<B>>,
    quantizer: Item<VectorQuantizer<B>>,
    bias: BiasV1,
    dropout: Empty,
    n_head: Empty,
    d_k: Empty,
    d_v: Empty,
    block_len: Empty,
    compute: Empty,
    form: Empty,
}

/// The position term in format 1: a Toeplitz table, XL terms, or neither
/// (the rotary term).
#[derive(Serialize, Deserialize)]
struct BiasV1 {
    toeplitz: Item<Option<Param<Tensor<B, 2>>>>,
    xl: Item<Option<XlBias<B>>>,
}

impl GauV1 {
    /// The sublayer's record as the model has it now.
    fn into_current(self) -> Result<GauRecordItem<B, S>, String> {
        let bias = match (self.bias.toeplitz, self.bias.xl) {
            (Some(table), None) => PositionTermRecordItem::toeplitz(table),
            (None, Some(xl)) => PositionTermRecordItem::xl(xl),
            // The rotary term has no record of its own; its channel is
            // read from the query projection once loaded.
            (None, None) => PositionTermRecordItem::rotary(Record::<B>::into_item::<S>(
                Module::<B>::into_record(Rotary::new(1)),
            )),
            (Some(_), Some(_)) => {
                return Err("a sublayer holds both a Toeplitz table and XL terms".into());
            }
        };
        Ok(GauRecordItem {
            input_norm: self.input_norm,
            q_proj: self.q_proj,
            kvg_proj: self.kvg_proj,
            out_proj: self.out_proj,
            quantizer: self.quantizer,
            bias,
            dropout: self.dropout,
            n_head: self.n_head,
            d_k: self.d_k,
            d_v: self.d_v,
            block_len: self.block_len,
            compute: self.compute,
            form: self.form,
            count_weight: EmptyRecord,
        })
    }

    /// Which position term the record holds.
    fn kind(&self) -> RelativeBias {
        match (&self.bias.toeplitz, &self.bias.xl) {
            (Some(_), _) => RelativeBias::Toeplitz,
            (None, Some(_)) => RelativeBias::Xl,
            (None, None) => RelativeBias::Rotary,
        }
    }
}

/// The record `name` (`<name>.bin`) of the checkpoint `dir`, as burn's
/// `BinFileRecorder` wrote it (bincode with its standard settings), on
/// `device`. Decoded with bincode's byte limit at the next power of two at
/// or above the file's size, so that no length in the file can claim more
/// memory than twice the file.
fn read_record<Bk: Backend, R: Record<Bk>>(
    dir: &Path,
    name: &str,
    device: &Bk::Device,
) -> Result<R, TrainError> {
    Ok(R::from_item(read_item::<R::Item<S>>(dir, name)?, device))
}

/// The item of the record `name` of `dir` (see [`read_record`]).
fn read_item<I: serde::de::DeserializeOwned>(dir: &Path, name: &str) -> Result<I, TrainError> {
    let path = dir.join(name).with_extension("bin");
    let bytes = untrusted::read_at_most(&path, u64::MAX)
        .map_err(|e| bad(dir, format!("{name}.bin {e}")))?;
    let record: BurnRecord<I, B> =
        decode_bounded(&bytes).map_err(|e| bad(dir, format!("{name}.bin: {e}")))?;
    Ok(record.item)
}

/// `bytes` decoded with bincode's standard settings (burn's), every length
/// held to the next power of two at or above `bytes.len()`.
fn decode_bounded<I: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<I, String> {
    use bincode::config::standard;
    // Through serde, bincode's errors arrive as text.
    let fail = |e: bincode::error::DecodeError| {
        let text = e.to_string();
        if text.contains("LimitExceeded") {
            "it states a length beyond its own size".to_string()
        } else {
            text.lines().next().unwrap_or_default().to_string()
        }
    };
    macro_rules! within {
        ($($bits:literal),*) => {$(
            if bytes.len() <= 1 << $bits {
                let config = standard().with_limit::<{ 1 << $bits }>();
                return bincode::serde::decode_from_slice(bytes, config)
                    .map(|(item, _)| item)
                    .map_err(fail);
            }
        )*};
    }
    within!(
        16, 18, 20, 22, 24, 26, 28, 30, 32, 34, 36, 38, 40, 42, 44, 46, 48
    );
    Err(format!(
        "{} bytes, more than a record of format 1 may hold",
        bytes.len()
    ))
}

/// The weights of `dir` loaded into `model` (which takes the record's
/// parameter ids, the keys of the optimizer records).
pub(crate) fn load_model<Bk: TrainBackend>(
    dir: &Path,
    model: TransformerVq<Bk>,
    device: &Bk::Device,
) -> Result<TransformerVq<Bk>, TrainError> {
    let fail = |reason: String| bad(dir, format!("model.bin {reason}"));
    let v1: ModelV1 = read_item(dir, "model")?;
    if v1.sublayers.len() != model.sublayers.len() {
        return Err(fail(format!(
            "holds {} sublayers, its config {}",
            v1.sublayers.len(),
            model.sublayers.len()
        )));
    }
    for (i, (g, want)) in v1.sublayers.iter().zip(&model.sublayers).enumerate() {
        if g.kind() != want.bias.kind() {
            return Err(fail(format!(
                "holds a {:?} position term in sublayer {i}, its config {:?}",
                g.kind(),
                want.bias.kind()
            )));
        }
    }
    let sublayers = v1
        .sublayers
        .into_iter()
        .map(GauV1::into_current)
        .collect::<Result<_, _>>()
        .map_err(fail)?;
    let item: TransformerVqRecordItem<B, S> = TransformerVqRecordItem {
        embedding: v1.embedding,
        sublayers,
        final_norm: v1.final_norm,
        output: v1.output,
        output_bias: v1.output_bias,
        logit_scale: v1.logit_scale,
        layer_drop: v1.layer_drop,
    };
    let item = on_backend::<Bk>(&item).map_err(fail)?;
    let mut model = model.load_record(TransformerVqRecord::from_item(item, device));
    // A rotary model saved before the position channel existed has none:
    // the query projection's width (`H (K + P + W)`, `W` the learned count
    // weight's column) says how many features it has.
    for g in &mut model.sublayers {
        if let PositionTerm::rotary(r) = &mut g.bias {
            let width = g.q_proj.weight.dims()[1] / g.n_head;
            r.channel = width
                .checked_sub(g.d_k + g.count_weight.width())
                .ok_or_else(|| fail(format!("has a query projection {width} wide per head")))?;
        }
    }
    Ok(model)
}

/// The record item `item`, read as format 1 laid it out for [`B`], as the
/// item of another backend's model: the items differ in type only, so a
/// bincode round trip carries it over.
fn on_backend<Bk: Backend>(
    item: &TransformerVqRecordItem<B, S>,
) -> Result<TransformerVqRecordItem<Bk, S>, String> {
    let config = bincode::config::standard();
    let bytes = bincode::serde::encode_to_vec(item, config).map_err(|e| e.to_string())?;
    decode_bounded(&bytes)
}

/// The optimizer state of `dir` loaded into `optim`, on `device` (the
/// plain, non-autodiff one).
pub(crate) fn load_optimizer<Bk: TrainBackend>(
    dir: &Path,
    mut optim: Optimizers<Bk>,
    device: &burn::tensor::Device<Bk::InnerBackend>,
) -> Result<Optimizers<Bk>, TrainError> {
    optim.decay = optim
        .decay
        .load_record(read_record(dir, "optim-decay", device)?);
    optim.no_decay = optim
        .no_decay
        .load_record(read_record(dir, "optim-no-decay", device)?);
    // Checkpoints written before the Toeplitz tables had their own group
    // have no such file: their tables start with fresh moments.
    if dir.join("optim-toeplitz.bin").is_file() {
        optim.toeplitz = optim
            .toeplitz
            .load_record(read_record(dir, "optim-toeplitz", device)?);
    }
    Ok(optim)
}

/// Writes a checkpoint of format 1 into `dir`, as tvq did before format 2
/// (the tests' stand-in for a run of an earlier version).
#[cfg(test)]
pub(crate) fn write(
    dir: &Path,
    model: &crate::placement::Model,
    optim: &Optimizers,
    states: &[tvq_model::ModelState<crate::placement::B>],
    trainer: &super::TrainerState,
) {
    use burn::record::Recorder;
    std::fs::create_dir_all(dir).unwrap();
    let rec = burn::record::BinFileRecorder::<FullPrecisionSettings>::new();
    let model = BurnRecord::<_, B>::new::<burn::record::BinFileRecorder<S>>(v1_of(model));
    let bytes = bincode::serde::encode_to_vec(&model, bincode::config::standard()).unwrap();
    std::fs::write(dir.join("model.bin"), bytes).unwrap();
    for (name, adam) in [
        ("optim-decay", &optim.decay),
        ("optim-no-decay", &optim.no_decay),
        ("optim-toeplitz", &optim.toeplitz),
    ] {
        rec.record(adam.to_record(), dir.join(name)).unwrap();
    }
    let states = super::states_to_bytes(dir, states).unwrap();
    std::fs::write(dir.join("state.safetensors"), states).unwrap();
    let json = serde_json::to_vec_pretty(trainer).unwrap();
    std::fs::write(dir.join("trainer.json"), json).unwrap();
    forge_manifest(dir);
}

/// `model`'s record as format 1 laid it out.
#[cfg(test)]
fn v1_of(model: &crate::placement::Model) -> ModelV1 {
    let item: TransformerVqRecordItem<B, S> = model.clone().into_record().into_item();
    let sublayers = item.sublayers.into_iter().map(|g| {
        let (toeplitz, xl) = match g.bias {
            PositionTermRecordItem::toeplitz(table) => (Some(table), None),
            PositionTermRecordItem::xl(xl) => (None, Some(xl)),
            PositionTermRecordItem::rotary(_) => (None, None),
        };
        GauV1 {
            input_norm: g.input_norm,
            q_proj: g.q_proj,
            kvg_proj: g.kvg_proj,
            out_proj: g.out_proj,
            quantizer: g.quantizer,
            bias: BiasV1 { toeplitz, xl },
            dropout: g.dropout,
            n_head: g.n_head,
            d_k: g.d_k,
            d_v: g.d_v,
            block_len: g.block_len,
            compute: g.compute,
            form: g.form,
        }
    });
    ModelV1 {
        embedding: item.embedding,
        sublayers: sublayers.collect(),
        final_norm: item.final_norm,
        output: item.output,
        output_bias: item.output_bias,
        logit_scale: item.logit_scale,
        layer_drop: item.layer_drop,
    }
}

/// Writes the format-1 manifest of the files in `dir` (sizes and FNV-1a
/// hashes), as tvq did, or as a forger would after changing a file.
#[cfg(test)]
pub(crate) fn forge_manifest(dir: &Path) {
    use tvq_data::hash::fnv1a;
    let mut manifest = std::collections::BTreeMap::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.file_name().is_some_and(|n| n == "manifest.json") {
            continue;
        }
        let bytes = std::fs::read(&path).unwrap();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let hash = format!("{:016x}", fnv1a(&bytes));
        manifest.insert(
            name,
            serde_json::json!({"bytes": bytes.len(), "fnv1a": hash}),
        );
    }
    std::fs::write(
        dir.join("manifest.json"),
        serde_json::to_vec_pretty(&manifest).unwrap(),
    )
    .unwrap();
}
