//! The description of a pass through the sublayers.
//!
//! Training, evaluation, reading a prompt (a whole model or a pipeline
//! stage's sublayers) and the forward pass of full activation
//! checkpointing all run the model's one loop over its sublayers,
//! [`crate::TransformerVq::run_sublayers`]; they differ
//! only in the [`Pass`] they give it: which tokens count, which dropout
//! masks, whether to report where the attention went, and what to keep of
//! the autodiff graph ([`Graph`]). The loop checks the carried state and the
//! masks against the model and the input on every path.

use std::ops::Range;

use burn::prelude::*;

use crate::attention::{AttentionGroups, AttentionState};
use crate::dropout::SublayerMasks;
use crate::error::ModelError;
use crate::quantizer::CodebookStats;

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

/// A pass over some sublayers: everything it reads besides the hidden
/// states and the carried state.
#[derive(Clone, Debug)]
pub struct Pass<B: Backend> {
    /// Dropout masks, one per sublayer of the pass, drawn beforehand
    /// ([`crate::TransformerVq::dropout_masks`]) for the pass's `[B, T]`.
    pub masks: Vec<SublayerMasks<B>>,
    /// Real tokens `[B, T]`: padding is left out of the codebook statistics.
    pub valid: Option<Tensor<B, 2, Bool>>,
    /// Whether each sublayer reports where its attention went (a
    /// diagnostic at the cost of a second pass over the scores).
    pub with_groups: bool,
    /// What to keep of the autodiff graph.
    pub graph: Graph,
}

impl<B: Backend> Pass<B> {
    /// A pass that keeps the whole graph, with `masks` and no diagnostics.
    pub fn new(masks: Vec<SublayerMasks<B>>, valid: Option<Tensor<B, 2, Bool>>) -> Self {
        Self {
            masks,
            valid,
            with_groups: false,
            graph: Graph::Whole,
        }
    }

    /// Checks this pass over sublayers `range` of a model of `n` from
    /// `states`, for `[b, t]` tokens.
    pub fn check(
        &self,
        range: &Range<usize>,
        states: &[AttentionState<B>],
        n: usize,
        [b, t]: [usize; 2],
    ) -> Result<(), ModelError> {
        let masks = &self.masks;
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

/// What the sublayers of a pass leave for the recomputing backward pass
/// ([`Graph::LastSublayer`]).
#[derive(Debug)]
pub struct Recomputable<B: Backend> {
    /// The input `[B, T, D]` of every sublayer but the last, in order.
    pub inputs: Vec<Tensor<B, 3>>,
    /// The last sublayer's input `[B, T, D]`, a leaf whose gradient the
    /// backward pass asks for.
    pub last_input: Tensor<B, 3>,
    /// The last sublayer's commitment `[B, T]`, with its graph (the pass's
    /// [`PassOutput::commitment`] is detached).
    pub last_commitment: Tensor<B, 2>,
}

/// What a pass over some sublayers returns.
#[derive(Debug)]
pub struct PassOutput<B: Backend> {
    /// Hidden states after the last sublayer, `[B, T, D]`.
    pub h: Tensor<B, 3>,
    /// Commitment error per token, summed over the sublayers and heads,
    /// `[B, T]` (detached under [`Graph::LastSublayer`]).
    pub commitment: Tensor<B, 2>,
    /// Code statistics per sublayer (empty for the quadratic form).
    pub stats: Vec<CodebookStats<B>>,
    /// Codes of the keys per sublayer, `[B, H, T]` (empty for the quadratic form).
    pub codes: Vec<Tensor<B, 3, Int>>,
    /// Where the attention went, per sublayer, when asked for.
    pub attention: Vec<AttentionGroups<B>>,
    /// Each sublayer's state after the segment (detached).
    pub states: Vec<AttentionState<B>>,
    /// Under [`Graph::LastSublayer`], what the backward pass recomputes from.
    pub recomputable: Option<Recomputable<B>>,
}
