//! The fused VQ attention in CubeCL (CUDA, wgpu): one segment's three
//! groups of keys (present block, previous block, compressed cache), one
//! softmax over them and the weighted values, with no score tensor in
//! device memory. The backward pass recomputes the scores from each
//! query's log-sum-exp, as FlashAttention does.
//!
//! Every kernel works on tiles of `TILE = 32` queries by `TILE` keys, a
//! cube of `16 x 32` units, one row of the tile a unit, 16 warps. The
//! tile's query and key rows are read from device memory once per tile
//! into shared memory, a chunk of channels at a time, and shared by all
//! its units. The scores, `dO . value` and the weighted values and
//! gradients are warps' `16 x 16` tile products (`tile.rs`: on the tensor
//! cores where the device has them) into shared memory, from which unit
//! `(y, z)` takes row `y` and columns `z`, `z + 16, ...` for everything
//! elementwise.
//! Keys number `N = 2L + S` (present `0..L`, previous `L..2L`, codes
//! `2L..`).
//!
//! A cube of 512 units also bounds what a unit may hold: CUDA compiles
//! each kernel for its cube's size, and 512 units share a multiprocessor's
//! 65,536 registers at 128 each, where cubes of 256 let ptxas take 220 and
//! more, for one cube of 8 warps per multiprocessor.
//!
//! - `log_sum_exp`: a cube per query tile: each query's log-sum-exp over
//!   all its keys, from a running maximum and sum of exponents;
//! - `attend`: a cube per query tile and slice of value channels: the
//!   probabilities, final as they are computed from the log-sum-exp,
//!   weigh the values into each warp's tiles of the output, kept in
//!   registers over all the keys (two passes over the scores instead of
//!   FlashAttention's one, which rescales what it has summed as a row's
//!   maximum grows: the tensor cores' fragments hide their rows);
//! - `backward_query`: a cube per query tile: `D = dO . O`, `ds = p (dO
//!   . value - D)`, then `dq` (each warp's tile of it in registers over
//!   the key tiles), the query's row of the bias gradient and its count
//!   weight's gradient, and `ds` of the window keys, from which one
//!   batched matrix product gives `dk` and `dk_prev` (`ds^T q`);
//! - `backward_values`: a cube per key tile and slice of value channels:
//!   `dv`, `dv_prev` and the cache means' gradient, `p^T dO`;
//! - `fold_previous`: each block's previous-key and previous-value
//!   gradients added to those of the block they were read from, the
//!   block before (block 0's previous block is carried: no gradient).
//!
//! Block `r`'s previous block is read in place, block `r - 1` of the
//! segment's keys and values (or the carried block for block 0), so that
//! no copy of them is laid out beside each block.
//!
//! A slice holds up to `MAX_SLICE` value channels (a cube's running sums,
//! `MAX_SLICE / 16` a unit, stay in registers), so `attend` computes the
//! scores once per slice: once at value widths up to 512, three times at
//! enwik8's 1,536 (and `log_sum_exp` once). Value rows and output gradients pass through shared
//! memory `CHUNK` channels at a time.
//!
//! Tiles keep their rows `PAD` elements more than their width apart, as
//! the tensor cores ask.
//!
//! Every output element is written by exactly one unit, so nothing is
//! zeroed first and nothing is accumulated atomically.

use burn::prelude::Backend;
use burn::tensor::TensorMetadata;
use burn_cubecl::CubeRuntime;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::launch::{cubes, empty_like, parts};
use super::tile::{ALIGN, Strides, Sums, WARP, product, tensor_cores};
use super::{AttentionKernelGrads, AttentionKernelInput, SOURCE_HASH};

/// Units along a cube's rows, and rows and columns of a warp's tile.
const SIDE: usize = 16;

/// Queries (and keys) per tile: unit `(y, z)` takes row `y` of it and
/// columns `z` and `z + SIDE`.
const TILE: usize = 2 * SIDE;

/// Units per cube, `SIDE x TILE`: one a row of the tile.
const UNITS: usize = SIDE * TILE;

/// Key channels through shared memory at a time (and value channels in
/// `dO . value`).
const KEY_CHUNK: usize = 32;

/// Value channels through shared memory at a time where values are
/// weighed: the `2 x 8` tiles of a chunk, one for each of a cube's 16
/// warps.
const CHUNK: usize = 128;

/// Channels of queries, output gradients and values through shared memory
/// at a time in `backward_query`, whose whole key tile leaves less room.
const ROW_CHUNK: usize = 16;

/// What rows of the tiles multiplied by warps' tile products hold past
/// their width: 4 floats, so that the tensor cores' rows start
/// 16 bytes apart and their fragments at 32-byte boundaries (`tile.rs`).
const PAD: usize = 4;

/// The channels of a chunk a unit writes.
const PER_CHUNK: usize = CHUNK / SIDE;

/// The most value channels one cube weighs (a unit keeps `MAX_SLICE /
/// SIDE` running sums), unless `TVQ_ATTENTION_SLICE` says otherwise.
const MAX_SLICE: usize = 512;

/// Widest key a tile holds: `backward_query` keeps a whole key tile, `TILE
/// (K + PAD)` floats, beside two chunk tiles (queries or output gradients,
/// and values) and its `ds` and `dp` tiles, in 32 KiB of shared memory.
/// Wider keys compose.
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
    k_carried: Tensor<F>,
    v_carried: Tensor<F>,
    bias: Tensor<F>,
    codebook: Tensor<F>,
    log_counts: Tensor<F>,
    shift: Tensor<F>,
    count_weight: Tensor<F>,
    means: Tensor<F>,
    /// 1 when block 0 of every row has no previous block.
    mask_first: u32,
    /// 1 when the cache's scores add `shift`.
    shifted: u32,
    /// 1 when the cache's scores weigh `log_counts` by `count_weight`.
    weighted: u32,
}

/// Keys a query sees, `2L + S`.
#[cube]
fn key_count<F: Float>(x: &Operands<F>) -> usize {
    2 * x.q.shape(1) + x.codebook.shape(1)
}

/// Blocks per stream, `R`.
#[cube]
fn block_count<F: Float>(x: &Operands<F>) -> usize {
    x.bias.shape(2) / x.q.shape(1)
}

/// The head of block row `g` (`g = (b H + h) R + r`).
#[cube]
fn head<F: Float>(x: &Operands<F>, g: usize) -> usize {
    (g / block_count::<F>(x)) % x.codebook.shape(0)
}

/// Channel `c` of row `j` of block row `g`'s previous block: row `g - 1`
/// of `segment` (`[G, L, W]`), or of `carried` (`[G / R, L, W]`) for a
/// stream's block 0; zero there under `mask_first`, where `carried` is
/// not read (it may be an empty tensor, whose bits would make NaNs of
/// the masked scores and their zero weights).
#[cube]
fn previous<F: Float>(
    x: &Operands<F>,
    segment: &Tensor<F>,
    carried: &Tensor<F>,
    g: usize,
    j: usize,
    c: usize,
) -> F {
    let r = block_count::<F>(x);
    let block = g % r;
    if block > 0 {
        segment[(g - 1) * segment.stride(0) + j * segment.stride(1) + c * segment.stride(2)]
    } else if x.mask_first == 1 {
        F::new(0.0)
    } else {
        carried[g / r * carried.stride(0) + j * carried.stride(1) + c * carried.stride(2)]
    }
}

/// Where query `i` of block row `g` starts in `bias` (or its gradient,
/// of the same shape).
#[cube]
fn bias_row<F: Float>(x: &Operands<F>, bias: &Tensor<F>, g: usize, i: usize) -> usize {
    let l = x.q.shape(1);
    let heads = x.codebook.shape(0);
    let blocks = block_count::<F>(x);
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
            let r = g % block_count::<F>(x);
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
                out = a;
                if x.weighted == 1 {
                    out *=
                        x.count_weight[g * x.count_weight.stride(0) + i * x.count_weight.stride(1)];
                }
                if x.shifted == 1 {
                    out += x.shift[g * x.shift.stride(0)];
                }
            }
        }
    }
    out
}

/// Channel `c` of key `n`'s value: the present or previous block's, or
/// the cache's `means`.
#[cube]
fn value<F: Float>(x: &Operands<F>, g: usize, n: usize, c: usize) -> F {
    let l = x.v.shape(1);
    if n < l {
        x.v[g * x.v.stride(0) + n * x.v.stride(1) + c * x.v.stride(2)]
    } else if n < 2 * l {
        previous::<F>(x, &x.v, &x.v_carried, g, n - l, c)
    } else {
        x.means[g * x.means.stride(0) + (n - 2 * l) * x.means.stride(1) + c * x.means.stride(2)]
    }
}

/// Channel `c` of key `n`: the present or previous block's, or the
/// codeword.
#[cube]
fn key<F: Float>(x: &Operands<F>, g: usize, h: usize, n: usize, c: usize) -> F {
    let l = x.k.shape(1);
    if n < l {
        x.k[g * x.k.stride(0) + n * x.k.stride(1) + c * x.k.stride(2)]
    } else if n < 2 * l {
        previous::<F>(x, &x.k, &x.k_carried, g, n - l, c)
    } else {
        x.codebook[h * x.codebook.stride(0)
            + (n - 2 * l) * x.codebook.stride(1)
            + c * x.codebook.stride(2)]
    }
}

/// Channels `c0..c0 + chunk` of queries `first..first + TILE` of block row
/// `g` into `tile` (`TILE x chunk`, rows `stride` apart), zeros past
/// the block or the key width.
#[cube]
fn load_queries<F: Float>(
    x: &Operands<F>,
    g: usize,
    first: usize,
    c0: usize,
    tile: &mut SharedMemory<F>,
    #[comptime] chunk: usize,
    #[comptime] stride: usize,
) {
    let mut e = UNIT_POS as usize;
    while e < TILE * chunk {
        let (i, c) = (first + e / chunk, c0 + e % chunk);
        let mut v = F::new(0.0);
        if i < x.q.shape(1) && c < x.q.shape(2) {
            v = x.q[g * x.q.stride(0) + i * x.q.stride(1) + c * x.q.stride(2)];
        }
        tile[e / chunk * stride + e % chunk] = v;
        e += UNITS;
    }
}

/// Channels `c0..c0 + chunk` of keys `first..first + TILE` of block row
/// `g` (head `h`) into `tile` (`TILE x chunk`, rows `stride` apart),
/// zeros past the keys or the key width.
#[cube]
fn load_keys<F: Float>(
    x: &Operands<F>,
    g: usize,
    h: usize,
    first: usize,
    c0: usize,
    tile: &mut SharedMemory<F>,
    #[comptime] chunk: usize,
    #[comptime] stride: usize,
) {
    let keys = key_count::<F>(x);
    let mut e = UNIT_POS as usize;
    while e < TILE * chunk {
        let (n, c) = (first + e / chunk, c0 + e % chunk);
        let mut v = F::new(0.0);
        if n < keys && c < x.q.shape(2) {
            v = key::<F>(x, g, h, n, c);
        }
        tile[e / chunk * stride + e % chunk] = v;
        e += UNITS;
    }
}

/// Channels `c0..c0 + chunk` of the values of keys `first..first + TILE`
/// into `tile` (`TILE x chunk`, rows `stride` apart), zeros past the
/// keys or channels.
#[cube]
fn load_values<F: Float>(
    x: &Operands<F>,
    g: usize,
    first: usize,
    c0: usize,
    tile: &mut SharedMemory<F>,
    #[comptime] chunk: usize,
    #[comptime] stride: usize,
) {
    let keys = key_count::<F>(x);
    let mut e = UNIT_POS as usize;
    while e < TILE * chunk {
        let (n, c) = (first + e / chunk, c0 + e % chunk);
        let mut v = F::new(0.0);
        if n < keys && c < x.v.shape(2) {
            v = value::<F>(x, g, n, c);
        }
        tile[e / chunk * stride + e % chunk] = v;
        e += UNITS;
    }
}

/// Channels `c0..c0 + chunk` of the output gradient of queries
/// `first..first + TILE` into `tile` (`TILE x chunk`, rows `stride`
/// apart), zeros past them.
#[cube]
fn load_grads<F: Float>(
    grad: &Tensor<F>,
    g: usize,
    first: usize,
    c0: usize,
    tile: &mut SharedMemory<F>,
    #[comptime] chunk: usize,
    #[comptime] stride: usize,
) {
    let mut e = UNIT_POS as usize;
    while e < TILE * chunk {
        let (i, c) = (first + e / chunk, c0 + e % chunk);
        let mut v = F::new(0.0);
        if i < grad.shape(1) && c < grad.shape(2) {
            v = grad[g * grad.stride(0) + i * grad.stride(1) + c * grad.stride(2)];
        }
        tile[e / chunk * stride + e % chunk] = v;
        e += UNITS;
    }
}

/// The score of key `n` for query `i` whose product `q_i . key_n` is
/// `dot`: `NEG` where masked.
#[cube]
fn score<F: Float>(x: &Operands<F>, g: usize, i: usize, n: usize, dot: F) -> F {
    let t = term::<F>(x, g, i, n);
    let mut s = F::new(NEG);
    if t > F::new(NEG) {
        s = dot + t;
    }
    s
}

/// The sum of `part` over the `SIDE` units of the unit's row, through
/// `scratch` (`TILE x SIDE` at least). Every unit of the cube calls it.
#[cube]
fn row_sum<F: Float>(scratch: &mut SharedMemory<F>, y: usize, z: usize, part: F) -> F {
    sync_cube();
    scratch[y * SIDE + z] = part;
    sync_cube();
    let mut total = F::new(0.0);
    for t in 0..SIDE {
        total += scratch[y * SIDE + t];
    }
    total
}

/// `q . key` of queries `i0..i0 + TILE` and keys `n0..n0 + TILE` of block
/// row `g` into `probs` (`TILE x TILE`; queries on its rows, or keys where
/// `by_key`), through `queries` and `key_tile` (`TILE x (KEY_CHUNK +
/// PAD)` each) `KEY_CHUNK` channels at a time: warp `w < 4` takes the
/// `16 x 16` tile `(w / 2, w % 2)`. Every unit of the cube calls it.
#[cube]
#[allow(clippy::too_many_arguments)]
fn score_tile<F: Float>(
    x: &Operands<F>,
    g: usize,
    h: usize,
    i0: usize,
    n0: usize,
    queries: &mut SharedMemory<F>,
    key_tile: &mut SharedMemory<F>,
    probs: &mut SharedMemory<F>,
    #[comptime] width: usize,
    #[comptime] by_key: bool,
    #[comptime] tensor_cores: bool,
) {
    let stride = comptime!(KEY_CHUNK + PAD);
    let (warp, lane) = (UNIT_POS as usize / WARP, UNIT_POS as usize % WARP);
    let (row, col) = (warp / 2 * SIDE, warp % 2 * SIDE);
    let mut k0 = 0usize;
    while k0 < width {
        sync_cube();
        load_queries::<F>(x, g, i0, k0, queries, KEY_CHUNK, stride);
        load_keys::<F>(x, g, h, n0, k0, key_tile, KEY_CHUNK, stride);
        sync_cube();
        if warp < 4 {
            let strides = comptime!(Strides {
                a: stride,
                b: stride,
                c: TILE,
            });
            if comptime!(by_key) {
                product::<F>(
                    probs,
                    row * TILE + col,
                    key_tile,
                    row * stride,
                    queries,
                    col * stride,
                    k0 == 0,
                    lane,
                    strides,
                    KEY_CHUNK,
                    true,
                    tensor_cores,
                );
            } else {
                product::<F>(
                    probs,
                    row * TILE + col,
                    queries,
                    row * stride,
                    key_tile,
                    col * stride,
                    k0 == 0,
                    lane,
                    strides,
                    KEY_CHUNK,
                    true,
                    tensor_cores,
                );
            }
        }
        k0 += KEY_CHUNK;
    }
    sync_cube();
}

/// `probs`, as [`score_tile`] left it (`q . key`), made the probabilities
/// `exp(score - lse)` of its queries for its keys, 0 where masked (rows
/// are queries from `i0` and columns keys from `n0`, or the other way
/// round where `by_key`). Unit `(y, z)` takes row `y` and columns `z`,
/// `z + SIDE`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn probabilities<F: Float>(
    x: &Operands<F>,
    lse: &Tensor<F>,
    probs: &mut SharedMemory<F>,
    g: usize,
    i0: usize,
    n0: usize,
    #[comptime] by_key: bool,
) {
    let (r, z) = (UNIT_POS_Y as usize, UNIT_POS_X as usize);
    #[unroll]
    for b in 0..2usize {
        let c = z + b * SIDE;
        let mut i = i0 + r;
        let mut n = n0 + c;
        if comptime!(by_key) {
            i = i0 + c;
            n = n0 + r;
        }
        let s = score::<F>(x, g, i, n, probs[r * TILE + c]);
        let mut p = F::new(0.0);
        // Only a query of the block has an unmasked score.
        if s > F::new(NEG) {
            p = (s - lse[g * lse.stride(0) + i * lse.stride(1)]).exp();
        }
        probs[r * TILE + c] = p;
    }
}

/// Each query's log-sum-exp of its scores `[G, L]`, the first of the
/// forward pass's two: a cube per `(g, query tile)`. The `2 x 2` score
/// tiles are warps 0-3's tile products; unit `(y, z)` then takes query
/// `y` and keeps its running maximum and sum of exponents over each key
/// tile's row (every unit of a row the same), so that no barrier is
/// needed beyond the scores'.
#[cube(launch)]
fn log_sum_exp<F: Float>(
    x: &Operands<F>,
    lse: &mut Tensor<F>,
    #[comptime] width: usize,
    #[comptime] tensor_cores: bool,
    #[comptime] _source: u64,
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
    let key_stride = comptime!(KEY_CHUNK + PAD);
    let mut queries = SharedMemory::<F>::new_aligned(TILE * key_stride, ALIGN);
    let mut key_tile = SharedMemory::<F>::new_aligned(TILE * key_stride, ALIGN);
    let mut probs = SharedMemory::<F>::new_aligned(TILE * TILE, ALIGN);
    let i = first + y;
    let mut m = F::new(NEG);
    let mut total = F::new(0.0);
    let mut n0 = 0;
    while n0 < keys {
        score_tile::<F>(
            x,
            g,
            h,
            first,
            n0,
            &mut queries,
            &mut key_tile,
            &mut probs,
            width,
            false,
            tensor_cores,
        );
        #[unroll]
        for b in 0..2usize {
            let at = y * TILE + z + b * SIDE;
            probs[at] = score::<F>(x, g, i, n0 + z + b * SIDE, probs[at]);
        }
        sync_cube();
        // (The next tile's scores overwrite `probs` after score_tile's
        // first barrier: these reads are done by then.)
        let mut top = m;
        for t in 0..TILE {
            top = F::max(top, probs[y * TILE + t]);
        }
        // exp(m - top) is 0 while m is still NEG and 1 while both are.
        let mut sum = total * (m - top).exp();
        for t in 0..TILE {
            let s = probs[y * TILE + t];
            if s > F::new(NEG) {
                sum += (s - top).exp();
            }
        }
        m = top;
        total = sum;
        n0 += TILE;
    }
    if i < l && z == 0 {
        lse[g * lse.stride(0) + i * lse.stride(1)] = m + total.ln();
    }
}

/// A query tile's output in one slice of `chunks CHUNK` value channels,
/// the second of the forward pass's two: a cube per `(g, query tile,
/// slice)`. With each query's log-sum-exp known, the probabilities are
/// final as they are computed, so that each warp keeps its tiles of `p
/// value` in registers over all the key tiles ([`Sums`]) with no rescale,
/// as [`backward_values`] keeps `p^T dO`. The `2 x 2` score tiles are
/// warps 0-3's tile products; warp `w` sums tile `(w / 8, w % 8)` of each
/// chunk of weighted values.
#[cube(launch)]
fn attend<F: Float>(
    x: &Operands<F>,
    lse: &Tensor<F>,
    out: &mut Tensor<F>,
    #[comptime] width: usize,
    #[comptime] chunks: usize,
    #[comptime] tensor_cores: bool,
    #[comptime] _source: u64,
    #[define(F)] _dtype: StorageType,
) {
    let l = x.q.shape(1);
    let dv = x.v.shape(2);
    let keys = key_count::<F>(x);
    let tiles = parts(l, TILE);
    let slices = parts(dv, comptime!(chunks * CHUNK));
    if CUBE_POS >= x.q.shape(0) * tiles * slices {
        terminate!();
    }
    let g = CUBE_POS / (tiles * slices);
    let first = (CUBE_POS / slices % tiles) * TILE;
    let c0 = (CUBE_POS % slices) * comptime!(chunks * CHUNK);
    let (y, z) = (UNIT_POS_Y as usize, UNIT_POS_X as usize);
    let h = head::<F>(x, g);
    let key_stride = comptime!(KEY_CHUNK + PAD);
    let value_stride = comptime!(CHUNK + PAD);
    let mut queries = SharedMemory::<F>::new_aligned(TILE * key_stride, ALIGN);
    let mut key_tile = SharedMemory::<F>::new_aligned(TILE * key_stride, ALIGN);
    let mut probs = SharedMemory::<F>::new_aligned(TILE * TILE, ALIGN);
    let mut values = SharedMemory::<F>::new_aligned(TILE * value_stride, ALIGN);
    let (warp, lane) = (UNIT_POS as usize / WARP, UNIT_POS as usize % WARP);
    let (row, col) = (warp / 8 * SIDE, warp % 8 * SIDE);
    let mut sums = Sums::<F>::new(chunks, tensor_cores);
    let mut n0 = 0;
    while n0 < keys {
        score_tile::<F>(
            x,
            g,
            h,
            first,
            n0,
            &mut queries,
            &mut key_tile,
            &mut probs,
            width,
            false,
            tensor_cores,
        );
        probabilities::<F>(x, lse, &mut probs, g, first, n0, false);
        #[unroll]
        for k in 0..chunks {
            sync_cube();
            load_values::<F>(x, g, n0, c0 + k * CHUNK, &mut values, CHUNK, value_stride);
            sync_cube();
            sums.add(
                k,
                &probs,
                row * TILE,
                &values,
                col,
                lane,
                comptime!(Strides {
                    a: TILE,
                    b: value_stride,
                    c: 0,
                }),
                TILE,
                false,
                tensor_cores,
            );
        }
        n0 += TILE;
    }
    // Each chunk's sums through `values` to the units that write them.
    #[unroll]
    for k in 0..chunks {
        sync_cube();
        sums.store(
            k,
            &mut values,
            row * value_stride + col,
            lane,
            value_stride,
            tensor_cores,
        );
        sync_cube();
        let i = first + y;
        #[unroll]
        for j in 0..PER_CHUNK {
            let c = c0 + k * CHUNK + z + j * SIDE;
            if i < l && c < dv {
                out[g * out.stride(0) + i * out.stride(1) + c * out.stride(2)] =
                    values[y * value_stride + z + j * SIDE];
            }
        }
    }
}

/// A query tile's `dq`, bias gradient rows, count weight gradient and
/// `ds` of the window keys (`[G, L, 2L]`): a cube per `(g, query tile)`.
/// Unit `(y, z)` takes query `y` of the tile and keys `z`, `z + SIDE` of
/// each key tile.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn backward_query<F: Float>(
    x: &Operands<F>,
    lse: &Tensor<F>,
    grad: &Tensor<F>,
    out: &Tensor<F>,
    dq: &mut Tensor<F>,
    dbias: &mut Tensor<F>,
    dweight: &mut Tensor<F>,
    ds_window: &mut Tensor<F>,
    #[comptime] width: usize,
    #[comptime] tensor_cores: bool,
    #[comptime] _source: u64,
    #[define(F)] _dtype: StorageType,
) {
    let l = x.q.shape(1);
    let dv = x.v.shape(2);
    let keys = key_count::<F>(x);
    let tiles = parts(l, TILE);
    if CUBE_POS >= x.q.shape(0) * tiles {
        terminate!();
    }
    let g = CUBE_POS / tiles;
    let first = (CUBE_POS % tiles) * TILE;
    let (y, z) = (UNIT_POS_Y as usize, UNIT_POS_X as usize);
    let (warp, lane) = (UNIT_POS as usize / WARP, UNIT_POS as usize % WARP);
    let h = head::<F>(x, g);
    // The key tile stays whole (for `dq = ds key`), its rows a whole number
    // of chunks wide (zeros past the key width) so that the chunked
    // products never read past a row.
    let padded = comptime!(width.div_ceil(KEY_CHUNK) * KEY_CHUNK);
    let key_stride = comptime!(padded + PAD);
    let row_stride = comptime!(ROW_CHUNK + PAD);
    let mut key_tile = SharedMemory::<F>::new_aligned(TILE * key_stride, ALIGN);
    // Query chunks, then output gradient chunks.
    let mut rows = SharedMemory::<F>::new_aligned(TILE * row_stride, ALIGN);
    let mut values = SharedMemory::<F>::new_aligned(TILE * row_stride, ALIGN);
    // q . key, then ds; and dO . value.
    let mut ds_tile = SharedMemory::<F>::new_aligned(TILE * TILE, ALIGN);
    let mut dp_tile = SharedMemory::<F>::new_aligned(TILE * TILE, ALIGN);
    let (score_row, score_col) = (warp / 2 * SIDE, warp % 2 * SIDE);
    let scores = comptime!(Strides {
        a: row_stride,
        b: key_stride,
        c: TILE,
    });
    let products = comptime!(Strides {
        a: row_stride,
        b: row_stride,
        c: TILE,
    });
    // D = dO_i . O_i, each unit summing every SIDE-th channel of its row.
    let i = first + y;
    let mut part = F::new(0.0);
    let mut own_lse = F::new(0.0);
    if i < l {
        own_lse = lse[g * lse.stride(0) + i * lse.stride(1)];
        let mut c = z;
        while c < dv {
            part += grad[g * grad.stride(0) + i * grad.stride(1) + c * grad.stride(2)]
                * out[g * out.stride(0) + i * out.stride(1) + c * out.stride(2)];
            c += SIDE;
        }
    }
    let own_delta = row_sum::<F>(&mut ds_tile, y, z, part);
    // Warp w's running sum of dq = ds key over the key tiles: tile (w /
    // columns, w % columns) of the TILE x padded tile of dq, where there is
    // one (at most 16: 2 x 8 at keys 128 wide).
    let columns = comptime!(padded / SIDE);
    let dq_tiles = comptime!(2 * columns);
    let (dq_row, dq_col) = (warp / columns * SIDE, warp % columns * SIDE);
    let mut dq_sums = Sums::<F>::new(1usize, tensor_cores);
    let mut weight_grad = F::new(0.0);
    let mut n0 = 0;
    while n0 < keys {
        sync_cube();
        load_keys::<F>(x, g, h, n0, 0, &mut key_tile, padded, key_stride);
        // q . key into `ds_tile`, ROW_CHUNK channels at a time.
        let mut kc = 0usize;
        while kc < width {
            sync_cube();
            load_queries::<F>(x, g, first, kc, &mut rows, ROW_CHUNK, row_stride);
            sync_cube();
            if warp < 4 {
                product::<F>(
                    &mut ds_tile,
                    score_row * TILE + score_col,
                    &rows,
                    score_row * row_stride,
                    &key_tile,
                    score_col * key_stride + kc,
                    kc == 0,
                    lane,
                    scores,
                    ROW_CHUNK,
                    true,
                    tensor_cores,
                );
            }
            kc += ROW_CHUNK;
        }
        // dO_i . value_n over every value channel into `dp_tile`.
        let mut vc = 0usize;
        while vc < dv {
            sync_cube();
            load_grads::<F>(grad, g, first, vc, &mut rows, ROW_CHUNK, row_stride);
            load_values::<F>(x, g, n0, vc, &mut values, ROW_CHUNK, row_stride);
            sync_cube();
            if warp < 4 {
                product::<F>(
                    &mut dp_tile,
                    score_row * TILE + score_col,
                    &rows,
                    score_row * row_stride,
                    &values,
                    score_col * row_stride,
                    vc == 0,
                    lane,
                    products,
                    ROW_CHUNK,
                    true,
                    tensor_cores,
                );
            }
            vc += ROW_CHUNK;
        }
        sync_cube();
        let bias_at = bias_row::<F>(x, dbias, g, i);
        #[unroll]
        for b in 0..2usize {
            let n = n0 + z + b * SIDE;
            let at = y * TILE + z + b * SIDE;
            let s = score::<F>(x, g, i, n, ds_tile[at]);
            let mut ds = F::new(0.0);
            if s > F::new(NEG) {
                ds = (s - own_lse).exp() * (dp_tile[at] - own_delta);
            }
            ds_tile[at] = ds;
            if i < l && n < 2 * l {
                ds_window
                    [g * ds_window.stride(0) + i * ds_window.stride(1) + n * ds_window.stride(2)] =
                    ds;
            }
            // Distance i - n to a present key, L + i - j to previous key
            // j >= i: each of the row's L + 1 distances is one window key's.
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
                let w =
                    x.log_counts[g * x.log_counts.stride(0) + (n - 2 * l) * x.log_counts.stride(1)];
                if w > F::new(NEG) {
                    weight_grad += ds * w;
                }
            }
        }
        sync_cube();
        if warp < dq_tiles {
            dq_sums.add(
                0usize,
                &ds_tile,
                dq_row * TILE,
                &key_tile,
                dq_col,
                lane,
                comptime!(Strides {
                    a: TILE,
                    b: key_stride,
                    c: 0,
                }),
                TILE,
                false,
                tensor_cores,
            );
        }
        n0 += TILE;
    }
    // dq through `key_tile` to the units that write it.
    sync_cube();
    if warp < dq_tiles {
        dq_sums.store(
            0usize,
            &mut key_tile,
            dq_row * key_stride + dq_col,
            lane,
            key_stride,
            tensor_cores,
        );
    }
    sync_cube();
    #[unroll]
    for j in 0..columns {
        let c = z + j * SIDE;
        if i < l && c < width {
            dq[g * dq.stride(0) + i * dq.stride(1) + c * dq.stride(2)] =
                key_tile[y * key_stride + c];
        }
    }
    let total = row_sum::<F>(&mut ds_tile, y, z, weight_grad);
    if z == 0 && i < l {
        dweight[g * dweight.stride(0) + i * dweight.stride(1)] = total;
    }
}

/// A key tile's value gradients (`dv`, `dv_prev` or the cache means') in
/// one slice of `chunks CHUNK` channels, `p^T dO`: a cube per `(g, key
/// tile, slice)`. The products are warps' tile products, as in `attend`,
/// the scores with keys on the rows and queries on the columns; unit `(y,
/// z)` takes key `y` of the tile and queries `z`, `z + SIDE` of each
/// query tile for the probabilities. Each warp keeps its tiles of
/// the gradients in registers over all query tiles (`Sums`), and they
/// reach device memory once, through shared memory.
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
    #[comptime] chunks: usize,
    #[comptime] means_grad: bool,
    #[comptime] tensor_cores: bool,
    #[comptime] _source: u64,
    #[define(F)] _dtype: StorageType,
) {
    let l = x.q.shape(1);
    let channels = x.v.shape(2);
    // Without the means' gradient the cache's key tiles have nothing to do.
    let keys = if comptime!(means_grad) {
        key_count::<F>(x)
    } else {
        2 * l
    };
    let tiles = parts(keys, TILE);
    let slices = parts(channels, comptime!(chunks * CHUNK));
    if CUBE_POS >= x.q.shape(0) * tiles * slices {
        terminate!();
    }
    let g = CUBE_POS / (tiles * slices);
    let first = (CUBE_POS / slices % tiles) * TILE;
    let c0 = (CUBE_POS % slices) * comptime!(chunks * CHUNK);
    let (y, z) = (UNIT_POS_Y as usize, UNIT_POS_X as usize);
    let h = head::<F>(x, g);
    let key_stride = comptime!(KEY_CHUNK + PAD);
    let grad_stride = comptime!(CHUNK + PAD);
    let mut queries = SharedMemory::<F>::new_aligned(TILE * key_stride, ALIGN);
    let mut key_tile = SharedMemory::<F>::new_aligned(TILE * key_stride, ALIGN);
    let mut grads = SharedMemory::<F>::new_aligned(TILE * grad_stride, ALIGN);
    let mut probs = SharedMemory::<F>::new_aligned(TILE * TILE, ALIGN);
    // Warp w's running sums: tile (w / 8, w % 8) of each chunk of channels.
    let (warp, lane) = (UNIT_POS as usize / WARP, UNIT_POS as usize % WARP);
    let (row, col) = (warp / 8 * SIDE, warp % 8 * SIDE);
    let mut sums = Sums::<F>::new(chunks, tensor_cores);
    let mut i0 = 0;
    while i0 < l {
        score_tile::<F>(
            x,
            g,
            h,
            i0,
            first,
            &mut queries,
            &mut key_tile,
            &mut probs,
            width,
            true,
            tensor_cores,
        );
        probabilities::<F>(x, lse, &mut probs, g, i0, first, true);
        #[unroll]
        for k in 0..chunks {
            sync_cube();
            load_grads::<F>(grad, g, i0, c0 + k * CHUNK, &mut grads, CHUNK, grad_stride);
            sync_cube();
            sums.add(
                k,
                &probs,
                row * TILE,
                &grads,
                col,
                lane,
                comptime!(Strides {
                    a: TILE,
                    b: grad_stride,
                    c: 0,
                }),
                TILE,
                false,
                tensor_cores,
            );
        }
        i0 += TILE;
    }
    // Each chunk's sums through `grads` to the units that write them.
    let n = first + y;
    #[unroll]
    for k in 0..chunks {
        sync_cube();
        sums.store(
            k,
            &mut grads,
            row * grad_stride + col,
            lane,
            grad_stride,
            tensor_cores,
        );
        sync_cube();
        #[unroll]
        for j in 0..PER_CHUNK {
            let c = c0 + k * CHUNK + z + j * SIDE;
            let v = grads[y * grad_stride + z + j * SIDE];
            if c < channels {
                if n < l {
                    dv[g * dv.stride(0) + n * dv.stride(1) + c * dv.stride(2)] = v;
                } else if n < 2 * l {
                    dv_prev[g * dv_prev.stride(0)
                        + (n - l) * dv_prev.stride(1)
                        + c * dv_prev.stride(2)] = v;
                } else if n < keys {
                    dmeans[g * dmeans.stride(0)
                        + (n - 2 * l) * dmeans.stride(1)
                        + c * dmeans.stride(2)] = v;
                }
            }
        }
    }
}

/// Units per cube of [`fold_previous`].
const FOLD_UNITS: usize = 256;

/// `dk` `[G, L, K]` and `dv` `[G, L, V]` of each block row `g` with the
/// next row's previous-block gradients added where that row is of the
/// same stream: `dk_g = window_g[..L] + window_{g+1}[L..]` from `window`
/// `[G, 2L, K]` (`ds^T q`), `dv_g += dv_prev_{g+1}`. A unit per element.
#[cube(launch)]
fn fold_previous<F: Float>(
    window: &Tensor<F>,
    dv_prev: &Tensor<F>,
    dk: &mut Tensor<F>,
    dv: &mut Tensor<F>,
    blocks: usize,
    #[comptime] _source: u64,
    #[define(F)] _dtype: StorageType,
) {
    let (l, width_k, width_v) = (dk.shape(1), dk.shape(2), dv.shape(2));
    let per_row = l * (width_k + width_v);
    let e = CUBE_POS * FOLD_UNITS + UNIT_POS as usize;
    if e >= dk.shape(0) * per_row {
        terminate!();
    }
    let (g, at) = (e / per_row, e % per_row);
    let next = (g + 1) % blocks != 0;
    if at < l * width_k {
        let (j, c) = (at / width_k, at % width_k);
        let mut sum = window[g * window.stride(0) + j * window.stride(1) + c * window.stride(2)];
        if next {
            sum += window
                [(g + 1) * window.stride(0) + (l + j) * window.stride(1) + c * window.stride(2)];
        }
        dk[g * dk.stride(0) + j * dk.stride(1) + c * dk.stride(2)] = sum;
    } else if next {
        let (j, c) = ((at - l * width_k) / width_v, (at - l * width_k) % width_v);
        dv[g * dv.stride(0) + j * dv.stride(1) + c * dv.stride(2)] +=
            dv_prev[(g + 1) * dv_prev.stride(0) + j * dv_prev.stride(1) + c * dv_prev.stride(2)];
    }
}

/// A cube of `SIDE x TILE` units: `UNIT_POS_X` in `0..SIDE`, `UNIT_POS_Y`
/// in `0..TILE`.
fn tile_dim() -> CubeDim {
    CubeDim::new_2d(SIDE as u32, TILE as u32)
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
        x.k_carried.clone().into_tensor_arg(),
        x.v_carried.clone().into_tensor_arg(),
        x.bias.clone().into_tensor_arg(),
        x.codebook.clone().into_tensor_arg(),
        x.log_counts.clone().into_tensor_arg(),
        x.shift.clone().into_tensor_arg(),
        x.count_weight.clone().into_tensor_arg(),
        x.means.clone().into_tensor_arg(),
        x.flags.mask_first as u32,
        x.flags.shifted as u32,
        x.flags.weighted as u32,
    )
}

/// The most value channels one cube weighs: `TVQ_ATTENTION_SLICE` where it
/// is 128 or 256, the switch that times the trade between recomputing
/// each tile's scores once per slice and the registers that a wider
/// slice's running sums take; else `MAX_SLICE`.
fn max_slice() -> usize {
    match std::env::var("TVQ_ATTENTION_SLICE").as_deref() {
        Ok("128") => 128,
        Ok("256") => 256,
        _ => MAX_SLICE,
    }
}

/// The chunks of a slice where values of width `dv` are weighed, over as
/// few slices of at most `max_slice` channels as cover `dv`.
fn chunks(dv: usize, max_slice: usize) -> usize {
    let slices = dv.div_ceil(max_slice).max(1);
    dv.div_ceil(slices * CHUNK).max(1)
}

/// [`super::VqKernels::vq_attention_forward`] on a cubecl backend.
pub(super) fn forward<R: CubeRuntime, B: Backend<FloatTensorPrimitive = CubeTensor<R>>>(
    x: &AttentionKernelInput<B>,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let [g, l, dk, dv, _] = sizes(x);
    let dtype = x.q.dtype;
    let out = empty_like(&x.q, vec![g, l, dv], dtype);
    let lse = empty_like(&x.q, vec![g, l], dtype);
    let tensor_cores = tensor_cores(&x.q.client, dtype);
    log_sum_exp::launch::<R>(
        &x.q.client,
        cubes(g * l.div_ceil(TILE)),
        tile_dim(),
        operands(x),
        lse.clone().into_tensor_arg(),
        dk,
        tensor_cores,
        SOURCE_HASH,
        dtype.into(),
    );
    let chunks = chunks(dv, max_slice());
    let slices = dv.div_ceil(chunks * CHUNK);
    attend::launch::<R>(
        &x.q.client,
        cubes(g * l.div_ceil(TILE) * slices),
        tile_dim(),
        operands(x),
        lse.clone().into_tensor_arg(),
        out.clone().into_tensor_arg(),
        dk,
        chunks,
        tensor_cores,
        SOURCE_HASH,
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
    let (dq, dbias, dweight) = (
        empty_like(&x.q, vec![g, l, dk], dtype),
        empty_like(&x.q, x.bias.shape().dims::<4>().to_vec(), dtype),
        empty_like(&x.q, vec![g, l], dtype),
    );
    // The window keys' ds, [G, L, 2L] (present keys, then previous ones).
    let ds = empty_like(&x.q, vec![g, l, 2 * l], dtype);
    let (dv_present, dv_prev, dmeans) = (
        empty_like(&x.q, vec![g, l, dv], dtype),
        empty_like(&x.q, vec![g, l, dv], dtype),
        empty_like(&x.q, vec![g, s, dv], dtype),
    );
    let client = x.q.client.clone();
    backward_query::launch::<R>(
        &client,
        cubes(g * l.div_ceil(TILE)),
        tile_dim(),
        operands(&x),
        lse.clone().into_tensor_arg(),
        grad.clone().into_tensor_arg(),
        out.into_tensor_arg(),
        dq.clone().into_tensor_arg(),
        dbias.clone().into_tensor_arg(),
        dweight.clone().into_tensor_arg(),
        ds.clone().into_tensor_arg(),
        dk,
        tensor_cores(&client, dtype),
        SOURCE_HASH,
        dtype.into(),
    );
    let chunks = chunks(dv, max_slice());
    let keys = 2 * l + if x.flags.means_grad { s } else { 0 };
    backward_values::launch::<R>(
        &client,
        cubes(g * keys.div_ceil(TILE) * dv.div_ceil(chunks * CHUNK)),
        tile_dim(),
        operands(&x),
        lse.into_tensor_arg(),
        grad.into_tensor_arg(),
        dv_present.clone().into_tensor_arg(),
        dv_prev.clone().into_tensor_arg(),
        dmeans.clone().into_tensor_arg(),
        dk,
        chunks,
        x.flags.means_grad,
        tensor_cores(&client, dtype),
        SOURCE_HASH,
        dtype.into(),
    );
    // dk and dk_prev: ds^T q, [G, 2L, L] x [G, L, K] = [G, 2L, K].
    let window = B::float_matmul(B::float_swap_dims(ds, 1, 2), x.q);
    let dk_all = if x.flags.prev_grad {
        let out = empty_like(&window, vec![g, l, dk], dtype);
        let blocks = x.bias.shape().dims::<4>()[2] / l;
        fold_previous::launch::<R>(
            &client,
            cubes((g * l * (dk + dv)).div_ceil(FOLD_UNITS)),
            CubeDim::new_1d(FOLD_UNITS as u32),
            window.into_tensor_arg(),
            dv_prev.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            dv_present.clone().into_tensor_arg(),
            blocks,
            SOURCE_HASH,
            dtype.into(),
        );
        out
    } else {
        B::float_slice(window, &[(0..g).into(), (0..l).into(), (0..dk).into()])
    };
    AttentionKernelGrads::<B> {
        q: dq,
        k: dk_all,
        v: dv_present,
        bias: dbias,
        means: dmeans,
        count_weight: dweight,
    }
}

#[cfg(test)]
mod tests {
    use std::process::Command;

    use burn::backend::wgpu::{WgpuDevice, WgpuRuntime};
    use cubecl::cuda::CudaCompiler;
    use cubecl::prelude::*;
    use cubecl::{Compiler, Runtime};
    use tvq_testkit::{Gpu, crate_dir, python_with};

    use super::*;

    /// `kernel` as the CUDA C++ that cubecl's CUDA runtime hands NVRTC on a
    /// device of compute capability 9.0 (launched checked, as `launch`
    /// does). The kernel is defined through a client of another runtime:
    /// its definition reads only the comptime arguments given here.
    fn cuda_source<K: CubeKernel>(kernel: K) -> String {
        let mut options = <CudaCompiler as Compiler>::CompilationOptions::default();
        let features = &mut options.supports_features;
        (features.grid_constants, features.clusters) = (true, true);
        (features.elect_sync, features.fast_math) = (true, true);
        let address = kernel.address_type();
        CudaCompiler::default()
            .compile(kernel.define(), &options, ExecutionMode::Checked, address)
            .expect("cubecl compiles the kernel to CUDA C++")
            .to_string()
    }

    /// What a kernel compiled from these tensors sees of [`Operands`].
    fn operands<F: Float>() -> OperandsCompilationArg<F> {
        let tensor = || TensorCompilationArg { inplace: None };
        OperandsCompilationArg {
            q: tensor(),
            k: tensor(),
            v: tensor(),
            k_carried: tensor(),
            v_carried: tensor(),
            bias: tensor(),
            codebook: tensor(),
            log_counts: tensor(),
            shift: tensor(),
            count_weight: tensor(),
            means: tensor(),
            mask_first: (),
            shifted: (),
            weighted: (),
        }
    }

    /// The four kernels that multiply tiles, for keys `width` wide and
    /// `chunks` chunks of value channels a slice, on the tensor cores or the units.
    fn sources(
        client: &ComputeClient<WgpuRuntime>,
        width: usize,
        chunks: usize,
        tensor_cores: bool,
    ) -> Vec<(&'static str, String)> {
        let tensor = || TensorCompilationArg { inplace: None };
        let settings = || {
            KernelSettings::default()
                .cube_dim(tile_dim())
                .address_type(AddressType::U32)
        };
        let dtype = f32::as_type_native_unchecked().storage_type();
        vec![
            (
                "log_sum_exp",
                cuda_source(log_sum_exp::LogSumExp::<WgpuRuntime>::new(
                    settings(),
                    client.clone(),
                    operands(),
                    tensor(),
                    width,
                    tensor_cores,
                    SOURCE_HASH,
                    dtype,
                )),
            ),
            (
                "attend",
                cuda_source(attend::Attend::<WgpuRuntime>::new(
                    settings(),
                    client.clone(),
                    operands(),
                    tensor(),
                    tensor(),
                    width,
                    chunks,
                    tensor_cores,
                    SOURCE_HASH,
                    dtype,
                )),
            ),
            (
                "backward_query",
                cuda_source(backward_query::BackwardQuery::<WgpuRuntime>::new(
                    settings(),
                    client.clone(),
                    operands(),
                    tensor(),
                    tensor(),
                    tensor(),
                    tensor(),
                    tensor(),
                    tensor(),
                    tensor(),
                    width,
                    tensor_cores,
                    SOURCE_HASH,
                    dtype,
                )),
            ),
            (
                "backward_values",
                cuda_source(backward_values::BackwardValues::<WgpuRuntime>::new(
                    settings(),
                    client.clone(),
                    operands(),
                    tensor(),
                    tensor(),
                    tensor(),
                    tensor(),
                    tensor(),
                    width,
                    chunks,
                    true,
                    tensor_cores,
                    SOURCE_HASH,
                    dtype,
                )),
            ),
        ]
    }

    /// A kernel's id, under which cubecl caches its compiled form, holds
    /// the hash of the kernels' sources it was launched with.
    #[test]
    fn a_kernels_id_changes_with_the_sources() {
        let test = "a_kernels_id_changes_with_the_sources";
        let up = std::panic::catch_unwind(|| WgpuRuntime::client(&WgpuDevice::DefaultDevice));
        let Ok(client) = up else {
            Gpu::Wgpu.missing(test, "no wgpu adapter answered");
            return;
        };
        let dtype = f32::as_type_native_unchecked().storage_type();
        let id = |source: u64| {
            let settings = KernelSettings::default().cube_dim(tile_dim());
            let tensor = TensorCompilationArg { inplace: None };
            let kernel = log_sum_exp::LogSumExp::<WgpuRuntime>::new(
                settings,
                client.clone(),
                operands(),
                tensor,
                64,
                false,
                source,
                dtype,
            );
            kernel.id().stable_hash()
        };
        assert_eq!(id(SOURCE_HASH), id(SOURCE_HASH));
        assert_ne!(id(SOURCE_HASH), id(SOURCE_HASH ^ 1));
    }

    /// The kernels compile for an H100 (`sm_90a`) with NVRTC, as cubecl's
    /// CUDA runtime compiles them, at the test model's and enwik8's widths
    /// (and enwik8's in slices of 256 value channels), in both forms:
    /// lavapipe runs only the units' form, so without this nothing
    /// compiled the tensor cores' `wmma` calls before a GPU did.
    /// NVRTC and CUDA's headers come with PyTorch's CUDA wheels; no GPU is
    /// needed. Prints what ptxas says of each (`--nocapture`; fields in
    /// `scripts/nvrtc_check.py`).
    #[test]
    fn the_kernels_compile_for_an_h100() {
        let test = "the_kernels_compile_for_an_h100";
        let Some(python) = python_with(test, &["cuda.bindings.nvrtc", "nvidia.cu13", "triton"])
        else {
            return;
        };
        let up = std::panic::catch_unwind(|| WgpuRuntime::client(&WgpuDevice::DefaultDevice));
        let Ok(client) = up else {
            Gpu::Wgpu.missing(test, "no wgpu adapter answered");
            return;
        };
        let dir = tempfile::tempdir().unwrap();
        let mut files = Vec::new();
        for (width, dv, slice) in [
            (64, 512, MAX_SLICE),
            (128, 1536, MAX_SLICE),
            (128, 1536, 256),
        ] {
            for tensor_cores in [true, false] {
                let chunks = chunks(dv, slice);
                for (kernel, source) in sources(&client, width, chunks, tensor_cores) {
                    // The form asked for is the form written.
                    assert_eq!(source.contains("wmma::"), tensor_cores, "{kernel}");
                    let form = if tensor_cores {
                        "tensor-cores"
                    } else {
                        "units"
                    };
                    let file = dir
                        .path()
                        .join(format!("{kernel}-k{width}-v{dv}-s{slice}-{form}.cu"));
                    std::fs::write(&file, source).unwrap();
                    files.push(file);
                }
            }
        }
        let script = crate_dir().join("../../scripts/nvrtc_check.py");
        let out = Command::new(python)
            .arg(script)
            .args(&files)
            .output()
            .unwrap();
        let report = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{report}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let compiled: Vec<serde_json::Value> = report
            .lines()
            .map(|line| serde_json::from_str(line).unwrap())
            .collect();
        assert_eq!(compiled.len(), files.len(), "{report}");
        for figures in &compiled {
            assert!(figures["registers"].as_u64().unwrap() > 0, "{figures}");
            println!("{figures}");
        }
    }
}
