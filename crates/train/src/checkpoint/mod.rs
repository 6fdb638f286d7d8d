//! Checkpoints that resume exactly, in tvq's own format.
//!
//! A checkpoint is a directory `checkpoints/step-NNNNNNNN/` of plain files
//! that any safetensors and JSON reader opens (docs/training.md lists every
//! name): `model.safetensors` (every parameter, the EMA codebook statistics
//! included, under its module path), `optimizer.safetensors` (the AdamW
//! moments of each group under the parameter's path, step counts in the
//! metadata), `state.safetensors` (the state carried between segments),
//! `trainer.json` (step, data cursor, best validation loss, loss scale)
//! and `manifest.json` (the format number and every file's size and
//! xxh3-64). The learning rate is a function of the step and dropout is
//! reseeded from (seed, step), so nothing else is needed to continue
//! bit-identically; the same run writes the same bytes.
//!
//! The directory is written under a temporary name, synced, then renamed;
//! readers list only `step-N` names, so they never see a temporary one. A
//! checkpoint whose files do not match its manifest is skipped. Checkpoints
//! of format 1 (burn records, module `format1`) are still read.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use burn::prelude::Backend;
use burn::store::{ModuleSnapshot, SafetensorsStore};
use serde::{Deserialize, Serialize};
use tvq_data::TrainCursor;
use tvq_model::{ModelState, TransformerVq, TransformerVqConfig, VqBackend};

use crate::error::TrainError;
use crate::fault::{self, Point};
use crate::nofollow;
use crate::placement::{B, Model, TrainBackend, seeded_draw};
use crate::step::optim::{LossScale, Optimizers};

mod format1;
mod manifest;
mod named;
mod state;
pub(crate) mod tensor_file;
pub(crate) mod untrusted;

pub use manifest::FORMAT;
pub(crate) use named::model_tensors;
pub(crate) use state::{states_from_bytes, states_to_bytes};
pub use tensor_file::checksum;

/// Progress of a run, saved with each checkpoint.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TrainerState {
    /// Optimizer steps done.
    pub step: u64,
    /// Where the data loader continues.
    pub cursor: TrainCursor,
    /// Best validation loss so far and its step.
    pub best: Option<(f64, u64)>,
    /// Training tokens consumed.
    pub tokens: u64,
    /// The dynamic loss scale of `f16` training (absent otherwise, and in
    /// checkpoints written before it existed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_scale: Option<LossScale>,
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> TrainError + '_ {
    move |e| TrainError::io(path, e)
}

pub(crate) fn bad(path: &Path, reason: impl Into<String>) -> TrainError {
    TrainError::Checkpoint {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

/// Directory of the checkpoint after `step`.
pub fn checkpoint_dir(run_dir: &Path, step: u64) -> PathBuf {
    run_dir.join("checkpoints").join(format!("step-{step:08}"))
}

fn sync_dir(path: &Path) {
    if let Ok(d) = std::fs::File::open(path) {
        let _ = d.sync_all();
    }
}

/// Writes a checkpoint atomically; returns its directory.
///
/// The files go to a temporary directory (`.tmp-step-N-PID`), are synced,
/// listed in the manifest, then the directory is renamed into place. A
/// failure removes the temporary directory; a process killed while writing
/// leaves it for [`remove_leftovers`] at the next start. A checkpoint of
/// the same step already in place (one that failed verification, say) is
/// set aside first and deleted only once the new one is in place.
pub fn save<Bk: TrainBackend>(
    run_dir: &Path,
    model: &TransformerVq<Bk>,
    optim: &Optimizers<Bk>,
    states: &[ModelState<Bk>],
    trainer: &TrainerState,
) -> Result<PathBuf, TrainError> {
    let final_dir = checkpoint_dir(run_dir, trainer.step);
    let parent = final_dir
        .parent()
        .expect("under checkpoints/")
        .to_path_buf();
    std::fs::create_dir_all(&parent).map_err(io(&parent))?;
    let tmp = parent.join(format!(
        "{TMP}step-{:08}-{}",
        trainer.step,
        std::process::id()
    ));
    let written = write_files(&tmp, model, optim, states, trainer)
        .and_then(|()| move_into_place(&tmp, &final_dir));
    if written.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    written?;
    sync_dir(&parent);
    Ok(final_dir)
}

/// The files of a checkpoint (format 2).
const MODEL: &str = "model.safetensors";
const OPTIMIZER: &str = "optimizer.safetensors";
const STATE: &str = "state.safetensors";
const TRAINER: &str = "trainer.json";

/// Prefixes of the temporary entries of `checkpoints/`: a checkpoint being
/// written, one being replaced, one being deleted.
const TMP: &str = ".tmp-";
const REPLACED: &str = ".replaced-";
const PRUNED: &str = ".pruned-";

/// The metadata of a weights file (checkpoint or export) of `step`.
pub(crate) fn weights_metadata(step: u64) -> BTreeMap<String, String> {
    BTreeMap::from([
        ("format".to_string(), "tvq".to_string()),
        ("step".to_string(), step.to_string()),
    ])
}

/// Writes every file of a checkpoint, and its manifest, into `tmp`: each
/// file synced and hashed as it is written, in a fixed order.
fn write_files<Bk: TrainBackend>(
    tmp: &Path,
    model: &TransformerVq<Bk>,
    optim: &Optimizers<Bk>,
    states: &[ModelState<Bk>],
    trainer: &TrainerState,
) -> Result<(), TrainError> {
    // A fresh directory: one found there (or a link, which remove_dir_all
    // removes, not its target) is gone first, and create_dir refuses
    // anything that appears in between.
    let _ = std::fs::remove_dir_all(tmp);
    std::fs::create_dir(tmp).map_err(io(tmp))?;
    let mut files = BTreeMap::new();
    let path = tmp.join(MODEL);
    let meta = weights_metadata(trainer.step);
    let written = nofollow::create(&path)
        .and_then(|file| tensor_file::write(file, &meta, model_tensors(model)))
        .map_err(io(&path))?;
    files.insert(MODEL, written);
    fault::inject(Point::CheckpointData).map_err(io(tmp))?;
    let path = tmp.join(OPTIMIZER);
    let (meta, tensors) = named::optimizer_tensors(model, optim);
    let written = nofollow::create(&path)
        .and_then(|file| tensor_file::write(file, &meta, tensors))
        .map_err(io(&path))?;
    files.insert(OPTIMIZER, written);
    let json = serde_json::to_vec_pretty(trainer).expect("serializable");
    for (name, bytes) in [(STATE, states_to_bytes(tmp, states)?), (TRAINER, json)] {
        let path = tmp.join(name);
        let written = tensor_file::write_bytes(&path, &bytes).map_err(io(&path))?;
        files.insert(name, written);
    }
    let path = tmp.join("manifest.json");
    fault::inject(Point::CheckpointManifest).map_err(io(&path))?;
    tensor_file::write_bytes(&path, &manifest::to_bytes(&files)).map_err(io(&path))?;
    sync_dir(tmp);
    Ok(())
}

/// Renames the complete `tmp` to `final_dir`, setting aside a directory
/// already there and deleting it once the new one is in place (put back
/// if the rename fails).
fn move_into_place(tmp: &Path, final_dir: &Path) -> Result<(), TrainError> {
    fault::inject(Point::CheckpointRename).map_err(io(final_dir))?;
    let replaced = final_dir.exists().then(|| set_aside(final_dir, REPLACED));
    let replaced = replaced.transpose().map_err(io(final_dir))?;
    if let Err(e) = std::fs::rename(tmp, final_dir) {
        if let Some(old) = &replaced {
            let _ = std::fs::rename(old, final_dir);
        }
        return Err(io(final_dir)(e));
    }
    if let Some(old) = replaced {
        let _ = std::fs::remove_dir_all(old);
    }
    Ok(())
}

/// Renames the checkpoint `dir` to a hidden `PREFIX` name beside it, which
/// no reader lists; returns the new path.
fn set_aside(dir: &Path, prefix: &str) -> std::io::Result<PathBuf> {
    let name = dir.file_name().expect("step-N").to_string_lossy();
    let aside = dir.with_file_name(format!("{prefix}{name}-{}", std::process::id()));
    std::fs::rename(dir, &aside)?;
    Ok(aside)
}

/// Removes what an earlier writer of `run_dir` left when it was killed or
/// failed: temporary checkpoint directories and files. A checkpoint that
/// was being replaced goes back into place if its replacement never got
/// there. Call only while holding the run directory's lock
/// ([`crate::run::lock::RunLock`]); returns how many entries were cleared.
pub fn remove_leftovers(run_dir: &Path) -> usize {
    let mut cleared = 0;
    let dir = run_dir.join("checkpoints");
    for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        if let Some(rest) = name.strip_prefix(REPLACED) {
            // `step-N-PID`: put back unless `step-N` is in place.
            let step_dir = rest.rsplit_once('-').map(|(s, _)| dir.join(s));
            if let Some(step_dir) = step_dir.filter(|d| !d.exists())
                && std::fs::rename(&path, &step_dir).is_ok()
            {
                tracing::warn!(
                    "put back {}, whose replacement was never written",
                    step_dir.display()
                );
                continue;
            }
        } else if !(name.starts_with(TMP) || name.starts_with(PRUNED)) {
            continue;
        }
        if std::fs::remove_dir_all(&path).is_ok() {
            cleared += 1;
        }
    }
    for name in [".config.toml.tmp", ".metrics.jsonl.tmp"] {
        if std::fs::remove_file(run_dir.join(name)).is_ok() {
            cleared += 1;
        }
    }
    cleared
}

/// Checks every file of a checkpoint against its manifest; returns the
/// checkpoint's format (1 or [`FORMAT`]).
pub fn verify(dir: &Path) -> Result<u32, TrainError> {
    manifest::verify(dir)
}

/// Checkpoint directories of a run, newest first.
pub fn list(run_dir: &Path) -> Vec<(u64, PathBuf)> {
    let mut found: Vec<(u64, PathBuf)> = std::fs::read_dir(run_dir.join("checkpoints"))
        .into_iter()
        .flatten()
        .filter_map(|e| {
            let path = e.ok()?.path();
            let step = path
                .file_name()?
                .to_str()?
                .strip_prefix("step-")?
                .parse()
                .ok()?;
            Some((step, path))
        })
        .collect();
    found.sort_by_key(|f| std::cmp::Reverse(f.0));
    found
}

/// The newest checkpoint that verifies, warning about any skipped.
///
/// A run being trained deletes old checkpoints while this looks (the
/// newest `keep_checkpoints` stay): one that vanished was replaced by a
/// newer one, so the list is read again rather than the vanished one
/// reported as damaged.
pub fn latest_valid(run_dir: &Path) -> Option<PathBuf> {
    for _ in 0..100 {
        let mut vanished = false;
        for (_, dir) in list(run_dir) {
            match verify(&dir) {
                Ok(_) => return Some(dir),
                Err(_) if !dir.exists() => vanished = true,
                Err(e) => tracing::warn!("skipping {e}"),
            }
        }
        if !vanished {
            break;
        }
    }
    None
}

/// A checkpoint read back to continue its run: everything [`resume`]
/// restores.
pub struct Resumed<Bk: TrainBackend = B> {
    /// The model (on the autodiff device given to [`resume`]).
    pub model: TransformerVq<Bk>,
    /// Optimizer state.
    pub optim: Optimizers<Bk>,
    /// Carried states, one per shard of the batch.
    pub states: Vec<ModelState<Bk>>,
    /// Progress.
    pub trainer: TrainerState,
}

/// Reads a verified checkpoint into `model` / `optim` built from the run's
/// config, the model on `device` and the carried states on `state_device`
/// (the autodiff device the shards run on, whose checkpointing strategy the
/// states must share).
pub fn resume<Bk: TrainBackend>(
    dir: &Path,
    model: TransformerVq<Bk>,
    optim: Optimizers<Bk>,
    device: &Bk::Device,
    state_device: &Bk::Device,
) -> Result<Resumed<Bk>, TrainError> {
    let format = verify(dir)?;
    let model = read_checkpoint_weights(dir, format, model, device)?;
    // Optimizer state lives on the plain (non-autodiff) device.
    let inner = Bk::inner_device(device);
    let optim = match format {
        1 => format1::load_optimizer(dir, optim, &inner)?,
        _ => named::read_optimizer(&dir.join(OPTIMIZER), &model, optim, &inner)?,
    };
    let state_path = dir.join(STATE);
    let bytes = untrusted::read_at_most(&state_path, u64::MAX).map_err(io(&state_path))?;
    let states = states_from_bytes(dir, &bytes, state_device)?;
    state::check_states(&states, &model).map_err(|e| bad(dir, format!("{STATE}: {e}")))?;
    let trainer = read_trainer(dir)?;
    Ok(Resumed {
        model,
        optim,
        states,
        trainer,
    })
}

/// The `trainer.json` of the checkpoint `dir`, whose step must be the one
/// the directory is named after.
pub(crate) fn read_trainer(dir: &Path) -> Result<TrainerState, TrainError> {
    let path = dir.join(TRAINER);
    let bytes = untrusted::read_at_most(&path, untrusted::JSON_LIMIT).map_err(io(&path))?;
    let trainer: TrainerState =
        serde_json::from_slice(&bytes).map_err(|e| bad(dir, format!("{TRAINER}: {e}")))?;
    let named = dir
        .file_name()
        .and_then(|n| n.to_str()?.strip_prefix("step-")?.parse::<u64>().ok());
    if named.is_some_and(|n| n != trainer.step) {
        return Err(bad(
            dir,
            format!(
                "{TRAINER} says step {}, the directory's name another",
                trainer.step
            ),
        ));
    }
    Ok(trainer)
}

/// The model of `cfg` with the weights of the checkpoint `dir`, on
/// `device`: the weights file must hold the config's parameters (checked
/// before the model is built, as for an export: a run's `config.toml` is
/// as untrusted as the checkpoint beside it).
pub fn model_of_checkpoint(
    dir: &Path,
    cfg: &TransformerVqConfig,
    device: &burn::DispatchDevice,
) -> Result<Model, TrainError> {
    match verify(dir)? {
        1 => {
            let bytes = untrusted::regular_file_len(&dir.join("model.bin"))
                .map_err(|e| bad(dir, format!("model.bin {e}")))?;
            // A record's floats are 4 bytes each: a quarter of that is a
            // bound that no layout of the record can miss.
            if bytes < cfg.num_params() as u64 {
                return Err(bad(
                    dir,
                    format!(
                        "model.bin holds {bytes} bytes, too few for the {} parameters of its config",
                        cfg.num_params()
                    ),
                ));
            }
            format1::load_model(dir, built(cfg, device)?, device)
        }
        _ => model_of_file(&dir.join(MODEL), cfg, device),
    }
}

/// The config's file in a Hugging Face folder of `tvq export --format hf`
/// (what marks a folder as one).
pub const HF_CONFIG: &str = "config.json";
/// The weights' file in a Hugging Face folder.
pub const HF_WEIGHTS: &str = "model.safetensors";

/// What a path given for a model names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    /// A `tvq export` file (`.safetensors`, its JSON beside it).
    Export(PathBuf),
    /// A checkpoint directory (a run directory's newest valid one, where
    /// a run directory was given).
    Checkpoint(PathBuf),
    /// A Hugging Face folder of `tvq export --format hf`.
    Hf(PathBuf),
}

/// `read` of what `path` names: an export, a checkpoint directory, a
/// Hugging Face folder, or a run directory's newest valid checkpoint. A
/// run being trained deletes old checkpoints once it has written a newer
/// one, maybe the one being read: then the newest is looked for again.
pub fn read_source<T>(
    path: &Path,
    mut read: impl FnMut(&Source) -> Result<T, TrainError>,
) -> Result<T, TrainError> {
    if path.extension().is_some_and(|e| e == "safetensors") {
        return read(&Source::Export(path.to_path_buf()));
    }
    if path.join("manifest.json").is_file() {
        return read(&Source::Checkpoint(path.to_path_buf()));
    }
    if path.join(HF_CONFIG).is_file() {
        return read(&Source::Hf(path.to_path_buf()));
    }
    for _ in 0..100 {
        let dir = latest_valid(path).ok_or_else(|| TrainError::NoModel(path.to_path_buf()))?;
        match read(&Source::Checkpoint(dir.clone())) {
            Err(_) if !dir.exists() => continue,
            read => return read,
        }
    }
    Err(TrainError::NoModel(path.to_path_buf()))
}

/// `model` (on `device`) with the weights of what `path` names
/// ([`read_source`]). Every tensor of `model` must be in the file, in its
/// shape, and no other (a source of another architecture is an error
/// naming the tensors, not a half-loaded model). `train.init_from`.
pub fn read_weights_from<Bk: TrainBackend>(
    path: &Path,
    model: TransformerVq<Bk>,
    device: &Bk::Device,
) -> Result<TransformerVq<Bk>, TrainError> {
    read_source(path, |source| match source {
        Source::Export(file) => read_weights(file, model.clone()),
        Source::Checkpoint(dir) => {
            read_checkpoint_weights(dir, verify(dir)?, model.clone(), device)
        }
        Source::Hf(dir) => read_weights(&dir.join(HF_WEIGHTS), model.clone()),
    })
}

fn read_checkpoint_weights<Bk: TrainBackend>(
    dir: &Path,
    format: u32,
    model: TransformerVq<Bk>,
    device: &Bk::Device,
) -> Result<TransformerVq<Bk>, TrainError> {
    match format {
        1 => format1::load_model(dir, model, device),
        _ => read_weights(&dir.join(MODEL), model),
    }
}

/// `model` with the weights of the safetensors file `path` (a checkpoint's
/// `model.safetensors` or an export), every parameter required. Tensors
/// stored as F16 or BF16 load widened to F32 (exactly); any other type is
/// an error naming the tensor, checked before burn sees the file (whose
/// loader panics on a type it does not expect).
pub(crate) fn read_weights<Bk: Backend>(
    path: &Path,
    model: TransformerVq<Bk>,
) -> Result<TransformerVq<Bk>, TrainError> {
    let bytes = untrusted::read_at_most(path, u64::MAX).map_err(|e| TrainError::io(path, e))?;
    weights_from_bytes(path, bytes, model)
}

/// The model of `cfg` on `device` with the weights of the safetensors
/// file `path` (an export, whose config came with it): the file must hold
/// at least the config's parameter count in values, checked before the
/// model is built, so that a config that lies about its sizes is an error,
/// not an allocation of whatever it claims.
pub(crate) fn model_of_file(
    path: &Path,
    cfg: &TransformerVqConfig,
    device: &burn::DispatchDevice,
) -> Result<Model, TrainError> {
    let bytes = untrusted::read_at_most(path, u64::MAX).map_err(|e| TrainError::io(path, e))?;
    let file =
        safetensors::SafeTensors::deserialize(&bytes).map_err(|e| bad(path, e.to_string()))?;
    let values = file
        .tensors()
        .iter()
        .map(|(_, v)| v.shape().iter().product::<usize>())
        .fold(0usize, usize::saturating_add);
    let want = cfg.num_params();
    if values < want {
        return Err(bad(
            path,
            format!(
                "holds {values} values, but the model its config describes has {want} parameters"
            ),
        ));
    }
    weights_from_bytes(path, bytes, built(cfg, device)?)
}

/// The model of `cfg` on `device`, its initial weights (replaced by a
/// file's) drawn under the draw lock: the backend's generator is shared
/// by every thread of the process ([`seeded_draw`]).
fn built(cfg: &TransformerVqConfig, device: &burn::DispatchDevice) -> Result<Model, TrainError> {
    built_on::<B>(cfg, device)
}

/// [`built`] on any backend.
fn built_on<Bk: VqBackend>(
    cfg: &TransformerVqConfig,
    device: &Bk::Device,
) -> Result<TransformerVq<Bk>, TrainError> {
    Ok(seeded_draw::<Bk, _>(device, None, || {
        cfg.init::<Bk>(device)
    })?)
}

/// `model`'s weights and codebooks in a model of `cfg` on `device` of
/// another backend, through the bytes of a weights file: how a model
/// trained on a fused backend reaches [`B`] for evaluation and sampling,
/// and how weights drawn on the CPU reach a backend without a CPU device.
pub(crate) fn moved<From: TrainBackend, To: VqBackend>(
    model: &TransformerVq<From>,
    cfg: &TransformerVqConfig,
    device: &To::Device,
) -> Result<TransformerVq<To>, TrainError> {
    let bytes = tensor_file::to_bytes(&BTreeMap::new(), model_tensors(model))
        .map_err(|e| TrainError::io(Path::new("(trained weights)"), e))?;
    let skeleton = built_on::<To>(cfg, device)?;
    let mut out = weights_from_bytes(Path::new("(trained weights)"), bytes, skeleton)?;
    out.set_precision(model.precision());
    Ok(out)
}

fn weights_from_bytes<Bk: Backend>(
    path: &Path,
    bytes: Vec<u8>,
    mut model: TransformerVq<Bk>,
) -> Result<TransformerVq<Bk>, TrainError> {
    let fail = |reason: String| bad(path, reason);
    let bytes = tensor_file::widened_to_f32(bytes).map_err(fail)?;
    let result = model
        .load_from(&mut SafetensorsStore::from_bytes(Some(bytes)))
        .map_err(|e| fail(e.to_string()))?;
    if !result.missing.is_empty() || !result.errors.is_empty() {
        return Err(fail(format!(
            "missing tensors {:?}, errors {:?}",
            result.missing, result.errors
        )));
    }
    // Tensors the model has no place for: the file is of another model.
    if !result.unused.is_empty() {
        return Err(fail(format!(
            "holds tensors its model has no place for: {:?}",
            result.unused
        )));
    }
    Ok(model)
}

/// Deletes all but the `keep` newest checkpoints up to `step` (the run's
/// current one) and the one at `best_step`. Checkpoints after `step` are
/// left alone and not counted: the run resumed before them because they
/// failed verification, and replaces each as it reaches its step. Each
/// deleted one is first renamed out of sight (atomically), so that a reader
/// never sees one half deleted; a failure only warns (the run itself is
/// saved), and what is left is removed at the next start
/// ([`remove_leftovers`]).
pub fn prune(run_dir: &Path, keep: usize, best_step: Option<u64>, step: u64) {
    let done = list(run_dir).into_iter().filter(|(s, _)| *s <= step);
    for (s, dir) in done.skip(keep) {
        if Some(s) == best_step {
            continue;
        }
        let deleted = set_aside(&dir, PRUNED).and_then(|aside| {
            fault::inject(Point::CheckpointPrune)?;
            std::fs::remove_dir_all(aside)
        });
        if let Err(e) = deleted {
            tracing::warn!("could not delete old checkpoint {}: {e}", dir.display());
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::placement::device::DeviceSpec;
    use burn::module::Module;
    use burn::optim::Optimizer;
    use burn::prelude::*;
    use tvq_model::{Pass, TransformerVqConfig};

    fn values<const D: usize>(t: &Tensor<B, D>) -> Vec<f32> {
        t.to_data().convert::<f32>().to_vec().unwrap()
    }

    fn codes(t: &Tensor<B, 3, Int>) -> Vec<i64> {
        t.to_data().convert::<i64>().to_vec().unwrap()
    }

    /// The tiny model of the checkpoint and export tests, with blocks of 2
    /// so that six tokens leave a compressed cache behind.
    pub(crate) fn tiny_config() -> TransformerVqConfig {
        tvq_testkit::tiny_model(7).with_block_len(2)
    }

    /// A state with a previous block, a compressed cache and a partial
    /// current block (two blocks through the block form, then one token).
    fn carried_state(device: &burn::DispatchDevice) -> ModelState<B> {
        let model = built(&tiny_config(), device).unwrap();
        let tokens =
            Tensor::<B, 2, Int>::from_data([[1, 2, 3, 4, 5, 6], [6, 5, 4, 3, 2, 1]], device);
        let out = model
            .forward(tokens, model.empty_state(), Pass::new())
            .unwrap();
        let token = Tensor::<B, 2, Int>::from_data([[1], [2]], device);
        model.decode(token, out.state).unwrap().1
    }

    #[test]
    fn carried_states_survive_serialisation() {
        let device = DeviceSpec::Cpu.init().unwrap().0;
        let states = vec![carried_state(&device), ModelState::new(2)];
        let path = Path::new("state.safetensors");
        let bytes = states_to_bytes(path, &states).unwrap();
        let back = states_from_bytes(path, &bytes, &device).unwrap();
        assert_eq!(back.len(), 2);
        for (a, b) in states.iter().zip(&back) {
            assert_eq!(a.sublayers.len(), b.sublayers.len());
            for (a, b) in a.sublayers.iter().zip(&b.sublayers) {
                assert_eq!(a.pos, b.pos);
                for (x, y) in [(&a.prev, &b.prev), (&a.current, &b.current)] {
                    assert_eq!(x.is_some(), y.is_some());
                    if let (Some(x), Some(y)) = (x, y) {
                        assert_eq!(values(&x.k_window), values(&y.k_window));
                        assert_eq!(values(&x.v), values(&y.v));
                        assert_eq!(codes(&x.codes), codes(&y.codes));
                    }
                }
                assert_eq!(a.cache.is_some(), b.cache.is_some());
                if let (Some(x), Some(y)) = (&a.cache, &b.cache) {
                    assert_eq!(values(&x.counts), values(&y.counts));
                    assert_eq!(values(&x.means), values(&y.means));
                }
            }
        }
        let s = &back[0].sublayers[0];
        assert_eq!(s.pos, 7);
        assert!(s.prev.is_some() && s.cache.is_some() && s.current.is_some());
        assert_eq!(back[1].sublayers[0].pos, 0);
    }

    /// Counts in the state's metadata that no entries back are refused
    /// before they size anything: a billion-billion shards of no
    /// sublayers (zero entries needed) once made a resume abort on its
    /// allocation.
    #[test]
    fn carried_state_counts_are_bounded_by_their_entries() {
        let device = DeviceSpec::Cpu.init().unwrap().0;
        let path = Path::new("state.safetensors");
        let state = |shards: &str, sublayers: &str| {
            let meta = [("micro_batches", shards), ("sublayers", sublayers)]
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .into();
            let bytes = tensor_file::to_bytes(&meta, vec![]).unwrap();
            states_from_bytes::<B>(path, &bytes, &device).map(|s| s.len())
        };
        assert_eq!(state("0", "0").unwrap(), 0, "no carried state");
        for (shards, sublayers, why) in [
            ("1000000000000", "0", "shards of no sublayers"),
            ("1", "0", "shards of no sublayers"),
            ("1000000000000", "1", "metadata entries"),
            ("1", "1000000000000", "metadata entries"),
            ("4294967296", "4294967296", "metadata entries"),
            ("-1", "1", "no `micro_batches`"),
        ] {
            let err = state(shards, sublayers).unwrap_err().to_string();
            assert!(err.contains(why), "{shards} x {sublayers}: {err}");
        }
    }

    #[test]
    fn a_changed_byte_fails_verification_and_old_checkpoints_are_pruned() {
        let run = tempfile::tempdir().unwrap();
        let device = DeviceSpec::Cpu.init().unwrap().0;
        let model = TransformerVqConfig::new(5)
            .with_d_model(4)
            .with_d_k(2)
            .with_d_v(2)
            .with_n_code(2)
            .with_n_layer(1)
            .with_block_len(2);
        let model = built(&model, &burn::DispatchDevice::autodiff(device)).unwrap();
        let optim = Optimizers::new(&crate::config::TrainSection::default());
        for step in 1..=4 {
            let progress = TrainerState {
                step,
                ..TrainerState::default()
            };
            save(run.path(), &model, &optim, &[], &progress).unwrap();
        }
        let dir = checkpoint_dir(run.path(), 4);
        verify(&dir).unwrap();
        let trainer = dir.join("trainer.json");
        let mut bytes = std::fs::read(&trainer).unwrap();
        bytes[0] ^= 1;
        std::fs::write(&trainer, bytes).unwrap();
        assert!(verify(&dir).unwrap_err().to_string().contains("checksum"));
        assert_eq!(
            latest_valid(run.path()),
            Some(checkpoint_dir(run.path(), 3))
        );

        prune(run.path(), 2, Some(1), 4);
        let kept = || -> Vec<u64> { list(run.path()).into_iter().map(|(s, _)| s).collect() };
        assert_eq!(kept(), [4, 3, 1], "the two newest and the best");
        // Resumed at step 1 (newer ones failed verification): those after
        // it are neither deleted nor counted.
        prune(run.path(), 1, None, 1);
        assert_eq!(kept(), [4, 3, 1]);
        prune(run.path(), 1, None, 3);
        assert_eq!(kept(), [4, 3]);
    }

    #[test]
    fn leftovers_of_a_killed_writer_are_removed_and_a_replaced_checkpoint_put_back() {
        let run = tempfile::tempdir().unwrap();
        let dir = run.path().join("checkpoints");
        for name in [
            ".tmp-step-00000003-77",
            ".pruned-step-00000001-77",
            ".replaced-step-00000002-77",
            ".replaced-step-00000004-77",
            "step-00000004",
        ] {
            std::fs::create_dir_all(dir.join(name)).unwrap();
            std::fs::write(dir.join(name).join("manifest.json"), name).unwrap();
        }
        std::fs::write(run.path().join(".metrics.jsonl.tmp"), "").unwrap();
        assert_eq!(remove_leftovers(run.path()), 4);
        let mut names: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(names, ["step-00000002", "step-00000004"]);
        // Step 2 is the one set aside (its replacement never arrived); step
        // 4's replacement did arrive, so the old one went.
        let manifest =
            |s: &str| std::fs::read_to_string(dir.join(s).join("manifest.json")).unwrap();
        assert_eq!(manifest("step-00000002"), ".replaced-step-00000002-77");
        assert_eq!(manifest("step-00000004"), "step-00000004");
        assert!(!run.path().join(".metrics.jsonl.tmp").exists());
    }

    /// A rotary model saved before the position channel existed (a
    /// format-1 checkpoint) has a query projection `H K` wide; built from a
    /// config that asks for a channel, it loads as the model it was and
    /// computes what it did.
    #[test]
    fn a_rotary_checkpoint_from_before_the_position_channel_computes_as_it_did() {
        let run = tempfile::tempdir().unwrap();
        let device = burn::DispatchDevice::autodiff(DeviceSpec::Cpu.init().unwrap().0);
        let cfg = tiny_config().with_bias(tvq_model::RelativeBias::Rotary);
        let old = built(&cfg.clone().with_rotary_channel(Some(0)), &device).unwrap();
        let optim = Optimizers::new(&crate::config::TrainSection::default());
        let dir = checkpoint_dir(run.path(), 0);
        format1::write(&dir, &old, &optim, &[], &TrainerState::default());
        let loaded = model_of_checkpoint(&dir, &cfg.with_rotary_channel(Some(4)), &device).unwrap();
        let tokens = Tensor::<B, 2, Int>::from_data([[1, 2, 3, 4, 5, 6]], &device);
        let logits = |m: &Model| {
            values(
                &m.forward(tokens.clone(), m.empty_state(), Pass::new())
                    .unwrap()
                    .logits
                    .unwrap(),
            )
        };
        assert_eq!(logits(&loaded), logits(&old));
    }

    /// A format-1 record holds each sublayer's position term as it was
    /// laid out then; one read under a config naming another term (a
    /// run directory's config edited by hand) is a one-line error, not a
    /// model with a term of the other kind.
    #[test]
    fn a_format1_record_under_a_config_of_another_position_term_is_refused() {
        let run = tempfile::tempdir().unwrap();
        let device = burn::DispatchDevice::autodiff(DeviceSpec::Cpu.init().unwrap().0);
        let cfg = tiny_config().with_bias(tvq_model::RelativeBias::Xl);
        let model = built(&cfg, &device).unwrap();
        let optim = Optimizers::new(&crate::config::TrainSection::default());
        let dir = checkpoint_dir(run.path(), 0);
        format1::write(&dir, &model, &optim, &[], &TrainerState::default());
        let loaded = model_of_checkpoint(&dir, &cfg, &device).unwrap();
        let tokens = Tensor::<B, 2, Int>::from_data([[1, 2, 3, 4, 5, 6]], &device);
        let logits = |m: &Model| {
            let out = m.forward(tokens.clone(), m.empty_state(), Pass::new());
            values(&out.unwrap().logits.unwrap())
        };
        assert_eq!(logits(&loaded), logits(&model));
        let err = model_of_checkpoint(&dir, &tiny_config(), &device)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("holds a Xl position term in sublayer 0, its config Toeplitz"),
            "{err}"
        );
    }

    /// A format-1 model record whose first long length (a tensor's bytes)
    /// is forged to a trillion trillion, its manifest forged to match, is a
    /// one-line error: the length is held to the file's size before
    /// anything is allocated for it (burn's own decoder would try).
    #[test]
    fn a_format1_record_that_claims_more_than_its_file_is_refused() {
        let run = tempfile::tempdir().unwrap();
        let device = burn::DispatchDevice::autodiff(DeviceSpec::Cpu.init().unwrap().0);
        let cfg = tiny_config();
        let model = built(&cfg, &device).unwrap();
        let optim = Optimizers::new(&crate::config::TrainSection::default());
        let dir = checkpoint_dir(run.path(), 0);
        format1::write(&dir, &model, &optim, &[], &TrainerState::default());
        assert!(model_of_checkpoint(&dir, &cfg, &device).is_ok());

        // A tensor's data is its bytes after their length, a bincode
        // varint: 251 then two bytes for a length of 251..2^16; 253 then
        // eight bytes for one of up to 2^64.
        let path = dir.join("model.bin");
        let mut bytes = std::fs::read(&path).unwrap();
        let largest = model_tensors(&model)
            .into_iter()
            .map(|t| (t.values)())
            .max_by_key(Vec::len)
            .unwrap();
        let data: Vec<u8> = largest.iter().flat_map(|v| v.to_le_bytes()).collect();
        assert!((251..1 << 16).contains(&data.len()));
        let at = (3..bytes.len() - data.len())
            .find(|&p| bytes[p..p + data.len()] == data[..])
            .expect("the tensor's data")
            - 3;
        let mut length = vec![251];
        length.extend((data.len() as u16).to_le_bytes());
        assert_eq!(bytes[at..at + 3], length[..], "its length before it");
        let mut forged = vec![253];
        forged.extend((1u64 << 62).to_le_bytes());
        bytes.splice(at..at + 3, forged);
        std::fs::write(&path, &bytes).unwrap();
        format1::forge_manifest(&dir);
        let Err(err) = model_of_checkpoint(&dir, &cfg, &device) else {
            panic!("a record with a forged length loaded");
        };
        let text = err.to_string();
        assert!(!text.contains('\n'), "{text}");
        assert!(text.contains("beyond its own size"), "{text}");
    }

    /// Every parameter of a model, by path.
    fn weights(model: &Model) -> Vec<(String, Vec<f32>)> {
        let mut out: Vec<_> = model_tensors(model)
            .into_iter()
            .map(|t| (t.name, (t.values)()))
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    /// `steps` AdamW steps of the XL-bias tiny model on a fixed batch.
    fn train(mut model: Model, mut optim: Optimizers, steps: usize) -> (Model, Optimizers) {
        let device = model.devices()[0].clone();
        let tokens =
            Tensor::<B, 2, Int>::from_data([[1, 2, 3, 4, 5, 6], [6, 5, 4, 3, 2, 1]], &device);
        for _ in 0..steps {
            let out = model
                .forward(tokens.clone(), model.empty_state(), Pass::new())
                .unwrap();
            let loss = out.logits.unwrap().square().mean();
            let grads = burn::optim::GradientsParams::from_grads(loss.backward(), &model);
            model = optim.step(1e-2, model, grads, 1.0);
        }
        (model, optim)
    }

    /// Training settings with weight decay and the optimizer `name`.
    fn settings(name: crate::config::OptimizerName) -> crate::config::TrainSection {
        let mut settings = crate::config::TrainSection::default();
        settings.optimizer.name = name;
        settings.optimizer.adamw.weight_decay = 0.1;
        settings
    }

    /// A trained model and its optimizer, saved in `format` and loaded into
    /// a fresh model and optimizer of the same config, continue exactly as
    /// the originals: the same weights after three more steps, under AdamW
    /// and under Muon. Format 2 ties each moment to its parameter by name,
    /// format 1 (AdamW only) by the ids in its model record.
    #[test]
    fn a_loaded_checkpoint_continues_exactly_in_either_format() {
        use crate::config::OptimizerName;
        let device = burn::DispatchDevice::autodiff(DeviceSpec::Cpu.init().unwrap().0);
        let cfg = tiny_config().with_bias(tvq_model::RelativeBias::Toeplitz);
        let fresh = || built(&cfg, &device).unwrap();
        for (name, formats) in [
            (OptimizerName::Adamw, &[1, 2][..]),
            (OptimizerName::Muon, &[2]),
        ] {
            let settings = settings(name);
            let (model, optim) = train(fresh(), Optimizers::new(&settings), 2);
            let muon_moments = optim.muon.as_ref().map(|m| m.to_record().len());
            assert_eq!(
                muon_moments,
                (name == OptimizerName::Muon).then_some(3 * fresh().sublayers.len()),
                "Muon steps the three projections of each sublayer"
            );
            assert!(
                !optim.decay.to_record().is_empty() && !optim.toeplitz.to_record().is_empty(),
                "every group has moments"
            );
            let progress = TrainerState {
                step: 2,
                ..Default::default()
            };
            let runs = [tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap()];
            let dirs = runs.each_ref().map(|r| checkpoint_dir(r.path(), 2));
            format1::write(&dirs[0], &model, &optim, &[], &progress);
            save(runs[1].path(), &model, &optim, &[], &progress).unwrap();
            let (want, _) = train(model.clone(), optim, 3);
            for &format in formats {
                let dir = &dirs[format as usize - 1];
                assert_eq!(verify(dir).unwrap(), format);
                let loaded =
                    resume(dir, fresh(), Optimizers::new(&settings), &device, &device).unwrap();
                assert_eq!(loaded.trainer, progress);
                assert!(weights(&loaded.model) == weights(&model), "format {format}");
                let (got, _) = train(loaded.model, loaded.optim, 3);
                assert!(weights(&got) == weights(&want), "{name:?}, format {format}");
            }
        }
    }

    /// A run resumed under the other optimizer keeps the moments of the
    /// groups that did not change and starts the moved matrices afresh:
    /// the same weights as a fresh optimizer given those moments.
    #[test]
    fn a_run_resumed_under_the_other_optimizer_starts_the_moved_matrices_afresh() {
        use crate::config::OptimizerName::{Adamw, Muon};
        let device = burn::DispatchDevice::autodiff(DeviceSpec::Cpu.init().unwrap().0);
        let cfg = tiny_config().with_bias(tvq_model::RelativeBias::Toeplitz);
        let (model, optim) = train(
            built(&cfg, &device).unwrap(),
            Optimizers::new(&settings(Adamw)),
            2,
        );
        let run = tempfile::tempdir().unwrap();
        let progress = TrainerState {
            step: 2,
            ..Default::default()
        };
        save(run.path(), &model, &optim, &[], &progress).unwrap();
        let dir = checkpoint_dir(run.path(), 2);
        let fresh = built(&cfg, &device).unwrap();
        let loaded = resume(
            &dir,
            fresh,
            Optimizers::new(&settings(Muon)),
            &device,
            &device,
        );
        let loaded = loaded.unwrap();
        let hidden = 3 * model.sublayers.len();
        assert_eq!(loaded.optim.muon.as_ref().unwrap().to_record().len(), 0);
        let matrices = optim.decay.to_record().len();
        assert_eq!(loaded.optim.decay.to_record().len(), matrices - hidden);
        // Saved again under Muon, the file holds no AdamW moments of them.
        let (model, optim) = train(loaded.model, loaded.optim, 1);
        let (meta, tensors) = named::optimizer_tensors(&model, &optim);
        assert_eq!(meta["optimizer"], "muon");
        let muon = tensors
            .iter()
            .filter(|t| t.name.starts_with("muon/"))
            .count();
        assert_eq!(muon, hidden);
        assert!(
            !tensors.iter().any(|t| t.name.starts_with("decay/")
                && t.name.contains("_proj.weight")
                && !t.name.contains("r_proj")),
            "stale AdamW moments of Muon's matrices"
        );
    }

    /// The same model, optimizer and states saved twice (into two runs)
    /// give the same bytes in every file; the model file holds every
    /// parameter under its path, f32, with the model's shapes.
    #[test]
    fn the_same_checkpoint_is_the_same_bytes() {
        let device = burn::DispatchDevice::autodiff(DeviceSpec::Cpu.init().unwrap().0);
        let cfg = tiny_config().with_bias(tvq_model::RelativeBias::Toeplitz);
        let settings = crate::config::TrainSection::default();
        let (model, optim) = train(built(&cfg, &device).unwrap(), Optimizers::new(&settings), 2);
        let states = [carried_state(&device), ModelState::new(2)];
        let progress = TrainerState {
            step: 2,
            ..Default::default()
        };
        let runs = [tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap()];
        let files = |run: &Path| -> Vec<(String, Vec<u8>)> {
            let dir = checkpoint_dir(run, 2);
            let mut out: Vec<_> = std::fs::read_dir(&dir)
                .unwrap()
                .map(|e| {
                    let path = e.unwrap().path();
                    let name = path.file_name().unwrap().to_string_lossy().into_owned();
                    (name, std::fs::read(&path).unwrap())
                })
                .collect();
            out.sort();
            out
        };
        for run in &runs {
            save(run.path(), &model, &optim, &states, &progress).unwrap();
        }
        let (a, b) = (files(runs[0].path()), files(runs[1].path()));
        let names: Vec<&str> = a.iter().map(|f| f.0.as_str()).collect();
        assert_eq!(names, ["manifest.json", MODEL, OPTIMIZER, STATE, TRAINER]);
        assert!(a == b, "two saves of one checkpoint differ");

        let bytes = &a[1].1;
        let file = safetensors::SafeTensors::deserialize(bytes).unwrap();
        let mut stored: Vec<(String, Vec<usize>)> = file
            .tensors()
            .into_iter()
            .map(|(n, v)| {
                assert_eq!(v.dtype(), safetensors::Dtype::F32, "{n}");
                (n, v.shape().to_vec())
            })
            .collect();
        stored.sort();
        let mut want = named::param_paths(&model);
        want.sort();
        assert_eq!(stored, want);
        assert!(
            want.iter().any(|(n, _)| n == "embedding.weight"),
            "{want:?}"
        );
    }
}
