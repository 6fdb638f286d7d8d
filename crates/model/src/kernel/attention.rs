//! The fused VQ attention in CubeCL (CUDA, wgpu): one segment's three
//! groups of keys (present block, previous block, compressed cache), one
//! softmax over them and the weighted values, with no score tensor in
//! device memory. The backward pass recomputes the scores from each
//! query's log-sum-exp, as FlashAttention does.
//!
//! Three kernels, each cube one row of work and its `WORKERS` units
//! striding over that row, the row's scores in shared memory:
//!
//! - `forward`: a cube per query: its `2L + S` scores, their softmax, the
//!   output and the log-sum-exp;
//! - `backward_query`: a cube per query: the scores' gradients
//!   `ds = p (dO . value - D)` (`D = dO . O`), then `dq`, the query's row of
//!   the bias gradient and its count weight's gradient;
//! - `backward_key`: a cube per key (present, previous, code) of a block
//!   row: `ds` and `p` of each of the block's queries, then the key's `dk`
//!   (window keys only: codewords take no gradient) and its value's `dv`.
//!
//! Every output element is written by exactly one cube, so nothing is
//! zeroed first and nothing is accumulated atomically.

use burn::prelude::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Shape, TensorMetadata};
use burn_cubecl::element::BoolElement;
use burn_cubecl::ops::numeric::empty_device_dtype;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{CubeBackend, CubeRuntime, FloatElement, IntElement};
use cubecl::prelude::*;

use super::{AttentionKernelGrads, AttentionKernelInput, VqKernels};

/// Units per cube: one warp on CUDA.
const WORKERS: u32 = 32;

/// Most keys (`2L + S`) a query's scores may hold in shared memory (32 KiB
/// of `f32`); past it the model composes the attention.
pub const MAX_KEYS: usize = 8192;

/// The score of a masked key. WGSL has no infinite literal; `exp(NEG - m)`
/// is exactly 0 in `f32` for any finite row maximum `m`, as `exp(-inf)` is.
const NEG: f32 = -1.0e30;

/// Whether a backend's fused attention covers a segment with these sizes.
pub fn covers(block_len: usize, codes: usize) -> bool {
    block_len > 0 && 2 * block_len + codes <= MAX_KEYS
}

/// What every kernel reads: [`AttentionKernelInput`] on the device.
#[derive(CubeLaunch, CubeType)]
struct Operands<F: Float> {
    q: Tensor<F>,
    k: Tensor<F>,
    v: Tensor<F>,
    k_prev: Tensor<F>,
    v_prev: Tensor<F>,
    bias: Tensor<F>,
    codebook: Tensor<F>,
    log_counts: Tensor<F>,
    shift: Tensor<F>,
    count_weight: Tensor<F>,
    means: Tensor<F>,
    /// 1 when block 0 of every row has no previous block.
    mask_first: u32,
}

/// The score of key `n` (`0..L` present, `L..2L` previous, `2L..` codes)
/// for query `i` of block row `g`, as [`AttentionKernelInput`] states it.
#[cube]
fn score<F: Float>(x: &Operands<F>, g: usize, i: usize, n: usize) -> F {
    let l = x.q.shape(1);
    let dk = x.q.shape(2);
    let heads = x.codebook.shape(0);
    let blocks = x.bias.shape(2) / l;
    let r = g % blocks;
    let h = (g / blocks) % heads;
    let b = g / (blocks * heads);
    let bias_at = b * x.bias.stride(0) + h * x.bias.stride(1) + (r * l + i) * x.bias.stride(2);
    let q_at = g * x.q.stride(0) + i * x.q.stride(1);
    let mut out = F::new(NEG);
    if n < l {
        if n <= i {
            let k_at = g * x.k.stride(0) + n * x.k.stride(1);
            let mut dot = F::new(0.0);
            for c in 0..dk {
                dot += x.q[q_at + c * x.q.stride(2)] * x.k[k_at + c * x.k.stride(2)];
            }
            out = dot + x.bias[bias_at + (i - n) * x.bias.stride(3)];
        }
    } else if n < 2 * l {
        let j = n - l;
        if x.mask_first == 0 || r > 0 {
            let k_at = g * x.k_prev.stride(0) + j * x.k_prev.stride(1);
            let mut dot = F::new(0.0);
            for c in 0..dk {
                dot += x.q[q_at + c * x.q.stride(2)] * x.k_prev[k_at + c * x.k_prev.stride(2)];
            }
            // Distance L + i - j is within the window's bias when j >= i.
            if j >= i {
                dot += x.bias[bias_at + (l + i - j) * x.bias.stride(3)];
            }
            out = dot;
        }
    } else {
        let s = n - 2 * l;
        let a = x.log_counts[g * x.log_counts.stride(0) + s * x.log_counts.stride(1)];
        // An empty code's ln 0 = -inf fails this test: it stays masked.
        if a > F::new(NEG) {
            let c_at = h * x.codebook.stride(0) + s * x.codebook.stride(1);
            let mut dot = F::new(0.0);
            for c in 0..dk {
                dot += x.q[q_at + c * x.q.stride(2)] * x.codebook[c_at + c * x.codebook.stride(2)];
            }
            let w = x.count_weight[g * x.count_weight.stride(0) + i * x.count_weight.stride(1)];
            out = dot + w * a + x.shift[g * x.shift.stride(0)];
        }
    }
    out
}

/// Channel `c` of key `n`'s value: `v`, `v_prev` or the cache's `means`.
#[cube]
fn value<F: Float>(x: &Operands<F>, g: usize, n: usize, c: usize) -> F {
    let l = x.v.shape(1);
    if n < l {
        x.v[g * x.v.stride(0) + n * x.v.stride(1) + c * x.v.stride(2)]
    } else if n < 2 * l {
        x.v_prev[g * x.v_prev.stride(0) + (n - l) * x.v_prev.stride(1) + c * x.v_prev.stride(2)]
    } else {
        x.means[g * x.means.stride(0) + (n - 2 * l) * x.means.stride(1) + c * x.means.stride(2)]
    }
}

/// Channel `c` of key `n`: `k`, `k_prev` or the codeword.
#[cube]
fn key<F: Float>(x: &Operands<F>, g: usize, h: usize, n: usize, c: usize) -> F {
    let l = x.k.shape(1);
    if n < l {
        x.k[g * x.k.stride(0) + n * x.k.stride(1) + c * x.k.stride(2)]
    } else if n < 2 * l {
        x.k_prev[g * x.k_prev.stride(0) + (n - l) * x.k_prev.stride(1) + c * x.k_prev.stride(2)]
    } else {
        x.codebook[h * x.codebook.stride(0)
            + (n - 2 * l) * x.codebook.stride(1)
            + c * x.codebook.stride(2)]
    }
}

/// The maximum of every unit's `x` in the cube (`part`: `WORKERS` slots).
#[cube]
fn cube_max<F: Float>(x: F, part: &mut SharedMemory<F>) -> F {
    part[UNIT_POS_X as usize] = x;
    sync_cube();
    let mut m = part[0];
    for t in 1..CUBE_DIM_X as usize {
        let y = part[t];
        if y > m {
            m = y;
        }
    }
    sync_cube();
    m
}

/// The sum of every unit's `x` in the cube (`part`: `WORKERS` slots).
#[cube]
fn cube_sum<F: Float>(x: F, part: &mut SharedMemory<F>) -> F {
    part[UNIT_POS_X as usize] = x;
    sync_cube();
    let mut total = F::new(0.0);
    for t in 0..CUBE_DIM_X as usize {
        total += part[t];
    }
    sync_cube();
    total
}

#[cube(launch)]
fn forward<F: Float>(
    x: &Operands<F>,
    out: &mut Tensor<F>,
    lse: &mut Tensor<F>,
    #[comptime] keys: u32,
    #[define(F)] _dtype: StorageType,
) {
    let l = x.q.shape(1);
    let row = CUBE_POS;
    if row >= x.q.shape(0) * l {
        terminate!();
    }
    let g = row / l;
    let i = row % l;
    let n_keys = keys as usize;
    let step = CUBE_DIM_X as usize;
    let mut p = SharedMemory::<F>::new(keys as usize);
    let mut part = SharedMemory::<F>::new(WORKERS as usize);

    let mut m = F::new(NEG);
    let mut n = UNIT_POS_X as usize;
    while n < n_keys {
        let s = score::<F>(x, g, i, n);
        p[n] = s;
        if s > m {
            m = s;
        }
        n += step;
    }
    let m = cube_max::<F>(m, &mut part);
    let mut z = F::new(0.0);
    let mut n = UNIT_POS_X as usize;
    while n < n_keys {
        let e = (p[n] - m).exp();
        p[n] = e;
        z += e;
        n += step;
    }
    let z = cube_sum::<F>(z, &mut part);

    let out_at = g * out.stride(0) + i * out.stride(1);
    let mut c = UNIT_POS_X as usize;
    while c < out.shape(2) {
        let mut acc = F::new(0.0);
        for n in 0..n_keys {
            acc += p[n] * value::<F>(x, g, n, c);
        }
        out[out_at + c * out.stride(2)] = acc / z;
        c += step;
    }
    if UNIT_POS_X == 0 {
        lse[g * lse.stride(0) + i * lse.stride(1)] = m + z.ln();
    }
}

#[cube(launch)]
fn backward_query<F: Float>(
    x: &Operands<F>,
    lse: &Tensor<F>,
    grad: &Tensor<F>,
    delta: &Tensor<F>,
    dq: &mut Tensor<F>,
    dbias: &mut Tensor<F>,
    dweight: &mut Tensor<F>,
    #[comptime] keys: u32,
    #[define(F)] _dtype: StorageType,
) {
    let l = x.q.shape(1);
    let row = CUBE_POS;
    if row >= x.q.shape(0) * l {
        terminate!();
    }
    let g = row / l;
    let i = row % l;
    let n_keys = keys as usize;
    let step = CUBE_DIM_X as usize;
    let dv = x.v.shape(2);
    let mut ds = SharedMemory::<F>::new(keys as usize);
    let mut part = SharedMemory::<F>::new(WORKERS as usize);
    let row_lse = lse[g * lse.stride(0) + i * lse.stride(1)];
    let row_delta = delta[g * delta.stride(0) + i * delta.stride(1)];
    let grad_at = g * grad.stride(0) + i * grad.stride(1);

    let mut n = UNIT_POS_X as usize;
    while n < n_keys {
        let s = score::<F>(x, g, i, n);
        let p = (s - row_lse).exp();
        let mut dp = F::new(0.0);
        for c in 0..dv {
            dp += grad[grad_at + c * grad.stride(2)] * value::<F>(x, g, n, c);
        }
        ds[n] = p * (dp - row_delta);
        n += step;
    }
    sync_cube();

    let heads = x.codebook.shape(0);
    let blocks = x.bias.shape(2) / l;
    let r = g % blocks;
    let h = (g / blocks) % heads;
    let b = g / (blocks * heads);
    let dq_at = g * dq.stride(0) + i * dq.stride(1);
    let mut c = UNIT_POS_X as usize;
    while c < x.q.shape(2) {
        let mut acc = F::new(0.0);
        for n in 0..n_keys {
            acc += ds[n] * key::<F>(x, g, h, n, c);
        }
        dq[dq_at + c * dq.stride(2)] = acc;
        c += step;
    }
    // Distance d <= i is present key i - d; d > i is previous key L + i - d.
    let bias_at = b * dbias.stride(0) + h * dbias.stride(1) + (r * l + i) * dbias.stride(2);
    let mut d = UNIT_POS_X as usize;
    while d <= l {
        let mut at = 2 * l + i - d;
        if d <= i {
            at = i - d;
        }
        dbias[bias_at + d * dbias.stride(3)] = ds[at];
        d += step;
    }
    // The count weight multiplies every non-empty code's ln count.
    let mut acc = F::new(0.0);
    let mut s = UNIT_POS_X as usize;
    while s < n_keys - 2 * l {
        let a = x.log_counts[g * x.log_counts.stride(0) + s * x.log_counts.stride(1)];
        if a > F::new(NEG) {
            acc += ds[2 * l + s] * a;
        }
        s += step;
    }
    let total = cube_sum::<F>(acc, &mut part);
    if UNIT_POS_X == 0 {
        dweight[g * dweight.stride(0) + i * dweight.stride(1)] = total;
    }
}

#[cube(launch)]
fn backward_key<F: Float>(
    x: &Operands<F>,
    lse: &Tensor<F>,
    grad: &Tensor<F>,
    delta: &Tensor<F>,
    dk: &mut Tensor<F>,
    dv: &mut Tensor<F>,
    dk_prev: &mut Tensor<F>,
    dv_prev: &mut Tensor<F>,
    dmeans: &mut Tensor<F>,
    #[comptime] keys: u32,
    #[comptime] block: u32,
    #[define(F)] _dtype: StorageType,
) {
    let l = x.q.shape(1);
    let n_keys = keys as usize;
    let row = CUBE_POS;
    if row >= x.q.shape(0) * n_keys {
        terminate!();
    }
    let g = row / n_keys;
    let n = row % n_keys;
    let step = CUBE_DIM_X as usize;
    let width = x.v.shape(2);
    let mut ps = SharedMemory::<F>::new(block as usize);
    let mut ds = SharedMemory::<F>::new(block as usize);

    // Masked pairs score NEG: their p, and so their ds, are exactly 0.
    let mut i = UNIT_POS_X as usize;
    while i < l {
        let s = score::<F>(x, g, i, n);
        let p = (s - lse[g * lse.stride(0) + i * lse.stride(1)]).exp();
        let grad_at = g * grad.stride(0) + i * grad.stride(1);
        let mut dp = F::new(0.0);
        for c in 0..width {
            dp += grad[grad_at + c * grad.stride(2)] * value::<F>(x, g, n, c);
        }
        ps[i] = p;
        ds[i] = p * (dp - delta[g * delta.stride(0) + i * delta.stride(1)]);
        i += step;
    }
    sync_cube();

    if n < 2 * l {
        let mut c = UNIT_POS_X as usize;
        while c < x.q.shape(2) {
            let mut acc = F::new(0.0);
            for i in 0..l {
                acc += ds[i] * x.q[g * x.q.stride(0) + i * x.q.stride(1) + c * x.q.stride(2)];
            }
            if n < l {
                dk[g * dk.stride(0) + n * dk.stride(1) + c * dk.stride(2)] = acc;
            } else {
                dk_prev
                    [g * dk_prev.stride(0) + (n - l) * dk_prev.stride(1) + c * dk_prev.stride(2)] =
                    acc;
            }
            c += step;
        }
    }
    let mut c = UNIT_POS_X as usize;
    while c < width {
        let mut acc = F::new(0.0);
        for i in 0..l {
            acc += ps[i] * grad[g * grad.stride(0) + i * grad.stride(1) + c * grad.stride(2)];
        }
        if n < l {
            dv[g * dv.stride(0) + n * dv.stride(1) + c * dv.stride(2)] = acc;
        } else if n < 2 * l {
            dv_prev[g * dv_prev.stride(0) + (n - l) * dv_prev.stride(1) + c * dv_prev.stride(2)] =
                acc;
        } else {
            dmeans[g * dmeans.stride(0) + (n - 2 * l) * dmeans.stride(1) + c * dmeans.stride(2)] =
                acc;
        }
        c += step;
    }
}

/// Cubes for `rows` rows of work, one each: CUDA and Vulkan allow 65,535
/// along an axis, so the rows wrap onto a second axis (`CUBE_POS` counts
/// them in order; the excess cubes of the last line stop at once).
fn cubes(rows: usize) -> CubeCount {
    let x = rows.clamp(1, 65_535);
    CubeCount::Static(x as u32, rows.div_ceil(x).max(1) as u32, 1)
}

/// A new tensor of `shape` beside `like`.
fn empty_like<R: CubeRuntime>(
    like: &CubeTensor<R>,
    shape: Vec<usize>,
    dtype: DType,
) -> CubeTensor<R> {
    empty_device_dtype(
        like.client.clone(),
        like.device.clone(),
        Shape::from(shape),
        dtype,
    )
}

/// `[G, L, K, V, S]` of an input.
fn sizes<R: CubeRuntime>(
    x: &AttentionKernelInput<impl Backend<FloatTensorPrimitive = CubeTensor<R>>>,
) -> [usize; 5] {
    let [g, l, dk] = x.q.shape().dims();
    let (dv, s) = (
        x.v.shape().dims::<3>()[2],
        x.codebook.shape().dims::<3>()[1],
    );
    [g, l, dk, dv, s]
}

/// The launch arguments of [`Operands`].
fn operands<F: Float, R: CubeRuntime>(
    x: &AttentionKernelInput<impl Backend<FloatTensorPrimitive = CubeTensor<R>>>,
) -> OperandsLaunch<F, R> {
    OperandsLaunch::new(
        x.q.clone().into_tensor_arg(),
        x.k.clone().into_tensor_arg(),
        x.v.clone().into_tensor_arg(),
        x.k_prev.clone().into_tensor_arg(),
        x.v_prev.clone().into_tensor_arg(),
        x.bias.clone().into_tensor_arg(),
        x.codebook.clone().into_tensor_arg(),
        x.log_counts.clone().into_tensor_arg(),
        x.shift.clone().into_tensor_arg(),
        x.count_weight.clone().into_tensor_arg(),
        x.means.clone().into_tensor_arg(),
        x.mask_first as u32,
    )
}

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> VqKernels
    for CubeBackend<R, F, I, BT>
{
    fn vq_attention_forward(
        x: &AttentionKernelInput<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let [g, l, _, dv, s] = sizes(x);
        let keys = 2 * l + s;
        let dtype = x.q.dtype;
        let out = empty_like(&x.q, vec![g, l, dv], dtype);
        let lse = empty_like(&x.q, vec![g, l], dtype);
        forward::launch::<R>(
            &x.q.client,
            cubes(g * l),
            CubeDim::new_1d(WORKERS),
            operands(x),
            out.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            keys as u32,
            dtype.into(),
        );
        (out, lse)
    }

    fn vq_attention_backward(
        x: AttentionKernelInput<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> AttentionKernelGrads<Self> {
        use burn::tensor::ops::FloatTensorOps;
        let [g, l, dk, dv, s] = sizes(&x);
        let keys = 2 * l + s;
        let dtype = x.q.dtype;
        // D = dO . O per query, [G, L, 1].
        let delta = Self::float_sum_dim(Self::float_mul(grad.clone(), out), 2);
        let grads = AttentionKernelGrads::<Self> {
            q: empty_like(&x.q, vec![g, l, dk], dtype),
            k: empty_like(&x.q, vec![g, l, dk], dtype),
            v: empty_like(&x.q, vec![g, l, dv], dtype),
            k_prev: empty_like(&x.q, vec![g, l, dk], dtype),
            v_prev: empty_like(&x.q, vec![g, l, dv], dtype),
            bias: empty_like(&x.q, x.bias.shape().dims::<4>().to_vec(), dtype),
            means: empty_like(&x.q, vec![g, s, dv], dtype),
            count_weight: empty_like(&x.q, vec![g, l], dtype),
        };
        let client = x.q.client.clone();
        backward_query::launch::<R>(
            &client,
            cubes(g * l),
            CubeDim::new_1d(WORKERS),
            operands(&x),
            lse.clone().into_tensor_arg(),
            grad.clone().into_tensor_arg(),
            delta.clone().into_tensor_arg(),
            grads.q.clone().into_tensor_arg(),
            grads.bias.clone().into_tensor_arg(),
            grads.count_weight.clone().into_tensor_arg(),
            keys as u32,
            dtype.into(),
        );
        backward_key::launch::<R>(
            &client,
            cubes(g * keys),
            CubeDim::new_1d(WORKERS),
            operands(&x),
            lse.into_tensor_arg(),
            grad.into_tensor_arg(),
            delta.into_tensor_arg(),
            grads.k.clone().into_tensor_arg(),
            grads.v.clone().into_tensor_arg(),
            grads.k_prev.clone().into_tensor_arg(),
            grads.v_prev.clone().into_tensor_arg(),
            grads.means.clone().into_tensor_arg(),
            keys as u32,
            l as u32,
            dtype.into(),
        );
        grads
    }
}
