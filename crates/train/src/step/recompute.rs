//! Full activation checkpointing: per-sublayer recomputation.
//!
//! The forward pass (the model's one sublayer loop under
//! [`tvq_model::Graph::LastSublayer`]) runs without an autodiff graph and keeps only each
//! sublayer's input `h_i` `[B, T, D]`. The backward pass then walks the
//! sublayers from the last to the first: sublayer `i` runs again from `h_i`
//! (a leaf that asks for its gradient) with the same dropout masks and
//! carried state, so it computes the same numbers, and its backward pass
//! starts from `g_{i+1}`, the gradient of the objective with respect to its
//! output: `sum(h_{i+1} ⊙ g_{i+1})` has exactly that gradient. The
//! sublayer's commitment term, which the loss reads directly, is added to
//! that objective. Only one sublayer's graph is alive at a time, so a step
//! keeps `N` hidden states plus one sublayer's activations, instead of every
//! sublayer's (the official code's per-layer remat, at the price of a second
//! forward pass through every sublayer but the last, whose graph is kept:
//! its backward pass comes first). The recomputed graph is itself kept
//! under burn's balanced checkpointing (the devices of `full` are those of
//! `selective`, [`crate::placement::autodiff_device`]), which takes a third off
//! the one sublayer's activations.
//!
//! The forward pass computes the same numbers as without recomputation, bit
//! for bit (losses, codebook statistics, carried state); the gradients agree
//! to rounding, since the gradient reaching a sublayer's input adds the
//! residual path and the recomputed graph in another order (tested in
//! [`crate::trainer`]).

use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::prelude::*;
use tvq_model::{DropoutMasks, Graph, Logits, Loss, ModelState, Pass, Recomputable};

use crate::error::TrainError;
use crate::placement::TrainBackend;
use crate::step::shard::{ShardPlan, ShardResult};
use tvq_model::TransformerVq;

/// The forward and backward passes of one shard (`inputs`, `targets` and
/// `valid` `[B, T]`, `None` where every token is real) from `state` with
/// dropout `masks`, recomputing each sublayer in the backward pass.
pub(crate) fn passes<B: TrainBackend>(
    model: &TransformerVq<B>,
    inputs: Tensor<B, 2, Int>,
    targets: Tensor<B, 2, Int>,
    valid: Option<Tensor<B, 2, Bool>>,
    state: ModelState<B>,
    masks: DropoutMasks<B>,
    plan: &ShardPlan,
) -> Result<ShardResult<B>, TrainError> {
    let forward = tracing::debug_span!("forward").entered();
    // 1: forward keeping only each sublayer's input, and the last
    // sublayer's graph, as its backward pass comes first (recomputing it
    // would save nothing).
    let pass = Pass::new()
        .with_masks(masks.clone())
        .with_graph(Graph::LastSublayer)
        .with_logits(Logits::None)
        .with_valid(valid.clone());
    let out = model.forward(inputs.clone(), state.clone(), pass)?;
    let Recomputable {
        inputs: kept,
        last_input: x,
        last_commitment,
    } = out.recomputable.expect("a model has sublayers");

    drop(forward);
    let _backward = tracing::debug_span!("backward").entered();
    // 2: the head and the loss through the last sublayer, every other
    // sublayer's commitment a constant (each adds its own term's gradient
    // below).
    let mut grads = GradientsAccumulator::<TransformerVq<B>>::new();
    let loss = Loss::from_parts(
        model.head(out.h),
        out.commitment,
        targets,
        valid.clone(),
        out.kernels,
    );
    let objective =
        plan.objective(&loss) + plan.commitment_objective(last_commitment, valid.clone());
    let mut g = backward(model, objective, &x, &mut grads); // [B, T, D]

    // 3: each other sublayer again, last to first, from its input.
    let layers = state.sublayers.into_iter().zip(masks.sublayers);
    for (i, ((s, m), x)) in layers.zip(kept).enumerate().rev() {
        let x = x.require_grad();
        let recompute = tracing::debug_span!("recompute", sublayer = i).entered();
        let pass = Pass::new()
            .with_masks(DropoutMasks { sublayers: vec![m] })
            .with_sublayers(i..i + 1)
            .with_logits(Logits::None)
            .with_valid(valid.clone());
        let one = ModelState { sublayers: vec![s] };
        let out = model.forward(x.clone(), one, pass)?;
        drop(recompute);
        let objective =
            (out.h * g).sum() + plan.commitment_objective(out.commitment, valid.clone());
        g = backward(model, objective, &x, &mut grads);
    }

    // 4: the embedding.
    let h0 = model.embedding.forward(inputs); // [B, T, D]
    let objective = (h0 * g).sum();
    grads.accumulate(
        model,
        GradientsParams::from_grads(objective.backward(), model),
    );
    Ok(ShardResult {
        grads: grads.grads(),
        ce: loss.ce.into_scalar().elem(),
        commitment: loss.commitment.into_scalar().elem(),
        stats: out.stats,
        state: out.state,
    })
}

/// Runs `objective`'s backward pass, adds the parameters' gradients to
/// `grads` and returns the gradient of the leaf `x` (on `x`'s device).
fn backward<B: TrainBackend>(
    model: &TransformerVq<B>,
    objective: Tensor<B, 1>,
    x: &Tensor<B, 3>,
    grads: &mut GradientsAccumulator<TransformerVq<B>>,
) -> Tensor<B, 3> {
    let mut all = objective.backward();
    let g = x
        .grad_remove(&mut all)
        .expect("the recomputed sublayer reads its input");
    grads.accumulate(model, GradientsParams::from_grads(all, model));
    Tensor::from_inner(g)
}

#[cfg(test)]
mod tests {
    use tvq_model::TransformerVqConfig;
    use tvq_testkit::tiny_model;

    use crate::config::TrainSection;
    use crate::placement::device::DeviceSpec;
    use crate::trainer::Trainer;
    use crate::trainer::tests::{batch, relative_gap, step_outcome};

    /// `selective` and `full` activation checkpointing compute what `none`
    /// does: losses, every gradient, the codebook statistics and the
    /// carried state, in every cache-gradient mode, with every dropout on
    /// (residual, layer, and the XL bias's sinusoid) and from a carried
    /// state. `selective` recomputes elementwise ops from the same inputs:
    /// bit for bit. `full` recomputes each sublayer with the same masks and
    /// state: its forward pass, hence the losses, statistics and state, are
    /// bit for bit; the gradients of the sublayers below the last and of
    /// the embedding reach their input as the sum of the residual path and
    /// the recomputed graph, added in another order, so they agree to
    /// rounding (within 1e-6 of each parameter's largest gradient; measured
    /// up to 8e-8 on this model).
    #[test]
    fn every_activation_checkpointing_mode_computes_the_same_step() {
        use crate::config::ActivationCheckpointing;
        use tvq_model::{CacheGrad, RelativeBias};
        for (cache_grad, bias) in [
            (CacheGrad::Window, RelativeBias::Toeplitz),
            (CacheGrad::None, RelativeBias::Xl),
            (CacheGrad::Full, RelativeBias::Xl),
        ] {
            let model = TransformerVqConfig {
                cache_grad,
                bias,
                n_layer: 2,
                dropout_residual: 0.2,
                dropout_layer: 0.2,
                dropout_sinusoid: 0.2,
                ..tiny_model(11)
            };
            let run = |mode| {
                let settings = TrainSection {
                    activation_checkpointing: mode,
                    lr: 1e-2,
                    warmup_steps: 0,
                    ..TrainSection::default()
                };
                let device = DeviceSpec::Cpu.init().unwrap().0;
                let mut t = Trainer::new(&model, &settings, &[device]).unwrap();
                // The passes of one segment (the model is not updated),
                // then those of the next from the carried state.
                t.gradients(&batch(2, 8, true)).unwrap();
                step_outcome(&mut t, &batch(2, 8, false))
            };
            let none = run(ActivationCheckpointing::None);
            assert!(none.1.iter().flatten().any(|&g| g != 0.0));
            for mode in [
                ActivationCheckpointing::Selective,
                ActivationCheckpointing::Full,
            ] {
                let got = run(mode);
                assert_eq!(got.0, none.0, "{mode} losses, {cache_grad:?}");
                if mode == ActivationCheckpointing::Selective {
                    assert_eq!(got.1, none.1, "{mode} gradients, {cache_grad:?}");
                }
                assert_eq!(got.1.len(), none.1.len());
                for (i, (a, b)) in got.1.iter().zip(&none.1).enumerate() {
                    let gap = relative_gap(a, b);
                    assert!(
                        gap <= 1e-6,
                        "{mode} gradient of parameter {i}, {cache_grad:?}: off by {gap} of the largest value"
                    );
                }
                assert_eq!(got.2, none.2, "{mode} codebook statistics, {cache_grad:?}");
                assert_eq!(got.3, none.3, "{mode} carried state, {cache_grad:?}");
            }
        }
    }
}
