//! One `16 x 16` tile of a matrix product, computed by a warp of 32 units
//! together: on the tensor cores (cubecl's `cmma`, `tf32` operands and
//! `f32` sums, `16 x 16 x 8` at a time) where the device has them, else
//! by the warp's units, eight entries each. Both read their operands from
//! shared memory; a tile is left there, row-major ([`product`]), or kept in
//! registers across products and stored when done ([`Sums`]), so the
//! kernel around a product is the same code on every device: lavapipe's
//! tests prove it with the units' form, and only the `cmma` calls differ
//! on a GPU.
//!
//! The tensor cores ask for strides of a multiple of 4 floats and for
//! operands that start at 32-byte boundaries: memory from
//! `SharedMemory::new_aligned(.., ALIGN)`, offsets of whole tiles and of
//! multiples of [`DEPTH`] along the depth.

use burn::tensor::DType;
use burn_cubecl::CubeRuntime;
use cubecl::features::MmaConfig;
use cubecl::ir::{ElemType, FloatKind};
use cubecl::prelude::*;

/// Rows and columns of a tile.
pub const SIDE: usize = 16;

/// Units that compute a tile together: a warp on CUDA.
pub const WARP: usize = 32;

/// Depth of one tensor-core step on `tf32` operands.
pub const DEPTH: usize = 8;

/// Bytes at which a shared-memory operand must start.
pub const ALIGN: usize = 32;

/// Columns of the tile each unit computes in the units' form.
const PER_UNIT: usize = SIDE * SIDE / WARP;

/// `c[i, j] = (c[i, j] unless fresh) + sum_t a[i, t] b(t, j)` for `i, j` in
/// `0..SIDE` and `t` in `0..depth`, where `a[i, t]` is at `a_at + i a_stride
/// + t` and `b(t, j)` at `b_at + j b_stride + t` (`by_rows`: the product's
/// columns are rows of `b`, as keys are for scores) or `b_at + t b_stride +
/// j`; `c[i, j]` at `c_at + i c_stride + j`. Every unit of the warp calls
/// it with its `lane` (`0..WARP`), in uniform control flow.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn product<F: Float>(
    c: &mut SharedMemory<F>,
    c_at: usize,
    a: &SharedMemory<F>,
    a_at: usize,
    b: &SharedMemory<F>,
    b_at: usize,
    fresh: bool,
    lane: usize,
    #[comptime] strides: Strides,
    #[comptime] depth: usize,
    #[comptime] by_rows: bool,
    #[comptime] tensor_cores: bool,
) {
    let mut sums = Sums::<F>::new(1usize, tensor_cores);
    if !fresh {
        sums.load(0usize, c, c_at, lane, strides.c, tensor_cores);
    }
    sums.add(
        0usize,
        a,
        a_at,
        b,
        b_at,
        lane,
        strides,
        depth,
        by_rows,
        tensor_cores,
    );
    sums.store(0usize, c, c_at, lane, strides.c, tensor_cores);
}

/// The strides of a product's three tiles (elements between rows).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Strides {
    /// Of `a`.
    pub a: usize,
    /// Of `b`.
    pub b: usize,
    /// Of `c`.
    pub c: usize,
}

/// Running sums of `count` `16 x 16` tiles of products that a warp keeps in
/// registers from one [`Sums::add`] to the next: a tensor-core fragment
/// each (`f32`: [`tensor_cores`] says so), or in the units' form
/// `PER_UNIT` entries a lane each, lane `l` holding row `l / 2`, columns
/// `(l % 2) PER_UNIT ..` of every tile.
#[derive(CubeType)]
pub struct Sums<F: Float> {
    fragments: Sequence<cmma::Matrix<F>>,
    entries: Array<F>,
}

#[cube]
impl<F: Float> Sums<F> {
    /// `count` tiles of zeros.
    pub fn new(#[comptime] count: usize, #[comptime] tensor_cores: bool) -> Sums<F> {
        let mut fragments = Sequence::new();
        let mut entries =
            Array::<F>::new(comptime!(if tensor_cores { 1 } else { count * PER_UNIT }));
        if comptime!(tensor_cores) {
            #[unroll]
            for _ in 0..count {
                let tile = unsafe {
                    cmma::Matrix::<F>::uninitialized(
                        cmma::MatrixIdent::Accumulator,
                        SIDE,
                        SIDE,
                        DEPTH,
                        cmma::MatrixLayout::Undefined,
                    )
                };
                cmma::fill(&tile, F::new(0.0));
                fragments.push(tile);
            }
        } else {
            #[unroll]
            for e in 0..comptime!(count * PER_UNIT) {
                entries[e] = F::new(0.0);
            }
        }
        Sums::<F> { fragments, entries }
    }

    /// Tile `tile` `+= a b`, the operands as in [`product`] (`strides.c`
    /// unused).
    #[allow(clippy::too_many_arguments)]
    pub fn add(
        &mut self,
        #[comptime] tile: usize,
        a: &SharedMemory<F>,
        a_at: usize,
        b: &SharedMemory<F>,
        b_at: usize,
        lane: usize,
        #[comptime] strides: Strides,
        #[comptime] depth: usize,
        #[comptime] by_rows: bool,
        #[comptime] tensor_cores: bool,
    ) {
        if comptime!(tensor_cores) {
            on_tensor_cores::<F>(
                self.fragments.index(tile),
                a,
                a_at,
                b,
                b_at,
                strides,
                depth,
                by_rows,
            );
        } else {
            let i = lane / 2;
            let j0 = (lane % 2) * PER_UNIT;
            let row = a_at + i * strides.a;
            for t in 0..depth {
                let x = a[row + t];
                #[unroll]
                for j in 0..PER_UNIT {
                    let at = comptime!(tile * PER_UNIT + j);
                    if comptime!(by_rows) {
                        self.entries[at] += x * b[b_at + (j0 + j) * strides.b + t];
                    } else {
                        self.entries[at] += x * b[b_at + t * strides.b + j0 + j];
                    }
                }
            }
        }
    }

    /// Tile `tile` from `c` at `c_at`, rows `stride` apart.
    pub fn load(
        &mut self,
        #[comptime] tile: usize,
        c: &SharedMemory<F>,
        c_at: usize,
        lane: usize,
        #[comptime] stride: usize,
        #[comptime] tensor_cores: bool,
    ) {
        if comptime!(tensor_cores) {
            cmma::load_with_layout(
                self.fragments.index(tile),
                &c.slice(c_at, c.len()),
                comptime!(stride as u32),
                cmma::MatrixLayout::RowMajor,
            );
        } else {
            let at = c_at + (lane / 2) * stride + (lane % 2) * PER_UNIT;
            #[unroll]
            for j in 0..PER_UNIT {
                self.entries[comptime!(tile * PER_UNIT + j)] = c[at + j];
            }
        }
    }

    /// Tile `tile` into `c` at `c_at`, rows `stride` apart.
    pub fn store(
        &self,
        #[comptime] tile: usize,
        c: &mut SharedMemory<F>,
        c_at: usize,
        lane: usize,
        #[comptime] stride: usize,
        #[comptime] tensor_cores: bool,
    ) {
        if comptime!(tensor_cores) {
            cmma::store(
                &mut c.slice_mut(c_at, c.len()),
                self.fragments.index(tile),
                comptime!(stride as u32),
                cmma::MatrixLayout::RowMajor,
            );
        } else {
            let at = c_at + (lane / 2) * stride + (lane % 2) * PER_UNIT;
            #[unroll]
            for j in 0..PER_UNIT {
                c[at + j] = self.entries[comptime!(tile * PER_UNIT + j)];
            }
        }
    }
}

/// `acc += a b` on the tensor cores: `depth / DEPTH` steps of `cmma` on
/// `tf32` operands into the `f32` accumulator, the operands as in
/// [`product`].
#[cube]
#[allow(clippy::too_many_arguments)]
fn on_tensor_cores<F: Float>(
    acc: &cmma::Matrix<F>,
    a: &SharedMemory<F>,
    a_at: usize,
    b: &SharedMemory<F>,
    b_at: usize,
    #[comptime] strides: Strides,
    #[comptime] depth: usize,
    #[comptime] by_rows: bool,
) {
    let lhs = unsafe {
        cmma::Matrix::<tf32>::uninitialized(
            cmma::MatrixIdent::A,
            SIDE,
            SIDE,
            DEPTH,
            cmma::MatrixLayout::RowMajor,
        )
    };
    // b(t, j) at j b_stride + t is column-major, at t b_stride + j row-major.
    let rhs = unsafe {
        cmma::Matrix::<tf32>::uninitialized(
            cmma::MatrixIdent::B,
            SIDE,
            SIDE,
            DEPTH,
            if comptime!(by_rows) {
                cmma::MatrixLayout::ColMajor
            } else {
                cmma::MatrixLayout::RowMajor
            },
        )
    };
    #[unroll]
    for step in 0..comptime!(depth / DEPTH) {
        let t = step * DEPTH;
        cmma::load(
            &lhs,
            &a.slice(a_at + t, a.len()),
            comptime!(strides.a as u32),
        );
        if comptime!(by_rows) {
            cmma::load(
                &rhs,
                &b.slice(b_at + t, b.len()),
                comptime!(strides.b as u32),
            );
        } else {
            cmma::load(
                &rhs,
                &b.slice(b_at + t * strides.b, b.len()),
                comptime!(strides.b as u32),
            );
        }
        cmma::execute::<tf32, tf32, F, F>(&lhs, &rhs, acc, acc);
    }
}

/// Whether the kernels on `client` compute their products on the tensor
/// cores: `f32` tensors, `tf32` `16 x 16 x 8` products that the device
/// has, 32 units a warp, and `TVQ_TENSOR_CORES` not `0` (the switch that
/// times the units' form on the same GPU).
pub fn tensor_cores<R: CubeRuntime>(client: &ComputeClient<R>, dtype: DType) -> bool {
    let tf32 = ElemType::Float(FloatKind::TF32).into();
    let shape = MmaConfig {
        a_type: tf32,
        b_type: tf32,
        cd_type: ElemType::Float(FloatKind::F32).into(),
        m: SIDE as u32,
        n: SIDE as u32,
        k: DEPTH as u32,
    };
    let hardware = &client.properties().hardware;
    dtype == DType::F32
        && client.features().matmul.cmma.contains(&shape)
        && hardware.plane_size_min == WARP as u32
        && hardware.plane_size_max == WARP as u32
        && std::env::var("TVQ_TENSOR_CORES").map_or(true, |v| v != "0")
}

#[cfg(test)]
mod tests {
    use burn::backend::wgpu::{WgpuDevice, WgpuRuntime};
    use cubecl::Runtime;
    use cubecl::prelude::*;
    use tvq_testkit::Gpu;

    use super::*;
    use crate::kernel::SOURCE_HASH;

    /// Two tile products into the second tile of `c`: the first half of
    /// the depth fresh, the second half added to it, the operands the
    /// second tiles of `a` and `b` (rows `a_stride` / `b_stride` apart).
    #[cube(launch)]
    #[allow(clippy::too_many_arguments)]
    fn twice<F: Float>(
        a: &Array<F>,
        b: &Array<F>,
        c: &mut Array<F>,
        #[comptime] a_stride: usize,
        #[comptime] b_stride: usize,
        #[comptime] depth: usize,
        #[comptime] by_rows: bool,
        #[comptime] tensor_cores: bool,
        #[comptime] _source: u64,
        #[define(F)] _dtype: StorageType,
    ) {
        let lane = UNIT_POS as usize;
        let b_rows = comptime!(if by_rows { 2 * SIDE } else { 2 * depth });
        let mut sa = SharedMemory::<F>::new_aligned(comptime!(2 * SIDE * a_stride), ALIGN);
        let mut sb = SharedMemory::<F>::new_aligned(comptime!(b_rows * b_stride), ALIGN);
        let mut sc = SharedMemory::<F>::new_aligned(comptime!(2 * SIDE * SIDE), ALIGN);
        let mut e = lane;
        while e < a.len() {
            sa[e] = a[e];
            e += WARP;
        }
        e = lane;
        while e < b.len() {
            sb[e] = b[e];
            e += WARP;
        }
        e = lane;
        while e < c.len() {
            sc[e] = F::new(-7.0);
            e += WARP;
        }
        sync_cube();
        let half = comptime!(depth / 2);
        let b_first = comptime!(if by_rows {
            SIDE * b_stride
        } else {
            depth * b_stride
        });
        let b_half = comptime!(if by_rows { half } else { half * b_stride });
        let strides = comptime!(Strides {
            a: a_stride,
            b: b_stride,
            c: SIDE,
        });
        #[unroll]
        for step in 0..2usize {
            product::<F>(
                &mut sc,
                SIDE * SIDE,
                &sa,
                SIDE * a_stride + step * half,
                &sb,
                b_first + step * b_half,
                step == 0,
                lane,
                strides,
                half,
                by_rows,
                tensor_cores,
            );
            sync_cube();
        }
        e = lane;
        while e < c.len() {
            c[e] = sc[e];
            e += WARP;
        }
    }

    /// Draws in `[-1, 1)`.
    fn draws(n: usize, seed: u64) -> Vec<f32> {
        let mut state = seed;
        (0..n)
            .map(|_| {
                state = state
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                (state >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            })
            .collect()
    }

    /// The warp's tile product on `client` against a host product in `f64`,
    /// each layout of `b`; tolerance `tol` relative to the depth.
    fn agrees<R: Runtime>(client: &ComputeClient<R>, tensor_cores: bool, tol: f64) {
        let depth = 32;
        let (a_stride, b_stride) = (depth + 4, SIDE + 4);
        for by_rows in [true, false] {
            let b_stride = if by_rows { a_stride } else { b_stride };
            let a = draws(2 * SIDE * a_stride, 1);
            let b_rows = if by_rows { 2 * SIDE } else { 2 * depth };
            let b = draws(b_rows * b_stride, 2);
            let c = client.empty(2 * SIDE * SIDE * 4);
            unsafe {
                twice::launch::<R>(
                    client,
                    CubeCount::Static(1, 1, 1),
                    CubeDim::new_1d(WARP as u32),
                    ArrayArg::from_raw_parts(client.create_from_slice(f32::as_bytes(&a)), a.len()),
                    ArrayArg::from_raw_parts(client.create_from_slice(f32::as_bytes(&b)), b.len()),
                    ArrayArg::from_raw_parts(c.clone(), 2 * SIDE * SIDE),
                    a_stride,
                    b_stride,
                    depth,
                    by_rows,
                    tensor_cores,
                    SOURCE_HASH,
                    f32::as_type_native_unchecked().storage_type(),
                )
            };
            let got = f32::from_bytes(&client.read_one_unchecked(c)).to_vec();
            for (e, &v) in got[..SIDE * SIDE].iter().enumerate() {
                assert_eq!(v, -7.0, "the first tile is not the product's: {e}");
            }
            for i in 0..SIDE {
                for j in 0..SIDE {
                    let want: f64 = (0..depth)
                        .map(|t| {
                            let x = a[(SIDE + i) * a_stride + t] as f64;
                            let y = if by_rows {
                                b[(SIDE + j) * b_stride + t]
                            } else {
                                b[(depth + t) * b_stride + j]
                            };
                            x * y as f64
                        })
                        .sum();
                    let v = got[SIDE * SIDE + i * SIDE + j] as f64;
                    assert!(
                        (v - want).abs() <= tol * depth as f64,
                        "by_rows {by_rows}, tensor cores {tensor_cores}: [{i}, {j}] {v} against {want}"
                    );
                }
            }
        }
    }

    #[test]
    fn a_warps_tile_product_matches_a_host_product() {
        let up = std::panic::catch_unwind(|| WgpuRuntime::client(&WgpuDevice::DefaultDevice));
        let Ok(client) = up else {
            Gpu::Wgpu.missing(
                "a_warps_tile_product_matches_a_host_product",
                "no wgpu adapter answered",
            );
            return;
        };
        agrees(&client, false, 1e-6);
        // Where the adapter has tensor cores (not lavapipe): their form too,
        // to tf32's 10 bits of mantissa.
        if tensor_cores(&client, DType::F32) {
            agrees(&client, true, 2e-3);
        }
    }
}
