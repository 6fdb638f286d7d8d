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
//! three groups of keys (a learned count weight `w` per query makes that
//! `exp(q . C_s + w ln n_s)`: the code's keys weigh as `n_s^w` of them):
//!
//! 1. the present block (causal), with bias;
//! 2. the previous block (all `L` keys; bias where the distance is `<= L`);
//! 3. the compressed cache of every older block: one entry per code.
//!
//! [`block_attention`] computes all blocks of a segment at once;
//! [`recurrent_attention`] computes one token from the carried [`AttentionState`].
//! Both give the quadratic definition's result to float rounding.
//!
//! The window's keys are the quantized `k_hat` in the paper. With
//! [`WindowKeys::Exact`] the window scores the keys themselves instead:
//! only the compressed cache needs codewords, so the window may keep what
//! quantization loses at the same cost (docs/learning.md, "Recall").
//!
//! Shapes: `B` batch, `H` heads, `T` segment length, `R = T / L` blocks,
//! `L` block length, `K` key width, `V` value width, `S` codes.
//!
//! The forms live apart: [`block`] (the block-parallel form), [`recurrent`]
//! (one token from the state), [`quadratic`] (the baseline), over what they
//! share: the carried [`state`], the [`scores`] of the three groups of keys
//! and their softmax, and the [`rotary`] position term. How they compute
//! (the products' type, the cache limit, the cache gradient) travels as one
//! [`Compute`].

pub mod block;
pub mod quadratic;
pub mod recurrent;
pub mod rotary;
pub mod scores;
pub mod state;

use burn::prelude::*;

pub use crate::compute::Compute;
pub use crate::config::WindowKeys;
pub use block::{BlockAttention, block_attention, block_attention_with_groups};
pub use quadratic::quadratic_attention;
pub use recurrent::recurrent_attention;
pub use rotary::{Rotary, rotary_scores};
pub use scores::{AttentionGroups, cache_limit_bias};
pub use state::{AttentionState, CachedBlock, CompressedCache};

/// The position term's part of the window's scores, as the attention
/// forms take it (what [`crate::position::PositionTerm::apply`] gives).
#[derive(Clone, Debug)]
pub enum Position<B: Backend> {
    /// An additive bias by distance `d = 0..=L` for each query, `[B or 1,
    /// H, T or 1, L + 1]` (the Toeplitz and XL terms).
    Table(Tensor<B, 4>),
    /// The windowed rotary position: queries and keys rotated by their
    /// distance, nothing added.
    Rotary(Rotary),
}

/// Inputs of one sublayer's attention, already projected, normalised and quantized.
#[derive(Clone, Debug)]
pub struct AttentionInput<B: Backend> {
    /// Query for the content scores (`q + u` under the XL bias), `[B, H, T, K]`.
    pub q: Tensor<B, 4>,
    /// The position term in the window.
    pub position: Position<B>,
    /// The keys the two-block window scores against, `[B, H, T, K]`: the
    /// quantized keys `k_hat` (straight-through), as in the paper, or the
    /// keys themselves under [`WindowKeys::Exact`]. Keys older than the
    /// window are always their codewords (`codes` into `codebook`).
    pub k_window: Tensor<B, 4>,
    /// Codes of the keys, `[B, H, T]`.
    pub codes: Tensor<B, 3, Int>,
    /// Values, `[B, H, T, V]` (in `f32` or already in the compute type).
    pub v: Tensor<B, 4>,
    /// Codebook, no gradient, `[H, S, K]`.
    pub codebook: Tensor<B, 3>,
    /// Each query's weight `w` of the compressed cache's counts, `q . C_s +
    /// w ln n_s`, `[B, H, T, 1]` ([`crate::CountWeight::Learned`]); `None`:
    /// 1, the paper's cache.
    pub count_weight: Option<Tensor<B, 4>>,
}
