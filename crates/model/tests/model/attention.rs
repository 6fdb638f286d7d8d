//! The block-parallel and recurrent forms against the quadratic oracle.

use burn::prelude::*;
use burn::tensor::Distribution;
use tvq_model::attention::{
    AttentionInput, AttentionState, Position, Rotary, block_attention, block_attention_with_groups,
    recurrent_attention, rotary_scores,
};
use tvq_model::precision::Precision;
use tvq_model::quantizer::VectorQuantizer;
use tvq_model::{CacheGrad, Compute, Kernels, WindowKeys};

use crate::common::*;

/// Sizes of one attention problem.
#[derive(Clone, Copy, Debug)]
struct Shape {
    b: usize,
    h: usize,
    t: usize,
    l: usize,
    k: usize,
    v: usize,
    s: usize,
    /// Bias table per query (`[B, H, T, L+1]`, as XL gives) or shared (`[1, H, 1, L+1]`, Toeplitz).
    per_query_bias: bool,
    /// With the windowed rotary position instead of the bias table.
    rotary: bool,
    /// The compressed cache's key limit.
    cache_limit: Option<usize>,
    /// The most keys one code of the cache weighs as.
    code_limit: Option<usize>,
    /// A weight of the cache's counts per query (random in (0, 2)).
    count_weight: bool,
}

const SHAPES: [Shape; 8] = [
    // one block
    Shape {
        b: 1,
        h: 1,
        t: 8,
        l: 8,
        k: 4,
        v: 6,
        s: 5,
        per_query_bias: false,
        rotary: false,
        cache_limit: None,
        code_limit: None,
        count_weight: false,
    },
    // two blocks
    Shape {
        b: 1,
        h: 1,
        t: 8,
        l: 4,
        k: 4,
        v: 6,
        s: 5,
        per_query_bias: true,
        rotary: false,
        cache_limit: None,
        code_limit: None,
        count_weight: false,
    },
    // many blocks, batch > 1
    Shape {
        b: 3,
        h: 1,
        t: 24,
        l: 4,
        k: 4,
        v: 5,
        s: 3,
        per_query_bias: false,
        rotary: false,
        cache_limit: None,
        code_limit: Some(1),
        count_weight: false,
    },
    // many blocks, several heads, per-query bias
    Shape {
        b: 2,
        h: 3,
        t: 20,
        l: 4,
        k: 4,
        v: 3,
        s: 6,
        per_query_bias: true,
        rotary: false,
        cache_limit: Some(5),
        code_limit: None,
        count_weight: true,
    },
    // block length 1 (every earlier key but one is in the cache)
    Shape {
        b: 2,
        h: 2,
        t: 6,
        l: 1,
        k: 3,
        v: 2,
        s: 4,
        per_query_bias: true,
        rotary: false,
        cache_limit: Some(2),
        code_limit: Some(2),
        count_weight: true,
    },
    // rotary: one block
    Shape {
        b: 1,
        h: 1,
        t: 8,
        l: 8,
        k: 4,
        v: 3,
        s: 5,
        per_query_bias: false,
        rotary: true,
        cache_limit: None,
        code_limit: None,
        count_weight: false,
    },
    // rotary: many blocks, several heads
    Shape {
        b: 2,
        h: 2,
        t: 20,
        l: 4,
        k: 6,
        v: 3,
        s: 4,
        per_query_bias: false,
        rotary: true,
        cache_limit: Some(3),
        code_limit: Some(1),
        count_weight: false,
    },
    // rotary: block length 1
    Shape {
        b: 1,
        h: 2,
        t: 6,
        l: 1,
        k: 4,
        v: 2,
        s: 3,
        per_query_bias: true,
        rotary: true,
        cache_limit: None,
        code_limit: None,
        count_weight: true,
    },
];

/// Leaves of one problem: q, k, v, bias (all requiring grad on an autodiff
/// device) and a quantizer with few codes, so codes repeat.
struct Problem {
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    bias: Tensor<B, 4>,
    quantizer: VectorQuantizer<B>,
    rotary: Option<Rotary>,
    cache_limit: Option<usize>,
    code_limit: Option<usize>,
    /// Each query's weight of the cache's counts, `[B, H, T, 1]`.
    count_weight: Option<Tensor<B, 4>>,
    /// Which keys the window scores against.
    window_keys: WindowKeys,
}

impl Problem {
    fn new(sh: Shape, seed: u64, device: &burn::DispatchDevice) -> Self {
        B::seed(device, seed);
        let leaf = |t: Tensor<B, 4>| {
            if B::ad_enabled(device) {
                t.require_grad()
            } else {
                t
            }
        };
        let bias_shape = if sh.per_query_bias {
            [sh.b, sh.h, sh.t, sh.l + 1]
        } else {
            [1, sh.h, 1, sh.l + 1]
        };
        Self {
            q: leaf(randn([sh.b, sh.h, sh.t, sh.k], device)),
            k: leaf(randn([sh.b, sh.h, sh.t, sh.k], device)),
            v: leaf(randn([sh.b, sh.h, sh.t, sh.v], device)),
            bias: leaf(randn(bias_shape, device)),
            quantizer: VectorQuantizer::new(sh.h, sh.s, sh.k, device),
            rotary: sh.rotary.then(|| Rotary::new(sh.l)),
            cache_limit: sh.cache_limit,
            code_limit: sh.code_limit,
            count_weight: sh.count_weight.then(|| {
                let w = Tensor::random(
                    [sh.b, sh.h, sh.t, 1],
                    Distribution::Uniform(0.05, 1.95),
                    device,
                );
                leaf(w)
            }),
            window_keys: WindowKeys::Quantized,
        }
    }

    /// Attention input for tokens `range` of the problem.
    fn input(&self, range: std::ops::Range<usize>) -> AttentionInput<B> {
        let [b, h, _, k] = self.q.dims();
        let cut = |x: &Tensor<B, 4>| {
            let d = x.dims();
            x.clone().slice([0..d[0], 0..d[1], range.clone(), 0..d[3]])
        };
        let vq = self
            .quantizer
            .quantize(cut(&self.k), None, Kernels::Composed);
        let bias = if self.bias.dims()[2] == 1 {
            self.bias.clone()
        } else {
            cut(&self.bias)
        };
        let _ = (b, h, k);
        let k_window = match self.window_keys {
            WindowKeys::Quantized => vq.k_hat,
            WindowKeys::Exact => cut(&self.k),
        };
        AttentionInput {
            q: cut(&self.q),
            position: match self.rotary {
                Some(rot) => Position::Rotary(rot),
                None => Position::Table(bias),
            },
            k_window,
            codes: vq.codes,
            v: cut(&self.v),
            codebook: self.quantizer.codebook(),
            count_weight: self.count_weight.as_ref().map(cut),
        }
    }

    /// The leaves whose gradients the attention gives: q, k, v, and the bias
    /// table where it is the position term.
    fn leaves(&self) -> Vec<(&'static str, &Tensor<B, 4>)> {
        let mut leaves = vec![("q", &self.q), ("k", &self.k), ("v", &self.v)];
        if self.rotary.is_none() {
            leaves.push(("bias", &self.bias));
        }
        leaves
    }

    /// How the problem computes under `cache_grad`: in `f32`, with its cache and code limits.
    fn cx(&self, cache_grad: CacheGrad) -> Compute {
        Compute {
            cache_grad,
            cache_limit: self.cache_limit,
            code_limit: self.code_limit,
            precision: Precision::F32,
            window_keys: self.window_keys,
            kernels: Default::default(),
        }
    }

    fn oracle(&self, l: usize, mode: CacheGrad) -> Tensor<B, 4> {
        oracle_attention(self.input(0..self.q.dims()[2]), l, self.cx(mode))
    }
}

const MODES: [CacheGrad; 3] = [CacheGrad::Window, CacheGrad::None, CacheGrad::Full];

#[test]
fn block_form_matches_oracle_forward_and_gradients() {
    let device = cpu_ad();
    for (n, sh) in SHAPES.iter().enumerate() {
        for mode in MODES {
            let p = Problem::new(*sh, 10 + n as u64, &device);
            let (out, _) = block_attention(
                p.input(0..sh.t),
                AttentionState::default(),
                sh.l,
                p.cx(mode),
            )
            .unwrap();
            let want = p.oracle(sh.l, mode);
            let ctx = format!("{sh:?} {mode:?}");
            assert_close(out.clone(), want.clone(), 1e-5, &format!("output, {ctx}"));

            // Same random projection of both outputs; compare every leaf's gradient.
            let w = randn(out.dims(), &device);
            let g_block = (out * w.clone()).sum().backward();
            let g_oracle = (want * w).sum().backward();
            let count_weight = p.count_weight.as_ref().map(|w| ("count weight", w));
            for (name, leaf) in p.leaves().into_iter().chain(count_weight) {
                let a = leaf.grad(&g_block).expect("block gradient");
                let b = leaf.grad(&g_oracle).expect("oracle gradient");
                assert!(
                    max_abs(b.clone()) > 0.0,
                    "oracle gradient of {name} is zero, {ctx}"
                );
                assert_close(a, b, 1e-5, &format!("d/d{name}, {ctx}"));
            }
        }
    }
}

#[test]
fn carried_state_gives_the_same_output_as_one_segment() {
    let device = cpu();
    for (n, sh) in SHAPES.iter().enumerate().filter(|(_, sh)| sh.t / sh.l >= 2) {
        let p = Problem::new(*sh, 20 + n as u64, &device);
        let whole = p.oracle(sh.l, CacheGrad::Window);
        let (one, _) = block_attention(
            p.input(0..sh.t),
            AttentionState::default(),
            sh.l,
            p.cx(CacheGrad::Window),
        )
        .unwrap();
        assert_close(
            one.clone(),
            whole,
            1e-5,
            &format!("one segment vs oracle, {sh:?}"),
        );
        // Every split at a block boundary, and three segments.
        for cut in (sh.l..sh.t).step_by(sh.l) {
            let (a, st) = block_attention(
                p.input(0..cut),
                AttentionState::default(),
                sh.l,
                p.cx(CacheGrad::Window),
            )
            .unwrap();
            assert_eq!(st.pos, cut);
            let (b, st) =
                block_attention(p.input(cut..sh.t), st, sh.l, p.cx(CacheGrad::Window)).unwrap();
            assert_eq!(st.pos, sh.t);
            assert_close(
                Tensor::cat(vec![a, b], 2),
                one.clone(),
                1e-5,
                &format!("split at {cut}, {sh:?}"),
            );
        }
        let mut state = AttentionState::default();
        let mut parts = vec![];
        for start in (0..sh.t).step_by(sh.l) {
            let (o, s) = block_attention(
                p.input(start..start + sh.l),
                state,
                sh.l,
                p.cx(CacheGrad::Window),
            )
            .unwrap();
            parts.push(o);
            state = s;
        }
        assert_close(
            Tensor::cat(parts, 2),
            one,
            1e-5,
            &format!("block by block, {sh:?}"),
        );
    }
}

#[test]
fn recurrent_form_matches_block_form() {
    let device = cpu();
    for (n, sh) in SHAPES.iter().enumerate() {
        let p = Problem::new(*sh, 30 + n as u64, &device);
        let (block, block_state) = block_attention(
            p.input(0..sh.t),
            AttentionState::default(),
            sh.l,
            p.cx(CacheGrad::Window),
        )
        .unwrap();
        let mut state = AttentionState::default();
        let mut outs = vec![];
        for i in 0..sh.t {
            let (o, s) =
                recurrent_attention(p.input(i..i + 1), state, sh.l, p.cx(CacheGrad::Window))
                    .unwrap();
            outs.push(o);
            state = s;
        }
        assert_close(
            Tensor::cat(outs, 2),
            block,
            1e-5,
            &format!("token by token, {sh:?}"),
        );
        // Both forms leave the same state behind (the recurrent form has no
        // cache object until a block leaves the window; the block form's is empty then).
        let b = block_state.cache.unwrap();
        match state.cache {
            Some(a) => {
                assert_close(a.counts, b.counts, 0.0, "cache counts");
                assert_close(a.means, b.means, 1e-5, "cache means");
            }
            None => assert_eq!(
                max_abs(b.counts),
                0.0,
                "block form cached tokens the recurrent form did not"
            ),
        }
        assert_close(
            state.prev.unwrap().v,
            block_state.prev.unwrap().v,
            0.0,
            "previous block",
        );
        assert!(state.current.is_none());
    }
}

#[test]
fn block_form_continues_after_recurrent_steps() {
    // Decode the first block token by token, then run the rest block-parallel.
    let sh = SHAPES[2];
    let device = cpu();
    let p = Problem::new(sh, 40, &device);
    let (whole, _) = block_attention(
        p.input(0..sh.t),
        AttentionState::default(),
        sh.l,
        p.cx(CacheGrad::Window),
    )
    .unwrap();
    let mut state = AttentionState::default();
    let mut outs = vec![];
    for i in 0..sh.l {
        // Mid-block, the block form must refuse the state.
        if i > 0 {
            assert!(
                block_attention(
                    p.input(i..i + sh.l),
                    state.clone(),
                    sh.l,
                    p.cx(CacheGrad::Window)
                )
                .is_err()
            );
        }
        let (o, s) =
            recurrent_attention(p.input(i..i + 1), state, sh.l, p.cx(CacheGrad::Window)).unwrap();
        outs.push(o);
        state = s;
    }
    let (rest, _) =
        block_attention(p.input(sh.l..sh.t), state, sh.l, p.cx(CacheGrad::Window)).unwrap();
    outs.push(rest);
    assert_close(Tensor::cat(outs, 2), whole, 1e-5, "steps then blocks");
}

#[test]
fn exact_window_keys_match_the_oracle_in_every_form() {
    // The window scores the keys themselves; older keys are codewords.
    let device = cpu_ad();
    for (n, sh) in SHAPES.iter().enumerate() {
        let mut p = Problem::new(*sh, 60 + n as u64, &device);
        p.window_keys = WindowKeys::Exact;
        let (cx, fresh) = (p.cx(CacheGrad::Window), AttentionState::default);
        let (out, _) = block_attention(p.input(0..sh.t), fresh(), sh.l, cx).unwrap();
        let want = p.oracle(sh.l, CacheGrad::Window);
        assert_close(out.clone(), want.clone(), 1e-5, &format!("output, {sh:?}"));
        let w = randn(out.dims(), &device);
        let g_block = (out.clone() * w.clone()).sum().backward();
        let g_oracle = (want * w).sum().backward();
        for (name, leaf) in p.leaves() {
            let (a, b) = (leaf.grad(&g_block).unwrap(), leaf.grad(&g_oracle).unwrap());
            assert_close(a, b, 1e-5, &format!("d/d{name}, {sh:?}"));
        }
        // Token by token, the state carrying the exact keys of its window.
        let (mut state, mut steps) = (fresh(), vec![]);
        for i in 0..sh.t {
            let (o, s) = recurrent_attention(p.input(i..i + 1), state, sh.l, cx).unwrap();
            steps.push(o);
            state = s;
        }
        let out = out.detach();
        assert_close(
            Tensor::cat(steps, 2),
            out.clone(),
            1e-5,
            &format!("steps, {sh:?}"),
        );
        // Not the paper's window: its quantized keys give another output.
        p.window_keys = WindowKeys::Quantized;
        let (paper, _) = block_attention(p.input(0..sh.t), fresh(), sh.l, cx).unwrap();
        let diff = max_abs_diff(out, paper.detach());
        assert!(
            diff > 1e-3,
            "exact and quantized windows differ by {diff}, {sh:?}"
        );
    }
}

/// Gradient of `sum(w * out[last block])` with respect to each block's keys and values.
fn block_grad_norms(mode: CacheGrad, rotary: bool) -> (Vec<f32>, Vec<f32>) {
    let sh = Shape {
        b: 2,
        h: 1,
        t: 16,
        l: 4,
        k: 4,
        v: 3,
        s: 3,
        per_query_bias: false,
        rotary,
        cache_limit: None,
        code_limit: None,
        count_weight: false,
    };
    let device = cpu_ad();
    let p = Problem::new(sh, 50, &device);
    let (out, _) = block_attention(
        p.input(0..sh.t),
        AttentionState::default(),
        sh.l,
        p.cx(mode),
    )
    .unwrap();
    let last = out.slice([0..sh.b, 0..sh.h, sh.t - sh.l..sh.t, 0..sh.v]);
    let w = randn(last.dims(), &device);
    let grads = (last * w).sum().backward();
    let per_block = |g: Tensor<B, 4>| -> Vec<f32> {
        let d = g.dims();
        (0..sh.t / sh.l)
            .map(|r| {
                max_abs(
                    g.clone()
                        .slice([0..d[0], 0..d[1], r * sh.l..(r + 1) * sh.l, 0..d[3]]),
                )
            })
            .collect()
    };
    (
        per_block(p.k.grad(&grads).unwrap()),
        per_block(p.v.grad(&grads).unwrap()),
    )
}

#[test]
fn gradient_reaches_exactly_the_blocks_the_cache_mode_allows() {
    for rotary in [false, true] {
        // Loss on block 3 of 4. Block 2 is its previous block; blocks 0 and 1
        // are in its compressed cache, which holds codes (no gradient) and
        // mean values (gradient only under `full`).
        let (k, v) = block_grad_norms(CacheGrad::None, rotary);
        assert!(
            k[3] > 0.0 && v[3] > 0.0,
            "present block always learns: {k:?} {v:?}"
        );
        assert_eq!(
            &k[..3],
            &[0.0; 3],
            "none: no key gradient before the present block"
        );
        assert_eq!(
            &v[..3],
            &[0.0; 3],
            "none: no value gradient before the present block"
        );

        let (k, v) = block_grad_norms(CacheGrad::Window, rotary);
        assert!(
            k[2] > 0.0 && v[2] > 0.0,
            "window: previous block learns: {k:?} {v:?}"
        );
        assert_eq!(&k[..2], &[0.0; 2], "window: older keys get nothing");
        assert_eq!(&v[..2], &[0.0; 2], "window: older values get nothing");

        let (k, v) = block_grad_norms(CacheGrad::Full, rotary);
        assert!(k[2] > 0.0 && v[2] > 0.0, "full: previous block learns");
        assert!(
            v[0] > 0.0 && v[1] > 0.0,
            "full: older values learn through the cache: {v:?}"
        );
        assert_eq!(
            &k[..2],
            &[0.0; 2],
            "full: older keys are codes, which carry no gradient"
        );
    }
}

#[test]
fn straight_through_estimator_and_commitment() {
    let device = cpu_ad();
    B::seed(&device, 60);
    let quantizer = VectorQuantizer::<B>::new(2, 5, 4, &device);
    let k = randn([2, 2, 7, 4], &device).require_grad();
    let vq = quantizer.quantize(k.clone(), None, Kernels::Composed);

    // The value of k_hat is the codeword of its code.
    let codebook = quantizer.codebook();
    let codes: Vec<i64> = vq
        .codes
        .clone()
        .into_data()
        .convert::<i64>()
        .to_vec()
        .unwrap();
    let cb = to_vec(codebook.clone());
    let kh = to_vec(vq.k_hat.clone());
    let kv = to_vec(k.clone());
    for (n, &z) in codes.iter().enumerate() {
        let head = (n / 7) % 2;
        let row = &cb[(head * 5 + z as usize) * 4..][..4];
        // k + (C_z - k) is C_z up to one rounding.
        for (a, b) in kh[n * 4..n * 4 + 4].iter().zip(row) {
            assert!((a - b).abs() <= 1e-6, "k_hat is the codeword: {a} vs {b}");
        }
        // ... and it is the nearest one.
        let dist = |c: &[f32]| {
            c.iter()
                .zip(&kv[n * 4..n * 4 + 4])
                .map(|(a, b)| (a - b).powi(2))
                .sum::<f32>()
        };
        for s in 0..5 {
            assert!(dist(row) <= dist(&cb[(head * 5 + s) * 4..][..4]) + 1e-6);
        }
    }

    // d/dk of sum(w * k_hat) is w: the gradient passes straight through.
    let w = randn([2, 2, 7, 4], &device);
    let g = (vq.k_hat * w.clone()).sum().backward();
    assert_close(
        k.grad(&g).unwrap(),
        w.inner(),
        0.0,
        "straight-through gradient",
    );

    // d/dk of the commitment error sum is 2 (k - C_z); the codebook gets none.
    let vq = quantizer.quantize(k.clone(), None, Kernels::Composed);
    let c_z = vq.k_hat.clone().detach(); // the value of k_hat is C_z
    let g = vq.commitment.sum().backward();
    assert_close(
        k.grad(&g).unwrap(),
        ((k.detach() - c_z.detach()) * 2.0).inner(),
        1e-6,
        "commitment gradient",
    );
    assert!(
        quantizer.c_sum.val().grad(&g).is_none(),
        "the codebook receives no gradient"
    );
}

/// The rotary scores the oracle uses are the definition,
/// `q_i . R(min(i - j, L)) k_j`, computed pair by pair on the host; with a
/// position channel of `P` features, the last `P/2` pairs turn at the
/// channel's own frequencies, spread over the window like the content's.
#[test]
fn rotary_scores_are_the_clipped_rotation_pair_by_pair() {
    let device = cpu();
    let (t, l) = (11, 4);
    // (K + P, P): content and channel pairs each from 1 radian per token
    // down to pi / L.
    for (k, channel) in [(6, 0), (10, 4)] {
        let rot = Rotary::new(l).with_channel(channel);
        let q = randn([1, 1, t, k], &device);
        let kk = randn([1, 1, t, k], &device);
        let got = to_vec(rotary_scores(
            rot,
            q.clone(),
            kk.clone(),
            Compute::default(),
        ));
        let (q, kk) = (to_vec(q), to_vec(kk));
        let half = k / 2;
        let content = half - channel / 2;
        let theta = |m: usize| {
            let (m, n) = if m < content {
                (m, content)
            } else {
                (m - content, channel / 2)
            };
            (std::f64::consts::PI / l as f64).powf(m as f64 / (n - 1) as f64)
        };
        for i in 0..t {
            for j in 0..t {
                // R(d) turns pair (m, m + K/2) by d theta_m; q . R(d) k with
                // the key turned backwards by d is the score of a query d later.
                let d = (i as f64 - j as f64).min(l as f64);
                let mut want = 0.0;
                for m in 0..half {
                    let a = -d * theta(m);
                    let (k1, k2) = (kk[j * k + m] as f64, kk[j * k + half + m] as f64);
                    let (r1, r2) = (k1 * a.cos() - k2 * a.sin(), k2 * a.cos() + k1 * a.sin());
                    want += q[i * k + m] as f64 * r1 + q[i * k + half + m] as f64 * r2;
                }
                let g = got[i * t + j] as f64;
                assert!(
                    (g - want).abs() < 1e-5,
                    "P = {channel}, ({i}, {j}): {g} vs {want}"
                );
            }
        }
    }
}

/// Share and entropy of each query's attention by group (present block,
/// previous block, older keys), from the oracle's explicit weights:
/// `[B, H, T, 3]` each, flattened.
fn oracle_groups(p: &Problem, sh: Shape) -> (Vec<f32>, Vec<f32>) {
    let device = p.q.device();
    let input = p.input(0..sh.t);
    let eye: Vec<f32> = (0..sh.t * sh.t)
        .map(|n| f32::from(n / sh.t == n % sh.t))
        .collect();
    let eye = Tensor::<B, 2>::from_data(TensorData::new(eye, [sh.t, sh.t]), &device)
        .reshape([1, 1, sh.t, sh.t])
        .expand([sh.b, sh.h, sh.t, sh.t]);
    // Attention to the identity's rows: the weights themselves, [B, H, T, T].
    let weights = oracle_attention(
        AttentionInput { v: eye, ..input },
        sh.l,
        p.cx(CacheGrad::Window),
    );
    let a: Vec<f32> = weights.into_data().to_vec().unwrap();
    let (mut share, mut entropy) = (vec![], vec![]);
    for row in a.chunks(sh.t) {
        let i = (share.len() / 3) % sh.t;
        let (mut s, mut e) = ([0f32; 3], [0f32; 3]);
        for (j, &w) in row.iter().enumerate().take(i + 1) {
            let g = (i / sh.l - j / sh.l).min(2);
            s[g] += w;
            if w > 0.0 {
                e[g] -= w * w.ln();
            }
        }
        share.extend(s);
        entropy.extend(e);
    }
    (share, entropy)
}

#[test]
fn attention_groups_match_the_oracle_weights_in_one_segment_and_carried() {
    let device = cpu();
    for (n, sh) in SHAPES.iter().enumerate() {
        let p = Problem::new(*sh, 70 + n as u64, &device);
        let (want_share, want_entropy) = oracle_groups(&p, *sh);
        // Whole, then from a carried state at a block boundary mid-way.
        let cut = sh.t / sh.l / 2 * sh.l;
        let mut parts = vec![];
        let whole = block_attention_with_groups(
            p.input(0..sh.t),
            AttentionState::default(),
            sh.l,
            p.cx(CacheGrad::Window),
        )
        .unwrap();
        parts.push((0, whole));
        if cut > 0 {
            let (_, state) = block_attention(
                p.input(0..cut),
                AttentionState::default(),
                sh.l,
                p.cx(CacheGrad::Window),
            )
            .unwrap();
            let rest = block_attention_with_groups(
                p.input(cut..sh.t),
                state,
                sh.l,
                p.cx(CacheGrad::Window),
            )
            .unwrap();
            parts.push((cut, rest));
        }
        for (start, a) in parts {
            let groups = a.groups.expect("groups were asked for");
            let ctx = format!("{sh:?} from token {start}");
            let want_weight = match &p.count_weight {
                Some(w) => w.clone().slice([0..sh.b, 0..sh.h, start..sh.t, 0..1]),
                None => Tensor::ones([sh.b, sh.h, sh.t - start, 1], &device),
            };
            assert_close(
                groups.count_weight,
                want_weight,
                0.0,
                &format!("count weight, {ctx}"),
            );
            let rows = |v: &[f32]| -> Vec<f32> {
                v.chunks(sh.t * 3)
                    .flat_map(|head| head[start * 3..].to_vec())
                    .collect()
            };
            let share: Vec<f32> = groups.share.into_data().to_vec().unwrap();
            let entropy: Vec<f32> = groups.entropy.into_data().to_vec().unwrap();
            for (what, got, want) in [
                ("share", share, rows(&want_share)),
                ("entropy", entropy, rows(&want_entropy)),
            ] {
                assert_eq!(got.len(), want.len(), "{what}, {ctx}");
                for (x, y) in got.iter().zip(&want) {
                    assert!((x - y).abs() < 1e-4, "{what}: {got:?} != {want:?}, {ctx}");
                }
            }
        }
    }
}
