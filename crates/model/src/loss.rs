//! The language-model objective: cross-entropy plus weighted commitment.
//! Training, evaluation and the benchmark all compute it here.

use burn::prelude::*;
use burn::tensor::activation::log_softmax;

use crate::model::ModelOutput;
use crate::quantizer::bool_to_float;

/// Per-token negative log-likelihood in nats, `[B, T]`, of `targets` `[B, T]`
/// under `logits` `[B, T, vocab]`.
pub fn token_nll<B: Backend>(logits: Tensor<B, 3>, targets: Tensor<B, 2, Int>) -> Tensor<B, 2> {
    let [b, t, _] = logits.dims();
    let logp = log_softmax(logits, 2);
    logp.gather(2, targets.reshape([b, t, 1]))
        .reshape([b, t])
        .neg()
}

/// The sum and the mean of `x` `[B, T]` over the tokens `valid` marks (all
/// when `None`), `[1]` each.
fn sum_and_mean<B: Backend>(
    x: Tensor<B, 2>,
    valid: Option<Tensor<B, 2, Bool>>,
) -> (Tensor<B, 1>, Tensor<B, 1>) {
    match valid {
        None => {
            let n = x.dims().iter().product::<usize>() as f64;
            let sum = x.sum();
            (sum.clone(), sum / n)
        }
        Some(valid) => {
            let w = bool_to_float(valid, &x.device()); // [B, T]
            let count = w.clone().sum().clamp_min(1.0); // [1]
            let sum = (x * w).sum();
            (sum.clone(), sum / count)
        }
    }
}

/// The loss of one pass over `[B, T]` tokens, in its parts. Means are over
/// the valid tokens; the official code divides by all `B T` positions
/// instead, which agrees when nothing is padded.
#[derive(Clone, Debug)]
pub struct Loss<B: Backend> {
    /// Cross-entropy of every token, nats, `[B, T]` (padding included).
    pub nll: Tensor<B, 2>,
    /// Cross-entropy summed over the valid tokens, nats, `[1]`.
    pub nll_sum: Tensor<B, 1>,
    /// Mean cross-entropy per valid token, nats, `[1]`.
    pub ce: Tensor<B, 1>,
    /// Mean commitment error per valid token (summed over sublayers), `[1]`.
    pub commitment: Tensor<B, 1>,
}

impl<B: Backend> Loss<B> {
    /// The loss of `output` against `targets` `[B, T]`; `valid` `[B, T]`
    /// marks the tokens that count (all when `None`).
    pub fn new(
        output: &ModelOutput<B>,
        targets: Tensor<B, 2, Int>,
        valid: Option<Tensor<B, 2, Bool>>,
    ) -> Self {
        Self::from_parts(
            output.logits.clone(),
            output.commitment.clone(),
            targets,
            valid,
        )
    }

    /// The loss of `logits` `[B, T, vocab]` and per-token commitment `[B, T]`
    /// against `targets` `[B, T]` ([`Self::new`] from the parts of a
    /// [`ModelOutput`]).
    pub fn from_parts(
        logits: Tensor<B, 3>,
        commitment: Tensor<B, 2>,
        targets: Tensor<B, 2, Int>,
        valid: Option<Tensor<B, 2, Bool>>,
    ) -> Self {
        let nll = token_nll(logits, targets); // [B, T]
        let (nll_sum, ce) = sum_and_mean(nll.clone(), valid.clone());
        Self {
            ce,
            commitment: Self::commitment_mean(commitment, valid),
            nll_sum,
            nll,
        }
    }

    /// The mean commitment per valid token, `[1]`, of per-token commitment
    /// `[B, T]` (one sublayer's, or all of them summed): [`Self::commitment`]
    /// of one part, for training that adds the parts' gradients one sublayer
    /// at a time.
    pub fn commitment_mean(
        commitment: Tensor<B, 2>,
        valid: Option<Tensor<B, 2, Bool>>,
    ) -> Tensor<B, 1> {
        sum_and_mean(commitment, valid).1
    }

    /// `ce + commit_weight * commitment`: what training minimises, `[1]`.
    pub fn total(&self, commit_weight: f64) -> Tensor<B, 1> {
        self.ce.clone() + self.commitment.clone() * commit_weight
    }
}
