//! Scores of the three groups of keys a query sees (present block,
//! previous block, compressed cache) and the one softmax over them: what
//! the block-parallel and recurrent forms share.

use burn::prelude::*;
use burn::tensor::ops::PadMode;

use super::Position;
use crate::compute::Compute;

/// The present and previous blocks' scores `[B, H, R, n, L]` for queries
/// `q` `[B, H, R, n, K]` at block offsets `rows`, against keys
/// `present` and `previous` `[B, H, R, L, K]`, with the `position` term, and
/// the query the compressed cache sees (`q` itself, or `R(L)^T q` under
/// [`Position::Rotary`]).
pub(super) fn window_scores_and_cache_query<B: Backend>(
    q: Tensor<B, 5>,
    present: Tensor<B, 5>,
    previous: Tensor<B, 5>,
    position: Position<B>,
    rows: std::ops::Range<usize>,
    cx: Compute,
) -> (Tensor<B, 5>, Tensor<B, 5>, Tensor<B, 5>) {
    let rot = match position {
        Position::Table(bias) => {
            let present = window_scores(
                q.clone(),
                present,
                bias.clone(),
                WindowBlock::Present,
                rows.clone(),
                cx,
            );
            let previous =
                window_scores(q.clone(), previous, bias, WindowBlock::Previous, rows, cx);
            return (present, previous, q);
        }
        Position::Rotary(rot) => rot,
    };
    // No bias, but a zero table still carries the present block's causal
    // mask (see [`window_scores`]); the previous block has no mask.
    let [_, h, _, l, _] = present.dims();
    let bias = Tensor::zeros([1, h, 1, l + 1], &q.device());
    let offsets: Vec<f64> = (0..l).map(|j| j as f64).collect();
    let at = |shift: usize| -> Vec<f64> { rows.clone().map(|i| (i + shift) as f64).collect() };
    let q_far = rot.rotate(q.clone(), &vec![l as f64; rows.len()]);
    let present = window_scores(
        rot.rotate(q.clone(), &at(0)),
        rot.rotate(present, &offsets),
        bias,
        WindowBlock::Present,
        rows.clone(),
        cx,
    );
    let near = cx.product_f32(
        rot.rotate(q, &at(l)),
        rot.rotate(previous.clone(), &offsets).swap_dims(3, 4),
    ); // [B, H, R, n, L]
    let far = cx.product_f32(q_far.clone(), previous.swap_dims(3, 4)); // [B, H, R, n, L]
    // Key j of the previous block is at distance L + i - j >= L when j <= i.
    let n = rows.len();
    let beyond: Vec<bool> = rows.flat_map(|i| (0..l).map(move |j| j <= i)).collect();
    let beyond = Tensor::<B, 1, Bool>::from_data(TensorData::new(beyond, [n * l]), &q_far.device())
        .reshape([1, 1, 1, n, l])
        .expand(far.dims());
    (present, near.mask_where(beyond, far), q_far)
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
    let offset = block_offset(block, l);
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

/// How far the keys of `block` are behind the present block's: query `i`
/// and key `j` (block offsets) are `offset + i - j` apart.
fn block_offset(block: WindowBlock, l: usize) -> i64 {
    match block {
        WindowBlock::Previous => l as i64,
        WindowBlock::Present => 0,
    }
}

/// The Toeplitz table's entries for `n` queries against `L` keys:
/// `[BB, H, n, L]`, entry `(i, j)` = `table[first + i - j]` where that is in
/// `0..=L`, and `pad` elsewhere, from `table` `[BB, H, L + 1]`. Built as
/// sliding windows (a row tiled and read back in rows one longer than it,
/// each row then one step further) rather than by selecting `n L`
/// indices: the backward pass of `select` is burn-cubecl's
/// `select_assign`, a single GPU thread looping over all `n L` indices,
/// while these ops' backward passes are elementwise and a reduction.
fn toeplitz_rows<B: Backend>(table: Tensor<B, 3>, first: i64, n: usize, pad: f32) -> Tensor<B, 4> {
    let [bb, h, width] = table.dims();
    let l = width - 1;
    // `ext[k]` = table[e] for e = first - (L - 1) + k, k in 0..W: every
    // distance the pairs span, `pad` outside the table. With `first` at
    // most 2L - 1 and n at least 1, the span always meets the table.
    let w = n + l - 1;
    let lowest = first - (l as i64 - 1);
    let highest = lowest + w as i64 - 1;
    let (from, to) = (lowest.max(0), highest.min(l as i64)); // in the table
    debug_assert!(from <= to, "distances {lowest}..={highest} miss the table");
    let ext = table
        .slice([0..bb, 0..h, from as usize..to as usize + 1])
        .pad(
            [
                (0, 0),
                (0, 0),
                ((from - lowest) as usize, (highest - to) as usize),
            ],
            PadMode::Constant(pad),
        ); // [BB, H, W]
    // ext tiled n + 1 times and read in rows of W + 1 holds ext[i + j'] at
    // row i, column j' (i + j' < W): key j = L - 1 - j', hence the flip.
    // Tiled by expand, not `repeat_dim`, whose backward pass in burn 0.21
    // sums the gradient as if the copies were interleaved.
    ext.unsqueeze_dim::<4>(2)
        .expand([bb, h, n + 1, w])
        .reshape([bb, h, (n + 1) * w])
        .slice([0..bb, 0..h, 0..n * (w + 1)])
        .reshape([bb, h, n, w + 1])
        .slice([0..bb, 0..h, 0..n, 0..l])
        .flip([3])
}

/// Scores of queries `q` `[B, H, R, n, K]` at block offsets `rows` against
/// the keys `k` `[B, H, R, L, K]` of one window block, with the relative bias
/// from the per-distance table `bias` `[B or 1, H, R * n or 1, L + 1]`, and
/// future keys at `-inf`. Returns `[B, H, R, n, L]` in `f32`, the product
/// in the compute type.
fn window_scores<B: Backend>(
    q: Tensor<B, 5>,
    k: Tensor<B, 5>,
    bias: Tensor<B, 4>,
    block: WindowBlock,
    rows: std::ops::Range<usize>,
    cx: Compute,
) -> Tensor<B, 5> {
    let [b, h, r, n, _] = q.dims();
    let l = k.dims()[3];
    let [bb, _, tb, _] = bias.dims();
    // Pairs without a bias get 0, except future keys, which get -inf: the
    // causal mask rides on the bias add instead of costing a pass of its own.
    let fill = match block {
        WindowBlock::Previous => 0.0,
        WindowBlock::Present => f32::NEG_INFINITY,
    };
    let scores = cx.product_f32(q, k.swap_dims(3, 4)); // [B, H, R, n, L]
    if tb == 1 {
        // One table for all queries (Toeplitz), added as rows of n L so the
        // backend sees one shared row when H = 1. A block's pairs without
        // a bias lie on one side of the table (the present block's future
        // keys below distance 0, the previous block's far keys above L),
        // so the table's padding is the fill.
        let first = block_offset(block, l) + rows.start as i64;
        let table =
            toeplitz_rows(bias.reshape([bb, h, l + 1]), first, n, fill).reshape([bb, h, 1, n * l]);
        (scores.reshape([b, h, r, n * l]) + table).reshape([b, h, r, n, l])
    } else {
        // A table per query (XL): gather each query's distances.
        let device = scores.device();
        let (distance, no_bias) = window_distances(block, rows, l);
        let no_bias = Tensor::<B, 1, Bool>::from_data(TensorData::new(no_bias, [n * l]), &device);
        let shape = [bb, h, r, n, l];
        let idx = Tensor::<B, 1, Int>::from_data(TensorData::new(distance, [n * l]), &device)
            .reshape([1, 1, 1, n, l])
            .expand(shape);
        let table = bias
            .reshape([bb, h, r, n, l + 1])
            .gather(4, idx)
            .mask_fill(no_bias.reshape([1, 1, 1, n, l]).expand(shape), fill);
        scores + table
    }
}

/// The cache's count terms, from its counts `[B, H, R, S]` (which carry no
/// gradient): what the composed and the fused attention add to the cache's
/// scores.
pub(super) struct CountTerms<B: Backend> {
    /// What each code weighs as, `[B, H, R, S]`: its count, clamped to the
    /// code limit where there is one (`ln 0 = -inf` marks the empty codes).
    pub weight: Tensor<B, 4>,
    /// The cache limit's score, the same for every code, `[B, H, R, 1]`:
    /// `-ln max(1, N / limit)` of the `N` keys cached (the tensor form of
    /// [`cache_limit_bias`]); `None` without a cache limit.
    pub shift: Option<Tensor<B, 4>>,
}

/// [`CountTerms`] of `counts` `[B, H, R, S]` under `cx`'s limits.
pub(super) fn count_terms<B: Backend>(counts: Tensor<B, 4>, cx: Compute) -> CountTerms<B> {
    // The sum comes before the clamp: burn-cubecl-fusion 0.21 panics on a
    // fused sum whose read block also writes a tensor used later
    // (docs/architecture.md, "Fused kernels: where a kernel plugs in").
    let shift = cx.cache_limit.map(|limit| {
        let cached = counts.clone().sum_dim(3); // N, the same for every head
        -(cached / limit as f64).clamp_min(1.0).log()
    });
    let weight = match cx.code_limit {
        Some(limit) => counts.clamp_max(limit as f64),
        None => counts,
    };
    CountTerms { weight, shift }
}

/// Scores of the compressed cache for each block's queries, from its
/// counts `[B, H, R, S]`: `[B, H, R, n, S]`, `q . C_s + w ln n_s` (`-inf`
/// where `n_s = 0`; `ln min(n_s, code_limit)` under a code limit; `w` each
/// query's `count_weight` `[B, H, R, n, 1]`, 1 when `None`), plus
/// [`cache_limit_bias`] of the `N` keys cached; in `f32`, the product in
/// the compute type.
pub(super) fn cache_scores<B: Backend>(
    q: Tensor<B, 5>,
    codebook: Tensor<B, 3>,
    counts: Tensor<B, 4>,
    count_weight: Option<Tensor<B, 5>>,
    cx: Compute,
) -> Tensor<B, 5> {
    let c_t = codebook
        .swap_dims(1, 2)
        .unsqueeze_dim::<4>(1)
        .unsqueeze_dim::<5>(0); // [1, H, 1, K, S]
    let scores = cx.product_f32(q, c_t); // [B, H, R, n, S]
    let CountTerms { weight, shift } = count_terms(counts.clone(), cx);
    let Some(w) = count_weight else {
        let log_n = match shift {
            Some(shift) => weight.log() + shift,
            None => weight.log(),
        };
        return scores + log_n.unsqueeze_dim::<5>(3); // [B, H, R, 1, S]
    };
    // w ln 0 would be NaN where w underflows to 0: weigh ln max(n, 1), then
    // mask the empty codes.
    let log_n = weight.clamp_min(1.0).log().unsqueeze_dim::<5>(3); // [B, H, R, 1, S]
    let mut scores = scores + w * log_n; // [B, H, R, n, S]
    if let Some(shift) = shift {
        scores = scores + shift.unsqueeze_dim::<5>(3); // [B, H, R, 1, 1]
    }
    let empty = counts.equal_elem(0.0).unsqueeze_dim::<5>(3); // [B, H, R, 1, S]
    let dims = scores.dims();
    scores.mask_fill(empty.expand(dims), f32::NEG_INFINITY)
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
/// sums in `f32`, only the products with the values in the compute type.
///
/// The groups (previous block, present block, compressed cache) are
/// normalised together without concatenating them: a concatenation, and the
/// slices of its gradient, cost more than the softmax itself. The row maximum
/// only keeps `exp` in range and cancels in the quotient, so it carries no
/// gradient. Every query sees at least itself, so the maximum is finite.
///
/// The scores are detached *before* the maximum, not after: a group can be
/// all `-inf` (the empty cache, the first block's previous block), and
/// autodiff records a maximum as argmax-then-gather, whose argmax of an
/// all-`-inf` row is no index at all. cubecl's gather then reads out of
/// bounds: an illegal address on CUDA, a stray value on wgpu.
pub(super) fn attend<B: Backend, const G: usize>(
    groups: [(Tensor<B, 5>, Tensor<B, 5>); G],
    cx: Compute,
) -> Tensor<B, 5> {
    let max = groups
        .iter()
        .map(|(scores, _)| scores.clone().detach().max_dim(4))
        .reduce(|a, b| a.max_pair(b))
        .expect("at least one group"); // [.., n, 1]
    let mut total: Option<(Tensor<B, 5>, Tensor<B, 5>)> = None; // (sum p v, sum p)
    for (scores, values) in groups {
        let p = (scores - max.clone()).exp(); // [.., n, N_g], unnormalised
        let o = cx.product_f32(p.clone(), values); // [.., n, V]
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
    /// Each query's weight of the cache's counts, `[B, H, T, 1]`: 1 in
    /// the paper's cache, learned under [`crate::CountWeight::Learned`].
    pub count_weight: Tensor<B, 4>,
}

/// [`AttentionGroups`] from the three groups' scores as [`attend`] sees
/// them: present and previous block `[B, H, R, L, L]`, cache `[B, H, R, L, S]`
/// (which include `w ln n_s`), with the cache's counts `[B, H, R, S]` and
/// the queries' count weights `[B, H, R, L, 1]` (`None`: 1).
pub(super) fn attention_groups<B: Backend>(
    present: Tensor<B, 5>,
    previous: Tensor<B, 5>,
    cache: Tensor<B, 5>,
    cache_counts: Tensor<B, 4>,
    count_weight: Option<Tensor<B, 5>>,
) -> AttentionGroups<B> {
    let [b, h, r, l, _] = present.dims();
    let count_weight = match count_weight {
        Some(w) => w.detach().reshape([b, h, r * l, 1]),
        None => Tensor::ones([b, h, r * l, 1], &present.device()),
    };
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
        count_weight,
    }
}

#[cfg(test)]
mod tests {
    use burn::backend::Autodiff;
    use burn::backend::flex::{Flex, FlexDevice};

    use super::*;

    /// The sliding-window table against the distances read one by one, for
    /// both window blocks, whole blocks and row ranges (the first rows, the
    /// last, one row): every pair with a bias holds its distance's entry,
    /// the others the padding, and the table's gradient is, for each
    /// distance, the sum of the output's gradient over the pairs at that
    /// distance.
    #[test]
    fn toeplitz_rows_pick_each_pairs_distance() {
        type Ad = Autodiff<Flex>;
        const PAD: f32 = -7.5;
        let device = FlexDevice;
        let normal = burn::tensor::Distribution::Normal(0.0, 1.0);
        for l in [1, 2, 5] {
            let table = Tensor::<Ad, 3>::random([2, 3, l + 1], normal, &device).require_grad();
            let values: Vec<f32> = table.to_data().to_vec().unwrap();
            for block in [WindowBlock::Present, WindowBlock::Previous] {
                for rows in [0..l, 0..1, l - 1..l, (l / 2)..l] {
                    let n = rows.len();
                    let first = block_offset(block, l) + rows.start as i64;
                    let out = toeplitz_rows(table.clone(), first, n, PAD);
                    let probe = Tensor::<Ad, 4>::random([2, 3, n, l], normal, &device);
                    let grads = (out.clone() * probe.clone()).sum().backward();
                    let grad: Vec<f32> = table.grad(&grads).unwrap().into_data().to_vec().unwrap();
                    let got: Vec<f32> = out.into_data().to_vec().unwrap();
                    let probe: Vec<f32> = probe.into_data().to_vec().unwrap();
                    let (distance, no_bias) = window_distances(block, rows.clone(), l);
                    let mut expected_grad = vec![0.0f32; 6 * (l + 1)];
                    for g in 0..6 {
                        for p in 0..n * l {
                            let at = g * (l + 1) + distance[p] as usize;
                            let expected = if no_bias[p] { PAD } else { values[at] };
                            assert_eq!(got[g * n * l + p], expected, "{block:?} {rows:?} L={l}");
                            if !no_bias[p] {
                                expected_grad[at] += probe[g * n * l + p];
                            }
                        }
                    }
                    for (a, b) in grad.iter().zip(&expected_grad) {
                        assert!(
                            (a - b).abs() < 1e-5,
                            "{block:?} {rows:?} L={l}: {grad:?} against {expected_grad:?}"
                        );
                    }
                }
            }
        }
    }
}
