//! Reading checkpoints of format 1, written by tvq before format 2: the
//! model (`model.bin`) and each AdamW group (`optim-decay.bin`,
//! `optim-no-decay.bin`, `optim-toeplitz.bin`) as burn 0.21 records in its
//! positional binary format, the optimizer state keyed by the `ParamId`s
//! stored in the model record. Such a run evaluates, samples, exports and
//! resumes as before; a resumed run writes format 2 from then on.

use std::path::Path;

use burn::module::Module;
use burn::optim::Optimizer;
use burn::record::{BinFileRecorder, FullPrecisionSettings, Recorder};

use super::bad;
use crate::error::TrainError;
use crate::placement::Model;
use crate::step::optim::Optimizers;

type Rec = BinFileRecorder<FullPrecisionSettings>;

fn record_err(dir: &Path) -> impl Fn(burn::record::RecorderError) -> TrainError + '_ {
    move |e| bad(dir, e.to_string())
}

/// The weights of `dir` loaded into `model` (which takes the record's
/// parameter ids, the keys of the optimizer records).
pub(crate) fn load_model(
    dir: &Path,
    model: Model,
    device: &burn::DispatchDevice,
) -> Result<Model, TrainError> {
    model
        .load_file(dir.join("model"), &Rec::new(), device)
        .map_err(record_err(dir))
}

/// The optimizer state of `dir` loaded into `optim`, on `device` (the
/// plain, non-autodiff one).
pub(crate) fn load_optimizer(
    dir: &Path,
    mut optim: Optimizers,
    device: &burn::DispatchDevice,
) -> Result<Optimizers, TrainError> {
    let rec = Rec::new();
    let load = |name: &str| rec.load(dir.join(name), device).map_err(record_err(dir));
    optim.decay = optim.decay.load_record(load("optim-decay")?);
    optim.no_decay = optim.no_decay.load_record(load("optim-no-decay")?);
    // Checkpoints written before the Toeplitz tables had their own group
    // have no such file: their tables start with fresh moments.
    if dir.join("optim-toeplitz.bin").is_file() {
        optim.toeplitz = optim.toeplitz.load_record(load("optim-toeplitz")?);
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
    use tvq_data::hash::fnv1a;
    std::fs::create_dir_all(dir).unwrap();
    let rec = Rec::new();
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
    let mut manifest = std::collections::BTreeMap::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
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
