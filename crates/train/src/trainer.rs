//! The [`Trainer`]: a model, its optimizers and carried states, and the one
//! place an optimizer step happens.
//!
//! One step: every row of the batch advances one segment. The rows are cut
//! into shards (`workers x micro_batches`), each run from its carried state
//! with its gradients summed ([`crate::step::gradients`]); then the gradients are
//! clipped by their global norm, AdamW steps, and the codebooks move one EMA
//! step with the statistics of every shard. The state each shard leaves
//! behind is detached and carried into the next step, unless the batch
//! starts new sequences.
//!
//! In a run over several nodes ([`Trainer::join`]) each node holds the
//! same model and optimizer and runs its own shards of the batch; one
//! collective sum per step makes the gradients and statistics the whole
//! batch's on every node, so every node takes the same step.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::placement::device::{check_precision, device_memory_bytes, precision_on};
use burn::optim::GradientsParams;
use burn::tensor::StreamId;
use burn::{CheckpointingStrategy, DispatchDevice};
use tvq_data::{Batch, TrainCursor};
use tvq_model::{
    CodebookMetrics, CodebookStats, ModelState, Precision, TransformerVq, TransformerVqConfig,
};

use crate::checkpoint::{self, TrainerState};
use crate::config::{ActivationCheckpointing, TrainSection};
use crate::error::TrainError;
use crate::node;
use crate::parallel::collective::Collective;
use crate::parallel::workers::{CREWS, check_device_list};
use crate::placement::{B, Model, TrainBackend};
use crate::placement::{CpuFused, autodiff_device, fork_onto, seeded_draw};
use crate::step::gradients::{StepGradients, compute_gradients};
use crate::step::optim::{LossScale, Optimizers, clip_global_norm, learning_rate};
use crate::step::shard::{Shard, ShardPlan};

/// The seed of step `step`'s dropout draws: they depend on (seed, step)
/// only, so a resumed run draws what an uninterrupted one would.
fn step_seed(seed: u64, step: u64) -> u64 {
    seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ step.wrapping_mul(0xBF58_476D_1CE4_E5B9)
}

/// What one optimizer step did, as the trainer sees it. The run's metrics
/// ([`crate::run::metrics::StepMetrics`]) add what follows from the run:
/// bits per byte, throughput, MFU, memory.
#[derive(Clone, Debug)]
pub struct StepOutcome {
    /// Optimizer step (1-based).
    pub step: u64,
    /// Learning rate used.
    pub lr: f64,
    /// Cross-entropy + commit_weight * commitment (what was minimised).
    pub loss: f64,
    /// Cross-entropy, nats per token.
    pub ce: f64,
    /// Commitment loss (summed over sublayers).
    pub commitment: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Each sublayer's codebook metrics of this step.
    pub codebooks: Vec<CodebookMetrics>,
    /// Tokens this step trained on, over every node.
    pub tokens: u64,
    /// Wall time of the step.
    pub elapsed: Duration,
    /// The loss scale the objective was multiplied by (`f16` only).
    pub loss_scale: Option<f64>,
    /// The gradients overflowed under loss scaling: weights and codebooks
    /// were left as they were.
    pub skipped: bool,
    /// An interrupt was seen (on any node) before or during the step.
    pub interrupted: bool,
    /// GPU memory held after the step, over this node's devices
    /// ([`Trainer::device_memory_bytes`]; `None` on the CPU).
    pub device_memory_bytes: Option<u64>,
}

/// Everything a run holds in memory between steps, on the backend `Bk`
/// ([`TrainBackend`]: [`B`] by default, every device; `CpuFused`,
/// `WgpuFused` and `CudaFused` for the devices' fused kernels).
///
/// Step it from one thread: on a GPU its carried states live in the
/// streams of the worker crew lent to that thread (`parallel::workers`).
pub struct Trainer<Bk: TrainBackend = B> {
    /// The model's config, for copies of it on [`B`] ([`Self::inference_model`]).
    config: TransformerVqConfig,
    settings: TrainSection,
    /// The type of the sublayers' products: `train.precision` on the
    /// model's device.
    precision: Precision,
    /// The autodiff device of the model, the optimizer and the sums.
    device: Bk::Device,
    /// The run's devices (plain), the model's first.
    devices: Vec<DispatchDevice>,
    /// The autodiff device of each worker thread (`train.workers` of them),
    /// with burn's balanced checkpointing under `selective`.
    worker_devices: Vec<Bk::Device>,
    n_sublayers: usize,
    /// Always `Some` between calls; taken while the optimizer consumes it.
    model: Option<TransformerVq<Bk>>,
    optim: Optimizers<Bk>,
    /// One carried state per shard of this node, in shard order.
    states: Vec<ModelState<Bk>>,
    state: TrainerState,
    last_checkpoint: Option<PathBuf>,
    /// This node's rank and the number of nodes (0 and 1 alone).
    rank: usize,
    nodes: usize,
    /// The other nodes, once joined.
    collective: Option<Collective>,
    /// Set to ask the run to stop ([`Self::watch_interrupt`]).
    interrupt: Option<Arc<AtomicBool>>,
}

impl<Bk: TrainBackend> Trainer<Bk> {
    /// A fresh run on the backend `Bk` ([`Trainer::new`] on [`B`]) of
    /// `model` trained with `settings` on `devices` (plain
    /// devices of one backend; autodiff is added here). The model, its
    /// optimizer and the gradient sums live on the first device; the
    /// `train.workers` worker threads are spread over all of them in turn
    /// (worker `w` on device `w mod len`), so `train.workers` must be a
    /// multiple of their number. The weights are drawn from `settings.seed`
    /// on the CPU and moved to the device, so that they are the same on
    /// every backend. A device that cannot compute in `train.precision` is
    /// an error here, before anything runs.
    pub fn start(
        model: &TransformerVqConfig,
        settings: &TrainSection,
        devices: &[DispatchDevice],
    ) -> Result<Self, TrainError> {
        check_devices::<Bk>(devices, settings.workers)?;
        let net = match Bk::cpu() {
            Some(cpu) => {
                seeded_draw::<Bk, _>(&cpu, Some(settings.seed), || model.init::<Bk>(&cpu))?
            }
            // A backend without a CPU device: drawn on `CpuFused`, copied.
            None => {
                let cpu = Default::default();
                let drawn = seeded_draw::<CpuFused, _>(&cpu, Some(settings.seed), || {
                    model.init::<CpuFused>(&cpu)
                })?;
                let device = Bk::device_on(&devices[0], CheckpointingStrategy::None);
                checkpoint::moved::<CpuFused, Bk>(&drawn, model, &device)?
            }
        };
        Self::with_weights(model, net, settings, devices)
    }

    /// [`Self::start`] with the weights of `net` (a model with autodiff, on
    /// the CPU or the first device) instead of drawn ones: how `tvq check`
    /// gives the device and the CPU one draw, whatever else draws from the
    /// backend's shared generator meanwhile.
    pub(crate) fn with_weights(
        config: &TransformerVqConfig,
        mut net: TransformerVq<Bk>,
        settings: &TrainSection,
        devices: &[DispatchDevice],
    ) -> Result<Self, TrainError> {
        check_devices::<Bk>(devices, settings.workers)?;
        let precision = precision_on(&devices[0], settings.precision);
        for d in devices {
            check_precision(d, precision).map_err(|reason| TrainError::Config {
                key: "train.precision".into(),
                reason,
            })?;
        }
        let mode = settings.activation_checkpointing;
        if mode != ActivationCheckpointing::None && !Bk::CHECKPOINTS {
            return Err(TrainError::Config {
                key: "train.activation_checkpointing".into(),
                reason: format!(
                    "is \"{mode}\", which the fused kernels' trainer does not take \
                     (train.kernels = \"composed\" does)"
                ),
            });
        }
        let worker_devices = (0..settings.workers)
            .map(|w| autodiff_device::<Bk>(&devices[w % devices.len()], mode))
            .collect();
        // The model and optimizer stay on a plain autodiff device whatever
        // the mode: `selective` forks the model onto its workers' devices.
        let device = Bk::device_on(&devices[0], CheckpointingStrategy::None);
        // Drawn on the CPU and moved: the same weights on every backend.
        net.set_precision(precision);
        net.set_kernels(settings.kernels.model());
        let n_sublayers = net.sublayers.len();
        let net = if net.embedding.weight.device() == device {
            net
        } else {
            fork_onto(&net, &device)
        };
        Ok(Self {
            config: config.clone(),
            settings: settings.clone(),
            precision,
            device,
            devices: devices.to_vec(),
            worker_devices,
            n_sublayers,
            model: Some(net),
            optim: Optimizers::new(settings),
            states: vec![ModelState::new(n_sublayers); settings.shards()],
            state: TrainerState {
                loss_scale: loss_scale_for(precision, None),
                ..TrainerState::default()
            },
            last_checkpoint: None,
            rank: 0,
            nodes: 1,
            collective: None,
            interrupt: None,
        })
    }

    /// Replaces the drawn weights and codebooks with those of `source` (an
    /// export, a checkpoint directory or a run directory:
    /// [`checkpoint::read_weights_from`]), before the first step: the
    /// optimizer and the progress stay fresh. `train.init_from`.
    pub fn start_from(&mut self, source: &Path) -> Result<(), TrainError> {
        if self.state.step != 0 {
            return Err(TrainError::Config {
                key: "train.init_from".into(),
                reason: format!("the run is at step {}, not starting", self.state.step),
            });
        }
        let drawn = self.model().clone();
        let mut model = checkpoint::read_weights_from(source, drawn, &self.device)?;
        model.set_precision(self.precision);
        model.set_kernels(self.settings.kernels.model());
        self.model = Some(model);
        Ok(())
    }

    /// Makes this trainer node `rank` of `nodes`: it runs shards
    /// `rank * s .. (rank + 1) * s` of every batch (`s` = shards per node)
    /// and takes the batch rows of those shards. Call before
    /// [`Self::resume`], then [`Self::join`] the other nodes.
    pub fn on_node(mut self, rank: usize, nodes: usize) -> Self {
        (self.rank, self.nodes) = (rank, nodes);
        self
    }

    /// Whether this trainer writes checkpoints, metrics and plots (node 0).
    pub fn is_writer(&self) -> bool {
        self.rank == 0
    }

    /// Shards per batch over every node.
    fn total_shards(&self) -> usize {
        self.states.len() * self.nodes
    }

    /// Continues from the checkpoint in `dir`: weights, optimizer state,
    /// carried states (this node's shards') and progress. The checkpoint
    /// must hold as many shards as the run has (nodes x workers x
    /// micro-batches, split any way: the shards are the same rows), unless
    /// `reshard`, which starts every shard from a fresh state.
    pub fn resume(&mut self, dir: &Path, reshard: bool) -> Result<(), TrainError> {
        let model = self.model.take().expect("the model is in place");
        let optim = std::mem::replace(&mut self.optim, Optimizers::new(&self.settings));
        // The carried states go where the shards run (their checkpointing
        // strategy must be the shards').
        let state_device = self.worker_devices[0].clone();
        let loaded = checkpoint::resume(dir, model, optim, &self.device, &state_device)?;
        let mut model = loaded.model;
        // Not weights: a checkpoint of one precision resumes in another.
        model.set_precision(self.precision);
        model.set_kernels(self.settings.kernels.model());
        self.model = Some(model);
        self.optim = loaded.optim;
        let (here, total) = (self.states.len(), self.total_shards());
        if loaded.states.len() == total {
            self.states = loaded.states[self.rank * here..(self.rank + 1) * here].to_vec();
        } else if reshard {
            tracing::warn!(
                "{} carries the state of {} shards, the run has {total}: every shard starts from a fresh state",
                dir.display(),
                loaded.states.len()
            );
            self.states = vec![ModelState::new(self.n_sublayers); here];
        } else {
            return Err(TrainError::Config {
                key: "train.workers".into(),
                reason: format!(
                    "{} carries the state of {} shards, but nodes x train.workers x train.micro_batches = {total}: \
                     resume with a layout of {} shards, or pass --reshard to start the carried states afresh",
                    dir.display(),
                    loaded.states.len(),
                    loaded.states.len()
                ),
            });
        }
        let scale = loaded.trainer.loss_scale;
        self.state = TrainerState {
            loss_scale: loss_scale_for(self.precision, scale),
            ..loaded.trainer
        };
        self.last_checkpoint = Some(dir.to_path_buf());
        Ok(())
    }

    /// Joins the other nodes of the run and checks that they agree with
    /// this one: every rank taken once, the same `fingerprint` (of the
    /// config), the same step and the same weights. The first disagreement
    /// is an error naming the node.
    pub fn join(&mut self, collective: Collective, fingerprint: u64) -> Result<(), TrainError> {
        let (rank, nodes) = (collective.rank(), collective.nodes());
        assert_eq!(
            (rank, nodes),
            (self.rank, self.nodes),
            "joined as set by on_node"
        );
        let words = [
            fingerprint,
            self.state.step,
            node::weights_hash(self.model()),
        ];
        node::agree(&collective, words)?;
        self.collective = Some(collective);
        Ok(())
    }

    /// Makes every step report [`StepOutcome::interrupted`] once `flag` is set
    /// (on this node or, in a run over several, on any node: the request
    /// travels with the step's sum, so all nodes stop after the same step).
    pub fn watch_interrupt(&mut self, flag: Arc<AtomicBool>) {
        self.interrupt = Some(flag);
    }

    fn interrupted(&self) -> bool {
        self.interrupt
            .as_ref()
            .is_some_and(|f| f.load(Ordering::SeqCst))
    }

    /// The model being trained.
    pub fn model(&self) -> &TransformerVq<Bk> {
        self.model.as_ref().expect("the model is in place")
    }

    /// The model without autodiff on [`B`] (evaluation and sampling run
    /// there), on the model's device.
    pub fn inference_model(&self) -> Model {
        let mut model = Bk::on_dispatch(self.model()).unwrap_or_else(|| {
            checkpoint::moved::<Bk, B>(self.model(), &self.config, &self.devices[0])
                .expect("a model's own weights load into a model of its config")
        });
        model.set_kernels(self.settings.kernels.model());
        model
    }

    /// [`Self::inference_model`] on each of the run's devices, in order (the
    /// first where the model lives): for evaluating on all of them.
    pub fn inference_models(&self) -> Vec<Model> {
        let model = self.inference_model();
        self.devices.iter().map(|d| fork_onto(&model, d)).collect()
    }

    /// Steps done, data cursor, best validation, tokens.
    pub fn state(&self) -> &TrainerState {
        &self.state
    }

    /// Records a validation loss after the current step; the best one is
    /// kept from pruning.
    pub fn record_validation(&mut self, loss: f64) {
        if self.state.best.is_none_or(|(best, _)| loss < best) {
            self.state.best = Some((loss, self.state.step));
        }
    }

    /// The checkpoint written (or resumed from) last.
    pub fn last_checkpoint(&self) -> Option<&Path> {
        self.last_checkpoint.as_deref()
    }

    /// The forward and backward passes of `batch` (this node's rows) from
    /// the carried states (fresh ones when the batch starts new sequences),
    /// without updating the model or summing over nodes. The states move
    /// on one segment: the trainer keeps them, and the returned `states`
    /// is empty.
    pub fn gradients(&mut self, batch: &Batch) -> Result<StepGradients<Bk>, TrainError> {
        let n_shards = self.states.len();
        let fresh = vec![ModelState::new(self.n_sublayers); n_shards];
        if batch.reset {
            self.states = fresh.clone();
        }
        let rows = batch.batch / n_shards;
        let shards = std::mem::take(&mut self.states)
            .into_iter()
            .enumerate()
            .map(|(i, state)| Shard {
                batch,
                rows: i * rows..(i + 1) * rows,
                state,
            })
            .collect();
        let plan = ShardPlan {
            first: self.rank * n_shards,
            total: n_shards * self.nodes,
            seed: step_seed(self.settings.seed, self.state.step + 1),
            commit_weight: self.settings.commit_weight,
            loss_mean: self.settings.loss_mean,
            loss_scale: self.state.loss_scale.map_or(1.0, |s| s.scale),
            checkpointing: self.settings.activation_checkpointing,
        };
        let model = self.model.as_ref().expect("the model is in place");
        match compute_gradients(model, shards, plan, &self.worker_devices) {
            Ok(mut g) => {
                self.states = std::mem::take(&mut g.states);
                Ok(g)
            }
            Err(e) => {
                self.states = fresh;
                Err(e)
            }
        }
    }

    /// One optimizer step on `batch`; `cursor` is where the data continues
    /// after it (saved with the next checkpoint). A loss that is not a
    /// finite number stops the run before the weights change.
    pub fn step(&mut self, batch: &Batch, cursor: TrainCursor) -> Result<StepOutcome, TrainError> {
        let started = Instant::now();
        let step = self.state.step + 1;
        let (g, tokens, stop) = self.summed_gradients(batch)?;
        let n = self.total_shards() as f64;
        let (ce, commitment) = (g.ce_sum as f64 / n, g.commitment_sum as f64 / n);
        let loss = self.finite_loss(step, ce + self.settings.commit_weight * commitment)?;
        let scale = self.state.loss_scale.map_or(1.0, |s| s.scale);
        let lr = learning_rate(&self.settings, step);
        let (grad_norm, skipped) = self.update(step, lr, g.grads, &g.stats, scale);
        self.state.step = step;
        self.state.cursor = cursor;
        self.state.tokens += tokens;
        Ok(StepOutcome {
            step,
            lr,
            loss,
            ce,
            commitment,
            grad_norm,
            codebooks: g.stats.iter().map(|s| s.metrics()).collect(),
            tokens,
            elapsed: started.elapsed(),
            loss_scale: self.state.loss_scale.map(|_| scale),
            skipped,
            interrupted: stop || (self.collective.is_none() && self.interrupted()),
            device_memory_bytes: self.device_memory_bytes(),
        })
    }

    /// The update half of [`Self::step`] with gradients and codebook
    /// statistics computed elsewhere (on this trainer's model and device):
    /// clipping, AdamW at the next step's learning rate, the EMA update.
    /// `tvq check` gives two devices the same gradients this way, so that
    /// the update itself is compared. Returns the gradient norm.
    pub(crate) fn apply(&mut self, grads: GradientsParams, stats: &[CodebookStats<Bk>]) -> f64 {
        let step = self.state.step + 1;
        let lr = learning_rate(&self.settings, step);
        let (grad_norm, _) = self.update(step, lr, grads, stats, 1.0);
        self.state.step = step;
        grad_norm
    }

    /// GPU memory this trainer's devices hold, in bytes ([`device_memory_bytes`]
    /// over the calling thread's stream and the idle worker streams); `None`
    /// on the CPU.
    pub fn device_memory_bytes(&self) -> Option<u64> {
        let mut streams = CREWS.idle_streams();
        streams.push(StreamId::current());
        device_memory_bytes(&self.devices, &streams)
    }

    /// This node's gradients of `batch`, summed over the nodes when there
    /// are several, with the tokens they hold and whether any node was
    /// asked to stop.
    fn summed_gradients(
        &mut self,
        batch: &Batch,
    ) -> Result<(StepGradients<Bk>, u64, bool), TrainError> {
        let g = self.gradients(batch)?;
        let tokens = batch.valid.iter().filter(|&&v| v).count() as u64;
        let Some(c) = &self.collective else {
            return Ok((g, tokens, false));
        };
        let _all_reduce = tracing::debug_span!("all_reduce").entered();
        let local = [tokens as f32, self.interrupted() as u8 as f32];
        let (summed, extra) = g.all_reduce(self.model(), &local, c)?;
        Ok((summed, extra[0] as u64, extra[1] > 0.0))
    }

    /// `loss`, or the error that stops the run when it is not a finite
    /// number (the weights unchanged, the last checkpoint named).
    fn finite_loss(&self, step: u64, mut loss: f64) -> Result<f64, TrainError> {
        if crate::fault::inject(crate::fault::Point::Loss).is_err() {
            loss = f64::NAN;
        }
        if loss.is_finite() {
            return Ok(loss);
        }
        Err(TrainError::NonFinite {
            step,
            loss,
            checkpoint: self
                .last_checkpoint
                .as_ref()
                .map_or("(none yet)".into(), |p| p.display().to_string()),
        })
    }

    /// Clips the gradients (of an objective multiplied by `scale`), takes
    /// the AdamW step at `lr` and the EMA update of the codebooks; returns
    /// the gradient norm and whether the step was skipped: under loss
    /// scaling, gradients that overflowed leave the weights and codebooks
    /// alone and lower the scale.
    fn update(
        &mut self,
        step: u64,
        lr: f64,
        grads: GradientsParams,
        stats: &[CodebookStats<Bk>],
        scale: f64,
    ) -> (f64, bool) {
        let model = self.model.take().expect("the model is in place");
        let optimizer = tracing::debug_span!("optimizer").entered();
        let clip = clip_global_norm(&model, &grads, self.settings.grad_clip, scale);
        let grad_norm = clip.norm;
        let skipped = self.state.loss_scale.is_some() && !grad_norm.is_finite();
        if let Some(s) = &mut self.state.loss_scale {
            s.update(!skipped);
        }
        if skipped {
            let lowered = self.state.loss_scale.map_or(1.0, |s| s.scale);
            tracing::warn!(
                "step {step}: the f16 gradients overflowed; the step is skipped and the loss scale is now {lowered}"
            );
            self.model = Some(model);
            return (grad_norm, true);
        }
        let model = self.optim.step(lr, model, grads, clip.factor);
        drop(optimizer);
        let _ema = tracing::debug_span!("ema").entered();
        self.model = Some(model.update_codebooks(stats, self.settings.codebook_decay));
        (grad_norm, false)
    }

    /// Writes a checkpoint of the current step into `run_dir` (atomically),
    /// then deletes all but the `train.keep_checkpoints` newest and the best.
    /// Over several nodes every node calls it: node 0 gathers the carried
    /// states of every shard and writes; the others only send theirs.
    pub fn save(&mut self, run_dir: &Path) -> Result<PathBuf, TrainError> {
        let states = match &self.collective {
            None => self.states.clone(),
            Some(c) => match node::gather_states(c, &self.states, &self.device)? {
                Some(all) => all,
                None => {
                    let dir = checkpoint::checkpoint_dir(run_dir, self.state.step);
                    self.last_checkpoint = Some(dir.clone());
                    return Ok(dir);
                }
            },
        };
        let dir = checkpoint::save(run_dir, self.model(), &self.optim, &states, &self.state)?;
        checkpoint::prune(
            run_dir,
            self.settings.keep_checkpoints,
            self.state.best.map(|b| b.1),
            self.state.step,
        );
        self.last_checkpoint = Some(dir.clone());
        Ok(dir)
    }
}

impl Trainer {
    /// [`Trainer::start`] on [`B`], which runs on every device and composes
    /// its kernels in training; `Trainer::<CpuFused>::start` fuses them on
    /// the CPU, `WgpuFused` and `CudaFused` on the GPUs
    /// ([`crate::placement::TrainOn`] says which a run gets).
    pub fn new(
        model: &TransformerVqConfig,
        settings: &TrainSection,
        devices: &[DispatchDevice],
    ) -> Result<Self, TrainError> {
        Self::start(model, settings, devices)
    }
}

/// The loss scale a run in `precision` carries, from the checkpoint's
/// `saved` one: `f16` keeps it (or starts one), the others have none.
fn loss_scale_for(precision: Precision, saved: Option<LossScale>) -> Option<LossScale> {
    (precision == Precision::F16).then(|| saved.unwrap_or_default())
}

/// Checks that `devices` can share `workers` threads: a valid list
/// ([`check_device_list`]) of devices `Bk` runs on, with as many workers
/// on each.
pub(crate) fn check_devices<Bk: TrainBackend>(
    devices: &[DispatchDevice],
    workers: usize,
) -> Result<(), TrainError> {
    check_device_list(devices)?;
    if let Some(other) = devices.iter().find(|d| !Bk::runs_on(d)) {
        return Err(TrainError::Devices(format!(
            "names {}, where this trainer's backend does not run",
            crate::placement::device::device_name(other)
        )));
    }
    if !workers.is_multiple_of(devices.len()) {
        return Err(TrainError::Config {
            key: "train.workers".into(),
            reason: format!(
                "is {workers}, not a multiple of the {} devices: each device runs as many worker threads \
                 (e.g. --set train.workers={})",
                devices.len(),
                devices.len()
            ),
        });
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::gpu_under_test::{gpu_under_test, two_wgpu_devices};
    use crate::placement::TrainOn;
    use crate::placement::device::{DeviceSpec, device_name};
    use burn::prelude::*;
    use tvq_testkit::tiny_model;

    /// `rows` rows of `len` tokens of a fixed pattern over 11 ids (`reset`:
    /// starting new sequences).
    pub(crate) fn batch(rows: usize, len: usize, reset: bool) -> Batch {
        let n = rows * len;
        let tokens: Vec<u32> = (0..n as u32).map(|i| (i * 7 + 3) % 11).collect();
        Batch {
            batch: rows,
            len,
            inputs: tokens.clone(),
            targets: tokens.iter().map(|t| (t + 1) % 11).collect(),
            valid: vec![true; n],
            reset,
        }
    }

    /// A trainer of the tiny model (11 ids) on the CPU, lr 1e-2 from the
    /// first step.
    pub(crate) fn trainer(workers: usize, micro_batches: usize) -> Trainer {
        let settings = TrainSection {
            workers,
            micro_batches,
            lr: 1e-2,
            warmup_steps: 0,
            ..TrainSection::default()
        };
        let device = DeviceSpec::Cpu.init().unwrap().0;
        Trainer::new(&tiny_model(11), &settings, &[device]).unwrap()
    }

    fn weights(t: &Trainer) -> Vec<f32> {
        t.model()
            .embedding
            .weight
            .val()
            .into_data()
            .to_vec()
            .unwrap()
    }

    #[test]
    fn steps_advance_the_state_and_change_the_weights() {
        let mut t = trainer(1, 1);
        let before = weights(&t);
        let cursor = TrainCursor { epoch: 0, step: 1 };
        let m = t.step(&batch(2, 8, true), cursor).unwrap();
        assert_eq!((m.step, m.tokens), (1, 16));
        assert!(m.loss.is_finite() && m.grad_norm > 0.0);
        assert_eq!(t.state().cursor, cursor);
        assert_ne!(weights(&t), before);
        // The carried state moved on one segment of 8 tokens.
        assert_eq!(t.states[0].pos(), 8);
        t.step(&batch(2, 8, false), cursor).unwrap();
        assert_eq!(t.states[0].pos(), 16);
        t.step(&batch(2, 8, true), cursor).unwrap();
        assert_eq!(
            t.states[0].pos(),
            8,
            "a reset batch starts from a fresh state"
        );
    }

    /// The losses of three steps on 4 rows of 8 tokens, the first starting
    /// new sequences.
    /// One step's gradient norm.
    fn step_norm<Bk: TrainBackend>(t: &mut Trainer<Bk>) -> f64 {
        t.step(&batch(4, 8, false), TrainCursor::default())
            .unwrap()
            .grad_norm
    }

    fn three_steps<Bk: TrainBackend>(t: &mut Trainer<Bk>) -> Vec<f64> {
        (0..3)
            .map(|i| {
                t.step(&batch(4, 8, i == 0), TrainCursor::default())
                    .unwrap()
                    .loss
            })
            .collect()
    }

    /// Two workers and a learning rate high enough, from the first step,
    /// that three steps move the losses apart when anything differs.
    fn two_workers_fast_lr() -> TrainSection {
        TrainSection {
            workers: 2,
            lr: 1e-2,
            warmup_steps: 0,
            ..TrainSection::default()
        }
    }

    /// A text corpus in `dir` of `lines` short numbered lines.
    pub(crate) fn line_corpus(dir: &std::path::Path, lines: usize) -> tvq_data::Corpus {
        use tvq_data::{Corpus, CorpusKind, DataConfig};
        let path = dir.join("text.txt");
        let text: String = (0..lines)
            .map(|i| format!("line {} of {i}\n", i % 7))
            .collect();
        std::fs::write(&path, text).unwrap();
        Corpus::open(&DataConfig::new(CorpusKind::Text, &path)).unwrap()
    }

    /// The values of every parameter of `model` (codebooks included), in
    /// the module's order.
    fn every_parameter<Bk: Backend>(model: &TransformerVq<Bk>) -> Vec<Vec<f32>> {
        use burn::module::{ModuleVisitor, Param};
        struct Values(Vec<Vec<f32>>);
        impl<Bk: Backend> ModuleVisitor<Bk> for Values {
            fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<Bk, D>>) {
                self.0.push(crate::placement::host_values(&p.val()));
            }
        }
        let mut values = Values(vec![]);
        model.visit(&mut values);
        values.0
    }

    #[test]
    fn shards_on_worker_threads_give_the_sequential_result() {
        let run = |workers, micro| {
            let mut t = trainer(workers, micro);
            (three_steps(&mut t), weights(&t))
        };
        assert_eq!(run(2, 1), run(1, 2));
    }

    /// `train.loss_mean = "row"` weighs every row alike: on a batch whose
    /// first row is scored on one target and the second on all eight, its
    /// gradients are those of the per-token mean with each row a shard of
    /// its own (the step's objective is the mean over shards of each
    /// shard's per-token mean), and not those of the per-token mean over
    /// the batch, where the first row weighs an eighth as much.
    #[test]
    fn the_per_row_mean_weighs_every_row_alike() {
        use crate::config::LossMean;
        let mut b = batch(2, 8, true);
        for t in &mut b.targets[..7] {
            *t = tvq_data::vocab::PAD;
        }
        let grads = |loss_mean, micro_batches| {
            let mut t = trainer(1, micro_batches);
            t.settings.loss_mean = loss_mean;
            step_outcome(&mut t, &b).1.concat()
        };
        let per_row = grads(LossMean::Row, 1);
        let row_shards = grads(LossMean::Token, 2);
        let per_token = grads(LossMean::Token, 1);
        assert!(relative_gap(&per_row, &row_shards) < 1e-5);
        assert!(relative_gap(&per_token, &row_shards) > 1e-2);
        // The mean over rows does not depend on the shards.
        assert!(relative_gap(&grads(LossMean::Row, 2), &per_row) < 1e-5);
    }

    #[test]
    fn devices_must_be_distinct_of_one_backend_and_share_the_workers_evenly() {
        use burn::backend::wgpu::WgpuDevice;
        let (cpu, gpu0, gpu1) = (
            DispatchDevice::Flex(Default::default()),
            DispatchDevice::Wgpu(WgpuDevice::DiscreteGpu(0)),
            DispatchDevice::Wgpu(WgpuDevice::DiscreteGpu(1)),
        );
        let reason = |devices: &[DispatchDevice], workers| {
            check_devices::<B>(devices, workers)
                .unwrap_err()
                .to_string()
        };
        assert!(check_devices::<B>(&[gpu0.clone(), gpu1.clone()], 4).is_ok());
        assert!(reason(&[], 1).contains("no device"));
        assert_eq!(
            reason(&[cpu.clone(), cpu.clone()], 2),
            "--device names cpu twice"
        );
        assert!(reason(&[cpu, gpu0.clone()], 2).contains("mixes backends (cpu and wgpu:0)"));
        let uneven = reason(&[gpu0.clone(), gpu1], 3);
        assert!(
            uneven.contains("train.workers") && uneven.contains("not a multiple of the 2 devices")
        );
        // A fused backend's trainer on a device of another backend.
        let other = check_devices::<crate::placement::CpuFused>(&[gpu0], 1).unwrap_err();
        assert!(
            other
                .to_string()
                .contains("names wgpu:0, where this trainer's backend does not run"),
            "{other}"
        );
    }

    /// Trainers on several threads at once, each with two workers on one
    /// GPU, compute what one computes alone. A trainer's carried states
    /// live in its workers' GPU streams, so a crew must stay with the
    /// thread it was lent to (`parallel::workers`): trading crews between
    /// the trainers' steps gave wrong losses and NaN on wgpu.
    #[test]
    fn trainers_on_several_threads_compute_what_each_computes_alone() {
        let test = "trainers_on_several_threads_compute_what_each_computes_alone";
        let Some(gpu) = gpu_under_test(test) else {
            return;
        };
        let settings = two_workers_fast_lr();
        let model = tiny_model(11);
        let losses = || {
            let mut t = Trainer::new(&model, &settings, std::slice::from_ref(&gpu)).unwrap();
            three_steps(&mut t)
        };
        let alone = losses();
        let together: Vec<Vec<f64>> = std::thread::scope(|s| {
            let threads: Vec<_> = (0..3).map(|_| s.spawn(|| [losses(), losses()])).collect();
            threads
                .into_iter()
                .flat_map(|t| t.join().unwrap())
                .collect()
        });
        for run in together {
            assert_eq!(run, alone);
        }
    }

    #[test]
    fn workers_on_two_devices_train_like_workers_on_one() {
        let Some([a, b]) = two_wgpu_devices("workers_on_two_devices_train_like_workers_on_one")
        else {
            return;
        };
        let settings = two_workers_fast_lr();
        let model = TransformerVqConfig {
            dropout_residual: 0.1,
            ..tiny_model(11)
        };
        let run = |devices: &[DispatchDevice]| {
            let mut t = Trainer::new(&model, &settings, devices).unwrap();
            let losses = three_steps(&mut t);
            // Each shard's carried state stays on the device it ran on.
            let device_of = |shard: usize| {
                let prev = t.states[shard].sublayers[0].prev.as_ref().unwrap();
                device_name(&prev.k_window.device())
            };
            let ran_on = [device_of(0), device_of(1)];
            (losses, weights(&t), ran_on)
        };
        let (losses_one, weights_one, ran_one) = run(std::slice::from_ref(&a));
        let (losses_two, weights_two, ran_two) = run(&[a.clone(), b.clone()]);
        assert_eq!(ran_one, [device_name(&a), device_name(&a)]);
        assert_eq!(ran_two, [device_name(&a), device_name(&b)]);
        for (one, two) in losses_one.iter().zip(&losses_two) {
            assert!(
                (one - two).abs() <= 1e-5 * one.abs(),
                "{losses_one:?} {losses_two:?}"
            );
        }
        for (one, two) in weights_one.iter().zip(&weights_two) {
            assert!(
                (one - two).abs() <= 1e-5 * one.abs().max(1e-2),
                "{one} {two}"
            );
        }
    }

    /// A run's random numbers (initial weights, dropout masks) are drawn on
    /// the CPU whatever the device: the same config and seed give the same
    /// weights bit for bit on the GPU, and training steps (the state carried
    /// from the second on: forward, backward, clipping, AdamW, EMA
    /// codebooks) whose losses differ by `f32` rounding only: 1e-4 relative
    /// over three steps, where dropout drawn apart moves them by percents.
    /// The trained models then score a split alike (evaluation).
    #[test]
    fn a_run_computes_the_same_on_the_gpu_as_on_the_cpu() {
        use crate::config::EvalSection;
        use crate::inference::evaluate::{EvalOptions, evaluate};
        use tvq_data::Split;
        let Some(gpu) = gpu_under_test("a_run_computes_the_same_on_the_gpu_as_on_the_cpu") else {
            return;
        };
        let settings = TrainSection {
            lr: 1e-2,
            warmup_steps: 0,
            ..TrainSection::default()
        };
        let dir = tempfile::tempdir().unwrap();
        let corpus = line_corpus(dir.path(), 300);
        let split = corpus.split(Split::Validation);
        let model = TransformerVqConfig {
            dropout_residual: 0.2,
            dropout_layer: 0.2,
            vocab_size: corpus.vocab.size(),
            ..tiny_model(11)
        };
        let eval = EvalSection {
            batch_size: 2,
            update_len: 8,
            ..EvalSection::default()
        };
        let run = |device: DispatchDevice| {
            let mut t = Trainer::new(&model, &settings, &[device]).unwrap();
            let initial = node::weights_hash(t.model());
            let losses = three_steps(&mut t);
            let trained = every_parameter(t.model());
            let scored = evaluate(
                &t.inference_models(),
                &split,
                &eval,
                &EvalOptions::default(),
            );
            (initial, losses, trained, scored.unwrap().loss)
        };
        let (cpu_weights, cpu_losses, cpu_trained, cpu_eval) =
            run(DeviceSpec::Cpu.init().unwrap().0);
        let (gpu_weights, gpu_losses, gpu_trained, gpu_eval) = run(gpu);
        assert_eq!(cpu_weights, gpu_weights, "initial weights");
        // Every parameter after the three updates, codebooks included.
        // AdamW divides by the gradient's running RMS, so a rounding
        // difference in a near-zero gradient can move a weight by up to
        // the learning rate's share; 1e-3 absolute is a tenth of lr.
        assert_eq!(cpu_trained.len(), gpu_trained.len());
        for (i, (c, g)) in cpu_trained.iter().zip(&gpu_trained).enumerate() {
            let worst = tvq_testkit::max_abs_diff(c, g);
            assert!(worst <= 1e-3, "parameter {i} differs by {worst}");
        }
        for (c, g) in cpu_losses.iter().zip(&gpu_losses) {
            assert!(
                (c - g).abs() <= 1e-4 * c.abs(),
                "{cpu_losses:?} {gpu_losses:?}"
            );
        }
        assert!(
            (cpu_eval - gpu_eval).abs() <= 1e-4 * cpu_eval,
            "{cpu_eval} {gpu_eval}"
        );
    }

    /// A group of keys with no key in it (the empty compressed cache, the
    /// first block's previous block) takes no part in the softmax's row
    /// maximum on the GPU either. Autodiff records a maximum as argmax then
    /// gather, and cubecl's argmax of a row of `-inf` is no index at all:
    /// the gather read out of bounds, an illegal address on CUDA (the H100
    /// and H200 runs) and a stray value on wgpu. With the Toeplitz table
    /// at -200 for distance 0, a block's first query scores about -200 on
    /// its only key, so a stray maximum far above that (lavapipe's is)
    /// underflows every `exp` of the row and the loss is NaN.
    #[test]
    fn a_group_without_keys_leaves_the_softmax_maximum_alone_on_the_gpu() {
        use burn::module::Param;
        use tvq_model::position::PositionTerm;
        let test = "a_group_without_keys_leaves_the_softmax_maximum_alone_on_the_gpu";
        let Some(gpu) = gpu_under_test(test) else {
            return;
        };
        let settings = TrainSection {
            warmup_steps: 0,
            ..TrainSection::default()
        };
        let losses = |device: DispatchDevice| {
            let mut t = Trainer::new(&tiny_model(11), &settings, &[device]).unwrap();
            let mut model = t.model.take().unwrap();
            for gau in &mut model.sublayers {
                let PositionTerm::toeplitz(table) = &mut gau.bias else {
                    panic!("the tiny model's position term is the Toeplitz table")
                };
                let [h, d] = table.dims();
                let far = Tensor::zeros([h, d], &table.device()).slice_fill(s![.., 0], -200.0);
                *table = Param::initialized(table.id, far.require_grad());
            }
            t.model = Some(model);
            three_steps(&mut t)
        };
        let cpu = losses(DeviceSpec::Cpu.init().unwrap().0);
        let on_gpu = losses(gpu);
        for (c, g) in cpu.iter().zip(&on_gpu) {
            assert!(
                c.is_finite() && (c - g).abs() <= 1e-4 * c.abs(),
                "cpu {cpu:?}, gpu {on_gpu:?}"
            );
        }
    }

    #[test]
    fn a_non_finite_loss_stops_before_the_weights_change() {
        let mut t = trainer(1, 1);
        // A NaN embedding makes every logit NaN.
        let mut model = t.model.take().unwrap();
        let w = model.embedding.weight.val();
        model.embedding.weight = burn::module::Param::from_tensor(w.mul_scalar(f32::NAN).detach());
        t.model = Some(model);
        let err = t
            .step(&batch(1, 4, true), TrainCursor::default())
            .unwrap_err();
        assert!(
            matches!(err, TrainError::NonFinite { step: 1, .. }),
            "{err}"
        );
        assert_eq!(t.state().step, 0);
    }

    /// Everything one step computes, as host values: the losses, every
    /// gradient (module order), the codebook statistics and the carried
    /// states (their checkpoint bytes).
    #[allow(clippy::type_complexity)]
    pub(crate) fn step_outcome<Bk: TrainBackend>(
        t: &mut Trainer<Bk>,
        batch: &Batch,
    ) -> (Vec<f32>, Vec<Vec<f32>>, Vec<f32>, Vec<f32>) {
        let mut g = t.gradients(batch).unwrap();
        let mut flat = vec![];
        let shapes = crate::step::gradients::flatten_grads(t.model(), &mut g.grads, &mut flat);
        let mut rest = &flat[..];
        let grads = shapes
            .into_iter()
            .flatten()
            .map(|shape| {
                let (head, tail) = rest.split_at(shape.iter().product());
                rest = tail;
                head.to_vec()
            })
            .collect();
        let stats = g
            .stats
            .iter()
            .flat_map(|s| {
                let mut v = crate::placement::host_values(&s.counts);
                v.extend(crate::placement::host_values(&s.sums));
                v.extend(crate::placement::host_values(&s.sq_error));
                v.extend(crate::placement::host_values(&s.sq_norm));
                v
            })
            .collect();
        (
            vec![g.ce_sum, g.commitment_sum],
            grads,
            stats,
            state_values(&t.states),
        )
    }

    /// Every number of carried `states`: positions, previous blocks (codes
    /// as floats) and compressed caches.
    fn state_values<Bk: Backend>(states: &[ModelState<Bk>]) -> Vec<f32> {
        use crate::placement::host_values;
        let mut v = vec![];
        for s in states.iter().flat_map(|s| &s.sublayers) {
            v.push(s.pos as f32);
            if let Some(p) = &s.prev {
                v.extend(host_values(&p.k_window));
                v.extend(host_values(&p.v));
                v.extend(host_values(&p.codes.clone().float()));
            }
            if let Some(c) = &s.cache {
                v.extend(host_values(&c.counts));
                v.extend(host_values(&c.means));
            }
        }
        v
    }

    /// A step trains in every precision: the loss of a batch falls over a
    /// few steps on it, and `f16` runs under a loss scale.
    #[test]
    fn a_step_trains_in_every_precision() {
        for precision in Precision::ALL {
            let settings = TrainSection {
                precision: precision.into(),
                lr: 1e-2,
                warmup_steps: 0,
                ..TrainSection::default()
            };
            let device = DeviceSpec::Cpu.init().unwrap().0;
            let mut t = Trainer::new(&tiny_model(11), &settings, &[device]).unwrap();
            let losses: Vec<StepOutcome> = (0..6)
                .map(|_| t.step(&batch(2, 8, true), TrainCursor::default()).unwrap())
                .collect();
            let (first, last) = (losses[0].loss, losses[5].loss);
            assert!(last < 0.9 * first, "{precision}: {first} -> {last}");
            assert!(losses.iter().all(|m| !m.skipped));
            assert_eq!(t.model().precision(), precision);
            let scale = losses[0].loss_scale;
            assert_eq!(
                scale,
                (precision == Precision::F16).then_some(LossScale::INITIAL)
            );
        }
    }

    /// The products really run in the precision asked for: the gradients
    /// of one step differ from `f32`'s in `f16` (11 significant bits) and
    /// more in `bf16` (8 bits), each within a few percent.
    #[test]
    fn half_precision_gradients_differ_from_f32_bf16_more_than_f16() {
        let gradients = |precision: Precision| {
            let settings = TrainSection {
                precision: precision.into(),
                ..TrainSection::default()
            };
            let device = DeviceSpec::Cpu.init().unwrap().0;
            let mut t = Trainer::new(&tiny_model(11), &settings, &[device]).unwrap();
            // f16's objective is multiplied by its loss scale.
            let scale = t.state.loss_scale.map_or(1.0, |s| s.scale) as f32;
            let grads = step_outcome(&mut t, &batch(2, 8, true)).1;
            grads
                .into_iter()
                .map(|g| g.into_iter().map(|x| x / scale).collect::<Vec<_>>())
                .collect::<Vec<_>>()
        };
        let f32s = gradients(Precision::F32);
        let scale = f32s.iter().flatten().fold(0f32, |m, g| m.max(g.abs()));
        // The largest difference from f32, relative to the largest gradient.
        let error = |precision| {
            let grads = gradients(precision);
            let worst = grads
                .iter()
                .flatten()
                .zip(f32s.iter().flatten())
                .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            worst / scale
        };
        let (f16, bf16) = (error(Precision::F16), error(Precision::Bf16));
        assert!(f16 > 0.0, "f16 products equal f32's: not in f16");
        assert!(
            bf16 > f16,
            "bf16 ({bf16}) should differ more than f16 ({f16})"
        );
        assert!(bf16 < 0.05, "bf16 gradients off by {bf16} of the largest");
    }

    /// A loss scale that overflows `f16` (largest value 65,504) but not
    /// `f32` skips the `f16` step and not the `f32` one: the overflow
    /// comes from the half-precision products themselves.
    #[test]
    fn a_loss_scale_that_overflows_only_f16_skips_only_the_f16_step() {
        for (precision, skipped) in [(Precision::F16, true), (Precision::F32, false)] {
            let settings = TrainSection {
                precision: precision.into(),
                ..TrainSection::default()
            };
            let device = DeviceSpec::Cpu.init().unwrap().0;
            let mut t = Trainer::new(&tiny_model(11), &settings, &[device]).unwrap();
            t.state.loss_scale = Some(LossScale {
                scale: 1e6,
                good_steps: 0,
            });
            let m = t.step(&batch(2, 8, true), TrainCursor::default()).unwrap();
            assert_eq!(m.skipped, skipped, "{precision}: {m:?}");
        }
    }

    /// Under loss scaling, gradients that overflow leave the weights alone
    /// and halve the scale; the next step trains.
    #[test]
    fn an_overflowing_f16_step_is_skipped_and_lowers_the_loss_scale() {
        let settings = TrainSection {
            precision: Precision::F16.into(),
            ..TrainSection::default()
        };
        let device = DeviceSpec::Cpu.init().unwrap().0;
        let mut t = Trainer::new(&tiny_model(11), &settings, &[device]).unwrap();
        // Gradients times 1e38 overflow f32.
        t.state.loss_scale = Some(LossScale {
            scale: 1e38,
            good_steps: 5,
        });
        let before = every_parameter(t.model());
        let m = t.step(&batch(2, 8, true), TrainCursor::default()).unwrap();
        assert!(m.skipped && !m.grad_norm.is_finite(), "{m:?}");
        assert_eq!(every_parameter(t.model()), before, "weights and codebooks");
        assert_eq!(
            t.state.loss_scale,
            Some(LossScale {
                scale: 5e37,
                good_steps: 0
            })
        );
        assert_eq!(t.state.step, 1, "the step is counted");
        t.state.loss_scale = Some(LossScale::new());
        let m = t.step(&batch(2, 8, true), TrainCursor::default()).unwrap();
        assert!(!m.skipped && m.grad_norm.is_finite());
        assert_ne!(every_parameter(t.model()), before);
    }

    /// The master weights are `f32` in every precision, so a checkpoint of
    /// one precision resumes in another with the same weights, optimizer
    /// and states; `f16`'s loss scale is saved and comes back.
    #[test]
    fn checkpoints_of_one_precision_resume_in_another() {
        let dir = tempfile::tempdir().unwrap();
        let device = DeviceSpec::Cpu.init().unwrap().0;
        let make = |precision: Precision| {
            let settings = TrainSection {
                precision: precision.into(),
                lr: 1e-2,
                warmup_steps: 0,
                ..TrainSection::default()
            };
            Trainer::new(&tiny_model(11), &settings, std::slice::from_ref(&device)).unwrap()
        };
        let mut path: Option<PathBuf> = None;
        for (from, to) in [
            (Precision::F32, Precision::Bf16),
            (Precision::Bf16, Precision::F16),
            (Precision::F16, Precision::F32),
            (Precision::F16, Precision::F16),
        ] {
            let mut a = make(from);
            if let Some(p) = &path {
                a.resume(p, false).unwrap();
            }
            a.step(&batch(2, 8, true), TrainCursor::default()).unwrap();
            a.step(&batch(2, 8, false), TrainCursor::default()).unwrap();
            let saved = a.save(dir.path()).unwrap();
            let mut b = make(to);
            b.resume(&saved, false).unwrap();
            assert_eq!(b.model().precision(), to);
            assert_eq!(every_parameter(b.model()), every_parameter(a.model()));
            assert_eq!(state_values(&b.states), state_values(&a.states));
            let scale = b.state().loss_scale;
            match (from, to) {
                (Precision::F16, Precision::F16) => assert_eq!(scale, a.state().loss_scale),
                (_, Precision::F16) => assert_eq!(scale, Some(LossScale::new())),
                _ => assert_eq!(scale, None),
            }
            let m = b.step(&batch(2, 8, false), TrainCursor::default()).unwrap();
            assert!(m.loss.is_finite());
            path = Some(saved);
        }
    }

    /// The largest difference between `got` and `want`, as a share of
    /// `want`'s largest magnitude (0 where they are equal).
    pub(crate) fn relative_gap(got: &[f32], want: &[f32]) -> f32 {
        assert_eq!(got.len(), want.len(), "lengths");
        let worst = tvq_testkit::max_abs_diff(got, want);
        if worst == 0.0 {
            return 0.0;
        }
        worst / want.iter().map(|x| x.abs()).fold(0f32, f32::max)
    }

    /// A fused backend in training (`Trainer<Bk>` on `device`): it starts
    /// from the weights the composed trainer draws (every backend draws
    /// with the CPU's generator), each sublayer's forward pass reaches the
    /// fused attention and quantizer, and one segment's gradients,
    /// codebook statistics and carried state, then three steps, come out
    /// as the composed trainer's on the same device to rounding (within
    /// `tol` of the largest value), under both position terms the kernels
    /// cover; each step's gradient norm and AdamW step too, by one kernel
    /// each per step. A checkpoint of either resumes in the other exactly.
    fn fused_trainer_takes_the_composed_steps<Bk: TrainBackend>(device: DispatchDevice, tol: f32) {
        use tvq_model::RelativeBias;
        use tvq_model::kernel::{
            fused_adamw_calls, fused_attention_calls, fused_norm_calls, fused_quantize_calls,
        };
        let dir = tempfile::tempdir().unwrap();
        let settings = TrainSection {
            lr: 1e-2,
            warmup_steps: 0,
            ..TrainSection::default()
        };
        let close = |a: &[f32], b: &[f32], what: &str| {
            let gap = relative_gap(a, b);
            assert!(gap <= tol, "{what}: off by {gap} of the largest value");
        };
        for bias in [RelativeBias::Toeplitz, RelativeBias::Xl] {
            let model = TransformerVqConfig {
                bias,
                n_layer: 2,
                ..tiny_model(11)
            };
            let devices = std::slice::from_ref(&device);
            let mut composed = Trainer::new(&model, &settings, devices).unwrap();
            let mut fused = Trainer::<Bk>::start(&model, &settings, devices).unwrap();
            assert_eq!(
                every_parameter(fused.model()),
                every_parameter(composed.model())
            );
            let calls = (fused_attention_calls(), fused_quantize_calls());
            let (norms, adamws) = (fused_norm_calls(), fused_adamw_calls());
            // One segment's passes from the same weights: losses, every
            // gradient, the codebook statistics and the carried state.
            let first = batch(4, 8, true);
            let (got, want) = (
                step_outcome(&mut fused, &first),
                step_outcome(&mut composed, &first),
            );
            close(&got.0, &want.0, "losses");
            assert_eq!(got.1.len(), want.1.len(), "gradients");
            for (i, (g, w)) in got.1.iter().zip(&want.1).enumerate() {
                close(g, w, &format!("{bias:?} gradient of parameter {i}"));
            }
            close(&got.2, &want.2, "codebook statistics");
            close(&got.3, &want.3, "carried state");
            // Then three steps.
            let (want, got) = (three_steps(&mut composed), three_steps(&mut fused));
            // A fourth step's gradient norm (`three_steps` gives losses).
            let (want_norm, got_norm) = (step_norm(&mut composed), step_norm(&mut fused));
            assert!(
                (got_norm - want_norm).abs() <= f64::from(tol) * want_norm,
                "{bias:?} gradient norm {got_norm}, composed {want_norm}"
            );
            assert_eq!(
                fused_norm_calls() - norms,
                4,
                "{bias:?}: the gradient norm's kernel per step"
            );
            assert_eq!(
                fused_adamw_calls() - adamws,
                4,
                "{bias:?}: the AdamW step's kernel per step"
            );
            let sublayer_passes = 5 * 2 * model.n_layer as u64;
            assert_eq!(
                (
                    fused_attention_calls() - calls.0,
                    fused_quantize_calls() - calls.1
                ),
                (sublayer_passes, sublayer_passes),
                "{bias:?}: every sublayer's forward pass fuses"
            );
            for (g, w) in got.iter().zip(&want) {
                assert!(
                    (g - w).abs() <= f64::from(tol) * w.abs(),
                    "{bias:?} losses {got:?}, {want:?}"
                );
            }
            let (got, want) = (
                every_parameter(fused.model()),
                every_parameter(composed.model()),
            );
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                close(g, w, &format!("{bias:?} parameter {i} after the steps"));
            }
            close(
                &state_values(&fused.states),
                &state_values(&composed.states),
                "states",
            );

            let saved = fused
                .save(&dir.path().join(format!("{bias:?}-fused")))
                .unwrap();
            let mut resumed = Trainer::new(&model, &settings, devices).unwrap();
            resumed.resume(&saved, false).unwrap();
            assert_eq!(
                every_parameter(resumed.model()),
                every_parameter(fused.model())
            );
            assert_eq!(state_values(&resumed.states), state_values(&fused.states));
            let saved = composed
                .save(&dir.path().join(format!("{bias:?}-composed")))
                .unwrap();
            let mut resumed = Trainer::<Bk>::start(&model, &settings, devices).unwrap();
            resumed.resume(&saved, false).unwrap();
            assert_eq!(
                every_parameter(resumed.model()),
                every_parameter(composed.model())
            );
            assert_eq!(
                state_values(&resumed.states),
                state_values(&composed.states)
            );
            let next = |t: &mut Trainer<Bk>| t.step(&batch(4, 8, false), TrainCursor::default());
            assert!(next(&mut resumed).unwrap().loss.is_finite());
            // What evaluation reads: the trained weights on `B`.
            assert_eq!(
                every_parameter(&fused.inference_model()),
                every_parameter(fused.model())
            );
        }
    }

    /// [`fused_trainer_takes_the_composed_steps`] on the CPU (`CpuFused`),
    /// within 1e-5 of the largest value.
    #[test]
    fn the_cpu_fused_trainer_takes_the_composed_steps() {
        let cpu = DeviceSpec::Cpu.init().unwrap().0;
        assert_eq!(
            TrainOn::choose(&TrainSection::default(), std::slice::from_ref(&cpu)),
            TrainOn::CpuFused
        );
        fused_trainer_takes_the_composed_steps::<crate::placement::CpuFused>(cpu.clone(), 1e-5);
        // Activation checkpointing is the composed trainer's: refused here.
        let selective = TrainSection {
            activation_checkpointing: ActivationCheckpointing::Selective,
            ..TrainSection::default()
        };
        let refused =
            Trainer::<crate::placement::CpuFused>::start(&tiny_model(11), &selective, &[cpu]);
        let why = refused.err().expect("refused").to_string();
        assert!(
            why.contains("train.activation_checkpointing") && why.contains("\"selective\""),
            "{why}"
        );
    }

    /// bf16 products train on the fused kernels too (the attention kernel
    /// widens its operands to `f32`): on the CPU a bf16 run chooses
    /// `CpuFused`, every sublayer's forward pass reaches the attention
    /// kernel, and one step's loss and gradients agree with the composed
    /// bf16 trainer's, and with `f32`'s, within what bf16's 8 significant
    /// bits allow (the largest gradient difference within 5% of the
    /// largest gradient, as `half_precision_gradients_differ_from_f32_*`
    /// finds for bf16 alone).
    #[test]
    fn bf16_trains_on_the_fused_kernels() {
        use tvq_model::kernel::fused_attention_calls;
        let cpu = DeviceSpec::Cpu.init().unwrap().0;
        let devices = std::slice::from_ref(&cpu);
        let settings = |precision: Precision| TrainSection {
            precision: precision.into(),
            ..TrainSection::default()
        };
        let bf16 = settings(Precision::Bf16);
        assert_eq!(TrainOn::choose(&bf16, devices), TrainOn::CpuFused);
        let model = tiny_model(11);
        let first = batch(2, 8, true);
        let calls = fused_attention_calls();
        let mut fused =
            Trainer::<crate::placement::CpuFused>::start(&model, &bf16, devices).unwrap();
        assert_eq!(fused.model().precision(), Precision::Bf16);
        let got = step_outcome(&mut fused, &first);
        assert_eq!(
            fused_attention_calls() - calls,
            2 * model.n_layer as u64,
            "every sublayer's attention fuses under bf16"
        );
        for precision in [Precision::Bf16, Precision::F32] {
            let mut composed = Trainer::new(&model, &settings(precision), devices).unwrap();
            let want = step_outcome(&mut composed, &first);
            let gap = relative_gap(&got.0, &want.0);
            assert!(gap <= 0.01, "losses against composed {precision}: {gap}");
            let (got, want) = (got.1.concat(), want.1.concat());
            let gap = relative_gap(&got, &want);
            assert!(gap <= 0.05, "gradients against composed {precision}: {gap}");
        }
    }

    /// [`fused_trainer_takes_the_composed_steps`] on the GPU under test
    /// (`WgpuFused` on lavapipe in CI, `CudaFused` on CUDA), against the
    /// composed trainer on the same device, within 1e-5 of the largest
    /// value.
    #[test]
    fn the_gpu_fused_trainer_takes_the_composed_steps() {
        use crate::placement::{CudaFused, WgpuFused};
        let test = "the_gpu_fused_trainer_takes_the_composed_steps";
        let Some(gpu) = gpu_under_test(test) else {
            return;
        };
        let on = TrainOn::choose(
            &TrainSection {
                precision: Precision::F32.into(),
                kernels: crate::config::KernelsSetting::Fused,
                ..TrainSection::default()
            },
            std::slice::from_ref(&gpu),
        );
        match on {
            TrainOn::WgpuFused => fused_trainer_takes_the_composed_steps::<WgpuFused>(gpu, 1e-5),
            TrainOn::CudaFused => fused_trainer_takes_the_composed_steps::<CudaFused>(gpu, 1e-5),
            other => panic!("{gpu:?} trains on {other}"),
        }
    }

    /// `train.init_from`: a fresh trainer takes every weight and codebook
    /// of another run's checkpoint, from its directory or the run's, but
    /// not its progress; a checkpoint of another architecture is an error
    /// naming the tensors, and the trainer keeps its drawn weights.
    #[test]
    fn a_trainer_starts_from_the_weights_and_codebooks_of_another_run() {
        let dir = tempfile::tempdir().unwrap();
        let mut source = trainer(1, 1);
        let drawn = every_parameter(source.model());
        source
            .step(&batch(2, 8, true), TrainCursor::default())
            .unwrap();
        source
            .step(&batch(2, 8, false), TrainCursor::default())
            .unwrap();
        let trained = every_parameter(source.model());
        let checkpoint = source.save(dir.path()).unwrap();
        for from in [checkpoint.as_path(), dir.path()] {
            let mut t = trainer(1, 1);
            assert_eq!(every_parameter(t.model()), drawn, "the same draw");
            t.start_from(from).unwrap();
            assert_eq!(every_parameter(t.model()), trained, "from {from:?}");
            assert_eq!(t.state().step, 0);
            let m = t.step(&batch(2, 8, true), TrainCursor::default()).unwrap();
            assert_eq!(m.step, 1);
        }

        let settings = TrainSection::default();
        let device = DeviceSpec::Cpu.init().unwrap().0;
        let other = tiny_model(11).with_n_code(7);
        let mut t = Trainer::new(&other, &settings, &[device]).unwrap();
        let before = every_parameter(t.model());
        let err = t.start_from(&checkpoint).unwrap_err().to_string();
        assert!(err.contains("c_sum") && !err.contains('\n'), "{err}");
        assert_eq!(every_parameter(t.model()), before);
    }

    #[test]
    fn a_device_without_the_precision_is_a_config_error() {
        use burn::backend::wgpu::WgpuDevice;
        let settings = TrainSection {
            precision: Precision::Bf16.into(),
            ..TrainSection::default()
        };
        // Refused before any adapter is touched.
        let wgpu = DispatchDevice::Wgpu(WgpuDevice::DefaultDevice);
        let Err(err) = Trainer::new(&tiny_model(11), &settings, &[wgpu]) else {
            panic!("bf16 on wgpu was accepted");
        };
        let err = err.to_string();
        assert!(
            err.contains("train.precision") && err.contains("bf16 does not run on wgpu"),
            "{err}"
        );
        assert!(!err.contains('\n'), "one line: {err}");
    }
}
