//! The windowed rotary position term.

use burn::prelude::*;

use crate::compute::Compute;

/// Windowed rotary position (ReRoPE-style): the score of query `i` and key
/// `j` is `q_i . R(min(i - j, L)) k_j`, where `R(d)` turns each feature
/// pair `(m, m + K/2)` by `d theta_m` (the rotary embedding, whose scores
/// depend on `i - j` only), clipped at the block length. Every key farther
/// than `L` sees position `L`: its score is `R(L)^T q . k`, one turned
/// query for the whole compressed cache, so attention stays linear.
///
/// The frequencies fit the window rather than a long context: `theta_m`
/// runs geometrically from 1 radian per token down to `pi / L`, so the
/// slowest pair turns half a turn across the window (its cosine falls
/// monotonically over every distance the window can tell apart) and no
/// pair is wasted on angles that barely move within `L` tokens, as most of
/// them are with the usual `10000^(-2m/K)` (measured: docs/learning.md).
///
/// The position channel ([`Self::channel`] features `P`): keys carry `P`
/// constant features beside their codeword's `K`, and queries `P`
/// features of their own (a learned projection), so the channel's part of
/// a score, `q_pos . R(d) 1`, is a sum of cosines of the distance weighted
/// by the query alone: a preference by distance that does not depend on
/// the key's content, which the rotation of content features alone cannot
/// express (XL has one in `(q + w) . W_r r_d`). Beyond the window it is
/// one constant per query, so the cache stays one entry per code.
///
/// In blocks: `R(a) q . R(b) k = q . R(b - a) k`, so for a query at block
/// offset `i` the present block's key at offset `j` scores `R(i) q . R(j) k`,
/// the previous block's `R(i + L) q . R(j) k` while `L + i - j < L` and
/// `R(L) q . k` beyond, as does the cache.
#[derive(Module, Clone, Copy, Debug, PartialEq)]
pub struct Rotary {
    /// The window `L`, the block length: the farthest distance told apart.
    pub window: usize,
    /// Features of the position channel `P` (even; 0 for none), laid out
    /// as the last `P/2` features of each half.
    pub channel: usize,
}

impl Rotary {
    /// How much sharper than `1 / sqrt(K)` the scores of the rotary form
    /// without a position channel are: the queries are multiplied by it.
    /// Queries and keys are RMS-normalised, so a plain `q . k / sqrt(K)`
    /// lies within `+-sqrt(K)`, too narrow a range to put most of the
    /// attention on one of `2L + S` keys; the Toeplitz and XL forms get the
    /// missing range from their bias terms, and the rotary form from its
    /// position channel, whose query features are not normalised. Without
    /// a channel (`rotary_channel = 0`, or a model saved before it existed)
    /// it has none (docs/learning.md measures twice their attention
    /// entropy).
    pub const LOGIT_SCALE: f64 = 2.0;

    /// The windowed rotary position for block length `window`.
    pub fn new(window: usize) -> Self {
        Self { window, channel: 0 }
    }

    /// The same with a position channel of `channel` features.
    pub fn with_channel(self, channel: usize) -> Self {
        Self { channel, ..self }
    }

    /// The frequency of feature pair `m` of `half` pairs, the content pairs
    /// and the channel's each spread over the window ([`Self::frequency`]).
    fn pair_frequency(&self, m: usize, half: usize) -> f64 {
        let channel_pairs = self.channel / 2;
        let content_pairs = half - channel_pairs;
        if m < content_pairs {
            self.frequency(m, content_pairs)
        } else {
            self.frequency(m - content_pairs, channel_pairs)
        }
    }

    /// `theta_m` of feature pair `m` of `half` pairs, in radians per token:
    /// from 1 (`m = 0`) down to `pi / L` (`m = half - 1`), geometrically.
    pub fn frequency(&self, m: usize, half: usize) -> f64 {
        if half < 2 {
            return 1.0;
        }
        let slowest = std::f64::consts::PI / self.window as f64;
        slowest.powf(m as f64 / (half - 1) as f64)
    }

    /// Keys (or codewords) `[.., K]` with the position channel's `P`
    /// constant features, each `scale` (the keys' `K^(-1/4)`), joined in
    /// ([`join_channel`]); the keys themselves without a channel.
    pub fn keys_with_channel<B: Backend, const D: usize>(
        &self,
        k: Tensor<B, D>,
        scale: f64,
    ) -> Tensor<B, D> {
        if self.channel == 0 {
            return k;
        }
        let mut dims = k.dims();
        dims[D - 1] = self.channel;
        let ones = Tensor::<B, D>::ones(dims, &k.device()) * scale;
        join_channel(k, ones)
    }

    /// `x` `[.., n, K]` (K even) with row `r` turned by `positions[r]`
    /// positions: `x cos + rot_half(x) sin`, `rot_half(x) = [-x2, x1]` for
    /// the halves `x1`, `x2` of the features.
    pub fn rotate<B: Backend, const D: usize>(
        &self,
        x: Tensor<B, D>,
        positions: &[f64],
    ) -> Tensor<B, D> {
        let dims = x.dims();
        let (n, k) = (dims[D - 2], dims[D - 1]);
        assert_eq!(positions.len(), n, "one position per row");
        let half = k / 2;
        let (mut cos, mut sin) = (vec![0f32; n * k], vec![0f32; n * k]);
        for (r, p) in positions.iter().enumerate() {
            for m in 0..half {
                let angle = p * self.pair_frequency(m, half);
                for col in [m, half + m] {
                    cos[r * k + col] = angle.cos() as f32;
                    sin[r * k + col] = angle.sin() as f32;
                }
            }
        }
        let mut shape = [1; D];
        (shape[D - 2], shape[D - 1]) = (n, k);
        let device = x.device();
        let table = |v: Vec<f32>| {
            Tensor::<B, 2>::from_data(TensorData::new(v, [n, k]), &device).reshape(shape)
        };
        let x1 = x.clone().narrow(D - 1, 0, half);
        let x2 = x.clone().narrow(D - 1, half, half);
        let rot_half = Tensor::cat(vec![x2.neg(), x1], D - 1);
        x * table(cos) + rot_half * table(sin)
    }
}

/// `x` `[.., K]` and the position channel `c` `[.., P]` as one vector
/// `[x1, c1, x2, c2]` (halves of each), so that the rotary embedding's
/// feature pairs `(m, m + (K + P)/2)` pair content with content and
/// channel with channel.
pub fn join_channel<B: Backend, const D: usize>(x: Tensor<B, D>, c: Tensor<B, D>) -> Tensor<B, D> {
    let (k, p) = (x.dims()[D - 1], c.dims()[D - 1]);
    let half = |t: &Tensor<B, D>, n: usize, first: bool| {
        t.clone()
            .narrow(D - 1, if first { 0 } else { n / 2 }, n / 2)
    };
    Tensor::cat(
        vec![
            half(&x, k, true),
            half(&c, p, true),
            half(&x, k, false),
            half(&c, p, false),
        ],
        D - 1,
    )
}

/// `q_i . R(min(i - j, L)) k_j` for every pair, `[B, H, T, T]` (future
/// pairs included; the caller masks them): `R(i) q . R(j) k` within the
/// window, `R(L) q . k` beyond it. In `f32`, the products in the compute type.
pub fn rotary_scores<B: Backend>(
    rot: Rotary,
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    cx: Compute,
) -> Tensor<B, 4> {
    let [b, h, t, _] = q.dims();
    let block_len = rot.window;
    let positions: Vec<f64> = (0..t).map(|i| i as f64).collect();
    let near = cx.product_f32(
        rot.rotate(q.clone(), &positions),
        rot.rotate(k.clone(), &positions).swap_dims(2, 3),
    );
    let far = cx.product_f32(rot.rotate(q, &vec![block_len as f64; t]), k.swap_dims(2, 3));
    let beyond: Vec<bool> = (0..t * t).map(|n| n / t >= n % t + block_len).collect();
    let beyond = Tensor::<B, 1, Bool>::from_data(TensorData::new(beyond, [t * t]), &near.device())
        .reshape([1, 1, t, t])
        .expand([b, h, t, t]);
    near.mask_where(beyond, far)
}
