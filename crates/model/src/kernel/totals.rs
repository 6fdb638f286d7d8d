//! Code totals in CubeCL (CUDA, wgpu): how much weight each code carries
//! within each group of tokens, and the weighted sum of the tokens' values,
//! in one kernel where the composed ops take a one-hot mask, an index
//! computation and two scatter-adds into zeroed tables (about ten
//! launches).
//!
//! - `code_totals`: the quantizer's codebook statistics;
//! - `block_caches`: the compressed cache every block of a segment sees,
//!   a running total over the segment's previous blocks merged into the
//!   carried cache, and the cache after the segment, where the composed
//!   ops add two cumulative sums and the merges (about twenty launches).
//!
//! A cube holds `TILE` codes of one output row and a slice of up to
//! `TILE * MAX_PER_UNIT` value channels: unit `(y, z)` totals code `y`'s
//! channels `z, z + TILE, ...`. The group's codes and weights pass through
//! shared memory `TOKENS` at a time; a unit reads a token's values only
//! where the token carries its code. Every output element is written by
//! exactly one unit.

use burn::tensor::{DType, TensorMetadata};
use burn_cubecl::CubeRuntime;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::SOURCE_HASH;
use super::launch::{cubes, empty_like, parts, zeros};

/// Codes (and channel lanes) per cube: a cube is `TILE x TILE` units.
const TILE: usize = 16;

/// Tokens through shared memory at a time, one per unit.
const TOKENS: usize = TILE * TILE;

/// The most accumulators a unit keeps: a slice is at most `TILE *
/// MAX_PER_UNIT` channels.
const MAX_PER_UNIT: usize = 16;

/// Codes `[G, N]`, weights `[G, N]` (read only when `weighted`), values
/// `[G, N, W]`: row `o` of counts `[O, S]` and sums `[O, S, W]` totals
/// the groups `g = o, o + O, ...`. A cube per `(o, code tile, slice)`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn code_totals<F: Float, I: Int>(
    codes: &Tensor<I>,
    weight: &Tensor<F>,
    values: &Tensor<F>,
    counts: &mut Tensor<F>,
    sums: &mut Tensor<F>,
    #[comptime] weighted: bool,
    #[comptime] per_unit: usize,
    #[comptime] _source: u64,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let (groups, n) = (codes.shape(0), codes.shape(1));
    let (rows, s) = (counts.shape(0), counts.shape(1));
    let width = values.shape(2);
    let (o, code, c0) = place(rows, s, width, per_unit);
    let mut token_codes = SharedMemory::<I>::new(TOKENS);
    let mut token_weights = SharedMemory::<F>::new(TOKENS);
    let mut count = F::new(0.0);
    let mut acc = zeros::<F>(per_unit);
    let mut g = o;
    while g < groups {
        add_tokens::<F, I>(
            codes,
            weight,
            values,
            g,
            0,
            n,
            code,
            code < s,
            c0,
            &mut count,
            &mut acc,
            &mut token_codes,
            &mut token_weights,
            weighted,
            per_unit,
        );
        g += rows;
    }
    if code < s {
        #[unroll]
        for j in 0..per_unit {
            let c = c0 + j * TILE;
            if c < width {
                sums[o * sums.stride(0) + code * sums.stride(1) + c * sums.stride(2)] = acc[j];
            }
        }
        if c0 == 0 {
            counts[o * counts.stride(0) + code * counts.stride(1)] = count;
        }
    }
}

/// Unit `(y, z)`'s output row, code and first channel, for `rows` rows of
/// `s` codes and values `width` wide: a cube per `(row, code tile,
/// slice)`. The excess cubes of [`cubes`]' last line stop here.
#[cube]
fn place(
    rows: usize,
    s: usize,
    width: usize,
    #[comptime] per_unit: usize,
) -> (usize, usize, usize) {
    let tiles = parts(s, TILE);
    let slices = parts(width, comptime!(per_unit * TILE));
    if CUBE_POS >= rows * tiles * slices {
        terminate!();
    }
    let o = CUBE_POS / (tiles * slices);
    let code = (CUBE_POS / slices % tiles) * TILE + UNIT_POS_Y as usize;
    let c0 = (CUBE_POS % slices) * comptime!(per_unit * TILE) + UNIT_POS_X as usize;
    (o, code, c0)
}

/// Adds tokens `first..first + count` of group `g` that carry `code`
/// into `total` (their weights, or 1 each unless `weighted`) and `acc`
/// (channels `c0 + j TILE` of their weighted values), where the unit
/// `owns` a code; codes and weights pass through shared memory. Every unit
/// of the cube calls it.
#[cube]
#[allow(clippy::too_many_arguments)]
fn add_tokens<F: Float, I: Int>(
    codes: &Tensor<I>,
    weight: &Tensor<F>,
    values: &Tensor<F>,
    g: usize,
    first: usize,
    count: usize,
    code: usize,
    owns: bool,
    c0: usize,
    total: &mut F,
    acc: &mut Array<F>,
    token_codes: &mut SharedMemory<I>,
    token_weights: &mut SharedMemory<F>,
    #[comptime] weighted: bool,
    #[comptime] per_unit: usize,
) {
    let width = values.shape(2);
    let mut n0 = 0;
    while n0 < count {
        sync_cube();
        let t = first + n0 + UNIT_POS as usize;
        // Past the tokens: code 0 at weight 0, skipped below.
        let mut z = I::cast_from(0);
        let mut w = F::new(0.0);
        if n0 + (UNIT_POS as usize) < count {
            z = codes[g * codes.stride(0) + t * codes.stride(1)];
            w = F::new(1.0);
            if comptime!(weighted) {
                w = weight[g * weight.stride(0) + t * weight.stride(1)];
            }
        }
        token_codes[UNIT_POS as usize] = z;
        token_weights[UNIT_POS as usize] = w;
        sync_cube();
        for e in 0..TOKENS {
            if owns && n0 + e < count && token_codes[e] == I::cast_from(code) {
                let w = token_weights[e];
                *total += w;
                let at = g * values.stride(0) + (first + n0 + e) * values.stride(1);
                #[unroll]
                for j in 0..per_unit {
                    let c = c0 + j * TILE;
                    if c < width {
                        acc[j] += w * values[at + c * values.stride(2)];
                    }
                }
            }
        }
        n0 += TOKENS;
    }
}

/// The cache of `n_c` keys of mean `mean` (`per_unit` channels) with
/// `total` keys of value sum `acc` merged in, written at `counts[at]` and
/// at `means[at_means + c stride]` for its channels `c = c0 + j TILE`
/// below `width`: `n = n_c + total` and `mean n_c / d + acc / d`, `d =
/// max(n, 1)`, as the composed merge.
#[cube]
#[allow(clippy::too_many_arguments)]
fn write_cache<F: Float>(
    counts: &mut Tensor<F>,
    means: &mut Tensor<F>,
    at: usize,
    at_means: usize,
    n_c: F,
    mean: &Array<F>,
    total: F,
    acc: &Array<F>,
    c0: usize,
    width: usize,
    stride: usize,
    #[comptime] per_unit: usize,
) {
    let n = n_c + total;
    let denom = F::max(n, F::new(1.0));
    #[unroll]
    for j in 0..per_unit {
        let c = c0 + j * TILE;
        if c < width {
            means[at_means + c * stride] = mean[j] * (n_c / denom) + acc[j] / denom;
        }
    }
    if c0 == 0 {
        counts[at] = n;
    }
}

/// The caches of a segment of `R` blocks (see
/// [`super::VqKernels::vq_block_caches`]): a cube per `(g, code tile,
/// slice)`, walking the blocks in order with a running total. The carried
/// tensors are not read when `fresh`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn block_caches<F: Float, I: Int>(
    carried_codes: &Tensor<I>,
    carried_values: &Tensor<F>,
    codes: &Tensor<I>,
    values: &Tensor<F>,
    carried_counts: &Tensor<F>,
    carried_means: &Tensor<F>,
    counts: &mut Tensor<F>,
    means: &mut Tensor<F>,
    counts_after: &mut Tensor<F>,
    means_after: &mut Tensor<F>,
    #[comptime] per_unit: usize,
    #[comptime] fresh: bool,
    #[comptime] _source: u64,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let (groups, s) = (carried_counts.shape(0), carried_counts.shape(1));
    let width = values.shape(2);
    let blocks = counts.shape(1);
    let l = carried_codes.shape(1);
    let (g, code, c0) = place(groups, s, width, per_unit);
    let mut token_codes = SharedMemory::<I>::new(TOKENS);
    let mut token_weights = SharedMemory::<F>::new(TOKENS);
    // The carried cache of this unit's code and channels (empty when fresh).
    let mut n_c = F::new(0.0);
    let mut mean = zeros::<F>(per_unit);
    let mut acc = zeros::<F>(per_unit);
    if comptime!(!fresh) {
        #[unroll]
        for j in 0..per_unit {
            let c = c0 + j * TILE;
            if code < s && c < width {
                mean[j] = carried_means[g * carried_means.stride(0)
                    + code * carried_means.stride(1)
                    + c * carried_means.stride(2)];
            }
        }
        if code < s {
            n_c = carried_counts[g * carried_counts.stride(0) + code * carried_counts.stride(1)];
        }
    }
    let mut total = F::new(0.0);
    for r in 0..blocks {
        if code < s {
            write_cache::<F>(
                counts,
                means,
                g * counts.stride(0) + r * counts.stride(1) + code * counts.stride(2),
                g * means.stride(0) + r * means.stride(1) + code * means.stride(2),
                n_c,
                &mean,
                total,
                &acc,
                c0,
                width,
                means.stride(3),
                per_unit,
            );
        }
        // Block r's previous block (the carried one, or the segment's
        // block r - 1) joins the caches of the blocks after it.
        if r == 0 {
            if comptime!(!fresh) {
                add_tokens::<F, I>(
                    carried_codes,
                    carried_values,
                    carried_values,
                    g,
                    0,
                    l,
                    code,
                    code < s,
                    c0,
                    &mut total,
                    &mut acc,
                    &mut token_codes,
                    &mut token_weights,
                    false,
                    per_unit,
                );
            }
        } else {
            add_tokens::<F, I>(
                codes,
                values,
                values,
                g,
                (r - 1) * l,
                l,
                code,
                code < s,
                c0,
                &mut total,
                &mut acc,
                &mut token_codes,
                &mut token_weights,
                false,
                per_unit,
            );
        }
    }
    if code < s {
        write_cache::<F>(
            counts_after,
            means_after,
            g * counts_after.stride(0) + code * counts_after.stride(1),
            g * means_after.stride(0) + code * means_after.stride(1),
            n_c,
            &mean,
            total,
            &acc,
            c0,
            width,
            means_after.stride(2),
            per_unit,
        );
    }
}

/// A unit's accumulators for values `width` channels wide: as few slices
/// of at most `TILE * MAX_PER_UNIT` channels as cover them.
fn per_unit(width: usize) -> usize {
    let slices = width.div_ceil(TILE * MAX_PER_UNIT).max(1);
    width.div_ceil(slices * TILE).max(1)
}

/// [`super::VqKernels::vq_code_totals`] on a cubecl backend.
pub(super) fn totals<R: CubeRuntime>(
    codes: CubeTensor<R>,
    weight: Option<CubeTensor<R>>,
    values: CubeTensor<R>,
    n_code: usize,
    rows: usize,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let width = values.shape().dims::<3>()[2];
    let dtype: DType = values.dtype;
    let counts = empty_like(&values, vec![rows, n_code], dtype);
    let sums = empty_like(&values, vec![rows, n_code, width], dtype);
    let per_unit = per_unit(width);
    let slices = width.div_ceil(per_unit * TILE).max(1);
    let int = codes.dtype;
    let weighted = weight.is_some();
    let weight = weight.unwrap_or_else(|| values.clone());
    code_totals::launch::<R>(
        &values.client.clone(),
        cubes(rows * n_code.div_ceil(TILE) * slices),
        CubeDim::new_2d(TILE as u32, TILE as u32),
        codes.into_tensor_arg(),
        weight.into_tensor_arg(),
        values.into_tensor_arg(),
        counts.clone().into_tensor_arg(),
        sums.clone().into_tensor_arg(),
        weighted,
        per_unit,
        SOURCE_HASH,
        [dtype.into(), int.into()],
    );
    (counts, sums)
}

/// [`super::VqKernels::vq_block_caches`] on a cubecl backend: `codes`
/// and `values` are the carried block's and the segment's.
pub(super) fn caches<R: CubeRuntime>(
    [carried_codes, codes]: [CubeTensor<R>; 2],
    [carried_values, values]: [CubeTensor<R>; 2],
    carried_counts: CubeTensor<R>,
    carried_means: CubeTensor<R>,
    fresh: bool,
) -> [CubeTensor<R>; 4] {
    let [g, n, width] = values.shape().dims();
    let blocks = n / carried_codes.shape().dims::<2>()[1];
    let s = carried_counts.shape().dims::<2>()[1];
    let dtype: DType = values.dtype;
    let outputs = [
        vec![g, blocks, s],
        vec![g, blocks, s, width],
        vec![g, s],
        vec![g, s, width],
    ]
    .map(|shape| empty_like(&values, shape, dtype));
    let per_unit = per_unit(width);
    let slices = width.div_ceil(per_unit * TILE).max(1);
    let int = codes.dtype;
    block_caches::launch::<R>(
        &values.client.clone(),
        cubes(g * s.div_ceil(TILE) * slices),
        CubeDim::new_2d(TILE as u32, TILE as u32),
        carried_codes.into_tensor_arg(),
        carried_values.into_tensor_arg(),
        codes.into_tensor_arg(),
        values.into_tensor_arg(),
        carried_counts.into_tensor_arg(),
        carried_means.into_tensor_arg(),
        outputs[0].clone().into_tensor_arg(),
        outputs[1].clone().into_tensor_arg(),
        outputs[2].clone().into_tensor_arg(),
        outputs[3].clone().into_tensor_arg(),
        per_unit,
        fresh,
        SOURCE_HASH,
        [dtype.into(), int.into()],
    );
    outputs
}
