//! The quadratic baseline: dense causal attention over unquantized keys.

use burn::prelude::*;
use burn::tensor::activation::softmax;

use super::Position;
use super::rotary::rotary_scores;
use super::scores::cache_limit_bias;
use crate::compute::Compute;

/// Dense causal softmax attention over unquantized keys with the same
/// position term and cache limit (on the keys before the previous block,
/// those the VQ form caches): the quadratic baseline (`[B, H, T, T]`
/// scores). The products in the compute type, the softmax and the output
/// in `f32`.
pub fn quadratic_attention<B: Backend>(
    q: Tensor<B, 4>,
    position: Position<B>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    block_len: usize,
    cx: Compute,
) -> Tensor<B, 4> {
    let [b, h, t, _] = q.dims();
    let l = block_len;
    let device = q.device();
    let mut limit_bias = Vec::with_capacity(t * t);
    for i in 0..t {
        let cached = (i / l).saturating_sub(1) * l; // keys before the previous block
        let far = cache_limit_bias(cached, cx.cache_limit) as f32;
        limit_bias.extend((0..t).map(|j| if j < cached { far } else { 0.0 }));
    }
    let limit_bias = Tensor::<B, 1>::from_data(TensorData::new(limit_bias, [t * t]), &device)
        .reshape([1, 1, t, t]);
    let future = Tensor::<B, 2, Bool>::tril_mask([t, t], 0, &device)
        .reshape([1, 1, t, t])
        .expand([b, h, t, t]);
    let scores = match position {
        Position::Table(bias) => {
            cx.product_f32(q, k.swap_dims(2, 3)) + table_by_distance(bias, b, t, l)
        }
        Position::Rotary(rot) => rotary_scores(rot, q, k, cx),
    };
    let scores = (scores + limit_bias).mask_fill(future, f32::NEG_INFINITY);
    cx.product_f32(softmax(scores, 3), v)
}

/// The bias table `[B or 1, H, T or 1, L + 1]` laid out by query and key,
/// `[B or 1, H, T, T]`: the bias of their distance where it is `0..=L`, 0
/// elsewhere.
fn table_by_distance<B: Backend>(bias: Tensor<B, 4>, b: usize, t: usize, l: usize) -> Tensor<B, 4> {
    let [bb, h, tb, _] = bias.dims();
    let device = bias.device();
    let (mut distance, mut no_bias) = (Vec::with_capacity(t * t), Vec::with_capacity(t * t));
    for i in 0..t {
        for j in 0..t {
            let d = i as i64 - j as i64;
            distance.push(d.clamp(0, l as i64));
            no_bias.push(!(0..=l as i64).contains(&d));
        }
    }
    let idx = Tensor::<B, 1, Int>::from_data(TensorData::new(distance, [t * t]), &device);
    let no_bias = Tensor::<B, 1, Bool>::from_data(TensorData::new(no_bias, [t * t]), &device)
        .reshape([1, 1, t, t]);
    let pos = if tb == 1 {
        bias.reshape([bb, h, l + 1])
            .select(2, idx)
            .reshape([bb, h, t, t])
    } else {
        bias.gather(3, idx.reshape([1, 1, t, t]).expand([b, h, t, t]))
    };
    pos.mask_fill(no_bias.expand([bb.max(1), h, t, t]), 0.0)
}
