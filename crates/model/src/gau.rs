//! One gated attention unit (GAU) sublayer with VQ attention.

use burn::module::{Module, Param};
use burn::nn::{Initializer, Linear, LinearConfig};
use burn::prelude::*;
use burn::tensor::activation::{sigmoid, silu};

use crate::attention::rotary::join_channel;
use crate::attention::{self, AttentionInput, AttentionState};
use crate::compute::Compute;
use crate::config::{AttentionForm, CountWeight, TransformerVqConfig, WindowKeys};
use crate::dropout::{self, SublayerDropout, SublayerMasks};
use crate::error::ModelError;
use crate::kernel::{Kernels, VqBackend};
use crate::layout::{merge_heads, split_heads};
use crate::norm::{RmsNorm, rms_normalize};
use crate::position::PositionTerm;
use crate::precision::{Precision, to_f32};
use crate::quantizer::{CodebookStats, VectorQuantizer};

/// A linear map `x W` without bias, `W ~ N(0, 1/fan_in)`, `[d_in, d_out]`.
pub(crate) fn projection<B: Backend>(d_in: usize, d_out: usize, device: &B::Device) -> Linear<B> {
    LinearConfig::new(d_in, d_out)
        .with_bias(false)
        .with_initializer(Initializer::Normal {
            mean: 0.0,
            std: (d_in as f64).powf(-0.5),
        })
        .init(device)
}

/// `weight` `[D, N]` with `n` zero columns appended, `[D, N + n]`, still
/// drawn lazily: burn draws a parameter when it is first read, so reading
/// it here would move its draw before the other parameters' and give a
/// model whose other weights are not those of the same seed without the
/// columns (the learned count weight's, which start at zero so that a new
/// model is the paper's model of the same seed).
fn with_zero_columns<B: Backend>(weight: Param<Tensor<B, 2>>, n: usize) -> Param<Tensor<B, 2>> {
    let [d, cols] = weight.lazy_shape().dims();
    let id = weight.id;
    let device = weight.lazy_device();
    Param::uninitialized(
        id,
        move |device, require_grad| {
            let w = weight.val(); // [D, N], drawn now
            let w = Tensor::cat(vec![w, Tensor::zeros([d, n], device)], 1).detach(); // [D, N + n]
            if require_grad { w.require_grad() } else { w }
        },
        device,
        true,
        [d, cols + n].into(),
    )
}

/// A GAU sublayer: `out = Dropout(((Attn(q, VQ(k), v) ⊙ g) W_o)`.
#[derive(Module, Debug)]
pub struct Gau<B: Backend> {
    /// RMS norm with gain and bias on the input.
    pub input_norm: RmsNorm<B>,
    /// `W_q`: `D -> H K` (then `H P` for the rotary position channel and
    /// `H` for the learned count weight, when the config has them).
    pub q_proj: Linear<B>,
    /// Fused `[W_k | W_v | W_g]`: `D -> H K + H V + H V` (the official layout).
    pub kvg_proj: Linear<B>,
    /// `W_o`: `H V -> D`.
    pub out_proj: Linear<B>,
    /// EMA codebook of the keys.
    pub quantizer: VectorQuantizer<B>,
    /// The position term (`bias` in parameter paths, as it always was).
    pub bias: PositionTerm<B>,
    /// Residual dropout probability (masks come from [`Gau::dropout_masks`]).
    pub dropout: f64,
    /// Heads `H`.
    pub n_head: usize,
    /// Key width `K`.
    pub d_k: usize,
    /// Value width `V`.
    pub d_v: usize,
    /// Block length `L`.
    pub block_len: usize,
    /// How the sublayer computes (from the config or set later, not
    /// learned).
    #[module(skip)]
    pub compute: Compute,
    /// VQ attention or the quadratic baseline.
    #[module(skip)]
    pub form: AttentionForm,
    /// Whether the query projection's last `H` columns give each query its
    /// weight of the cache's counts ([`CountWeight::Learned`]).
    #[module(skip)]
    pub count_weight: CountWeight,
}

/// What a GAU sublayer returns for one segment.
#[derive(Debug)]
pub struct GauOutput<B: Backend> {
    /// Residual branch, `[B, T, D]`.
    pub out: Tensor<B, 3>,
    /// Commitment error per token, `[B, T]` (zero for the quadratic form).
    pub commitment: Tensor<B, 2>,
    /// Code statistics (`None` for the quadratic form).
    pub stats: Option<CodebookStats<B>>,
    /// Codes of the keys, `[B, H, T]` (`None` for the quadratic form).
    pub codes: Option<Tensor<B, 3, Int>>,
    /// Where the attention went, when asked for (never for the quadratic
    /// form).
    pub attention: Option<attention::AttentionGroups<B>>,
    /// State after the segment.
    pub state: AttentionState<B>,
}

/// The projections of one segment, per head: `q` and `k` in `f32` (they
/// are normalised and quantized), `v` and `gate` in the compute type (they
/// only enter products).
struct Projected<B: Backend> {
    q: Tensor<B, 4>,    // [B, H, T, K], RMS-normalised and scaled by K^(-1/4)
    k: Tensor<B, 4>,    // [B, H, T, K], likewise
    v: Tensor<B, 4>,    // [B, H, T, V], silu
    gate: Tensor<B, 3>, // [B, T, H V], silu (not split by head)
    count_weight: Option<Tensor<B, 4>>, // [B, H, T, 1], in (0, 2), f32
}

impl<B: VqBackend> Gau<B> {
    /// A sublayer initialised as the spec says.
    pub fn new(cfg: &TransformerVqConfig, device: &B::Device) -> Self {
        let (d, h, k, v) = (cfg.d_model, cfg.n_head, cfg.d_k, cfg.d_v);
        let bias = PositionTerm::new(cfg, device);
        let mut q_proj = projection(d, h * (k + bias.channel()), device);
        if cfg.count_weight == CountWeight::Learned {
            q_proj.weight = with_zero_columns(q_proj.weight, h);
        }
        Self {
            input_norm: RmsNorm::new(d, device),
            q_proj,
            kvg_proj: projection(d, h * (k + 2 * v), device),
            out_proj: projection(h * v, d, device),
            quantizer: VectorQuantizer::new(h, cfg.n_code, k, device),
            bias,
            dropout: cfg.dropout_residual,
            n_head: h,
            d_k: k,
            d_v: v,
            block_len: cfg.block_len,
            compute: Compute {
                cache_grad: cfg.cache_grad,
                cache_limit: cfg.cache_limit,
                code_limit: cfg.code_limit,
                precision: Precision::F32,
                window_keys: cfg.window_keys,
                kernels: Kernels::default(),
            },
            form: cfg.attention,
            count_weight: cfg.count_weight,
        }
    }

    /// The projections of `x` `[B, T, D]`, their products in `cx`'s type.
    fn project(&self, x: Tensor<B, 3>, cx: Compute) -> Projected<B> {
        let (h, k, v) = (self.n_head, self.d_k, self.d_v);
        let scale = (k as f64).powf(-0.25); // twice applied: the 1/sqrt(K) of attention
        let x = cx.cast(self.input_norm.affine(rms_normalize_with(x, cx.kernels))); // statistics in f32, then the compute type
        let q_scale = scale * self.bias.query_scale();
        let (hk, hv) = (h * k, h * v);
        let channel = self.bias.channel();
        let heads = |x: Tensor<B, 3>| to_f32(split_heads(x, h));
        let q = if channel == 0 {
            let [q] = column_blocks(&x, self.q_proj.weight.val(), [hk], cx);
            rms_normalize_with(heads(q), cx.kernels) * q_scale
        } else {
            // The position channel is not normalised: its size is how much
            // the query cares about distance.
            let [content, pos] = column_blocks(&x, self.q_proj.weight.val(), [hk, h * channel], cx);
            let content = rms_normalize_with(heads(content), cx.kernels) * q_scale; // [B, H, T, K]
            let pos = heads(pos) * scale; // [B, H, T, P]
            join_channel(content, pos)
        };
        let [k_raw, v_raw, g_raw] = column_blocks(&x, self.kvg_proj.weight.val(), [hk, hv, hv], cx);
        let count_weight = (self.count_weight == CountWeight::Learned).then(|| {
            let w = self.q_proj.weight.val();
            let [d, cols] = w.dims();
            let w = w.slice([0..d, cols - h..cols]).unsqueeze::<3>(); // [1, D, H]
            let z = heads(cx.product(x.clone(), w)); // [B, H, T, 1]
            sigmoid(z) * 2.0
        });
        let k = rms_normalize_with(heads(k_raw), cx.kernels) * scale;
        // Both activations before `v` is split by head: one fused kernel.
        let (v, gate) = (silu_with(v_raw, cx.kernels), silu_with(g_raw, cx.kernels));
        Projected {
            q,
            k,
            v: split_heads(v, h),
            gate,
            count_weight,
        }
    }

    /// `[B, T, D]` (`f32`) from the attention output `o` `[B, H, T, V]`
    /// and the gate, the output product in `cx`'s type.
    fn finish(
        &self,
        o: Tensor<B, 4>,
        gate: Tensor<B, 3>,
        residual_mask: Option<Tensor<B, 3>>,
        cx: Compute,
    ) -> Tensor<B, 3> {
        let o = cx.cast(merge_heads(o)) * gate; // [B, T, H V]
        let d = self.out_proj.weight.val().dims()[1];
        let [y] = column_blocks(&o, self.out_proj.weight.val(), [d], cx); // [B, T, D]
        dropout::apply(to_f32(y), residual_mask)
    }

    /// The keys `[B, H, T, K (+ P)]` the window scores against: the
    /// quantized `k_hat` or, under [`WindowKeys::Exact`], the keys `k`
    /// themselves (with the rotary position channel either way).
    fn window_keys(&self, k_hat: &Tensor<B, 4>, k: &Tensor<B, 4>) -> Tensor<B, 4> {
        match self.compute.window_keys {
            WindowKeys::Quantized => self.keys_with_channel(k_hat.clone()),
            WindowKeys::Exact => self.keys_with_channel(k.clone()),
        }
    }

    /// Keys (or codewords) `[.., K]` with the rotary position channel's
    /// constant features joined in (the keys themselves for other terms).
    fn keys_with_channel<const D: usize>(&self, k: Tensor<B, D>) -> Tensor<B, D> {
        match self.bias.rotary() {
            Some(r) => r.keys_with_channel(k, (self.d_k as f64).powf(-0.25)),
            None => k,
        }
    }

    /// Dropout probabilities of this sublayer, with the model's layer drop.
    pub fn dropout_probs(&self, layer_drop: f64) -> SublayerDropout {
        SublayerDropout {
            sinusoid: self.bias.sinusoid_dropout(),
            residual: self.dropout,
            layer: layer_drop,
        }
    }

    /// Draws this sublayer's dropout masks for `[batch, len]` tokens (none
    /// outside training), with the model's layer drop, on `device` of any
    /// backend `D`.
    pub fn dropout_masks<D: Backend>(
        &self,
        layer_drop: f64,
        shape: [usize; 2],
        device: &D::Device,
    ) -> SublayerMasks<D> {
        let d_model = self.out_proj.weight.dims()[1];
        let p = self.dropout_probs(layer_drop);
        SublayerMasks::draw(p, shape, d_model, self.block_len, device)
    }

    /// Block-parallel form over a segment `x` `[B, T, D]` (`T` a multiple of
    /// `L`); `valid` `[B, T]` marks the tokens that count towards the codebook
    /// statistics. The layer-drop mask in `masks` is the caller's (it acts on
    /// the residual connection). With `with_attention`, also reports where the
    /// attention went ([`attention::AttentionGroups`], a diagnostic).
    pub fn forward(
        &self,
        x: Tensor<B, 3>,
        state: AttentionState<B>,
        valid: Option<Tensor<B, 2, Bool>>,
        masks: &mut SublayerMasks<B>,
        with_attention: bool,
    ) -> Result<GauOutput<B>, ModelError> {
        let [b, t, _] = x.dims();
        let device = x.device();
        let cx = self.compute;
        let p = self.project(x, cx);
        let (q, position) = self.bias.apply(p.q, self.block_len, masks.sinusoid.take());
        if self.form == AttentionForm::Quadratic {
            if state.pos != 0 || state.prev.is_some() {
                return Err(ModelError::QuadraticIsStateless);
            }
            let o = attention::quadratic_attention(
                q,
                position,
                self.keys_with_channel(p.k),
                p.v,
                self.block_len,
                cx,
            );
            return Ok(GauOutput {
                out: self.finish(o, p.gate, masks.residual.take(), cx),
                commitment: Tensor::zeros([b, t], &device),
                stats: None,
                codes: None,
                attention: None,
                state: AttentionState::default(),
            });
        }
        let vq = self.quantizer.quantize(p.k.clone(), valid, cx.kernels);
        let input = AttentionInput {
            q,
            position,
            k_window: self.window_keys(&vq.k_hat, &p.k),
            codes: vq.codes.clone(),
            v: p.v,
            codebook: self.keys_with_channel(vq.codebook.clone()),
            count_weight: p.count_weight,
        };
        let (o, state, attention) = if with_attention {
            let a = attention::block_attention_with_groups(input, state, self.block_len, cx)?;
            (a.out, a.state, a.groups)
        } else {
            let (o, state) = attention::block_attention(input, state, self.block_len, cx)?;
            (o, state, None)
        };
        Ok(GauOutput {
            out: self.finish(o, p.gate, masks.residual.take(), cx),
            commitment: vq.commitment,
            stats: Some(vq.stats),
            codes: Some(vq.codes),
            attention,
            state,
        })
    }

    /// Recurrent form for one token `x` `[B, 1, D]` (masks as in
    /// [`Gau::forward`]).
    pub fn decode(
        &self,
        x: Tensor<B, 3>,
        state: AttentionState<B>,
        masks: &mut SublayerMasks<B>,
    ) -> Result<(Tensor<B, 3>, AttentionState<B>), ModelError> {
        if self.form == AttentionForm::Quadratic {
            return Err(ModelError::QuadraticIsStateless);
        }
        let cx = self.compute.in_f32();
        let p = self.project(x, cx);
        let (q, position) = self.bias.apply(p.q, self.block_len, masks.sinusoid.take());
        let vq = self.quantizer.quantize(p.k.clone(), None, cx.kernels);
        let input = AttentionInput {
            q,
            position,
            k_window: self.window_keys(&vq.k_hat, &p.k),
            codes: vq.codes,
            v: p.v,
            codebook: self.keys_with_channel(vq.codebook.clone()),
            count_weight: p.count_weight,
        };
        let (o, state) = attention::recurrent_attention(input, state, self.block_len, cx)?;
        Ok((self.finish(o, p.gate, masks.residual.take(), cx), state))
    }
}

/// [`rms_normalize`], differentiated by the backend's own backward step
/// under [`Kernels::Fused`] where it has one ([`VqBackend::vq_rms_normalize`]).
pub fn rms_normalize_with<B: VqBackend, const D: usize>(
    x: Tensor<B, D>,
    kernels: Kernels,
) -> Tensor<B, D> {
    match kernels {
        Kernels::Fused => B::vq_rms_normalize(x),
        Kernels::Composed => rms_normalize(x),
    }
}

/// SiLU of `x`: the backend's own passes under [`Kernels::Fused`]
/// ([`VqBackend::vq_silu`]), burn's composed ops otherwise.
pub fn silu_with<B: VqBackend, const D: usize>(x: Tensor<B, D>, kernels: Kernels) -> Tensor<B, D> {
    match kernels {
        Kernels::Fused => B::vq_silu(x),
        Kernels::Composed => silu(x),
    }
}

/// `x W` `[B, T, sum(widths)]` for `x` `[B, T, D]`, as one tensor per block
/// of `widths` columns, the products in `cx`'s type. One matmul per column block of the weight, rather
/// than slicing the product: slices of the last axis are strided views, and
/// every elementwise op (and the slice's backward) on them is far slower
/// than on contiguous tensors. For one token (the recurrent form) the
/// product is sliced instead: slicing the weight would copy it whole at
/// every token, while the output row is tiny.
/// Under [`Kernels::Fused`], the blocks are the backend's product with a
/// backward step of its own where it has one
/// ([`VqBackend::vq_column_blocks`]).
fn column_blocks<B: VqBackend, const N: usize>(
    x: &Tensor<B, 3>,
    w: Tensor<B, 2>,
    widths: [usize; N],
    cx: Compute,
) -> [Tensor<B, 3>; N] {
    let [b, t, _] = x.dims();
    let [d, cols] = w.dims();
    // One block of every column is the weight itself (a slice's backward
    // would zero a copy of its gradient and assign into it).
    let whole = N == 1 && widths[0] == cols;
    if t > 1 && cx.kernels == Kernels::Fused {
        let dtype = cx.precision.dtype();
        let own = B::vq_column_blocks(x.clone().cast(dtype), w.clone().cast(dtype), widths);
        if let Some(blocks) = own {
            return blocks;
        }
    }
    let product = (t == 1 || whole).then(|| cx.product(x.clone(), w.clone().unsqueeze::<3>()));
    let mut start = 0;
    widths.map(|n| {
        let cols = start..start + n;
        start += n;
        match &product {
            Some(p) if whole => p.clone(),
            Some(p) => p.clone().slice([0..b, 0..1, cols]),
            None => cx.product(x.clone(), w.clone().slice([0..d, cols]).unsqueeze::<3>()),
        }
    })
}
