//! The recurrent form: one token at a time from the carried state.

use burn::prelude::*;

use super::AttentionInput;
use super::scores::{attend, cache_scores, window_scores_and_cache_query};
use super::state::{AttentionState, CachedBlock, CompressedCache, empty_block};
use crate::compute::Compute;
use crate::error::ModelError;
use crate::quantizer::code_totals;

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
        false, // once per block of generated tokens
    );
    cache.absorb(add_n.reshape([b, h, s]), add_sum.reshape([b, h, s, dv]))
}

/// Recurrent VQ attention for one token (`T = 1` in every input), O(L + S)
/// work whatever the position. Returns the output `[B, H, 1, V]` and the
/// state including this token.
pub fn recurrent_attention<B: Backend>(
    input: AttentionInput<B>,
    state: AttentionState<B>,
    block_len: usize,
    cx: Compute,
) -> Result<(Tensor<B, 4>, AttentionState<B>), ModelError> {
    let AttentionInput {
        q,
        position,
        k_window,
        codes,
        v,
        codebook,
        count_weight,
    } = input;
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

    let current = state
        .current
        .unwrap_or_else(|| empty_block(b, h, l, dk, dv, s, &device))
        .with_slot(i, k_window, v, codes);
    let has_prev = state.prev.is_some();
    let prev = state
        .prev
        .unwrap_or_else(|| empty_block(b, h, l, dk, dv, s, &device));

    let q = q.unsqueeze_dim::<5>(2); // [B, H, 1, 1, K]
    let block = |x: &Tensor<B, 4>| x.clone().unsqueeze_dim::<5>(2); // [B, H, 1, L, width]
    let (present_scores, mut prev_scores, q) = window_scores_and_cache_query(
        q,
        block(&current.k_window),
        block(&prev.k_window),
        position,
        i..i + 1,
        cx,
    ); // [B, H, 1, 1, L] each
    if !has_prev {
        prev_scores = prev_scores.full_like(f32::NEG_INFINITY);
    }

    let cache = state
        .cache
        .unwrap_or_else(|| CompressedCache::empty(b, h, s, dv, &device));
    let counts = cache.counts.clone().unsqueeze_dim(2); // [B, H, 1, S]
    let count_weight = count_weight.map(|w| w.unsqueeze_dim::<5>(2)); // [B, H, 1, 1, 1]
    let c_scores = cache_scores(q, codebook, counts, count_weight, cx); // [B, H, 1, 1, S]
    let out = attend(
        [
            (present_scores, block(&current.v)),
            (prev_scores, block(&prev.v)),
            (c_scores, cache.means.clone().unsqueeze_dim(2)),
        ],
        cx,
    )
    .reshape([b, h, 1, dv]);

    let prev = has_prev.then_some(prev);
    Ok((
        out,
        state_after_token(state.pos + 1, l, current, prev, cache),
    ))
}

/// The state after the token at stream position `pos - 1`, now in
/// `current`: at the end of a block the previous block leaves the window
/// for the compressed cache, and the current one takes its place.
fn state_after_token<B: Backend>(
    pos: usize,
    l: usize,
    current: CachedBlock<B>,
    prev: Option<CachedBlock<B>>,
    cache: CompressedCache<B>,
) -> AttentionState<B> {
    if !pos.is_multiple_of(l) {
        return AttentionState {
            pos,
            prev,
            cache: Some(cache),
            current: Some(current),
        };
    }
    let s = cache.counts.dims()[2];
    AttentionState {
        pos,
        prev: Some(current),
        cache: Some(match prev {
            Some(prev) => fold_into_cache(cache, &prev, s),
            None => cache,
        }),
        current: None,
    }
}
