//! The block-parallel form: every block of a segment at once.

use std::cell::OnceCell;

use burn::prelude::*;
use burn::tensor::TensorPrimitive;

use super::scores::{
    CountTerms, attend, attention_groups, cache_scores, count_terms, window_scores_and_cache_query,
};
use super::state::{AttentionState, CachedBlock, CompressedCache, empty_block};
use super::{AttentionGroups, AttentionInput, Position};
use crate::compute::Compute;
use crate::config::CacheGrad;
use crate::error::ModelError;
use crate::kernel::{self, AttentionFlags, AttentionKernelInput, Kernels, VqBackend};
use crate::precision::to_f32;
use crate::quantizer::code_totals;

/// Keys, values and codes of a segment cut into its `R` blocks.
struct Blocks<B: Backend> {
    /// `[B, H, R, L, K]`.
    k_window: Tensor<B, 5>,
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
    let [b, h, r, l, _] = blocks.k_window.dims();
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
        k_window: shift(carried.k_window, blocks.k_window.clone()),
        v: shift(carried.v, blocks.v.clone()),
        codes,
    }
}

/// The previous block of every block ([`previous_blocks`]), laid out only
/// where composed ops ask for it: the fused kernels read it in place.
struct Previous<'a, B: Backend> {
    carried: &'a Carried<B>,
    blocks: &'a Blocks<B>,
    cache_grad: CacheGrad,
    laid_out: OnceCell<Blocks<B>>,
}

impl<B: Backend> Previous<'_, B> {
    fn blocks(&self) -> &Blocks<B> {
        self.laid_out.get_or_init(|| {
            previous_blocks(self.carried.prev_or_empty(), self.blocks, self.cache_grad)
        })
    }
}

/// Step 4: the compressed cache each block's queries see. Block `r`'s cache
/// holds the carried cache plus the previous blocks of blocks `0..r-1`,
/// i.e. everything up to block `r - 2`: an exclusive cumulative sum of
/// per-block code totals (or the backend's fused kernel, a running total,
/// under [`Kernels::Fused`] where no gradient flows into the cache).
/// Returns the per-block counts `[B, H, R, S]` and means `[B, H, R, S, V]`,
/// and the carried cache with every block's previous block folded in (the
/// state after the segment, detached).
fn block_caches<B: VqBackend>(
    prev: &Previous<'_, B>,
    s: usize,
    cx: Compute,
) -> (Tensor<B, 4>, Tensor<B, 5>, CompressedCache<B>) {
    let [b, h, r, l, dv] = prev.blocks.v.dims();
    let carried = prev.carried;
    // The fused kernel passes no gradient on: values that carry one compose.
    let fused = (cx.kernels == Kernels::Fused && cx.cache_grad != CacheGrad::Full)
        .then(|| {
            // A fresh stream's kernel reads nothing carried: placeholders.
            let fresh = carried.prev.is_none() && carried.cache.is_none();
            let (block, cache) = if fresh {
                (carried.unread_block(), carried.unread_cache())
            } else {
                (carried.prev_or_empty(), carried.cache_or_empty())
            };
            // Counts and means in f32 whatever the compute type.
            let values = |v: Tensor<B, 3>| to_f32(v.detach()).into_primitive().tensor();
            B::vq_block_caches(
                block.codes.reshape([b * h, l]).into_primitive(),
                values(block.v.reshape([b * h, l, dv])),
                prev.blocks
                    .codes
                    .clone()
                    .reshape([b * h, r * l])
                    .into_primitive(),
                values(prev.blocks.v.clone().reshape([b * h, r * l, dv])),
                cache.counts.reshape([b * h, s]).into_primitive().tensor(),
                cache
                    .means
                    .reshape([b * h, s, dv])
                    .into_primitive()
                    .tensor(),
                fresh,
            )
        })
        .flatten();
    if let Some(c) = fused {
        let float = |x| TensorPrimitive::Float(x);
        let after = CompressedCache {
            counts: Tensor::<B, 2>::from_primitive(float(c.counts_after)).reshape([b, h, s]),
            means: Tensor::<B, 3>::from_primitive(float(c.means_after)).reshape([b, h, s, dv]),
        };
        return (
            Tensor::<B, 3>::from_primitive(float(c.counts)).reshape([b, h, r, s]),
            Tensor::<B, 4>::from_primitive(float(c.means)).reshape([b, h, r, s, dv]),
            after,
        );
    }
    let prev = prev.blocks();
    // Counts and means in f32 whatever the compute type: they sum many keys.
    let values = match cx.cache_grad {
        CacheGrad::Full => to_f32(prev.v.clone()),
        CacheGrad::None | CacheGrad::Window => to_f32(prev.v.clone().detach()),
    };
    let by_group = B::vq_totals_by_group(&values.device());
    let (counts, sums) = code_totals(
        prev.codes.clone().reshape([b * h * r, l]),
        None,
        values.reshape([b * h * r, l, dv]),
        s,
        by_group,
    );
    let counts = counts.reshape([b, h, r, s]); // [B, H, R, S]
    let sums = sums.reshape([b, h, r, s, dv]); // [B, H, R, S, V]
    let counts_before = counts.clone().cumsum(2) - counts.clone();
    let sums_before = sums.clone().cumsum(2) - sums.clone();
    let carried = carried.cache_or_empty();
    let (cache_counts, cache_means) = carried.merge(counts_before, sums_before);
    let after = carried.absorb(
        counts.detach().sum_dim(2).reshape([b, h, s]),
        sums.detach().sum_dim(2).reshape([b, h, s, dv]),
    );
    (cache_counts, cache_means, after)
}

/// What a segment starts from: the carried previous block and compressed
/// cache (`None` in a fresh stream), checked against the segment's sizes.
struct Carried<B: Backend> {
    prev: Option<CachedBlock<B>>,
    cache: Option<CompressedCache<B>>,
    /// `[B, H, L, K, V, S]`.
    dims: [usize; 6],
    device: B::Device,
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
        if let Some(prev) = &state.prev {
            expect_dims(
                "previous-block k_window",
                &prev.k_window.dims(),
                &[b, h, l, dk],
            )?;
            expect_dims("previous-block v", &prev.v.dims(), &[b, h, l, dv])?;
        }
        if let Some(cache) = &state.cache {
            expect_dims("cache counts", &cache.counts.dims(), &[b, h, s])?;
            expect_dims("cache means", &cache.means.dims(), &[b, h, s, dv])?;
        }
        Ok(Self {
            prev: state.prev,
            cache: state.cache,
            dims,
            device: device.clone(),
        })
    }

    /// The previous block, or empty slots (zeros, code `S`) where there is
    /// none yet: what the composed ops read.
    fn prev_or_empty(&self) -> CachedBlock<B> {
        let [b, h, l, dk, dv, s] = self.dims;
        self.prev
            .clone()
            .unwrap_or_else(|| empty_block(b, h, l, dk, dv, s, &self.device))
    }

    /// The compressed cache, or an empty one (zeros) where there is none yet.
    fn cache_or_empty(&self) -> CompressedCache<B> {
        let [b, h, _, _, dv, s] = self.dims;
        self.cache
            .clone()
            .unwrap_or_else(|| CompressedCache::empty(b, h, s, dv, &self.device))
    }

    /// A previous block of uninitialised tensors, no fill launched: for the
    /// fused kernels of a fresh stream, which do not read it.
    fn unread_block(&self) -> CachedBlock<B> {
        let [b, h, l, dk, dv, _] = self.dims;
        CachedBlock {
            k_window: Tensor::empty([b, h, l, dk], &self.device),
            v: Tensor::empty([b, h, l, dv], &self.device),
            codes: Tensor::empty([b, h, l], &self.device),
        }
    }

    /// A compressed cache of uninitialised tensors, as [`Self::unread_block`].
    fn unread_cache(&self) -> CompressedCache<B> {
        let [b, h, _, _, dv, s] = self.dims;
        CompressedCache {
            counts: Tensor::empty([b, h, s], &self.device),
            means: Tensor::empty([b, h, s, dv], &self.device),
        }
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

/// What steps 3 and 5 read, for [`fused_attention`].
struct FusedInputs<'a, B: Backend> {
    /// `[B, H, R, L, K]`.
    q: Tensor<B, 5>,
    blocks: &'a Blocks<B>,
    /// What the segment starts from (its previous block read for block 0).
    carried: &'a Carried<B>,
    /// `[B or 1, H, T or 1, L + 1]`.
    bias: Tensor<B, 4>,
    /// `[H, S, K]`.
    codebook: Tensor<B, 3>,
    /// `[B, H, R, S]`.
    cache_counts: Tensor<B, 4>,
    /// `[B, H, R, S, V]`.
    cache_means: Tensor<B, 5>,
    /// `[B, H, R, L, 1]`.
    count_weight: Option<Tensor<B, 5>>,
    cx: Compute,
}

/// Steps 3 and 5 as the backend's fused kernel ([`VqBackend::vq_attention`]),
/// the cache's terms of [`cache_scores`] laid out for it: the output
/// `[B, H, R, L, V]`, or `None` where the backend has no kernel.
fn fused_attention<B: VqBackend>(x: FusedInputs<'_, B>) -> Option<Tensor<B, 5>> {
    let [b, h, r, l, dk] = x.q.dims();
    let (dv, s) = (x.blocks.v.dims()[4], x.codebook.dims()[1]);
    let g = b * h * r;
    let device = x.q.device();
    // The kernel computes in f32 whatever the products' type: reduced
    // operands are widened here (a cast, differentiable, linear in T).
    let rows =
        |t: Tensor<B, 5>, width: usize| to_f32(t).reshape([g, l, width]).into_primitive().tensor();
    let CountTerms { weight, shift } = count_terms(x.cache_counts, x.cx);
    let flags = AttentionFlags {
        mask_first: x.carried.prev.is_none(),
        prev_grad: x.cx.cache_grad != CacheGrad::None,
        means_grad: x.cx.cache_grad == CacheGrad::Full,
        shifted: shift.is_some(),
        weighted: x.count_weight.is_some(),
    };
    // The kernel reads `shift` and `count_weight` only where they are
    // given: an empty tensor stands for each elsewhere (no fill launched).
    let shift = shift.unwrap_or_else(|| Tensor::empty([b, h, r, 1], &device));
    let count_weight = match x.count_weight {
        Some(w) => to_f32(w).reshape([g, l]),
        None => Tensor::empty([g, l], &device),
    };
    // A fresh stream's block 0 has no previous block: masked, not read.
    let carried_block = match &x.carried.prev {
        Some(block) => block.clone(),
        None => x.carried.unread_block(),
    };
    let carried =
        |t: Tensor<B, 4>, width: usize| t.reshape([b * h, l, width]).into_primitive().tensor();
    let out = B::vq_attention(AttentionKernelInput {
        q: rows(x.q, dk),
        k: rows(x.blocks.k_window.clone(), dk),
        v: rows(x.blocks.v.clone(), dv),
        k_carried: carried(carried_block.k_window, dk),
        v_carried: carried(carried_block.v, dv),
        bias: to_f32(x.bias)
            .expand([b, h, r * l, l + 1])
            .into_primitive()
            .tensor(),
        codebook: x.codebook.into_primitive().tensor(),
        log_counts: weight.log().reshape([g, s]).into_primitive().tensor(),
        shift: shift.reshape([g]).into_primitive().tensor(),
        count_weight: count_weight.into_primitive().tensor(),
        means: x.cache_means.reshape([g, s, dv]).into_primitive().tensor(),
        flags,
    })?;
    let out = Tensor::<B, 3>::from_primitive(TensorPrimitive::Float(out));
    Some(out.reshape([b, h, r, l, dv]))
}

/// Step 6: the state after a segment: its last block becomes the previous
/// block; `cache` already holds every block's previous block. Detached.
fn state_after<B: Backend>(
    pos: usize,
    blocks: Blocks<B>,
    cache: CompressedCache<B>,
) -> AttentionState<B> {
    let [b, h, r, l, dk] = blocks.k_window.dims();
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
            k_window: last(blocks.k_window, dk),
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
pub fn block_attention<B: VqBackend>(
    input: AttentionInput<B>,
    state: AttentionState<B>,
    block_len: usize,
    cx: Compute,
) -> Result<(Tensor<B, 4>, AttentionState<B>), ModelError> {
    let out = block_attention_impl(input, state, block_len, cx, false)?;
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
pub fn block_attention_with_groups<B: VqBackend>(
    input: AttentionInput<B>,
    state: AttentionState<B>,
    block_len: usize,
    cx: Compute,
) -> Result<BlockAttention<B>, ModelError> {
    block_attention_impl(input, state, block_len, cx, true)
}

fn block_attention_impl<B: VqBackend>(
    input: AttentionInput<B>,
    state: AttentionState<B>,
    block_len: usize,
    cx: Compute,
    with_groups: bool,
) -> Result<BlockAttention<B>, ModelError> {
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
        k_window: k_window.reshape([b, h, r, l, dk]),
        v: v.reshape([b, h, r, l, dv]),
        codes: codes.reshape([b, h, r, l]),
    };
    // 2: previous blocks (laid out where composed ops read them).
    let prev = Previous {
        carried: &carried,
        blocks: &blocks,
        cache_grad: cx.cache_grad,
        laid_out: OnceCell::new(),
    };
    // 4: compressed cache by cumulative sum, [B, H, R, S] and [B, H, R, S, V].
    let (cache_counts, cache_means, cache_after) = block_caches(&prev, s, cx);
    let count_weight = count_weight.map(|w| w.reshape([b, h, r, l, 1]));
    // 3 and 5 in one kernel, where the backend has one that covers them.
    let fusable = B::FUSES_ATTENTION
        && cx.kernels == Kernels::Fused
        && !with_groups
        && kernel::attention::covers(l, dk);
    let fused = match &position {
        Position::Table(bias) if fusable => fused_attention(FusedInputs {
            q: q.clone(),
            blocks: &blocks,
            carried: &carried,
            bias: bias.clone(),
            codebook: codebook.clone(),
            cache_counts: cache_counts.clone(),
            cache_means: cache_means.clone(),
            count_weight: count_weight.clone(),
            cx,
        }),
        _ => None,
    };
    let (out, groups) = match fused {
        Some(out) => (out, None),
        None => {
            let prev = prev.blocks();
            // 3: window scores, present block (causal) and previous block, [B, H, R, L, L].
            let (present_scores, mut prev_scores, q) = window_scores_and_cache_query(
                q,
                blocks.k_window.clone(),
                prev.k_window.clone(),
                position,
                0..l,
                cx,
            );
            if carried.prev.is_none() {
                prev_scores = mask_first_previous(prev_scores);
            }
            let cache_scores =
                cache_scores(q, codebook, cache_counts.clone(), count_weight.clone(), cx); // [B, H, R, L, S]
            let groups = with_groups.then(|| {
                attention_groups(
                    present_scores.clone(),
                    prev_scores.clone(),
                    cache_scores.clone(),
                    cache_counts,
                    count_weight,
                )
            });
            // 5: one softmax over the three groups.
            let out = attend(
                [
                    (present_scores, blocks.v.clone()),
                    (prev_scores, prev.v.clone()),
                    (cache_scores, cache_means),
                ],
                cx,
            );
            (out, groups)
        }
    };
    // 6: state out.
    let out = out.reshape([b, h, t, dv]);
    Ok(BlockAttention {
        out,
        state: state_after(pos + t, blocks, cache_after),
        groups,
    })
}
