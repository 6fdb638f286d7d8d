//! Checkpoints that resume exactly.
//!
//! A checkpoint is a directory `checkpoints/step-NNNNNNNN/` holding the model
//! (codebooks included), both optimizers' state, the model state carried
//! between segments (`state.safetensors`), and `trainer.json` (step, data
//! cursor, best validation loss). The learning rate is a function of the
//! step and dropout is reseeded from (seed, step), so nothing else is needed
//! to continue bit-identically. `manifest.json` lists every file with its
//! size and FNV-1a hash; a checkpoint whose files do not match is skipped.
//! The directory is written under a temporary name, synced, then renamed;
//! readers list only `step-N` names, so they never see a temporary one.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use burn::module::Module;
use burn::optim::Optimizer;
use burn::prelude::*;
use burn::record::{BinFileRecorder, FullPrecisionSettings, Recorder};
use burn::tensor::backend::DeviceOps;
use serde::{Deserialize, Serialize};
use tvq_data::TrainCursor;
use tvq_data::hash::fnv1a;
use tvq_model::ModelState;
use tvq_model::attention::{AttentionState, CachedBlock, CompressedCache};

use crate::error::TrainError;
use crate::export::f32_values;
use crate::fault::{self, Point};
use crate::optim::{B, LossScale, Model, Optimizers};

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

type Rec = BinFileRecorder<FullPrecisionSettings>;

fn io(path: &Path) -> impl Fn(std::io::Error) -> TrainError + '_ {
    move |e| TrainError::io(path, e)
}

fn bad(path: &Path, reason: impl Into<String>) -> TrainError {
    TrainError::Checkpoint {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

/// Tensors of the carried states (one per shard of the batch) as
/// safetensors. The stored names say `micro`, from before worker threads
/// made shards of micro-batches; they are kept so older checkpoints load.
pub(crate) fn states_to_bytes(
    path: &Path,
    states: &[ModelState<B>],
) -> Result<Vec<u8>, TrainError> {
    let mut tensors: BTreeMap<String, (Vec<usize>, Vec<f32>)> = BTreeMap::new();
    let mut meta = std::collections::HashMap::new();
    let mut put = |name: String, dims: Vec<usize>, data: TensorData| {
        tensors.insert(
            name,
            (dims, data.convert::<f32>().to_vec::<f32>().expect("f32")),
        );
    };
    for (m, state) in states.iter().enumerate() {
        for (i, s) in state.sublayers.iter().enumerate() {
            let p = format!("micro{m}/sublayer{i}");
            meta.insert(format!("{p}/pos"), s.pos.to_string());
            for (slot, block) in [("prev", &s.prev), ("current", &s.current)] {
                if let Some(b) = block {
                    put(
                        format!("{p}/{slot}/k_hat"),
                        b.k_hat.dims().to_vec(),
                        b.k_hat.to_data(),
                    );
                    put(format!("{p}/{slot}/v"), b.v.dims().to_vec(), b.v.to_data());
                    put(
                        format!("{p}/{slot}/codes"),
                        b.codes.dims().to_vec(),
                        b.codes.to_data(),
                    );
                }
            }
            if let Some(c) = &s.cache {
                put(
                    format!("{p}/cache/counts"),
                    c.counts.dims().to_vec(),
                    c.counts.to_data(),
                );
                put(
                    format!("{p}/cache/means"),
                    c.means.dims().to_vec(),
                    c.means.to_data(),
                );
            }
        }
    }
    meta.insert("micro_batches".into(), states.len().to_string());
    meta.insert(
        "sublayers".into(),
        states.first().map_or(0, |s| s.sublayers.len()).to_string(),
    );
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .into_iter()
        .map(|(n, (dims, data))| (n, dims, data.iter().flat_map(|x| x.to_le_bytes()).collect()))
        .collect();
    let views = bytes
        .iter()
        .map(|(n, dims, data)| {
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, dims.clone(), data)
                .map(|v| (n.clone(), v))
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad(path, format!("state serialization: {e}")))?;
    safetensors::serialize(views, Some(meta))
        .map_err(|e| bad(path, format!("state serialization: {e}")))
}

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
pub fn save(
    run_dir: &Path,
    model: &Model,
    optim: &Optimizers,
    states: &[ModelState<B>],
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

/// Prefixes of the temporary entries of `checkpoints/`: a checkpoint being
/// written, one being replaced, one being deleted.
const TMP: &str = ".tmp-";
const REPLACED: &str = ".replaced-";
const PRUNED: &str = ".pruned-";

/// Writes every file of a checkpoint, and its manifest, into `tmp`.
fn write_files(
    tmp: &Path,
    model: &Model,
    optim: &Optimizers,
    states: &[ModelState<B>],
    trainer: &TrainerState,
) -> Result<(), TrainError> {
    let _ = std::fs::remove_dir_all(tmp);
    std::fs::create_dir_all(tmp).map_err(io(tmp))?;
    let rec = Rec::new();
    let record_err = |e: burn::record::RecorderError| bad(tmp, e.to_string());
    model
        .clone()
        .save_file(tmp.join("model"), &rec)
        .map_err(record_err)?;
    fault::inject(Point::CheckpointData).map_err(io(tmp))?;
    rec.record(optim.decay.to_record(), tmp.join("optim-decay"))
        .map_err(record_err)?;
    rec.record(optim.no_decay.to_record(), tmp.join("optim-no-decay"))
        .map_err(record_err)?;
    rec.record(optim.toeplitz.to_record(), tmp.join("optim-toeplitz"))
        .map_err(record_err)?;
    std::fs::write(tmp.join("state.safetensors"), states_to_bytes(tmp, states)?)
        .map_err(io(tmp))?;
    let json = serde_json::to_vec_pretty(trainer).expect("serializable");
    std::fs::write(tmp.join("trainer.json"), json).map_err(io(tmp))?;

    let mut manifest = BTreeMap::new();
    for entry in std::fs::read_dir(tmp).map_err(io(tmp))? {
        let path = entry.map_err(io(tmp))?.path();
        let bytes = std::fs::read(&path).map_err(io(&path))?;
        std::fs::File::open(&path)
            .and_then(|f| f.sync_all())
            .map_err(io(&path))?;
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        manifest.insert(
            name,
            serde_json::json!({"bytes": bytes.len(), "fnv1a": format!("{:016x}", fnv1a(&bytes))}),
        );
    }
    let manifest_path = tmp.join("manifest.json");
    fault::inject(Point::CheckpointManifest).map_err(io(&manifest_path))?;
    std::fs::write(
        &manifest_path,
        serde_json::to_vec_pretty(&manifest).expect("serializable"),
    )
    .map_err(io(&manifest_path))?;
    std::fs::File::open(&manifest_path)
        .and_then(|f| f.sync_all())
        .map_err(io(&manifest_path))?;
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
/// ([`crate::lock::RunLock`]); returns how many entries were cleared.
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

/// Checks every file of a checkpoint against its manifest.
pub fn verify(dir: &Path) -> Result<(), TrainError> {
    let manifest_path = dir.join("manifest.json");
    let text = std::fs::read(&manifest_path)
        .map_err(|_| bad(dir, "no manifest.json (incomplete checkpoint)"))?;
    let manifest: BTreeMap<String, serde_json::Value> =
        serde_json::from_slice(&text).map_err(|e| bad(dir, format!("manifest.json: {e}")))?;
    for required in [
        "model.bin",
        "optim-decay.bin",
        "optim-no-decay.bin",
        "state.safetensors",
        "trainer.json",
    ] {
        if !manifest.contains_key(required) {
            return Err(bad(dir, format!("manifest lacks {required}")));
        }
    }
    for (name, entry) in &manifest {
        let bytes =
            std::fs::read(dir.join(name)).map_err(|_| bad(dir, format!("{name} is missing")))?;
        let want = entry["fnv1a"].as_str().unwrap_or_default();
        if entry["bytes"].as_u64() != Some(bytes.len() as u64)
            || format!("{:016x}", fnv1a(&bytes)) != want
        {
            return Err(bad(dir, format!("{name} does not match its checksum")));
        }
    }
    Ok(())
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
                Ok(()) => return Some(dir),
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

/// A loaded checkpoint.
pub struct Loaded {
    /// The model (on the autodiff device given to [`load`]).
    pub model: Model,
    /// Optimizer state.
    pub optim: Optimizers,
    /// Carried states, one per shard of the batch.
    pub states: Vec<ModelState<B>>,
    /// Progress.
    pub trainer: TrainerState,
}

/// Loads a verified checkpoint into `model` / `optim` built from the run's
/// config, the model on `device` and the carried states on `state_device`
/// (the autodiff device the shards run on, whose checkpointing strategy the
/// states must share).
pub fn load(
    dir: &Path,
    model: Model,
    mut optim: Optimizers,
    device: &burn::DispatchDevice,
    state_device: &burn::DispatchDevice,
) -> Result<Loaded, TrainError> {
    verify(dir)?;
    let rec = Rec::new();
    let record_err = |e: burn::record::RecorderError| bad(dir, e.to_string());
    let model = model
        .load_file(dir.join("model"), &rec, device)
        .map_err(record_err)?;
    // Optimizer records live on the plain (non-autodiff) device.
    let inner = device.inner();
    optim.decay = optim.decay.load_record(
        rec.load(dir.join("optim-decay"), inner)
            .map_err(record_err)?,
    );
    optim.no_decay = optim.no_decay.load_record(
        rec.load(dir.join("optim-no-decay"), inner)
            .map_err(record_err)?,
    );
    // Checkpoints written before the Toeplitz tables had their own group
    // have no such file: their tables start with fresh moments.
    if dir.join("optim-toeplitz.bin").is_file() {
        optim.toeplitz = optim.toeplitz.load_record(
            rec.load(dir.join("optim-toeplitz"), inner)
                .map_err(record_err)?,
        );
    }
    let state_path = dir.join("state.safetensors");
    let bytes = std::fs::read(&state_path).map_err(io(&state_path))?;
    let states = states_from_bytes(dir, &bytes, state_device)?;
    let trainer_path = dir.join("trainer.json");
    let trainer = serde_json::from_slice(&std::fs::read(&trainer_path).map_err(io(&trainer_path))?)
        .map_err(|e| bad(dir, format!("trainer.json: {e}")))?;
    Ok(Loaded {
        model,
        optim,
        states,
        trainer,
    })
}

/// Loads only the model weights of a checkpoint (for evaluation and sampling).
pub fn load_model(
    dir: &Path,
    model: Model,
    device: &burn::DispatchDevice,
) -> Result<Model, TrainError> {
    verify(dir)?;
    model
        .load_file(dir.join("model"), &Rec::new(), device)
        .map_err(|e| bad(dir, e.to_string()))
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
    use tvq_model::TransformerVqConfig;
    use tvq_model::device::DeviceSpec;

    fn values<const D: usize>(t: &Tensor<B, D>) -> Vec<f32> {
        t.to_data().convert::<f32>().to_vec().unwrap()
    }

    fn codes(t: &Tensor<B, 3, Int>) -> Vec<i64> {
        t.to_data().convert::<i64>().to_vec().unwrap()
    }

    /// The tiny model of the checkpoint and export tests (vocabulary 7,
    /// blocks of 2).
    pub(crate) fn tiny_config() -> TransformerVqConfig {
        TransformerVqConfig::new(7)
            .with_d_model(8)
            .with_d_k(4)
            .with_d_v(6)
            .with_n_code(3)
            .with_n_layer(1)
            .with_block_len(2)
    }

    /// A state with a previous block, a compressed cache and a partial
    /// current block (two blocks through the block form, then one token).
    fn carried_state(device: &burn::DispatchDevice) -> ModelState<B> {
        let model = tiny_config().init::<B>(device).unwrap();
        let tokens =
            Tensor::<B, 2, Int>::from_data([[1, 2, 3, 4, 5, 6], [6, 5, 4, 3, 2, 1]], device);
        let out = model.forward(tokens, model.empty_state(), None).unwrap();
        let token = Tensor::<B, 2, Int>::from_data([[1], [2]], device);
        model.step(token, out.state).unwrap().1
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
                        assert_eq!(values(&x.k_hat), values(&y.k_hat));
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
            .with_block_len(2)
            .init::<B>(&burn::DispatchDevice::autodiff(device))
            .unwrap();
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

    /// A rotary model saved before the position channel existed has a
    /// query projection `H K` wide; built from a config that asks for a
    /// channel, it loads as the model it was and computes what it did.
    #[test]
    fn a_rotary_checkpoint_from_before_the_position_channel_computes_as_it_did() {
        let run = tempfile::tempdir().unwrap();
        let device = burn::DispatchDevice::autodiff(DeviceSpec::Cpu.init().unwrap().0);
        let cfg = tiny_config().with_bias(tvq_model::RelativeBias::Rotary);
        let old = cfg
            .clone()
            .with_rotary_channel(Some(0))
            .init::<B>(&device)
            .unwrap();
        let optim = Optimizers::new(&crate::config::TrainSection::default());
        save(run.path(), &old, &optim, &[], &TrainerState::default()).unwrap();
        let fresh = cfg.with_rotary_channel(Some(4)).init::<B>(&device).unwrap();
        let loaded = load_model(&checkpoint_dir(run.path(), 0), fresh, &device).unwrap();
        let tokens = Tensor::<B, 2, Int>::from_data([[1, 2, 3, 4, 5, 6]], &device);
        let logits = |m: &Model| {
            values(
                &m.forward(tokens.clone(), m.empty_state(), None)
                    .unwrap()
                    .logits,
            )
        };
        assert_eq!(logits(&loaded), logits(&old));
    }
}
