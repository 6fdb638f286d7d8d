//! The fused quantizer in CubeCL (CUDA, wgpu): each key's squared distance
//! to every codeword of its head, the nearest codeword (ties to the lowest
//! index), its row, the squared error and the key's squared norm, in one
//! pass with no `[B, H, T, S]` distance tensor in device memory.
//!
//! A cube holds `UNITS` keys of one block row `g = b H + h`, a key per
//! unit, in registers; the head's codewords pass through shared memory
//! `CODES` at a time, every unit reading the same word (a broadcast, no
//! bank conflict). The distance is `sum_c (k_c - C_c)^2` itself, not
//! `|C|^2 - 2 k . C` as the composed ops rank codes: the nearest code's
//! distance is then the squared error the commitment term and the
//! statistics need, with no cancellation.

use burn::tensor::{DType, TensorMetadata};
use burn_cubecl::CubeRuntime;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::SOURCE_HASH;
use super::launch::{cubes, empty_like, parts};

/// Keys per cube, one per unit.
const UNITS: usize = 256;

/// Codewords per shared-memory step.
const CODES: usize = 32;

/// Widest key the kernel holds in a unit's registers; wider keys compose.
pub const MAX_KEY_WIDTH: usize = 128;

/// Whether the fused quantizer covers keys of this width.
pub fn covers(key_width: usize) -> bool {
    (1..=MAX_KEY_WIDTH).contains(&key_width)
}

/// Keys `[G, T, K]` against codewords `[H, S, K]` (row `g` is head
/// `g % H`): codes `[G, T]`, nearest codewords `[G, T, K]`, squared
/// errors and squared norms `[G, T]`. A cube per `(g, UNITS keys)`.
#[cube(launch)]
fn quantize_keys<F: Float, I: Int>(
    keys: &Tensor<F>,
    codebook: &Tensor<F>,
    codes: &mut Tensor<I>,
    nearest: &mut Tensor<F>,
    error: &mut Tensor<F>,
    norms: &mut Tensor<F>,
    #[comptime] width: usize,
    #[comptime] _source: u64,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let t = keys.shape(1);
    let s = codebook.shape(1);
    let tiles = parts(t, UNITS);
    if CUBE_POS >= keys.shape(0) * tiles {
        terminate!();
    }
    let g = CUBE_POS / tiles;
    let i = (CUBE_POS % tiles) * UNITS + UNIT_POS as usize;
    let h = g % codebook.shape(0);
    let own = i < t;

    let mut key = Array::<F>::new(width);
    let mut norm = F::new(0.0);
    #[unroll]
    for c in 0..width {
        let mut v = F::new(0.0);
        if own {
            v = keys[g * keys.stride(0) + i * keys.stride(1) + c * keys.stride(2)];
        }
        key[c] = v;
        norm += v * v;
    }
    let mut words = SharedMemory::<F>::new(CODES * width);
    let mut best = F::new(0.0);
    let mut code = 0;
    let mut n0 = 0;
    while n0 < s {
        sync_cube();
        let mut e = UNIT_POS as usize;
        while e < CODES * width {
            let n = n0 + e / width;
            let mut v = F::new(0.0);
            if n < s {
                v = codebook[h * codebook.stride(0)
                    + n * codebook.stride(1)
                    + (e % width) * codebook.stride(2)];
            }
            words[e] = v;
            e += UNITS;
        }
        sync_cube();
        for j in 0..CODES {
            let n = n0 + j;
            if n < s {
                let mut d = F::new(0.0);
                #[unroll]
                for c in 0..width {
                    let diff = key[c] - words[j * width + c];
                    d += diff * diff;
                }
                // Strictly nearer only: ties keep the lower index.
                if n == 0 || d < best {
                    best = d;
                    code = n;
                }
            }
        }
        n0 += CODES;
    }
    if own {
        codes[g * codes.stride(0) + i * codes.stride(1)] = I::cast_from(code);
        error[g * error.stride(0) + i * error.stride(1)] = best;
        norms[g * norms.stride(0) + i * norms.stride(1)] = norm;
        let word = h * codebook.stride(0) + code * codebook.stride(1);
        let row = g * nearest.stride(0) + i * nearest.stride(1);
        for c in 0..width {
            nearest[row + c * nearest.stride(2)] = codebook[word + c * codebook.stride(2)];
        }
    }
}

/// [`super::VqKernels::vq_quantize`] on a cubecl backend: `keys` `[G, T,
/// K]`, `codebook` `[H, S, K]`; codes of `int` type, nearest codewords,
/// squared errors and squared norms.
pub(super) fn quantize<R: CubeRuntime>(
    keys: CubeTensor<R>,
    codebook: CubeTensor<R>,
    int: DType,
) -> (CubeTensor<R>, CubeTensor<R>, CubeTensor<R>, CubeTensor<R>) {
    let [g, t, k] = keys.shape().dims();
    let dtype = keys.dtype;
    let codes = empty_like(&keys, vec![g, t], int);
    let nearest = empty_like(&keys, vec![g, t, k], dtype);
    let error = empty_like(&keys, vec![g, t], dtype);
    let norm = empty_like(&keys, vec![g, t], dtype);
    quantize_keys::launch::<R>(
        &keys.client.clone(),
        cubes(g * t.div_ceil(UNITS)),
        CubeDim::new_1d(UNITS as u32),
        keys.into_tensor_arg(),
        codebook.into_tensor_arg(),
        codes.clone().into_tensor_arg(),
        nearest.clone().into_tensor_arg(),
        error.clone().into_tensor_arg(),
        norm.clone().into_tensor_arg(),
        k,
        SOURCE_HASH,
        [dtype.into(), int.into()],
    );
    (codes, nearest, error, norm)
}
