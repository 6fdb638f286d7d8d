//! Mixed precision: the type the matrix products run in.
//!
//! Parameters, EMA codebooks and every statistic stay `f32`; only the
//! products of the GAU sublayers (projections, attention scores, weighted
//! values) run in the compute type, and the elementwise ops that directly
//! follow a product on the way to the next one (silu, the gate) stay in it.
//! Everything that sums many terms or sets a scale runs in `f32`: RMS norm
//! statistics, the quantizer's distances and the commitment, the softmax's
//! maximum, exponentials and sums, the compressed cache's counts and means,
//! the residual stream, the output head and the loss (docs/training.md,
//! "Precision"). This is the official code's split (`param_dtype` f32,
//! `dtype` bfloat16) with autocast's rule for reductions.
//!
//! A cast is differentiable: its gradient comes back in the input's type,
//! so every parameter's gradient is `f32`.

use std::fmt;
use std::str::FromStr;

use burn::prelude::*;
use burn::tensor::FloatDType;
use serde::{Deserialize, Serialize};

/// The type of the GAU sublayers' matrix products.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// Everything in `f32`. Default.
    #[default]
    F32,
    /// bfloat16 products: `f32`'s range with 8 bits of mantissa; needs no
    /// loss scaling.
    Bf16,
    /// IEEE half products: 11 bits of mantissa but a range of `6e-8 ..
    /// 65504`, so small gradients underflow without loss scaling.
    F16,
}

impl Precision {
    /// Every precision, in the order of their names.
    pub const ALL: [Precision; 3] = [Precision::F32, Precision::Bf16, Precision::F16];

    /// The float type of the products.
    pub fn dtype(self) -> FloatDType {
        match self {
            Precision::F32 => FloatDType::F32,
            Precision::Bf16 => FloatDType::BF16,
            Precision::F16 => FloatDType::F16,
        }
    }

    /// Whether the products run in a narrower type than `f32`.
    pub fn is_reduced(self) -> bool {
        self != Precision::F32
    }

    /// The name in configs and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Precision::F32 => "f32",
            Precision::Bf16 => "bf16",
            Precision::F16 => "f16",
        }
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.name())
    }
}

impl FromStr for Precision {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| format!("unknown precision {s:?} (f32, bf16 or f16)"))
    }
}

/// `a b` with both operands and the product in `dtype`: the one place a
/// reduced-precision product happens. Operands already in `dtype` are not
/// cast (a cast to the same type is not even an autodiff node).
pub fn product_in<B: Backend, const D: usize>(
    a: Tensor<B, D>,
    b: Tensor<B, D>,
    dtype: FloatDType,
) -> Tensor<B, D> {
    a.cast(dtype).matmul(b.cast(dtype))
}

/// `x` in `f32` (itself when it is already).
pub fn to_f32<B: Backend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    x.cast(FloatDType::F32)
}
