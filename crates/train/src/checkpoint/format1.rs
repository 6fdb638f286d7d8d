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

use burn::module::Module;
use burn::optim::Optimizer;
use burn::record::{BurnRecord, FullPrecisionSettings, Record};

use super::{bad, untrusted};
use crate::error::TrainError;
use crate::placement::{B, Model};
use crate::step::optim::Optimizers;

/// The record `name` (`<name>.bin`) of the checkpoint `dir`, as burn's
/// `BinFileRecorder` wrote it (bincode with its standard settings), on
/// `device`. Decoded with bincode's byte limit at the next power of two at
/// or above the file's size, so that no length in the file can claim more
/// memory than twice the file.
fn read_record<R: Record<B>>(
    dir: &Path,
    name: &str,
    device: &burn::DispatchDevice,
) -> Result<R, TrainError> {
    let path = dir.join(name).with_extension("bin");
    let bytes = untrusted::read_at_most(&path, u64::MAX)
        .map_err(|e| bad(dir, format!("{name}.bin {e}")))?;
    let record: BurnRecord<R::Item<FullPrecisionSettings>, B> =
        decode_bounded(&bytes).map_err(|e| bad(dir, format!("{name}.bin: {e}")))?;
    Ok(R::from_item(record.item, device))
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
pub(crate) fn load_model(
    dir: &Path,
    model: Model,
    device: &burn::DispatchDevice,
) -> Result<Model, TrainError> {
    Ok(model.load_record(read_record(dir, "model", device)?))
}

/// The optimizer state of `dir` loaded into `optim`, on `device` (the
/// plain, non-autodiff one).
pub(crate) fn load_optimizer(
    dir: &Path,
    mut optim: Optimizers,
    device: &burn::DispatchDevice,
) -> Result<Optimizers, TrainError> {
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
    model: &Model,
    optim: &Optimizers,
    states: &[tvq_model::ModelState<crate::placement::B>],
    trainer: &super::TrainerState,
) {
    use burn::record::Recorder;
    std::fs::create_dir_all(dir).unwrap();
    let rec = burn::record::BinFileRecorder::<FullPrecisionSettings>::new();
    model.clone().save_file(dir.join("model"), &rec).unwrap();
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
