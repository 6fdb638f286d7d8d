//! The Transformer-VQ language model: embedding, `N` layers of two GAU
//! sublayers, optional final norm, output projection.

use burn::module::{Module, ModuleVisitor, Param};
use burn::nn::{Embedding, EmbeddingConfig, Initializer, Linear, LinearConfig};
use burn::prelude::*;

use crate::attention::{AttentionGroups, AttentionState};
use crate::config::TransformerVqConfig;
use crate::dropout::{self, DropoutMasks, SublayerMasks};
use crate::error::{ConfigError, ModelError};
use crate::gau::{Gau, GauOutput};
use crate::kernel::{Kernels, VqBackend};
use crate::norm::RmsNorm;
use crate::pass::{Graph, Logits, Pass, PassInput, Recomputable};
use crate::precision::Precision;
use crate::quantizer::CodebookStats;

/// The Transformer-VQ language model. Build it with [`TransformerVqConfig::init`].
#[derive(Module, Debug)]
pub struct TransformerVq<B: Backend> {
    /// Token embedding `E`, `[vocab, D]`, init `N(0, 1)`.
    pub embedding: Embedding<B>,
    /// GAU sublayers in order: layer `n` holds sublayers `2n` and `2n + 1`.
    pub sublayers: Vec<Gau<B>>,
    /// Final RMS norm (when `final_norm`).
    pub final_norm: Option<RmsNorm<B>>,
    /// Untied output projection with bias, `[D, vocab]` (when not tied).
    pub output: Option<Linear<B>>,
    /// Output bias of the tied head, `[vocab]` (when tied).
    pub output_bias: Option<Param<Tensor<B, 1>>>,
    /// Multiplier on the logits.
    pub logit_scale: f64,
    /// Probability of dropping a sublayer for a batch row in training.
    pub layer_drop: f64,
}

/// State of every sublayer, carried between segments of one stream.
#[derive(Clone, Debug)]
pub struct ModelState<B: Backend> {
    /// One state per GAU sublayer.
    pub sublayers: Vec<AttentionState<B>>,
}

impl<B: Backend> ModelState<B> {
    /// The state of a fresh stream: nothing to attend.
    pub fn new(n_sublayers: usize) -> Self {
        Self {
            sublayers: (0..n_sublayers)
                .map(|_| AttentionState::default())
                .collect(),
        }
    }

    /// Tokens seen so far.
    pub fn pos(&self) -> usize {
        self.sublayers.first().map_or(0, |s| s.pos)
    }

    /// A state of one row repeated `n` times: `n` streams that have read the
    /// same tokens (to generate several continuations of one prompt).
    pub fn repeat_rows(self, n: usize) -> Self {
        Self {
            sublayers: self
                .sublayers
                .into_iter()
                .map(|s| s.repeat_rows(n))
                .collect(),
        }
    }

    /// The same state cut from the autodiff graph.
    pub fn detach(self) -> Self {
        Self {
            sublayers: self
                .sublayers
                .into_iter()
                .map(AttentionState::detach)
                .collect(),
        }
    }

    /// The same state on `device`.
    pub fn into_device(self, device: &B::Device) -> Self {
        Self {
            sublayers: self
                .sublayers
                .into_iter()
                .map(|s| s.into_device(device))
                .collect(),
        }
    }
}

/// What a forward pass returns: [`crate::GauOutput`]'s fields gathered
/// over the pass's sublayers, the hidden states and logits after them.
#[derive(Debug)]
pub struct ModelOutput<B: Backend> {
    /// Hidden states after the pass's last sublayer, before the final norm,
    /// `[B, T, D]`.
    pub h: Tensor<B, 3>,
    /// Logits as the pass asked ([`Logits`]): `[B, T, vocab]`,
    /// `[B, 1, vocab]`, or `None`.
    pub logits: Option<Tensor<B, 3>>,
    /// Commitment error per token, summed over the sublayers and heads,
    /// `[B, T]` (detached under [`Graph::LastSublayer`]).
    pub commitment: Tensor<B, 2>,
    /// Code statistics per sublayer (empty for the quadratic form).
    pub stats: Vec<CodebookStats<B>>,
    /// Codes of the keys per sublayer, `[B, H, T]` (empty for the quadratic form).
    pub codes: Vec<Tensor<B, 3, Int>>,
    /// Where the attention went, per sublayer: empty unless the pass asked
    /// ([`Pass::with_attention`]; and for the quadratic form).
    pub attention: Vec<AttentionGroups<B>>,
    /// State of the pass's sublayers after the segment (detached).
    pub state: ModelState<B>,
    /// Under [`Graph::LastSublayer`], what the backward pass recomputes from.
    pub recomputable: Option<Recomputable<B>>,
    /// The kernels the pass ran under ([`TransformerVq::kernels`]): the
    /// loss takes the same.
    pub kernels: Kernels,
}

/// Building a model from its config lives here, beside the model (as in
/// burn's examples), so that the config knows nothing of the network.
impl TransformerVqConfig {
    /// Validates the config and builds the model with freshly initialised
    /// parameters (the spec's initialisation) on `device`. Every parameter
    /// is drawn here, in a fixed order, so seeding the device's RNG before
    /// this call determines the weights.
    pub fn init<B: VqBackend>(&self, device: &B::Device) -> Result<TransformerVq<B>, ConfigError> {
        self.validate()?;
        let model = TransformerVq::new(self, device);
        // burn draws parameters lazily, at first use; draw them now instead.
        struct Materialize;
        impl<B: Backend> ModuleVisitor<B> for Materialize {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
                let _ = param.val();
            }
        }
        model.visit(&mut Materialize);
        Ok(model)
    }
}

impl<B: VqBackend> TransformerVq<B> {
    pub(crate) fn new(cfg: &TransformerVqConfig, device: &B::Device) -> Self {
        let d = cfg.d_model;
        let tied = cfg.tie_embeddings;
        Self {
            embedding: EmbeddingConfig::new(cfg.vocab_size, d)
                .with_initializer(Initializer::Normal {
                    mean: 0.0,
                    std: 1.0,
                })
                .init(device),
            sublayers: (0..cfg.n_sublayers())
                .map(|_| Gau::new(cfg, device))
                .collect(),
            final_norm: cfg.final_norm.then(|| RmsNorm::new(d, device)),
            output: (!tied).then(|| {
                let mut lin = LinearConfig::new(d, cfg.vocab_size)
                    .with_initializer(Initializer::Normal {
                        mean: 0.0,
                        std: (d as f64).powf(-0.5),
                    })
                    .init(device);
                lin.bias = Some(Param::from_tensor(Tensor::zeros([cfg.vocab_size], device)));
                lin
            }),
            output_bias: tied.then(|| Param::from_tensor(Tensor::zeros([cfg.vocab_size], device))),
            logit_scale: cfg.logit_scale,
            layer_drop: cfg.dropout_layer,
        }
    }

    /// A fresh state for this model.
    pub fn empty_state(&self) -> ModelState<B> {
        ModelState::new(self.sublayers.len())
    }

    /// The forward pass, block-parallel, of a segment (`T` a multiple of
    /// `L`) from the carried `state`, as `pass` describes ([`Pass`]): the
    /// embedding of the tokens, the sublayers, then the logits. The returned
    /// state is detached: no gradient crosses a segment boundary.
    ///
    /// `input` is token ids `[B, T]`, or hidden states `[B, T, D]` for a
    /// pass that starts at a later sublayer ([`Pass::with_sublayers`]);
    /// `state` holds one entry per sublayer of the pass.
    pub fn forward(
        &self,
        input: impl Into<PassInput<B>>,
        state: ModelState<B>,
        pass: Pass<B>,
    ) -> Result<ModelOutput<B>, ModelError> {
        let n = self.sublayers.len();
        let range = pass.sublayers.clone().unwrap_or(0..n);
        let mut h = match input.into() {
            PassInput::Tokens(tokens) => {
                let [b, t] = tokens.dims();
                if b == 0 || t == 0 {
                    return Err(ModelError::EmptyInput { rows: b, len: t });
                }
                if range.start != 0 {
                    return Err(ModelError::StateMismatch(format!(
                        "tokens are the input of sublayer 0, not of sublayer {}",
                        range.start
                    )));
                }
                self.embedding.forward(tokens) // [B, T, D]
            }
            PassInput::Hidden(h) => h,
        };
        let [b, t, _] = h.dims();
        let masks = match pass.masks {
            Some(masks) => masks.sublayers,
            None => match self.sublayers.get(range.clone()) {
                Some(gaus) => {
                    let device = self.embedding.weight.device();
                    gaus.iter()
                        .map(|g| g.dropout_masks::<B>(self.layer_drop, [b, t], &device))
                        .collect()
                }
                None => vec![], // refused by the check
            },
        };
        Pass::check(&range, &state.sublayers, &masks, n, [b, t])?;
        let last = range.end.saturating_sub(1);
        // Without a graph: the same parameters, none asking for a gradient,
        // on an input that brings none into the pass.
        let frozen = (pass.graph == Graph::LastSublayer).then(|| {
            h = h.clone().detach();
            self.clone().no_grad()
        });
        // The sublayers' commitment summed, [B, T]; no fill to start from.
        let mut commitment: Option<Tensor<B, 2>> = None;
        let (mut stats, mut codes, mut attention) = (vec![], vec![], vec![]);
        let mut states = Vec::with_capacity(range.len());
        let (mut inputs, mut recomputable) = (vec![], None);
        for ((i, s), m) in range.zip(state.sublayers).zip(masks) {
            let valid = pass.valid.clone();
            let with_attention = pass.with_attention;
            let (next, sublayer) = match &frozen {
                Some(frozen) if i < last => {
                    inputs.push(h.clone());
                    frozen.sublayer(i, h, s, valid, m, with_attention)?
                }
                Some(_) => {
                    let x = h.require_grad();
                    let (next, sublayer) =
                        self.sublayer(i, x.clone(), s, valid, m, with_attention)?;
                    recomputable = Some(Recomputable {
                        inputs: std::mem::take(&mut inputs),
                        last_input: x,
                        last_commitment: sublayer.commitment.clone(),
                    });
                    (next, sublayer)
                }
                None => self.sublayer(i, h, s, valid, m, with_attention)?,
            };
            h = next;
            let term = match pass.graph {
                Graph::Whole => sublayer.commitment,
                Graph::LastSublayer => sublayer.commitment.detach(),
            };
            commitment = Some(match commitment {
                Some(sum) => sum + term,
                None => term,
            });
            stats.extend(sublayer.stats);
            codes.extend(sublayer.codes);
            attention.extend(sublayer.attention);
            states.push(sublayer.state.detach());
        }
        let logits = match pass.logits {
            Logits::All => Some(self.head(h.clone())),
            Logits::Last => {
                let d = h.dims()[2];
                Some(self.head(h.clone().slice([0..b, t - 1..t, 0..d])))
            }
            Logits::None => None,
        };
        let commitment = commitment.unwrap_or_else(|| Tensor::zeros([b, t], &h.device()));
        Ok(ModelOutput {
            h,
            logits,
            commitment,
            stats,
            codes,
            attention,
            state: ModelState { sublayers: states },
            recomputable,
            kernels: self.kernels(),
        })
    }

    /// Sublayer `i` over hidden states `h` `[B, T, D]` from its `state`,
    /// with its dropout `masks` (layer drop included): the hidden states
    /// after it (its branch added to the residual stream) and what it
    /// returned.
    fn sublayer(
        &self,
        i: usize,
        h: Tensor<B, 3>,
        state: AttentionState<B>,
        valid: Option<Tensor<B, 2, Bool>>,
        mut masks: SublayerMasks<B>,
        with_attention: bool,
    ) -> Result<(Tensor<B, 3>, GauOutput<B>), ModelError> {
        let out = self.sublayers[i].forward(h.clone(), state, valid, &mut masks, with_attention)?;
        // Layer drop: a row keeps or skips the whole sublayer.
        let h = h + dropout::apply(out.out.clone(), masks.layer);
        Ok((h, out))
    }

    /// The logits `[B, T, vocab]` of final hidden states `h` `[B, T, D]`
    /// (final norm and output projection, in `f32`): the end of both
    /// [`Self::forward`] and [`Self::decode`].
    pub fn head(&self, h: Tensor<B, 3>) -> Tensor<B, 3> {
        let h = match &self.final_norm {
            Some(norm) => norm.forward(h),
            None => h,
        };
        let logits = match (&self.output, &self.output_bias) {
            (Some(out), _) => out.forward(h),
            (None, Some(bias)) => {
                let e = self
                    .embedding
                    .weight
                    .val()
                    .transpose()
                    .unsqueeze_dim::<3>(0); // [1, D, vocab]
                h.matmul(e) + bias.val().unsqueeze::<3>()
            }
            (None, None) => unreachable!("the output head is either untied or tied"),
        };
        logits * self.logit_scale
    }

    /// Decodes one token per row, `token` `[B, 1]`, with the recurrent
    /// form: constant work and memory whatever the position. Returns the
    /// logits `[B, 1, vocab]` of the next token and the state after it.
    pub fn decode(
        &self,
        token: Tensor<B, 2, Int>,
        state: ModelState<B>,
    ) -> Result<(Tensor<B, 3>, ModelState<B>), ModelError> {
        if state.sublayers.len() != self.sublayers.len() {
            return Err(ModelError::StateMismatch(format!(
                "{} sublayer states for {} sublayers",
                state.sublayers.len(),
                self.sublayers.len()
            )));
        }
        let [rows, len] = token.dims();
        if rows == 0 || len == 0 {
            return Err(ModelError::EmptyInput { rows, len });
        }
        let masks = self.dropout_masks(token.dims());
        let mut h = self.embedding.forward(token);
        let mut states = Vec::with_capacity(self.sublayers.len());
        let layers = self.sublayers.iter().zip(state.sublayers);
        for ((gau, s), mut m) in layers.zip(masks.sublayers) {
            let (out, s) = gau.decode(h.clone(), s, &mut m)?;
            h = h + dropout::apply(out, m.layer);
            states.push(s.detach());
        }
        Ok((self.head(h), ModelState { sublayers: states }))
    }

    /// Returns the model with every sublayer's codebook moved one EMA step
    /// (`gamma`, 0.99 in the recipe) towards the step's statistics, one entry
    /// of `stats` per sublayer. Empty `stats` (the quadratic form, which
    /// quantizes nothing) leave the model as it is.
    pub fn update_codebooks(mut self, stats: &[CodebookStats<B>], gamma: f64) -> Self {
        if stats.is_empty() {
            return self;
        }
        assert_eq!(
            stats.len(),
            self.sublayers.len(),
            "one statistics entry per sublayer"
        );
        self.sublayers = self
            .sublayers
            .into_iter()
            .zip(stats)
            .map(|(mut gau, s)| {
                gau.quantizer = gau.quantizer.ema_update(s, gamma);
                gau
            })
            .collect();
        self
    }

    /// Whether a training-mode forward pass draws random numbers (any
    /// dropout active). Concurrent passes must seed the generator and draw
    /// their masks ([`Self::dropout_masks`]) one at a time to be
    /// reproducible: the backends draw from one global generator.
    pub fn uses_dropout(&self) -> bool {
        self.sublayers.iter().any(|g| {
            let p = g.dropout_probs(self.layer_drop);
            p.sinusoid > 0.0 || p.residual > 0.0 || p.layer > 0.0
        })
    }

    /// Draws every dropout mask of a forward pass over `[batch, len]` tokens,
    /// sublayer by sublayer. Outside training (a model without autodiff)
    /// nothing is drawn and nothing dropped.
    pub fn dropout_masks(&self, shape: [usize; 2]) -> DropoutMasks<B> {
        // The parameters' device says whether this is a training model (the
        // token tensors' does not: integer tensors carry no autodiff).
        self.dropout_masks_on::<B>(shape, &self.embedding.weight.device())
    }

    /// [`Self::dropout_masks`] drawn with `device`'s generator (on
    /// `device`, of any backend `D`): the trainer draws them on the CPU
    /// whatever the model's device, so that a run's masks depend on its
    /// seed only, then moves them ([`DropoutMasks::to_device`],
    /// [`DropoutMasks::onto`]).
    pub fn dropout_masks_on<D: Backend>(
        &self,
        shape: [usize; 2],
        device: &D::Device,
    ) -> DropoutMasks<D> {
        DropoutMasks {
            sublayers: self
                .sublayers
                .iter()
                .map(|g| g.dropout_masks::<D>(self.layer_drop, shape, device))
                .collect(),
        }
    }

    /// Block length `L`.
    pub fn block_len(&self) -> usize {
        self.sublayers[0].block_len
    }

    /// Vocabulary size.
    pub fn vocab_size(&self) -> usize {
        self.embedding.weight.dims()[0]
    }

    /// Sets the type of every sublayer's matrix products in the
    /// block-parallel form ([`Precision`]; parameters, statistics and the
    /// residual stream stay `f32`). Not a weight: a loaded model computes in
    /// `f32` until set.
    pub fn set_precision(&mut self, precision: Precision) {
        for g in &mut self.sublayers {
            g.compute.precision = precision;
        }
    }

    /// Sets whether every sublayer's attention may run as the backend's
    /// fused kernel ([`Kernels`]); composed ops are the oracle the kernels
    /// are tested against. Not a weight.
    pub fn set_kernels(&mut self, kernels: Kernels) {
        for g in &mut self.sublayers {
            g.compute.kernels = kernels;
        }
    }

    /// Whether the sublayers run the backend's fused kernels
    /// ([`Self::set_kernels`]).
    pub fn kernels(&self) -> Kernels {
        self.sublayers
            .first()
            .map_or(Kernels::default(), |g| g.compute.kernels)
    }

    /// The type of the sublayers' matrix products ([`Self::set_precision`]).
    pub fn precision(&self) -> Precision {
        self.sublayers
            .first()
            .map_or(Precision::F32, |g| g.compute.precision)
    }

    /// Sets every sublayer's cache limit
    /// ([`crate::TransformerVqConfig::cache_limit`]), e.g. to read a stream
    /// far longer than the training sequences with a model trained without
    /// one. It is not a weight: the model computes as if configured so.
    pub fn set_cache_limit(&mut self, limit: Option<usize>) {
        for g in &mut self.sublayers {
            g.compute.cache_limit = limit;
        }
    }

    /// Sets every sublayer's code limit
    /// ([`crate::TransformerVqConfig::code_limit`]), e.g. to read examples
    /// far longer than the training ones with a model trained without one.
    /// It is not a weight: the model computes as if configured so.
    pub fn set_code_limit(&mut self, limit: Option<usize>) {
        for g in &mut self.sublayers {
            g.compute.code_limit = limit;
        }
    }
}
