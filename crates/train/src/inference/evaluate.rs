//! Streaming evaluation: a whole split through the model with the state
//! carried from segment to segment (or reset every so many tokens), and
//! optionally the loss by position in the document.

use burn::prelude::*;
use serde::{Deserialize, Serialize};
use tvq_data::vocab::PAD;
use tvq_data::{Batch, EvalBatches, TokenSplit};
use tvq_model::{Loss, ModelState, Pass, TransformerVq};

use crate::batch::BatchTensors;
use crate::config::EvalSection;
use crate::error::TrainError;
use crate::inference::attention::{self, AttentionShare};
use crate::inference::recall::{RecallReport, evaluate_recall};
use crate::parallel::workers::map_in_workers;
use crate::placement::B;
use crate::progress::progress_bar;

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
    /// Where each sublayer's attention went over the whole split (a recall
    /// task: at its answers), when asked for (VQ attention only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub attention: Option<Vec<AttentionShare>>,
    /// For a recall task: the answers' exact-match accuracy (its loss and
    /// bits are then per answer).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub recall: Option<RecallReport>,
}

/// How a split is scored, beyond the `[eval]` table's batch layout.
#[derive(Clone, Debug, Default)]
pub struct EvalOptions {
    /// Score only the first this many batches (`None`: the whole split).
    pub max_segments: Option<usize>,
    /// Draw a progress bar.
    pub progress: bool,
    /// Threads that score shards of the batch's rows at once.
    pub workers: usize,
    /// Reset the state every this many tokens of a row (a multiple of
    /// `eval.update_len`), as the official validation does per sequence;
    /// `None` carries it through the row.
    pub reset_every: Option<usize>,
    /// Also report the loss by position in the document ([`PositionBucket`]).
    pub by_position: bool,
    /// Also report where the attention went ([`AttentionShare`]), over the
    /// whole split and, with `by_position`, by position (a recall task: at
    /// its answers, overall and by distance).
    pub attention: bool,
}

/// Mean loss of the tokens at positions `first..=last` of their document:
/// position `n` is a token predicted after reading `n` tokens of its
/// document (the end-of-document token that opens it counts; after a state
/// reset, counting restarts at the first token read).
///
/// Buckets end on powers of two (`1`, `2`, `3..=4`, `5..=8`, ...), so a
/// state reset every `2^k` tokens (`--reset-every`) fills its last bucket
/// rather than leaving position `2^k` alone in one.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PositionBucket {
    /// First position of the bucket (`last / 2 + 1`).
    pub first: u64,
    /// Last position of the bucket (a power of two).
    pub last: u64,
    /// Tokens scored in the bucket.
    pub tokens: u64,
    /// Their mean loss, bits per token.
    pub bits_per_token: f64,
    /// Where each sublayer's attention went at these positions, when asked
    /// for ([`EvalOptions::attention`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub attention: Vec<AttentionShare>,
}

/// Sums of one position bucket (or of the whole split).
#[derive(Clone, Debug, Default)]
struct Sums {
    nats: f64,
    tokens: u64,
    /// Attention figures, [`attention::FIGURES`] per sublayer.
    attention: Vec<f64>,
}

impl Sums {
    fn add(&mut self, nats: f32, attention: &[f32]) {
        self.nats += nats as f64;
        self.tokens += 1;
        attention::accumulate(&mut self.attention, attention);
    }
}

/// Sums of the loss (and attention figures) by log2 position bucket, and
/// each row's position.
struct PositionTally {
    /// Tokens of its current document each row has read.
    read: Vec<u64>,
    /// Per bucket `k` (positions `2^k / 2 + 1 ..= 2^k`).
    buckets: Vec<Sums>,
    /// Over every token.
    total: Sums,
}

impl PositionTally {
    fn new(rows: usize) -> Self {
        Self {
            read: vec![0; rows],
            buckets: vec![],
            total: Sums::default(),
        }
    }

    /// Every row starts again at position 0 (a state reset).
    fn restart(&mut self) {
        self.read.iter_mut().for_each(|r| *r = 0);
    }

    /// Adds a batch's per-token losses `nll` (nats, row-major like the
    /// batch) and attention figures `attention` (the same tokens, each with
    /// [`attention::FIGURES`] per sublayer; empty when not measured).
    fn add(&mut self, batch: &Batch, nll: &[f32], attention: &[f32], eos: u32) {
        let per_token = attention.len() / nll.len().max(1);
        for (i, (&input, &loss)) in batch.inputs.iter().zip(nll).enumerate() {
            if !batch.valid[i] {
                continue;
            }
            let read = &mut self.read[i / batch.len];
            *read = if input == eos { 1 } else { *read + 1 };
            let k = read.next_power_of_two().ilog2() as usize;
            if self.buckets.len() <= k {
                self.buckets.resize(k + 1, Sums::default());
            }
            let figures = &attention[i * per_token..(i + 1) * per_token];
            self.buckets[k].add(loss, figures);
            self.total.add(loss, figures);
        }
    }

    fn buckets(&self) -> Vec<PositionBucket> {
        self.buckets
            .iter()
            .enumerate()
            .filter(|(_, s)| s.tokens > 0)
            .map(|(k, s)| PositionBucket {
                first: (1 << k) / 2 + 1,
                last: 1 << k,
                tokens: s.tokens,
                bits_per_token: s.nats / s.tokens as f64 / std::f64::consts::LN_2,
                attention: attention::means(&s.attention, s.tokens),
            })
            .collect()
    }
}

impl EvalReport {
    /// "loss L nats/token, X bits/byte" (a recall task: per answer, and
    /// the accuracy).
    pub fn summary(&self) -> String {
        match &self.recall {
            Some(r) => format!(
                "recall accuracy {:.2}% of {} answers, loss {:.4} nats/answer",
                100.0 * r.accuracy,
                r.answers,
                self.loss
            ),
            None => format!(
                "loss {:.4} nats/token, {:.4} bits/byte",
                self.loss, self.bits_per_byte
            ),
        }
    }
}

/// Scores `split` with `models` (copies of one plain, non-autodiff model,
/// one per device) in batches of `eval.batch_size` rows of
/// `eval.update_len` tokens ([`EvalBatches`]: each row walks its own
/// contiguous region of the split). The rows are cut into up to
/// `opts.workers` shards that run on their own threads
/// ([`map_in_workers`]), each carrying its own state; shard `g` runs on
/// `models[g mod len]`, where its state stays.
///
/// A recall task's split is scored example by example instead
/// ([`evaluate_recall`], on the first model): its loss per scored target
/// (the answers, or every token where the task scores its text) and its
/// accuracy, of the first `max_segments x eval.batch_size` examples, and
/// with `opts.attention` where the attention went at the answers.
pub fn evaluate(
    models: &[TransformerVq<B>],
    split: &TokenSplit,
    eval: &EvalSection,
    opts: &EvalOptions,
) -> Result<EvalReport, TrainError> {
    if let Some(recall) = &split.recall {
        if opts.by_position || opts.reset_every.is_some() {
            return Err(TrainError::Config {
                key: "eval".into(),
                reason: "--by-position and --reset-every do not apply to a recall task \
                         (each example is read from a fresh state)"
                    .into(),
            });
        }
        let examples = opts.max_segments.map(|m| m.saturating_mul(eval.batch_size));
        let scores = evaluate_recall(
            &models[0],
            split,
            recall,
            eval,
            examples,
            opts.progress,
            opts.attention,
        )?;
        let loss = scores.nll / scores.scored.max(1) as f64;
        let ln2 = std::f64::consts::LN_2;
        return Ok(EvalReport {
            split: split.split.to_string(),
            tokens: scores.scored,
            complete: scores.complete,
            loss,
            bits_per_token: loss / ln2,
            bits_per_byte: loss / ln2,
            token_perplexity: loss.exp(),
            word_perplexity: None,
            reset_every: None,
            by_position: None,
            attention: scores.attention,
            recall: Some(scores.report),
        });
    }
    let devices: Vec<_> = models.iter().map(|m| m.embedding.weight.device()).collect();
    crate::parallel::workers::check_device_list(&devices)?;
    let (batch, update_len) = (eval.batch_size, eval.update_len);
    check_reset_every(opts.reset_every, update_len)?;
    let batches = EvalBatches::new(split.clone(), batch, update_len)?;
    let total = batches.num_batches();
    let n = opts.max_segments.map_or(total, |m| m.min(total));
    let bar = progress_bar(
        opts.progress,
        n as u64,
        &format!(
            "eval {} [{{bar:30}}] {{pos}}/{{len}} eta {{eta}}",
            split.split
        ),
    );
    let model_of = |shard: usize| &models[shard % models.len()];
    let per_token = opts.by_position || opts.attention;
    // Rows [start, end) of every batch per shard: as even as possible.
    let shards = opts.workers.clamp(1, batch.max(1));
    let bounds: Vec<_> = (0..shards)
        .map(|g| g * batch / shards..(g + 1) * batch / shards)
        .collect();
    let empty_states = || (0..shards).map(|g| model_of(g).empty_state()).collect();
    let mut states: Vec<_> = empty_states();
    let mut positions = PositionTally::new(batch);
    let (mut nll, mut tokens) = (0f64, 0u64);
    for (k, b) in batches.take(n).enumerate() {
        let reset_now = opts
            .reset_every
            .is_some_and(|e| (k * update_len).is_multiple_of(e));
        if b.reset || reset_now {
            states = empty_states();
            positions.restart();
        }
        let work: Vec<_> = bounds
            .iter()
            .cloned()
            .zip(std::mem::take(&mut states))
            .enumerate()
            .collect();
        let scored = map_in_workers(
            work,
            shards,
            |_| (),
            |_, (shard, (rows, state))| score_rows(model_of(shard), &b, rows, state, opts),
        )?;
        let (mut batch_nll, mut batch_attention) = (vec![], vec![]);
        for shard in scored {
            nll += shard.nll;
            batch_nll.extend(shard.token_nll);
            batch_attention.extend(shard.attention);
            states.push(shard.state);
        }
        if per_token {
            positions.add(&b, &batch_nll, &batch_attention, split.eos);
        }
        tokens += b
            .targets
            .iter()
            .zip(&b.valid)
            .filter(|&(&t, &v)| v && t != PAD)
            .count() as u64;
        bar.inc(1);
    }
    bar.finish_and_clear();
    Ok(report(split, opts, (nll, tokens), n == total, &positions))
}

/// `--reset-every`, when given, must be a positive multiple of the segment.
fn check_reset_every(reset_every: Option<usize>, update_len: usize) -> Result<(), TrainError> {
    match reset_every {
        Some(every) if every == 0 || !every.is_multiple_of(update_len) => Err(TrainError::Config {
            key: "--reset-every".into(),
            reason: format!("must be a positive multiple of eval.update_len ({update_len})"),
        }),
        _ => Ok(()),
    }
}

/// The report of `tokens` scored `nll` nats in all, over the whole `split`
/// (`complete`) or a part of it.
fn report(
    split: &TokenSplit,
    opts: &EvalOptions,
    (nll, tokens): (f64, u64),
    complete: bool,
    positions: &PositionTally,
) -> EvalReport {
    // Share of the split's bytes (and words) behind the tokens scored.
    let share = match complete {
        true => 1.0,
        false => tokens as f64 / split.len().max(1) as f64,
    };
    let ln2 = std::f64::consts::LN_2;
    let loss = nll / tokens.max(1) as f64;
    EvalReport {
        split: split.split.to_string(),
        tokens,
        complete,
        loss,
        bits_per_token: loss / ln2,
        bits_per_byte: nll / ln2 / (split.stats.bytes as f64 * share).max(1.0),
        token_perplexity: loss.exp(),
        word_perplexity: split
            .stats
            .words
            .map(|w| (nll / (w as f64 * share).max(1.0)).exp()),
        reset_every: opts.reset_every,
        by_position: opts.by_position.then(|| positions.buckets()),
        attention: opts
            .attention
            .then(|| attention::means(&positions.total.attention, positions.total.tokens)),
        recall: None,
    }
}

/// What one shard of a batch's rows scored.
struct Scored {
    /// Summed loss, nats.
    nll: f64,
    /// Each token's loss, nats, row-major (empty unless measured by position
    /// or attention).
    token_nll: Vec<f32>,
    /// Each token's attention figures ([`attention::per_token`]).
    attention: Vec<f32>,
    /// The state carried to the next segment.
    state: ModelState<B>,
}

/// Scores rows `rows` of batch `b` with `model`, from `state`.
fn score_rows(
    model: &TransformerVq<B>,
    b: &Batch,
    rows: std::ops::Range<usize>,
    state: ModelState<B>,
    opts: &EvalOptions,
) -> Result<Scored, TrainError> {
    let BatchTensors {
        inputs,
        targets,
        valid,
    } = BatchTensors::rows(b, rows, &model.embedding.weight.device());
    let pass = Pass::new()
        .with_valid(valid.clone())
        .with_attention(opts.attention);
    let out = model.forward(inputs, state, pass)?;
    let loss = Loss::new(&out, targets, valid);
    let token_nll = match opts.by_position || opts.attention {
        true => loss.nll.into_data().convert::<f32>().to_vec().expect("f32"),
        false => vec![],
    };
    Ok(Scored {
        nll: loss.nll_sum.into_scalar().elem::<f64>(),
        token_nll,
        attention: attention::per_token(&out.attention),
        state: out.state,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::TrainSection;
    use crate::gpu_under_test::two_wgpu_devices;
    use crate::trainer::Trainer;
    use crate::trainer::tests::line_corpus;
    use burn::DispatchDevice;
    use tvq_model::TransformerVqConfig;
    use tvq_testkit::tiny_model;

    #[test]
    fn attention_figures_are_averaged_per_bucket_and_over_the_split() {
        // One row of 3 tokens (positions 1, 2, 3), two sublayers, the third
        // token padding.
        let batch = Batch {
            batch: 1,
            len: 3,
            inputs: vec![1, 5, 6],
            targets: vec![0; 3],
            valid: vec![true, true, false],
            reset: true,
        };
        let figures: Vec<f32> = (0..3 * 2 * attention::FIGURES).map(|i| i as f32).collect();
        let mut tally = PositionTally::new(1);
        tally.add(&batch, &[0.0; 3], &figures, 1);
        let b = tally.buckets();
        assert_eq!(b.len(), 2);
        // Position 1 alone: token 0's figures; sublayer 1 starts at F, token
        // 1 at 2 F (F figures per sublayer: 3 shares, 3 entropies, the count
        // weight).
        let f = attention::FIGURES as f64;
        assert_eq!(b[0].attention[0].share, [0.0, 1.0, 2.0]);
        assert_eq!(b[0].attention[1].entropy, [f + 3.0, f + 4.0, f + 5.0]);
        assert_eq!(b[0].attention[1].count_weight, f + 6.0);
        // Position 2: token 1; the padding is left out.
        assert_eq!(
            b[1].attention[0].share,
            [2.0 * f, 2.0 * f + 1.0, 2.0 * f + 2.0]
        );
        let total = attention::means(&tally.total.attention, tally.total.tokens);
        let want = [2.0 * f, 2.0 * f + 1.0, 2.0 * f + 2.0];
        assert_eq!(total[1].share, want, "(F + 3 F) / 2, ...");
    }

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
        tally.add(&batch, &nll, &[], 1);
        // Positions: row 0: 1 2 3 1 2 3; row 1: 1 2 3 4. Position 4 ends
        // the bucket 3..=4 rather than opening one of its own.
        let b = tally.buckets();
        let ln2 = std::f64::consts::LN_2;
        let expect = [
            (1, 1, 3, (0.0 + 3.0 + 6.0) / 3.0),
            (2, 2, 3, (1.0 + 4.0 + 7.0) / 3.0),
            (3, 4, 4, (2.0 + 5.0 + 8.0 + 9.0) / 4.0),
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
        carried.add(&next, &nll, &[], 1); // from 0: positions 1..=6
        carried.restart();
        carried.add(&next, &nll, &[], 1);
        assert_eq!(carried.buckets().iter().map(|b| b.tokens).sum::<u64>(), 24);
        assert_eq!(carried.buckets()[0].tokens, 4, "position 1 twice per row");
    }

    #[test]
    fn evaluation_on_two_devices_scores_like_one() {
        use crate::config::EvalSection;
        use crate::inference::evaluate::{EvalOptions, evaluate};
        use tvq_data::Split;
        let Some([a, b]) = two_wgpu_devices("evaluation_on_two_devices_scores_like_one") else {
            return;
        };
        let dir = tempfile::tempdir().unwrap();
        let corpus = line_corpus(dir.path(), 600);
        let split = corpus.split(Split::Validation);
        let model = TransformerVqConfig {
            vocab_size: corpus.vocab.size(),
            ..tiny_model(11)
        };
        let settings = TrainSection {
            workers: 2,
            ..TrainSection::default()
        };
        let eval = EvalSection {
            batch_size: 4,
            update_len: 8,
            ..EvalSection::default()
        };
        let opts = EvalOptions {
            workers: 2,
            attention: true,
            ..EvalOptions::default()
        };
        let score = |devices: &[DispatchDevice]| {
            let t = Trainer::new(&model, &settings, devices).unwrap();
            let models = t.inference_models();
            assert_eq!(models.len(), devices.len(), "one copy per device");
            for (m, d) in models.iter().zip(devices) {
                assert_eq!(m.embedding.weight.device(), *d);
            }
            evaluate(&models, &split, &eval, &opts).unwrap()
        };
        let one = score(std::slice::from_ref(&a));
        let two = score(&[a, b]);
        assert!(one.complete && one.tokens > 0 && one.tokens == two.tokens);
        assert!(
            (one.loss - two.loss).abs() <= 1e-5 * one.loss,
            "{} {}",
            one.loss,
            two.loss
        );
    }
}
