//! Recall accuracy: over a recall task's split ([`tvq_data::recall`]), how
//! many answers the model's most likely next token gets exactly right,
//! overall and by how far back the answer was given.
//!
//! Each example is read from a fresh state, segment by segment with the
//! state carried (so an answer beyond the two-block window must come from
//! the compressed cache), `eval.batch_size` examples at a time. Where the
//! attention went at each answer can be measured too: a model that recalls
//! from beyond its window should weigh the compressed cache there.

use burn::prelude::*;
use serde::{Deserialize, Serialize};
use tvq_data::recall::{Answer, RecallSet};
use tvq_data::vocab::{EOS, PAD};
use tvq_data::{Batch, TokenSplit};
use tvq_model::{Loss, Pass, TransformerVq};

use crate::batch::BatchTensors;
use crate::config::EvalSection;
use crate::error::TrainError;
use crate::inference::attention::{self, AttentionShare};
use crate::inference::code_sharing::{CodeSharing, ExampleSharing, SharingBucket, SharingTally};
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
    /// The answers whose pair was in the compressed cache when asked for,
    /// by how many other pairs of the example shared its code, per codebook
    /// (VQ attention; empty for the quadratic form or when nothing was
    /// cached).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub code_sharing: Vec<CodeSharing>,
    /// The same answers by how many other pairs shared the pair's code in
    /// every codebook at once: those no codebook tells apart from it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub code_sharing_joint: Vec<SharingBucket>,
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
    /// Where each sublayer's attention went at these answers (the mean over
    /// them), when measured.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub attention: Vec<AttentionShare>,
}

/// Sums of the answers in one distance bucket (or of all of them).
#[derive(Clone, Debug, Default)]
struct AnswerSums {
    answers: u64,
    correct: u64,
    /// Attention figures, [`attention::FIGURES`] per sublayer.
    attention: Vec<f64>,
}

impl AnswerSums {
    fn add(&mut self, right: bool, attention: &[f32]) {
        self.answers += 1;
        self.correct += right as u64;
        attention::accumulate(&mut self.attention, attention);
    }

    fn accuracy(&self) -> f64 {
        self.correct as f64 / self.answers.max(1) as f64
    }
}

/// Counts right answers by distance bucket (bucket `k` ends at `2^k`), with
/// the attention figures read at them.
#[derive(Clone, Debug, Default)]
pub struct RecallTally {
    /// Per bucket.
    buckets: Vec<AnswerSums>,
    /// Over every answer.
    total: AnswerSums,
}

impl RecallTally {
    /// One answer given `distance` tokens back, right or not, and the
    /// attention figures at its position (per sublayer its three shares,
    /// then its three entropies; empty when not measured).
    pub fn add(&mut self, distance: usize, right: bool, attention: &[f32]) {
        let k = distance.max(1).next_power_of_two().ilog2() as usize;
        if self.buckets.len() <= k {
            self.buckets.resize(k + 1, AnswerSums::default());
        }
        self.buckets[k].add(right, attention);
        self.total.add(right, attention);
    }

    /// The report of everything added.
    pub fn report(&self) -> RecallReport {
        RecallReport {
            answers: self.total.answers,
            correct: self.total.correct,
            accuracy: self.total.accuracy(),
            by_distance: self
                .buckets
                .iter()
                .enumerate()
                .filter(|(_, s)| s.answers > 0)
                .map(|(k, s)| DistanceBucket {
                    first: (1u64 << k) / 2 + 1,
                    last: 1 << k,
                    answers: s.answers,
                    correct: s.correct,
                    accuracy: s.accuracy(),
                    attention: attention::means(&s.attention, s.answers),
                })
                .collect(),
            code_sharing: vec![],
            code_sharing_joint: vec![],
        }
    }

    /// Where each sublayer's attention went, the mean over every answer
    /// (empty when not measured).
    pub fn attention(&self) -> Vec<AttentionShare> {
        attention::means(&self.total.attention, self.total.answers)
    }
}

/// What [`evaluate_recall`] measured.
#[derive(Clone, Debug)]
pub struct RecallScores {
    /// The answers' accuracy.
    pub report: RecallReport,
    /// Where the attention went at the answers, when asked for.
    pub attention: Option<Vec<AttentionShare>>,
    /// Loss summed over the scored targets, nats.
    pub nll: f64,
    /// Targets scored: the answers, unless the task scores its text too
    /// (`data.passkey.score_text`).
    pub scored: u64,
    /// Whether every example of the split was scored.
    pub complete: bool,
}

/// Scores the first `max_examples` examples (all when `None`) of recall
/// split `split` with `model`, and with `with_attention` where the attention
/// went at each answer.
pub fn evaluate_recall(
    model: &TransformerVq<B>,
    split: &TokenSplit,
    recall: &RecallSet,
    eval: &EvalSection,
    max_examples: Option<usize>,
    progress: bool,
    with_attention: bool,
) -> Result<RecallScores, TrainError> {
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
    let mut sharing = SharingTally::default();
    for first in (0..examples).step_by(rows) {
        let group: Vec<usize> = (first..(first + rows).min(examples)).collect();
        let mut state = model.empty_state();
        // Per row: its example's answers (positions within the example),
        // whose code sharing is counted as the segments are read.
        let mut shares: Vec<ExampleSharing> = (group.iter())
            .map(|&e| {
                let base = e * len;
                let lo = recall.answers.partition_point(|a| a.pos < base);
                let hi = recall.answers.partition_point(|a| a.pos < base + len);
                let answers = (recall.answers[lo..hi].iter())
                    .map(|a| Answer {
                        pos: a.pos - base,
                        ..*a
                    })
                    .collect();
                ExampleSharing::new(answers, model.block_len())
            })
            .collect();
        for start in (0..len).step_by(seg) {
            let batch = segment(split, &group, len, start, seg);
            let t = BatchTensors::rows(&batch, 0..group.len(), &device);
            let pass = Pass::new()
                .with_valid(t.valid.clone())
                .with_attention(with_attention);
            let out = model.forward(t.inputs, state, pass)?;
            let guess: Vec<i64> = (out.logits.clone())
                .expect("every position's logits")
                .argmax(2) // [R, T, 1]
                .into_data()
                .convert::<i64>()
                .to_vec()
                .expect("i64");
            let figures = attention::per_token(&out.attention); // [R, T, sublayer, FIGURES]
            let per_token = figures.len() / batch.targets.len();
            nll += Loss::new(&out, t.targets, t.valid)
                .nll_sum
                .into_scalar()
                .elem::<f64>();
            // Whether the answer at each position of the segment was right.
            let mut right = vec![false; batch.targets.len()]; // [R * seg]
            for (i, &target) in batch.targets.iter().enumerate() {
                if target == PAD || !batch.valid[i] {
                    continue;
                }
                scored += 1;
                let pos = group[i / seg] * len + start + i % seg;
                if let Some(&d) = distance.get(&pos) {
                    let at = &figures[i * per_token..(i + 1) * per_token];
                    right[i] = guess[i] == target as i64;
                    tally.add(d, right[i], at);
                }
            }
            // Every codebook's codes of each row, `[R][codebook][seg]`.
            let mut codes: Vec<Vec<Vec<u32>>> = vec![vec![]; group.len()];
            let mut heads = 1;
            for c in &out.codes {
                let [r, h, t] = c.dims(); // [R, H, seg]
                heads = h;
                let c: Vec<u32> = (c.clone().into_data())
                    .convert::<u32>()
                    .to_vec()
                    .expect("u32");
                for (row, row_codes) in codes.iter_mut().enumerate().take(r) {
                    for head in 0..h {
                        let from = (row * h + head) * t;
                        row_codes.push(c[from..from + t].to_vec());
                    }
                }
            }
            for (row, share) in shares.iter_mut().enumerate() {
                let right = &right[row * seg..(row + 1) * seg];
                share.add_segment(&codes[row], heads, right, &mut sharing);
            }
            state = out.state;
        }
        bar.inc(group.len() as u64);
    }
    let mut report = tally.report();
    report.code_sharing = sharing.report();
    report.code_sharing_joint = sharing.joint();
    bar.finish_and_clear();
    Ok(RecallScores {
        report,
        attention: with_attention.then(|| tally.attention()),
        nll,
        scored,
        complete: examples == recall.examples(),
    })
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
            tally.add(distance, right, &[]);
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

    #[test]
    fn the_tally_averages_the_attention_at_the_answers_by_distance() {
        // One sublayer: figures [present, previous, cache, 3 entropies,
        // count weight].
        let near = [0.9, 0.1, 0.0, 0.5, 0.1, 0.0, 1.0];
        let far = [0.1, 0.1, 0.8, 0.1, 0.1, 1.0, 0.2];
        let farther = [0.2, 0.2, 0.6, 0.1, 0.1, 2.0, 0.4];
        let mut tally = RecallTally::default();
        tally.add(2, true, &near);
        tally.add(40, true, &far);
        tally.add(50, false, &farther);
        let r = tally.report();
        assert_eq!(r.by_distance.len(), 2);
        let close = |a: [f64; 3], b: [f64; 3]| a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-6);
        assert!(close(r.by_distance[0].attention[0].share, [0.9, 0.1, 0.0]));
        // 33..=64: the mean of the two answers there.
        let far_bucket = &r.by_distance[1].attention[0];
        assert!(close(far_bucket.share, [0.15, 0.15, 0.7]));
        assert!(close(far_bucket.entropy, [0.1, 0.1, 1.5]));
        assert!((far_bucket.count_weight - 0.3).abs() < 1e-6);
        // Over every answer.
        assert!(close(
            tally.attention()[0].share,
            [0.4, 0.4 / 3.0, 1.4 / 3.0]
        ));
        // Not measured: no figures, in the report or its JSON.
        let mut plain = RecallTally::default();
        plain.add(2, true, &[]);
        assert!(plain.attention().is_empty());
        let json = serde_json::to_string(&plain.report()).unwrap();
        assert!(!json.contains("attention"), "{json}");
    }
}
