//! What every kernel's launch needs: how many cubes, new output tensors,
//! and the one integer helper kernels lack.

use burn::tensor::{DType, Shape};
use burn_cubecl::CubeRuntime;
use burn_cubecl::ops::numeric::empty_device_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

/// How many parts of `size` cover `n` (`div_ceil`, which kernels lack).
#[cube]
#[allow(clippy::manual_div_ceil)]
pub(crate) fn parts(n: usize, #[comptime] size: usize) -> usize {
    (n + size - 1) / size
}

/// `count` accumulators, zero.
#[cube]
pub(crate) fn zeros<F: Float>(#[comptime] count: usize) -> Array<F> {
    let mut acc = Array::<F>::new(count);
    for j in 0..count {
        acc[j] = F::new(0.0);
    }
    acc
}

/// Cubes for `count` cubes of work, one each: CUDA and Vulkan allow 65,535
/// along an axis, so they wrap onto a second axis (`CUBE_POS` counts them
/// in order; the excess cubes of the last line stop at once).
pub(crate) fn cubes(count: usize) -> CubeCount {
    let x = count.clamp(1, 65_535);
    CubeCount::Static(x as u32, count.div_ceil(x).max(1) as u32, 1)
}

/// A new tensor of `shape` and `dtype` on `like`'s device.
pub(crate) fn empty_like<R: CubeRuntime>(
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
