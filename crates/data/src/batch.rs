//! Batches for stateful training and for evaluation.
//!
//! Training: the split is cut into sequences of `sequence_len` tokens (from a
//! per-epoch offset drawn from the seed). Each step hands every row the next
//! segment of `update_len` tokens of its current sequence, so the model
//! state can be carried from one segment to the next; [`Batch::reset`] says
//! when it must start afresh. Which sequence a row takes next depends on
//! the layout:
//! - `reset_each_sequence` (the official layout): every epoch deals the
//!   sequences out in a random order drawn from the seed, so the rows of a
//!   batch and consecutive batches hold unrelated text, and every sequence
//!   is seen once per epoch;
//! - otherwise the state carries across sequences, so each row walks one
//!   contiguous run of the split (the split cut into `batch` runs).
//!
//! Targets are the tokens themselves, inputs the token before each
//! (end-of-document at a reset). In a recall task only the answers are
//! targets; every other target is `PAD`, which the loss skips.
//!
//! Evaluation: the split is cut into `batch` contiguous regions; each row
//! walks its region segment by segment, so every token is a target exactly
//! once, in order; the rows' tails are padded and masked.

use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::config::DataConfig;
use crate::corpus::TokenSplit;
use crate::error::DataError;
use crate::hash::{SplitMix64, splitmix64};
use crate::vocab::{EOS, PAD};

/// `batch` rows of `len` tokens, row-major.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Batch {
    /// Rows.
    pub batch: usize,
    /// Tokens per row.
    pub len: usize,
    /// Model inputs, `[batch * len]`.
    pub inputs: Vec<u32>,
    /// Targets (the next token of each input), `[batch * len]`; `PAD` where
    /// invalid or not scored (a recall task's non-answers).
    pub targets: Vec<u32>,
    /// Which positions are real tokens, `[batch * len]`.
    pub valid: Vec<bool>,
    /// Reset the model state (all rows) before this batch.
    pub reset: bool,
}

/// How training batches are laid out.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TrainLayout {
    /// Rows (parallel streams) per batch.
    pub batch: usize,
    /// Tokens per row per step (one segment).
    pub update_len: usize,
    /// Tokens per sequence, a multiple of `update_len`; the state resets between sequences.
    pub sequence_len: usize,
    /// Seed of the per-epoch offsets.
    pub seed: u64,
    /// Reset the state at every new sequence (the official layout); when
    /// false the state resets only at the start of an epoch.
    pub reset_each_sequence: bool,
}

impl DataConfig {
    /// The layout of training batches, with the data order drawn from `seed`.
    pub fn train_layout(&self, seed: u64) -> TrainLayout {
        TrainLayout {
            batch: self.batch_size,
            update_len: self.update_len,
            sequence_len: self.sequence_len,
            seed,
            reset_each_sequence: self.reset_each_sequence,
        }
    }
}

/// Position of a [`TrainBatches`] iterator; restoring it continues with
/// exactly the batches that would have come next.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TrainCursor {
    /// Completed epochs.
    pub epoch: u64,
    /// Batches handed out in this epoch.
    pub step: u64,
}

/// An endless, deterministic stream of training batches.
#[derive(Clone, Debug)]
pub struct TrainBatches {
    split: TokenSplit,
    layout: TrainLayout,
    cursor: TrainCursor,
    /// Sequences per row and epoch.
    seqs_per_row: usize,
    /// The shuffled order of the cursor's epoch (empty when not shuffled).
    order: (u64, Vec<u32>),
    /// The rows handed out (all of them unless [`Self::with_rows`]).
    rows: Range<usize>,
}

impl TrainBatches {
    /// Batches over `split` laid out as `layout`, starting at `cursor`.
    pub fn new(
        split: TokenSplit,
        layout: TrainLayout,
        cursor: TrainCursor,
    ) -> Result<Self, DataError> {
        let TrainLayout {
            batch,
            update_len,
            sequence_len,
            ..
        } = layout;
        if batch == 0 || update_len == 0 {
            return Err(DataError::Layout(
                "batch and update_len must be at least 1".into(),
            ));
        }
        if sequence_len == 0 || !sequence_len.is_multiple_of(update_len) {
            return Err(DataError::Layout(format!(
                "sequence_len ({sequence_len}) must be a positive multiple of update_len ({update_len})"
            )));
        }
        let needed = batch.saturating_mul(sequence_len);
        if split.len() < needed {
            return Err(DataError::SplitTooSmall {
                split: split.split.to_string(),
                tokens: split.len(),
                needed,
                what: format!("{batch} rows of one {sequence_len}-token sequence"),
            });
        }
        // A recall task's sequences are its examples, which must not be cut;
        // otherwise the largest offset still leaves every row one whole
        // sequence.
        let seqs_per_row = match &split.recall {
            Some(recall) if recall.example_len != sequence_len => {
                return Err(DataError::Layout(format!(
                    "the recall task's examples are {} tokens, not data.sequence_len ({sequence_len})",
                    recall.example_len
                )));
            }
            Some(_) => split.len() / needed,
            None => (split.len() - (sequence_len - 1).min(split.len() - needed)) / needed,
        };
        let mut batches = Self {
            split,
            layout,
            cursor,
            seqs_per_row,
            order: (0, vec![]),
            rows: 0..batch,
        };
        // A cursor from a checkpoint of a run over another corpus (or this
        // one, since shrunk) may point past this corpus's epoch.
        if cursor.step >= batches.steps_per_epoch() {
            return Err(DataError::Layout(format!(
                "the data position (batch {} of epoch {}) lies beyond an epoch of this corpus \
                 ({} batches): the corpus changed since the checkpoint was written",
                cursor.step,
                cursor.epoch,
                batches.steps_per_epoch()
            )));
        }
        batches.order = (cursor.epoch, batches.epoch_order(cursor.epoch));
        Ok(batches)
    }

    /// Hands out only rows `rows` of every batch (one node's share of a
    /// run over several): the same tokens as those rows of the whole batch.
    pub fn with_rows(mut self, rows: Range<usize>) -> Result<Self, DataError> {
        if rows.is_empty() || rows.end > self.layout.batch {
            return Err(DataError::Layout(format!(
                "rows {rows:?} are not a part of a batch of {} rows",
                self.layout.batch
            )));
        }
        self.rows = rows;
        Ok(self)
    }

    /// Where the iterator stands.
    pub fn cursor(&self) -> TrainCursor {
        self.cursor
    }

    /// Batches per epoch.
    pub fn steps_per_epoch(&self) -> u64 {
        (self.seqs_per_row * self.layout.sequence_len / self.layout.update_len) as u64
    }

    /// Where this epoch's first sequence starts: a seeded draw in
    /// `[0, min(sequence_len, slack + 1))`, so sequence boundaries move between epochs.
    fn epoch_offset(&self, epoch: u64) -> usize {
        let l = &self.layout;
        if self.split.recall.is_some() {
            return 0; // examples start at multiples of the sequence
        }
        let slack = self.split.len() - self.seqs_per_row * l.batch * l.sequence_len;
        let range = (l.sequence_len.min(slack + 1)) as u64;
        (splitmix64(l.seed ^ splitmix64(epoch)) % range) as usize
    }

    /// In which order an epoch deals out its sequences: entry
    /// `seq * batch + row` is the sequence row `row` reads as its `seq`-th.
    /// A seeded Fisher-Yates shuffle when every sequence starts afresh;
    /// empty (each row walks its own contiguous run) otherwise.
    fn epoch_order(&self, epoch: u64) -> Vec<u32> {
        let l = &self.layout;
        if !l.reset_each_sequence {
            return vec![];
        }
        let n = self.seqs_per_row * l.batch;
        let mut order: Vec<u32> = (0..n as u32).collect();
        // Another stream than the epoch offsets' (which mix the seed with
        // the epoch alone).
        let mut rng = SplitMix64(splitmix64(l.seed) ^ splitmix64(epoch ^ 0x5EED_0F0D_E500_0000));
        for i in (1..n).rev() {
            let j = (rng.next_u64() % (i as u64 + 1)) as usize;
            order.swap(i, j);
        }
        order
    }

    /// The batch at `cursor` (without advancing).
    pub fn batch_at(&self, cursor: TrainCursor) -> Batch {
        let l = &self.layout;
        let segs_per_seq = l.sequence_len / l.update_len;
        let seq = cursor.step as usize / segs_per_seq; // sequence index within each row
        let seg = cursor.step as usize % segs_per_seq;
        let reset = seg == 0 && (l.reset_each_sequence || seq == 0);
        let offset = self.epoch_offset(cursor.epoch);
        let other_epoch;
        let order = if self.order.0 == cursor.epoch {
            &self.order.1
        } else {
            other_epoch = self.epoch_order(cursor.epoch);
            &other_epoch
        };
        let n = self.rows.len() * l.update_len;
        let (mut inputs, mut targets) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for row in self.rows.clone() {
            let sequence = if order.is_empty() {
                row * self.seqs_per_row + seq
            } else {
                order[seq * l.batch + row] as usize
            };
            let start = offset + sequence * l.sequence_len + seg * l.update_len;
            for p in start..start + l.update_len {
                let first = p == start;
                inputs.push(if (first && reset) || p == 0 {
                    EOS
                } else {
                    self.split.get(p - 1)
                });
                targets.push(self.split.target(p));
            }
        }
        Batch {
            batch: self.rows.len(),
            len: l.update_len,
            inputs,
            targets,
            valid: vec![true; n],
            reset,
        }
    }
}

impl Iterator for TrainBatches {
    type Item = Batch;

    fn next(&mut self) -> Option<Batch> {
        let batch = self.batch_at(self.cursor);
        self.cursor.step += 1;
        if self.cursor.step == self.steps_per_epoch() {
            let epoch = self.cursor.epoch + 1;
            self.cursor = TrainCursor { epoch, step: 0 };
            self.order = (epoch, self.epoch_order(epoch));
        }
        Some(batch)
    }
}

/// Every token of a split exactly once, in order, in `batch` parallel rows.
#[derive(Clone, Debug)]
pub struct EvalBatches {
    split: TokenSplit,
    batch: usize,
    update_len: usize,
    region: usize,
    next: usize,
}

impl EvalBatches {
    /// Evaluation batches of `batch` rows and `update_len` tokens.
    pub fn new(split: TokenSplit, batch: usize, update_len: usize) -> Result<Self, DataError> {
        if batch == 0 || update_len == 0 {
            return Err(DataError::Layout(
                "batch and update_len must be at least 1".into(),
            ));
        }
        if batch > split.len() {
            return Err(DataError::Layout(format!(
                "an evaluation batch of {batch} rows, more than the split's {} tokens",
                split.len()
            )));
        }
        let region = split.len().div_ceil(batch);
        Ok(Self {
            split,
            batch,
            update_len,
            region,
            next: 0,
        })
    }

    /// Number of batches.
    pub fn num_batches(&self) -> usize {
        self.region.div_ceil(self.update_len)
    }

    /// Tokens that will be targets (the whole split).
    pub fn num_tokens(&self) -> usize {
        self.split.len()
    }
}

impl Iterator for EvalBatches {
    type Item = Batch;

    fn next(&mut self) -> Option<Batch> {
        if self.next >= self.num_batches() {
            return None;
        }
        let (b, t) = (self.batch, self.update_len);
        let mut batch = Batch {
            batch: b,
            len: t,
            inputs: Vec::with_capacity(b * t),
            targets: Vec::with_capacity(b * t),
            valid: Vec::with_capacity(b * t),
            reset: self.next == 0,
        };
        for row in 0..b {
            let start = row * self.region;
            let end = ((row + 1) * self.region).min(self.split.len());
            for i in self.next * t..(self.next + 1) * t {
                let p = start + i;
                if p < end {
                    batch
                        .inputs
                        .push(if i == 0 { EOS } else { self.split.get(p - 1) });
                    batch.targets.push(self.split.target(p));
                    batch.valid.push(true);
                } else {
                    batch.inputs.push(PAD);
                    batch.targets.push(PAD);
                    batch.valid.push(false);
                }
            }
        }
        self.next += 1;
        Some(batch)
    }
}
