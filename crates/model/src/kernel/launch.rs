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
    let x = count.clamp(1, MAX_AXIS);
    CubeCount::Static(x as u32, count.div_ceil(x).max(1) as u32, 1)
}

/// The most cubes along an axis on CUDA and Vulkan.
const MAX_AXIS: usize = 65_535;

/// Elements per chunk and chunks per tensor where each cube of `units`
/// units takes one chunk of one of several flat tensors of `lens`
/// elements: 16 elements a unit, or more where the largest tensor would
/// need more than an axis of cubes (a multiple of `units` always).
pub(crate) fn flat_chunks(lens: &[usize], units: usize) -> (usize, usize) {
    let most = lens.iter().copied().max().unwrap_or(0).max(1);
    let chunk = (16 * units).max(most.div_ceil(MAX_AXIS).next_multiple_of(units));
    (chunk, most.div_ceil(chunk))
}

/// Items per launch of a kernel that takes its items as sequence
/// arguments, `bindings` buffers each: as many as the device binds beside
/// one more buffer and the launch's metadata, at least one, at most
/// `most` (each item a branch of the unrolled kernel).
pub(crate) fn per_launch<R: CubeRuntime>(
    client: &ComputeClient<R>,
    bindings: usize,
    most: usize,
) -> usize {
    (client.properties().hardware.max_bindings as usize)
        .saturating_sub(2)
        .div_euclid(bindings)
        .clamp(1, most)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_the_largest_tensor_within_an_axis_of_cubes() {
        let units = 256;
        let least = 16 * units;
        assert_eq!(flat_chunks(&[1, 5], units), (least, 1));
        assert_eq!(flat_chunks(&[least + 1, 3], units), (least, 2));
        for most in [MAX_AXIS * least, MAX_AXIS * least + 1, 3 << 30] {
            let (chunk, chunks) = flat_chunks(&[7, most], units);
            assert!(chunks <= MAX_AXIS && chunk * chunks >= most, "{most}");
            assert_eq!(chunk % units, 0);
        }
    }
}
