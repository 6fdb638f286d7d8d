//! The quadratic baseline: dense causal attention over unquantized keys.

use burn::prelude::*;
use burn::tensor::activation::softmax;

use super::rotary::{Rotary, rotary_scores};
use super::scores::cache_limit_bias;
use crate::compute::Compute;

/// Dense causal softmax attention over unquantized keys with the same
/// relative bias (or windowed rotary position) and cache limit (on the keys
/// before the previous block, those the VQ form caches): the quadratic
/// baseline (`[B, H, T, T]` scores). The products in the compute type, the softmax and
/// the output in `f32`.
pub fn quadratic_attention<B: Backend>(
    q: Tensor<B, 4>,
    bias: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    block_len: usize,
    rotary: Option<Rotary>,
    cx: Compute,
) -> Tensor<B, 4> {
    let [b, h, t, _] = q.dims();
    let l = block_len;
    let device = q.device();
    let mut distance = Vec::with_capacity(t * t);
    let mut no_bias = Vec::with_capacity(t * t);
    let mut limit_bias = Vec::with_capacity(t * t);
    for i in 0..t {
        let cached = (i / l).saturating_sub(1) * l; // keys before the previous block
        let far = cache_limit_bias(cached, cx.cache_limit) as f32;
        for j in 0..t {
            let d = i as i64 - j as i64;
            distance.push(d.clamp(0, l as i64));
            no_bias.push(!(0..=l as i64).contains(&d));
            limit_bias.push(if j < cached { far } else { 0.0 });
        }
    }
    let limit_bias = Tensor::<B, 1>::from_data(TensorData::new(limit_bias, [t * t]), &device)
        .reshape([1, 1, t, t]);
    let idx = Tensor::<B, 1, Int>::from_data(TensorData::new(distance, [t * t]), &device);
    let no_bias = Tensor::<B, 1, Bool>::from_data(TensorData::new(no_bias, [t * t]), &device)
        .reshape([1, 1, t, t]);
    let [bb, _, tb, _] = bias.dims();
    let pos = if tb == 1 {
        bias.reshape([bb, h, l + 1])
            .select(2, idx)
            .reshape([bb, h, t, t])
    } else {
        bias.gather(3, idx.reshape([1, 1, t, t]).expand([b, h, t, t]))
    };
    let pos = pos.mask_fill(no_bias.expand([bb.max(1), h, t, t]), 0.0);
    let future = Tensor::<B, 2, Bool>::tril_mask([t, t], 0, &device)
        .reshape([1, 1, t, t])
        .expand([b, h, t, t]);
    let content = match rotary {
        Some(rot) => rotary_scores(rot, q, k, cx),
        None => cx.product_f32(q, k.swap_dims(2, 3)),
    };
    let scores = (content + pos + limit_bias).mask_fill(future, f32::NEG_INFINITY);
    cx.product_f32(softmax(scores, 3), v)
}
