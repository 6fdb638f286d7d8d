//! The position term of a sublayer: one [`PositionTerm`] per sublayer,
//! one variant per kind (Toeplitz, Transformer-XL, windowed rotary), each
//! owning its parameters and what it adds to the scores.
//!
//! What a term gives the attention is a [`Position`]: the additive terms a
//! table of biases by distance `d = 0..=L` for every query (keys farther
//! than `L` get none), the rotary term the rotation of queries and keys
//! ([`Rotary`]) with nothing added.
//!
//! Adding a term: a variant here (its parameters, [`PositionTerm::new`],
//! [`PositionTerm::apply`]), its [`RelativeBias`] in the config, its tests;
//! and, only if it is neither a table nor a rotation, a [`Position`]
//! variant and its scores in the attention forms.

// The variants are named as parameter paths name them (see
// `PositionTerm`); burn's derive repeats them in the record types here.
#![allow(non_camel_case_types)]

use burn::module::{Module, Param};
use burn::nn::{Initializer, Linear, LinearConfig};
use burn::prelude::*;

use crate::attention::{Position, Rotary};
use crate::config::{RelativeBias, TransformerVqConfig};

/// Transformer-XL bias terms of one sublayer.
#[derive(Module, Debug)]
pub struct XlBias<B: Backend> {
    /// `W_r`: sinusoid embedding (`D`) to per-head key width (`H K`).
    pub r_proj: Linear<B>,
    /// Content bias `u`, `[H, K]` (added to the query for content scores).
    pub u: Param<Tensor<B, 2>>,
    /// Position bias `w`, `[H, K]` (the paper's `v`; renamed to avoid values).
    pub w: Param<Tensor<B, 2>>,
    /// Dropout probability on the sinusoid embedding (masks come from
    /// [`crate::dropout`]).
    pub sinusoid_dropout: f64,
    /// Wavelength base of the sinusoid.
    pub sinusoid_base: f64,
}

/// The position term of one sublayer.
///
/// The variants are named as they appear in parameter paths
/// (`sublayers.3.bias.toeplitz`, `sublayers.3.bias.xl.u`): burn's module
/// derive names an enum's variant in the path, and these are the names
/// every checkpoint and export of tvq uses.
// One per sublayer, built once: the XL variant's size costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Module, Debug)]
pub enum PositionTerm<B: Backend> {
    /// Toeplitz table `b_h[d]`, `[H, L + 1]`: one learned bias per head and
    /// distance.
    toeplitz(Param<Tensor<B, 2>>),
    /// Transformer-XL: `(q + w) . W_r r_d` by distance, `u` on the content.
    xl(XlBias<B>),
    /// The windowed rotary position with its position channel (no bias
    /// parameters: the channel's query features are part of the query
    /// projection).
    rotary(Rotary),
}

/// `[sin(d w_m) for m < D/2, then cos(d w_m)]`, `w_m = base^(-2m/D)`, for
/// `d = 0..n`. `[n, D]`.
pub fn sinusoid_embedding<B: Backend>(
    n: usize,
    d_model: usize,
    base: f64,
    device: &B::Device,
) -> Tensor<B, 2> {
    let half = d_model / 2;
    let mut data = vec![0f32; n * d_model];
    for d in 0..n {
        for m in 0..half {
            let angle = d as f64 * base.powf(-2.0 * m as f64 / d_model as f64);
            data[d * d_model + m] = angle.sin() as f32;
            data[d * d_model + half + m] = angle.cos() as f32;
        }
    }
    Tensor::from_data(TensorData::new(data, [n, d_model]), device)
}

/// The initial Toeplitz table `[H, L + 1]`: `b_h[d] = a_h (1 - d / L)` with
/// `a_h = locality 2^(-8 h / H)`, ALiBi's geometric spread of per-head
/// ranges, shifted so that `b_h[L] = 0` like every key beyond the window.
///
/// Why not zero: AdamW moves each entry by about the learning rate per
/// step, so a table starting flat can gain only ~`sum(lr)` nats of locality
/// over a run (about 1.3 in the quick start), and the model stalls near the
/// bigram level (docs/learning.md).
pub fn toeplitz_init<B: Backend>(
    heads: usize,
    block_len: usize,
    locality: f64,
    device: &B::Device,
) -> Tensor<B, 2> {
    let l = block_len;
    let data: Vec<f32> = (0..heads)
        .flat_map(|h| {
            let a = locality * 2f64.powf(-8.0 * h as f64 / heads as f64);
            (0..=l).map(move |d| (a * (1.0 - d as f64 / l as f64)) as f32)
        })
        .collect();
    Tensor::from_data(TensorData::new(data, [heads, l + 1]), device)
}

impl<B: Backend> PositionTerm<B> {
    /// The term configured in `cfg`: the Toeplitz table with its initial
    /// locality ([`toeplitz_init`]); the XL terms as the spec says (all zero
    /// except `W_r`, which is `N(0, 1/D)`); the rotary term with the
    /// config's channel.
    pub fn new(cfg: &TransformerVqConfig, device: &B::Device) -> Self {
        let (h, k) = (cfg.n_head, cfg.d_k);
        match cfg.bias {
            RelativeBias::Toeplitz => Self::toeplitz(Param::from_tensor(toeplitz_init(
                h,
                cfg.block_len,
                cfg.toeplitz_locality,
                device,
            ))),
            RelativeBias::Rotary => {
                Self::rotary(Rotary::new(cfg.block_len).with_channel(cfg.rotary_channel_width()))
            }
            RelativeBias::Xl => Self::xl(XlBias {
                r_proj: LinearConfig::new(cfg.d_model, h * k)
                    .with_bias(false)
                    .with_initializer(Initializer::Normal {
                        mean: 0.0,
                        std: (cfg.d_model as f64).powf(-0.5),
                    })
                    .init(device),
                u: Param::from_tensor(Tensor::zeros([h, k], device)),
                w: Param::from_tensor(Tensor::zeros([h, k], device)),
                sinusoid_dropout: cfg.dropout_sinusoid,
                sinusoid_base: cfg.sinusoid_base,
            }),
        }
    }

    /// Which kind of term this is.
    pub fn kind(&self) -> RelativeBias {
        match self {
            Self::toeplitz(_) => RelativeBias::Toeplitz,
            Self::xl(_) => RelativeBias::Xl,
            Self::rotary(_) => RelativeBias::Rotary,
        }
    }

    /// The windowed rotary position, when it is this term.
    pub fn rotary(&self) -> Option<Rotary> {
        match self {
            Self::rotary(r) => Some(*r),
            _ => None,
        }
    }

    /// Features `P` of the rotary position channel the query projection
    /// carries beside its `K` (0 for the other terms).
    pub fn channel(&self) -> usize {
        self.rotary().map_or(0, |r| r.channel)
    }

    /// What the queries are multiplied by beyond `K^(-1/4)`: the rotary
    /// term without a position channel sharpens its scores through the
    /// query ([`Rotary::LOGIT_SCALE`]); with one, the channel's
    /// unnormalised features give the scores their range, as the bias
    /// does for the others.
    pub fn query_scale(&self) -> f64 {
        match self.rotary() {
            Some(r) if r.channel == 0 => Rotary::LOGIT_SCALE,
            _ => 1.0,
        }
    }

    /// Dropout probability of the XL sinusoid embedding (0 for the others).
    pub fn sinusoid_dropout(&self) -> f64 {
        match self {
            Self::xl(xl) => xl.sinusoid_dropout,
            _ => 0.0,
        }
    }

    /// From the scaled query `q` `[B, H, T, K]` (already `K^(-1/4)`), the
    /// content query (`q + u'` for XL) and the term's part of the window's
    /// scores: the per-distance bias table `[B or 1, H, T or 1, L + 1]` of
    /// the Toeplitz and XL terms, or the rotary position.
    /// `sinusoid_mask` `[L + 1, D]` is the XL sinusoid embedding's dropout
    /// mask.
    pub fn apply(
        &self,
        q: Tensor<B, 4>,
        block_len: usize,
        sinusoid_mask: Option<Tensor<B, 2>>,
    ) -> (Tensor<B, 4>, Position<B>) {
        let xl = match self {
            Self::toeplitz(table) => {
                let [h, n] = table.dims();
                return (q, Position::Table(table.val().reshape([1, h, 1, n])));
            }
            Self::rotary(rotary) => return (q, Position::Rotary(*rotary)),
            Self::xl(xl) => xl,
        };
        let [_, h, _, k] = q.dims();
        let scale = (k as f64).powf(-0.25);
        let d_model = xl.r_proj.weight.dims()[0];
        let sin = sinusoid_embedding::<B>(block_len + 1, d_model, xl.sinusoid_base, &q.device());
        let sin = crate::dropout::apply(sin, sinusoid_mask);
        let r = xl.r_proj.forward(sin) * scale; // [L+1, H K]
        let r = r
            .reshape([block_len + 1, h, k])
            .swap_dims(0, 1)
            .swap_dims(1, 2)
            .unsqueeze_dim::<4>(0); // [1, H, K, L+1]
        let u = xl.u.val().reshape([1, h, 1, k]) * scale;
        let w = xl.w.val().reshape([1, h, 1, k]) * scale;
        let table = (q.clone() + w).matmul(r); // [B, H, T, L+1]
        (q + u, Position::Table(table))
    }
}

#[cfg(test)]
mod tests {
    use burn::backend::flex::FlexDevice;
    use burn::{Dispatch, DispatchDevice};

    use super::*;

    #[test]
    fn the_toeplitz_table_starts_local_and_meets_the_cache_at_the_window_edge() {
        let device = DispatchDevice::Flex(FlexDevice);
        let table: Vec<f32> = toeplitz_init::<Dispatch>(2, 4, 2.0, &device)
            .into_data()
            .to_vec()
            .unwrap();
        // Head 0: amplitude 2; head 1 of 2: 2 * 2^-4.
        let a1 = 2.0 * 2f32.powf(-4.0);
        let expect = [
            2.0,
            1.5,
            1.0,
            0.5,
            0.0,
            a1,
            0.75 * a1,
            0.5 * a1,
            0.25 * a1,
            0.0,
        ];
        for (got, want) in table.iter().zip(expect) {
            assert!((got - want).abs() < 1e-6, "{table:?}");
        }
        let flat: Vec<f32> = toeplitz_init::<Dispatch>(3, 8, 0.0, &device)
            .into_data()
            .to_vec()
            .unwrap();
        assert_eq!(flat, vec![0.0; 27], "locality 0 is the zero table");
    }
}
