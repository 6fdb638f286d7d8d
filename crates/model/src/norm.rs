//! RMS layer norm, as the official code defines it: epsilon inside the root,
//! nothing subtracted first.

use burn::module::{Module, Param};
use burn::prelude::*;

/// Epsilon added to the mean square before the root.
pub const RMS_EPS: f64 = 1e-6;

/// `x / sqrt(mean(x^2) + 1e-6)` over the last axis (no gain, no bias).
pub fn rms_normalize<B: Backend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    let r = reciprocal_rms(x.clone());
    x * r
}

/// `1 / sqrt(mean(x^2) + 1e-6)` over the last axis, `[..., 1]`.
pub(crate) fn reciprocal_rms<B: Backend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    let ms = x.square().mean_dim(D - 1); // [..., 1]
    (ms + RMS_EPS).sqrt().recip()
}

/// RMS norm with a learned gain (init 1) and bias (init 0).
#[derive(Module, Debug)]
pub struct RmsNorm<B: Backend> {
    /// Gain `g`, `[D]`.
    pub gain: Param<Tensor<B, 1>>,
    /// Bias `b`, `[D]`.
    pub bias: Param<Tensor<B, 1>>,
}

impl<B: Backend> RmsNorm<B> {
    /// A norm over `d` features with gain 1 and bias 0.
    pub fn new(d: usize, device: &B::Device) -> Self {
        Self {
            gain: Param::from_tensor(Tensor::ones([d], device)),
            bias: Param::from_tensor(Tensor::zeros([d], device)),
        }
    }

    /// `[..., D] -> [..., D]`.
    pub fn forward<const N: usize>(&self, x: Tensor<B, N>) -> Tensor<B, N> {
        self.affine(rms_normalize(x))
    }

    /// The gain and bias applied to `normalized` `[..., D]` (the output of
    /// [`rms_normalize`]).
    pub fn affine<const N: usize>(&self, normalized: Tensor<B, N>) -> Tensor<B, N> {
        let gain = self.gain.val().unsqueeze::<N>();
        let bias = self.bias.val().unsqueeze::<N>();
        normalized * gain + bias
    }
}
