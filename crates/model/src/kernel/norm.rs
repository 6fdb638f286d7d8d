//! The sum of the squares of many tensors in CubeCL (CUDA, wgpu): the
//! global gradient norm of a training step in a few launches, where the
//! composed ops take one reduction per gradient and an addition per pair.
//!
//! The tensors travel as one sequence argument, up to `PER_LAUNCH` per
//! launch. A cube sums the squares of one chunk of one
//! tensor into a partial `[n, chunks]`; cubes past a tensor's last chunk
//! write zero, so every partial is written and one sum of them all is the
//! total.

use burn::tensor::DType;
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::SOURCE_HASH;
use super::launch::{empty_like, flat_chunks, per_launch};

/// Units per cube, each summing every `UNITS`-th element of the chunk.
const UNITS: usize = 256;

/// The most tensors per launch (each is a branch of the unrolled kernel),
/// fewer where the device binds fewer buffers at once.
const PER_LAUNCH: usize = 32;

/// Cube `(c, y)` writes `partials[first + y, c]`: the sum of the squares
/// of elements `c chunk..(c + 1) chunk` of `tensors[y]`, read as a flat
/// buffer.
#[cube(launch)]
fn sum_squares<F: Float>(
    tensors: &Sequence<Tensor<F>>,
    partials: &mut Tensor<F>,
    first: usize,
    chunk: usize,
    #[comptime] _source: u64,
    #[define(F)] _dtype: StorageType,
) {
    let (c, y) = (CUBE_POS_X as usize, CUBE_POS_Y as usize);
    let unit = UNIT_POS as usize;
    let mut part = F::new(0.0);
    #[unroll]
    for k in 0..tensors.len() {
        if y == k {
            let t = tensors.index(k);
            let mut end = c * chunk + chunk;
            if end > t.len() {
                end = t.len();
            }
            let mut at = c * chunk + unit;
            while at < end {
                let x = t[at];
                part += x * x;
                at += UNITS;
            }
        }
    }
    // A tree over the cube's units through shared memory.
    let mut scratch = SharedMemory::<F>::new(UNITS);
    scratch[unit] = part;
    sync_cube();
    #[unroll]
    for s in 1..comptime!(UNITS.trailing_zeros() as usize + 1) {
        let half = comptime!(UNITS >> s);
        if unit < half {
            let other = scratch[unit + half];
            scratch[unit] += other;
        }
        sync_cube();
    }
    if unit == 0 {
        partials[(first + y) * partials.stride(0) + c] = scratch[0];
    }
}

/// [`super::VqKernels::vq_sum_squares`] on a cubecl backend: the partial
/// sums `[n, chunks]` (their sum is the total), or `None` where the
/// tensors are not all of one float type.
pub(super) fn partials<R: CubeRuntime>(tensors: Vec<CubeTensor<R>>) -> Option<CubeTensor<R>> {
    let dtype: DType = tensors[0].dtype;
    if tensors.iter().any(|t| t.dtype != dtype) {
        return None;
    }
    // A flat read needs a tensor's elements alone in their buffer, in any order.
    let tensors: Vec<_> = tensors
        .into_iter()
        .map(|t| {
            if t.is_contiguous_buffer() {
                t
            } else {
                into_contiguous(t)
            }
        })
        .collect();
    let lens: Vec<usize> = tensors
        .iter()
        .map(|t| t.meta.shape().num_elements())
        .collect();
    let (chunk, chunks) = flat_chunks(&lens, UNITS);
    let partials = empty_like(&tensors[0], vec![tensors.len(), chunks], dtype);
    let client = tensors[0].client.clone();
    let per_launch = per_launch(&client, 1, PER_LAUNCH);
    for (i, group) in tensors.chunks(per_launch).enumerate() {
        sum_squares::launch::<R>(
            &client,
            CubeCount::Static(chunks as u32, group.len() as u32, 1),
            CubeDim::new_1d(UNITS as u32),
            group.iter().map(|t| t.clone().into_tensor_arg()).collect(),
            partials.clone().into_tensor_arg(),
            i * per_launch,
            chunk,
            SOURCE_HASH,
            dtype.into(),
        );
    }
    Some(partials)
}
