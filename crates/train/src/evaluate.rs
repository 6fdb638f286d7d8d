//! Streaming evaluation: a whole split through the model with the state
//! carried from segment to segment (or reset every so many tokens), and
//! optionally the loss by position in the document.

use burn::prelude::*;
use indicatif::{ProgressBar, ProgressStyle};
use serde::{Deserialize, Serialize};
use tvq_data::{Batch, EvalBatches, TokenSplit};
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
    /// The state was reset every this many tokens of a row (absent: carried
    /// through the whole row).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reset_every: Option<usize>,
    /// The loss by position in the document, when asked for.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub by_position: Option<Vec<PositionBucket>>,
}

/// How a split is scored, beyond the `[eval]` table's batch layout.
#[derive(Clone, Debug, Default)]
pub struct EvalOptions {
    /// Score only the first this many batches (`None`: the whole split).
    pub max_segments: Option<usize>,
    /// Draw a progress bar.
    pub progress: bool,
    /// Threads that score groups of the batch's rows at once.
    pub workers: usize,
    /// Reset the state every this many tokens of a row (a multiple of
    /// `eval.update_len`), as the official validation does per sequence;
    /// `None` carries it through the row.
    pub reset_every: Option<usize>,
    /// Also report the loss by position in the document ([`PositionBucket`]).
    pub by_position: bool,
}

/// Mean loss of the tokens at positions `first..=last` of their document:
/// position `n` is a token predicted after reading `n` tokens of its
/// document (the end-of-document token that opens it counts; after a state
/// reset, counting restarts at the first token read).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PositionBucket {
    /// First position of the bucket (a power of two).
    pub first: u64,
    /// Last position of the bucket (`2 first - 1`).
    pub last: u64,
    /// Tokens scored in the bucket.
    pub tokens: u64,
    /// Their mean loss, bits per token.
    pub bits_per_token: f64,
}

/// Sums of the loss by log2 position bucket, and each row's position.
struct PositionTally {
    /// Tokens of its current document each row has read.
    read: Vec<u64>,
    /// Per bucket `k` (positions `2^k ..= 2^(k+1) - 1`): nats and tokens.
    sums: Vec<(f64, u64)>,
}

impl PositionTally {
    fn new(rows: usize) -> Self {
        Self {
            read: vec![0; rows],
            sums: vec![],
        }
    }

    /// Every row starts again at position 0 (a state reset).
    fn restart(&mut self) {
        self.read.iter_mut().for_each(|r| *r = 0);
    }

    /// Adds a batch's per-token losses `nll` (nats, row-major like the batch).
    fn add(&mut self, batch: &Batch, nll: &[f32], eos: u32) {
        for (i, (&input, &loss)) in batch.inputs.iter().zip(nll).enumerate() {
            if !batch.valid[i] {
                continue;
            }
            let read = &mut self.read[i / batch.len];
            *read = if input == eos { 1 } else { *read + 1 };
            let k = read.ilog2() as usize;
            if self.sums.len() <= k {
                self.sums.resize(k + 1, (0.0, 0));
            }
            self.sums[k].0 += loss as f64;
            self.sums[k].1 += 1;
        }
    }

    fn buckets(&self) -> Vec<PositionBucket> {
        self.sums
            .iter()
            .enumerate()
            .filter(|(_, s)| s.1 > 0)
            .map(|(k, &(nats, tokens))| PositionBucket {
                first: 1 << k,
                last: (2 << k) - 1,
                tokens,
                bits_per_token: nats / tokens as f64 / std::f64::consts::LN_2,
            })
            .collect()
    }
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
/// `eval.batch_size` rows of `eval.update_len` tokens ([`EvalBatches`]:
/// each row walks its own contiguous region of the split). The rows are cut
/// into up to `opts.workers` groups that run on their own threads
/// ([`map_in_workers`]), each carrying its own state.
pub fn evaluate(
    model: &TransformerVq<B>,
    split: &TokenSplit,
    eval: &EvalSection,
    opts: &EvalOptions,
) -> Result<EvalReport, TrainError> {
    let (batch, update_len) = (eval.batch_size, eval.update_len);
    if let Some(every) = opts.reset_every
        && (every == 0 || !every.is_multiple_of(update_len))
    {
        return Err(TrainError::Config {
            key: "--reset-every".into(),
            reason: format!("must be a positive multiple of eval.update_len ({update_len})"),
        });
    }
    let batches = EvalBatches::new(split.clone(), batch, update_len)?;
    let total = batches.num_batches();
    let n = opts.max_segments.map_or(total, |m| m.min(total));
    let bar = if opts.progress {
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
    let groups = opts.workers.clamp(1, batch.max(1));
    let bounds: Vec<_> = (0..groups)
        .map(|g| g * batch / groups..(g + 1) * batch / groups)
        .collect();
    let mut states = vec![model.empty_state(); groups];
    let mut positions = PositionTally::new(batch);
    let (mut nll, mut tokens) = (0f64, 0u64);
    for (k, b) in batches.take(n).enumerate() {
        let reset_now = opts
            .reset_every
            .is_some_and(|e| (k * update_len).is_multiple_of(e));
        if b.reset || reset_now {
            states = vec![model.empty_state(); groups];
            positions.restart();
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
                let loss = Loss::new(&out, targets, Some(valid));
                let per_token: Vec<f32> = match opts.by_position {
                    true => loss.nll.into_data().convert::<f32>().to_vec().expect("f32"),
                    false => vec![],
                };
                Ok((
                    loss.nll_sum.into_scalar().elem::<f64>(),
                    per_token,
                    out.state,
                ))
            },
        )?;
        let mut batch_nll = Vec::with_capacity(if opts.by_position { b.inputs.len() } else { 0 });
        for (group_nll, per_token, state) in scored {
            nll += group_nll;
            batch_nll.extend(per_token);
            states.push(state);
        }
        if opts.by_position {
            positions.add(&b, &batch_nll, split.eos);
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
        reset_every: opts.reset_every,
        by_position: opts.by_position.then(|| positions.buckets()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_restart_at_each_document_and_fill_log2_buckets() {
        // Two rows of 6 tokens; EOS = 1. Row 0 holds a document start at
        // input 0 and another at input 3; row 1 starts mid-document (read 0
        // so far) and ends in padding.
        let batch = Batch {
            batch: 2,
            len: 6,
            inputs: vec![1, 5, 6, 1, 7, 8, 9, 9, 9, 9, 0, 0],
            targets: vec![0; 12],
            valid: [[true; 6], [true, true, true, true, false, false]].concat(),
            reset: true,
        };
        let nll: Vec<f32> = (0..12).map(|i| i as f32).collect();
        let mut tally = PositionTally::new(2);
        tally.add(&batch, &nll, 1);
        // Positions: row 0: 1 2 3 1 2 3; row 1: 1 2 3 4.
        let b = tally.buckets();
        let ln2 = std::f64::consts::LN_2;
        let expect = [
            (1, 1, 3, (0.0 + 3.0 + 6.0) / 3.0),
            (2, 3, 6, (1.0 + 2.0 + 4.0 + 5.0 + 7.0 + 8.0) / 6.0),
            (4, 7, 1, 9.0),
        ];
        assert_eq!(b.len(), expect.len());
        for (got, (first, last, tokens, nats)) in b.iter().zip(expect) {
            assert_eq!((got.first, got.last, got.tokens), (first, last, tokens));
            assert!((got.bits_per_token - nats / ln2).abs() < 1e-9);
        }
        // Carried into the next batch: row 0 is at position 3, row 1 at 4.
        let next = Batch {
            inputs: vec![5; 12],
            valid: vec![true; 12],
            ..batch
        };
        let mut carried = PositionTally::new(2);
        carried.add(&next, &nll, 1); // from 0: positions 1..=6
        carried.restart();
        carried.add(&next, &nll, 1);
        assert_eq!(carried.buckets().iter().map(|b| b.tokens).sum::<u64>(), 24);
        assert_eq!(carried.buckets()[0].tokens, 4, "position 1 twice per row");
    }
}
