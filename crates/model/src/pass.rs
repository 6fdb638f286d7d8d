//! The description of a forward pass: [`TransformerVq::forward`]'s third
//! argument.
//!
//! Training, evaluation, reading a prompt (a whole model or a pipeline
//! stage's sublayers) and the forward pass of full activation
//! checkpointing all run the model's one forward pass; they differ only in
//! the [`Pass`] they give it: its input ([`PassInput`]), which sublayers,
//! which tokens count, which dropout masks, whether to report where the
//! attention went, what to keep of the autodiff graph ([`Graph`]) and which
//! logits to compute ([`Logits`]). The pass checks the carried state and
//! the masks against the model and the input on every path.
//!
//! ```
//! # use burn::backend::flex::{Flex, FlexDevice};
//! # use burn::prelude::*;
//! use tvq_model::{Logits, Pass, TransformerVqConfig};
//! let device = FlexDevice;
//! let model = TransformerVqConfig::new(256)
//!     .with_d_model(16).with_d_k(8).with_d_v(16).with_n_code(4).with_block_len(4)
//!     .init::<Flex>(&device)?;
//! let tokens = Tensor::<Flex, 2, Int>::zeros([2, 8], &device); // [B, T]
//! // Every position's logits, as training and evaluation want them.
//! let out = model.forward(tokens.clone(), model.empty_state(), Pass::new())?;
//! assert_eq!(out.logits.unwrap().dims(), [2, 8, 256]);
//! // Only the last position's, with where the attention went.
//! let pass = Pass::new().with_logits(Logits::Last).with_attention(true);
//! let out = model.forward(tokens, model.empty_state(), pass)?;
//! assert_eq!(out.logits.unwrap().dims(), [2, 1, 256]);
//! assert_eq!(out.attention.len(), 4); // one per sublayer
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! [`TransformerVq::forward`]: crate::TransformerVq::forward

use std::ops::Range;

use burn::prelude::*;

use crate::attention::AttentionState;
use crate::dropout::{DropoutMasks, SublayerMasks};
use crate::error::ModelError;

/// What a pass reads: token ids, or the hidden states a pipeline stage
/// receives from the stage before it.
#[derive(Clone, Debug)]
pub enum PassInput<B: Backend> {
    /// Token ids `[B, T]`, embedded before the first sublayer (the pass
    /// then starts at sublayer 0).
    Tokens(Tensor<B, 2, Int>),
    /// Hidden states `[B, T, D]`: the input of the pass's first sublayer.
    Hidden(Tensor<B, 3>),
}

impl<B: Backend> From<Tensor<B, 2, Int>> for PassInput<B> {
    fn from(tokens: Tensor<B, 2, Int>) -> Self {
        Self::Tokens(tokens)
    }
}

impl<B: Backend> From<Tensor<B, 3>> for PassInput<B> {
    fn from(h: Tensor<B, 3>) -> Self {
        Self::Hidden(h)
    }
}

/// What a pass keeps of the autodiff graph.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Graph {
    /// Every sublayer's (training without recomputation; a model without
    /// autodiff records none anyway).
    #[default]
    Whole,
    /// Only the last sublayer's, from its input made a leaf; the other
    /// sublayers run without a graph and keep their inputs
    /// ([`Recomputable`]), to run again one at a time in the backward pass
    /// (full activation checkpointing).
    LastSublayer,
}

/// Which logits a pass computes after its last sublayer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Logits {
    /// Every position's, `[B, T, vocab]` (training, evaluation).
    #[default]
    All,
    /// The last position's only, `[B, 1, vocab]`: what reading a prompt
    /// needs, without the output head's `T x vocab` product for the
    /// positions before it.
    Last,
    /// None: the pass ends at its last sublayer's hidden states (a
    /// pipeline stage, features for a probe).
    None,
}

/// A forward pass: everything it reads besides its input and the carried
/// state. [`Pass::new`] is a plain pass over the whole model; the `with_`
/// methods change one thing each.
#[derive(Clone, Debug)]
pub struct Pass<B: Backend> {
    /// Dropout masks, one per sublayer of the pass, drawn beforehand
    /// ([`crate::TransformerVq::dropout_masks`]) for the pass's `[B, T]`;
    /// `None`: drawn as the pass begins.
    pub masks: Option<DropoutMasks<B>>,
    /// Real tokens `[B, T]`: padding is left out of the codebook statistics.
    pub valid: Option<Tensor<B, 2, Bool>>,
    /// Whether each sublayer reports where its attention went (a
    /// diagnostic at the cost of a second pass over the scores).
    pub with_attention: bool,
    /// What to keep of the autodiff graph.
    pub graph: Graph,
    /// The sublayers the pass runs (`None`: all of them); the carried
    /// state holds one entry per sublayer of the range.
    pub sublayers: Option<Range<usize>>,
    /// Which logits to compute after the last sublayer.
    pub logits: Logits,
}

impl<B: Backend> Default for Pass<B> {
    fn default() -> Self {
        Self {
            masks: None,
            valid: None,
            with_attention: false,
            graph: Graph::Whole,
            sublayers: None,
            logits: Logits::All,
        }
    }
}

impl<B: Backend> Pass<B> {
    /// Every sublayer, every position's logits, every token counted,
    /// dropout masks drawn as the pass begins (only a model with autodiff
    /// draws any), no diagnostics.
    pub fn new() -> Self {
        Self::default()
    }

    /// The pass with dropout `masks` drawn beforehand, one per sublayer of
    /// the pass.
    pub fn with_masks(self, masks: DropoutMasks<B>) -> Self {
        Self {
            masks: Some(masks),
            ..self
        }
    }

    /// The pass counting only the tokens `valid` `[B, T]` marks in the
    /// codebook statistics (every token where `None`).
    pub fn with_valid(self, valid: Option<Tensor<B, 2, Bool>>) -> Self {
        Self { valid, ..self }
    }

    /// The pass reporting where each sublayer's attention went if
    /// `report` is set (a diagnostic flag passes straight through).
    pub fn with_attention(self, report: bool) -> Self {
        Self {
            with_attention: report,
            ..self
        }
    }

    /// The pass keeping `graph` of the autodiff graph.
    pub fn with_graph(self, graph: Graph) -> Self {
        Self { graph, ..self }
    }

    /// The pass over sublayers `range` only.
    pub fn with_sublayers(self, range: Range<usize>) -> Self {
        Self {
            sublayers: Some(range),
            ..self
        }
    }

    /// The pass computing `logits`.
    pub fn with_logits(self, logits: Logits) -> Self {
        Self { logits, ..self }
    }

    /// Checks this pass over sublayers `range` of a model of `n` from
    /// `states`, for `[b, t]` tokens, with `masks`.
    pub(crate) fn check(
        range: &Range<usize>,
        states: &[AttentionState<B>],
        masks: &[SublayerMasks<B>],
        n: usize,
        [b, t]: [usize; 2],
    ) -> Result<(), ModelError> {
        if range.start > range.end || range.end > n || states.len() != range.len() {
            return Err(ModelError::StateMismatch(format!(
                "{} sublayer states for sublayers {range:?} of {n}",
                states.len()
            )));
        }
        if masks.len() != range.len() {
            return Err(ModelError::MaskMismatch(format!(
                "masks for {} sublayers, the pass runs {}",
                masks.len(),
                range.len()
            )));
        }
        let fits = |m: &SublayerMasks<B>| {
            m.residual.as_ref().is_none_or(|r| r.dims()[..2] == [b, t])
                && m.layer.as_ref().is_none_or(|l| l.dims()[0] == b)
        };
        if !masks.iter().all(fits) {
            return Err(ModelError::MaskMismatch(format!(
                "masks drawn for another batch or length than the input [{b}, {t}]"
            )));
        }
        Ok(())
    }
}

/// What a pass under [`Graph::LastSublayer`] leaves for the recomputing
/// backward pass.
#[derive(Debug)]
pub struct Recomputable<B: Backend> {
    /// The input `[B, T, D]` of every sublayer but the last, in order.
    pub inputs: Vec<Tensor<B, 3>>,
    /// The last sublayer's input `[B, T, D]`, a leaf whose gradient the
    /// backward pass asks for.
    pub last_input: Tensor<B, 3>,
    /// The last sublayer's commitment `[B, T]`, with its graph (the pass's
    /// [`crate::ModelOutput::commitment`] is detached).
    pub last_commitment: Tensor<B, 2>,
}
