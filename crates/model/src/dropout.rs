//! Dropout masks, drawn for a whole forward pass before it runs.
//!
//! The backends draw random numbers from one global generator. Drawing every
//! mask of a pass up front, in a fixed order, lets several passes run at
//! once on worker threads, each with masks from its own seed: only the
//! seeding and drawing have to happen one at a time, not the passes.

use burn::prelude::*;
use burn::tensor::Distribution;

/// A mask that keeps an element with probability `1 - p` and scales the
/// kept ones by `1 / (1 - p)` (inverted dropout), shaped `shape`. `None`
/// when `p = 0` or outside training (no autodiff): nothing is dropped.
fn draw<B: Backend, const D: usize>(
    p: f64,
    shape: [usize; D],
    device: &B::Device,
) -> Option<Tensor<B, D>> {
    if p == 0.0 || !B::ad_enabled(device) {
        return None;
    }
    let keep = 1.0 - p;
    Some(Tensor::random(shape, Distribution::Bernoulli(keep), device) * (1.0 / keep))
}

/// Multiplies `x` by `mask` (nothing to do without one).
pub(crate) fn apply<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    mask: Option<Tensor<B, D>>,
) -> Tensor<B, D> {
    match mask {
        Some(mask) => x * mask,
        None => x,
    }
}

/// Dropout probabilities of one GAU sublayer and its residual connection.
#[derive(Clone, Copy, Debug)]
pub struct SublayerDropout {
    /// On the XL bias's sinusoid embedding (`p_dropsin`; 0 for Toeplitz).
    pub sinusoid: f64,
    /// On the sublayer's output (`p_dropres`).
    pub residual: f64,
    /// Of the whole sublayer, per batch row (`p_droplyr`).
    pub layer: f64,
}

/// The masks of one sublayer for one forward pass.
#[derive(Clone, Debug)]
pub struct SublayerMasks<B: Backend> {
    /// XL sinusoid embedding, `[L + 1, D]`.
    pub sinusoid: Option<Tensor<B, 2>>,
    /// Sublayer output, `[B, T, D]`.
    pub residual: Option<Tensor<B, 3>>,
    /// Layer drop, `[B, 1, 1]`: the whole sublayer per row.
    pub layer: Option<Tensor<B, 3>>,
}

impl<B: Backend> SublayerMasks<B> {
    /// Draws the masks for `[batch, len]` tokens of model width `d_model`
    /// and block length `block_len`, in the order the forward pass uses them.
    pub(crate) fn draw(
        p: SublayerDropout,
        [batch, len]: [usize; 2],
        d_model: usize,
        block_len: usize,
        device: &B::Device,
    ) -> Self {
        Self {
            sinusoid: draw(p.sinusoid, [block_len + 1, d_model], device),
            residual: draw(p.residual, [batch, len, d_model], device),
            layer: draw(p.layer, [batch, 1, 1], device),
        }
    }
}

/// Every sublayer's masks for one forward pass, in sublayer order (see
/// [`crate::TransformerVq::dropout_masks`]).
#[derive(Clone, Debug)]
pub struct DropoutMasks<B: Backend> {
    /// One entry per GAU sublayer.
    pub sublayers: Vec<SublayerMasks<B>>,
}

impl<B: Backend> DropoutMasks<B> {
    /// The masks on `device`, copied through the host where they move
    /// ([`crate::device::to_device_via_host`]; nothing is copied where they
    /// already are).
    pub fn to_device(self, device: &B::Device) -> Self {
        use crate::device::to_device_via_host as to;
        self.map(|t| to(t, device), |t| to(t, device))
    }

    /// The masks on `device` of another backend, through the host: how
    /// masks drawn on the CPU reach a backend that has no CPU device.
    pub fn onto<D: Backend>(self, device: &D::Device) -> DropoutMasks<D> {
        self.map(
            |t| Tensor::from_data(t.into_data(), device),
            |t| Tensor::from_data(t.into_data(), device),
        )
    }

    /// Every mask through `rank2` or `rank3`, by its rank.
    fn map<D: Backend>(
        self,
        rank2: impl Fn(Tensor<B, 2>) -> Tensor<D, 2>,
        rank3: impl Fn(Tensor<B, 3>) -> Tensor<D, 3>,
    ) -> DropoutMasks<D> {
        let sublayers = self
            .sublayers
            .into_iter()
            .map(|m| SublayerMasks {
                sinusoid: m.sinusoid.map(&rank2),
                residual: m.residual.map(&rank3),
                layer: m.layer.map(&rank3),
            })
            .collect();
        DropoutMasks { sublayers }
    }
}
