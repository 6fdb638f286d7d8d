//! The language-model objective: cross-entropy plus weighted commitment.
//! Training, evaluation and the benchmark all compute it here.

use burn::prelude::*;
use burn::tensor::activation::log_softmax;

use crate::kernel::{Kernels, VqBackend};
use crate::model::ModelOutput;
use crate::ops::total;
use crate::quantizer::bool_to_float;

/// The padding token. A target of it is never scored: the official code's
/// `loss_mask = (targets != PAD)`, which also lets a recall task score only
/// its answers (every other target is `PAD`).
pub const PAD: i64 = 0;

/// Per-token negative log-likelihood in nats, `[B, T]`, of `targets` `[B, T]`
/// under `logits` `[B, T, vocab]`; under [`Kernels::Fused`], with the
/// backend's own backward step where it has one
/// ([`VqBackend::vq_token_nll`]).
pub fn token_nll<B: VqBackend>(
    logits: Tensor<B, 3>,
    targets: Tensor<B, 2, Int>,
    kernels: Kernels,
) -> Tensor<B, 2> {
    let own = match kernels {
        Kernels::Fused => B::vq_token_nll(logits.clone(), targets.clone()),
        Kernels::Composed => None,
    };
    own.unwrap_or_else(|| {
        let [b, t, _] = logits.dims();
        let logp = log_softmax(logits, 2);
        logp.gather(2, targets.reshape([b, t, 1]))
            .reshape([b, t])
            .neg()
    })
}

/// The sum and the mean of `x` `[B, T]` over the tokens `marked` marks
/// with 1 (`[B, T]`, 0 elsewhere; all when `None`), `[1]` each.
fn sum_and_mean<B: Backend>(
    x: Tensor<B, 2>,
    marked: Option<Tensor<B, 2>>,
) -> (Tensor<B, 1>, Tensor<B, 1>) {
    let n = x.dims().iter().product::<usize>();
    match marked {
        None => {
            let sum = total(x);
            (sum.clone(), sum / n as f64)
        }
        Some(w) => {
            let count = total(w.clone()).clamp_min(1.0); // [1]
            let sum = total(x * w);
            (sum.clone(), sum / count)
        }
    }
}

/// The loss of one pass over `[B, T]` tokens, in its parts. The
/// cross-entropy's mean is over the scored tokens (valid, target not
/// [`PAD`]), the commitment's over the valid ones; the official code
/// divides both by all `B T` positions instead, which agrees when nothing
/// is padded.
#[derive(Clone, Debug)]
pub struct Loss<B: Backend> {
    /// Cross-entropy of every token, nats, `[B, T]` (padding included).
    pub nll: Tensor<B, 2>,
    /// Cross-entropy summed over the scored tokens, nats, `[1]`.
    pub nll_sum: Tensor<B, 1>,
    /// Mean cross-entropy per scored token, nats, `[1]` (0 where none is).
    pub ce: Tensor<B, 1>,
    /// Which tokens are scored, `[B, T]`: 1 where so, 0 elsewhere.
    pub scored: Tensor<B, 2>,
    /// Mean commitment error per valid token (summed over sublayers), `[1]`.
    pub commitment: Tensor<B, 1>,
}

impl<B: VqBackend> Loss<B> {
    /// The loss of `output` against `targets` `[B, T]`; `valid` `[B, T]`
    /// marks the real tokens (all when `None`), of which those whose target
    /// is not [`PAD`] are scored.
    ///
    /// # Panics
    ///
    /// If `output` has no logits: its pass must compute every position's
    /// ([`crate::Logits::All`], the default).
    pub fn new(
        output: &ModelOutput<B>,
        targets: Tensor<B, 2, Int>,
        valid: Option<Tensor<B, 2, Bool>>,
    ) -> Self {
        let logits = output.logits.clone();
        Self::from_parts(
            logits.expect("the loss reads every position's logits"),
            output.commitment.clone(),
            targets,
            valid,
            output.kernels,
        )
    }

    /// The loss of `logits` `[B, T, vocab]` and per-token commitment `[B, T]`
    /// against `targets` `[B, T]` ([`Self::new`] from the parts of a
    /// [`ModelOutput`], `kernels` its pass's).
    pub fn from_parts(
        logits: Tensor<B, 3>,
        commitment: Tensor<B, 2>,
        targets: Tensor<B, 2, Int>,
        valid: Option<Tensor<B, 2, Bool>>,
        kernels: Kernels,
    ) -> Self {
        let device = logits.device();
        // 1 where scored, 0 elsewhere `[B, T]`: a mask and a fill that burn's
        // fusion takes into one kernel (boolean `not` and `and` are not).
        let pad = targets.clone().equal_elem(PAD);
        let scored = match valid.clone() {
            Some(valid) => bool_to_float(valid, &device),
            None => Tensor::ones(targets.dims(), &device),
        }
        .mask_fill(pad, 0.0);
        let nll = token_nll(logits, targets, kernels); // [B, T]
        let (nll_sum, ce) = sum_and_mean(nll.clone(), Some(scored.clone()));
        Self {
            ce,
            scored,
            commitment: Self::commitment_mean(commitment, valid),
            nll_sum,
            nll,
        }
    }
}

impl<B: Backend> Loss<B> {
    /// The mean commitment per valid token, `[1]`, of per-token commitment
    /// `[B, T]` (one sublayer's, or all of them summed): [`Self::commitment`]
    /// of one part, for training that adds the parts' gradients one sublayer
    /// at a time.
    pub fn commitment_mean(
        commitment: Tensor<B, 2>,
        valid: Option<Tensor<B, 2, Bool>>,
    ) -> Tensor<B, 1> {
        let valid = valid.map(|v| bool_to_float(v, &commitment.device()));
        sum_and_mean(commitment, valid).1
    }

    /// `ce + commit_weight * commitment`: what training minimises, `[1]`.
    pub fn total(&self, commit_weight: f64) -> Tensor<B, 1> {
        self.ce.clone() + self.commitment.clone() * commit_weight
    }

    /// The cross-entropy with every row weighed alike, `[1]`: the mean over
    /// the rows of each row's mean over its scored tokens (0 for a row with
    /// none). Where every row has as many scored tokens, it is
    /// [`Self::ce`]; where one row is scored on 5 answers and another on 256
    /// text tokens, the 5 weigh as much as the 256. As a mean over rows, it
    /// is the same whichever shards the rows are cut into.
    pub fn ce_per_row(&self) -> Tensor<B, 1> {
        let count = self.scored.clone().sum_dim(1).clamp_min(1.0); // [B, 1]
        let sum = (self.nll.clone() * self.scored.clone()).sum_dim(1); // [B, 1]
        (sum / count).mean()
    }
}

#[cfg(test)]
mod tests {
    use burn::backend::flex::FlexDevice;
    use burn::{Dispatch, DispatchDevice};

    use super::*;

    /// Logits `[R, 4, 5]` sure of token `sure[r][t]` at each position of
    /// each row.
    fn sure_of_rows<const R: usize>(
        sure: [[i64; 4]; R],
        device: &DispatchDevice,
    ) -> Tensor<Dispatch, 3> {
        let mut logits = vec![0.0f32; R * 4 * 5];
        for (i, &s) in sure.iter().flatten().enumerate() {
            logits[i * 5 + s as usize] = 100.0;
        }
        Tensor::from_data(TensorData::new(logits, [R, 4, 5]), device)
    }

    /// Logits `[1, 4, 5]` sure of token `sure[t]` at each position.
    fn sure_of(sure: [i64; 4], device: &DispatchDevice) -> Tensor<Dispatch, 3> {
        sure_of_rows([sure], device)
    }

    #[test]
    fn only_targets_that_are_not_pad_are_scored() {
        let device = DispatchDevice::Flex(FlexDevice);
        let commitment = Tensor::<Dispatch, 2>::from_data([[1.0, 2.0, 3.0, 4.0]], &device);
        // A recall example: the answers are at positions 1 and 3; the rest
        // are PAD. A model that copies the answers, and is wrong (sure of
        // token 4) everywhere else, loses nothing.
        let targets = Tensor::<Dispatch, 2, Int>::from_data([[0, 2, 0, 3]], &device);
        let copies = sure_of([4, 2, 4, 3], &device);
        let loss = Loss::from_parts(
            copies,
            commitment.clone(),
            targets.clone(),
            None,
            Kernels::Fused,
        );
        assert!(loss.ce.into_scalar().elem::<f32>() < 1e-6);
        // Wrong on one answer: its loss, over the two answers.
        let wrong = sure_of([4, 2, 4, 1], &device);
        let loss = Loss::from_parts(
            wrong,
            commitment.clone(),
            targets.clone(),
            None,
            Kernels::Fused,
        );
        let ce = loss.ce.into_scalar().elem::<f32>();
        assert!((ce - 50.0).abs() < 1e-3, "{ce}");
        // Commitment counts every valid token, answer or not; an invalid
        // answer is not scored.
        assert!((loss.commitment.into_scalar().elem::<f32>() - 2.5).abs() < 1e-6);
        let valid = Tensor::<Dispatch, 2, Bool>::from_data([[true, true, true, false]], &device);
        let wrong = sure_of([4, 2, 4, 1], &device);
        let loss = Loss::from_parts(wrong, commitment, targets, Some(valid), Kernels::Fused);
        assert!(loss.ce.into_scalar().elem::<f32>() < 1e-6);
        assert!((loss.commitment.into_scalar().elem::<f32>() - 2.0).abs() < 1e-6);
    }

    #[test]
    fn per_row_every_row_weighs_alike() {
        let device = DispatchDevice::Flex(FlexDevice);
        let commitment = Tensor::<Dispatch, 2>::zeros([3, 4], &device);
        // Row 0: one answer (position 1), wrong by 100 nats. Row 1: four
        // text targets, all right. Row 2: nothing scored.
        let targets =
            Tensor::<Dispatch, 2, Int>::from_data([[0, 2, 0, 0], [1, 1, 1, 1], [0; 4]], &device);
        let logits = sure_of_rows([[4, 1, 4, 4], [1, 1, 1, 1], [4; 4]], &device);
        let loss = Loss::from_parts(logits, commitment, targets, None, Kernels::Fused);
        // Per token, the answer is one of five scored targets.
        let ce = loss.ce.clone().into_scalar().elem::<f32>();
        assert!((ce - 20.0).abs() < 1e-3, "{ce}");
        // Per row, it is all of one row of three.
        let per_row = loss.ce_per_row().into_scalar().elem::<f32>();
        assert!((per_row - 100.0 / 3.0).abs() < 1e-3, "{per_row}");
    }
}
