//! The Transformer-VQ language model: embedding, `N` layers of two GAU
//! sublayers, optional final norm, output projection.

use std::ops::Range;

use burn::module::{Module, ModuleVisitor, Param};
use burn::nn::{Embedding, EmbeddingConfig, Initializer, Linear, LinearConfig};
use burn::prelude::*;

use crate::attention::{AttentionGroups, AttentionState};
use crate::config::TransformerVqConfig;
use crate::dropout::{self, DropoutMasks, SublayerMasks};
use crate::error::{ConfigError, ModelError};
use crate::gau::Gau;
use crate::norm::RmsNorm;
use crate::pass::{Graph, Pass, PassOutput, Recomputable};
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

/// What one sublayer ([`TransformerVq::sublayer_forward`]) returns.
#[derive(Debug)]
pub struct SublayerOutput<B: Backend> {
    /// Hidden states after the sublayer (its branch added to the residual
    /// stream), `[B, T, D]`.
    pub h: Tensor<B, 3>,
    /// Commitment error per token, summed over heads, `[B, T]`.
    pub commitment: Tensor<B, 2>,
    /// Code statistics (`None` for the quadratic form).
    pub stats: Option<CodebookStats<B>>,
    /// Codes of the keys, `[B, H, T]` (`None` for the quadratic form).
    pub codes: Option<Tensor<B, 3, Int>>,
    /// Where the attention went, when asked for.
    pub groups: Option<AttentionGroups<B>>,
    /// The sublayer's state after the segment (detached).
    pub state: AttentionState<B>,
}

/// What the model returns for one segment.
#[derive(Debug)]
pub struct ModelOutput<B: Backend> {
    /// Logits, `[B, T, vocab]`.
    pub logits: Tensor<B, 3>,
    /// Commitment error per token, summed over sublayers and heads, `[B, T]`.
    pub commitment: Tensor<B, 2>,
    /// Code statistics per sublayer (empty for the quadratic form).
    pub stats: Vec<CodebookStats<B>>,
    /// Codes of the keys per sublayer, `[B, H, T]` (empty for the quadratic form).
    pub codes: Vec<Tensor<B, 3, Int>>,
    /// Where the attention went, per sublayer: empty unless asked for
    /// ([`TransformerVq::forward_with_attention_groups`]; and for the
    /// quadratic form).
    pub attention: Vec<AttentionGroups<B>>,
    /// State after the segment (detached).
    pub state: ModelState<B>,
}

/// Building a model from its config lives here, beside the model (as in
/// burn's examples), so that the config knows nothing of the network.
impl TransformerVqConfig {
    /// Validates the config and builds the model with freshly initialised
    /// parameters (the spec's initialisation) on `device`. Every parameter
    /// is drawn here, in a fixed order, so seeding the device's RNG before
    /// this call determines the weights.
    pub fn init<B: Backend>(&self, device: &B::Device) -> Result<TransformerVq<B>, ConfigError> {
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

impl<B: Backend> TransformerVq<B> {
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
        self.dropout_masks_on(shape, &self.embedding.weight.device())
    }

    /// [`Self::dropout_masks`] drawn with `device`'s generator (on
    /// `device`): the trainer draws them on the CPU whatever the model's
    /// device, so that a run's masks depend on its seed only, then moves
    /// them ([`DropoutMasks::to_device`]).
    pub fn dropout_masks_on(&self, shape: [usize; 2], device: &B::Device) -> DropoutMasks<B> {
        DropoutMasks {
            sublayers: self
                .sublayers
                .iter()
                .map(|g| g.dropout_masks(self.layer_drop, shape, device))
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

    fn check_state(&self, state: &ModelState<B>) -> Result<(), ModelError> {
        if state.sublayers.len() != self.sublayers.len() {
            return Err(ModelError::StateMismatch(format!(
                "{} sublayer states for {} sublayers",
                state.sublayers.len(),
                self.sublayers.len()
            )));
        }
        Ok(())
    }

    /// The logits `[B, T, vocab]` of final hidden states `h` `[B, T, D]`
    /// (final norm and output projection, in `f32`).
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

    /// Block-parallel forward over a segment `tokens` `[B, T]` (`T` a multiple
    /// of `L`) from `state`. `valid` `[B, T]` marks real tokens (padding is
    /// excluded from the codebook statistics). The returned state is detached:
    /// no gradient crosses a segment boundary. Dropout masks are drawn as
    /// the pass begins ([`Self::forward_with_masks`] takes them drawn).
    pub fn forward(
        &self,
        tokens: Tensor<B, 2, Int>,
        state: ModelState<B>,
        valid: Option<Tensor<B, 2, Bool>>,
    ) -> Result<ModelOutput<B>, ModelError> {
        let masks = self.dropout_masks(tokens.dims());
        self.forward_with_masks(tokens, state, valid, masks)
    }

    /// [`Self::forward`] that also reports where each sublayer's attention
    /// went ([`ModelOutput::attention`]): a diagnostic, at the cost of a
    /// second pass over the attention scores.
    pub fn forward_with_attention_groups(
        &self,
        tokens: Tensor<B, 2, Int>,
        state: ModelState<B>,
        valid: Option<Tensor<B, 2, Bool>>,
    ) -> Result<ModelOutput<B>, ModelError> {
        let masks = self.dropout_masks(tokens.dims());
        let pass = Pass {
            with_groups: true,
            ..Pass::new(masks.sublayers, valid)
        };
        self.forward_pass(tokens, state, pass)
    }

    /// [`Self::forward`] with dropout masks drawn beforehand by
    /// [`Self::dropout_masks`] for the same `[B, T]`.
    pub fn forward_with_masks(
        &self,
        tokens: Tensor<B, 2, Int>,
        state: ModelState<B>,
        valid: Option<Tensor<B, 2, Bool>>,
        masks: DropoutMasks<B>,
    ) -> Result<ModelOutput<B>, ModelError> {
        self.forward_pass(tokens, state, Pass::new(masks.sublayers, valid))
    }

    /// The block-parallel forward of a segment `tokens` `[B, T]` from
    /// `state`, returning only the last position's logits `[B, 1, vocab]`
    /// and the state: what reading a prompt needs, without the output
    /// head's `T x vocab` product for the positions before the last (most
    /// of the work for a small model with a large vocabulary). The same as
    /// [`Self::embed`], [`Self::forward_sublayers`] over every sublayer and
    /// [`Self::head_last`], the pieces a caller may run apart (a pipeline
    /// over threads, each owning some sublayers).
    pub fn forward_last(
        &self,
        tokens: Tensor<B, 2, Int>,
        state: ModelState<B>,
    ) -> Result<(Tensor<B, 3>, ModelState<B>), ModelError> {
        let h = self.embed(tokens)?;
        let (h, sublayers) = self.forward_sublayers(0..self.sublayers.len(), h, state.sublayers)?;
        Ok((self.head_last(h), ModelState { sublayers }))
    }

    /// The input of the first sublayer: the embeddings `[B, T, D]` of
    /// `tokens` `[B, T]`.
    pub fn embed(&self, tokens: Tensor<B, 2, Int>) -> Result<Tensor<B, 3>, ModelError> {
        let [b, t] = tokens.dims();
        if b == 0 || t == 0 {
            return Err(ModelError::EmptyInput { rows: b, len: t });
        }
        Ok(self.embedding.forward(tokens))
    }

    /// The block-parallel form of the sublayers `range` only, over hidden
    /// states `h` `[B, T, D]` (`T` a multiple of `L`) from their `states`
    /// (one per sublayer of `range`): the hidden states after the last of
    /// them and their detached states. For reading, not training: no code
    /// statistics or commitment come back.
    pub fn forward_sublayers(
        &self,
        range: std::ops::Range<usize>,
        h: Tensor<B, 3>,
        states: Vec<AttentionState<B>>,
    ) -> Result<(Tensor<B, 3>, Vec<AttentionState<B>>), ModelError> {
        let [b, t, _] = h.dims();
        let device = self.embedding.weight.device();
        let masks = match self.sublayers.get(range.clone()) {
            Some(gaus) => gaus
                .iter()
                .map(|g| g.dropout_masks(self.layer_drop, [b, t], &device))
                .collect(),
            None => vec![], // refused by the pass's check
        };
        let out = self.run_sublayers(range, h, states, Pass::new(masks, None))?;
        Ok((out.h, out.states))
    }

    /// The block-parallel form of sublayers `range` over hidden states `h`
    /// `[B, T, D]` (`T` a multiple of `L`) from their `states` (one per
    /// sublayer of `range`), as `pass` describes: the one loop over the
    /// sublayers.
    pub fn run_sublayers(
        &self,
        range: Range<usize>,
        mut h: Tensor<B, 3>,
        states: Vec<AttentionState<B>>,
        pass: Pass<B>,
    ) -> Result<PassOutput<B>, ModelError> {
        let [b, t, _] = h.dims();
        pass.check(&range, &states, self.sublayers.len(), [b, t])?;
        let n = range.len();
        // Without a graph: the same parameters, none asking for a gradient,
        // on an input that brings none into the pass.
        let frozen = (pass.graph == Graph::LastSublayer).then(|| {
            h = h.clone().detach();
            self.clone().no_grad()
        });
        let mut commitment = Tensor::zeros([b, t], &h.device());
        let mut out = PassOutput {
            h: h.clone(),
            commitment: commitment.clone(),
            stats: Vec::with_capacity(n),
            codes: Vec::with_capacity(n),
            attention: vec![],
            states: Vec::with_capacity(n),
            recomputable: None,
        };
        let mut inputs = Vec::with_capacity(n);
        let last = range.end.saturating_sub(1);
        for ((i, s), m) in range.zip(states).zip(pass.masks) {
            let (valid, groups) = (pass.valid.clone(), pass.with_groups);
            let sublayer = match &frozen {
                Some(frozen) if i < last => {
                    inputs.push(h.clone());
                    frozen.sublayer_forward(i, h, s, valid, m, groups)?
                }
                Some(_) => {
                    let x = h.require_grad();
                    let sublayer = self.sublayer_forward(i, x.clone(), s, valid, m, groups)?;
                    out.recomputable = Some(Recomputable {
                        inputs: std::mem::take(&mut inputs),
                        last_input: x,
                        last_commitment: sublayer.commitment.clone(),
                    });
                    sublayer
                }
                None => self.sublayer_forward(i, h, s, valid, m, groups)?,
            };
            h = sublayer.h;
            commitment = match pass.graph {
                Graph::Whole => commitment + sublayer.commitment,
                Graph::LastSublayer => commitment + sublayer.commitment.detach(),
            };
            out.stats.extend(sublayer.stats);
            out.codes.extend(sublayer.codes);
            out.attention.extend(sublayer.groups);
            out.states.push(sublayer.state);
        }
        out.h = h;
        out.commitment = commitment;
        Ok(out)
    }

    /// The logits `[B, 1, vocab]` of the last position of the final hidden
    /// states `h` `[B, T, D]`.
    pub fn head_last(&self, h: Tensor<B, 3>) -> Tensor<B, 3> {
        let [b, t, d] = h.dims();
        self.head(h.slice([0..b, t - 1..t, 0..d]))
    }

    /// Sublayer `i`'s block-parallel forward over hidden states `h`
    /// `[B, T, D]` from its `state`, with its dropout masks `masks` (layer
    /// drop included): one step of [`Self::forward`], for a caller that
    /// runs the sublayers one at a time (per-sublayer recomputation in
    /// training keeps only each sublayer's input).
    pub fn sublayer_forward(
        &self,
        i: usize,
        h: Tensor<B, 3>,
        state: AttentionState<B>,
        valid: Option<Tensor<B, 2, Bool>>,
        mut masks: SublayerMasks<B>,
        with_groups: bool,
    ) -> Result<SublayerOutput<B>, ModelError> {
        let gau = self.sublayers.get(i).ok_or_else(|| {
            ModelError::StateMismatch(format!(
                "sublayer {i} of a model with {}",
                self.sublayers.len()
            ))
        })?;
        let out = gau.forward(h.clone(), state, valid, &mut masks, with_groups)?;
        Ok(SublayerOutput {
            // Layer drop: a row keeps or skips the whole sublayer.
            h: h + dropout::apply(out.out, masks.layer),
            commitment: out.commitment,
            stats: out.stats,
            codes: out.codes,
            groups: out.groups,
            state: out.state.detach(),
        })
    }

    /// The embedding, the sublayers as `pass` says, then the logits of
    /// every position.
    pub fn forward_pass(
        &self,
        tokens: Tensor<B, 2, Int>,
        state: ModelState<B>,
        pass: Pass<B>,
    ) -> Result<ModelOutput<B>, ModelError> {
        self.check_state(&state)?;
        let h = self.embed(tokens)?; // [B, T, D]
        let out = self.run_sublayers(0..self.sublayers.len(), h, state.sublayers, pass)?;
        Ok(ModelOutput {
            logits: self.head(out.h),
            commitment: out.commitment,
            stats: out.stats,
            codes: out.codes,
            attention: out.attention,
            state: ModelState {
                sublayers: out.states,
            },
        })
    }

    /// Recurrent forward of one token per row, `token` `[B, 1]`: constant work
    /// and memory whatever the position. Returns logits `[B, 1, vocab]`.
    pub fn step(
        &self,
        token: Tensor<B, 2, Int>,
        state: ModelState<B>,
    ) -> Result<(Tensor<B, 3>, ModelState<B>), ModelError> {
        self.check_state(&state)?;
        let [rows, len] = token.dims();
        if rows == 0 || len == 0 {
            return Err(ModelError::EmptyInput { rows, len });
        }
        let masks = self.dropout_masks(token.dims());
        let mut h = self.embedding.forward(token);
        let mut states = Vec::with_capacity(self.sublayers.len());
        let layers = self.sublayers.iter().zip(state.sublayers);
        for ((gau, s), mut m) in layers.zip(masks.sublayers) {
            let (out, s) = gau.step(h.clone(), s, &mut m)?;
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
}
