//! What a sublayer carries between segments: the previous block and the
//! compressed cache (and, in the recurrent form, the block being filled).

use burn::prelude::*;

use crate::device::to_device_via_host;

/// Keys, values and codes of one block as they were when it was the present block.
#[derive(Clone, Debug)]
pub struct CachedBlock<B: Backend> {
    /// The keys the window scores against (quantized, or exact under
    /// [`crate::WindowKeys::Exact`]), `[B, H, L, K]`.
    pub k_window: Tensor<B, 4>,
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
            k_window: self.k_window.detach(),
            v: self.v.detach(),
            codes: self.codes,
        }
    }

    fn into_device(self, device: &B::Device) -> Self {
        Self {
            k_window: to_device_via_host(self.k_window, device),
            v: to_device_via_host(self.v, device),
            codes: to_device_via_host(self.codes, device),
        }
    }

    /// The block with slot `i` holding one token's `k_window` `[B, H, 1, K]`,
    /// `v` `[B, H, 1, V]` and `codes` `[B, H, 1]`.
    pub(super) fn with_slot(
        self,
        i: usize,
        k_window: Tensor<B, 4>,
        v: Tensor<B, 4>,
        codes: Tensor<B, 3, Int>,
    ) -> Self {
        let [b, h, _, dk] = self.k_window.dims();
        let dv = self.v.dims()[3];
        Self {
            k_window: self
                .k_window
                .slice_assign([0..b, 0..h, i..i + 1, 0..dk], k_window),
            v: self.v.slice_assign([0..b, 0..h, i..i + 1, 0..dv], v),
            codes: self.codes.slice_assign([0..b, 0..h, i..i + 1], codes),
        }
    }

    fn repeat_rows(self, n: usize) -> Self {
        Self {
            k_window: self.k_window.repeat_dim(0, n),
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
    pub(super) fn detach(self) -> Self {
        Self {
            counts: self.counts.detach(),
            means: self.means.detach(),
        }
    }

    /// The cache of a stream with nothing older than its previous block.
    pub(super) fn empty(b: usize, h: usize, s: usize, v: usize, device: &B::Device) -> Self {
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
    pub(super) fn merge(
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
    pub(super) fn absorb(&self, add_counts: Tensor<B, 3>, add_sums: Tensor<B, 4>) -> Self {
        let [b, h, s, v] = add_sums.dims();
        let (counts, means) = self.merge(add_counts.unsqueeze_dim(2), add_sums.unsqueeze_dim(2));
        Self {
            counts: counts.reshape([b, h, s]),
            means: means.reshape([b, h, s, v]),
        }
    }
}

/// Empty-slot placeholders for a missing previous block.
pub(super) fn empty_block<B: Backend>(
    b: usize,
    h: usize,
    l: usize,
    k: usize,
    v: usize,
    s: usize,
    device: &B::Device,
) -> CachedBlock<B> {
    CachedBlock {
        k_window: Tensor::zeros([b, h, l, k], device),
        v: Tensor::zeros([b, h, l, v], device),
        codes: Tensor::<B, 3, Int>::full([b, h, l], s as i64, device),
    }
}
