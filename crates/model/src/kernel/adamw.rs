//! AdamW over many parameters in CubeCL (CUDA, wgpu): a training step's
//! gradient scaling (clipping) and the AdamW update of every parameter in
//! a few launches, where the composed ops take a scaling and a fused
//! elementwise kernel or more per parameter.
//!
//! The tensors travel as sequence arguments, up to `PER_LAUNCH`
//! parameters per launch (seven tensors each); a cube updates one chunk of
//! one parameter, reading and writing every tensor flat, in one order
//! (all are contiguous). The per-parameter scalars are rows of a small
//! table (`ROW` columns, [`super::AdamwScalars::row`]).

use burn::tensor::DType;
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::launch::{empty_like, flat_chunks, per_launch};
use super::{ROW, SOURCE_HASH};

/// Units per cube, each updating every `UNITS`-th element of the chunk.
const UNITS: usize = 256;

/// The most parameters per launch (each a branch of the unrolled kernel
/// and seven bindings), fewer where the device binds fewer buffers.
const PER_LAUNCH: usize = 16;

/// Cube `(c, y)` steps elements `c chunk..(c + 1) chunk` of parameter
/// `first + y` (`params[y]`): the gradient scaled, the moments moved, the
/// bias-corrected update and the decoupled decay, in the order of burn's
/// AdamW.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn adamw<F: Float>(
    params: &Sequence<Tensor<F>>,
    grads: &Sequence<Tensor<F>>,
    m1s: &Sequence<Tensor<F>>,
    m2s: &Sequence<Tensor<F>>,
    new_params: &mut Sequence<Tensor<F>>,
    new_m1s: &mut Sequence<Tensor<F>>,
    new_m2s: &mut Sequence<Tensor<F>>,
    table: &Tensor<F>,
    first: usize,
    chunk: usize,
    #[comptime] _source: u64,
    #[define(F)] _dtype: StorageType,
) {
    let (c, y) = (CUBE_POS_X as usize, CUBE_POS_Y as usize);
    let row = (first + y) * ROW;
    let lr = table[row];
    let keep = table[row + 1];
    let (c1, c2) = (table[row + 2], table[row + 3]);
    let (beta1, rest1) = (table[row + 4], table[row + 5]);
    let (beta2, rest2) = (table[row + 6], table[row + 7]);
    let (epsilon, scale) = (table[row + 8], table[row + 9]);
    #[unroll]
    for k in 0..params.len() {
        if y == k {
            let p = params.index(k);
            let g = grads.index(k);
            let m1 = m1s.index(k);
            let m2 = m2s.index(k);
            let out = new_params.index_mut(k);
            let out1 = new_m1s.index_mut(k);
            let out2 = new_m2s.index_mut(k);
            let mut end = c * chunk + chunk;
            if end > p.len() {
                end = p.len();
            }
            let mut at = c * chunk + UNIT_POS as usize;
            while at < end {
                let grad = g[at] * scale;
                let a = m1[at] * beta1 + grad * rest1;
                let b = m2[at] * beta2 + grad * grad * rest2;
                let delta = (a / c1) / (F::sqrt(b / c2) + epsilon);
                out[at] = p[at] * keep - delta * lr;
                out1[at] = a;
                out2[at] = b;
                at += UNITS;
            }
        }
    }
}

/// [`super::VqKernels::vq_adamw`] on a cubecl backend: `tensors` are each
/// parameter's four (parameter, gradient, first and second moment) in
/// turn, `table` their scalars `[n, ROW]`; the new parameters and moments,
/// three per parameter in turn. `None` where the tensors are not all of
/// the table's float type.
pub(super) fn step<R: CubeRuntime>(
    tensors: Vec<CubeTensor<R>>,
    table: CubeTensor<R>,
) -> Option<Vec<CubeTensor<R>>> {
    let dtype: DType = table.dtype;
    if tensors.iter().any(|t| t.dtype != dtype) {
        return None;
    }
    // Flat reads pair elements only in one layout: row-major, each alone.
    let tensors: Vec<_> = tensors.into_iter().map(into_contiguous).collect();
    let table = into_contiguous(table);
    let n = tensors.len() / 4;
    let lens: Vec<usize> = (0..n)
        .map(|i| tensors[4 * i].meta.shape().num_elements())
        .collect();
    let (chunk, chunks) = flat_chunks(&lens, UNITS);
    let outputs: Vec<CubeTensor<R>> = (0..3 * n)
        .map(|j| {
            let like = &tensors[4 * (j / 3)];
            empty_like(like, like.meta.shape().to_vec(), dtype)
        })
        .collect();
    let client = table.client.clone();
    // Seven bindings a parameter (and the table's).
    let per_launch = per_launch(&client, 7, PER_LAUNCH);
    let arg = |i: usize| tensors[i].clone().into_tensor_arg();
    let out = |j: usize| outputs[j].clone().into_tensor_arg();
    for start in (0..n).step_by(per_launch) {
        let group = start..(start + per_launch).min(n);
        let seq = |of: &dyn Fn(usize) -> TensorArg<R>| group.clone().map(of).collect();
        adamw::launch::<R>(
            &client,
            CubeCount::Static(chunks as u32, group.len() as u32, 1),
            CubeDim::new_1d(UNITS as u32),
            seq(&|i| arg(4 * i)),
            seq(&|i| arg(4 * i + 1)),
            seq(&|i| arg(4 * i + 2)),
            seq(&|i| arg(4 * i + 3)),
            seq(&|i| out(3 * i)),
            seq(&|i| out(3 * i + 1)),
            seq(&|i| out(3 * i + 2)),
            table.clone().into_tensor_arg(),
            start,
            chunk,
            SOURCE_HASH,
            dtype.into(),
        );
    }
    Some(outputs)
}
