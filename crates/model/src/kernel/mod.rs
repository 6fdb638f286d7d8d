//! Fused kernels and the one seam through which the model reaches them.
//!
//! The model asks its backend for a fused operation through [`VqBackend`];
//! a backend without a kernel answers `None` and the model computes the
//! same thing with composed tensor ops, which stay the CPU path and the
//! oracle the kernels are tested against. A backend with kernels
//! implements [`VqKernels`] (forward and backward); [`VqBackend`] then
//! follows for it and for burn's `Autodiff` over it, whose backward pass
//! calls the kernel's backward.
//!
//! | backend | fused |
//! |---|---|
//! | `CubeBackend<R, ..>` (cubecl: CUDA, wgpu), with or without `Autodiff` | [`attention`], [`quantizer`], code totals (`totals.rs`), the sum of squares of many tensors (`norm.rs`: the global gradient norm), AdamW over many parameters (`adamw.rs`), tensors joined along their last axis (`join.rs`) |
//! | `Fusion<B>` (burn's fusion over such a backend: burn's `Wgpu` and `Cuda` in the default build), with or without `Autodiff` | `B`'s, each a custom operation of the fusion stream (`fusion.rs`) |
//! | `burn::Dispatch` (what `tvq` infers on, and trains on where the kernels do not cover a run) | the CPU's, forward only, on a CPU device without autodiff (inference); otherwise none: its tensors hide the backend they live on, so training with the kernels runs on `Autodiff<Flex>`, `Autodiff<burn::backend::Wgpu>` or `Autodiff<burn::backend::Cuda>`, and `tvq bench kernels` on those |
//! | `Flex` (the CPU), with or without `Autodiff` | attention, quantizer, code totals, SiLU, the projections' products (both ways), the sum of squares and AdamW in Rust over its buffers (`cpu.rs`); the join composes |
//!
//! Shapes: `G = B H R` block rows, `L` block length, `K` key width, `V`
//! value width, `S` codes, `T = R L`.

mod adamw;
pub mod attention;
mod autodiff;
mod cpu;
#[cfg(feature = "fusion")]
mod fusion;
mod join;
mod launch;
mod norm;
pub mod quantizer;
mod tile;
mod totals;

use std::cell::Cell;

use burn::backend::flex::{Flex, FlexTensor};
use burn::prelude::{Backend, Int, Tensor};
use burn::tensor::activation::silu;
use burn::tensor::backend::DeviceOps;
use burn::tensor::ops::{FloatTensor, FloatTensorOps, IntTensor, IntTensorOps};
use burn::tensor::{DType, TensorData, TensorMetadata, TensorPrimitive};
use burn::{Dispatch, DispatchDevice};
use burn_cubecl::element::BoolElement;
use burn_cubecl::{CubeBackend, CubeRuntime, FloatElement, IntElement};

use crate::norm::rms_normalize;

/// The sources of tvq's cubecl kernels (every file of this folder with
/// a `cube` attribute; a test keeps the list whole), hashed into
/// [`SOURCE_HASH`].
const SOURCES: [(&str, &[u8]); 8] = [
    ("adamw.rs", include_bytes!("adamw.rs")),
    ("attention.rs", include_bytes!("attention.rs")),
    ("join.rs", include_bytes!("join.rs")),
    ("launch.rs", include_bytes!("launch.rs")),
    ("norm.rs", include_bytes!("norm.rs")),
    ("quantizer.rs", include_bytes!("quantizer.rs")),
    ("tile.rs", include_bytes!("tile.rs")),
    ("totals.rs", include_bytes!("totals.rs")),
];

/// A hash (FNV-1a, 64 bits) of the kernels' sources. cubecl keeps a
/// compiled kernel under its type and comptime arguments, not its code, so
/// every kernel here takes this hash as a comptime argument (`_source`):
/// a kernel changed between two builds is compiled anew, never loaded as
/// the older build compiled it, and burn's kernels compiled into the same
/// cache stay of use to the next build.
pub const SOURCE_HASH: u64 = {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    let mut i = 0;
    while i < SOURCES.len() {
        let bytes = SOURCES[i].1;
        let mut j = 0;
        while j < bytes.len() {
            hash = (hash ^ bytes[j] as u64).wrapping_mul(0x0100_0000_01b3);
            j += 1;
        }
        i += 1;
    }
    hash
};

/// Whether a sublayer's attention and quantizer may each run as one fused
/// kernel where the backend has one, or always as composed tensor ops.
///
/// Composed is the default: the kernels are exact, faster than the
/// composed ops on the CPU from T = 2,048 but slower on lavapipe (tiled,
/// but scalar loads and no tensor cores) and not yet timed on a GPU
/// (docs/benchmarks.md, `tvq bench kernels`). A model opts in with
/// [`Kernels::Fused`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kernels {
    /// The fused kernels where the backend has them and the sublayer's
    /// settings are covered (attention: the Toeplitz and XL position
    /// terms, products in any precision, the kernel computing in `f32`,
    /// and no report of where the attention went; both: keys at most 128
    /// wide); composed ops otherwise.
    Fused,
    /// Composed tensor ops everywhere: the oracle. Default.
    #[default]
    Composed,
}

/// The inputs of one segment's fused VQ attention (every block at once),
/// as backend primitives. The score of query `i` of block row `g`:
///
/// - present-block key `j <= i`: `q_i . k_j + bias[i - j]` (`j > i`: masked);
/// - previous-block key `j`: `q_i . k'_j`, plus `bias[L + i - j]` when
///   `j >= i` (distance `<= L`), where `k'` is block `r - 1` of the
///   segment's keys, or `k_carried` in block 0 (`r = g mod R`); masked in
///   block 0 when [`AttentionFlags::mask_first`];
/// - code `s` of the compressed cache: `q_i . C_s + w_i log_counts_s +
///   shift_g`, masked where `log_counts_s = -inf` (an empty code); `w_i`
///   is 1 unless [`AttentionFlags::weighted`], `shift_g` 0 unless
///   [`AttentionFlags::shifted`].
///
/// One softmax over the `2L + S` scores weighs the present values, the
/// previous block's (`v'`, as `k'`) and `means`. The previous block is read
/// in place, not laid out beside each block: no copy of the keys and
/// values, and their gradients come back summed into `k`'s and `v`'s.
#[derive(Clone, Debug)]
pub struct AttentionKernelInput<B: Backend> {
    /// Content queries, `[G, L, K]` (`q + u` under the XL bias).
    pub q: FloatTensor<B>,
    /// Present-block keys, `[G, L, K]`.
    pub k: FloatTensor<B>,
    /// Present-block values, `[G, L, V]`.
    pub v: FloatTensor<B>,
    /// The carried previous block's keys, block 0's previous keys,
    /// `[B H, L, K]` (read only without [`AttentionFlags::mask_first`]);
    /// no gradient.
    pub k_carried: FloatTensor<B>,
    /// Its values, `[B H, L, V]`; no gradient.
    pub v_carried: FloatTensor<B>,
    /// Bias by distance `0..=L` for each query, `[B, H, T, L + 1]`
    /// (broadcast views welcome: a Toeplitz table expanded).
    pub bias: FloatTensor<B>,
    /// Codewords, `[H, S, K]`; no gradient.
    pub codebook: FloatTensor<B>,
    /// `ln` of each block's (limited) code counts, `-inf` for an empty
    /// code, `[G, S]`; no gradient.
    pub log_counts: FloatTensor<B>,
    /// The cache limit's score, the same for every code, `[G]`; no
    /// gradient. Read only when [`AttentionFlags::shifted`] (any tensor of
    /// the shape otherwise, such as an empty one: no fill to launch).
    pub shift: FloatTensor<B>,
    /// Each query's weight of `log_counts`, `[G, L]`. Read only when
    /// [`AttentionFlags::weighted`] (the paper's cache weighs every query
    /// by 1; any tensor of the shape otherwise, as for `shift`).
    pub count_weight: FloatTensor<B>,
    /// The compressed cache's mean values, `[G, S, V]`.
    pub means: FloatTensor<B>,
    /// What the kernels read and pass on.
    pub flags: AttentionFlags,
}

/// The switches of an [`AttentionKernelInput`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionFlags {
    /// Whether block 0 of every row has no previous block (a fresh stream).
    pub mask_first: bool,
    /// Whether the previous-block scores pass gradient on to the keys and
    /// values of the segment's blocks (`false`: only the present block's
    /// do, as where the previous block is detached).
    pub prev_grad: bool,
    /// Whether the cache means pass gradient on (to the values they
    /// summarise, [`crate::CacheGrad::Full`]); `false`: the backward pass
    /// leaves [`AttentionKernelGrads::means`] meaningless and skips its work.
    pub means_grad: bool,
    /// Whether the cache's scores add `shift` (a cache limit).
    pub shifted: bool,
    /// Whether the cache's scores weigh `log_counts` by `count_weight` (a
    /// learned count weight; its gradient is the kernel's only then).
    pub weighted: bool,
}

/// The gradients of [`AttentionKernelInput`]'s differentiable inputs,
/// each of its input's shape.
#[derive(Debug)]
pub struct AttentionKernelGrads<B: Backend> {
    /// `[G, L, K]`.
    pub q: FloatTensor<B>,
    /// `[G, L, K]`: as present and (under [`AttentionFlags::prev_grad`])
    /// as previous keys.
    pub k: FloatTensor<B>,
    /// `[G, L, V]`: as `k`.
    pub v: FloatTensor<B>,
    /// `[B, H, T, L + 1]`, dense.
    pub bias: FloatTensor<B>,
    /// `[G, S, V]` (meaningless unless [`AttentionFlags::means_grad`]).
    pub means: FloatTensor<B>,
    /// `[G, L]` (meaningless unless [`AttentionFlags::weighted`]).
    pub count_weight: FloatTensor<B>,
}

impl<B: Backend> AttentionKernelGrads<B> {
    /// The gradients in one fixed order (`q`, `k`, `v`, `bias`, `means`,
    /// `count_weight`): that of the autodiff step's parents and of the
    /// fusion operation's outputs.
    pub(crate) fn into_array(self) -> [FloatTensor<B>; 6] {
        [
            self.q,
            self.k,
            self.v,
            self.bias,
            self.means,
            self.count_weight,
        ]
    }

    /// The gradients from [`Self::into_array`]'s order (the fusion
    /// operation's outputs).
    #[cfg(feature = "fusion")]
    pub(crate) fn from_array([q, k, v, bias, means, count_weight]: [FloatTensor<B>; 6]) -> Self {
        Self {
            q,
            k,
            v,
            bias,
            means,
            count_weight,
        }
    }
}

/// What the fused quantizer finds for keys `[G, T, K]` (`G = B H`), each
/// against its head's codewords; nothing carries gradient.
#[derive(Clone, Debug)]
pub struct Nearest<B: Backend> {
    /// Each key's nearest code, ties to the lowest index, `[G, T]`.
    pub codes: IntTensor<B>,
    /// Its codeword, `[G, T, K]`.
    pub words: FloatTensor<B>,
    /// The squared distance to it, `|k - C_z|^2`, `[G, T]`.
    pub error: FloatTensor<B>,
    /// The key's squared norm, `|k|^2`, `[G, T]` (for the statistics).
    pub norm: FloatTensor<B>,
}

/// How much weight each code carries within groups of tokens, and the
/// weighted sums of the tokens' values (see [`VqKernels::vq_code_totals`]);
/// nothing carries gradient.
#[derive(Clone, Debug)]
pub struct CodeTotals<B: Backend> {
    /// `[O, S]`.
    pub counts: FloatTensor<B>,
    /// `[O, S, W]`.
    pub sums: FloatTensor<B>,
}

/// The compressed cache every block of a segment sees and the cache after
/// the segment (see [`VqKernels::vq_block_caches`]); nothing carries
/// gradient.
#[derive(Clone, Debug)]
pub struct BlockCaches<B: Backend> {
    /// Keys per code in block `r`'s cache, `[G, R, S]`.
    pub counts: FloatTensor<B>,
    /// Their mean values, `[G, R, S, V]`.
    pub means: FloatTensor<B>,
    /// Keys per code after the segment, `[G, S]`.
    pub counts_after: FloatTensor<B>,
    /// Their mean values, `[G, S, V]`.
    pub means_after: FloatTensor<B>,
}

impl<B: Backend> BlockCaches<B> {
    /// The four tensors in one fixed order (that of the fusion
    /// operation's outputs).
    pub(crate) fn into_array(self) -> [FloatTensor<B>; 4] {
        [self.counts, self.means, self.counts_after, self.means_after]
    }

    /// The tensors from [`Self::into_array`]'s order.
    pub(crate) fn from_array(
        [counts, means, counts_after, means_after]: [FloatTensor<B>; 4],
    ) -> Self {
        Self {
            counts,
            means,
            counts_after,
            means_after,
        }
    }
}

/// One parameter's AdamW step as burn's `AdamW` takes it, operation by
/// operation: the gradient `g` times `grad_scale` (clipping), the moments
/// `m1 = beta1 m1 + (1 - beta1) g` and `m2 = beta2 m2 + (1 - beta2) g^2`
/// (from zero before the first step), the update `u = (m1 / (1 -
/// beta1^t)) / (sqrt(m2 / (1 - beta2^t)) + epsilon)` and the parameter
/// `p (1 - lr weight_decay) - lr u`, every scalar taken in `f32` as burn
/// takes it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamwScalars {
    /// The learning rate.
    pub lr: f64,
    /// The decoupled weight decay.
    pub weight_decay: f64,
    /// The first moment's decay.
    pub beta1: f32,
    /// The second moment's decay.
    pub beta2: f32,
    /// Added to the second moment's root.
    pub epsilon: f32,
    /// The step `t` this is for the parameter (1 for its first).
    pub time: usize,
    /// The factor on the gradient (clipping's, the loss scale's inverse).
    pub grad_scale: f64,
}

/// Columns of a row of [`VqKernels::vq_adamw`]'s table.
const ROW: usize = 10;

impl AdamwScalars {
    /// The row of [`VqKernels::vq_adamw`]'s table: the learning rate,
    /// what the parameter keeps of itself, the two bias corrections, each
    /// moment's decay and its complement, `epsilon` and the gradient's
    /// factor.
    fn row(&self) -> [f32; ROW] {
        let t = self.time as i32;
        [
            self.lr as f32,
            (1.0 - self.lr * self.weight_decay) as f32,
            1.0 - self.beta1.powi(t),
            1.0 - self.beta2.powi(t),
            self.beta1,
            1.0 - self.beta1,
            self.beta2,
            1.0 - self.beta2,
            self.epsilon,
            self.grad_scale as f32,
        ]
    }
}

/// One parameter's input to [`VqBackend::vq_adamw`]; nothing carries
/// gradient.
#[derive(Clone, Debug)]
pub struct AdamwParam<B: Backend> {
    /// The parameter.
    pub param: FloatTensor<B>,
    /// Its gradient, of its shape.
    pub grad: FloatTensor<B>,
    /// Its first and second moments after its previous step; `None`
    /// before its first.
    pub moments: Option<[FloatTensor<B>; 2]>,
    /// The step's scalars.
    pub scalars: AdamwScalars,
}

/// The fused kernels a backend provides.
pub trait VqKernels: Backend {
    /// The compressed cache each of a segment's `R` blocks sees: the
    /// carried cache (`counts` `[G, S]` keys per code of mean values
    /// `means` `[G, S, V]`) with the previous blocks of blocks `0..r`
    /// merged in; and the cache after the segment, every previous block
    /// merged in. Block 0's previous block is the carried one (codes
    /// `carried_codes` `[G, L]`, values `carried_values` `[G, L, V]`),
    /// block `r`'s the segment's block `r - 1` (`codes` `[G, R L]`,
    /// `values` `[G, R L, V]`), read in place; code `S` is an empty slot.
    /// A merge keeps the running mean: `(mean n_c + sum) / max(n_c + n,
    /// 1)`. `fresh`: a stream's first segment, where nothing is carried
    /// (no previous block, an empty cache): the four carried tensors keep
    /// their shapes but are not read (`Tensor::empty` will do, no fill).
    fn vq_block_caches(
        carried_codes: IntTensor<Self>,
        carried_values: FloatTensor<Self>,
        codes: IntTensor<Self>,
        values: FloatTensor<Self>,
        counts: FloatTensor<Self>,
        means: FloatTensor<Self>,
        fresh: bool,
    ) -> BlockCaches<Self>;

    /// How much weight each code carries and the weighted sum of the
    /// values of the tokens that carry it: `codes` `[G, N]` in `0..=S`
    /// (`S = n_code` marks an empty slot, which counts nowhere), `weight`
    /// `[G, N]` (ones when `None`), `values` `[G, N, W]`. Row `o` of the
    /// result totals groups `o, o + O, o + 2 O, ...` (`O = rows`, a divisor
    /// of `G`).
    fn vq_code_totals(
        codes: IntTensor<Self>,
        weight: Option<FloatTensor<Self>>,
        values: FloatTensor<Self>,
        n_code: usize,
        rows: usize,
    ) -> CodeTotals<Self>;

    /// Each key's nearest codeword: `keys` `[G, T, K]` against `codebook`
    /// `[H, S, K]`, row `g` of head `g % H`.
    fn vq_quantize(keys: FloatTensor<Self>, codebook: FloatTensor<Self>) -> Nearest<Self>;

    /// Whether the composed totals of codes (`code_totals` in
    /// `crate::quantizer`) scatter within each group rather than
    /// `select_assign` over all of them: on the cubecl backends, whose
    /// `select_assign` loops over every index in one thread per output
    /// column (one thread for the counts), it is the form that keeps the
    /// device busy; on the CPU `select_assign` adds whole rows at once.
    const TOTALS_BY_GROUP: bool = false;

    /// Whether [`Self::vq_sum_squares`] has a kernel (answers `Some`).
    const SUMS_SQUARES: bool = false;

    /// The sum of the squares of every element of `tensors` (at least one,
    /// of any shapes, on one device) as a tensor `[1]`: a global gradient
    /// norm's square in a few launches. `None` (the default) where the
    /// backend has no kernel for it, or the tensors are not all of one
    /// float type.
    fn vq_sum_squares(tensors: Vec<FloatTensor<Self>>) -> Option<FloatTensor<Self>> {
        let _ = tensors;
        None
    }

    /// Whether [`Self::vq_join`] has a kernel (answers `Some`).
    const JOINS: bool = false;

    /// `parts` (each `[.., n_i]`, alike but for the last axis) joined
    /// along their last axis, `[.., sum n_i]`, in one launch, or `None`
    /// (the default) where the backend has no kernel for it or the parts
    /// are not all of one float type: the caller `cat`s them then.
    fn vq_join(parts: Vec<FloatTensor<Self>>) -> Option<FloatTensor<Self>> {
        let _ = parts;
        None
    }

    /// Whether [`Self::vq_adamw`] has a kernel (answers `Some`).
    const STEPS_ADAMW: bool = false;

    /// Whether RMS normalisation and the commitment under `Autodiff` over
    /// this backend take backward steps of their own
    /// ([`VqBackend::vq_rms_normalize`], [`VqBackend::vq_commitment`]): on
    /// the cubecl backends they save launches of burn's backward of the
    /// composed ops (which broadcasts through tensors of ones); on the CPU,
    /// where a launch costs nothing, they gave no speed beside the noise
    /// (docs/benchmarks.md), so it keeps burn's.
    const OWN_BACKWARDS: bool = false;

    /// Whether SiLU under `Autodiff` over this backend takes
    /// [`Self::vq_silu`] and [`Self::vq_silu_backward`] as its passes
    /// ([`VqBackend::vq_silu`]): on the CPU one pass each way, where burn's
    /// SiLU is two ops forward and four backward, each a fresh tensor; the
    /// cubecl backends keep burn's ops, which its fusion joins.
    const SILU: bool = false;

    /// SiLU `x sigmoid(x)` of `x`, any shape; composed by default.
    fn vq_silu(x: FloatTensor<Self>) -> FloatTensor<Self> {
        composed_silu::<Self>(x)
    }

    /// The gradient of SiLU at `x` from its output's gradient `grad` (both
    /// of one shape): `g s + g x s (1 - s)`, `s = sigmoid(x)`, the terms
    /// of burn's backward of the composed ops in its order; composed by
    /// default.
    fn vq_silu_backward(x: FloatTensor<Self>, grad: FloatTensor<Self>) -> FloatTensor<Self> {
        composed_silu_backward::<Self>(x, grad)
    }

    /// Whether [`Self::vq_column_products`] and [`Self::vq_column_backward`]
    /// have kernels ([`VqBackend::vq_column_blocks`] under `Autodiff` over
    /// this backend takes them, for one block too): on the CPU each product
    /// writes its own buffer and the weight's gradient is one buffer with
    /// each block's columns written in place, where burn's backward of the
    /// products of slices allocates, zeroes and adds a weight-sized tensor
    /// per block and sums the input's gradients block by block.
    const PROJECTS: bool = false;

    /// `x w` for `x` `[B, T, D]` and `w` `[D, sum(widths)]`, one product
    /// per block of `widths` columns, `[B, T, widths[i]]`; `None` (the
    /// default) where the backend has no kernel for it or the tensors are
    /// not `f32`.
    fn vq_column_products(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        widths: &[usize],
    ) -> Option<Vec<FloatTensor<Self>>> {
        let _ = (x, w, widths);
        None
    }

    /// The gradients `[dx, dw]` of [`Self::vq_column_products`]' `x`
    /// `[B, T, D]` and `w` `[D, N]` from its blocks' gradients `dys`
    /// (`[B, T, n_i]`, their widths summing to `N`): `dx = sum_i dy_i
    /// w_i^T`, `dw = [x^T dy_0, x^T dy_1, ..]`. `None` (the default) where
    /// the backend has no kernel for it or the tensors are not `f32`.
    fn vq_column_backward(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        dys: Vec<FloatTensor<Self>>,
    ) -> Option<[FloatTensor<Self>; 2]> {
        let _ = (x, w, dys);
        None
    }

    /// AdamW steps of many parameters ([`AdamwScalars`]): `tensors` holds
    /// each parameter's four (the parameter, its gradient, its first and
    /// second moments) in turn, `table` their scalars `[n, ROW]`
    /// ([`AdamwScalars`]' rows) in the parameters' float type; the answer
    /// holds each parameter's new value and moments in turn. `None` (the
    /// default) where the backend has no kernel for it or the tensors are
    /// not all of the table's float type.
    fn vq_adamw(
        tensors: Vec<FloatTensor<Self>>,
        table: FloatTensor<Self>,
    ) -> Option<Vec<FloatTensor<Self>>> {
        let _ = (tensors, table);
        None
    }

    /// The fused attention's output `[G, L, V]` and each query's
    /// log-sum-exp of its scores `[G, L]` (what the backward pass needs to
    /// recompute the probabilities instead of storing them).
    fn vq_attention_forward(
        input: &AttentionKernelInput<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// The gradients of the fused attention from the output's gradient
    /// `grad` `[G, L, V]`, given the forward pass's output and
    /// log-sum-exp.
    fn vq_attention_backward(
        input: AttentionKernelInput<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> AttentionKernelGrads<Self>;
}

/// What the model asks of its backend: each fused operation, or `None`
/// where the backend has no kernel for it (then the model composes it).
pub trait VqBackend: Backend {
    /// Whether [`Self::vq_attention`] may have a kernel (answer `Some`;
    /// `Dispatch` does only on some devices): the model lays out the
    /// kernel's inputs only then.
    const FUSES_ATTENTION: bool;

    /// Whether [`Self::vq_adamw`] may have a kernel (answer `Some`): the
    /// trainer gathers the optimizer's moments for it only then.
    const STEPS_ADAMW: bool;

    /// The fused attention's output `[G, L, V]`, differentiable where the
    /// backend is.
    fn vq_attention(input: AttentionKernelInput<Self>) -> Option<FloatTensor<Self>>;

    /// [`VqKernels::vq_quantize`] (for keys and codebook that carry no
    /// gradient), or `None` where the backend has no kernel for it.
    fn vq_quantize(keys: FloatTensor<Self>, codebook: FloatTensor<Self>) -> Option<Nearest<Self>>;

    /// [`VqKernels::vq_block_caches`] (for values and a carried cache that
    /// carry no gradient), or `None` where the backend has no kernel for it.
    fn vq_block_caches(
        carried_codes: IntTensor<Self>,
        carried_values: FloatTensor<Self>,
        codes: IntTensor<Self>,
        values: FloatTensor<Self>,
        counts: FloatTensor<Self>,
        means: FloatTensor<Self>,
        fresh: bool,
    ) -> Option<BlockCaches<Self>>;

    /// [`VqKernels::vq_code_totals`] (for values that carry no gradient),
    /// or `None` where the backend has no kernel for it.
    fn vq_code_totals(
        codes: IntTensor<Self>,
        weight: Option<FloatTensor<Self>>,
        values: FloatTensor<Self>,
        n_code: usize,
        rows: usize,
    ) -> Option<CodeTotals<Self>>;

    /// [`VqKernels::vq_sum_squares`] (for tensors that carry no gradient),
    /// or `None` where the backend has no kernel for it.
    fn vq_sum_squares(tensors: Vec<FloatTensor<Self>>) -> Option<FloatTensor<Self>>;

    /// The AdamW steps of `params` (at least one, on one device) by
    /// [`VqKernels::vq_adamw`]: each parameter's new value and moments
    /// (`[param, m1, m2]`), or `None` where the backend has no kernel for
    /// it.
    fn vq_adamw(params: Vec<AdamwParam<Self>>) -> Option<Vec<[FloatTensor<Self>; 3]>>;

    /// Whether the composed totals of codes on `device` scatter within each
    /// group ([`VqKernels::TOTALS_BY_GROUP`]).
    fn vq_totals_by_group(device: &Self::Device) -> bool;

    /// [`rms_normalize`] of `x` over its last axis, the same forward ops,
    /// differentiated by a backward step of its own where the backend is
    /// burn's `Autodiff` over a cubecl one ([`VqKernels::OWN_BACKWARDS`]:
    /// `dx = r g - r^3 x mean(g x)`, one reduction, no tensor of ones as
    /// burn's `mean_dim` backward fills); composed elsewhere.
    fn vq_rms_normalize<const D: usize>(x: Tensor<Self, D>) -> Tensor<Self, D>;

    /// SiLU of `x`, `x sigmoid(x)`: burn's composed ops unless the backend
    /// is burn's `Autodiff` over one with passes of its own
    /// ([`VqKernels::SILU`]), where it is one pass forward and one
    /// backward.
    fn vq_silu<const D: usize>(x: Tensor<Self, D>) -> Tensor<Self, D> {
        silu(x)
    }

    /// The commitment of keys `k` `[B, H, T, K]` to their codewords
    /// `words` `[B, H, T, K]` per token, `[B, T]`: `sum_{h, k} (k -
    /// words)^2`, its value the sum over heads of `errors` `[B, H, T, 1]`
    /// (the squared errors, detached, as the quantizer found them),
    /// differentiated by a backward step of its own (`dk = 2 (k - words)
    /// g`, one elementwise pass, no tensors of ones as burn's `sum_dim`
    /// backward fills) where the backend is burn's `Autodiff` over a
    /// cubecl one ([`VqKernels::OWN_BACKWARDS`]); `None` (the default)
    /// elsewhere, where the caller composes it.
    fn vq_commitment(
        k: Tensor<Self, 4>,
        words: Tensor<Self, 4>,
        errors: Tensor<Self, 4>,
    ) -> Option<Tensor<Self, 2>> {
        let _ = (k, words, errors);
        None
    }

    /// The straight-through estimator of keys `k` `[B, H, T, K]` and their
    /// codewords `words` `[B, H, T, K]` (no gradient): `words` in the
    /// forward pass, the gradient passed to `k` unchanged, by a backward
    /// step of its own where the backend is burn's `Autodiff` over a
    /// cubecl one ([`VqKernels::OWN_BACKWARDS`]): composed, `k` plus the
    /// detached `words - k` takes two launches for a value the kernel
    /// already wrote. `None` (the default) elsewhere, where the
    /// caller composes it.
    fn vq_straight_through(k: Tensor<Self, 4>, words: Tensor<Self, 4>) -> Option<Tensor<Self, 4>> {
        let _ = (k, words);
        None
    }

    /// The negative log-likelihood per token `[B, T]` of `targets` `[B, T]`
    /// under `logits` `[B, T, V]`, the value [`crate::token_nll`] composes,
    /// differentiated by a backward step of its own where the backend is
    /// burn's `Autodiff` over a cubecl one ([`VqKernels::OWN_BACKWARDS`]):
    /// `d logits = (softmax - onehot) g`, one elementwise pass, where
    /// burn's backward of the log-softmax and the gather fills a tensor,
    /// scatters into it and reduces it again. `None` (the default)
    /// elsewhere, where the caller composes it.
    fn vq_token_nll(
        logits: Tensor<Self, 3>,
        targets: Tensor<Self, 2, Int>,
    ) -> Option<Tensor<Self, 2>> {
        let _ = (logits, targets);
        None
    }

    /// `x W` for `x` `[B, T, D]` and `w` `[D, sum(widths)]` as one tensor
    /// per block of `widths` columns, `[B, T, widths[i]]`, each the product
    /// with its columns of `w`, differentiated by a backward step of its
    /// own where the backend is burn's `Autodiff` over a cubecl one
    /// ([`VqKernels::OWN_BACKWARDS`]): the blocks' gradients joined, then
    /// one product for `dx` and one for `dw` (burn's backward of the
    /// products of slices of `w` takes two products per block, and each
    /// slice's gradient is a filled tensor of `w`'s shape with the block
    /// assigned in); over the CPU ([`VqKernels::PROJECTS`]) the backend's
    /// own products both ways, for one block too. Every block must reach
    /// the loss, as the projections of a sublayer do: the first block's
    /// step runs the others'. `None` (the default) elsewhere, for one
    /// block on a cubecl backend, and where the widths do not cover every
    /// column of `w`: the caller composes it then.
    fn vq_column_blocks<const N: usize>(
        x: Tensor<Self, 3>,
        w: Tensor<Self, 2>,
        widths: [usize; N],
    ) -> Option<[Tensor<Self, 3>; N]> {
        let _ = (x, w, widths);
        None
    }
}

impl<B: VqKernels> VqBackend for B {
    const FUSES_ATTENTION: bool = true;
    const STEPS_ADAMW: bool = <B as VqKernels>::STEPS_ADAMW;

    fn vq_attention(input: AttentionKernelInput<Self>) -> Option<FloatTensor<Self>> {
        count(&FUSED_CALLS);
        Some(B::vq_attention_forward(&input).0)
    }

    fn vq_quantize(keys: FloatTensor<Self>, codebook: FloatTensor<Self>) -> Option<Nearest<Self>> {
        count(&QUANTIZE_CALLS);
        Some(B::vq_quantize(keys, codebook))
    }

    fn vq_code_totals(
        codes: IntTensor<Self>,
        weight: Option<FloatTensor<Self>>,
        values: FloatTensor<Self>,
        n_code: usize,
        rows: usize,
    ) -> Option<CodeTotals<Self>> {
        count(&TOTALS_CALLS);
        Some(B::vq_code_totals(codes, weight, values, n_code, rows))
    }

    fn vq_block_caches(
        carried_codes: IntTensor<Self>,
        carried_values: FloatTensor<Self>,
        codes: IntTensor<Self>,
        values: FloatTensor<Self>,
        counts: FloatTensor<Self>,
        means: FloatTensor<Self>,
        fresh: bool,
    ) -> Option<BlockCaches<Self>> {
        count(&TOTALS_CALLS);
        Some(B::vq_block_caches(
            carried_codes,
            carried_values,
            codes,
            values,
            counts,
            means,
            fresh,
        ))
    }

    fn vq_sum_squares(tensors: Vec<FloatTensor<Self>>) -> Option<FloatTensor<Self>> {
        let total = B::vq_sum_squares(tensors)?;
        count(&NORM_CALLS);
        Some(total)
    }

    fn vq_adamw(params: Vec<AdamwParam<Self>>) -> Option<Vec<[FloatTensor<Self>; 3]>> {
        if !<B as VqKernels>::STEPS_ADAMW {
            return None;
        }
        let n = params.len();
        let device = B::float_device(&params.first()?.param);
        let float = params[0].param.dtype();
        let mut rows = Vec::with_capacity(n * ROW);
        let mut tensors = Vec::with_capacity(4 * n);
        for p in params {
            rows.extend(p.scalars.row());
            // Zero moments before the first step: `0 beta + x` is `x`
            // exactly, burn's first moments.
            let [m1, m2] = p.moments.unwrap_or_else(|| {
                let zeros = || B::float_zeros(p.param.shape(), &device, float.into());
                [zeros(), zeros()]
            });
            tensors.extend([p.param, p.grad, m1, m2]);
        }
        let table = TensorData::new(rows, [n, ROW]).convert_dtype(float);
        let table = B::float_from_data(table, &device);
        let mut out = B::vq_adamw(tensors, table)?.into_iter();
        count(&ADAMW_CALLS);
        Some(
            (0..n)
                .map(|_| [(); 3].map(|_| out.next().expect("three tensors a parameter")))
                .collect(),
        )
    }

    fn vq_totals_by_group(_: &Self::Device) -> bool {
        B::TOTALS_BY_GROUP
    }

    /// Composed: without `Autodiff` there is no backward step to replace.
    fn vq_rms_normalize<const D: usize>(x: Tensor<Self, D>) -> Tensor<Self, D> {
        rms_normalize(x)
    }

    /// Without `Autodiff` the forward pass alone, where the backend has it.
    fn vq_silu<const D: usize>(x: Tensor<Self, D>) -> Tensor<Self, D> {
        if !B::SILU {
            return silu(x);
        }
        count(&SILU_CALLS);
        Tensor::from_primitive(TensorPrimitive::Float(B::vq_silu(
            x.into_primitive().tensor(),
        )))
    }
}

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> VqKernels
    for CubeBackend<R, F, I, BT>
{
    fn vq_code_totals(
        codes: IntTensor<Self>,
        weight: Option<FloatTensor<Self>>,
        values: FloatTensor<Self>,
        n_code: usize,
        rows: usize,
    ) -> CodeTotals<Self> {
        let (counts, sums) = totals::totals(codes, weight, values, n_code, rows);
        CodeTotals { counts, sums }
    }

    fn vq_block_caches(
        carried_codes: IntTensor<Self>,
        carried_values: FloatTensor<Self>,
        codes: IntTensor<Self>,
        values: FloatTensor<Self>,
        counts: FloatTensor<Self>,
        means: FloatTensor<Self>,
        fresh: bool,
    ) -> BlockCaches<Self> {
        BlockCaches::from_array(totals::caches(
            [carried_codes, codes],
            [carried_values, values],
            counts,
            means,
            fresh,
        ))
    }

    const TOTALS_BY_GROUP: bool = true;

    const SUMS_SQUARES: bool = true;

    fn vq_sum_squares(tensors: Vec<FloatTensor<Self>>) -> Option<FloatTensor<Self>> {
        norm::partials(tensors).map(Self::float_sum)
    }

    const JOINS: bool = true;

    fn vq_join(parts: Vec<FloatTensor<Self>>) -> Option<FloatTensor<Self>> {
        join::join_last(parts)
    }

    const STEPS_ADAMW: bool = true;

    const OWN_BACKWARDS: bool = true;

    fn vq_adamw(
        tensors: Vec<FloatTensor<Self>>,
        table: FloatTensor<Self>,
    ) -> Option<Vec<FloatTensor<Self>>> {
        adamw::step(tensors, table)
    }

    fn vq_quantize(keys: FloatTensor<Self>, codebook: FloatTensor<Self>) -> Nearest<Self> {
        let int: DType = I::dtype();
        let (codes, words, error, norm) = quantizer::quantize(keys, codebook, int);
        Nearest {
            codes,
            words,
            error,
            norm,
        }
    }

    fn vq_attention_forward(
        input: &AttentionKernelInput<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        attention::forward(input)
    }

    fn vq_attention_backward(
        input: AttentionKernelInput<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> AttentionKernelGrads<Self> {
        attention::backward(input, out, lse, grad)
    }
}

/// `burn::Dispatch`, what `tvq` infers on, reaches the CPU's kernels where
/// its tensors are plain CPU tensors: inference on the CPU, by way of host
/// data (a copy of the inputs and the output, linear in their size).
/// Everywhere else it composes: its tensors hide the backend they live on,
/// and burn 0.21 gives no way to add a backward step to its autodiff graph
/// (training reaches the kernels on `Autodiff` over `Flex`, burn's `Wgpu`
/// or burn's `Cuda` instead).
impl VqBackend for Dispatch {
    const FUSES_ATTENTION: bool = true;
    const STEPS_ADAMW: bool = false;

    fn vq_attention(x: AttentionKernelInput<Self>) -> Option<FloatTensor<Self>> {
        let device = plain_cpu(&x.q)?;
        count(&FUSED_CALLS);
        let flex = AttentionKernelInput::<Flex> {
            q: to_flex(x.q),
            k: to_flex(x.k),
            v: to_flex(x.v),
            k_carried: to_flex(x.k_carried),
            v_carried: to_flex(x.v_carried),
            bias: to_flex(x.bias),
            codebook: to_flex(x.codebook),
            log_counts: to_flex(x.log_counts),
            shift: to_flex(x.shift),
            count_weight: to_flex(x.count_weight),
            means: to_flex(x.means),
            flags: x.flags,
        };
        let (out, _) = Flex::vq_attention_forward(&flex);
        Some(Self::float_from_data(out.into_data(), &device))
    }

    fn vq_quantize(keys: FloatTensor<Self>, codebook: FloatTensor<Self>) -> Option<Nearest<Self>> {
        let device = plain_cpu(&keys)?;
        count(&QUANTIZE_CALLS);
        let n = <Flex as VqKernels>::vq_quantize(to_flex(keys), to_flex(codebook));
        Some(Nearest {
            codes: Self::int_from_data(n.codes.into_data(), &device),
            words: Self::float_from_data(n.words.into_data(), &device),
            error: Self::float_from_data(n.error.into_data(), &device),
            norm: Self::float_from_data(n.norm.into_data(), &device),
        })
    }

    /// Composed: the statistics are training's, where `Dispatch` composes.
    fn vq_code_totals(
        _: IntTensor<Self>,
        _: Option<FloatTensor<Self>>,
        _: FloatTensor<Self>,
        _: usize,
        _: usize,
    ) -> Option<CodeTotals<Self>> {
        None
    }

    /// Composed, as [`Self::vq_code_totals`].
    fn vq_block_caches(
        _: IntTensor<Self>,
        _: FloatTensor<Self>,
        _: IntTensor<Self>,
        _: FloatTensor<Self>,
        _: FloatTensor<Self>,
        _: FloatTensor<Self>,
        _: bool,
    ) -> Option<BlockCaches<Self>> {
        None
    }

    /// Composed, as [`Self::vq_code_totals`].
    fn vq_sum_squares(_: Vec<FloatTensor<Self>>) -> Option<FloatTensor<Self>> {
        None
    }

    /// Composed, as [`Self::vq_code_totals`].
    fn vq_adamw(_: Vec<AdamwParam<Self>>) -> Option<Vec<[FloatTensor<Self>; 3]>> {
        None
    }

    /// By group on every device but the CPU's (all others are cubecl's).
    fn vq_totals_by_group(device: &DispatchDevice) -> bool {
        !matches!(device.inner(), DispatchDevice::Flex(_))
    }

    /// Composed, as [`Self::vq_code_totals`].
    fn vq_rms_normalize<const D: usize>(x: Tensor<Self, D>) -> Tensor<Self, D> {
        rms_normalize(x)
    }
}

/// burn's SiLU of `x`, `x sigmoid(x)`, the composed ops on primitives.
pub(crate) fn composed_silu<B: Backend>(x: FloatTensor<B>) -> FloatTensor<B> {
    B::float_mul(x.clone(), B::sigmoid(x))
}

/// The gradient of [`composed_silu`] at `x` from the output's `grad`, as
/// burn's backward of its two ops: `g s` through the product, `(g x) s (1
/// - s)` through the sigmoid, summed.
pub(crate) fn composed_silu_backward<B: Backend>(
    x: FloatTensor<B>,
    grad: FloatTensor<B>,
) -> FloatTensor<B> {
    let s = B::sigmoid(x.clone());
    let through_s = B::sigmoid_backward(s.clone(), B::float_mul(grad.clone(), x));
    B::float_add(B::float_mul(grad, s), through_s)
}

/// The commitment per token `[B, T]` from each head's squared error
/// `err` `[B, H, T, 1]`: their sum over the heads (for one head, the error
/// itself: no reduction over an axis of one).
pub(crate) fn sum_over_heads<B: Backend>(err: Tensor<B, 4>) -> Tensor<B, 2> {
    let [b, h, t, _] = err.dims();
    match h {
        1 => err.reshape([b, t]),
        _ => err.sum_dim(1).reshape([b, t]),
    }
}

/// The device of `t` if it is the CPU without autodiff.
fn plain_cpu(t: &FloatTensor<Dispatch>) -> Option<DispatchDevice> {
    match Dispatch::float_device(t) {
        device @ DispatchDevice::Flex(_) => Some(device),
        _ => None,
    }
}

/// A CPU tensor of `Dispatch` as `Flex`'s, through host data.
fn to_flex(t: FloatTensor<Dispatch>) -> FlexTensor {
    // A tensor's rank is only its type's: any rank reads the primitive's data.
    let t = burn::tensor::Tensor::<Dispatch, 1>::from_primitive(TensorPrimitive::Float(t));
    FlexTensor::from_data(t.into_data())
}

thread_local! {
    /// Per thread, so that tests running side by side do not see each
    /// other's calls.
    static FUSED_CALLS: Cell<u64> = const { Cell::new(0) };
    static QUANTIZE_CALLS: Cell<u64> = const { Cell::new(0) };
    static TOTALS_CALLS: Cell<u64> = const { Cell::new(0) };
    static NORM_CALLS: Cell<u64> = const { Cell::new(0) };
    static ADAMW_CALLS: Cell<u64> = const { Cell::new(0) };
    static RMS_CALLS: Cell<u64> = const { Cell::new(0) };
    static COMMITMENT_CALLS: Cell<u64> = const { Cell::new(0) };
    static COLUMN_BLOCKS_CALLS: Cell<u64> = const { Cell::new(0) };
    static STRAIGHT_THROUGH_CALLS: Cell<u64> = const { Cell::new(0) };
    static TOKEN_NLL_CALLS: Cell<u64> = const { Cell::new(0) };
    static SILU_CALLS: Cell<u64> = const { Cell::new(0) };
}

/// Counts one call in `counter`.
fn count(counter: &'static std::thread::LocalKey<Cell<u64>>) {
    counter.with(|c| c.set(c.get() + 1));
}

/// How many fused attention calls this thread has made: how a test sees
/// that the fused path ran rather than silently falling back.
pub fn fused_attention_calls() -> u64 {
    FUSED_CALLS.with(Cell::get)
}

/// How many fused quantizer calls this thread has made.
pub fn fused_quantize_calls() -> u64 {
    QUANTIZE_CALLS.with(Cell::get)
}

/// How many fused code-totals and block-cache calls this thread has made.
pub fn fused_totals_calls() -> u64 {
    TOTALS_CALLS.with(Cell::get)
}

/// How many sums of squares by kernel this thread has made.
pub fn fused_norm_calls() -> u64 {
    NORM_CALLS.with(Cell::get)
}

/// How many AdamW steps by kernel this thread has made.
pub fn fused_adamw_calls() -> u64 {
    ADAMW_CALLS.with(Cell::get)
}

/// How many RMS normalisations with their own backward step this thread
/// has made.
pub fn fused_rms_calls() -> u64 {
    RMS_CALLS.with(Cell::get)
}

/// How many commitments with their own backward step this thread has made.
pub fn fused_commitment_calls() -> u64 {
    COMMITMENT_CALLS.with(Cell::get)
}

/// How many column-block products with their own backward step this
/// thread has made.
pub fn fused_column_blocks_calls() -> u64 {
    COLUMN_BLOCKS_CALLS.with(Cell::get)
}

/// How many straight-through estimators with their own backward step this
/// thread has made.
pub fn fused_straight_through_calls() -> u64 {
    STRAIGHT_THROUGH_CALLS.with(Cell::get)
}

/// How many SiLUs of the backend's own passes ([`VqKernels::SILU`]) this
/// thread has made.
pub fn fused_silu_calls() -> u64 {
    SILU_CALLS.with(Cell::get)
}

/// How many token log-likelihoods with their own backward step this thread
/// has made.
pub fn fused_token_nll_calls() -> u64 {
    TOKEN_NLL_CALLS.with(Cell::get)
}

#[cfg(test)]
mod tests {
    /// Every file of this folder with cubecl kernel code is hashed into
    /// [`super::SOURCE_HASH`], so a change to any kernel moves the cache of
    /// compiled kernels to a new folder.
    #[test]
    fn the_source_hash_covers_every_kernel_file() {
        // The crate's folder as the test runs, not as it was built: a binary
        // reused from another checkout's build would read a folder gone.
        let dir = tvq_testkit::crate_dir().join("src/kernel");
        let mut with_kernels: Vec<String> = std::fs::read_dir(&dir)
            .expect("the kernel folder")
            .map(|entry| entry.expect("an entry").path())
            .filter(|path| {
                let text = std::fs::read_to_string(path).unwrap_or_default();
                text.lines()
                    .any(|line| line.trim_start().starts_with("#[cube"))
            })
            .map(|path| path.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        with_kernels.sort();
        let hashed: Vec<String> = super::SOURCES
            .iter()
            .map(|(name, _)| name.to_string())
            .collect();
        assert_eq!(with_kernels, hashed);
    }

    /// Every kernel takes [`super::SOURCE_HASH`] as a comptime argument
    /// (which cubecl keeps in the kernel's id: `a_kernels_id_changes_with_the_sources`)
    /// and every launch passes it, so a kernel whose code changed is
    /// compiled anew rather than loaded as an older build compiled it,
    /// while burn's kernels in the same cache stay valid.
    #[test]
    fn every_kernel_is_known_by_the_sources_hash() {
        let mut kernels = 0;
        for (name, bytes) in super::SOURCES {
            let text = std::str::from_utf8(bytes).unwrap();
            for kernel in text.split("#[cube(launch)]").skip(1) {
                let signature = &kernel[..kernel.find(") {").unwrap()];
                assert!(
                    signature.contains("#[comptime] _source: u64,"),
                    "{name}: {signature}"
                );
                kernels += 1;
            }
            for launch in text.split("::launch::<").skip(1) {
                let args = &launch[..launch.find(");").unwrap()];
                assert!(args.contains("SOURCE_HASH,"), "{name}: {args}");
            }
        }
        assert!(kernels >= 12, "{kernels} kernels");
    }
}
