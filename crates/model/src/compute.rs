//! How a sublayer computes: the settings that are not learned (set from
//! the config, or changed on a loaded model) and that every function of
//! its attention reads, carried together as one small context.

use burn::prelude::*;

use crate::config::{CacheGrad, WindowKeys};
use crate::kernel::Kernels;
use crate::precision::{Precision, product_in, to_f32};

/// How a sublayer computes. Not parameters: a loaded model's can be
/// changed ([`crate::TransformerVq::set_cache_limit`],
/// [`crate::TransformerVq::set_code_limit`],
/// [`crate::TransformerVq::set_precision`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Compute {
    /// Gradient through the caches within a segment.
    pub cache_grad: CacheGrad,
    /// Most keys the compressed cache weighs
    /// ([`crate::attention::cache_limit_bias`]; `None`: all of them, the
    /// paper's cache).
    pub cache_limit: Option<usize>,
    /// Most keys one code of the compressed cache weighs as
    /// ([`crate::TransformerVqConfig::code_limit`]; `None`: all of them).
    pub code_limit: Option<usize>,
    /// Type of the matrix products (projections, scores, weighted values);
    /// statistics, the softmax and the compressed cache stay `f32`
    /// ([`crate::precision`]).
    pub precision: Precision,
    /// Which keys the two-block window scores against.
    pub window_keys: WindowKeys,
    /// Whether the attention may run as the backend's fused kernel.
    pub kernels: Kernels,
}

impl Compute {
    /// The same settings in `f32`: the recurrent form always computes so.
    pub fn in_f32(self) -> Self {
        Self {
            precision: Precision::F32,
            ..self
        }
    }

    /// `a b` in the compute type ([`product_in`]).
    pub fn product<B: Backend, const D: usize>(
        &self,
        a: Tensor<B, D>,
        b: Tensor<B, D>,
    ) -> Tensor<B, D> {
        product_in(a, b, self.precision.dtype())
    }

    /// `a b` in the compute type, returned in `f32`: a product whose result
    /// is summed or normalised next.
    pub fn product_f32<B: Backend, const D: usize>(
        &self,
        a: Tensor<B, D>,
        b: Tensor<B, D>,
    ) -> Tensor<B, D> {
        to_f32(self.product(a, b))
    }

    /// `x` in the compute type.
    pub fn cast<B: Backend, const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        x.cast(self.precision.dtype())
    }
}
