//! Vector quantizer with an EMA codebook (one codebook per head).
//!
//! The codebook is `C = c_sum / max(c_count, 0.01)`. Both tensors are module
//! parameters so they are saved with the model, but they never require
//! gradient: the trainer folds each step's [`CodebookStats`] into them with
//! [`VectorQuantizer::ema_update`].

use burn::module::{Module, Param};
use burn::prelude::*;
use burn::tensor::ops::PadMode;
use burn::tensor::{Distribution, IndexingUpdateOp, TensorPrimitive};

use crate::device::to_device_via_host;
use crate::kernel::{self, Kernels, VqBackend};
use crate::ops::total;

/// Floor on `c_count` when dividing, as in the official code.
const MIN_COUNT: f64 = 0.01;

/// EMA codebook of one GAU sublayer.
#[derive(Module, Debug)]
pub struct VectorQuantizer<B: Backend> {
    /// Decayed sum of the keys assigned to each code, `[H, S, K]`.
    pub c_sum: Param<Tensor<B, 3>>,
    /// Decayed number of keys assigned to each code, `[H, S]`.
    pub c_count: Param<Tensor<B, 2>>,
}

/// Keys after quantization, with what the losses and the EMA need.
#[derive(Clone, Debug)]
pub struct Quantized<B: Backend> {
    /// Straight-through keys `k + sg(C_z - k)`: the value is the codeword, the
    /// gradient is the identity into `k`. `[B, H, T, K]`.
    pub k_hat: Tensor<B, 4>,
    /// Codes `z = argmin_s |k - C_s|^2`, ties to the lowest index. `[B, H, T]`.
    pub codes: Tensor<B, 3, Int>,
    /// Commitment error per token, `sum_h |k - sg(C_z)|^2`; carries gradient into `k`. `[B, T]`.
    pub commitment: Tensor<B, 2>,
    /// The codebook the keys were quantized against (detached), `[H, S,
    /// K]`: the attention's, computed once.
    pub codebook: Tensor<B, 3>,
    /// Code statistics of the valid tokens (no gradient).
    pub stats: CodebookStats<B>,
}

/// Per-step code statistics of one sublayer over the valid tokens, summed
/// over batch rows (and shards of a batch with [`CodebookStats::merge`]).
#[derive(Clone, Debug)]
pub struct CodebookStats<B: Backend> {
    /// Tokens assigned to each code, `[H, S]`.
    pub counts: Tensor<B, 2>,
    /// Sum of the (pre-quantization) keys assigned to each code, `[H, S, K]`.
    pub sums: Tensor<B, 3>,
    /// `sum |k - C_z|^2` over tokens and heads, `[1]`.
    pub sq_error: Tensor<B, 1>,
    /// `sum |k|^2` over tokens and heads, `[1]`.
    pub sq_norm: Tensor<B, 1>,
}

/// Host-side summary of [`CodebookStats`] for logging.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CodebookMetrics {
    /// Fraction of the `H * S` codes that received at least one token.
    pub usage: f64,
    /// `exp(entropy)` of the code distribution, averaged over heads.
    pub perplexity: f64,
    /// Relative quantization error `|k - k_hat| / |k|` over all tokens.
    pub relative_error: f64,
}

/// A 0/1 float tensor from a boolean one, on the float `device`. On an
/// autodiff device the result is an (untracked) autodiff tensor, so it can be
/// mixed with activations; `Bool::float()` would not be.
pub(crate) fn bool_to_float<B: Backend, const D: usize>(
    mask: Tensor<B, D, Bool>,
    device: &B::Device,
) -> Tensor<B, D> {
    Tensor::zeros(mask.shape(), device).mask_fill(mask, 1.0)
}

/// How many tokens carry each code, and the sum of their `values`, within
/// each of `G` groups, by scatter-add (a one-hot matmul would cost `S` times
/// more). `codes` `[G, N]` with values in `0..=n_code`, where `n_code` marks
/// an empty slot that counts nowhere; `weight` `[G, N]` scales each token
/// (e.g. 0 for padding); `values` `[G, N, W]`. Returns the counts `[G, S]`
/// and sums `[G, S, W]`; gradient flows into `values`. `by_group`: as
/// scatters within each group ([`totals_by_group`]), the form for backends
/// whose `select_assign` loops over every index in one thread per column
/// ([`VqBackend::vq_totals_by_group`]); the same totals up to the order of
/// the additions.
pub(crate) fn code_totals<B: Backend>(
    codes: Tensor<B, 2, Int>,
    weight: Option<Tensor<B, 2>>,
    values: Tensor<B, 3>,
    n_code: usize,
    by_group: bool,
) -> (Tensor<B, 2>, Tensor<B, 3>) {
    let [g, n, w] = values.dims();
    let device = values.device();
    let s = n_code;
    let mut keep = bool_to_float(codes.clone().lower_elem(s as i64), &device); // [G, N]
    if let Some(weight) = weight {
        keep = keep * weight;
    }
    if by_group {
        return totals_by_group(codes.clamp_max(s as i64 - 1), keep, values, s);
    }
    // Row of each token in the flattened [G S] table; an empty slot goes to
    // code S - 1 of its group with weight 0.
    let group = Tensor::<B, 1, Int>::arange_step(0..(g * s) as i64, s, &device).reshape([g, 1]);
    let row = (codes.clamp_max(s as i64 - 1) + group).reshape([g * n]);
    let counts = Tensor::<B, 1>::zeros([g * s], &device)
        .select_assign(
            0,
            row.clone(),
            keep.clone().reshape([g * n]),
            IndexingUpdateOp::Add,
        )
        .reshape([g, s]);
    let weighted = (values * keep.unsqueeze_dim::<3>(2)).reshape([g * n, w]);
    let sums = Tensor::<B, 2>::zeros([g * s, w], &device)
        .select_assign(0, row, weighted, IndexingUpdateOp::Add)
        .reshape([g, s, w]);
    (counts, sums)
}

/// [`code_totals`] as scatters along each group's tokens, in chunks of at
/// most `S` tokens: `codes` `[G, N]` in `0..S`, `keep` `[G, N]` each token's
/// weight, `values` `[G, N, W]`. On the GPU backends burn's `select_assign`
/// gives each output column one thread that loops over all `G N` tokens
/// (the counts: a single thread), a scatter along the tokens one thread
/// per group, chunk and column; chunks of `S` bound each thread's loop and
/// keep the chunks' partial totals no larger than the values.
fn totals_by_group<B: Backend>(
    codes: Tensor<B, 2, Int>,
    keep: Tensor<B, 2>,
    values: Tensor<B, 3>,
    s: usize,
) -> (Tensor<B, 2>, Tensor<B, 3>) {
    let [g, n, w] = values.dims();
    let device = values.device();
    let chunk = n.clamp(1, s);
    let c = n.div_ceil(chunk); // chunks per group
    let mut weighted = values * keep.clone().unsqueeze_dim::<3>(2); // [G, N, W]
    let (mut codes, mut keep) = (codes, keep);
    let pad = c * chunk - n;
    if pad > 0 {
        // Padding tokens carry code 0 with weight 0: they add nothing.
        let zeros = PadMode::Constant(0.0);
        codes = codes.pad([(0, pad)], zeros);
        keep = keep.pad([(0, pad)], zeros);
        weighted = weighted.pad([(0, pad), (0, 0)], zeros);
    }
    let codes = codes.reshape([g * c, chunk]); // [G c, chunk]
    let counts = Tensor::<B, 2>::zeros([g * c, s], &device).scatter(
        1,
        codes.clone(),
        keep.reshape([g * c, chunk]),
        IndexingUpdateOp::Add,
    ); // [G c, S]
    let sums = Tensor::<B, 3>::zeros([g * c, s, w], &device).scatter(
        1,
        codes.unsqueeze_dim::<3>(2).expand([g * c, chunk, w]),
        weighted.reshape([g * c, chunk, w]),
        IndexingUpdateOp::Add,
    ); // [G c, S, W]
    if c == 1 {
        return (counts, sums);
    }
    (
        counts.reshape([g, c, s]).sum_dim(1).reshape([g, s]),
        sums.reshape([g, c, s, w]).sum_dim(1).reshape([g, s, w]),
    )
}

/// [`code_totals`] with row `o` of the result totalling groups `o, o +
/// rows, o + 2 rows, ...` (`rows` divides `G`), as the backend's fused
/// kernel under [`Kernels::Fused`] where it has one: the kernel passes no
/// gradient on, so `values` that carry one need [`Kernels::Composed`].
/// Returns the counts `[rows, S]` and sums `[rows, S, W]`.
pub(crate) fn code_totals_with<B: VqBackend>(
    codes: Tensor<B, 2, Int>,
    weight: Option<Tensor<B, 2>>,
    values: Tensor<B, 3>,
    n_code: usize,
    rows: usize,
    kernels: Kernels,
) -> (Tensor<B, 2>, Tensor<B, 3>) {
    let [g, _, w] = values.dims();
    let fused = (kernels == Kernels::Fused)
        .then(|| {
            B::vq_code_totals(
                codes.clone().into_primitive(),
                weight.clone().map(|w| w.into_primitive().tensor()),
                values.clone().into_primitive().tensor(),
                n_code,
                rows,
            )
        })
        .flatten();
    if let Some(t) = fused {
        let float = |x| TensorPrimitive::Float(x);
        return (
            Tensor::from_primitive(float(t.counts)),
            Tensor::from_primitive(float(t.sums)),
        );
    }
    let by_group = B::vq_totals_by_group(&values.device());
    let (counts, sums) = code_totals(codes, weight, values, n_code, by_group);
    if rows == g {
        return (counts, sums);
    }
    (
        counts
            .reshape([g / rows, rows, n_code])
            .sum_dim(0)
            .reshape([rows, n_code]),
        sums.reshape([g / rows, rows, n_code, w])
            .sum_dim(0)
            .reshape([rows, n_code, w]),
    )
}

/// Each key's nearest codeword by composed ops: `kd` `[B, H, T, K]`
/// (detached) against `codebook` `[H, S, K]`; the codes `[B, H, T]` (ties
/// to the lowest index) and their codewords `[B, H, T, K]`. Ranked by
/// `|C_s|^2 - 2 k . C_s`, `|k - C_s|^2` up to the per-key constant `|k|^2`,
/// as the official code ranks them.
fn nearest_composed<B: Backend>(
    kd: &Tensor<B, 4>,
    codebook: &Tensor<B, 3>,
) -> (Tensor<B, 3, Int>, Tensor<B, 4>) {
    let [b, h, t, d_k] = kd.dims();
    let s = codebook.dims()[1];
    let device = kd.device();
    // As C k^T, then transposed. Computed as k C^T followed by
    // `* -2 + |C|^2`, the distances of one token (the recurrent form)
    // came out wrong on wgpu at H = 2, S = 16 (burn 0.21's fused
    // kernels on lavapipe, each operand right when read alone; `tvq
    // check` found it). The same dot products either way.
    let cross = codebook
        .clone()
        .unsqueeze_dim::<4>(0)
        .matmul(kd.clone().swap_dims(2, 3)) // [B, H, S, T]
        .swap_dims(2, 3); // [B, H, T, S]
    let c_sq = codebook.clone().square().sum_dim(2).reshape([1, h, 1, s]); // [1, H, 1, S]
    let dist = cross * -2.0 + c_sq; // [B, H, T, S]
    let codes = dist.argmin(3).reshape([b, h, t]); // [B, H, T]

    // Gather C_z per head from the flattened [H*S, K] codebook.
    let offsets =
        Tensor::<B, 1, Int>::arange_step(0..(h * s) as i64, s, &device).reshape([1, h, 1]);
    let flat_idx = (codes.clone() + offsets).reshape([b * h * t]);
    let c_z = codebook
        .clone()
        .reshape([h * s, d_k])
        .select(0, flat_idx)
        .reshape([b, h, t, d_k]); // [B, H, T, K], constant
    (codes, c_z)
}

impl<B: Backend> VectorQuantizer<B> {
    /// A codebook with `c_sum ~ N(0, 1/(S H))` and `c_count = 1`.
    pub fn new(n_head: usize, n_code: usize, d_k: usize, device: &B::Device) -> Self {
        let std = 1.0 / ((n_code * n_head) as f64).sqrt();
        let c_sum = Tensor::random(
            [n_head, n_code, d_k],
            Distribution::Normal(0.0, std),
            device,
        );
        Self {
            c_sum: Param::from_tensor(c_sum).set_require_grad(false),
            c_count: Param::from_tensor(Tensor::ones([n_head, n_code], device))
                .set_require_grad(false),
        }
    }

    /// Codebook size `S`.
    pub fn n_code(&self) -> usize {
        self.c_count.dims()[1]
    }

    /// The codebook `C = c_sum / max(c_count, 0.01)`, detached. `[H, S, K]`.
    pub fn codebook(&self) -> Tensor<B, 3> {
        // Shaped before the floor: burn's fusion then takes the floor and
        // the division into one kernel.
        let count = self.c_count.val().detach().unsqueeze_dim::<3>(2); // [H, S, 1]
        self.c_sum.val().detach() / count.clamp_min(MIN_COUNT)
    }

    /// Quantizes keys `k` `[B, H, T, K]`; `valid` `[B, T]` marks the tokens
    /// that count towards the statistics (all when `None`). Under
    /// [`Kernels::Fused`], the distances, codes and codewords come from
    /// the backend's fused kernel where it has one.
    pub fn quantize(
        &self,
        k: Tensor<B, 4>,
        valid: Option<Tensor<B, 2, Bool>>,
        kernels: Kernels,
    ) -> Quantized<B>
    where
        B: VqBackend,
    {
        let [b, h, t, d_k] = k.dims();
        let device = k.device();
        let codebook = self.codebook(); // [H, S, K]
        let s = codebook.dims()[1];
        let kd = k.clone().detach();

        let fused = (kernels == Kernels::Fused
            && kernel::quantizer::covers(d_k)
            && kd.dtype() == codebook.dtype())
        .then(|| {
            B::vq_quantize(
                kd.clone()
                    .reshape([b * h, t, d_k])
                    .into_primitive()
                    .tensor(),
                codebook.clone().into_primitive().tensor(),
            )
        })
        .flatten();
        let (codes, c_z, squares) = match fused {
            Some(n) => {
                let float = |x| Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(x));
                let words = Tensor::<B, 3>::from_primitive(TensorPrimitive::Float(n.words));
                let per_key = |x| float(x).reshape([b, h, t, 1]);
                (
                    Tensor::<B, 2, Int>::from_primitive(n.codes).reshape([b, h, t]),
                    words.reshape([b, h, t, d_k]),
                    Some((per_key(n.error), per_key(n.norm))),
                )
            }
            None => {
                let (codes, c_z) = nearest_composed(&kd, &codebook);
                (codes, c_z, None)
            }
        };

        // The straight-through estimator: `c_z` forward, `k`'s gradient back.
        let own = match kernels {
            Kernels::Fused => B::vq_straight_through(k.clone(), c_z.clone()),
            Kernels::Composed => None,
        };
        let k_hat = own.unwrap_or_else(|| k.clone() + (c_z.clone() - k.clone()).detach());
        // Each key's squared error and squared norm `[B, H, T, 1]` (no
        // gradient): the kernel's where it ran, else composed, the errors
        // then with gradient for the commitment.
        let (sq_err, sq_norm, err) = match squares {
            Some((sq_err, sq_norm)) => (sq_err, sq_norm, None),
            None => {
                let err = (k.clone() - c_z.clone()).square().sum_dim(3);
                let sq_norm = kd.clone().square().sum_dim(3);
                (err.clone().detach(), sq_norm, Some(err))
            }
        };
        let own = match kernels {
            Kernels::Fused => B::vq_commitment(k.clone(), c_z.clone(), sq_err.clone()),
            Kernels::Composed => None,
        };
        let commitment = own.unwrap_or_else(|| {
            kernel::sum_over_heads(err.unwrap_or_else(|| (k - c_z).square().sum_dim(3)))
        }); // [B, T]

        // Statistics over valid tokens only (no gradient).
        let weight = valid.map(|valid| bool_to_float(valid, &device)); // [B, T]
        let (counts, sums) = code_totals_with(
            codes.clone().reshape([b * h, t]),
            weight.clone().map(|w| {
                w.unsqueeze_dim::<3>(1)
                    .expand([b, h, t])
                    .reshape([b * h, t])
            }),
            kd.reshape([b * h, t, d_k]),
            s,
            h,
            kernels,
        ); // [H, S], [H, S, K]: summed over the batch
        let weighed_total = |x: Tensor<B, 4>| match &weight {
            Some(w) => total(x * w.clone().reshape([b, 1, t, 1])),
            None => total(x),
        };
        let (sq_error, sq_norm) = (weighed_total(sq_err), weighed_total(sq_norm));

        Quantized {
            k_hat,
            codes,
            commitment,
            codebook,
            stats: CodebookStats {
                counts,
                sums,
                sq_error,
                sq_norm,
            },
        }
    }

    /// One EMA step from a step's statistics, `gamma` the decay (0.99):
    /// `c_sum <- gamma c_sum + (1 - gamma) sums`, likewise `c_count`.
    /// Parameter ids are kept, so optimizer state stays attached.
    pub fn ema_update(self, stats: &CodebookStats<B>, gamma: f64) -> Self {
        let c_sum = self.c_sum.val().detach() * gamma + stats.sums.clone().detach() * (1.0 - gamma);
        let c_count =
            self.c_count.val().detach() * gamma + stats.counts.clone().detach() * (1.0 - gamma);
        Self {
            c_sum: Param::initialized(self.c_sum.id, c_sum).set_require_grad(false),
            c_count: Param::initialized(self.c_count.id, c_count).set_require_grad(false),
        }
    }
}

impl<B: Backend> CodebookStats<B> {
    /// Sum of two statistics (e.g. of two shards of one step).
    pub fn merge(self, other: Self) -> Self {
        Self {
            counts: self.counts + other.counts,
            sums: self.sums + other.sums,
            sq_error: self.sq_error + other.sq_error,
            sq_norm: self.sq_norm + other.sq_norm,
        }
    }

    /// The same statistics on `device` (to sum those of several devices),
    /// copied through the host where they move.
    pub fn into_device(self, device: &B::Device) -> Self {
        Self {
            counts: to_device_via_host(self.counts, device),
            sums: to_device_via_host(self.sums, device),
            sq_error: to_device_via_host(self.sq_error, device),
            sq_norm: to_device_via_host(self.sq_norm, device),
        }
    }

    /// Codebook usage, code perplexity and relative quantization error (reads
    /// the statistics back to the host).
    pub fn metrics(&self) -> CodebookMetrics {
        let [h, s] = self.counts.dims();
        let counts: Vec<f32> = self
            .counts
            .to_data()
            .convert::<f32>()
            .to_vec()
            .unwrap_or_default();
        let used = counts.iter().filter(|&&c| c > 0.0).count();
        let mut perplexity = 0.0;
        for head in counts.chunks(s) {
            let total: f64 = head.iter().map(|&c| c as f64).sum();
            let entropy: f64 = head
                .iter()
                .filter(|&&c| c > 0.0)
                .map(|&c| {
                    let p = c as f64 / total;
                    -p * p.ln()
                })
                .sum();
            perplexity += entropy.exp() / h as f64;
        }
        let scalar = |t: &Tensor<B, 1>| t.to_data().convert::<f64>().to_vec::<f64>().unwrap()[0];
        let (err, norm) = (scalar(&self.sq_error), scalar(&self.sq_norm));
        CodebookMetrics {
            usage: used as f64 / (h * s) as f64,
            perplexity,
            relative_error: if norm > 0.0 { (err / norm).sqrt() } else { 0.0 },
        }
    }
}

#[cfg(test)]
mod tests {
    use burn::backend::flex::FlexDevice;
    use burn::{Dispatch, DispatchDevice};

    use super::*;

    #[test]
    fn code_totals_count_and_sum_per_group_and_skip_empty_slots() {
        // Both forms; by group, N = 4 tokens make two chunks of S = 3 (one padded).
        for by_group in [false, true] {
            let device = DispatchDevice::Flex(FlexDevice);
            // Two groups of four tokens, S = 3; code 3 is the empty-slot sentinel.
            let codes =
                Tensor::<Dispatch, 2, Int>::from_data([[0, 2, 0, 3], [1, 1, 3, 2]], &device);
            let values = Tensor::<Dispatch, 3>::from_data(
                [
                    [[1.0, 10.0], [2.0, 20.0], [3.0, 30.0], [4.0, 40.0]],
                    [[5.0, 50.0], [6.0, 60.0], [7.0, 70.0], [8.0, 80.0]],
                ],
                &device,
            );
            let weight =
                Tensor::<Dispatch, 2>::from_data([[1.0, 1.0, 0.0, 1.0], [1.0; 4]], &device);
            let (counts, sums) = code_totals(codes.clone(), None, values.clone(), 3, by_group);
            counts.into_data().assert_eq(
                &TensorData::from([[2.0f32, 0.0, 1.0], [0.0, 2.0, 1.0]]),
                false,
            );
            sums.into_data().assert_eq(
                &TensorData::from([
                    [[4.0f32, 40.0], [0.0, 0.0], [2.0, 20.0]],
                    [[0.0, 0.0], [11.0, 110.0], [8.0, 80.0]],
                ]),
                false,
            );
            // A zero weight removes the token from both.
            let (counts, sums) = code_totals(codes, Some(weight), values, 3, by_group);
            counts.into_data().assert_eq(
                &TensorData::from([[1.0f32, 0.0, 1.0], [0.0, 2.0, 1.0]]),
                false,
            );
            let first = sums.slice([0..1, 0..1, 0..2]).into_data();
            first.assert_eq(&TensorData::from([[[1.0f32, 10.0]]]), false);
        }
    }

    /// The by-group form against the column form on random codes (empty
    /// slots among them), weights and values, for token counts below, at and
    /// above S and not a multiple of it: the same totals, and the same
    /// gradient into the values.
    #[test]
    fn totals_by_group_match_the_column_form_in_value_and_gradient() {
        use burn::backend::Autodiff;
        use burn::backend::flex::Flex;
        type Ad = Autodiff<Flex>;
        let device = FlexDevice;
        let (g, s, w) = (3, 4, 5);
        for n in [1, 4, 7, 12] {
            let codes =
                Tensor::<Ad, 2, Int>::random([g, n], Distribution::Uniform(0.0, 5.0), &device);
            let weight = Tensor::<Ad, 2>::random([g, n], Distribution::Uniform(0.0, 1.0), &device);
            let values =
                Tensor::<Ad, 3>::random([g, n, w], Distribution::Normal(0.0, 1.0), &device);
            let probe = Tensor::<Ad, 3>::random([g, s, w], Distribution::Normal(0.0, 1.0), &device);
            let run = |by_group: bool| {
                let values = values.clone().require_grad();
                let (counts, sums) = code_totals(
                    codes.clone(),
                    Some(weight.clone()),
                    values.clone(),
                    s,
                    by_group,
                );
                let grads = (sums.clone() * probe.clone()).sum().backward();
                let grad = values.grad(&grads).expect("values carry a gradient");
                (counts.into_data(), sums.into_data(), grad.into_data())
            };
            let (column, group) = (run(false), run(true));
            let tolerance = burn::tensor::Tolerance::<f32>::absolute(1e-5);
            column.0.assert_approx_eq::<f32>(&group.0, tolerance);
            column.1.assert_approx_eq::<f32>(&group.1, tolerance);
            column.2.assert_approx_eq::<f32>(&group.2, tolerance);
        }
    }

    #[test]
    fn the_gpu_backends_total_by_group_and_the_cpu_by_column() {
        use burn::backend::wgpu::WgpuDevice;
        assert!(!<Dispatch as VqBackend>::vq_totals_by_group(
            &DispatchDevice::Flex(FlexDevice)
        ));
        assert!(<Dispatch as VqBackend>::vq_totals_by_group(
            &DispatchDevice::Wgpu(WgpuDevice::default())
        ));
        const { assert!(<burn::backend::Wgpu as kernel::VqKernels>::TOTALS_BY_GROUP) };
        const { assert!(!<burn::backend::flex::Flex as kernel::VqKernels>::TOTALS_BY_GROUP) };
    }
}
