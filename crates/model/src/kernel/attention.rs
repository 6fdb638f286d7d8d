//! The fused VQ attention in CubeCL (CUDA, wgpu): one segment's three
//! groups of keys (present block, previous block, compressed cache), one
//! softmax over them and the weighted values, with no score tensor in
//! device memory. The backward pass recomputes the scores from each
//! query's log-sum-exp, as FlashAttention does.
//!
//! Every kernel works on tiles of `TILE` queries by `TILE` keys, a cube of
//! `TILE x TILE` units, one score each: the tile's query and key rows
//! (`TILE x K`) are read from device memory once into shared memory and
//! shared by all its units, instead of once per score. Keys number
//! `N = 2L + S` (present `0..L`, previous `L..2L`, codes `2L..`).
//!
//! - `forward_stats`: a cube per query tile, over every key tile: each
//!   query's log-sum-exp (running maximum and sum, then a reduction);
//! - `forward_values`: a cube per query tile and slice of `SLICE` value
//!   channels: the probabilities recomputed from the log-sum-exp, times
//!   the values (the value width, 1,536 at enwik8 widths, is split over
//!   cubes so that a unit's accumulators stay in registers);
//! - `backward_query`: a cube per query tile: `ds = p (dO . value - D)`
//!   (`D = dO . O`), then `dq`, the query's row of the bias gradient and
//!   its count weight's gradient;
//! - `backward_key`: a cube per tile of window keys: `ds` again, then `dk`
//!   (codewords take no gradient);
//! - `backward_values`: a cube per key tile and value slice: `dv`,
//!   `dv_prev` and the cache means' gradient, `p^T dO`.
//!
//! Tiles whose rows a unit reads across (query and key rows, the chunks of
//! `dO . value`) keep their rows one element more than their width apart,
//! so that the units of a warp reading one column of 16 rows read 16
//! different shared-memory banks instead of one bank 16 times.
//!
//! Every output element is written by exactly one unit, so nothing is
//! zeroed first and nothing is accumulated atomically. `dO . value` is
//! computed by both `backward_query` and `backward_key`: the price of no
//! atomics.

use burn::prelude::Backend;
use burn::tensor::TensorMetadata;
use burn_cubecl::CubeRuntime;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::launch::{cubes, empty_like, parts};
use super::{AttentionKernelGrads, AttentionKernelInput};

/// Queries (and keys) per tile; a cube is `TILE x TILE` units.
const TILE: usize = 16;

/// Value channels each unit accumulates where values are weighed.
const PER_UNIT: usize = 8;

/// Value channels per cube where values are weighed.
const SLICE: usize = TILE * PER_UNIT;

/// Value channels per step of `dO . value`.
const CHUNK: usize = 64;

/// Widest key a tile holds: a tile of queries and one of keys, `2 TILE K`
/// floats, with the value slice, in 32 KiB of shared memory. Wider keys
/// compose.
pub const MAX_KEY_WIDTH: usize = 128;

/// The score of a masked key. WGSL has no infinite literal; `exp(NEG - m)`
/// is exactly 0 in `f32` for any finite row maximum `m`, as `exp(-inf)` is.
const NEG: f32 = -1.0e30;

/// Whether a backend's fused attention covers a segment with this block
/// length and key width.
pub fn covers(block_len: usize, key_width: usize) -> bool {
    block_len > 0 && (1..=MAX_KEY_WIDTH).contains(&key_width)
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

/// Keys a query sees, `2L + S`.
#[cube]
fn key_count<F: Float>(x: &Operands<F>) -> usize {
    2 * x.q.shape(1) + x.codebook.shape(1)
}

/// The head of block row `g` (`g = (b H + h) R + r`).
#[cube]
fn head<F: Float>(x: &Operands<F>, g: usize) -> usize {
    let blocks = x.bias.shape(2) / x.q.shape(1);
    (g / blocks) % x.codebook.shape(0)
}

/// Where query `i` of block row `g` starts in `bias` (or its gradient,
/// of the same shape).
#[cube]
fn bias_row<F: Float>(x: &Operands<F>, bias: &Tensor<F>, g: usize, i: usize) -> usize {
    let l = x.q.shape(1);
    let heads = x.codebook.shape(0);
    let blocks = x.bias.shape(2) / l;
    let r = g % blocks;
    let h = (g / blocks) % heads;
    let b = g / (blocks * heads);
    b * bias.stride(0) + h * bias.stride(1) + (r * l + i) * bias.stride(2)
}

/// Everything of the score of key `n` for query `i` of block row `g`
/// but the product `q_i . key_n`, as [`AttentionKernelInput`] states it:
/// `NEG` where the key is masked (or `i`, `n` lie past the block or the
/// keys, as a tile's last rows may).
#[cube]
fn term<F: Float>(x: &Operands<F>, g: usize, i: usize, n: usize) -> F {
    let l = x.q.shape(1);
    let mut out = F::new(NEG);
    if i < l && n < key_count::<F>(x) {
        let bias_at = bias_row::<F>(x, &x.bias, g, i);
        if n < l {
            if n <= i {
                out = x.bias[bias_at + (i - n) * x.bias.stride(3)];
            }
        } else if n < 2 * l {
            let j = n - l;
            let r = g % (x.bias.shape(2) / l);
            if x.mask_first == 0 || r > 0 {
                out = F::new(0.0);
                // Distance L + i - j is within the window's bias when j >= i.
                if j >= i {
                    out = x.bias[bias_at + (l + i - j) * x.bias.stride(3)];
                }
            }
        } else {
            let s = n - 2 * l;
            let a = x.log_counts[g * x.log_counts.stride(0) + s * x.log_counts.stride(1)];
            // An empty code's ln 0 = -inf fails this test: it stays masked.
            if a > F::new(NEG) {
                let w = x.count_weight[g * x.count_weight.stride(0) + i * x.count_weight.stride(1)];
                out = w * a + x.shift[g * x.shift.stride(0)];
            }
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

/// Queries `first..first + TILE` of block row `g` into `tile`
/// (`TILE x width`, rows `width + 1` apart), zeros past the block.
#[cube]
fn load_queries<F: Float>(
    x: &Operands<F>,
    g: usize,
    first: usize,
    tile: &mut SharedMemory<F>,
    #[comptime] width: usize,
) {
    let mut e = UNIT_POS as usize;
    while e < TILE * width {
        let i = first + e / width;
        let mut v = F::new(0.0);
        if i < x.q.shape(1) {
            v = x.q[g * x.q.stride(0) + i * x.q.stride(1) + (e % width) * x.q.stride(2)];
        }
        tile[e / width * (width + 1) + e % width] = v;
        e += TILE * TILE;
    }
}

/// Keys `first..first + TILE` of block row `g` (head `h`) into `tile`
/// (`TILE x width`, rows `width + 1` apart), zeros past the keys.
#[cube]
fn load_keys<F: Float>(
    x: &Operands<F>,
    g: usize,
    h: usize,
    first: usize,
    tile: &mut SharedMemory<F>,
    #[comptime] width: usize,
) {
    let keys = key_count::<F>(x);
    let mut e = UNIT_POS as usize;
    while e < TILE * width {
        let n = first + e / width;
        let mut v = F::new(0.0);
        if n < keys {
            v = key::<F>(x, g, h, n, e % width);
        }
        tile[e / width * (width + 1) + e % width] = v;
        e += TILE * TILE;
    }
}

/// Channels `c0..c0 + SLICE` of the values of keys `first..first + TILE`
/// into `tile` (`TILE x SLICE`), zeros past the keys or channels.
#[cube]
fn load_values<F: Float>(
    x: &Operands<F>,
    g: usize,
    first: usize,
    c0: usize,
    tile: &mut SharedMemory<F>,
) {
    let keys = key_count::<F>(x);
    let mut e = UNIT_POS as usize;
    while e < TILE * SLICE {
        let n = first + e / SLICE;
        let c = c0 + e % SLICE;
        let mut v = F::new(0.0);
        if n < keys && c < x.v.shape(2) {
            v = value::<F>(x, g, n, c);
        }
        tile[e] = v;
        e += TILE * TILE;
    }
}

/// Channels `c0..c0 + SLICE` of the output gradient of queries
/// `first..first + TILE` into `tile` (`TILE x SLICE`), zeros past them.
#[cube]
fn load_grads<F: Float>(
    grad: &Tensor<F>,
    g: usize,
    first: usize,
    c0: usize,
    tile: &mut SharedMemory<F>,
) {
    let mut e = UNIT_POS as usize;
    while e < TILE * SLICE {
        let i = first + e / SLICE;
        let c = c0 + e % SLICE;
        let mut v = F::new(0.0);
        if i < grad.shape(1) && c < grad.shape(2) {
            v = grad[g * grad.stride(0) + i * grad.stride(1) + c * grad.stride(2)];
        }
        tile[e] = v;
        e += TILE * TILE;
    }
}

/// The score of key `n` for query `i`, whose rows are `k_row` of `keys`
/// and `q_row` of `queries`; `NEG` where masked.
#[cube]
#[allow(clippy::too_many_arguments)]
fn score<F: Float>(
    x: &Operands<F>,
    g: usize,
    i: usize,
    n: usize,
    queries: &SharedMemory<F>,
    q_row: usize,
    keys: &SharedMemory<F>,
    k_row: usize,
    #[comptime] width: usize,
) -> F {
    let t = term::<F>(x, g, i, n);
    let mut s = F::new(NEG);
    if t > F::new(NEG) {
        let mut dot = F::new(0.0);
        for c in 0..width {
            dot += queries[q_row * (width + 1) + c] * keys[k_row * (width + 1) + c];
        }
        s = dot + t;
    }
    s
}

/// `dO_i . value_n` over every value channel, `CHUNK` channels at a time,
/// for the query of `query_row` and the key of `key_row` of the tiles at
/// `first_query` and `first_key` (`grads`, `values`: `TILE x CHUNK` each,
/// rows `CHUNK + 1` apart).
/// Every unit of the cube calls it.
#[cube]
#[allow(clippy::too_many_arguments)]
fn grad_dot_value<F: Float>(
    x: &Operands<F>,
    grad: &Tensor<F>,
    g: usize,
    first_query: usize,
    first_key: usize,
    query_row: usize,
    key_row: usize,
    grads: &mut SharedMemory<F>,
    values: &mut SharedMemory<F>,
) -> F {
    let l = x.q.shape(1);
    let width = x.v.shape(2);
    let keys = key_count::<F>(x);
    let mut dp = F::new(0.0);
    let mut c0 = 0;
    while c0 < width {
        sync_cube();
        let mut e = UNIT_POS as usize;
        while e < TILE * CHUNK {
            let (row, c) = (e / CHUNK, c0 + e % CHUNK);
            let mut a = F::new(0.0);
            let mut b = F::new(0.0);
            if first_query + row < l && c < width {
                a = grad[g * grad.stride(0)
                    + (first_query + row) * grad.stride(1)
                    + c * grad.stride(2)];
            }
            if first_key + row < keys && c < width {
                b = value::<F>(x, g, first_key + row, c);
            }
            grads[row * (CHUNK + 1) + e % CHUNK] = a;
            values[row * (CHUNK + 1) + e % CHUNK] = b;
            e += TILE * TILE;
        }
        sync_cube();
        for t in 0..CHUNK {
            dp += grads[query_row * (CHUNK + 1) + t] * values[key_row * (CHUNK + 1) + t];
        }
        c0 += CHUNK;
    }
    dp
}

/// `count` accumulators, zero.
#[cube]
fn zeros<F: Float>(#[comptime] count: usize) -> Array<F> {
    let mut acc = Array::<F>::new(count);
    for j in 0..count {
        acc[j] = F::new(0.0);
    }
    acc
}

/// Unit `(y, z)`'s share of a tile product: `acc[j] += sum_t
/// weights[y, t] rows[t, z + j TILE]` for the `acc.len()` columns `z, z +
/// TILE, ...` below `width`, rows `stride` apart.
#[cube]
#[allow(clippy::too_many_arguments)]
fn accumulate<F: Float>(
    acc: &mut Array<F>,
    weights: &SharedMemory<F>,
    rows: &SharedMemory<F>,
    y: usize,
    z: usize,
    #[comptime] count: usize,
    #[comptime] stride: usize,
    #[comptime] width: usize,
) {
    for j in 0..count {
        let c = z + j * TILE;
        if c < width {
            let mut a = acc[j];
            for t in 0..TILE {
                a += weights[y * TILE + t] * rows[t * stride + c];
            }
            acc[j] = a;
        }
    }
}

/// The log-sum-exp of row `i` from each unit's running maximum and sum
/// (`TILE` per row in `maxes`, `sums`).
#[cube]
fn row_lse<F: Float>(maxes: &SharedMemory<F>, sums: &SharedMemory<F>, row: usize) -> F {
    let mut top = F::new(NEG);
    for t in 0..TILE {
        let m = maxes[row * TILE + t];
        if m > top {
            top = m;
        }
    }
    let mut total = F::new(0.0);
    for t in 0..TILE {
        total += sums[row * TILE + t] * (maxes[row * TILE + t] - top).exp();
    }
    top + total.ln()
}

/// A query tile's log-sum-exp: a cube per `(g, query tile)`.
#[cube(launch)]
fn forward_stats<F: Float>(
    x: &Operands<F>,
    lse: &mut Tensor<F>,
    #[comptime] width: usize,
    #[define(F)] _dtype: StorageType,
) {
    let l = x.q.shape(1);
    let keys = key_count::<F>(x);
    let tiles = parts(l, TILE);
    if CUBE_POS >= x.q.shape(0) * tiles {
        terminate!();
    }
    let g = CUBE_POS / tiles;
    let first = (CUBE_POS % tiles) * TILE;
    let (y, z) = (UNIT_POS_Y as usize, UNIT_POS_X as usize);
    let h = head::<F>(x, g);
    let mut queries = SharedMemory::<F>::new(TILE * (width + 1));
    let mut key_tile = SharedMemory::<F>::new(TILE * (width + 1));
    let mut maxes = SharedMemory::<F>::new(TILE * TILE);
    let mut sums = SharedMemory::<F>::new(TILE * TILE);
    load_queries::<F>(x, g, first, &mut queries, width);

    // This unit's running maximum and sum over keys z, z + TILE, ...
    let mut m = F::new(NEG);
    let mut total = F::new(0.0);
    let mut n0 = 0;
    while n0 < keys {
        sync_cube();
        load_keys::<F>(x, g, h, n0, &mut key_tile, width);
        sync_cube();
        let s = score::<F>(x, g, first + y, n0 + z, &queries, y, &key_tile, z, width);
        if s > F::new(NEG) {
            let mut top = m;
            if s > top {
                top = s;
            }
            total = total * (m - top).exp() + (s - top).exp();
            m = top;
        }
        n0 += TILE;
    }
    maxes[y * TILE + z] = m;
    sums[y * TILE + z] = total;
    sync_cube();
    if z == 0 && first + y < l {
        lse[g * lse.stride(0) + (first + y) * lse.stride(1)] = row_lse::<F>(&maxes, &sums, y);
    }
}

/// A query tile's output in one slice of value channels: a cube per
/// `(g, query tile, slice)`.
#[cube(launch)]
fn forward_values<F: Float>(
    x: &Operands<F>,
    lse: &Tensor<F>,
    out: &mut Tensor<F>,
    #[comptime] width: usize,
    #[define(F)] _dtype: StorageType,
) {
    let l = x.q.shape(1);
    let dv = x.v.shape(2);
    let keys = key_count::<F>(x);
    let tiles = parts(l, TILE);
    let slices = parts(dv, SLICE);
    if CUBE_POS >= x.q.shape(0) * tiles * slices {
        terminate!();
    }
    let g = CUBE_POS / (tiles * slices);
    let first = (CUBE_POS / slices % tiles) * TILE;
    let c0 = (CUBE_POS % slices) * SLICE;
    let (y, z) = (UNIT_POS_Y as usize, UNIT_POS_X as usize);
    let h = head::<F>(x, g);
    let i = first + y;
    let mut queries = SharedMemory::<F>::new(TILE * (width + 1));
    let mut key_tile = SharedMemory::<F>::new(TILE * (width + 1));
    let mut values = SharedMemory::<F>::new(TILE * SLICE);
    let mut probs = SharedMemory::<F>::new(TILE * TILE);
    load_queries::<F>(x, g, first, &mut queries, width);
    let mut own_lse = F::new(0.0);
    if i < l {
        own_lse = lse[g * lse.stride(0) + i * lse.stride(1)];
    }
    let mut acc = zeros::<F>(PER_UNIT);
    let mut n0 = 0;
    while n0 < keys {
        sync_cube();
        load_keys::<F>(x, g, h, n0, &mut key_tile, width);
        load_values::<F>(x, g, n0, c0, &mut values);
        sync_cube();
        let s = score::<F>(x, g, i, n0 + z, &queries, y, &key_tile, z, width);
        let mut p = F::new(0.0);
        if s > F::new(NEG) {
            p = (s - own_lse).exp();
        }
        probs[y * TILE + z] = p;
        sync_cube();
        accumulate::<F>(&mut acc, &probs, &values, y, z, PER_UNIT, SLICE, SLICE);
        n0 += TILE;
    }
    for j in 0..PER_UNIT {
        let c = c0 + z + j * TILE;
        if i < l && c < dv {
            out[g * out.stride(0) + i * out.stride(1) + c * out.stride(2)] = acc[j];
        }
    }
}

/// A query tile's `dq`, bias gradient rows and count weight gradient: a
/// cube per `(g, query tile)`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn backward_query<F: Float>(
    x: &Operands<F>,
    lse: &Tensor<F>,
    grad: &Tensor<F>,
    delta: &Tensor<F>,
    dq: &mut Tensor<F>,
    dbias: &mut Tensor<F>,
    dweight: &mut Tensor<F>,
    #[comptime] width: usize,
    #[define(F)] _dtype: StorageType,
) {
    let l = x.q.shape(1);
    let keys = key_count::<F>(x);
    let tiles = parts(l, TILE);
    if CUBE_POS >= x.q.shape(0) * tiles {
        terminate!();
    }
    let g = CUBE_POS / tiles;
    let first = (CUBE_POS % tiles) * TILE;
    let (y, z) = (UNIT_POS_Y as usize, UNIT_POS_X as usize);
    let h = head::<F>(x, g);
    let i = first + y;
    let mut queries = SharedMemory::<F>::new(TILE * (width + 1));
    let mut key_tile = SharedMemory::<F>::new(TILE * (width + 1));
    let mut grads = SharedMemory::<F>::new(TILE * (CHUNK + 1));
    let mut values = SharedMemory::<F>::new(TILE * (CHUNK + 1));
    let mut ds_tile = SharedMemory::<F>::new(TILE * TILE);
    load_queries::<F>(x, g, first, &mut queries, width);
    let mut own_lse = F::new(0.0);
    let mut own_delta = F::new(0.0);
    if i < l {
        own_lse = lse[g * lse.stride(0) + i * lse.stride(1)];
        own_delta = delta[g * delta.stride(0) + i * delta.stride(1)];
    }
    let bias_at = bias_row::<F>(x, dbias, g, i);
    let per_unit = comptime!(width.div_ceil(TILE));
    let mut acc = zeros::<F>(per_unit);
    let mut weight_grad = F::new(0.0);
    let mut n0 = 0;
    while n0 < keys {
        sync_cube();
        load_keys::<F>(x, g, h, n0, &mut key_tile, width);
        sync_cube();
        let n = n0 + z;
        let s = score::<F>(x, g, i, n, &queries, y, &key_tile, z, width);
        let dp = grad_dot_value::<F>(x, grad, g, first, n0, y, z, &mut grads, &mut values);
        let mut ds = F::new(0.0);
        if s > F::new(NEG) {
            ds = (s - own_lse).exp() * (dp - own_delta);
        }
        ds_tile[y * TILE + z] = ds;
        // Distance i - n to a present key, L + i - j to previous key j >= i:
        // each of the row's L + 1 distances is one window key's.
        if i < l && n < l {
            if n <= i {
                dbias[bias_at + (i - n) * dbias.stride(3)] = ds;
            }
        } else if i < l && n < 2 * l {
            let j = n - l;
            if j >= i {
                dbias[bias_at + (l + i - j) * dbias.stride(3)] = ds;
            }
        } else if i < l && n < keys {
            let a = x.log_counts[g * x.log_counts.stride(0) + (n - 2 * l) * x.log_counts.stride(1)];
            if a > F::new(NEG) {
                weight_grad += ds * a;
            }
        }
        sync_cube();
        accumulate::<F>(
            &mut acc,
            &ds_tile,
            &key_tile,
            y,
            z,
            per_unit,
            comptime!(width + 1),
            width,
        );
        n0 += TILE;
    }
    for j in 0..per_unit {
        let c = z + j * TILE;
        if i < l && c < width {
            dq[g * dq.stride(0) + i * dq.stride(1) + c * dq.stride(2)] = acc[j];
        }
    }
    sync_cube();
    ds_tile[y * TILE + z] = weight_grad;
    sync_cube();
    if z == 0 && i < l {
        let mut total = F::new(0.0);
        for t in 0..TILE {
            total += ds_tile[y * TILE + t];
        }
        dweight[g * dweight.stride(0) + i * dweight.stride(1)] = total;
    }
}

/// A tile of window keys' `dk` (present or previous block): a cube per
/// `(g, key tile)` over `2L` keys.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn backward_key<F: Float>(
    x: &Operands<F>,
    lse: &Tensor<F>,
    grad: &Tensor<F>,
    delta: &Tensor<F>,
    dk: &mut Tensor<F>,
    dk_prev: &mut Tensor<F>,
    #[comptime] width: usize,
    #[define(F)] _dtype: StorageType,
) {
    let l = x.q.shape(1);
    let tiles = parts(2 * l, TILE);
    if CUBE_POS >= x.q.shape(0) * tiles {
        terminate!();
    }
    let g = CUBE_POS / tiles;
    let first = (CUBE_POS % tiles) * TILE;
    // Unit (y, z): key `first + y`, query `i0 + z` of each query tile.
    let (y, z) = (UNIT_POS_Y as usize, UNIT_POS_X as usize);
    let h = head::<F>(x, g);
    let n = first + y;
    let mut queries = SharedMemory::<F>::new(TILE * (width + 1));
    let mut key_tile = SharedMemory::<F>::new(TILE * (width + 1));
    let mut grads = SharedMemory::<F>::new(TILE * (CHUNK + 1));
    let mut values = SharedMemory::<F>::new(TILE * (CHUNK + 1));
    let mut ds_tile = SharedMemory::<F>::new(TILE * TILE);
    load_keys::<F>(x, g, h, first, &mut key_tile, width);
    let per_unit = comptime!(width.div_ceil(TILE));
    let mut acc = zeros::<F>(per_unit);
    let mut i0 = 0;
    while i0 < l {
        sync_cube();
        load_queries::<F>(x, g, i0, &mut queries, width);
        sync_cube();
        let i = i0 + z;
        let s = score::<F>(x, g, i, n, &queries, z, &key_tile, y, width);
        let dp = grad_dot_value::<F>(x, grad, g, i0, first, z, y, &mut grads, &mut values);
        let mut ds = F::new(0.0);
        if s > F::new(NEG) {
            let own_lse = lse[g * lse.stride(0) + i * lse.stride(1)];
            let own_delta = delta[g * delta.stride(0) + i * delta.stride(1)];
            ds = (s - own_lse).exp() * (dp - own_delta);
        }
        ds_tile[y * TILE + z] = ds;
        sync_cube();
        accumulate::<F>(
            &mut acc,
            &ds_tile,
            &queries,
            y,
            z,
            per_unit,
            comptime!(width + 1),
            width,
        );
        i0 += TILE;
    }
    for j in 0..per_unit {
        let c = z + j * TILE;
        if c < width {
            if n < l {
                dk[g * dk.stride(0) + n * dk.stride(1) + c * dk.stride(2)] = acc[j];
            } else if n < 2 * l {
                dk_prev
                    [g * dk_prev.stride(0) + (n - l) * dk_prev.stride(1) + c * dk_prev.stride(2)] =
                    acc[j];
            }
        }
    }
}

/// A key tile's value gradients (`dv`, `dv_prev` or the cache means') in
/// one slice of channels, `p^T dO`: a cube per `(g, key tile, slice)`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn backward_values<F: Float>(
    x: &Operands<F>,
    lse: &Tensor<F>,
    grad: &Tensor<F>,
    dv: &mut Tensor<F>,
    dv_prev: &mut Tensor<F>,
    dmeans: &mut Tensor<F>,
    #[comptime] width: usize,
    #[define(F)] _dtype: StorageType,
) {
    let l = x.q.shape(1);
    let channels = x.v.shape(2);
    let keys = key_count::<F>(x);
    let tiles = parts(keys, TILE);
    let slices = parts(channels, SLICE);
    if CUBE_POS >= x.q.shape(0) * tiles * slices {
        terminate!();
    }
    let g = CUBE_POS / (tiles * slices);
    let first = (CUBE_POS / slices % tiles) * TILE;
    let c0 = (CUBE_POS % slices) * SLICE;
    // Unit (y, z): key `first + y`, query `i0 + z` of each query tile.
    let (y, z) = (UNIT_POS_Y as usize, UNIT_POS_X as usize);
    let h = head::<F>(x, g);
    let n = first + y;
    let mut queries = SharedMemory::<F>::new(TILE * (width + 1));
    let mut key_tile = SharedMemory::<F>::new(TILE * (width + 1));
    let mut grads = SharedMemory::<F>::new(TILE * SLICE);
    let mut probs = SharedMemory::<F>::new(TILE * TILE);
    load_keys::<F>(x, g, h, first, &mut key_tile, width);
    let mut acc = zeros::<F>(PER_UNIT);
    let mut i0 = 0;
    while i0 < l {
        sync_cube();
        load_queries::<F>(x, g, i0, &mut queries, width);
        load_grads::<F>(grad, g, i0, c0, &mut grads);
        sync_cube();
        let i = i0 + z;
        let s = score::<F>(x, g, i, n, &queries, z, &key_tile, y, width);
        let mut p = F::new(0.0);
        if s > F::new(NEG) {
            p = (s - lse[g * lse.stride(0) + i * lse.stride(1)]).exp();
        }
        probs[y * TILE + z] = p;
        sync_cube();
        accumulate::<F>(&mut acc, &probs, &grads, y, z, PER_UNIT, SLICE, SLICE);
        i0 += TILE;
    }
    for j in 0..PER_UNIT {
        let c = c0 + z + j * TILE;
        if c < channels {
            if n < l {
                dv[g * dv.stride(0) + n * dv.stride(1) + c * dv.stride(2)] = acc[j];
            } else if n < 2 * l {
                dv_prev
                    [g * dv_prev.stride(0) + (n - l) * dv_prev.stride(1) + c * dv_prev.stride(2)] =
                    acc[j];
            } else if n < keys {
                dmeans[g * dmeans.stride(0)
                    + (n - 2 * l) * dmeans.stride(1)
                    + c * dmeans.stride(2)] = acc[j];
            }
        }
    }
}

/// A cube of `TILE x TILE` units.
fn tile_dim() -> CubeDim {
    CubeDim::new_2d(TILE as u32, TILE as u32)
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

/// [`super::VqKernels::vq_attention_forward`] on a cubecl backend.
pub(super) fn forward<R: CubeRuntime, B: Backend<FloatTensorPrimitive = CubeTensor<R>>>(
    x: &AttentionKernelInput<B>,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let [g, l, dk, dv, _] = sizes(x);
    let dtype = x.q.dtype;
    let out = empty_like(&x.q, vec![g, l, dv], dtype);
    let lse = empty_like(&x.q, vec![g, l], dtype);
    let (client, query_tiles, slices) = (&x.q.client, l.div_ceil(TILE), dv.div_ceil(SLICE));
    forward_stats::launch::<R>(
        client,
        cubes(g * query_tiles),
        tile_dim(),
        operands(x),
        lse.clone().into_tensor_arg(),
        dk,
        dtype.into(),
    );
    forward_values::launch::<R>(
        client,
        cubes(g * query_tiles * slices),
        tile_dim(),
        operands(x),
        lse.clone().into_tensor_arg(),
        out.clone().into_tensor_arg(),
        dk,
        dtype.into(),
    );
    (out, lse)
}

/// [`super::VqKernels::vq_attention_backward`] on a cubecl backend.
pub(super) fn backward<R: CubeRuntime, B: Backend<FloatTensorPrimitive = CubeTensor<R>>>(
    x: AttentionKernelInput<B>,
    out: CubeTensor<R>,
    lse: CubeTensor<R>,
    grad: CubeTensor<R>,
) -> AttentionKernelGrads<B> {
    let [g, l, dk, dv, s] = sizes(&x);
    let dtype = x.q.dtype;
    // D = dO . O per query, [G, L, 1].
    let delta = B::float_sum_dim(B::float_mul(grad.clone(), out), 2);
    let grads = AttentionKernelGrads::<B> {
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
    let slices = dv.div_ceil(SLICE);
    backward_query::launch::<R>(
        &client,
        cubes(g * l.div_ceil(TILE)),
        tile_dim(),
        operands(&x),
        lse.clone().into_tensor_arg(),
        grad.clone().into_tensor_arg(),
        delta.clone().into_tensor_arg(),
        grads.q.clone().into_tensor_arg(),
        grads.bias.clone().into_tensor_arg(),
        grads.count_weight.clone().into_tensor_arg(),
        dk,
        dtype.into(),
    );
    backward_key::launch::<R>(
        &client,
        cubes(g * (2 * l).div_ceil(TILE)),
        tile_dim(),
        operands(&x),
        lse.clone().into_tensor_arg(),
        grad.clone().into_tensor_arg(),
        delta.into_tensor_arg(),
        grads.k.clone().into_tensor_arg(),
        grads.k_prev.clone().into_tensor_arg(),
        dk,
        dtype.into(),
    );
    backward_values::launch::<R>(
        &client,
        cubes(g * (2 * l + s).div_ceil(TILE) * slices),
        tile_dim(),
        operands(&x),
        lse.into_tensor_arg(),
        grad.into_tensor_arg(),
        grads.v.clone().into_tensor_arg(),
        grads.v_prev.clone().into_tensor_arg(),
        grads.means.clone().into_tensor_arg(),
        dk,
        dtype.into(),
    );
    grads
}
