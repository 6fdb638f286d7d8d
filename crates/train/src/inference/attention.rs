//! Where the attention went: for each sublayer, the share of its weight on
//! the present block, the previous block and the compressed cache, the
//! three groups' parts of the attention entropy, and the queries' weight of
//! the cache's counts ([`tvq_model::attention::AttentionGroups`]), read per
//! token and averaged over whichever tokens a report groups (a position
//! bucket, a recall task's answers at one distance, a whole split).

use burn::prelude::*;
use serde::{Deserialize, Serialize};

use crate::placement::B;

/// Where one sublayer's attention went, averaged over its heads and the
/// tokens measured.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AttentionShare {
    /// Share of the attention weight on the present block, the previous
    /// block and the compressed cache.
    pub share: [f64; 3],
    /// Each of the three groups' part of the attention entropy over keys,
    /// nats (the entropy is their sum).
    pub entropy: [f64; 3],
    /// The queries' weight of the compressed cache's counts (1 in the
    /// paper's cache; learned under `model.count_weight = "learned"`).
    #[serde(default = "one")]
    pub count_weight: f64,
}

fn one() -> f64 {
    1.0
}

/// Per-token attention figures: for each sublayer the three shares, the
/// three entropies and the count weight.
pub(crate) const FIGURES: usize = 7;

/// Adds one token's figures (`FIGURES` per sublayer; empty when not
/// measured) to running sums.
pub(crate) fn accumulate(sums: &mut Vec<f64>, figures: &[f32]) {
    sums.resize(figures.len().max(sums.len()), 0.0);
    for (sum, &x) in sums.iter_mut().zip(figures) {
        *sum += x as f64;
    }
}

/// Means of per-token attention figures summed over `tokens` tokens.
pub(crate) fn means(sums: &[f64], tokens: u64) -> Vec<AttentionShare> {
    let n = tokens.max(1) as f64;
    sums.chunks(FIGURES)
        .map(|f| AttentionShare {
            share: [f[0] / n, f[1] / n, f[2] / n],
            entropy: [f[3] / n, f[4] / n, f[5] / n],
            count_weight: f[6] / n,
        })
        .collect()
}

/// The attention figures of a segment's tokens, `[B, T, sublayer, FIGURES]`
/// flattened: each sublayer's shares, entropies and count weight, averaged
/// over heads.
pub(crate) fn per_token(groups: &[tvq_model::attention::AttentionGroups<B>]) -> Vec<f32> {
    let figures: Vec<[Vec<f32>; 3]> = groups
        .iter()
        .map(|g| {
            let host = |t: &Tensor<B, 4>| -> Vec<f32> {
                let [b, _, t_len, w] = t.dims();
                t.clone()
                    .mean_dim(1) // [B, 1, T, W]
                    .reshape([b * t_len * w])
                    .into_data()
                    .convert::<f32>()
                    .to_vec()
                    .expect("f32")
            };
            [host(&g.share), host(&g.entropy), host(&g.count_weight)]
        })
        .collect();
    let tokens = figures.first().map_or(0, |f| f[2].len());
    let mut out = Vec::with_capacity(tokens * figures.len() * FIGURES);
    for i in 0..tokens {
        for [share, entropy, count_weight] in &figures {
            out.extend_from_slice(&share[i * 3..i * 3 + 3]);
            out.extend_from_slice(&entropy[i * 3..i * 3 + 3]);
            out.push(count_weight[i]);
        }
    }
    out
}
