//! Streaming evaluation: a whole split through the model with the state
//! carried from segment to segment.

use burn::prelude::*;
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use tvq_data::{EvalBatches, TokenSplit};
use tvq_model::{Loss, TransformerVq};

use crate::batch::BatchTensors;
use crate::config::EvalSection;
use crate::error::TrainError;
use crate::optim::B;
use crate::workers::map_in_workers;

/// Results of evaluating a split (or its first segments).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct EvalReport {
    /// Which split.
    pub split: String,
    /// Tokens scored.
    pub tokens: u64,
    /// Whether the whole split was scored.
    pub complete: bool,
    /// Mean negative log-likelihood per token, nats.
    pub loss: f64,
    /// Bits per token.
    pub bits_per_token: f64,
    /// Bits per byte of text (estimated from the split's bytes-per-token
    /// ratio when only part of the split was scored).
    pub bits_per_byte: f64,
    /// Perplexity per token.
    pub token_perplexity: f64,
    /// Perplexity per whitespace-separated word, where words were counted.
    pub word_perplexity: Option<f64>,
}

impl EvalReport {
    /// "loss L nats/token, X bits/byte".
    pub fn summary(&self) -> String {
        format!(
            "loss {:.4} nats/token, {:.4} bits/byte",
            self.loss, self.bits_per_byte
        )
    }
}

/// Scores `split` with `model` (a plain, non-autodiff model) in batches of
/// `eval.batch_size` rows of `eval.update_len` tokens: the first
/// `max_segments` batches or all of them. The rows are cut into up to
/// `workers` groups that run on their own threads ([`map_in_workers`]),
/// each carrying its own state.
pub fn evaluate(
    model: &TransformerVq<B>,
    split: &TokenSplit,
    eval: &EvalSection,
    max_segments: Option<usize>,
    show_progress: bool,
    workers: usize,
) -> Result<EvalReport, TrainError> {
    let (batch, update_len) = (eval.batch_size, eval.update_len);
    let batches = EvalBatches::new(split.clone(), batch, update_len)?;
    let total = batches.num_batches();
    let n = max_segments.map_or(total, |m| m.min(total));
    let bar = if show_progress {
        ProgressBar::new(n as u64)
    } else {
        ProgressBar::hidden()
    };
    bar.set_style(
        ProgressStyle::with_template("eval {split} [{bar:30}] {pos}/{len} eta {eta}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    let device = model.embedding.weight.device();
    // Rows [start, end) of every batch per group: as even as possible.
    let groups = workers.clamp(1, batch.max(1));
    let bounds: Vec<_> = (0..groups)
        .map(|g| g * batch / groups..(g + 1) * batch / groups)
        .collect();
    let mut states = vec![model.empty_state(); groups];
    let (mut nll, mut tokens) = (0f64, 0u64);
    for b in batches.take(n) {
        if b.reset {
            states = vec![model.empty_state(); groups];
        }
        let work: Vec<_> = bounds
            .iter()
            .cloned()
            .zip(std::mem::take(&mut states))
            .collect();
        let scored = map_in_workers(
            work,
            groups,
            || (),
            |_, (rows, state)| -> Result<_, TrainError> {
                let BatchTensors {
                    inputs,
                    targets,
                    valid,
                } = BatchTensors::rows(&b, rows, &device);
                let out = model.forward(inputs, state, Some(valid.clone()))?;
                let nll: f64 = Loss::new(&out, targets, Some(valid))
                    .nll_sum
                    .into_scalar()
                    .elem();
                Ok((nll, out.state))
            },
        )?;
        for (group_nll, state) in scored {
            nll += group_nll;
            states.push(state);
        }
        tokens += b.valid.iter().filter(|&&v| v).count() as u64;
        bar.inc(1);
    }
    bar.finish_and_clear();
    let complete = n == total;
    let ln2 = std::f64::consts::LN_2;
    // Share of the split's bytes (and words) behind the tokens scored.
    let share = tokens as f64 / split.len().max(1) as f64;
    let bytes = split.stats.bytes as f64 * if complete { 1.0 } else { share };
    let loss = nll / tokens.max(1) as f64;
    Ok(EvalReport {
        split: split.split.to_string(),
        tokens,
        complete,
        loss,
        bits_per_token: loss / ln2,
        bits_per_byte: nll / ln2 / bytes.max(1.0),
        token_perplexity: loss.exp(),
        word_perplexity: split
            .stats
            .words
            .map(|w| (nll / (w as f64 * if complete { 1.0 } else { share }).max(1.0)).exp()),
    })
}
