//! The fused kernels against the composed ops they replace, on wgpu's
//! cubecl backend (lavapipe in CI) and on the CPU (`Flex`). The attention: outputs and the
//! gradients of every differentiable input, for each position-term
//! layout, cache gradient mode, limit and the learned count weight, from a
//! fresh stream and from a carried state. The quantizer: codes,
//! straight-through keys, commitment, its gradient and the statistics, and
//! each code a nearest one by a host oracle in `f64`. The code totals:
//! against a host oracle in `f64`. The sum of squares and AdamW over many
//! tensors: against host oracles.

use std::sync::OnceLock;

use burn::backend::Autodiff;
use burn::backend::flex::{Flex, FlexDevice};
use burn::backend::wgpu::{CubeBackend, WgpuDevice, WgpuRuntime};
use burn::module::Param;
use burn::prelude::*;
use burn::tensor::Distribution;
use burn::tensor::TensorPrimitive;
use burn::tensor::backend::AutodiffBackend;
use tvq_model::attention::{AttentionInput, AttentionState, Position, block_attention};
use tvq_model::gau::{rms_normalize_with, silu_with};
use tvq_model::kernel::{
    AdamwParam, AdamwScalars, AttentionFlags, AttentionKernelInput, Kernels, VqBackend, VqKernels,
    fused_adamw_calls, fused_attention_calls, fused_column_blocks_calls, fused_commitment_calls,
    fused_norm_calls, fused_quantize_calls, fused_rms_calls, fused_silu_calls,
    fused_straight_through_calls, fused_token_nll_calls, fused_totals_calls,
};
use tvq_model::quantizer::{Quantized, VectorQuantizer};
use tvq_model::{CacheGrad, Compute, token_nll};
use tvq_testkit::Gpu;

use crate::common::{self, cpu};

/// wgpu's cubecl backend, unfused, so that the kernel is reached directly.
type Cube = CubeBackend<WgpuRuntime, f32, i32, u32>;
type Ad = Autodiff<Cube>;
/// burn's wgpu backend as the default build has it (with burn's fusion):
/// each kernel a custom operation of the fusion stream.
type Fused = Autodiff<burn::backend::Wgpu>;
/// The CPU backend, where the kernels are Rust over its buffers.
type Cpu = Autodiff<Flex>;

/// What the tests run on: an autodiff backend whose model can reach a
/// fused kernel.
trait Under: AutodiffBackend + VqBackend {}
impl<A: AutodiffBackend + VqBackend> Under for A {}

/// One property's three tests, in a module of the property's name: `gpu`
/// (wgpu's cubecl backend, unfused, so that each kernel is reached
/// directly), `fusion` (burn's wgpu backend with its fusion, as the default
/// build has it) and `cpu` (`Flex`), each an expression of the device `$d`
/// (a reference). The GPU's two are SKIPPED without a wgpu adapter, or fail
/// where wgpu is required.
macro_rules! on_each_backend {
    ($(#[$doc:meta])* $name:ident, |$d:ident| gpu: $gpu:expr, fusion: $fusion:expr, cpu: $cpu:expr) => {
        $(#[$doc])*
        mod $name {
            use super::*;

            #[test]
            fn gpu() {
                if let Some(device) = wgpu(concat!(stringify!($name), "::gpu")) {
                    let $d = &device;
                    $gpu;
                }
            }

            #[test]
            fn fusion() {
                if let Some(device) = wgpu(concat!(stringify!($name), "::fusion")) {
                    let $d = &device;
                    $fusion;
                }
            }

            #[test]
            fn cpu() {
                let $d = &FlexDevice;
                $cpu;
            }
        }
    };
}

/// The wgpu device, once its adapter answers; `None` (and a SKIPPED line,
/// or a failure where wgpu is required) when there is none.
fn wgpu(test: &str) -> Option<WgpuDevice> {
    static UP: OnceLock<bool> = OnceLock::new();
    let up = *UP.get_or_init(|| {
        keep_caches_out_of_the_tree();
        let hook = std::panic::take_hook();
        std::panic::set_hook(Box::new(|_| {}));
        let up = std::panic::catch_unwind(|| {
            Tensor::<Cube, 1>::from_floats([1.0], &WgpuDevice::DefaultDevice).into_data()
        })
        .is_ok();
        std::panic::set_hook(hook);
        up
    });
    if up {
        Some(WgpuDevice::DefaultDevice)
    } else {
        Gpu::Wgpu.missing(test, "no wgpu adapter answered");
        None
    }
}

/// cubecl keeps its autotuning cache under the `target/` of the working
/// directory (here the crate's source tree) unless told otherwise: this
/// binary's goes to the system's temporary directory. Before the first GPU
/// use, as cubecl reads its settings once.
fn keep_caches_out_of_the_tree() {
    use cubecl::config::cache::CacheConfig;
    use cubecl::config::{CubeClRuntimeConfig, RuntimeConfig};
    let mut settings = CubeClRuntimeConfig::storage().lock();
    if settings.is_none() {
        let mut config = CubeClRuntimeConfig::from_current_dir().override_from_env();
        config.autotune.cache = CacheConfig::File(std::env::temp_dir().join("tvq-model-tests"));
        *settings = Some(std::sync::Arc::new(config));
    }
}

/// Sizes and settings of one case.
#[derive(Clone, Copy, Debug)]
struct Case {
    b: usize,
    h: usize,
    /// Blocks in the segment.
    r: usize,
    l: usize,
    k: usize,
    v: usize,
    s: usize,
    /// A bias table per query (`[B, H, T, L + 1]`, XL) or one per head (Toeplitz).
    per_query_bias: bool,
    cache_grad: CacheGrad,
    cache_limit: Option<usize>,
    code_limit: Option<usize>,
    count_weight: bool,
    /// Whether the segment starts from a carried state (previous block and
    /// a non-empty cache) rather than a fresh stream.
    carried: bool,
}

const BASE: Case = Case {
    b: 2,
    h: 3,
    r: 4,
    l: 3,
    k: 5,
    v: 7,
    s: 6,
    per_query_bias: false,
    cache_grad: CacheGrad::Window,
    cache_limit: None,
    code_limit: None,
    count_weight: false,
    carried: false,
};

/// A small seeded generator (splitmix64), local to each draw: burn's is
/// one for the whole process, shared by the tests running beside these.
struct Splitmix(u64);

impl Splitmix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    fn uniform(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Standard normal (Box-Muller).
    fn normal(&mut self) -> f32 {
        let (u, w) = (1.0 - self.uniform(), self.uniform());
        ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * w).cos()) as f32
    }
}

/// Host data of one case's inputs.
struct Draw {
    q: TensorData,
    k: TensorData,
    v: TensorData,
    bias: TensorData,
    codes: TensorData,
    codebook: TensorData,
    count_weight: TensorData,
    /// Weights of the output in the loss, so that every output element's
    /// gradient differs.
    probe: TensorData,
}

impl Case {
    fn t(&self) -> usize {
        self.r * self.l
    }

    /// Draws a segment of `t` tokens from `seed`: the same inputs on every
    /// run, so that a tolerance below holds for these draws and a failure
    /// is a fault, not a draw that came near the limit.
    fn draw(&self, t: usize, seed: u64) -> Draw {
        let mut rng = Splitmix(seed);
        let (b, h, k, v, s, l) = (self.b, self.h, self.k, self.v, self.s, self.l);
        let mut normal = |shape: [usize; 4]| {
            let len = shape.iter().product::<usize>();
            TensorData::new((0..len).map(|_| rng.normal()).collect::<Vec<f32>>(), [len])
        };
        let bias_rows = if self.per_query_bias { b * h * t } else { h };
        let q = normal([b, h, t, k]);
        let k_window = normal([b, h, t, k]);
        let values = normal([b, h, t, v]);
        let bias = normal([1, 1, bias_rows, l + 1]);
        let codebook = normal([1, h, s, k]);
        let probe = normal([b, h, t, v]);
        let codes: Vec<i32> = (0..b * h * t)
            .map(|_| (rng.uniform() * s as f64) as i32)
            .collect();
        let weight: Vec<f32> = (0..b * h * t)
            .map(|_| (0.2 + 1.6 * rng.uniform()) as f32)
            .collect();
        Draw {
            q,
            k: k_window,
            v: values,
            bias,
            codes: TensorData::new(codes, [b * h * t]),
            codebook,
            count_weight: TensorData::new(weight, [b * h * t]),
            probe,
        }
    }

    fn cx(&self, kernels: Kernels) -> Compute {
        Compute {
            cache_grad: self.cache_grad,
            cache_limit: self.cache_limit,
            code_limit: self.code_limit,
            kernels,
            ..Compute::default()
        }
    }
}

/// What one run gives: the output, the gradients of q, k, v, the bias
/// table and the count weight, and the compressed cache after the segment,
/// as host vectors.
#[derive(Debug)]
struct Run {
    out: Vec<f32>,
    grads: Vec<(&'static str, Vec<f32>)>,
    after: [Vec<f32>; 2],
}

fn host<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data().convert::<f32>().to_vec().unwrap()
}

/// The case's segment through [`block_attention`] on `device` with
/// `kernels`, from `state`.
fn run<A: Under>(
    case: &Case,
    draw: &Draw,
    state: AttentionState<A>,
    kernels: Kernels,
    device: &A::Device,
) -> Run {
    let (b, h, t, l) = (case.b, case.h, case.t(), case.l);
    let tensor = |data: &TensorData, shape: [usize; 4]| {
        Tensor::<A, 1>::from_data(data.clone(), device)
            .reshape(shape)
            .require_grad()
    };
    let q = tensor(&draw.q, [b, h, t, case.k]);
    let k = tensor(&draw.k, [b, h, t, case.k]);
    let v = tensor(&draw.v, [b, h, t, case.v]);
    let bias = if case.per_query_bias {
        tensor(&draw.bias, [b, h, t, l + 1])
    } else {
        tensor(&draw.bias, [1, h, 1, l + 1])
    };
    let weight = tensor(&draw.count_weight, [b, h, t, 1]);
    let input = AttentionInput {
        q: q.clone(),
        position: Position::Table(bias.clone()),
        k_window: k.clone(),
        codes: Tensor::<A, 1, Int>::from_data(draw.codes.clone(), device).reshape([b, h, t]),
        v: v.clone(),
        codebook: Tensor::<A, 1>::from_data(draw.codebook.clone(), device)
            .reshape([h, case.s, case.k]),
        count_weight: case.count_weight.then(|| weight.clone()),
    };
    let (out, after) = block_attention(input, state, l, case.cx(kernels)).expect("attention runs");
    let cache = after.cache.expect("a cache after the segment");
    let probe = Tensor::<A, 1>::from_data(draw.probe.clone(), device).reshape([b, h, t, case.v]);
    let grads = (out.clone() * probe).sum().backward();
    let grad = |x: Tensor<A, 4>| x.grad(&grads).map(host).unwrap_or_default();
    let mut named = vec![
        ("q", grad(q)),
        ("k", grad(k)),
        ("v", grad(v)),
        ("bias", grad(bias)),
    ];
    if case.count_weight {
        named.push(("count_weight", grad(weight)));
    }
    Run {
        out: host(out.inner()),
        grads: named,
        after: [host(cache.counts.inner()), host(cache.means.inner())],
    }
}

/// The state after a first segment of the case's sizes (composed ops),
/// so that the segment under test has a previous block and a cache.
fn carried_state<A: Under>(case: &Case, device: &A::Device) -> AttentionState<A> {
    let draw = case.draw(case.t(), 1);
    let (b, h, t) = (case.b, case.h, case.t());
    let input = AttentionInput {
        q: Tensor::<A, 1>::from_data(draw.q, device).reshape([b, h, t, case.k]),
        position: Position::Table(Tensor::<A, 1>::from_data(draw.bias, device).reshape(
            if case.per_query_bias {
                [b, h, t, case.l + 1]
            } else {
                [1, h, 1, case.l + 1]
            },
        )),
        k_window: Tensor::<A, 1>::from_data(draw.k, device).reshape([b, h, t, case.k]),
        codes: Tensor::<A, 1, Int>::from_data(draw.codes, device).reshape([b, h, t]),
        v: Tensor::<A, 1>::from_data(draw.v, device).reshape([b, h, t, case.v]),
        codebook: Tensor::<A, 1>::from_data(draw.codebook, device).reshape([h, case.s, case.k]),
        count_weight: None,
    };
    let cx = case.cx(Kernels::Composed);
    block_attention(input, AttentionState::default(), case.l, cx)
        .expect("first segment runs")
        .1
}

/// The smallest distance between two codewords of one head, `words`
/// `[H, S, K]` flat.
fn closest_codewords(words: &[f32], h: usize, s: usize, k: usize) -> f64 {
    let word = |head: usize, code: usize| &words[(head * s + code) * k..][..k];
    let mut closest = f64::INFINITY;
    for head in 0..h {
        for a in 0..s {
            for b in 0..a {
                let d: f64 = (word(head, a).iter().zip(word(head, b)))
                    .map(|(x, y)| (*x as f64 - *y as f64).powi(2))
                    .sum();
                closest = closest.min(d.sqrt());
            }
        }
    }
    closest
}

/// The largest difference between `a` and the reference `b`, relative to
/// `b`'s largest magnitude where that exceeds 1 (sums over 150 channels
/// round differently in a tile's order than in the composed ops').
fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(1.0f32, |m, y| m.max(y.abs()));
    tvq_testkit::max_abs_diff(a, b) / scale
}

/// Runs `case` fused and composed and requires them to agree within `tol`
/// (relative, [`max_diff`]) in the output, every gradient and the cache
/// after the segment, and the fused run to have reached the kernel. `tol`
/// is for values up to 128 channels wide: the gradients of q, k and the
/// bias sum `dO . v` over the value's channels, whose rounding grows as the
/// square root of their number (1.2e-5 at 1,100 channels over 16 draws
/// here, 2.2e-5 on another machine's lavapipe, against 2.7e-6 at 7).
fn agree<A: Under>(case: Case, device: &A::Device, tol: f32) {
    let tol = tol * (case.v as f32 / 128.0).sqrt().max(1.0);
    let state = if case.carried {
        carried_state::<A>(&case, device)
    } else {
        AttentionState::default()
    };
    let draw = case.draw(case.t(), 2);
    let composed = run::<A>(&case, &draw, state.clone(), Kernels::Composed, device);
    let (before, caches) = (fused_attention_calls(), fused_totals_calls());
    let fused = run::<A>(&case, &draw, state, Kernels::Fused, device);
    assert!(
        fused_attention_calls() > before,
        "{case:?}: the fused run did not reach the kernel"
    );
    // The block caches' kernel passes no gradient on: not under Full.
    assert_eq!(
        fused_totals_calls() > caches,
        case.cache_grad != CacheGrad::Full,
        "{case:?}: the block caches' kernel"
    );
    let diff = max_diff(&fused.out, &composed.out);
    assert!(diff <= tol, "{case:?}: output max |diff| = {diff:e}");
    for (name, f, c) in [
        ("cache counts after", &fused.after[0], &composed.after[0]),
        ("cache means after", &fused.after[1], &composed.after[1]),
    ] {
        let diff = max_diff(f, c);
        assert!(diff <= tol, "{case:?}: {name}: max |diff| = {diff:e}");
    }
    for ((name, f), (_, c)) in fused.grads.iter().zip(&composed.grads) {
        assert!(!c.is_empty(), "{case:?}: no gradient of {name}");
        let diff = max_diff(f, c);
        assert!(
            diff <= tol,
            "{case:?}: gradient of {name}: max |diff| = {diff:e}"
        );
    }
}

/// Every case the attention kernels are held to: empty and carried
/// caches, both position-term layouts, every cache gradient mode, the
/// limits, the count weight, and sizes that leave partial tiles.
fn cases() -> [Case; 11] {
    [
        // One block: no previous block, empty cache.
        Case { r: 1, ..BASE },
        // Many blocks, Toeplitz-shaped bias, every cache gradient mode.
        BASE,
        Case {
            cache_grad: CacheGrad::None,
            ..BASE
        },
        Case {
            cache_grad: CacheGrad::Full,
            ..BASE
        },
        // XL-shaped bias (a table per query), carried state.
        Case {
            per_query_bias: true,
            carried: true,
            ..BASE
        },
        // Limits that bind, and the learned count weight.
        Case {
            cache_limit: Some(4),
            code_limit: Some(2),
            carried: true,
            ..BASE
        },
        Case {
            count_weight: true,
            cache_grad: CacheGrad::Full,
            carried: true,
            ..BASE
        },
        // Several query and key tiles (32 each on the GPUs), each with a
        // partial last one, and keys wider than a chunk of channels.
        Case {
            b: 1,
            h: 2,
            r: 3,
            l: 37,
            k: 37,
            v: 150,
            s: 19,
            per_query_bias: true,
            count_weight: true,
            carried: true,
            ..BASE
        },
        Case {
            b: 1,
            h: 1,
            r: 2,
            l: 17,
            k: 16,
            v: 129,
            s: 40,
            ..BASE
        },
        // Values wider than one slice of a cube (1,024 channels): two
        // slices, the second partial.
        Case {
            b: 1,
            h: 1,
            r: 2,
            l: 5,
            k: 8,
            v: 1100,
            s: 3,
            carried: true,
            ..BASE
        },
        // Block length 1, odd widths, a single head and row.
        Case {
            b: 1,
            h: 1,
            r: 5,
            l: 1,
            k: 3,
            v: 2,
            s: 4,
            ..BASE
        },
    ]
}

/// Every case of [`cases`] on one backend.
fn each_case<A: Under>(device: &A::Device) {
    for case in cases() {
        agree::<A>(case, device, 2e-5);
    }
}

on_each_backend!(
    fused_attention_matches_the_composed_ops,
    |d| gpu: each_case::<Ad>(d),
    fusion: each_case::<Fused>(d),
    cpu: each_case::<Cpu>(d)
);

/// The fused attention on `input`, whose queries, keys and values are
/// `leaves`: its output and the leaves' gradients under `sum(out *
/// probe)`, as host values in that order, and the gradients (for other
/// leaves).
fn attend_with_grads<A: Under>(
    input: AttentionKernelInput<A>,
    leaves: [Tensor<A, 3>; 3],
    probe: &Tensor<A, 3>,
) -> (Vec<Vec<f32>>, <A as AutodiffBackend>::Gradients) {
    let out = A::vq_attention(input).expect("the backend has the kernel");
    let out = Tensor::<A, 3>::from_primitive(TensorPrimitive::Float(out));
    let grads = (out.clone() * probe.clone()).sum().backward();
    let mut all = vec![host(out.inner())];
    all.extend(leaves.map(|t| host(t.grad(&grads).expect("a gradient"))));
    (all, grads)
}

/// [`attend_with_grads`]' four host values, `got` against `want`, bit for
/// bit (`want` finite), named with `case`.
fn same_attention_bits(want: Vec<Vec<f32>>, got: Vec<Vec<f32>>, case: &str) {
    let bits = |x: Vec<f32>| x.into_iter().map(f32::to_bits).collect::<Vec<_>>();
    for ((name, want), got) in ["output", "dq", "dk", "dv"].into_iter().zip(want).zip(got) {
        assert!(want.iter().all(|x| x.is_finite()), "{case}: {name}");
        assert_eq!(bits(got), bits(want), "{case}: {name}");
    }
}

/// A fresh stream's kernels read nothing carried (so that its carried
/// tensors can be left unfilled): the block caches under `fresh` and the
/// attention under `mask_first`, given carried tensors of NaN (and codes
/// that would count), agree bit for bit with the same kernels given an
/// empty carried state (zeros, empty slots), in the values and the
/// gradients. A read would spread the NaNs.
fn fresh_streams_read_nothing_carried<A: Under>(device: &A::Device) {
    let (b, h, r, l, k, v, s) = (2, 3, 3, 5, 4, 6, 7);
    let (bh, g, t) = (b * h, b * h * r, r * l);
    let normal =
        |shape: [usize; 3]| Tensor::<A, 3>::random(shape, Distribution::Normal(0.0, 1.0), device);
    let fill = |shape: [usize; 3], x: f32| {
        let len = shape.iter().product::<usize>();
        Tensor::<A, 3>::from_data(TensorData::new(vec![x; len], shape), device)
    };
    let bits = |x: Vec<f32>| x.into_iter().map(f32::to_bits).collect::<Vec<_>>();
    let float = |x| TensorPrimitive::Float(x);

    // The block caches: carried codes 0 (which would count), values,
    // counts and means NaN; against empty slots and a zero cache.
    let codes =
        Tensor::<A, 2, Int>::random([bh, t], Distribution::Uniform(0.0, (s + 1) as f64), device);
    let values = normal([bh, t, v]);
    let caches = |fresh: bool| {
        let (carried_codes, x) = if fresh {
            (Tensor::<A, 2, Int>::zeros([bh, l], device), f32::NAN)
        } else {
            (Tensor::<A, 2, Int>::full([bh, l], s as i64, device), 0.0)
        };
        let c = A::vq_block_caches(
            carried_codes.into_primitive(),
            fill([bh, l, v], x).into_primitive().tensor(),
            codes.clone().into_primitive(),
            values.clone().into_primitive().tensor(),
            fill([bh, s, 1], x)
                .reshape([bh, s])
                .into_primitive()
                .tensor(),
            fill([bh, s, v], x).into_primitive().tensor(),
            fresh,
        )
        .expect("the backend has the kernel");
        [
            host(Tensor::<A, 3>::from_primitive(float(c.counts))),
            host(Tensor::<A, 4>::from_primitive(float(c.means))),
            host(Tensor::<A, 2>::from_primitive(float(c.counts_after))),
            host(Tensor::<A, 3>::from_primitive(float(c.means_after))),
        ]
    };
    let (want, got) = (caches(false), caches(true));
    for (name, want, got) in ["counts", "means", "counts after", "means after"]
        .into_iter()
        .zip(want)
        .zip(got)
        .map(|((n, w), g)| (n, w, g))
    {
        assert!(
            want.iter().all(|x| x.is_finite()),
            "caches: {name}: {want:?}"
        );
        assert_eq!(bits(got), bits(want), "caches: {name}");
    }

    // The attention: carried keys and values NaN, against zeros.
    let (q, keys, vals) = (normal([g, l, k]), normal([g, l, k]), normal([g, l, v]));
    let bias = normal([b * h, t, l + 1]).reshape([b, h, t, l + 1]);
    let codebook = normal([h, s, k]);
    let log_counts = normal([g, s, 1]).reshape([g, s]);
    let means = normal([g, s, v]);
    let probe = normal([g, l, v]);
    let attend = |x: f32| {
        let leaves = [q.clone(), keys.clone(), vals.clone()].map(|t| t.require_grad());
        let input = AttentionKernelInput {
            q: leaves[0].clone().into_primitive().tensor(),
            k: leaves[1].clone().into_primitive().tensor(),
            v: leaves[2].clone().into_primitive().tensor(),
            k_carried: fill([bh, l, k], x).into_primitive().tensor(),
            v_carried: fill([bh, l, v], x).into_primitive().tensor(),
            bias: bias.clone().into_primitive().tensor(),
            codebook: codebook.clone().into_primitive().tensor(),
            log_counts: log_counts.clone().into_primitive().tensor(),
            shift: fill([g, 1, 1], 0.0).reshape([g]).into_primitive().tensor(),
            count_weight: fill([g, l, 1], 0.0)
                .reshape([g, l])
                .into_primitive()
                .tensor(),
            means: means.clone().into_primitive().tensor(),
            flags: AttentionFlags {
                mask_first: true,
                prev_grad: true,
                means_grad: true,
                shifted: false,
                weighted: false,
            },
        };
        attend_with_grads(input, leaves, &probe).0
    };
    same_attention_bits(attend(0.0), attend(f32::NAN), "attention");
}

on_each_backend!(
    fresh_streams_read_nothing_carried,
    |d| gpu: fresh_streams_read_nothing_carried::<Ad>(d),
    fusion: fresh_streams_read_nothing_carried::<Fused>(d),
    cpu: fresh_streams_read_nothing_carried::<Cpu>(d)
);

/// Skipping the cache means' gradient ([`AttentionFlags::means_grad`]
/// off, the means untracked) changes nothing else: the output and the
/// gradients of the queries, keys and values agree bit for bit with the
/// pass that computes it, across block sizes whose window ends inside a
/// key tile and past it, with and without the previous block's gradient.
fn means_grad_changes_nothing_else<A: Under>(device: &A::Device) {
    for (b, h, r, l, k, v, s, prev_grad) in
        [(1, 2, 3, 5, 4, 6, 7, true), (2, 1, 2, 40, 8, 3, 33, false)]
    {
        let (bh, g, t) = (b * h, b * h * r, r * l);
        let normal = |shape: [usize; 3]| {
            Tensor::<A, 3>::random(shape, Distribution::Normal(0.0, 1.0), device)
        };
        let (q, keys, vals) = (normal([g, l, k]), normal([g, l, k]), normal([g, l, v]));
        let bias = normal([bh, t, l + 1]).reshape([b, h, t, l + 1]);
        let (codebook, means) = (normal([h, s, k]), normal([g, s, v]));
        let log_counts = normal([g, s, 1]).reshape([g, s]);
        let (carried_k, carried_v) = (normal([bh, l, k]), normal([bh, l, v]));
        let probe = normal([g, l, v]);
        let attend = |means_grad: bool| {
            let leaves = [q.clone(), keys.clone(), vals.clone()].map(|t| t.require_grad());
            let means = match means_grad {
                true => means.clone().require_grad(),
                false => means.clone(),
            };
            let input = AttentionKernelInput {
                q: leaves[0].clone().into_primitive().tensor(),
                k: leaves[1].clone().into_primitive().tensor(),
                v: leaves[2].clone().into_primitive().tensor(),
                k_carried: carried_k.clone().into_primitive().tensor(),
                v_carried: carried_v.clone().into_primitive().tensor(),
                bias: bias.clone().into_primitive().tensor(),
                codebook: codebook.clone().into_primitive().tensor(),
                log_counts: log_counts.clone().into_primitive().tensor(),
                shift: Tensor::<A, 1>::zeros([g], device).into_primitive().tensor(),
                count_weight: Tensor::<A, 2>::zeros([g, l], device)
                    .into_primitive()
                    .tensor(),
                means: means.clone().into_primitive().tensor(),
                flags: AttentionFlags {
                    mask_first: false,
                    prev_grad,
                    means_grad,
                    shifted: false,
                    weighted: false,
                },
            };
            let (all, grads) = attend_with_grads(input, leaves, &probe);
            let dmeans = means.grad(&grads).map(host);
            assert_eq!(dmeans.is_some(), means_grad, "the means' gradient");
            all
        };
        // The skipping pass first: a part it failed to write would
        // otherwise hold the other pass's figures, in a buffer reused.
        let (got, want) = (attend(false), attend(true));
        same_attention_bits(want, got, &format!("L {l}"));
    }
}

on_each_backend!(
    means_grad_changes_nothing_else,
    |d| gpu: means_grad_changes_nothing_else::<Ad>(d),
    fusion: means_grad_changes_nothing_else::<Fused>(d),
    cpu: means_grad_changes_nothing_else::<Cpu>(d)
);

/// A quantizer of `h` heads whose codewords are `words` `[H, S, K]`
/// (counts of one, so that the codebook is `words` itself).
fn quantizer_of<A: Under>(words: Tensor<A, 3>) -> VectorQuantizer<A> {
    let [h, s, _] = words.dims();
    let device = words.device();
    VectorQuantizer {
        c_sum: Param::from_tensor(words).set_require_grad(false),
        c_count: Param::from_tensor(Tensor::ones([h, s], &device)).set_require_grad(false),
    }
}

/// `keys` through `quantizer` with `kernels`, half the tokens of the
/// first row marked invalid; the result and the gradient of `keys` under
/// `sum(k_hat * probe) + sum(commitment)`.
fn quantize<A: Under>(
    quantizer: &VectorQuantizer<A>,
    keys: &Tensor<A, 4>,
    probe: &Tensor<A, 4>,
    kernels: Kernels,
) -> (Quantized<A>, Vec<f32>) {
    let [b, _, t, _] = keys.dims();
    let keys = keys.clone().detach().require_grad();
    let valid = Tensor::<A, 1, Int>::arange(0..(b * t) as i64, &keys.device())
        .reshape([b, t])
        .greater_equal_elem((t / 2) as i64);
    let vq = quantizer.quantize(keys.clone(), Some(valid), kernels);
    let loss = (vq.k_hat.clone() * probe.clone()).sum() + vq.commitment.clone().sum();
    let grads = loss.backward();
    let grad = keys.grad(&grads).map(host).expect("keys have a gradient");
    (vq, grad)
}

fn ints<B: Backend, const D: usize>(t: Tensor<B, D, Int>) -> Vec<i64> {
    t.into_data().convert::<i64>().to_vec().unwrap()
}

on_each_backend!(
    /// The fused quantizer gives what the composed one does where the nearest
    /// code is clear (keys planted near codewords), each of its codes is a
    /// nearest one by an `f64` oracle on random keys, and exact ties go to the
    /// lowest index: sizes past a cube's 256 keys and a step's 32 codes, key
    /// widths of 1, an odd one and the widest covered (128).
    fused_quantizer_matches_the_composed_ops,
    |d| gpu: quantizer_agrees::<Ad>(d),
    fusion: quantizer_agrees::<Fused>(d),
    cpu: quantizer_agrees::<Cpu>(d)
);

fn quantizer_agrees<A: Under>(device: &A::Device) {
    let normal = |shape: [usize; 4], std: f64| {
        Tensor::<A, 4>::random(shape, Distribution::Normal(0.0, std), device)
    };
    for (b, h, t, k, s) in [
        (2, 3, 5, 4, 6),
        (1, 2, 300, 37, 70),
        (2, 1, 9, 128, 33),
        (1, 2, 40, 1, 3),
    ] {
        let case = format!("B {b}, H {h}, T {t}, K {k}, S {s}");
        // Codewords at least 0.05 apart within a head, so that a planted
        // key (noise 1e-3) has one nearest codeword, in f32 too (a draw of
        // three scalars can put two within the noise).
        let words = (0..100)
            .map(|_| normal([1, h, s, k], 1.0).reshape([h, s, k]))
            .find(|w| closest_codewords(&host(w.clone().inner()), h, s, k) >= 0.05)
            .expect("100 draws of codewords too close together");
        let quantizer = quantizer_of(words.clone());
        let probe = normal([b, h, t, k], 1.0);

        // Planted: each key a codeword plus noise far below their spacing.
        let planted =
            Tensor::<A, 1, Int>::random([b * h * t], Distribution::Uniform(0.0, s as f64), device);
        let rows = Tensor::<A, 1, Int>::arange_step(0..(h * s) as i64, s, device)
            .reshape([1, h, 1])
            .expand([b, h, t])
            .reshape([b * h * t]);
        let keys = words
            .clone()
            .reshape([h * s, k])
            .select(0, planted.clone() + rows)
            .reshape([b, h, t, k])
            + normal([b, h, t, k], 1e-3);
        let (calls, totals) = (fused_quantize_calls(), fused_totals_calls());
        let (fused, fused_grad) = quantize(&quantizer, &keys, &probe, Kernels::Fused);
        assert!(
            fused_quantize_calls() > calls && fused_totals_calls() > totals,
            "{case}: a kernel did not run"
        );
        let (composed, composed_grad) = quantize(&quantizer, &keys, &probe, Kernels::Composed);
        let codes = ints(fused.codes.clone());
        assert_eq!(codes, ints(planted), "{case}: planted codes");
        assert_eq!(codes, ints(composed.codes.clone()), "{case}: codes");
        let pairs = [
            (
                "k_hat",
                host(fused.k_hat.inner()),
                host(composed.k_hat.inner()),
            ),
            (
                "commitment",
                host(fused.commitment.inner()),
                host(composed.commitment.inner()),
            ),
            ("gradient of keys", fused_grad, composed_grad),
            (
                "counts",
                host(fused.stats.counts.inner()),
                host(composed.stats.counts.inner()),
            ),
            (
                "sums",
                host(fused.stats.sums.inner()),
                host(composed.stats.sums.inner()),
            ),
            (
                "sq_error",
                host(fused.stats.sq_error.inner()),
                host(composed.stats.sq_error.inner()),
            ),
            (
                "sq_norm",
                host(fused.stats.sq_norm.inner()),
                host(composed.stats.sq_norm.inner()),
            ),
        ];
        for (name, f, c) in pairs {
            let diff = max_diff(&f, &c);
            assert!(diff <= 1e-5, "{case}: {name}: max |diff| = {diff:e}");
        }

        // Random keys: the squared errors agree to rounding, relatively
        // (their sum is each key's distance to its code, far from zero
        // here)...
        let keys = normal([b, h, t, k], 1.0);
        let (fused, _) = quantize(&quantizer, &keys, &probe, Kernels::Fused);
        let (composed, _) = quantize(&quantizer, &keys, &probe, Kernels::Composed);
        let [f, c] = [&fused, &composed].map(|q| host(q.stats.sq_error.clone().inner()));
        for (f, c) in f.iter().zip(&c) {
            assert!(
                (f - c).abs() <= 1e-5 * c.abs(),
                "{case}: random keys' sq_error {f}, composed {c}"
            );
        }
        // ...and each code is a nearest one, by distances in f64.
        let (codes, kv, cb) = (
            ints(fused.codes),
            host(keys.clone().inner()),
            host(words.clone().inner()),
        );
        for (n, &z) in codes.iter().enumerate() {
            let head = (n / t) % h;
            let dist = |code: usize| -> f64 {
                let word = &cb[(head * s + code) * k..][..k];
                let key = &kv[n * k..][..k];
                word.iter()
                    .zip(key)
                    .map(|(&a, &b)| (a as f64 - b as f64).powi(2))
                    .sum()
            };
            let best = (0..s).map(dist).fold(f64::INFINITY, f64::min);
            assert!(
                (0..s as i64).contains(&z) && dist(z as usize) <= best + 1e-5 * best.max(1.0),
                "{case}: key {n} took code {z} at {}, the nearest is at {best}",
                dist(z as usize)
            );
        }

        // Ties: every codeword twice, the copies in the upper half; a
        // nearest code is always in the lower half.
        let doubled = quantizer_of(Tensor::cat(vec![words.clone(), words.clone()], 1));
        let (tied, _) = quantize(&doubled, &keys, &probe, Kernels::Fused);
        let codes = ints(tied.codes);
        assert!(
            codes.iter().all(|&z| (0..s as i64).contains(&z)),
            "{case}: a tie went to the higher index: {codes:?}"
        );
    }
}

/// The fused code totals against a host oracle in `f64`: codes with empty
/// slots (`S`), with and without weights, groups folded onto fewer rows,
/// past a cube's 16 codes and 256 tokens, and values of 1 channel and of
/// 1,100 (five slices of a cube).
fn code_totals_agree<A: Under>(device: &A::Device) {
    for (g, n, w, s, rows) in [
        (3, 5, 4, 6, 3),
        (4, 300, 37, 70, 2),
        (2, 9, 1100, 3, 1),
        (1, 40, 1, 17, 1),
    ] {
        let codes =
            Tensor::<A, 2, Int>::random([g, n], Distribution::Uniform(0.0, (s + 1) as f64), device);
        let values = Tensor::<A, 3>::random([g, n, w], Distribution::Normal(0.0, 1.0), device);
        let weight = Tensor::<A, 2>::random([g, n], Distribution::Uniform(0.0, 1.0), device);
        let (zs, vs, ws) = (
            ints(codes.clone()),
            host(values.clone()),
            host(weight.clone()),
        );
        for weighted in [false, true] {
            let case = format!("G {g}, N {n}, W {w}, S {s}, rows {rows}, weighted {weighted}");
            let calls = fused_totals_calls();
            let t = A::vq_code_totals(
                codes.clone().into_primitive(),
                weighted.then(|| weight.clone().into_primitive().tensor()),
                values.clone().into_primitive().tensor(),
                s,
                rows,
            )
            .expect("the backend has the kernel");
            assert!(fused_totals_calls() > calls, "{case}: not counted");
            let counts = host(Tensor::<A, 2>::from_primitive(TensorPrimitive::Float(
                t.counts,
            )));
            let sums = host(Tensor::<A, 3>::from_primitive(TensorPrimitive::Float(
                t.sums,
            )));
            let mut want_counts = vec![0.0f64; rows * s];
            let mut want_sums = vec![0.0f64; rows * s * w];
            for gi in 0..g {
                for ti in 0..n {
                    let z = zs[gi * n + ti] as usize;
                    if z == s {
                        continue;
                    }
                    let wt = if weighted {
                        ws[gi * n + ti] as f64
                    } else {
                        1.0
                    };
                    let at = (gi % rows) * s + z;
                    want_counts[at] += wt;
                    for c in 0..w {
                        want_sums[at * w + c] += wt * vs[(gi * n + ti) * w + c] as f64;
                    }
                }
            }
            let near = |got: &[f32], want: &[f64], what: &str| {
                assert_eq!(got.len(), want.len(), "{case}: {what}: size");
                for (i, (&a, &b)) in got.iter().zip(want).enumerate() {
                    assert!(
                        (a as f64 - b).abs() <= 1e-4 * b.abs().max(1.0),
                        "{case}: {what}[{i}] = {a}, expected {b}"
                    );
                }
            };
            near(&counts, &want_counts, "counts");
            near(&sums, &want_sums, "sums");
        }
    }
}

on_each_backend!(
    fused_code_totals_match_a_host_oracle,
    |d| gpu: code_totals_agree::<Ad>(d),
    fusion: code_totals_agree::<Fused>(d),
    cpu: code_totals_agree::<Cpu>(d)
);

/// The sum of the squares of many tensors by kernel (`VqBackend::vq_sum_squares`,
/// the global gradient norm's) against an f64 host sum: 70 tensors, more
/// than one launch takes, so that several launches share the partials;
/// from one element to one past a chunk of 4,096, a transposed view (read
/// flat) and a slice (read through a copy). `kernel`: whether the backend
/// has the kernel (`None` and no call counted otherwise).
fn sum_squares_agree<A: Under>(device: &A::Device, kernel: bool) {
    let shapes = [[1, 1], [1, 4096], [1, 4097], [3, 35], [64, 130], [7, 1]];
    let mut tensors: Vec<Tensor<A, 2>> = (0..68)
        .map(|i| {
            let shape = shapes[i % shapes.len()];
            Tensor::random(shape, Distribution::Normal(0.0, 1.0), device)
        })
        .collect();
    let big = Tensor::<A, 2>::random([40, 50], Distribution::Normal(0.0, 1.0), device);
    tensors.push(big.clone().transpose());
    tensors.push(big.slice([3..20, 5..42]));
    let want: f64 = tensors
        .iter()
        .flat_map(|t| host(t.clone()))
        .map(|x| f64::from(x) * f64::from(x))
        .sum();
    let calls = fused_norm_calls();
    let got = A::vq_sum_squares(
        tensors
            .into_iter()
            .map(|t| t.into_primitive().tensor())
            .collect(),
    );
    let Some(got) = got else {
        assert!(!kernel, "the backend has the kernel");
        assert_eq!(fused_norm_calls(), calls, "no kernel, no call counted");
        return;
    };
    assert!(kernel, "a sum of squares where there is no kernel");
    assert_eq!(fused_norm_calls(), calls + 1, "one call counted");
    let got = host(Tensor::<A, 1>::from_primitive(TensorPrimitive::Float(got)));
    assert_eq!(got.len(), 1, "one value");
    assert!(
        (f64::from(got[0]) - want).abs() <= 1e-5 * want,
        "sum of squares {}, expected {want}",
        got[0]
    );
}

on_each_backend!(
    fused_sum_of_squares_matches_a_host_oracle,
    |d| gpu: sum_squares_agree::<Ad>(d, true),
    fusion: sum_squares_agree::<Fused>(d, true),
    cpu: sum_squares_agree::<Cpu>(d, true)
);

/// RMS normalisation with its own backward step (`VqBackend::vq_rms_normalize`)
/// against the composed ops: the values, and the input's gradient under an
/// upstream gradient that is not constant, on a view that is not
/// contiguous (axes swapped), rows of odd width, one row small enough that
/// the epsilon matters. `own`: whether the backend takes the step of its
/// own (one call counted) or composes (none counted, the same numbers).
fn rms_agrees<A: Under>(device: &A::Device, own: bool) {
    let shape = [2, 5, 3, 7];
    let values: Vec<f32> = (0..shape.iter().product::<usize>())
        .map(|i| {
            let v = (i as f32 * 0.7).sin() * 1.3 + 0.2;
            if i < 7 { v * 1e-3 } else { v }
        })
        .collect();
    let upstream = Tensor::<A, 4>::random([2, 3, 5, 7], Distribution::Normal(0.0, 1.0), device);
    let run = |kernels| {
        let leaf = Tensor::<A, 4>::from_data(TensorData::new(values.clone(), shape), device)
            .require_grad();
        let y = rms_normalize_with(leaf.clone().swap_dims(1, 2), kernels); // [2, 3, 5, 7]
        let grads = (y.clone() * upstream.clone()).sum().backward();
        (host(y), host(leaf.grad(&grads).unwrap()))
    };
    let (want, want_grad) = run(Kernels::Composed);
    let calls = fused_rms_calls();
    let (got, got_grad) = run(Kernels::Fused);
    assert_eq!(fused_rms_calls(), calls + u64::from(own), "calls counted");
    let (values, grads) = (max_diff(&got, &want), max_diff(&got_grad, &want_grad));
    assert!(values <= 1e-6, "values differ by {values}");
    assert!(grads <= 1e-5, "gradients differ by {grads}");
    if !own {
        assert_eq!((values, grads), (0.0, 0.0), "the composed ops, twice");
    }
}

on_each_backend!(
    /// The CPU keeps burn's backward of the composed ops (the step of its own
    /// measured no faster there).
    rms_backward_matches_the_composed_ops,
    |d| gpu: rms_agrees::<Ad>(d, true),
    fusion: rms_agrees::<Fused>(d, true),
    cpu: rms_agrees::<Cpu>(d, false)
);

/// SiLU with the backend's own passes (`VqBackend::vq_silu`) against
/// burn's composed ops: the values within 1e-6 of their size, and the
/// input's gradient under an upstream gradient `g` that is not constant
/// within `1e-6 |g| (1 + |x|)` (the rounding of `1 - s` in both), on a view
/// that is not contiguous, inputs of both signs, zero and past the
/// sigmoid's saturation, a tensor small enough for one thread and one that
/// the CPU splits. `own`: whether the backend has the passes (a call
/// counted) or composes (none counted).
fn silu_agrees<A: Under>(device: &A::Device, own: bool) {
    for shape in [[2, 5, 3, 7], [2, 64, 3, 200]] {
        let n = shape.iter().product::<usize>();
        let mut values: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin() * 12.0).collect();
        values[..4].copy_from_slice(&[0.0, 95.0, -95.0, -0.0]);
        let [a, b, c, d] = shape;
        let upstream = Tensor::<A, 4>::random([a, c, b, d], Distribution::Normal(0.0, 1.0), device);
        let run = |kernels| {
            let leaf = Tensor::<A, 4>::from_data(TensorData::new(values.clone(), shape), device)
                .require_grad();
            let y = silu_with(leaf.clone().swap_dims(1, 2), kernels); // [a, c, b, d]
            let grads = (y.clone() * upstream.clone()).sum().backward();
            (host(y), host(leaf.grad(&grads).unwrap()))
        };
        let (want, want_grad) = run(Kernels::Composed);
        let calls = fused_silu_calls();
        let (got, got_grad) = run(Kernels::Fused);
        assert_eq!(fused_silu_calls(), calls + u64::from(own), "calls counted");
        assert!(want.iter().chain(&want_grad).all(|x| x.is_finite()));
        // x in the values' layout [a, c, b, d]; g in the gradient's [a, b, c, d].
        let x = host(
            Tensor::<A, 4>::from_data(TensorData::new(values.clone(), shape), device)
                .swap_dims(1, 2),
        );
        let g = host(upstream.clone().swap_dims(1, 2));
        for (i, (&got, &want)) in got.iter().zip(&want).enumerate() {
            let bound = 1e-6 * want.abs() + 1e-37;
            assert!(
                (got - want).abs() <= bound,
                "value {i} of {shape:?} at x = {}: {got} against {want}",
                x[i]
            );
        }
        for (i, (&got, &want)) in got_grad.iter().zip(&want_grad).enumerate() {
            let bound = 1e-6 * g[i].abs() * (1.0 + values[i].abs()) + 1e-37;
            assert!(
                (got - want).abs() <= bound,
                "gradient {i} of {shape:?} at x = {}: {got} against {want}",
                values[i]
            );
        }
    }
}

on_each_backend!(
    /// The cubecl backends keep burn's ops, which its fusion joins.
    silu_matches_the_composed_ops,
    |d| gpu: silu_agrees::<Ad>(d, false),
    fusion: silu_agrees::<Fused>(d, false),
    cpu: silu_agrees::<Cpu>(d, true)
);

/// The CPU's SiLU backward pass writes the input's gradient into the
/// upstream gradient's buffer where nothing else holds that buffer (no
/// allocation), and into a new one where something does: the held
/// gradient keeps its values, and both ways give `g s + g x s (1 - s)`.
#[test]
fn cpu_silu_backward_overwrites_only_a_gradient_it_owns() {
    use burn::backend::flex::FlexTensor;
    let n = 100_003; // several of the pass's chunks and a tail
    let xs: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin() * 12.0).collect();
    let gs: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
    let flex = |v: &[f32]| FlexTensor::from_data(TensorData::new(v.to_vec(), [n]));
    let grad = flex(&gs);
    let buffer = grad.storage::<f32>().as_ptr();
    let owned = Flex::vq_silu_backward(flex(&xs), grad);
    assert_eq!(owned.storage::<f32>().as_ptr(), buffer, "written in place");
    let grad = flex(&gs);
    let held = grad.clone();
    let copied = Flex::vq_silu_backward(flex(&xs), grad);
    assert_eq!(
        held.storage::<f32>(),
        &gs[..],
        "a held gradient keeps its values"
    );
    assert_ne!(copied.storage::<f32>().as_ptr(), buffer);
    for (i, (&a, &b)) in owned
        .storage::<f32>()
        .iter()
        .zip(copied.storage::<f32>())
        .enumerate()
    {
        let (x, g) = (xs[i], gs[i]);
        let s = 1.0 / (1.0 + (-x).exp());
        let want = g * s + g * x * s * (1.0 - s);
        assert_eq!(a.to_bits(), b.to_bits(), "element {i}: both ways agree");
        assert!(
            (a - want).abs() <= 1e-6 * (1.0 + want.abs()),
            "element {i}: {a} against {want}"
        );
    }
}

/// The commitment with its own backward step (`VqBackend::vq_commitment`,
/// given the squared errors) against the composed ops: the values, and the gradients of the keys (a
/// view with swapped axes) and of the codewords under an upstream gradient
/// that is not constant, one head and three. `own`: whether the backend
/// takes the step of its own (a call counted) or answers `None`.
fn commitment_agrees<A: Under>(device: &A::Device, own: bool) {
    let names = ["values", "keys", "codewords"];
    own_step_agrees("commitment", names, fused_commitment_calls, own, |h| {
        let (keys, words) = (
            draw::<A>([2, 5, h, 7], device),
            draw::<A>([2, h, 5, 7], device),
        );
        let upstream = Tensor::<A, 2>::random([2, 5], Distribution::Normal(0.0, 1.0), device);
        move |fused: bool| {
            let (k, w) = (
                leaf::<A>(&keys, [2, 5, h, 7], device),
                leaf::<A>(&words, [2, h, 5, 7], device),
            );
            let (kt, w2) = (k.clone().swap_dims(1, 2), w.clone()); // [2, H, 5, 7]
            let c = if fused {
                let errors = (kt.clone() - w2.clone()).square().sum_dim(3).detach();
                A::vq_commitment(kt, w2, errors)?
            } else {
                (kt - w2).square().sum_dim(3).sum_dim(1).reshape([2, 5])
            };
            let grads = (c.clone() * upstream.clone()).sum().backward();
            Some([
                host(c.inner()),
                host(k.grad(&grads)?),
                host(w.grad(&grads)?),
            ])
        }
    });
}

/// Normal draws of `shape` as host values.
fn draw<A: Under>(shape: [usize; 4], device: &A::Device) -> Vec<f32> {
    host(Tensor::<A, 4>::random(
        shape,
        Distribution::Normal(0.0, 1.0),
        device,
    ))
}

/// A leaf tensor of `shape` holding `values`, asking for its gradient.
fn leaf<A: Under>(values: &[f32], shape: [usize; 4], device: &A::Device) -> Tensor<A, 4> {
    Tensor::<A, 4>::from_data(TensorData::new(values.to_vec(), shape), device).require_grad()
}

/// A step with a backward of its own (`what`) against the composed ops,
/// for one head and three: `setup(h)` draws the inputs and returns the run,
/// which gives the `names`d host values (composed, or fused: `None` where
/// the backend has no step of its own). `calls` counts the step's calls;
/// `own`: whether the backend takes the step of its own.
fn own_step_agrees<const N: usize, R: Fn(bool) -> Option<[Vec<f32>; N]>>(
    what: &str,
    names: [&str; N],
    calls: fn() -> u64,
    own: bool,
    setup: impl Fn(usize) -> R,
) {
    for h in [1, 3] {
        let run = setup(h);
        let want = run(false).expect("the composed ops");
        let before = calls();
        let got = run(true);
        assert_eq!(
            calls(),
            before + u64::from(own),
            "{what}, H {h}: calls counted"
        );
        let Some(got) = got else {
            assert!(!own, "{what}, H {h}: no step of its own");
            continue;
        };
        assert!(
            own,
            "{what}, H {h}: a step of its own where none was expected"
        );
        for ((name, got), want) in names.iter().zip(got).zip(want) {
            let diff = max_diff(&got, &want);
            assert!(diff <= 1e-5, "{what}, H {h}: {name} differ by {diff}");
        }
    }
}

on_each_backend!(
    /// The CPU keeps burn's backward of the composed ops, as for the RMS norm.
    commitment_backward_matches_the_composed_ops,
    |d| gpu: commitment_agrees::<Ad>(d, true),
    fusion: commitment_agrees::<Fused>(d, true),
    cpu: commitment_agrees::<Cpu>(d, false)
);

/// Tensors joined along their last axis by kernel (`VqKernels::vq_join`,
/// what joins the gradients of the projections onto column blocks)
/// against burn's `cat`, bit for bit: ten parts of odd widths (more than
/// one launch takes, so the later launches start at an offset), one read
/// through a view with swapped axes, one a slice. Parts of other leading
/// axes are declined. `kernel`: whether the backend has the kernel.
fn join_agrees<K: VqKernels>(device: &K::Device, kernel: bool) {
    let widths = [3, 1, 7, 5, 2, 9, 4, 1, 6, 8];
    let normal =
        |shape: [usize; 3]| Tensor::<K, 3>::random(shape, Distribution::Normal(0.0, 1.0), device);
    let parts: Vec<Tensor<K, 3>> = widths
        .iter()
        .enumerate()
        .map(|(i, &n)| match i {
            2 => normal([2, n, 5]).swap_dims(1, 2),
            5 => normal([2, 5, n + 3]).slice([0..2, 0..5, 1..n + 1]),
            _ => normal([2, 5, n]),
        })
        .collect();
    let primitives = |parts: &[Tensor<K, 3>]| {
        parts
            .iter()
            .map(|t| t.clone().into_primitive().tensor())
            .collect()
    };
    let got = K::vq_join(primitives(&parts));
    let Some(got) = got else {
        assert!(!kernel, "the backend has the kernel");
        return;
    };
    assert!(kernel, "a join where there is no kernel");
    let got = Tensor::<K, 3>::from_primitive(TensorPrimitive::Float(got));
    let want = Tensor::cat(parts.clone(), 2);
    assert_eq!(got.dims(), want.dims(), "shape");
    assert_eq!(host(got), host(want), "values");
    let mut other = parts;
    other[7] = normal([2, 4, 1]);
    assert!(
        K::vq_join(primitives(&other)).is_none(),
        "other leading axes"
    );
}

on_each_backend!(
    joins_match_burns_cat,
    |d| gpu: join_agrees::<Cube>(d, true),
    fusion: join_agrees::<burn::backend::Wgpu>(d, true),
    cpu: join_agrees::<Flex>(d, false)
);

/// The straight-through estimator with its own backward step
/// (`VqBackend::vq_straight_through`) against the composed `k + (words -
/// k)` with the difference detached: the values (the codewords), and the
/// gradient of the keys (a view with swapped axes, also read by another
/// term of the loss) under an upstream gradient that is not constant, one
/// head and three. `own` as for the commitment.
fn straight_through_agrees<A: Under>(device: &A::Device, own: bool) {
    let names = ["values", "keys"];
    own_step_agrees(
        "straight-through",
        names,
        fused_straight_through_calls,
        own,
        |h| {
            let (keys, words) = (
                draw::<A>([2, 5, h, 7], device),
                draw::<A>([2, h, 5, 7], device),
            );
            let upstream =
                Tensor::<A, 4>::random([2, h, 5, 7], Distribution::Normal(0.0, 1.0), device);
            move |fused: bool| {
                let k = leaf::<A>(&keys, [2, 5, h, 7], device);
                let w =
                    Tensor::<A, 4>::from_data(TensorData::new(words.clone(), [2, h, 5, 7]), device);
                let kt = k.clone().swap_dims(1, 2); // [2, H, 5, 7]
                let k_hat = if fused {
                    A::vq_straight_through(kt.clone(), w)?
                } else {
                    kt.clone() + (w - kt.clone()).detach()
                };
                let loss = (k_hat.clone() * upstream.clone()).sum() + kt.sum_dim(3).sum() * 0.5;
                let grads = loss.backward();
                Some([host(k_hat.inner()), host(k.grad(&grads)?)])
            }
        },
    );
}

on_each_backend!(
    /// The CPU keeps burn's backward of the composed ops, as for the RMS norm.
    straight_through_backward_matches_the_composed_ops,
    |d| gpu: straight_through_agrees::<Ad>(d, true),
    fusion: straight_through_agrees::<Fused>(d, true),
    cpu: straight_through_agrees::<Cpu>(d, false)
);

/// The token log-likelihood with its own backward step
/// (`VqBackend::vq_token_nll`) against the composed log-softmax and
/// gather: the values, and the gradient of the logits (a view with swapped
/// axes, scaled so that the softmax is far from uniform) under an upstream
/// gradient that is not constant, for one row and three, over a vocabulary
/// of odd size with targets at both ends of it. `own` as for the
/// commitment.
fn token_nll_agrees<A: Under>(device: &A::Device, own: bool) {
    let names = ["values", "logits"];
    own_step_agrees("token nll", names, fused_token_nll_calls, own, |rows| {
        let (t, v) = (5, 11);
        let logits: Vec<f32> = draw::<A>([rows, v, t, 1], device)
            .into_iter()
            .map(|x| x * 8.0)
            .collect();
        let targets: Vec<i64> = (0..rows * t).map(|i| [0, v as i64 - 1, 3][i % 3]).collect();
        let upstream = Tensor::<A, 2>::random([rows, t], Distribution::Normal(0.0, 1.0), device);
        move |fused: bool| {
            let x = leaf::<A>(&logits, [rows, v, t, 1], device);
            let xt = x.clone().reshape([rows, v, t]).swap_dims(1, 2); // [R, T, V]
            let targets =
                Tensor::<A, 2, Int>::from_data(TensorData::new(targets.clone(), [rows, t]), device);
            let kernels = if fused {
                Kernels::Fused
            } else {
                Kernels::Composed
            };
            if fused && !own {
                // No step of its own: the composed ops, as `token_nll` runs them.
                A::vq_token_nll(xt.clone(), targets.clone())?;
            }
            let nll = token_nll(xt, targets, kernels); // [R, T]
            let grads = (nll.clone() * upstream.clone()).sum().backward();
            Some([host(nll.inner()), host(x.grad(&grads)?)])
        }
    });
}

on_each_backend!(
    /// The CPU keeps burn's backward of the composed ops, as for the RMS norm.
    token_nll_backward_matches_the_composed_ops,
    |d| gpu: token_nll_agrees::<Ad>(d, true),
    fusion: token_nll_agrees::<Fused>(d, true),
    cpu: token_nll_agrees::<Cpu>(d, false)
);

/// The product with blocks of a weight's columns with its own backward
/// step (`VqBackend::vq_column_blocks`) against the composed ops (a
/// product with each slice of the weight): the blocks, and the gradients
/// of the input (a view with swapped axes, also read by another term of
/// the loss) and of the weight (likewise), each block under an upstream
/// gradient of its own; three blocks, two and one, a batch of two, and
/// on the CPU products large enough for gemm's threads. `own`: whether
/// the backend takes the step of its own for several blocks (a call
/// counted) or answers `None`; `single`: likewise for one block.
fn column_blocks_agree<A: Under>(device: &A::Device, own: bool, single: bool) {
    /// The blocks, then the gradients of the input and the weight.
    fn run<A: Under, const N: usize>(
        device: &A::Device,
        [t, d]: [usize; 2],
        widths: [usize; N],
        draws: &[Vec<f32>],
        fused: bool,
    ) -> Option<Vec<Vec<f32>>> {
        let b = 2;
        let n: usize = widths.iter().sum();
        fn tensor<A: Under, const D: usize>(
            data: &[f32],
            shape: [usize; D],
            device: &A::Device,
        ) -> Tensor<A, D> {
            Tensor::from_data(TensorData::new(data.to_vec(), shape), device)
        }
        let x = tensor::<A, 3>(&draws[0], [t, b, d], device).require_grad(); // [T, B, D]
        let w = tensor::<A, 2>(&draws[1], [d, n], device).require_grad();
        let xv = x.clone().swap_dims(0, 1); // [B, T, D]
        let blocks = if fused {
            A::vq_column_blocks(xv.clone(), w.clone(), widths)?
        } else {
            let mut start = 0;
            widths.map(|c| {
                let cols = w.clone().slice([0..d, start..start + c]).unsqueeze::<3>();
                start += c;
                xv.clone().matmul(cols)
            })
        };
        let mut loss = (xv.clone() * xv).sum() + w.clone().sum() * 0.5;
        let mut got = vec![];
        for (i, block) in blocks.into_iter().enumerate() {
            let probe = tensor::<A, 3>(&draws[2 + i], [b, t, widths[i]], device);
            loss = loss + (block.clone() * probe).sum();
            got.push(host(block.inner()));
        }
        let grads = loss.backward();
        got.push(host(x.grad(&grads)?));
        got.push(host(w.grad(&grads)?));
        Some(got)
    }
    fn check<A: Under, const N: usize>(
        device: &A::Device,
        [t, d]: [usize; 2],
        widths: [usize; N],
        own: bool,
    ) {
        let b = 2;
        let n: usize = widths.iter().sum();
        let normal = |len: usize| {
            host(Tensor::<A, 1>::random(
                [len],
                Distribution::Normal(0.0, 1.0),
                device,
            ))
        };
        let mut draws = vec![normal(t * b * d), normal(d * n)];
        draws.extend(widths.map(|c| normal(b * t * c)));
        let want = run::<A, N>(device, [t, d], widths, &draws, false).expect("the composed ops");
        let calls = fused_column_blocks_calls();
        let got = run::<A, N>(device, [t, d], widths, &draws, true);
        assert_eq!(
            fused_column_blocks_calls(),
            calls + u64::from(own),
            "{widths:?}: calls counted"
        );
        let Some(got) = got else {
            assert!(!own, "{widths:?}: no product of its own");
            return;
        };
        assert!(
            own,
            "{widths:?}: a product of its own where none was expected"
        );
        assert_eq!(got.len(), want.len());
        for (i, (got, want)) in got.iter().zip(&want).enumerate() {
            let name = match i {
                i if i < N => format!("block {i}"),
                i if i == N => "the input's gradient".into(),
                _ => "the weight's gradient".into(),
            };
            // Sums of up to this many products of unit normals: a bound
            // that grows with their length (1e-5 for the small shapes).
            let terms = (b * t).max(n).max(d);
            let diff = max_diff(got, want);
            assert!(
                diff <= 1e-6 * terms as f32,
                "{widths:?}: {name} differs by {diff}"
            );
        }
    }
    check::<A, 3>(device, [5, 6], [3, 4, 2], own);
    check::<A, 2>(device, [5, 6], [5, 1], own);
    check::<A, 1>(device, [5, 6], [7], single);
    if single {
        // 400 x 96 x 200 multiply-adds a product: gemm's threads.
        check::<A, 2>(device, [200, 96], [200, 56], own);
        check::<A, 1>(device, [200, 96], [200], single);
    }
}

on_each_backend!(
    /// The CPU takes its own products both ways, for one block too.
    column_blocks_backward_matches_the_composed_ops,
    |d| gpu: column_blocks_agree::<Ad>(d, true, false),
    fusion: column_blocks_agree::<Fused>(d, true, false),
    cpu: column_blocks_agree::<Cpu>(d, true, true)
);

/// AdamW over many parameters by kernel (`VqBackend::vq_adamw`) against
/// burn's AdamW written out on the host in `f32`, operation by operation
/// ([`AdamwScalars`]): 37 parameters (more than one launch takes), from
/// one element to one past a chunk of 4,096, one gradient a transposed
/// view (read through a copy), each with its own learning rate, decay,
/// betas, step count and gradient factor, every third before its first
/// step (no moments). `kernel`: whether the backend has the kernel
/// (`None` and no call counted otherwise).
fn adamw_agrees<A: Under>(device: &A::Device, kernel: bool) {
    let shapes = [[1, 1], [1, 4096], [1, 4097], [3, 35], [64, 130], [7, 1]];
    let normal = |shape: [usize; 2], sd: f64| {
        Tensor::<A, 2>::random(shape, Distribution::Normal(0.0, sd), device)
    };
    let mut params = vec![];
    // Per parameter: its scalars and its four tensors' values.
    let mut wanted = vec![];
    for i in 0..37 {
        let shape = shapes[i % shapes.len()];
        let param = normal(shape, 1.0);
        let grad = if i == 4 {
            normal([shape[1], shape[0]], 1.0).transpose()
        } else {
            normal(shape, 1.0)
        };
        let moments = (i % 3 != 0).then(|| {
            let m2 = Tensor::<A, 2>::random(shape, Distribution::Uniform(0.0, 0.01), device);
            [normal(shape, 0.1), m2]
        });
        let scalars = AdamwScalars {
            lr: 1e-3 * (1 + i % 4) as f64,
            weight_decay: if i % 2 == 0 { 0.1 } else { 0.0 },
            beta1: [0.9, 0.8][i % 2],
            beta2: [0.999, 0.95][i / 2 % 2],
            epsilon: [1e-8, 1e-5][i / 3 % 2],
            time: if moments.is_some() { 2 + i % 7 } else { 1 },
            grad_scale: [1.0, 0.37, 2.5][i / 4 % 3],
        };
        let [m1, m2] = match &moments {
            Some([m1, m2]) => [host(m1.clone()), host(m2.clone())],
            None => [(); 2].map(|_| vec![0.0; shape[0] * shape[1]]),
        };
        wanted.push((scalars, [host(param.clone()), host(grad.clone()), m1, m2]));
        let primitive = |t: Tensor<A, 2>| t.into_primitive().tensor();
        params.push(AdamwParam {
            param: primitive(param),
            grad: primitive(grad),
            moments: moments.map(|m| m.map(primitive)),
            scalars,
        });
    }
    let calls = fused_adamw_calls();
    let Some(got) = A::vq_adamw(params) else {
        assert!(!kernel, "the backend has the kernel");
        assert_eq!(fused_adamw_calls(), calls, "no kernel, no call counted");
        return;
    };
    assert!(kernel, "an AdamW step where there is no kernel");
    assert_eq!(fused_adamw_calls(), calls + 1, "one call counted");
    assert_eq!(got.len(), wanted.len(), "three tensors a parameter");
    for (i, (three, (s, [p, g, m1, m2]))) in got.into_iter().zip(&wanted).enumerate() {
        let t = s.time as i32;
        let (c1, c2) = (1.0 - s.beta1.powi(t), 1.0 - s.beta2.powi(t));
        let keep = (1.0 - s.lr * s.weight_decay) as f32;
        let mut want = [vec![], vec![], vec![]];
        for j in 0..p.len() {
            let g = g[j] * s.grad_scale as f32;
            let a = m1[j] * s.beta1 + g * (1.0 - s.beta1);
            let b = m2[j] * s.beta2 + g * g * (1.0 - s.beta2);
            let update = (a / c1) / ((b / c2).sqrt() + s.epsilon);
            want[0].push(p[j] * keep - update * s.lr as f32);
            want[1].push(a);
            want[2].push(b);
        }
        // Below a floor of each output's scale (a moment of terms of 0.1
        // may cancel), rounding is measured against the floor.
        let floors = [1e-3, 0.1, 1e-3];
        for (k, (got, want)) in three.into_iter().zip(want).enumerate() {
            let got = host(Tensor::<A, 2>::from_primitive(TensorPrimitive::Float(got)));
            assert_eq!(got.len(), want.len(), "parameter {i}, output {k}: size");
            for (j, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (g - w).abs() <= 1e-6 * w.abs().max(floors[k]),
                    "parameter {i}, output {k} (value, m1, m2), element {j}: {g}, expected {w}"
                );
            }
        }
    }
}

on_each_backend!(
    fused_adamw_matches_a_host_oracle,
    |d| gpu: adamw_agrees::<Ad>(d, true),
    fusion: adamw_agrees::<Fused>(d, true),
    cpu: adamw_agrees::<Cpu>(d, true)
);

/// `burn::Dispatch` (what `tvq` runs on) reaches the CPU's kernels in
/// inference: on the CPU without autodiff the network's forward pass under
/// [`Kernels::Fused`] runs every sublayer's attention and quantizer as a
/// kernel and agrees with the composed pass (Toeplitz and XL, two
/// segments, so that the second starts from a carried cache); with
/// autodiff it composes (no kernel has a backward step there): no kernel
/// call, the composed logits.
#[test]
fn dispatch_reaches_the_cpu_kernels_in_inference() {
    use crate::tiny::{config, model, random_tokens, tokens};
    use tvq_model::{Pass, RelativeBias, TransformerVq};

    for bias in [RelativeBias::Toeplitz, RelativeBias::Xl] {
        let cfg = config(bias);
        let (b, t) = (2, 4 * cfg.block_len);
        let segments = [3, 4].map(|seed| random_tokens(b, t, cfg.vocab_size, seed));
        // Each segment's logits, and the attention and quantizer kernel calls.
        let run = |m: &TransformerVq<common::B>, kernels: Kernels| {
            let device = m.embedding.weight.device();
            let mut m = m.clone();
            m.set_kernels(kernels);
            let calls = [fused_attention_calls(), fused_quantize_calls()];
            let mut state = m.empty_state();
            let logits = segments.clone().map(|data| {
                let out = m
                    .forward(tokens(&data, b, &device), state.clone(), Pass::new())
                    .unwrap();
                state = out.state;
                common::to_vec(out.logits.unwrap().detach())
            });
            let reached = [
                fused_attention_calls() - calls[0],
                fused_quantize_calls() - calls[1],
            ];
            (logits, reached)
        };
        let sublayers = 2 * cfg.n_layer as u64;
        let plain = model(&cfg, 1, &cpu());
        let (composed, none) = run(&plain, Kernels::Composed);
        assert_eq!(none, [0, 0], "{bias:?}: composed ran a kernel");
        let (fused, reached) = run(&plain, Kernels::Fused);
        assert_eq!(
            reached,
            [2 * sublayers; 2],
            "{bias:?}: every sublayer, both segments"
        );
        for (segment, (f, c)) in fused.iter().zip(&composed).enumerate() {
            let diff = max_diff(f, c);
            assert!(diff <= 1e-5, "{bias:?}, segment {segment}: {diff:e}");
        }
        let tracked = model(&cfg, 1, &common::cpu_ad());
        let (autodiff, composes) = run(&tracked, Kernels::Fused);
        assert_eq!(composes, [0, 0], "{bias:?}: a kernel ran under autodiff");
        assert_eq!(
            autodiff,
            run(&tracked, Kernels::Composed).0,
            "{bias:?}: under autodiff"
        );
    }
}
