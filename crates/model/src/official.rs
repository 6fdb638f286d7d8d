//! Import from (and export to) the official JAX implementation's config and
//! parameter names, so its checkpoints run in tvq and tvq can be checked
//! against its outputs.
//!
//! | official (per sublayer `transformer_layers_{n}/scanned_attn{1,2}/`) | tvq (`sublayers[2n + j]`) | layout |
//! |---|---|---|
//! | `input_ln/g`, `input_ln/b` | `input_norm.gain`, `input_norm.bias` | `[D]` |
//! | `q_proj/kernel` | `q_proj.weight` | `[D, H K]` |
//! | `kvg_proj/kernel` | `kvg_proj.weight` | `[D, H K + 2 H V]`, columns k, v, gate |
//! | `res_proj/kernel` | `out_proj.weight` | `[H V, D]` |
//! | `r_proj/kernel` | `bias.xl.r_proj.weight` | `[D, H K]` |
//! | `u`, `v` | `bias.xl.u`, `bias.xl.w` | `[H K]` official, `[H, K]` tvq |
//! | `quantizer/c_sum`, `quantizer/c_count` | `quantizer.c_sum`, `quantizer.c_count` | `[H, S, K]`, `[H, S]` |
//!
//! and, once: `token_embedder/embs` → `embedding.weight` `[vocab, D]`;
//! `out_proj/kernel`, `out_proj/bias` → `output.weight` `[D, vocab]`,
//! `output.bias` (untied); `token_embedder/bias_out` → `output_bias` (tied).
//! Kernels are `[in, out]` (`y = x W`) on both sides: nothing is transposed.

use std::collections::BTreeMap;

use burn::module::Param;
use burn::prelude::*;
use serde::Deserialize;
use thiserror::Error;

use crate::config::{CacheGrad, RelativeBias, TransformerVqConfig};
use crate::kernel::VqBackend;
use crate::model::TransformerVq;
use crate::position::PositionTerm;

/// The fields of the official `config` object that shape the network.
/// Other fields (optimizer, data, sampling) are ignored.
#[derive(Clone, Debug, Deserialize, PartialEq)]
pub struct OfficialConfig {
    /// Vocabulary size (bytes + 3 specials for byte-level data).
    pub n_vocab: usize,
    /// `D`.
    pub d_model: usize,
    /// `K`.
    pub d_k: usize,
    /// `V`.
    pub d_v: usize,
    /// `S`.
    pub n_code: usize,
    /// `H`.
    pub n_head: usize,
    /// Layers (two GAUs each).
    pub n_layer: usize,
    /// `L`.
    pub block_len: usize,
    /// Length of the uncompressed window; tvq requires `mem_len == block_len`.
    pub mem_len: usize,
    /// 1: compressed cache on (tvq requires it).
    pub agg_cache: u8,
    /// 0 or 1: gradient through the caches.
    pub grad_thru_cache: u8,
    /// 1: absolute sinusoid positions (not supported).
    #[serde(default)]
    pub pe_abs: u8,
    /// XL sinusoid base.
    pub pe_lam: f64,
    /// 1: final norm before the output.
    #[serde(default)]
    pub e_preln: u8,
    /// 1: output tied to the embedding.
    #[serde(default)]
    pub e_tie: u8,
    /// Logit scale.
    #[serde(default = "one")]
    pub e_scale: f64,
    /// Residual dropout.
    #[serde(default)]
    pub p_dropres: f64,
    /// Layer drop.
    #[serde(default)]
    pub p_droplyr: f64,
    /// Sinusoid dropout.
    #[serde(default)]
    pub p_dropsin: f64,
    /// Embedding dropout (not supported unless 0).
    #[serde(default)]
    pub p_dropemb: f64,
}

fn one() -> f64 {
    1.0
}

/// Why an official config or checkpoint cannot be imported.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum ImportError {
    /// A setting tvq does not implement.
    #[error("official setting `{key} = {value}` is not supported: {why}")]
    Unsupported {
        /// Official key.
        key: &'static str,
        /// Its value.
        value: String,
        /// What tvq supports instead.
        why: &'static str,
    },
    /// A parameter the model needs is absent.
    #[error("official checkpoint has no tensor `{0}`")]
    Missing(String),
    /// A parameter has another shape than the config implies.
    #[error("official tensor `{name}` has shape {got:?}, expected {want:?}")]
    Shape {
        /// Official name.
        name: String,
        /// Shape found.
        got: Vec<usize>,
        /// Shape expected.
        want: Vec<usize>,
    },
    /// The resulting config is invalid.
    #[error(transparent)]
    Config(#[from] crate::error::ConfigError),
}

/// A tensor under its official name: row-major `f32` data and its shape.
#[derive(Clone, Debug, PartialEq)]
pub struct OfficialTensor {
    /// Shape.
    pub shape: Vec<usize>,
    /// Row-major values.
    pub data: Vec<f32>,
}

/// The tvq config equivalent to an official config: XL bias,
/// `grad_thru_cache` 0 → `cache_grad = none`, 1 → `full`.
pub fn config_from_official(c: &OfficialConfig) -> Result<TransformerVqConfig, ImportError> {
    let unsupported = |key, value: String, why| Err(ImportError::Unsupported { key, value, why });
    if c.mem_len != c.block_len {
        return unsupported(
            "mem_len",
            c.mem_len.to_string(),
            "tvq's window is one block: mem_len must equal block_len",
        );
    }
    if c.agg_cache != 1 {
        return unsupported(
            "agg_cache",
            c.agg_cache.to_string(),
            "tvq always uses the compressed cache (agg_cache = 1)",
        );
    }
    if c.pe_abs != 0 {
        return unsupported(
            "pe_abs",
            c.pe_abs.to_string(),
            "absolute positions are not implemented (pe_abs = 0)",
        );
    }
    if c.e_preln != 0 {
        return unsupported(
            "e_preln",
            c.e_preln.to_string(),
            "importing the final norm is not implemented yet (e_preln = 0)",
        );
    }
    if c.p_dropemb != 0.0 {
        return unsupported(
            "p_dropemb",
            c.p_dropemb.to_string(),
            "embedding dropout is not implemented (p_dropemb = 0)",
        );
    }
    let cache_grad = match c.grad_thru_cache {
        0 => CacheGrad::None,
        1 => CacheGrad::Full,
        other => return unsupported("grad_thru_cache", other.to_string(), "must be 0 or 1"),
    };
    let cfg = TransformerVqConfig::new(c.n_vocab)
        .with_d_model(c.d_model)
        .with_d_k(c.d_k)
        .with_d_v(c.d_v)
        .with_n_code(c.n_code)
        .with_n_head(c.n_head)
        .with_n_layer(c.n_layer)
        .with_block_len(c.block_len)
        .with_bias(RelativeBias::Xl)
        .with_cache_grad(cache_grad)
        .with_final_norm(false)
        .with_tie_embeddings(c.e_tie != 0)
        .with_logit_scale(c.e_scale)
        .with_dropout_residual(c.p_dropres)
        .with_dropout_layer(c.p_droplyr)
        .with_dropout_sinusoid(c.p_dropsin)
        .with_sinusoid_base(c.pe_lam);
    cfg.validate()?;
    Ok(cfg)
}

/// Visits every parameter of a model under its official name.
pub trait OfficialVisitor<B: Backend> {
    /// `param` is the tvq parameter; `shape` its official shape (same element
    /// order); `trainable` is false for the EMA codebook.
    fn visit<const D: usize>(
        &mut self,
        name: &str,
        param: &mut Param<Tensor<B, D>>,
        shape: &[usize],
        trainable: bool,
    );
}

/// Walks `model` in the official naming (the table in the module docs).
/// Requires the XL bias; other parameters of a Toeplitz model have no official name.
pub fn visit_official<B: VqBackend, V: OfficialVisitor<B>>(
    model: &mut TransformerVq<B>,
    v: &mut V,
) {
    let d = model.embedding.weight.dims()[1];
    let vocab = model.vocab_size();
    v.visit(
        "token_embedder/embs",
        &mut model.embedding.weight,
        &[vocab, d],
        true,
    );
    for (i, gau) in model.sublayers.iter_mut().enumerate() {
        let p = format!("transformer_layers_{}/scanned_attn{}", i / 2, i % 2 + 1);
        let (h, k, dv) = (gau.n_head, gau.d_k, gau.d_v);
        v.visit(
            &format!("{p}/input_ln/g"),
            &mut gau.input_norm.gain,
            &[d],
            true,
        );
        v.visit(
            &format!("{p}/input_ln/b"),
            &mut gau.input_norm.bias,
            &[d],
            true,
        );
        v.visit(
            &format!("{p}/q_proj/kernel"),
            &mut gau.q_proj.weight,
            &[d, h * k],
            true,
        );
        v.visit(
            &format!("{p}/kvg_proj/kernel"),
            &mut gau.kvg_proj.weight,
            &[d, h * (k + 2 * dv)],
            true,
        );
        v.visit(
            &format!("{p}/res_proj/kernel"),
            &mut gau.out_proj.weight,
            &[h * dv, d],
            true,
        );
        if let PositionTerm::xl(xl) = &mut gau.bias {
            v.visit(
                &format!("{p}/r_proj/kernel"),
                &mut xl.r_proj.weight,
                &[d, h * k],
                true,
            );
            v.visit(&format!("{p}/u"), &mut xl.u, &[h * k], true);
            v.visit(&format!("{p}/v"), &mut xl.w, &[h * k], true);
        }
        let s = gau.quantizer.n_code();
        v.visit(
            &format!("{p}/quantizer/c_sum"),
            &mut gau.quantizer.c_sum,
            &[h, s, k],
            false,
        );
        v.visit(
            &format!("{p}/quantizer/c_count"),
            &mut gau.quantizer.c_count,
            &[h, s],
            false,
        );
    }
    if let Some(out) = model.output.as_mut() {
        v.visit("out_proj/kernel", &mut out.weight, &[d, vocab], true);
        if let Some(bias) = out.bias.as_mut() {
            v.visit("out_proj/bias", bias, &[vocab], true);
        }
    }
    if let Some(bias) = model.output_bias.as_mut() {
        v.visit("token_embedder/bias_out", bias, &[vocab], true);
    }
}

struct Loader<'a, B: Backend> {
    tensors: &'a BTreeMap<String, OfficialTensor>,
    device: B::Device,
    error: Option<ImportError>,
}

impl<B: Backend> OfficialVisitor<B> for Loader<'_, B> {
    fn visit<const D: usize>(
        &mut self,
        name: &str,
        param: &mut Param<Tensor<B, D>>,
        shape: &[usize],
        trainable: bool,
    ) {
        if self.error.is_some() {
            return;
        }
        let Some(t) = self.tensors.get(name) else {
            self.error = Some(ImportError::Missing(name.to_string()));
            return;
        };
        if t.shape != shape {
            self.error = Some(ImportError::Shape {
                name: name.to_string(),
                got: t.shape.clone(),
                want: shape.to_vec(),
            });
            return;
        }
        let value =
            Tensor::<B, D>::from_data(TensorData::new(t.data.clone(), param.dims()), &self.device);
        *param = Param::initialized(param.id, value).set_require_grad(trainable);
    }
}

/// Builds a tvq model from an official config and its parameters (by
/// official name) on `device`. Tensors the model does not use are ignored.
pub fn import<B: VqBackend>(
    config: &OfficialConfig,
    tensors: &BTreeMap<String, OfficialTensor>,
    device: &B::Device,
) -> Result<(TransformerVqConfig, TransformerVq<B>), ImportError> {
    let cfg = config_from_official(config)?;
    let mut model = cfg.init::<B>(device)?;
    let mut loader = Loader {
        tensors,
        device: device.clone(),
        error: None,
    };
    visit_official(&mut model, &mut loader);
    match loader.error {
        Some(e) => Err(e),
        None => Ok((cfg, model)),
    }
}

/// Every parameter's value under its official name and shape (the inverse of [`import`]).
pub fn export<B: VqBackend>(model: &TransformerVq<B>) -> BTreeMap<String, OfficialTensor> {
    struct Reader(BTreeMap<String, OfficialTensor>);
    impl<B: Backend> OfficialVisitor<B> for Reader {
        fn visit<const D: usize>(
            &mut self,
            name: &str,
            param: &mut Param<Tensor<B, D>>,
            shape: &[usize],
            _: bool,
        ) {
            let data = param
                .val()
                .into_data()
                .convert::<f32>()
                .to_vec()
                .expect("f32 data");
            self.0.insert(
                name.to_string(),
                OfficialTensor {
                    shape: shape.to_vec(),
                    data,
                },
            );
        }
    }
    let mut reader = Reader(BTreeMap::new());
    visit_official(&mut model.clone(), &mut reader);
    reader.0
}
