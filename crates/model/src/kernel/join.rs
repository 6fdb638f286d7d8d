//! Tensors joined along their last axis in CubeCL (CUDA, wgpu): one
//! launch, where burn's `cat` under fusion assigns each tensor into its
//! columns of the output in a launch of its own. The backward step of the
//! projections onto blocks of a weight's columns joins the blocks'
//! gradients so.
//!
//! The tensors travel as one sequence argument, up to `PER_LAUNCH` per
//! launch, each read flat (row-major, contiguous); a cube copies one chunk
//! of one tensor into its columns of the output.

use burn::tensor::DType;
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::SOURCE_HASH;
use super::launch::{empty_like, flat_chunks, per_launch};

/// Units per cube, each copying every `UNITS`-th element of the chunk.
const UNITS: usize = 256;

/// The most tensors per launch (each is a branch of the unrolled kernel).
const PER_LAUNCH: usize = 8;

/// Cube `(c, y)` copies elements `c chunk..(c + 1) chunk` of `parts[y]`
/// (`[rows, n_y]`, flat) to `out` (`[rows, N]`, flat): element `e` to row
/// `e / n_y`, column `offset + (sum of n_k for k < y) + e % n_y`.
#[cube(launch)]
fn join<F: Float>(
    parts: &Sequence<Tensor<F>>,
    out: &mut Tensor<F>,
    rows: usize,
    offset: usize,
    chunk: usize,
    #[comptime] _source: u64,
    #[define(F)] _dtype: StorageType,
) {
    let (c, y) = (CUBE_POS_X as usize, CUBE_POS_Y as usize);
    let width = out.len() / rows;
    let mut start = offset;
    #[unroll]
    for k in 0..parts.len() {
        let t = parts.index(k);
        let n = t.len() / rows;
        if y == k {
            let mut end = c * chunk + chunk;
            if end > t.len() {
                end = t.len();
            }
            let mut e = c * chunk + UNIT_POS as usize;
            while e < end {
                out[(e / n) * width + start + e % n] = t[e];
                e += UNITS;
            }
        }
        start += n;
    }
}

/// The shape of parts of these shapes and types (each `[.., n_i]`) joined
/// along their last axis, `[.., sum n_i]`: `None` (the kernel declines)
/// where there are none, they are not all of one type or alike but for
/// the last axis, or they have no rows.
pub(super) fn joined_shape(
    parts: impl IntoIterator<Item = (Vec<usize>, DType)>,
) -> Option<Vec<usize>> {
    let mut parts = parts.into_iter();
    let (mut shape, dtype) = parts.next()?;
    let last = shape.len().checked_sub(1)?;
    for (dims, d) in parts {
        if d != dtype || dims.len() != shape.len() || dims[..last] != shape[..last] {
            return None;
        }
        shape[last] += dims[last];
    }
    (shape[..last].iter().product::<usize>() > 0).then_some(shape)
}

/// [`super::VqKernels::vq_join`] on a cubecl backend: `parts` joined along
/// their last axis, or `None` where [`joined_shape`] declines them.
pub(super) fn join_last<R: CubeRuntime>(parts: Vec<CubeTensor<R>>) -> Option<CubeTensor<R>> {
    let shape = joined_shape(parts.iter().map(|t| (t.meta.shape().to_vec(), t.dtype)))?;
    let dtype: DType = parts[0].dtype;
    let parts: Vec<_> = parts.into_iter().map(into_contiguous).collect();
    let last = shape.len() - 1;
    let rows: usize = shape[..last].iter().product();
    let widths: Vec<usize> = parts.iter().map(|t| t.meta.shape()[last]).collect();
    let out = empty_like(&parts[0], shape, dtype);
    let lens: Vec<usize> = widths.iter().map(|n| rows * n).collect();
    let (chunk, chunks) = flat_chunks(&lens, UNITS);
    let client = out.client.clone();
    let per_launch = per_launch(&client, 1, PER_LAUNCH);
    let mut offset = 0;
    for (group, widths) in parts.chunks(per_launch).zip(widths.chunks(per_launch)) {
        join::launch::<R>(
            &client,
            CubeCount::Static(chunks as u32, group.len() as u32, 1),
            CubeDim::new_1d(UNITS as u32),
            group.iter().map(|t| t.clone().into_tensor_arg()).collect(),
            out.clone().into_tensor_arg(),
            rows,
            offset,
            chunk,
            SOURCE_HASH,
            dtype.into(),
        );
        offset += widths.iter().sum::<usize>();
    }
    Some(out)
}
