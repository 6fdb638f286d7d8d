//! Recall accuracy: over a recall task's split ([`tvq_data::recall`]), how
//! many answers the model's most likely next token gets exactly right,
//! overall and by how far back the answer was given.
//!
//! Each example is read from a fresh state, segment by segment with the
//! state carried (so an answer beyond the two-block window must come from
//! the compressed cache), `eval.batch_size` examples at a time.

use burn::prelude::*;
use serde::{Deserialize, Serialize};
use tvq_data::recall::RecallSet;
use tvq_data::vocab::{EOS, PAD};
use tvq_data::{Batch, TokenSplit};
use tvq_model::{Loss, Pass, TransformerVq};

use crate::batch::BatchTensors;
use crate::config::EvalSection;
use crate::error::TrainError;
use crate::placement::B;
use crate::progress::progress_bar;

/// Exact-match accuracy on a recall task's answers.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RecallReport {
    /// Answers scored.
    pub answers: u64,
    /// Answers the model's most likely token got right.
    pub correct: u64,
    /// `correct / answers`.
    pub accuracy: f64,
    /// The same by the distance between the answer and where it was given,
    /// in buckets ending on powers of two (as the loss by position).
    pub by_distance: Vec<DistanceBucket>,
}

/// Accuracy of the answers given `first..=last` tokens back.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DistanceBucket {
    /// Shortest distance in the bucket (`last / 2 + 1`).
    pub first: u64,
    /// Longest distance in the bucket (a power of two).
    pub last: u64,
    /// Answers in the bucket.
    pub answers: u64,
    /// Of which right.
    pub correct: u64,
    /// `correct / answers`.
    pub accuracy: f64,
}

/// Counts right answers by distance bucket (bucket `k` ends at `2^k`).
#[derive(Clone, Debug, Default)]
pub struct RecallTally {
    /// `(answers, correct)` per bucket.
    buckets: Vec<(u64, u64)>,
}

impl RecallTally {
    /// One answer given `distance` tokens back, right or not.
    pub fn add(&mut self, distance: usize, right: bool) {
        let k = distance.max(1).next_power_of_two().ilog2() as usize;
        if self.buckets.len() <= k {
            self.buckets.resize(k + 1, (0, 0));
        }
        self.buckets[k].0 += 1;
        self.buckets[k].1 += right as u64;
    }

    /// The report of everything added.
    pub fn report(&self) -> RecallReport {
        let ratio = |c: u64, n: u64| c as f64 / n.max(1) as f64;
        let (answers, correct) = self
            .buckets
            .iter()
            .fold((0, 0), |(n, c), &(bn, bc)| (n + bn, c + bc));
        RecallReport {
            answers,
            correct,
            accuracy: ratio(correct, answers),
            by_distance: self
                .buckets
                .iter()
                .enumerate()
                .filter(|(_, (n, _))| *n > 0)
                .map(|(k, &(n, c))| DistanceBucket {
                    first: (1u64 << k) / 2 + 1,
                    last: 1 << k,
                    answers: n,
                    correct: c,
                    accuracy: ratio(c, n),
                })
                .collect(),
        }
    }
}

/// Scores the first `max_examples` examples (all when `None`) of recall
/// split `split` with `model`: the accuracy report (which counts the
/// answers), the loss summed over the scored targets, nats, and their
/// number (the answers', unless the task scores its text too:
/// `data.passkey.score_text`).
pub fn evaluate_recall(
    model: &TransformerVq<B>,
    split: &TokenSplit,
    recall: &RecallSet,
    eval: &EvalSection,
    max_examples: Option<usize>,
    progress: bool,
) -> Result<(RecallReport, f64, u64), TrainError> {
    let (len, seg) = (recall.example_len, eval.update_len);
    let examples = max_examples.map_or(recall.examples(), |m| m.min(recall.examples()));
    let rows = eval.batch_size.clamp(1, examples.max(1));
    let device = model.embedding.weight.device();
    let bar = progress_bar(
        progress,
        examples as u64,
        &format!(
            "recall {} [{{bar:30}}] {{pos}}/{{len}} eta {{eta}}",
            split.split
        ),
    );
    let distance: std::collections::HashMap<usize, usize> =
        recall.answers.iter().map(|a| (a.pos, a.distance)).collect();
    let (mut tally, mut nll, mut scored) = (RecallTally::default(), 0f64, 0u64);
    for first in (0..examples).step_by(rows) {
        let group: Vec<usize> = (first..(first + rows).min(examples)).collect();
        let mut state = model.empty_state();
        for start in (0..len).step_by(seg) {
            let batch = segment(split, &group, len, start, seg);
            let t = BatchTensors::rows(&batch, 0..group.len(), &device);
            let out = model.forward(t.inputs, state, Pass::new().with_valid(t.valid.clone()))?;
            let guess: Vec<i64> = (out.logits.clone())
                .expect("every position's logits")
                .argmax(2) // [R, T, 1]
                .into_data()
                .convert::<i64>()
                .to_vec()
                .expect("i64");
            nll += Loss::new(&out, t.targets, Some(t.valid))
                .nll_sum
                .into_scalar()
                .elem::<f64>();
            for (i, &target) in batch.targets.iter().enumerate() {
                if target == PAD || !batch.valid[i] {
                    continue;
                }
                scored += 1;
                let pos = group[i / seg] * len + start + i % seg;
                if let Some(&d) = distance.get(&pos) {
                    tally.add(d, guess[i] == target as i64);
                }
            }
            state = out.state;
        }
        bar.inc(group.len() as u64);
    }
    bar.finish_and_clear();
    Ok((tally.report(), nll, scored))
}

/// Tokens `start..start + seg` of each example in `group` as one batch
/// (padded past the example's end).
fn segment(split: &TokenSplit, group: &[usize], len: usize, start: usize, seg: usize) -> Batch {
    let mut batch = Batch {
        batch: group.len(),
        len: seg,
        inputs: Vec::with_capacity(group.len() * seg),
        targets: Vec::with_capacity(group.len() * seg),
        valid: Vec::with_capacity(group.len() * seg),
        reset: start == 0,
    };
    for &e in group {
        for i in start..start + seg {
            let p = e * len + i;
            let real = i < len;
            batch.inputs.push(match (real, i) {
                (false, _) => PAD,
                (true, 0) => EOS,
                (true, _) => split.get(p - 1),
            });
            batch.targets.push(if real { split.target(p) } else { PAD });
            batch.valid.push(real);
        }
    }
    batch
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tally_counts_right_answers_by_distance() {
        let mut tally = RecallTally::default();
        for (distance, right) in [
            (1, true),
            (2, false),
            (3, true),
            (4, true),
            (5, false),
            (8, false),
            (100, true),
        ] {
            tally.add(distance, right);
        }
        let r = tally.report();
        assert_eq!((r.answers, r.correct), (7, 4));
        assert!((r.accuracy - 4.0 / 7.0).abs() < 1e-12);
        let rows: Vec<_> = r
            .by_distance
            .iter()
            .map(|b| (b.first, b.last, b.answers, b.correct))
            .collect();
        assert_eq!(
            rows,
            [
                (1, 1, 1, 1),
                (2, 2, 1, 0),
                (3, 4, 2, 2),
                (5, 8, 2, 0),
                (65, 128, 1, 1)
            ]
        );
        assert_eq!(RecallTally::default().report().accuracy, 0.0);
    }
}
