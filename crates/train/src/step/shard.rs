//! One shard of a step: the rows it trains on, how its passes run
//! ([`ShardPlan`]) and what they give back (`ShardResult`). The plain
//! passes ([`crate::step::gradients`]) and the recomputing ones ([`crate::step::recompute`])
//! share these.

use std::ops::Range;

use burn::optim::GradientsParams;
use burn::prelude::*;
use tvq_data::Batch;
use tvq_model::{CodebookStats, Loss, ModelState};

use crate::config::{ActivationCheckpointing, LossMean};
use crate::placement::TrainBackend;

/// One shard of a batch: some of its rows and the state they carry from
/// the previous segment.
pub struct Shard<'a, B: TrainBackend> {
    /// The batch.
    pub batch: &'a Batch,
    /// The shard's rows of it.
    pub rows: Range<usize>,
    /// The rows' carried state, on any device: it moves to the device the
    /// shard runs on, and the next state stays there.
    pub state: ModelState<B>,
}

/// Which shards of the whole run a call computes, how they draw dropout,
/// and how their passes run.
#[derive(Clone, Copy, Debug)]
pub struct ShardPlan {
    /// Index of the first shard in the run (`rank * shards per node`).
    pub first: usize,
    /// Shards in the whole run (over every node): each shard's loss is
    /// divided by it, so the sum over shards is the mean.
    pub total: usize,
    /// Seed of this step's dropout draws; shard `g` draws from
    /// `shard_seed(seed, g)`, so its masks do not depend on where it runs.
    pub seed: u64,
    /// Weight of the commitment loss.
    pub commit_weight: f64,
    /// How a shard averages its cross-entropy.
    pub loss_mean: LossMean,
    /// Factor on the objective before the backward pass (dynamic loss
    /// scaling, [`crate::step::optim::LossScale`]; 1 without): the gradients come
    /// back multiplied by it.
    pub loss_scale: f64,
    /// Whether each sublayer's forward pass runs again in the backward pass
    /// ([`ActivationCheckpointing::Full`], [`crate::step::recompute`]); burn's
    /// balanced checkpointing is the devices' ([`crate::placement::autodiff_device`]).
    pub checkpointing: ActivationCheckpointing,
}

impl ShardPlan {
    /// `x` times the loss scale (itself when there is none).
    pub(crate) fn scaled<B: Backend>(&self, x: Tensor<B, 1>) -> Tensor<B, 1> {
        if self.loss_scale == 1.0 {
            x
        } else {
            x * self.loss_scale
        }
    }

    /// A shard's part of the step's objective: its loss over the run's
    /// shards, scaled.
    pub(crate) fn objective<B: Backend>(&self, loss: &Loss<B>) -> Tensor<B, 1> {
        let ce = match self.loss_mean {
            LossMean::Token => loss.ce.clone(),
            LossMean::Row => loss.ce_per_row(),
        };
        let total = ce + loss.commitment.clone() * self.commit_weight;
        self.scaled(total / self.total as f64)
    }

    /// The part of the objective a per-token commitment `[B, T]` (one
    /// sublayer's) adds: the same terms as [`Self::objective`]'s.
    pub(crate) fn commitment_objective<B: Backend>(
        &self,
        commitment: Tensor<B, 2>,
        valid: Option<Tensor<B, 2, Bool>>,
    ) -> Tensor<B, 1> {
        let mean = Loss::commitment_mean(commitment, valid);
        self.scaled(mean * self.commit_weight / self.total as f64)
    }
}

/// The seed of shard `shard`'s dropout masks in a step seeded `seed`.
pub(crate) fn shard_seed(seed: u64, shard: usize) -> u64 {
    tvq_data::hash::splitmix64(seed ^ (shard as u64).wrapping_mul(0xD1B5_4A32_D192_ED03))
}

/// What one shard's passes produce.
pub(crate) struct ShardResult<B: TrainBackend> {
    /// Gradients of the shard's part of the objective.
    pub grads: GradientsParams,
    /// Mean cross-entropy, nats per token.
    pub ce: f32,
    /// Mean commitment.
    pub commitment: f32,
    /// Codebook statistics, one per sublayer.
    pub stats: Vec<CodebookStats<B>>,
    /// The state after the segment (detached).
    pub state: ModelState<B>,
}
