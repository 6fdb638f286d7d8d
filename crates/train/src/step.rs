//! The forward and backward passes of one optimizer step.
//!
//! The batch's rows are cut into shards, each with its own carried state;
//! shards are independent until their gradients are summed, so they can run
//! on several worker threads ([`crate::workers`]).

use std::sync::{Condvar, Mutex};

use burn::module::Module;
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::prelude::*;
use tvq_model::{CodebookStats, Loss, ModelState};

use crate::batch::BatchTensors;
use crate::error::TrainError;
use crate::optim::{B, Model};
use crate::workers::map_in_workers;

/// One shard of a batch: its rows' tokens and the state they carry from
/// the previous segment.
pub struct Shard {
    /// Inputs, targets and validity, `[R, T]` each.
    pub tokens: BatchTensors,
    /// The rows' carried state.
    pub state: ModelState<B>,
}

/// What one step's forward and backward passes produce.
pub struct StepGradients {
    /// Gradients of the loss (the mean over shards of each shard's mean
    /// token loss), keyed by parameter.
    pub grads: GradientsParams,
    /// Mean cross-entropy (nats per token), averaged over shards.
    pub ce: f64,
    /// Mean commitment loss, averaged over shards.
    pub commitment: f64,
    /// Codebook statistics of every sublayer, summed over shards.
    pub stats: Vec<CodebookStats<B>>,
    /// Each shard's state after the segment (detached by the model), in
    /// shard order.
    pub states: Vec<ModelState<B>>,
}

struct ShardResult {
    grads: GradientsParams,
    ce: f64,
    commitment: f64,
    stats: Vec<CodebookStats<B>>,
    state: ModelState<B>,
}

/// Lets shards draw their dropout masks one at a time in shard order. The
/// backends draw random numbers from one global generator; taking turns
/// makes the draws come in the order one thread would make them, while the
/// forward and backward passes (which draw nothing once they have their
/// masks) overlap.
#[derive(Default)]
struct MaskTurns {
    next: Mutex<usize>,
    turn_over: Condvar,
}

/// Shard `i`'s turn; the next shard's begins when this is dropped (also on
/// an error or a panic, so no worker waits forever).
struct Turn<'a>(&'a MaskTurns);

impl MaskTurns {
    fn wait_for(&self, i: usize) -> Turn<'_> {
        let mut next = self.next.lock().unwrap_or_else(|e| e.into_inner());
        while *next != i {
            next = self.turn_over.wait(next).unwrap_or_else(|e| e.into_inner());
        }
        Turn(self)
    }
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        *self.0.next.lock().unwrap_or_else(|e| e.into_inner()) += 1;
        self.0.turn_over.notify_all();
    }
}

fn run_shard(
    model: &Model,
    (i, shard): (usize, Shard),
    turns: Option<&MaskTurns>,
    n_shards: usize,
    commit_weight: f64,
) -> Result<ShardResult, TrainError> {
    let BatchTensors {
        inputs,
        targets,
        valid,
    } = shard.tokens;
    let masks = {
        let _turn = turns.map(|t| t.wait_for(i));
        model.dropout_masks(inputs.dims())
    };
    let out = model.forward_with_masks(inputs, shard.state, Some(valid.clone()), masks)?;
    let loss = Loss::new(&out, targets, Some(valid));
    // The step minimises the mean over shards of each shard's mean token loss.
    let objective = loss.total(commit_weight) / n_shards as f64;
    Ok(ShardResult {
        ce: loss.ce.into_scalar().elem(),
        commitment: loss.commitment.into_scalar().elem(),
        grads: GradientsParams::from_grads(objective.backward(), model),
        stats: out.stats,
        state: out.state,
    })
}

/// Runs the forward and backward passes of `shards` on `workers` threads
/// ([`map_in_workers`]), each on its own fork of the model: a fork has its
/// own autodiff graph and the same parameter ids, so the gradients line up.
/// With dropout the shards draw their masks in turn, in shard order
/// ([`MaskTurns`]), before their passes run at once. Summing in shard order
/// makes the result independent of `workers` (it depends on the shards
/// only).
pub fn compute_gradients(
    model: &Model,
    shards: Vec<Shard>,
    workers: usize,
    commit_weight: f64,
) -> Result<StepGradients, TrainError> {
    let n = shards.len();
    let turns = (workers > 1 && model.uses_dropout()).then(MaskTurns::default);
    let device = model.embedding.weight.device();
    let results = map_in_workers(
        shards.into_iter().enumerate().collect(),
        workers,
        || model.clone().fork(&device),
        |fork, shard| run_shard(fork, shard, turns.as_ref(), n, commit_weight),
    )?;
    let mut accumulator = GradientsAccumulator::<Model>::new();
    let (mut ce_sum, mut commitment_sum) = (0.0, 0.0);
    let mut stats: Option<Vec<CodebookStats<B>>> = None;
    let mut states = Vec::with_capacity(n);
    for r in results {
        accumulator.accumulate(model, r.grads);
        ce_sum += r.ce;
        commitment_sum += r.commitment;
        stats = Some(match stats {
            None => r.stats,
            Some(acc) => acc
                .into_iter()
                .zip(r.stats)
                .map(|(a, b)| a.merge(b))
                .collect(),
        });
        states.push(r.state);
    }
    Ok(StepGradients {
        grads: accumulator.grads(),
        ce: ce_sum / n as f64,
        commitment: commitment_sum / n as f64,
        stats: stats.unwrap_or_default(),
        states,
    })
}
