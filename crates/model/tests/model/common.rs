//! Helpers shared by the model tests, and the quadratic oracle.

use burn::backend::flex::FlexDevice;
use burn::prelude::*;
use burn::tensor::Distribution;
use burn::{Dispatch, DispatchDevice};
use tvq_model::attention::{AttentionInput, Position, rotary_scores};
use tvq_model::{CacheGrad, Compute};

pub type B = Dispatch;

/// The CPU device without autodiff.
pub fn cpu() -> DispatchDevice {
    DispatchDevice::Flex(FlexDevice)
}

/// The CPU device with autodiff.
pub fn cpu_ad() -> DispatchDevice {
    DispatchDevice::autodiff(cpu())
}

pub fn randn<const D: usize>(shape: [usize; D], device: &DispatchDevice) -> Tensor<B, D> {
    Tensor::random(shape, Distribution::Normal(0.0, 1.0), device)
}

pub fn to_vec<const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data().convert::<f32>().to_vec().unwrap()
}

pub fn max_abs_diff<const D: usize>(a: Tensor<B, D>, b: Tensor<B, D>) -> f32 {
    assert_eq!(a.dims(), b.dims(), "shapes differ");
    tvq_testkit::max_abs_diff(&to_vec(a), &to_vec(b))
}

pub fn max_abs<const D: usize>(a: Tensor<B, D>) -> f32 {
    to_vec(a).iter().fold(0.0f32, |m, x| m.max(x.abs()))
}

/// Asserts `|a - b| <= tol` elementwise, naming `what` on failure.
pub fn assert_close<const D: usize>(a: Tensor<B, D>, b: Tensor<B, D>, tol: f32, what: &str) {
    let diff = max_abs_diff(a, b);
    assert!(diff <= tol, "{what}: max |diff| = {diff:e} > {tol:e}");
}

/// The spec's attention, written as directly as possible: full `T x T`
/// scores, `bias(i - j)` for `0 <= i - j <= L`, causal softmax. Keys in the
/// query's block or the one before score with `k_window` (the quantized
/// keys, or the exact ones); older keys with their codeword `C[code]`. Which key/value receives gradient follows `mode`: the
/// present block always; the previous block unless `none`; older blocks'
/// keys never (they are codewords, which carry no gradient) and their values
/// only under `full`.
///
/// A bias table is `[B or 1, H, T or 1, L + 1]`, indexed by distance; the
/// rotary position rotates the content scores instead. Under a
/// cache limit, the keys before the query's previous block (the `N` the
/// compressed cache holds) each score `ln(limit / N)` less when `N > limit`.
/// Under a code limit, a cached key whose code `n` cached keys share scores
/// `ln(min(n, limit) / n)` less: the `n` together weigh `min(n, limit)`.
/// With a count weight `w` per query, they weigh `min(n, limit)^w`: each
/// scores `w ln min(n, limit) - ln n`.
pub fn oracle_attention(input: AttentionInput<B>, block_len: usize, cx: Compute) -> Tensor<B, 4> {
    let AttentionInput {
        q,
        position,
        k_window,
        codes,
        v,
        codebook,
        count_weight,
    } = input;
    let (bias, rotary) = match position {
        Position::Table(bias) => (Some(bias), None),
        Position::Rotary(rot) => (None, Some(rot)),
    };
    let (mode, cache_limit) = (cx.cache_grad, cx.cache_limit);
    let [b, h, t, _] = q.dims();
    let l = block_len;
    let device = q.device();
    let bool_tensor = |f: &dyn Fn(usize, usize) -> bool| {
        let data: Vec<bool> = (0..t * t).map(|n| f(n / t, n % t)).collect();
        Tensor::<B, 2, Bool>::from_data(TensorData::new(data, [t, t]), &device)
            .reshape([1, 1, t, t])
            .expand([b, h, t, t])
    };
    let block_gap = |i: usize, j: usize| i / l - j / l;
    let key_flows = bool_tensor(&|i, j| {
        j <= i && (block_gap(i, j) == 0 || (block_gap(i, j) == 1 && mode != CacheGrad::None))
    });
    let value_flows = bool_tensor(&|i, j| {
        j <= i
            && match block_gap(i, j) {
                0 => true,
                1 => mode != CacheGrad::None,
                _ => mode == CacheGrad::Full,
            }
    });
    let future = bool_tensor(&|i, j| j > i);

    // Position term: pos[i, j] = sum_d bias[i, d] [i - j = d], d <= L.
    let mut onehot = vec![0f32; t * t * (l + 1)];
    for i in 0..t {
        for j in 0..=i {
            if i - j <= l {
                onehot[(i * t + j) * (l + 1) + (i - j)] = 1.0;
            }
        }
    }
    let onehot =
        Tensor::<B, 3>::from_data(TensorData::new(onehot, [t, t, l + 1]), &device).unsqueeze::<5>(); // [1, 1, T, T, L+1]
    let pos = match bias {
        Some(bias) => (bias.unsqueeze_dim::<5>(3) * onehot)
            .sum_dim(4)
            .squeeze_dim::<4>(4), // [B|1, H, T, T]
        None => Tensor::zeros([1, 1, t, t], &device),
    };
    let limit: Vec<f32> = (0..t * t)
        .map(|n| {
            let (i, j) = (n / t, n % t);
            let cached = if i / l >= 2 { (i / l - 1) * l } else { 0 };
            match cache_limit {
                Some(limit) if j < cached && cached > limit => (limit as f32 / cached as f32).ln(),
                _ => 0.0,
            }
        })
        .collect();
    let pos = pos
        + Tensor::<B, 2>::from_data(TensorData::new(limit, [t, t]), &device).reshape([1, 1, t, t]);
    // The code limit and the count weight, key by key: count the cached
    // keys on each key's code; `weighed` is ln min(n, limit), `own` ln n.
    let code: Vec<i64> = codes.clone().into_data().convert::<i64>().to_vec().unwrap();
    let (mut weighed, mut own) = (vec![0f32; b * h * t * t], vec![0f32; b * h * t * t]);
    for bh in 0..b * h {
        let code = &code[bh * t..(bh + 1) * t];
        for i in 0..t {
            let cached = if i / l >= 2 { (i / l - 1) * l } else { 0 };
            for j in 0..cached {
                let n = code[..cached].iter().filter(|&&c| c == code[j]).count();
                let at = (bh * t + i) * t + j;
                weighed[at] = (n.min(cx.code_limit.unwrap_or(n)) as f32).ln();
                own[at] = (n as f32).ln();
            }
        }
    }
    let keys = |x: Vec<f32>| {
        Tensor::<B, 1>::from_data(TensorData::new(x, [b * h * t * t]), &device)
            .reshape([b, h, t, t])
    };
    let weighed = match count_weight {
        Some(w) => keys(weighed) * w, // w [B, H, T, 1]: one per query (row)
        None => keys(weighed),
    };
    let pos = pos + weighed - keys(own);

    let content = |k: Tensor<B, 4>| match rotary {
        Some(rot) => rotary_scores(rot, q.clone(), k, Compute::default()),
        None => q.clone().matmul(k.swap_dims(2, 3)),
    };
    let scores_flow = content(k_window.clone());
    let scores_const = content(k_window.detach());
    let window = scores_const.mask_where(key_flows, scores_flow);
    // Beyond the window every key is its codeword: C[code], [B, H, T, K].
    let [_, s, dk] = codebook.dims();
    let idx = codes.unsqueeze_dim::<4>(3).expand([b, h, t, dk]);
    let codewords = codebook
        .unsqueeze::<4>()
        .expand([b, h, s, dk])
        .gather(2, idx);
    let beyond = bool_tensor(&|i, j| j <= i && block_gap(i, j) >= 2);
    let scores = window.mask_where(beyond, content(codewords.detach())) + pos;
    let p = burn::tensor::activation::softmax(scores.mask_fill(future, f32::NEG_INFINITY), 3);
    let zeros = p.zeros_like();
    let p_flow = zeros.clone().mask_where(value_flows.clone(), p.clone());
    let p_const = p.mask_where(value_flows, zeros);
    p_flow.matmul(v.clone()) + p_const.matmul(v.detach())
}
