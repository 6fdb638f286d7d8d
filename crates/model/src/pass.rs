//! The one loop over the sublayers, and the description of a pass through
//! it.
//!
//! Training, evaluation, reading a prompt (a whole model or a pipeline
//! stage's sublayers) and the forward pass of full activation
//! checkpointing all run [`TransformerVq::run_sublayers`]; they differ
//! only in the [`Pass`] they give it: which tokens count, which dropout
//! masks, whether to report where the attention went, and what to keep of
//! the autodiff graph ([`Graph`]). The loop checks the carried state and the
//! masks against the model and the input on every path.

use std::ops::Range;

use burn::module::Module;
use burn::prelude::*;

use crate::attention::{AttentionGroups, AttentionState};
use crate::dropout::SublayerMasks;
use crate::error::ModelError;
use crate::model::TransformerVq;
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
    /// ([`TransformerVq::dropout_masks`]) for the pass's `[B, T]`.
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

impl<B: Backend> TransformerVq<B> {
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
        self.check_pass(&range, &states, &pass.masks, [b, t])?;
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

    /// Checks a pass over `range` from `states` with `masks` for `[b, t]`
    /// tokens against the model.
    fn check_pass(
        &self,
        range: &Range<usize>,
        states: &[AttentionState<B>],
        masks: &[SublayerMasks<B>],
        [b, t]: [usize; 2],
    ) -> Result<(), ModelError> {
        let n = self.sublayers.len();
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
