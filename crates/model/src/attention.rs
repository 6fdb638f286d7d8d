//! VQ attention in its two production forms, plus the quadratic baseline.
//!
//! For a query at stream position `i` and key at `j <= i` the score is
//! `q_i . k_hat_j + bias(i - j)` where the bias exists only for `i - j <= L`
//! (or, with the windowed rotary position, `q_i . R(min(i - j, L)) k_hat_j`:
//! [`Rotary`]).
//! Keys farther than one block carry no bias and every `k_hat` is a codeword,
//! so those keys can be grouped by code: a code `s` seen `n_s` times with mean
//! value `mu_s` contributes `exp(q . C_s + ln n_s)` with value `mu_s`, exactly
//! what the individual keys would have contributed. Each query therefore sees
//! three groups of keys:
//!
//! 1. the present block (causal), with bias;
//! 2. the previous block (all `L` keys; bias where the distance is `<= L`);
//! 3. the compressed cache of every older block: one entry per code.
//!
//! [`block_attention`] computes all blocks of a segment at once;
//! [`step_attention`] computes one token from the carried [`AttentionState`].
//! Both give the quadratic definition's result to float rounding.
//!
//! Shapes: `B` batch, `H` heads, `T` segment length, `R = T / L` blocks,
//! `L` block length, `K` key width, `V` value width, `S` codes.

use burn::prelude::*;
use burn::tensor::FloatDType;
use burn::tensor::activation::softmax;

use crate::config::CacheGrad;
use crate::device::to_device_via_host;
use crate::error::ModelError;
use crate::precision::{Precision, product_in, to_f32};
use crate::quantizer::code_totals;

/// Keys, values and codes of one block as they were when it was the present block.
#[derive(Clone, Debug)]
pub struct CachedBlock<B: Backend> {
    /// Quantized keys, `[B, H, L, K]`.
    pub k_hat: Tensor<B, 4>,
    /// Values (after silu), `[B, H, L, V]`.
    pub v: Tensor<B, 4>,
    /// Codes; the sentinel `S` marks an empty slot. `[B, H, L]`.
    pub codes: Tensor<B, 3, Int>,
}

/// Every key older than the previous block, grouped by code.
#[derive(Clone, Debug)]
pub struct CompressedCache<B: Backend> {
    /// How many keys had each code, `[B, H, S]`.
    pub counts: Tensor<B, 3>,
    /// Mean value of those keys (0 where the count is 0), `[B, H, S, V]`.
    /// Kept as a mean, not a sum, so it stays bounded on long streams.
    pub means: Tensor<B, 4>,
}

/// What one GAU sublayer carries from one segment (or token) to the next.
/// A fresh stream starts from [`AttentionState::default`]: nothing to attend.
#[derive(Clone, Debug)]
pub struct AttentionState<B: Backend> {
    /// Tokens of the stream seen so far.
    pub pos: usize,
    /// The last complete block, once there is one.
    pub prev: Option<CachedBlock<B>>,
    /// All complete blocks before `prev`, grouped by code.
    pub cache: Option<CompressedCache<B>>,
    /// The block being filled by the recurrent form: slots `0..pos % L` hold
    /// tokens. `None` at a block boundary.
    pub current: Option<CachedBlock<B>>,
}

impl<B: Backend> Default for AttentionState<B> {
    fn default() -> Self {
        Self {
            pos: 0,
            prev: None,
            cache: None,
            current: None,
        }
    }
}

impl<B: Backend> CachedBlock<B> {
    fn detach(self) -> Self {
        Self {
            k_hat: self.k_hat.detach(),
            v: self.v.detach(),
            codes: self.codes,
        }
    }

    fn into_device(self, device: &B::Device) -> Self {
        Self {
            k_hat: to_device_via_host(self.k_hat, device),
            v: to_device_via_host(self.v, device),
            codes: to_device_via_host(self.codes, device),
        }
    }

    fn repeat_rows(self, n: usize) -> Self {
        Self {
            k_hat: self.k_hat.repeat_dim(0, n),
            v: self.v.repeat_dim(0, n),
            codes: self.codes.repeat_dim(0, n),
        }
    }
}

impl<B: Backend> AttentionState<B> {
    /// The state of the batch tiled `n` times along the rows (with one row:
    /// `n` copies of it).
    pub fn repeat_rows(self, n: usize) -> Self {
        Self {
            pos: self.pos,
            prev: self.prev.map(|b| b.repeat_rows(n)),
            cache: self.cache.map(|c| CompressedCache {
                counts: c.counts.repeat_dim(0, n),
                means: c.means.repeat_dim(0, n),
            }),
            current: self.current.map(|b| b.repeat_rows(n)),
        }
    }

    /// The same state with every tensor cut from the autodiff graph.
    pub fn detach(self) -> Self {
        Self {
            pos: self.pos,
            prev: self.prev.map(CachedBlock::detach),
            cache: self.cache.map(CompressedCache::detach),
            current: self.current.map(CachedBlock::detach),
        }
    }

    /// The same state on `device` (a worker's device in training on
    /// several devices), copied through the host where it moves.
    pub fn into_device(self, device: &B::Device) -> Self {
        Self {
            pos: self.pos,
            prev: self.prev.map(|b| b.into_device(device)),
            cache: self.cache.map(|c| CompressedCache {
                counts: to_device_via_host(c.counts, device),
                means: to_device_via_host(c.means, device),
            }),
            current: self.current.map(|b| b.into_device(device)),
        }
    }
}

impl<B: Backend> CompressedCache<B> {
    fn detach(self) -> Self {
        Self {
            counts: self.counts.detach(),
            means: self.means.detach(),
        }
    }

    /// The cache of a stream with nothing older than its previous block.
    fn empty(b: usize, h: usize, s: usize, v: usize, device: &B::Device) -> Self {
        Self {
            counts: Tensor::zeros([b, h, s], device),
            means: Tensor::zeros([b, h, s, v], device),
        }
    }

    /// The cache after adding, for each of `R` alternatives, `add_counts`
    /// `[B, H, R, S]` more keys per code whose values sum to `add_sums`
    /// `[B, H, R, S, V]`. Returns counts `[B, H, R, S]` and means
    /// `[B, H, R, S, V]`. Kept as a running mean,
    /// `mu = mu_c n_c / n + sums / n`, so nothing grows with the stream.
    /// The block form merges every block's cache at once; the recurrent
    /// form merges one block (`R = 1`).
    fn merge(
        &self,
        add_counts: Tensor<B, 4>,
        add_sums: Tensor<B, 5>,
    ) -> (Tensor<B, 4>, Tensor<B, 5>) {
        let n_c = self.counts.clone().unsqueeze_dim::<4>(2); // [B, H, 1, S]
        let total = n_c.clone() + add_counts; // [B, H, R, S]
        let denom = total.clone().clamp_min(1.0);
        let means = self.means.clone().unsqueeze_dim::<5>(2)
            * (n_c / denom.clone()).unsqueeze_dim::<5>(4)
            + add_sums / denom.unsqueeze_dim::<5>(4); // [B, H, R, S, V]
        (total, means)
    }

    /// The cache with one more block of keys folded in: `add_counts`
    /// `[B, H, S]`, `add_sums` `[B, H, S, V]`.
    fn absorb(&self, add_counts: Tensor<B, 3>, add_sums: Tensor<B, 4>) -> Self {
        let [b, h, s, v] = add_sums.dims();
        let (counts, means) = self.merge(add_counts.unsqueeze_dim(2), add_sums.unsqueeze_dim(2));
        Self {
            counts: counts.reshape([b, h, s]),
            means: means.reshape([b, h, s, v]),
        }
    }
}

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
#[derive(Clone, Copy, Debug, PartialEq)]
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

/// The present and previous blocks' scores `[B, H, R, n, L]` for queries
/// `q` `[B, H, R, n, K]` at block offsets `rows`, against keys
/// `present` and `previous` `[B, H, R, L, K]`, and the query the compressed
/// cache sees (`q` itself, or `R(L)^T q` under [`Rotary`]).
fn window_scores_and_cache_query<B: Backend>(
    q: Tensor<B, 5>,
    present: Tensor<B, 5>,
    previous: Tensor<B, 5>,
    bias: Tensor<B, 4>,
    rows: std::ops::Range<usize>,
    rotary: Option<Rotary>,
    dt: FloatDType,
) -> (Tensor<B, 5>, Tensor<B, 5>, Tensor<B, 5>) {
    let Some(rot) = rotary else {
        let present = window_scores(
            q.clone(),
            present,
            bias.clone(),
            WindowBlock::Present,
            rows.clone(),
            dt,
        );
        let previous = window_scores(q.clone(), previous, bias, WindowBlock::Previous, rows, dt);
        return (present, previous, q);
    };
    let l = present.dims()[3];
    let offsets: Vec<f64> = (0..l).map(|j| j as f64).collect();
    let at = |shift: usize| -> Vec<f64> { rows.clone().map(|i| (i + shift) as f64).collect() };
    let q_far = rot.rotate(q.clone(), &vec![l as f64; rows.len()]);
    let present = window_scores(
        rot.rotate(q.clone(), &at(0)),
        rot.rotate(present, &offsets),
        bias.clone(),
        WindowBlock::Present,
        rows.clone(),
        dt,
    );
    let near = window_scores(
        rot.rotate(q, &at(l)),
        rot.rotate(previous.clone(), &offsets),
        bias.clone(),
        WindowBlock::Previous,
        rows.clone(),
        dt,
    );
    let far = window_scores(
        q_far.clone(),
        previous,
        bias,
        WindowBlock::Previous,
        rows.clone(),
        dt,
    );
    // Key j of the previous block is at distance L + i - j >= L when j <= i.
    let n = rows.len();
    let beyond: Vec<bool> = rows.flat_map(|i| (0..l).map(move |j| j <= i)).collect();
    let beyond = Tensor::<B, 1, Bool>::from_data(TensorData::new(beyond, [n * l]), &q_far.device())
        .reshape([1, 1, 1, n, l])
        .expand(far.dims());
    (present, near.mask_where(beyond, far), q_far)
}

/// Inputs of one sublayer's attention, already projected, normalised and quantized.
#[derive(Clone, Debug)]
pub struct AttentionInput<B: Backend> {
    /// Query for the content scores (`q + u` under the XL bias), `[B, H, T, K]`.
    pub q: Tensor<B, 4>,
    /// Bias by distance `d = 0..=L` for each query, `[B or 1, H, T or 1, L + 1]`.
    pub bias: Tensor<B, 4>,
    /// Quantized keys (straight-through), `[B, H, T, K]`.
    pub k_hat: Tensor<B, 4>,
    /// Codes of the keys, `[B, H, T]`.
    pub codes: Tensor<B, 3, Int>,
    /// Values, `[B, H, T, V]`.
    pub v: Tensor<B, 4>,
    /// Codebook, no gradient, `[H, S, K]`.
    pub codebook: Tensor<B, 3>,
    /// The windowed rotary position, when it is the position term (then
    /// `bias` is all zero).
    pub rotary: Option<Rotary>,
    /// Most keys the compressed cache weighs ([`cache_limit_bias`];
    /// `None`: all of them, the paper's cache).
    pub cache_limit: Option<usize>,
    /// Type of the products (scores and weighted values); the softmax and
    /// the compressed cache stay `f32` ([`crate::precision`]). `v` may come
    /// in it already.
    pub precision: Precision,
}

/// One of the two blocks a query attends key by key. For a query at offset
/// `i` of its block, key `j` of the previous block is at distance `L + i - j`
/// and key `j` of the present block at `i - j` (a future key when negative).
#[derive(Clone, Copy, Debug)]
enum WindowBlock {
    Previous,
    Present,
}

/// For queries at block offsets `rows` against the `L` keys of `block`:
/// the distances clamped to `0..=L`, and which pairs get no bias (distance
/// outside `0..=L`; in the present block exactly the future keys).
/// Row-major over `(i, j)`.
fn window_distances(
    block: WindowBlock,
    rows: std::ops::Range<usize>,
    l: usize,
) -> (Vec<i64>, Vec<bool>) {
    let offset = match block {
        WindowBlock::Previous => l as i64,
        WindowBlock::Present => 0,
    };
    let n = rows.len() * l;
    let (mut distance, mut no_bias) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for i in rows {
        for j in 0..l {
            let d = offset + i as i64 - j as i64;
            distance.push(d.clamp(0, l as i64));
            no_bias.push(!(0..=l as i64).contains(&d));
        }
    }
    (distance, no_bias)
}

/// Scores of queries `q` `[B, H, R, n, K]` at block offsets `rows` against
/// the keys `k` `[B, H, R, L, K]` of one window block, with the relative bias
/// from the per-distance table `bias` `[B or 1, H, R * n or 1, L + 1]`, and
/// future keys at `-inf`. Returns `[B, H, R, n, L]` in `f32`, the product
/// in `dt`.
fn window_scores<B: Backend>(
    q: Tensor<B, 5>,
    k: Tensor<B, 5>,
    bias: Tensor<B, 4>,
    block: WindowBlock,
    rows: std::ops::Range<usize>,
    dt: FloatDType,
) -> Tensor<B, 5> {
    let [b, h, r, n, _] = q.dims();
    let l = k.dims()[3];
    let [bb, _, tb, _] = bias.dims();
    let device = q.device();
    let (distance, no_bias) = window_distances(block, rows, l);
    let idx = Tensor::<B, 1, Int>::from_data(TensorData::new(distance, [n * l]), &device);
    let no_bias = Tensor::<B, 1, Bool>::from_data(TensorData::new(no_bias, [n * l]), &device);
    // Pairs without a bias get 0, except future keys, which get -inf: the
    // causal mask rides on the bias add instead of costing a pass of its own.
    let fill = match block {
        WindowBlock::Previous => 0.0,
        WindowBlock::Present => f32::NEG_INFINITY,
    };
    let scores = to_f32(product_in(q, k.swap_dims(3, 4), dt)); // [B, H, R, n, L]
    if tb == 1 {
        // One table for all queries (Toeplitz): pick by distance. Added as
        // rows of n L so the backend sees one shared row when H = 1.
        let table = bias
            .reshape([bb, h, l + 1])
            .select(2, idx)
            .mask_fill(no_bias.reshape([1, 1, n * l]).expand([bb, h, n * l]), fill)
            .reshape([bb, h, 1, n * l]);
        (scores.reshape([b, h, r, n * l]) + table).reshape([b, h, r, n, l])
    } else {
        // A table per query (XL): gather each query's distances.
        let shape = [bb, h, r, n, l];
        let idx = idx.reshape([1, 1, 1, n, l]).expand(shape);
        let table = bias
            .reshape([bb, h, r, n, l + 1])
            .gather(4, idx)
            .mask_fill(no_bias.reshape([1, 1, 1, n, l]).expand(shape), fill);
        scores + table
    }
}

/// Scores of the compressed cache for each block's queries, from its
/// counts `[B, H, R, S]`: `[B, H, R, n, S]`, `q . C_s + ln n_s` (`-inf`
/// where `n_s = 0`), plus [`cache_limit_bias`] of the `N` keys cached; in
/// `f32`, the product in `dt`.
fn cache_scores<B: Backend>(
    q: Tensor<B, 5>,
    codebook: Tensor<B, 3>,
    counts: Tensor<B, 4>,
    limit: Option<usize>,
    dt: FloatDType,
) -> Tensor<B, 5> {
    let c_t = codebook
        .swap_dims(1, 2)
        .unsqueeze_dim::<4>(1)
        .unsqueeze_dim::<5>(0); // [1, H, 1, K, S]
    let scores = to_f32(product_in(q, c_t, dt)); // [B, H, R, n, S]
    // ln 0 = -inf masks the empty codes; counts carry no gradient.
    let mut log_n = counts.clone().log(); // [B, H, R, S]
    if let Some(limit) = limit {
        let cached = counts.sum_dim(3); // [B, H, R, 1]: N, the same for every head
        log_n = log_n - (cached / limit as f64).clamp_min(1.0).log();
    }
    scores + log_n.unsqueeze_dim::<5>(3) // [B, H, R, 1, S]
}

/// The score added to every key of the compressed cache when it holds
/// `cached` keys: `-ln(max(1, cached / limit))`. Past `limit` keys the
/// cache's keys together weigh what `limit` of them would, so the cache's
/// share of the attention stops growing with the stream: models whose
/// window terms were set for the cache sizes of their training sequences
/// otherwise lose the window to the cache in far longer streams
/// (docs/learning.md). `None`: every key weighs in full, the paper's cache.
pub fn cache_limit_bias(cached: usize, limit: Option<usize>) -> f64 {
    match limit {
        Some(limit) if cached > limit => -(cached as f64 / limit as f64).ln(),
        _ => 0.0,
    }
}

/// One softmax over several groups of keys, then the weighted values: each
/// group is scores `[.., n, N_g]` (`f32`) with values `[.., N_g, V]`.
/// Returns `[.., n, V]` in `f32`: the maximum, the exponentials and their
/// sums in `f32`, only the products with the values in `dt`.
///
/// The groups (previous block, present block, compressed cache) are
/// normalised together without concatenating them: a concatenation, and the
/// slices of its gradient, cost more than the softmax itself. The row maximum
/// only keeps `exp` in range and cancels in the quotient, so it carries no
/// gradient. Every query sees at least itself, so the maximum is finite.
fn attend<B: Backend, const G: usize>(
    groups: [(Tensor<B, 5>, Tensor<B, 5>); G],
    dt: FloatDType,
) -> Tensor<B, 5> {
    let max = groups
        .iter()
        .map(|(scores, _)| scores.clone().max_dim(4))
        .reduce(|a, b| a.max_pair(b))
        .expect("at least one group")
        .detach(); // [.., n, 1]
    let mut total: Option<(Tensor<B, 5>, Tensor<B, 5>)> = None; // (sum p v, sum p)
    for (scores, values) in groups {
        let p = (scores - max.clone()).exp(); // [.., n, N_g], unnormalised
        let o = to_f32(product_in(p.clone(), values, dt)); // [.., n, V]
        let z = p.sum_dim(4); // [.., n, 1]
        total = Some(match total {
            Some((acc_o, acc_z)) => (acc_o + o, acc_z + z),
            None => (o, z),
        });
    }
    let (o, z) = total.expect("at least one group");
    o / z
}

/// Where each query's attention goes, by group of keys: present block,
/// previous block, compressed cache (in that order along the last axis).
/// A diagnostic (`tvq eval --attention`), computed only when asked for.
#[derive(Clone, Debug)]
pub struct AttentionGroups<B: Backend> {
    /// Share of the attention weight on each group, `[B, H, T, 3]`; the
    /// three sum to 1 for every query.
    pub share: Tensor<B, 4>,
    /// Each group's part of the attention entropy over keys, nats,
    /// `[B, H, T, 3]`: `-sum a_j ln a_j` over the group's keys, a cached code
    /// standing for its `n_s` keys, each with an equal part of the code's
    /// weight (as in the quadratic form on quantized keys). The entropy of a
    /// query's attention is the sum over the groups.
    pub entropy: Tensor<B, 4>,
}

/// [`AttentionGroups`] from the three groups' scores as [`attend`] sees
/// them: present and previous block `[B, H, R, L, L]`, cache `[B, H, R, L, S]`
/// (which include `ln n_s`), with the cache's counts `[B, H, R, S]`.
fn attention_groups<B: Backend>(
    present: Tensor<B, 5>,
    previous: Tensor<B, 5>,
    cache: Tensor<B, 5>,
    cache_counts: Tensor<B, 4>,
) -> AttentionGroups<B> {
    let [b, h, r, l, _] = present.dims();
    // A key's own log weight (up to the normaliser): its score, less ln n_s
    // for a code that stands for n_s keys. Masked keys (score -inf) get a
    // finite stand-in so that 0 * it stays 0.
    let log_n = cache_counts.clamp_min(1.0).log().unsqueeze_dim::<5>(3); // [B, H, R, 1, S]
    let groups = [
        (present.detach(), None),
        (previous.detach(), None),
        (cache.detach(), Some(log_n)),
    ];
    let max = groups
        .iter()
        .map(|(scores, _)| scores.clone().max_dim(4))
        .reduce(|a, b| a.max_pair(b))
        .expect("three groups"); // [B, H, R, L, 1]
    let (mut mass, mut weighted) = (vec![], vec![]);
    for (scores, log_n) in groups {
        let shifted = scores - max.clone(); // [.., L, N_g]
        let p = shifted.clone().exp();
        let own = match log_n {
            Some(log_n) => shifted - log_n,
            None => shifted,
        }
        .clamp_min(-1e4);
        mass.push(p.clone().sum_dim(4)); // [.., L, 1]
        weighted.push((p * own).sum_dim(4)); // [.., L, 1]
    }
    let mass = Tensor::cat(mass, 4); // [B, H, R, L, 3]
    let z = mass.clone().sum_dim(4); // [B, H, R, L, 1]
    let share = mass / z.clone();
    // a_j = p_j / Z, so -sum a_j ln a_j = share ln Z - (sum p_j own_j) / Z.
    let entropy = share.clone() * z.clone().log() - Tensor::cat(weighted, 4) / z;
    AttentionGroups {
        share: share.reshape([b, h, r * l, 3]),
        entropy: entropy.reshape([b, h, r * l, 3]),
    }
}

/// Empty-slot placeholders for a missing previous block.
fn empty_block<B: Backend>(
    b: usize,
    h: usize,
    l: usize,
    k: usize,
    v: usize,
    s: usize,
    device: &B::Device,
) -> CachedBlock<B> {
    CachedBlock {
        k_hat: Tensor::zeros([b, h, l, k], device),
        v: Tensor::zeros([b, h, l, v], device),
        codes: Tensor::<B, 3, Int>::full([b, h, l], s as i64, device),
    }
}

/// Keys, values and codes of a segment cut into its `R` blocks.
struct Blocks<B: Backend> {
    /// `[B, H, R, L, K]`.
    k_hat: Tensor<B, 5>,
    /// `[B, H, R, L, V]`.
    v: Tensor<B, 5>,
    /// `[B, H, R, L]`.
    codes: Tensor<B, 4, Int>,
}

fn expect_dims(what: &str, got: &[usize], want: &[usize]) -> Result<(), ModelError> {
    if got == want {
        Ok(())
    } else {
        Err(ModelError::StateMismatch(format!(
            "{what} is {got:?}, expected {want:?}"
        )))
    }
}

/// Step 2: the previous block of every block: the carried one for block 0,
/// block `r - 1` for block `r`. Under `CacheGrad::None` the window's
/// previous blocks carry no gradient.
fn previous_blocks<B: Backend>(
    carried: CachedBlock<B>,
    blocks: &Blocks<B>,
    cache_grad: CacheGrad,
) -> Blocks<B> {
    let [b, h, r, l, _] = blocks.k_hat.dims();
    let no_grad = cache_grad == CacheGrad::None;
    let shift = |carried: Tensor<B, 4>, x: Tensor<B, 5>| -> Tensor<B, 5> {
        let x = if no_grad { x.detach() } else { x };
        // The carried block is f32; the segment's values may be narrower.
        let head = carried.cast(x.dtype()).unsqueeze_dim::<5>(2); // [B, H, 1, L, W]
        if r == 1 {
            return head;
        }
        let width = x.dims()[4];
        Tensor::cat(
            vec![head, x.slice([0..b, 0..h, 0..r - 1, 0..l, 0..width])],
            2,
        )
    };
    let head = carried.codes.unsqueeze_dim::<4>(2); // [B, H, 1, L]
    let codes = if r == 1 {
        head
    } else {
        let earlier = blocks.codes.clone().slice([0..b, 0..h, 0..r - 1, 0..l]);
        Tensor::cat(vec![head, earlier], 2)
    };
    Blocks {
        k_hat: shift(carried.k_hat, blocks.k_hat.clone()),
        v: shift(carried.v, blocks.v.clone()),
        codes,
    }
}

/// Step 4: the compressed cache each block's queries see. Block `r`'s cache
/// holds the carried cache plus the previous blocks of blocks `0..r-1`,
/// i.e. everything up to block `r - 2`: an exclusive cumulative sum of
/// per-block code totals. Returns the per-block counts `[B, H, R, S]` and
/// means `[B, H, R, S, V]`, and the carried cache with every block's
/// previous block folded in (the state after the segment, detached).
fn block_caches<B: Backend>(
    carried: CompressedCache<B>,
    prev: &Blocks<B>,
    s: usize,
    cache_grad: CacheGrad,
) -> (Tensor<B, 4>, Tensor<B, 5>, CompressedCache<B>) {
    let [b, h, r, l, dv] = prev.v.dims();
    // Counts and means in f32 whatever the compute type: they sum many keys.
    let values = match cache_grad {
        CacheGrad::Full => to_f32(prev.v.clone()),
        CacheGrad::None | CacheGrad::Window => to_f32(prev.v.clone().detach()),
    };
    let (counts, sums) = code_totals(
        prev.codes.clone().reshape([b * h * r, l]),
        None,
        values.reshape([b * h * r, l, dv]),
        s,
    );
    let counts = counts.reshape([b, h, r, s]); // [B, H, R, S]
    let sums = sums.reshape([b, h, r, s, dv]); // [B, H, R, S, V]
    let counts_before = counts.clone().cumsum(2) - counts.clone();
    let sums_before = sums.clone().cumsum(2) - sums.clone();
    let (cache_counts, cache_means) = carried.merge(counts_before, sums_before);
    let after = carried.absorb(
        counts.detach().sum_dim(2).reshape([b, h, s]),
        sums.detach().sum_dim(2).reshape([b, h, s, dv]),
    );
    (cache_counts, cache_means, after)
}

/// What a segment starts from: the carried previous block (empty slots
/// when there is none yet) and compressed cache, checked against the
/// segment's sizes.
struct Carried<B: Backend> {
    has_prev: bool,
    prev: CachedBlock<B>,
    cache: CompressedCache<B>,
}

impl<B: Backend> Carried<B> {
    /// `dims` = `[B, H, L, K, V, S]`.
    fn unpack(
        state: AttentionState<B>,
        dims: [usize; 6],
        device: &B::Device,
    ) -> Result<Self, ModelError> {
        let [b, h, l, dk, dv, s] = dims;
        if !state.pos.is_multiple_of(l) || state.current.is_some() {
            return Err(ModelError::StateNotBlockAligned {
                pos: state.pos,
                block_len: l,
            });
        }
        let has_prev = state.prev.is_some();
        let prev = state
            .prev
            .unwrap_or_else(|| empty_block(b, h, l, dk, dv, s, device));
        expect_dims("previous-block k_hat", &prev.k_hat.dims(), &[b, h, l, dk])?;
        expect_dims("previous-block v", &prev.v.dims(), &[b, h, l, dv])?;
        let cache = state
            .cache
            .unwrap_or_else(|| CompressedCache::empty(b, h, s, dv, device));
        expect_dims("cache counts", &cache.counts.dims(), &[b, h, s])?;
        expect_dims("cache means", &cache.means.dims(), &[b, h, s, dv])?;
        Ok(Self {
            has_prev,
            prev,
            cache,
        })
    }
}

/// Block 0 of a fresh stream has no previous block: its previous-block
/// scores `[B, H, R, L, L]` become `-inf`.
fn mask_first_previous<B: Backend>(scores: Tensor<B, 5>) -> Tensor<B, 5> {
    let [b, h, r, l, _] = scores.dims();
    let first: Vec<bool> = (0..r).map(|blk| blk == 0).collect();
    let first = Tensor::<B, 1, Bool>::from_data(TensorData::new(first, [r]), &scores.device())
        .reshape([1, 1, r, 1, 1])
        .expand([b, h, r, l, l]);
    scores.mask_fill(first, f32::NEG_INFINITY)
}

/// Step 6: the state after a segment: its last block becomes the previous
/// block; `cache` already holds every block's previous block. Detached.
fn state_after<B: Backend>(
    pos: usize,
    blocks: Blocks<B>,
    cache: CompressedCache<B>,
) -> AttentionState<B> {
    let [b, h, r, l, dk] = blocks.k_hat.dims();
    let dv = blocks.v.dims()[4];
    // States are f32 whatever the compute type, so that they resume in any.
    let last = |x: Tensor<B, 5>, width: usize| {
        to_f32(x.slice([0..b, 0..h, r - 1..r, 0..l, 0..width]))
            .reshape([b, h, l, width])
            .detach()
    };
    AttentionState {
        pos,
        prev: Some(CachedBlock {
            k_hat: last(blocks.k_hat, dk),
            v: last(blocks.v, dv),
            codes: blocks
                .codes
                .slice([0..b, 0..h, r - 1..r, 0..l])
                .reshape([b, h, l]),
        }),
        cache: Some(cache.detach()),
        current: None,
    }
}

/// Block-parallel VQ attention over one segment of `T = R L` tokens that
/// starts at a block boundary, in the steps of docs/architecture.md.
/// Returns the output `[B, H, T, V]` and the detached state after the
/// segment. No loop over blocks: every block's scores come from batched
/// matmuls, and every block's compressed cache from a cumulative sum.
pub fn block_attention<B: Backend>(
    input: AttentionInput<B>,
    state: AttentionState<B>,
    block_len: usize,
    cache_grad: CacheGrad,
) -> Result<(Tensor<B, 4>, AttentionState<B>), ModelError> {
    let out = block_attention_impl(input, state, block_len, cache_grad, false)?;
    Ok((out.out, out.state))
}

/// What [`block_attention_with_groups`] returns.
#[derive(Debug)]
pub struct BlockAttention<B: Backend> {
    /// The output, `[B, H, T, V]`.
    pub out: Tensor<B, 4>,
    /// The detached state after the segment.
    pub state: AttentionState<B>,
    /// Where the attention went (present when asked for).
    pub groups: Option<AttentionGroups<B>>,
}

/// [`block_attention`], also returning where the attention went
/// ([`AttentionGroups`]), at the cost of a second pass over the scores.
pub fn block_attention_with_groups<B: Backend>(
    input: AttentionInput<B>,
    state: AttentionState<B>,
    block_len: usize,
    cache_grad: CacheGrad,
) -> Result<BlockAttention<B>, ModelError> {
    block_attention_impl(input, state, block_len, cache_grad, true)
}

fn block_attention_impl<B: Backend>(
    input: AttentionInput<B>,
    state: AttentionState<B>,
    block_len: usize,
    cache_grad: CacheGrad,
    with_groups: bool,
) -> Result<BlockAttention<B>, ModelError> {
    let AttentionInput {
        q,
        bias,
        k_hat,
        codes,
        v,
        codebook,
        rotary,
        cache_limit,
        precision,
    } = input;
    let dt = precision.dtype();
    let [b, h, t, dk] = q.dims();
    let (dv, s, l) = (v.dims()[3], codebook.dims()[1], block_len);
    if t == 0 || !t.is_multiple_of(l) {
        return Err(ModelError::SegmentNotBlockAligned {
            len: t,
            block_len: l,
        });
    }
    let (r, pos) = (t / l, state.pos);
    let carried = Carried::unpack(state, [b, h, l, dk, dv, s], &q.device())?;

    // 1: blocks.
    let q = q.reshape([b, h, r, l, dk]);
    let blocks = Blocks {
        k_hat: k_hat.reshape([b, h, r, l, dk]),
        v: v.reshape([b, h, r, l, dv]),
        codes: codes.reshape([b, h, r, l]),
    };
    // 2: previous blocks.
    let prev = previous_blocks(carried.prev, &blocks, cache_grad);
    // 3: window scores, present block (causal) and previous block, [B, H, R, L, L].
    let (present_scores, mut prev_scores, q) = window_scores_and_cache_query(
        q,
        blocks.k_hat.clone(),
        prev.k_hat.clone(),
        bias,
        0..l,
        rotary,
        dt,
    );
    if !carried.has_prev {
        prev_scores = mask_first_previous(prev_scores);
    }
    // 4: compressed cache by cumulative sum, [B, H, R, S] and [B, H, R, S, V].
    let (cache_counts, cache_means, cache_after) =
        block_caches(carried.cache, &prev, s, cache_grad);
    let cache_scores = cache_scores(q, codebook, cache_counts.clone(), cache_limit, dt); // [B, H, R, L, S]
    let groups = with_groups.then(|| {
        attention_groups(
            present_scores.clone(),
            prev_scores.clone(),
            cache_scores.clone(),
            cache_counts,
        )
    });
    // 5: one softmax over the three groups.
    let out = attend(
        [
            (present_scores, blocks.v.clone()),
            (prev_scores, prev.v),
            (cache_scores, cache_means),
        ],
        dt,
    );
    // 6: state out.
    let out = out.reshape([b, h, t, dv]);
    Ok(BlockAttention {
        out,
        state: state_after(pos + t, blocks, cache_after),
        groups,
    })
}

/// Folds a block that leaves the window into the compressed cache.
fn fold_into_cache<B: Backend>(
    cache: CompressedCache<B>,
    block: &CachedBlock<B>,
    s: usize,
) -> CompressedCache<B> {
    let [b, h, l, dv] = block.v.dims();
    let (add_n, add_sum) = code_totals(
        block.codes.clone().reshape([b * h, l]),
        None,
        block.v.clone().reshape([b * h, l, dv]),
        s,
    );
    cache.absorb(add_n.reshape([b, h, s]), add_sum.reshape([b, h, s, dv]))
}

/// Recurrent VQ attention for one token (`T = 1` in every input), O(L + S)
/// work whatever the position. Returns the output `[B, H, 1, V]` and the
/// state including this token.
pub fn step_attention<B: Backend>(
    input: AttentionInput<B>,
    state: AttentionState<B>,
    block_len: usize,
) -> Result<(Tensor<B, 4>, AttentionState<B>), ModelError> {
    let AttentionInput {
        q,
        bias,
        k_hat,
        codes,
        v,
        codebook,
        rotary,
        cache_limit,
        precision,
    } = input;
    let dt = precision.dtype();
    let [b, h, t, dk] = q.dims();
    let dv = v.dims()[3];
    let s = codebook.dims()[1];
    let l = block_len;
    if t != 1 {
        return Err(ModelError::StateMismatch(format!(
            "the recurrent form takes one token, got {t}"
        )));
    }
    let device = q.device();
    let i = state.pos % l;

    // Write this token into slot i of the current block.
    let current = state
        .current
        .unwrap_or_else(|| empty_block(b, h, l, dk, dv, s, &device));
    let current = CachedBlock {
        k_hat: current
            .k_hat
            .slice_assign([0..b, 0..h, i..i + 1, 0..dk], k_hat),
        v: current.v.slice_assign([0..b, 0..h, i..i + 1, 0..dv], v),
        codes: current.codes.slice_assign([0..b, 0..h, i..i + 1], codes),
    };
    let has_prev = state.prev.is_some();
    let prev = state
        .prev
        .unwrap_or_else(|| empty_block(b, h, l, dk, dv, s, &device));

    let q = q.unsqueeze_dim::<5>(2); // [B, H, 1, 1, K]
    let block = |x: &Tensor<B, 4>| x.clone().unsqueeze_dim::<5>(2); // [B, H, 1, L, width]
    let (present_scores, mut prev_scores, q) = window_scores_and_cache_query(
        q,
        block(&current.k_hat),
        block(&prev.k_hat),
        bias,
        i..i + 1,
        rotary,
        dt,
    ); // [B, H, 1, 1, L] each
    if !has_prev {
        prev_scores = prev_scores.full_like(f32::NEG_INFINITY);
    }

    let cache = state
        .cache
        .unwrap_or_else(|| CompressedCache::empty(b, h, s, dv, &device));
    let counts = cache.counts.clone().unsqueeze_dim(2); // [B, H, 1, S]
    let c_scores = cache_scores(q, codebook, counts, cache_limit, dt); // [B, H, 1, 1, S]
    let out = attend(
        [
            (present_scores, block(&current.v)),
            (prev_scores, block(&prev.v)),
            (c_scores, cache.means.clone().unsqueeze_dim(2)),
        ],
        dt,
    )
    .reshape([b, h, 1, dv]);

    // At the end of a block the previous block leaves the window.
    let new_state = if i + 1 == l {
        AttentionState {
            pos: state.pos + 1,
            prev: Some(current),
            cache: Some(if has_prev {
                fold_into_cache(cache, &prev, s)
            } else {
                cache
            }),
            current: None,
        }
    } else {
        AttentionState {
            pos: state.pos + 1,
            prev: has_prev.then_some(prev),
            cache: Some(cache),
            current: Some(current),
        }
    };
    Ok((out, new_state))
}

/// `q_i . R(min(i - j, L)) k_j` for every pair, `[B, H, T, T]` (future
/// pairs included; the caller masks them): `R(i) q . R(j) k` within the
/// window, `R(L) q . k` beyond it. In `f32`, the products in `dt`.
pub fn rotary_scores<B: Backend>(
    rot: Rotary,
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    dt: FloatDType,
) -> Tensor<B, 4> {
    let [b, h, t, _] = q.dims();
    let block_len = rot.window;
    let positions: Vec<f64> = (0..t).map(|i| i as f64).collect();
    let near = to_f32(product_in(
        rot.rotate(q.clone(), &positions),
        rot.rotate(k.clone(), &positions).swap_dims(2, 3),
        dt,
    ));
    let far = to_f32(product_in(
        rot.rotate(q, &vec![block_len as f64; t]),
        k.swap_dims(2, 3),
        dt,
    ));
    let beyond: Vec<bool> = (0..t * t).map(|n| n / t >= n % t + block_len).collect();
    let beyond = Tensor::<B, 1, Bool>::from_data(TensorData::new(beyond, [t * t]), &near.device())
        .reshape([1, 1, t, t])
        .expand([b, h, t, t]);
    near.mask_where(beyond, far)
}

/// Dense causal softmax attention over unquantized keys with the same
/// relative bias (or windowed rotary position) and cache limit (on the keys
/// before the previous block, those the VQ form caches): the quadratic
/// baseline (`[B, H, T, T]` scores). The products in `dt`, the softmax and
/// the output in `f32`.
#[allow(clippy::too_many_arguments)]
pub fn quadratic_attention<B: Backend>(
    q: Tensor<B, 4>,
    bias: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    block_len: usize,
    rotary: Option<Rotary>,
    cache_limit: Option<usize>,
    dt: FloatDType,
) -> Tensor<B, 4> {
    let [b, h, t, _] = q.dims();
    let l = block_len;
    let device = q.device();
    let mut distance = Vec::with_capacity(t * t);
    let mut no_bias = Vec::with_capacity(t * t);
    let mut limit_bias = Vec::with_capacity(t * t);
    for i in 0..t {
        let cached = (i / l).saturating_sub(1) * l; // keys before the previous block
        let far = cache_limit_bias(cached, cache_limit) as f32;
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
        Some(rot) => rotary_scores(rot, q, k, dt),
        None => to_f32(product_in(q, k.swap_dims(2, 3), dt)),
    };
    let scores = (content + pos + limit_bias).mask_fill(future, f32::NEG_INFINITY);
    to_f32(product_in(softmax(scores, 3), v, dt))
}
