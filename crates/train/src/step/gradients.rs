//! The forward and backward passes of one optimizer step.
//!
//! The batch's rows are cut into shards, each with its own carried state;
//! shards are independent until their gradients are summed, so they can run
//! on several worker threads ([`crate::parallel::workers`]) and on several nodes
//! ([`crate::parallel::collective`]): the gradients, codebook statistics and losses
//! are sums over shards, and a node's sums are added to the other nodes'
//! ([`StepGradients::all_reduce`]).

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use tvq_model::{CodebookStats, Loss, ModelState, Pass, TransformerVq};

use crate::batch::BatchTensors;
use crate::config::ActivationCheckpointing;
use crate::error::TrainError;
use crate::parallel::collective::Collective;
use crate::parallel::workers::map_in_workers;
use crate::placement::{TrainBackend, drawn_masks, fork_onto, host_values};

use crate::step::shard::{Shard, ShardPlan, ShardResult, shard_seed};

/// What one step's forward and backward passes produce: sums over the
/// shards computed here (and over every node after [`Self::all_reduce`]).
pub struct StepGradients<B: TrainBackend> {
    /// Gradients of the objective (the mean over the run's shards of each
    /// shard's mean token loss), keyed by parameter.
    pub grads: GradientsParams,
    /// Sum over shards of each shard's mean cross-entropy (nats per token).
    pub ce_sum: f32,
    /// Sum over shards of each shard's mean commitment loss.
    pub commitment_sum: f32,
    /// Codebook statistics of every sublayer, summed over shards.
    pub stats: Vec<CodebookStats<B>>,
    /// Each shard's state after the segment (detached by the model), in
    /// shard order, on the device the shard ran on; never reduced (each
    /// node carries its own shards).
    pub states: Vec<ModelState<B>>,
}

/// The passes of shard `i` on `fork` (on its worker's device). Gradients
/// and statistics come back on `home`, the device of the model stepped.
fn run_shard<B: TrainBackend>(
    fork: &TransformerVq<B>,
    (i, shard): (usize, Shard<B>),
    plan: ShardPlan,
    home: &B::Device,
) -> Result<ShardResult<B>, TrainError> {
    let _shard = tracing::debug_span!("shard", i).entered();
    let device = fork.embedding.weight.device();
    let BatchTensors {
        inputs,
        targets,
        valid,
    } = BatchTensors::rows(shard.batch, shard.rows, &device);
    let seed = fork
        .uses_dropout()
        .then(|| shard_seed(plan.seed, plan.first + i));
    // Drawn on the CPU whatever the device: the masks depend on the seed
    // only, not on the backend's generator.
    let masks = drawn_masks(fork, inputs.dims(), seed, &device);
    let state = shard.state.into_device(&device);
    let mut result = match plan.checkpointing {
        ActivationCheckpointing::Full => {
            crate::step::recompute::passes(fork, inputs, targets, valid, state, masks, &plan)?
        }
        ActivationCheckpointing::None | ActivationCheckpointing::Selective => {
            let forward = tracing::debug_span!("forward").entered();
            let pass = Pass::new().with_masks(masks).with_valid(valid.clone());
            let out = fork.forward(inputs, state, pass)?;
            let loss = Loss::new(&out, targets, valid);
            drop(forward);
            // The step minimises the mean over shards of each shard's mean token loss.
            let grads = tracing::debug_span!("backward")
                .in_scope(|| GradientsParams::from_grads(plan.objective(&loss).backward(), fork));
            ShardResult {
                ce: loss.ce.into_scalar().elem(),
                commitment: loss.commitment.into_scalar().elem(),
                grads,
                stats: out.stats,
                state: out.state,
            }
        }
    };
    if device != *home {
        let mut flat = vec![];
        let shapes = flatten_grads(fork, &mut result.grads, &mut flat);
        result.grads = unflatten_grads(fork, shapes, &mut Pieces(&flat), &B::inner_device(home));
        result.stats = result
            .stats
            .into_iter()
            .map(|s| s.into_device(home))
            .collect();
    }
    Ok(result)
}

/// Runs the forward and backward passes of `shards` on one worker thread
/// per entry of `devices` (autodiff devices; [`map_in_workers`] gives
/// worker `w` shards `w`, `w + workers`, ...), each on its own fork of the
/// model on its device: a fork has its own autodiff graph and the same
/// parameter ids, so the gradients line up. They are summed on the
/// model's device in shard order, which makes the result independent of
/// the number of workers (it depends on the shards only).
pub fn compute_gradients<B: TrainBackend>(
    model: &TransformerVq<B>,
    shards: Vec<Shard<B>>,
    plan: ShardPlan,
    devices: &[B::Device],
) -> Result<StepGradients<B>, TrainError> {
    let n = shards.len();
    let home = model.embedding.weight.device();
    let results = map_in_workers(
        shards.into_iter().enumerate().collect(),
        devices.len(),
        |w| fork_onto(model, &devices[w]),
        |fork, shard| run_shard(fork, shard, plan, &home),
    )?;
    let mut accumulator = GradientsAccumulator::<TransformerVq<B>>::new();
    let (mut ce_sum, mut commitment_sum) = (0f32, 0f32);
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
        ce_sum,
        commitment_sum,
        stats: stats.unwrap_or_default(),
        states,
    })
}

/// Moves the gradients out of `grads` onto the end of `flat`, parameter by
/// parameter in module order (the same on every node, whatever ids the
/// parameters got); returns which parameters had one, with their shapes.
pub(crate) fn flatten_grads<B: AutodiffBackend>(
    model: &TransformerVq<B>,
    grads: &mut GradientsParams,
    flat: &mut Vec<f32>,
) -> Vec<Option<Vec<usize>>> {
    struct Flatten<'a> {
        grads: &'a mut GradientsParams,
        flat: &'a mut Vec<f32>,
        shapes: Vec<Option<Vec<usize>>>,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Flatten<'_> {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<B, D>>) {
            let grad = self.grads.remove::<B::InnerBackend, D>(p.id);
            self.shapes.push(grad.as_ref().map(|g| g.dims().to_vec()));
            if let Some(g) = grad {
                self.flat.extend(host_values(&g));
            }
        }
    }
    let mut v = Flatten {
        grads,
        flat,
        shapes: vec![],
    };
    model.visit(&mut v);
    v.shapes
}

/// The gradients [`flatten_grads`] took, read back from `pieces` onto `device`.
fn unflatten_grads<B: AutodiffBackend>(
    model: &TransformerVq<B>,
    shapes: Vec<Option<Vec<usize>>>,
    pieces: &mut Pieces,
    device: &burn::tensor::Device<B::InnerBackend>,
) -> GradientsParams {
    struct Unflatten<'a, 'b, B: AutodiffBackend> {
        shapes: std::vec::IntoIter<Option<Vec<usize>>>,
        pieces: &'a mut Pieces<'b>,
        device: &'a burn::tensor::Device<B::InnerBackend>,
        grads: GradientsParams,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Unflatten<'_, '_, B> {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<B, D>>) {
            if let Some(Some(shape)) = self.shapes.next() {
                let values = self.pieces.take(shape.iter().product()).to_vec();
                let grad = Tensor::<B::InnerBackend, D>::from_data(
                    TensorData::new(values, shape),
                    self.device,
                );
                self.grads.register::<B::InnerBackend, D>(p.id, grad);
            }
        }
    }
    let mut v = Unflatten::<B> {
        shapes: shapes.into_iter(),
        pieces,
        device,
        grads: GradientsParams::new(),
    };
    model.visit(&mut v);
    v.grads
}

/// `grads` of `from`'s parameters, and the same values as gradients of
/// `to`'s (the same architecture, matched parameter by parameter in module
/// order) on `to`'s device: how `tvq check` gives two devices the same
/// gradients.
pub(crate) fn shared_grads<B: TrainBackend>(
    from: &TransformerVq<B>,
    mut grads: GradientsParams,
    to: &TransformerVq<B>,
) -> [GradientsParams; 2] {
    let mut flat = vec![];
    let shapes = flatten_grads(from, &mut grads, &mut flat);
    [from, to].map(|m| flat_grads(m, shapes.clone(), &flat))
}

/// The gradients [`flatten_grads`] took (`shapes`, `flat`) as gradients of
/// `model`'s parameters, matched in module order, on `model`'s device: how
/// one backend's gradients reach a trainer of another.
pub(crate) fn flat_grads<B: TrainBackend>(
    model: &TransformerVq<B>,
    shapes: Vec<Option<Vec<usize>>>,
    flat: &[f32],
) -> GradientsParams {
    let device = B::inner_device(&model.embedding.weight.device());
    unflatten_grads(model, shapes, &mut Pieces(flat), &device)
}

fn from_values<B: Backend, const D: usize>(
    values: &[f32],
    shape: [usize; D],
    device: &B::Device,
) -> Tensor<B, D> {
    Tensor::from_data(TensorData::new(values.to_vec(), shape), device)
}

/// Cuts a flat vector into consecutive pieces.
struct Pieces<'a>(&'a [f32]);

impl<'a> Pieces<'a> {
    fn take(&mut self, n: usize) -> &'a [f32] {
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        head
    }
}

impl<B: TrainBackend> StepGradients<B> {
    /// Adds every node's sums to this node's, in one collective call: the
    /// gradients (in module order), the codebook statistics, the losses
    /// and `extra` (values every node contributes, summed). Afterwards every
    /// node holds the same sums, so every node's AdamW and EMA steps agree.
    pub fn all_reduce(
        mut self,
        model: &TransformerVq<B>,
        extra: &[f32],
        collective: &Collective,
    ) -> Result<(Self, Vec<f32>), TrainError> {
        let mut flat = vec![];
        // Every node runs the same graph, so the same parameters have gradients.
        let shapes = flatten_grads(model, &mut self.grads, &mut flat);
        for s in &self.stats {
            for values in [
                host_values(&s.counts),
                host_values(&s.sums),
                host_values(&s.sq_error),
                host_values(&s.sq_norm),
            ] {
                flat.extend(values);
            }
        }
        flat.extend([self.ce_sum, self.commitment_sum]);
        flat.extend(extra);
        let summed = collective.all_reduce_sum(flat, "summing a step's gradients")?;

        let mut pieces = Pieces(&summed);
        let grad_device = B::inner_device(&model.embedding.weight.device());
        let grads = unflatten_grads(model, shapes, &mut pieces, &grad_device);
        let stats = self
            .stats
            .iter()
            .map(|s| {
                let device = s.counts.device();
                CodebookStats {
                    counts: from_values(
                        pieces.take(s.counts.shape().num_elements()),
                        s.counts.dims(),
                        &device,
                    ),
                    sums: from_values(
                        pieces.take(s.sums.shape().num_elements()),
                        s.sums.dims(),
                        &device,
                    ),
                    sq_error: from_values(pieces.take(1), [1], &device),
                    sq_norm: from_values(pieces.take(1), [1], &device),
                }
            })
            .collect();
        let [ce_sum, commitment_sum] = [pieces.take(1)[0], pieces.take(1)[0]];
        let extra = pieces.take(extra.len()).to_vec();
        self.grads = grads;
        self.stats = stats;
        self.ce_sum = ce_sum;
        self.commitment_sum = commitment_sum;
        Ok((self, extra))
    }
}
