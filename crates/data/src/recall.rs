//! Synthetic recall tasks as corpora: does a model find, far back in its
//! context, what it was told?
//!
//! **Multi-query associative recall (MQAR)**, after Zoology (Arora et al.
//! 2023, arXiv 2312.04927). Each example is one sequence of
//! `data.sequence_len` tokens: first `pairs` key-value pairs, then the
//! query region, where `queries` of the keys appear again, each at a random
//! place, each followed by its value. Only the values that follow a query
//! are scored: the model must have kept the pair since it was read. As in
//! Zoology:
//! - keys and values come from disjoint halves of a task vocabulary of
//!   `vocab` symbols (keys `1..vocab/2`, values `vocab/2..vocab`), the keys
//!   of one example distinct, the values drawn freely;
//! - a query occupies two places (the key, then its value), at an even
//!   offset of the query region.
//!
//! Where no query stands, the query region holds symbol 0 by default
//! (`filler = "zero"`), or, as in Zoology's default, any symbol of the task
//! vocabulary (`filler = "random"`): keys then reappear as distractors,
//! followed by symbols that are not their values. Queries are placed
//! uniformly over the query region by default, so that the distance
//! between pair and query is spread over the whole sequence (each answer's
//! distance is recorded, and accuracy is reported by distance), or by
//! Zoology's power law (`power_a`), which puts most queries near the
//! pairs. tvq may also ask for fewer keys than there are pairs (`queries`).
//! Symbols are bytes: symbol `s` is the
//! byte-level token `s + 3`, so a recall model uses the byte vocabulary and
//! its samples decode as bytes; hence `vocab <= 256` and `pairs < vocab/2`.
//! With `role_period = P` (tvq's own), the halves repeat every `P` symbols
//! instead (keys `1..P/2`, `P..3P/2`, ...; values `P/2..P`, `3P/2..2P`,
//! ...), so that a curriculum that raises `vocab` from `P` keeps every
//! symbol's role: under the default halves, raising `vocab` from 64 to 128
//! would make the 64-symbol values `32..64` keys.
//!
//! **Passkey retrieval**, as in long-context work: text from a corpus as
//! filler, with " The pass key is 48213. Remember it. " at a random depth,
//! and at the end " What is the pass key? The pass key is " followed by the
//! key, whose digits are the answers. Each example's filler starts at a
//! random place of its split's text.
//!
//! Every example is a pure function of the task's seed, its split and its
//! index (and, for passkeys, the text), so a split is the same on every
//! machine and a run resumes exactly.
//!
//! **Examples made elsewhere** ([`read_task_file`], `tvq eval
//! --task-file`): a JSON Lines file, one example per line, `{"tokens":
//! [ids], "answers": [{"pos": p, "token": id, "distance": d}]}`. `tokens`
//! are ids of the model's vocabulary (for a byte-level model, byte `b` is
//! id `b + 3`); answer `pos` is the index in `tokens` of a token the model
//! must predict from the tokens before it, `token` repeats it (a check),
//! and `distance` (optional; default `pos`) is how far back it was given.

use std::io::BufRead;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::DataError;
use crate::hash::{SplitMix64, splitmix64};
use crate::vocab::PAD;

/// The `[data.mqar]` table: the task's shape and how many examples each
/// split holds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MqarConfig {
    /// Key-value pairs at the start of every example.
    #[serde(default = "defaults::pairs")]
    pub pairs: usize,
    /// Keys asked for in the query region (default: every key).
    #[serde(default)]
    pub queries: Option<usize>,
    /// Symbols of the task vocabulary: keys are `1..vocab/2`, values
    /// `vocab/2..vocab` (at most 256: symbols are bytes).
    #[serde(default = "defaults::vocab")]
    pub vocab: usize,
    /// Symbols whose halves split into keys and values, repeated up to
    /// `vocab` (default: `vocab`, one split): symbol `s` is a value where
    /// `s % role_period >= role_period / 2`, a key otherwise (0 is the
    /// filler). Set it to an earlier stage's `vocab` to grow the vocabulary
    /// with every symbol keeping its role.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role_period: Option<usize>,
    /// Examples in the training split.
    #[serde(default = "defaults::train_examples")]
    pub train_examples: usize,
    /// Examples in each of the validation and test splits.
    #[serde(default = "defaults::eval_examples")]
    pub eval_examples: usize,
    /// Seed of the examples (the training order is the run's `train.seed`).
    #[serde(default)]
    pub seed: u64,
    /// What fills the query region where no query stands.
    #[serde(default, skip_serializing_if = "Filler::is_zero")]
    pub filler: Filler,
    /// Zoology's power law of query places: the query region's slot `k`
    /// (`1..`) weighs `k^(power_a - 1)`, so Zoology's 0.01 puts most
    /// queries near the pairs and 1 is uniform; absent: uniform.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub power_a: Option<f64>,
}

/// What fills an MQAR example's query region where no query stands.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Filler {
    /// Symbol 0, which is neither a key nor a value (tvq's default).
    #[default]
    Zero,
    /// Any symbol of the task vocabulary, uniformly (Zoology's default):
    /// keys reappear followed by symbols that are not their values, as
    /// distractors.
    Random,
}

impl Filler {
    fn is_zero(&self) -> bool {
        *self == Filler::Zero
    }
}

mod defaults {
    pub fn pairs() -> usize {
        16
    }
    pub fn vocab() -> usize {
        256
    }
    pub fn train_examples() -> usize {
        8192
    }
    pub fn eval_examples() -> usize {
        256
    }
    pub fn digits() -> usize {
        5
    }
}

impl Default for MqarConfig {
    fn default() -> Self {
        Self {
            pairs: defaults::pairs(),
            queries: None,
            vocab: defaults::vocab(),
            role_period: None,
            train_examples: defaults::train_examples(),
            eval_examples: defaults::eval_examples(),
            seed: 0,
            filler: Filler::Zero,
            power_a: None,
        }
    }
}

/// One scored target of a recall split.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Answer {
    /// Position in the split of the target that is the answer.
    pub pos: usize,
    /// Tokens between the answer and the place it was given (the value of
    /// the pair, for MQAR): how far back the model must look.
    pub distance: usize,
}

/// What makes a split a recall task: its examples' length and the targets
/// that are scored. Every other target is not.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecallSet {
    /// Tokens per example; example `i` is tokens `i * example_len ..`.
    pub example_len: usize,
    /// The scored targets, sorted by position.
    pub answers: Vec<Answer>,
    /// Whether the target at each position of the split is scored.
    scored: Vec<bool>,
}

impl RecallSet {
    /// Whether the target at position `pos` of the split is scored.
    pub fn is_scored(&self, pos: usize) -> bool {
        self.scored.get(pos).copied().unwrap_or(false)
    }

    /// Number of examples.
    pub fn examples(&self) -> usize {
        self.scored.len() / self.example_len.max(1)
    }
}

/// One generated example: its symbols (bytes) and its answers (positions
/// within the example).
#[derive(Clone, Debug, PartialEq, Eq)]
struct Example {
    symbols: Vec<u8>,
    answers: Vec<Answer>,
}

impl MqarConfig {
    /// Keys asked for per example.
    pub fn num_queries(&self) -> usize {
        self.queries.unwrap_or(self.pairs)
    }

    /// The symbols split into keys and values, repeated up to `vocab`.
    fn period(&self) -> usize {
        self.role_period.unwrap_or(self.vocab)
    }

    /// Key number `i` (`0..vocab/2 - 1`), in increasing order of symbols.
    fn key_symbol(&self, i: usize) -> u8 {
        let half = self.period() / 2;
        // Counting the filler 0 as key number -1.
        let m = i + 1;
        (m / half * 2 * half + m % half) as u8
    }

    /// Value number `j` (`0..vocab/2`), in increasing order of symbols.
    fn value_symbol(&self, j: usize) -> u8 {
        let half = self.period() / 2;
        (j / half * 2 * half + half + j % half) as u8
    }

    /// Whether examples of `len` tokens can hold this task: one line saying
    /// which setting to change where not.
    pub fn check(&self, len: usize) -> Result<(), DataError> {
        let bad = |reason: String| Err(DataError::Unsupported(format!("data.mqar: {reason}")));
        if self.vocab > 256 || self.vocab < 4 || !self.vocab.is_multiple_of(2) {
            return bad(format!(
                "vocab must be even and within 4..=256 (symbols are bytes), not {}",
                self.vocab
            ));
        }
        let period = self.period();
        if period < 2 || !period.is_multiple_of(2) || !self.vocab.is_multiple_of(period) {
            return bad(format!(
                "role_period must be even and divide vocab ({}), not {period}",
                self.vocab
            ));
        }
        let keys = self.vocab / 2 - 1;
        if self.pairs == 0 || self.pairs > keys {
            return bad(format!(
                "pairs must be within 1..={keys} (the distinct keys of a vocab of {}), not {}",
                self.vocab, self.pairs
            ));
        }
        let queries = self.num_queries();
        if queries == 0 || queries > self.pairs {
            return bad(format!(
                "queries must be within 1..={} (the pairs), not {queries}",
                self.pairs
            ));
        }
        let needed = 2 * self.pairs + 2 * queries;
        if needed > len {
            return bad(format!(
                "{} pairs and {queries} queries take {needed} tokens, more than the \
                 {len}-token sequences (data.sequence_len)",
                self.pairs
            ));
        }
        if self.train_examples == 0 || self.eval_examples == 0 {
            return bad("train_examples and eval_examples must be at least 1".into());
        }
        if let Some(a) = self.power_a
            && !(a > 0.0 && a <= 1.0)
        {
            return bad(format!(
                "power_a must be within (0, 1] (1 is uniform, Zoology's is 0.01), not {a}"
            ));
        }
        Ok(())
    }

    /// Example `index` of set `set` (a split), `len` tokens long.
    fn example(&self, set: u64, index: usize, len: usize) -> Example {
        let rng = &mut stream(self.seed, set, index);
        let (half, pairs) = (self.vocab / 2, self.pairs);
        // Distinct keys: a partial Fisher-Yates shuffle of every key.
        let mut keys: Vec<u8> = (0..half - 1).map(|i| self.key_symbol(i)).collect();
        for i in 0..pairs {
            let j = i + below(rng, keys.len() - i);
            keys.swap(i, j);
        }
        let values: Vec<u8> = (0..pairs)
            .map(|_| self.value_symbol(below(rng, half)))
            .collect();
        let mut symbols = vec![0u8; len];
        for i in 0..pairs {
            symbols[2 * i] = keys[i];
            symbols[2 * i + 1] = values[i];
        }
        // Which pairs are asked for, and at which of the query region's
        // two-token slots (each slot's weight under the power law).
        let mut asked: Vec<usize> = (0..pairs).collect();
        let mut slots: Vec<usize> = (0..(len - 2 * pairs) / 2).collect();
        let weights: Option<Vec<f64>> = self.power_a.map(|a| {
            (1..=slots.len())
                .map(|k| (k as f64).powf(a - 1.0))
                .collect()
        });
        let mut asked_at = vec![false; len];
        let mut answers = Vec::with_capacity(self.num_queries());
        for q in 0..self.num_queries() {
            let a = q + below(rng, pairs - q);
            asked.swap(q, a);
            let s = q + match &weights {
                None => below(rng, slots.len() - q),
                Some(w) => weighted(rng, slots[q..].iter().map(|&slot| w[slot])),
            };
            slots.swap(q, s);
            let (pair, at) = (asked[q], 2 * pairs + 2 * slots[q]);
            symbols[at] = keys[pair];
            symbols[at + 1] = values[pair];
            asked_at[at..at + 2].fill(true);
            answers.push(Answer {
                pos: at + 1,
                distance: at - 2 * pair,
            });
        }
        if self.filler == Filler::Random {
            for (symbol, _) in (symbols.iter_mut().zip(&asked_at))
                .skip(2 * pairs)
                .filter(|(_, asked)| !**asked)
            {
                *symbol = below(rng, self.vocab) as u8;
            }
        }
        answers.sort_by_key(|a| a.pos);
        Example { symbols, answers }
    }

    /// The symbols (bytes) of `n` examples of `len` tokens of set `set`
    /// (each split its own), back to back, and which targets are scored.
    pub fn examples(
        &self,
        set: u64,
        n: usize,
        len: usize,
    ) -> Result<(Vec<u8>, RecallSet), DataError> {
        self.check(len)?;
        gather("data.mqar", n, len, |i| self.example(set, i, len))
    }
}

/// A draw from `0..n`.
fn below(rng: &mut SplitMix64, n: usize) -> usize {
    (rng.next_u64() % n as u64) as usize
}

/// A draw of an index of `weights` (not all zero), each as likely as its
/// weight.
fn weighted(rng: &mut SplitMix64, weights: impl Iterator<Item = f64> + Clone) -> usize {
    let total: f64 = weights.clone().sum();
    // 53 random bits: a uniform draw from [0, 1).
    let mut u = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64 * total;
    let mut last = 0;
    for (i, w) in weights.enumerate() {
        if u < w {
            return i;
        }
        u -= w;
        last = i;
    }
    // Rounding left `u` past the last weight.
    last
}

/// The random stream of example `index` of set `set` of a task seeded `seed`.
fn stream(seed: u64, set: u64, index: usize) -> SplitMix64 {
    SplitMix64(splitmix64(seed) ^ splitmix64(set << 48 | index as u64))
}

/// `n` examples of `len` tokens, made by `example`, back to back, and
/// their answers.
fn gather(
    task: &str,
    n: usize,
    len: usize,
    example: impl Fn(usize) -> Example,
) -> Result<(Vec<u8>, RecallSet), DataError> {
    if n.checked_mul(len).is_none_or(|total| total > 1 << 32) {
        return Err(DataError::Unsupported(format!(
            "{task}: {n} examples of {len} tokens are more than 2^32 tokens"
        )));
    }
    let examples = (0..n).map(|i| {
        let example = example(i);
        debug_assert_eq!(example.symbols.len(), len);
        (example.symbols, example.answers)
    });
    Ok(lay_out(n, len, 0, examples))
}

/// The `n` `examples` (tokens and answers, each answer's position within
/// its example) back to back, each padded with `pad` to `len` tokens, and
/// the recall set that finds their answers in the split.
fn lay_out<T: Copy>(
    n: usize,
    len: usize,
    pad: T,
    examples: impl Iterator<Item = (Vec<T>, Vec<Answer>)>,
) -> (Vec<T>, RecallSet) {
    let (mut tokens, mut scored, mut answers) =
        (Vec::with_capacity(n * len), vec![false; n * len], vec![]);
    for (i, (example, mut example_answers)) in examples.enumerate() {
        example_answers.sort_by_key(|a| a.pos);
        for a in example_answers {
            let pos = i * len + a.pos;
            scored[pos] = true;
            answers.push(Answer { pos, ..a });
        }
        let real = example.len();
        tokens.extend(example);
        tokens.extend(std::iter::repeat_n(pad, len - real));
    }
    let set = RecallSet {
        example_len: len,
        answers,
        scored,
    };
    (tokens, set)
}

/// Most bytes of a task file (`tvq eval --task-file`): it is read whole.
pub const TASK_FILE_MAX_BYTES: u64 = 1 << 30;

/// Most tokens of a task file's examples, once each is padded to the
/// longest.
pub const TASK_FILE_MAX_TOKENS: usize = 1 << 28;

/// One line of a task file.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TaskLine {
    tokens: Vec<u32>,
    answers: Vec<TaskAnswer>,
}

/// One answer of a task file's line.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TaskAnswer {
    pos: usize,
    token: u32,
    #[serde(default)]
    distance: Option<usize>,
}

/// Reads the recall examples of a task file (the module's docs give its
/// format) for a model of `vocab_size` ids: the ids of every example back
/// to back, each padded with `PAD` (id 0, never scored) to the longest,
/// and the answers. A malformed line, an id outside the vocabulary or an
/// answer that does not match its token is an error naming the line.
pub fn read_task_file(path: &Path, vocab_size: usize) -> Result<(Vec<u32>, RecallSet), DataError> {
    let file = std::fs::File::open(path).map_err(|e| DataError::io(path, e))?;
    let size = file.metadata().map_err(|e| DataError::io(path, e))?.len();
    let bad = |reason: String| DataError::Unsupported(format!("{}: {reason}", path.display()));
    if size > TASK_FILE_MAX_BYTES {
        return Err(bad(format!(
            "{size} bytes, more than a task file may hold ({TASK_FILE_MAX_BYTES})"
        )));
    }
    let mut examples = vec![];
    for (i, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line.map_err(|e| DataError::io(path, e))?;
        if line.trim().is_empty() {
            continue;
        }
        let at = |reason: String| bad(format!("line {}: {reason}", i + 1));
        let example: TaskLine = serde_json::from_str(&line).map_err(|e| at(e.to_string()))?;
        check_task_line(&example, vocab_size).map_err(at)?;
        examples.push(example);
    }
    let len = examples.iter().map(|e| e.tokens.len()).max().unwrap_or(0);
    if examples.iter().all(|e| e.answers.is_empty()) {
        return Err(bad("no example has an answer".into()));
    }
    if examples.len().saturating_mul(len) > TASK_FILE_MAX_TOKENS {
        return Err(bad(format!(
            "{} examples padded to {len} tokens are more than {TASK_FILE_MAX_TOKENS} tokens",
            examples.len()
        )));
    }
    let n = examples.len();
    let examples = examples.into_iter().map(|line| {
        let answers = (line.answers.iter())
            .map(|a| Answer {
                pos: a.pos,
                distance: a.distance.unwrap_or(a.pos),
            })
            .collect();
        (line.tokens, answers)
    });
    Ok(lay_out(n, len, PAD, examples))
}

/// What is wrong with one line of a task file, if anything.
fn check_task_line(line: &TaskLine, vocab_size: usize) -> Result<(), String> {
    if line.tokens.is_empty() {
        return Err("no tokens".into());
    }
    if let Some(t) = line.tokens.iter().find(|&&t| t as usize >= vocab_size) {
        return Err(format!("token {t} is outside the model's {vocab_size} ids"));
    }
    let mut seen = std::collections::HashSet::new();
    for a in &line.answers {
        match line.tokens.get(a.pos) {
            None => {
                return Err(format!(
                    "an answer at {} of {} tokens",
                    a.pos,
                    line.tokens.len()
                ));
            }
            Some(&t) if t != a.token => {
                return Err(format!("the answer at {} is {}, not {t}", a.pos, a.token));
            }
            _ => {}
        }
        if !seen.insert(a.pos) {
            return Err(format!("two answers at {}", a.pos));
        }
    }
    Ok(())
}

/// The `[data.passkey]` table: passkey retrieval in a text.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PasskeyConfig {
    /// Digits of the passkey.
    #[serde(default = "defaults::digits")]
    pub digits: usize,
    /// Examples in the training split.
    #[serde(default = "defaults::train_examples")]
    pub train_examples: usize,
    /// Examples in each of the validation and test splits.
    #[serde(default = "defaults::eval_examples")]
    pub eval_examples: usize,
    /// Seed of the examples (the training order is the run's `train.seed`).
    #[serde(default)]
    pub seed: u64,
    /// Score every target, the filler text's too, not only the key's
    /// digits: the text is then a language-modelling corpus with a passkey
    /// mixed into every example, and the accuracy is still the digits'.
    /// Written only when set, so configs from before it read the same.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub score_text: bool,
    /// With `score_text`, the share of the training examples (spread
    /// evenly over them) scored on their digits only: answer-only passkeys
    /// mixed into language modelling. The validation and test examples are
    /// scored whole, so their bits per byte stay comparable. With
    /// `train.loss_mean = "row"` an answer-only example's digits weigh as
    /// much as a text example's tokens. Written only when set.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub answer_only_share: f64,
}

fn is_zero(x: &f64) -> bool {
    *x == 0.0
}

impl Default for PasskeyConfig {
    fn default() -> Self {
        Self {
            digits: defaults::digits(),
            train_examples: defaults::train_examples(),
            eval_examples: defaults::eval_examples(),
            seed: 0,
            score_text: false,
            answer_only_share: 0.0,
        }
    }
}

/// What stands before the passkey, and after it, where it is given.
const NEEDLE: [&str; 2] = [" The pass key is ", ". Remember it. "];
/// The question at the end of every example, after which the passkey's
/// digits are the answers.
const QUESTION: &str = " What is the pass key? The pass key is ";

impl PasskeyConfig {
    /// Tokens of an example that are not filler text.
    fn fixed_len(&self) -> usize {
        NEEDLE[0].len() + self.digits + NEEDLE[1].len() + QUESTION.len() + self.digits
    }

    /// Whether examples of `len` tokens, whose filler is drawn from a text
    /// of `text_len` bytes, can hold this task.
    pub fn check(&self, len: usize, text_len: usize) -> Result<(), DataError> {
        let bad = |reason: String| Err(DataError::Unsupported(format!("data.passkey: {reason}")));
        if !(1..=16).contains(&self.digits) {
            return bad(format!("digits must be within 1..=16, not {}", self.digits));
        }
        if len <= self.fixed_len() {
            return bad(format!(
                "an example takes {} tokens besides its filler text: data.sequence_len ({len}) \
                 must be longer",
                self.fixed_len()
            ));
        }
        if text_len < len {
            return bad(format!(
                "the text's split has {text_len} bytes, fewer than one {len}-token example \
                 (data.sequence_len)"
            ));
        }
        if self.train_examples == 0 || self.eval_examples == 0 {
            return bad("train_examples and eval_examples must be at least 1".into());
        }
        if !(0.0..=1.0).contains(&self.answer_only_share) {
            return bad("answer_only_share must be within [0, 1]".into());
        }
        if self.answer_only_share > 0.0 && !self.score_text {
            return bad(
                "answer_only_share needs score_text = true (without it every example is \
                 answer-only)"
                    .into(),
            );
        }
        Ok(())
    }

    /// Example `index` of set `set`: filler bytes of `text` (`text_len`
    /// bytes) from a random place, the needle at a random depth, the
    /// question at the end; the answers are the digits after it.
    fn example(
        &self,
        set: u64,
        index: usize,
        len: usize,
        text: &impl Fn(usize) -> u8,
        text_len: usize,
    ) -> Example {
        let mut rng = stream(self.seed, set, index);
        let mut below = |n: usize| (rng.next_u64() % n as u64) as usize;
        let key: Vec<u8> = (0..self.digits).map(|_| b'0' + below(10) as u8).collect();
        let filler = len - self.fixed_len();
        let (from, depth) = (below(text_len - filler + 1), below(filler + 1));
        let mut symbols: Vec<u8> = (from..from + depth).map(text).collect();
        symbols.extend(NEEDLE[0].bytes());
        let given = symbols.len();
        symbols.extend(&key);
        symbols.extend(NEEDLE[1].bytes());
        symbols.extend((from + depth..from + filler).map(text));
        symbols.extend(QUESTION.bytes());
        let asked = symbols.len();
        symbols.extend(&key);
        let answers = (0..self.digits)
            .map(|i| Answer {
                pos: asked + i,
                distance: asked - given,
            })
            .collect();
        Example { symbols, answers }
    }

    /// `n` examples of `len` tokens of set `set` (each split its own), with
    /// filler from `text` (`text_len` bytes), back to back, and which
    /// targets are scored; `training` says whether the set is the
    /// training split, of which `answer_only_share` score their digits
    /// alone.
    pub fn examples(
        &self,
        set: u64,
        training: bool,
        n: usize,
        len: usize,
        text: impl Fn(usize) -> u8,
        text_len: usize,
    ) -> Result<(Vec<u8>, RecallSet), DataError> {
        self.check(len, text_len)?;
        let (symbols, mut recall) = gather("data.passkey", n, len, |i| {
            self.example(set, i, len, &text, text_len)
        })?;
        if self.score_text {
            for (i, example) in recall.scored.chunks_mut(len).enumerate() {
                if !(training && self.is_answer_only(i)) {
                    example.fill(true);
                }
            }
        }
        Ok((symbols, recall))
    }

    /// Whether training example `index` is scored on its digits only:
    /// where `index * answer_only_share` passes a whole number, so that
    /// every run of examples holds its share of them.
    fn is_answer_only(&self, index: usize) -> bool {
        let s = self.answer_only_share;
        ((index + 1) as f64 * s).floor() > (index as f64 * s).floor()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn task(pairs: usize, queries: Option<usize>) -> MqarConfig {
        MqarConfig {
            pairs,
            queries,
            vocab: 64,
            role_period: None,
            train_examples: 8,
            eval_examples: 4,
            seed: 7,
            ..Default::default()
        }
    }

    #[test]
    fn every_answer_is_the_value_paired_with_the_key_before_it() {
        let cfg = task(12, None);
        let len = 96;
        let (symbols, set) = cfg.examples(0, 8, len).unwrap();
        assert_eq!(symbols.len(), 8 * len);
        assert_eq!(set.answers.len(), 8 * 12);
        assert_eq!(set.examples(), 8);
        for a in &set.answers {
            let start = a.pos / len * len;
            let example = &symbols[start..start + len];
            let (key, value) = (example[a.pos - start - 1], example[a.pos - start]);
            assert!(
                (1..32).contains(&key) && (32..64).contains(&value),
                "{key} {value}"
            );
            // The pair: `distance` back, the same key and value, in the
            // pair region.
            let given = a.pos - start - a.distance;
            assert!(given < 2 * 12 && given % 2 == 1, "{a:?}");
            assert_eq!((example[given - 1], example[given]), (key, value));
            assert!(set.is_scored(a.pos) && !set.is_scored(a.pos - 1));
        }
        // Keys are distinct within an example, and every key is asked once.
        for e in symbols.chunks(len) {
            let mut keys: Vec<u8> = e[..24].iter().step_by(2).copied().collect();
            keys.sort();
            keys.dedup();
            assert_eq!(keys.len(), 12);
            let asked = e[24..].iter().filter(|&&s| (1..32).contains(&s)).count();
            assert_eq!(asked, 12);
        }
        // Only the answers are scored.
        let scored = (0..symbols.len()).filter(|&p| set.is_scored(p)).count();
        assert_eq!(scored, set.answers.len());
    }

    /// The symbols and answers (position, distance) of
    /// `task(4, Some(2))`'s first validation example of 24 tokens, as the
    /// generator made them before `role_period` (commit 8b23942).
    const PINNED: [u8; 24] = [
        5, 36, 20, 51, 23, 36, 17, 42, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 5, 36, 0, 0, 23, 36,
    ];
    const PINNED_ANSWERS: [(usize, usize); 2] = [(19, 18), (23, 18)];

    #[test]
    fn examples_do_not_change_across_versions() {
        // So that a run resumes on the examples it trained on, and a
        // recorded figure reproduces.
        let (symbols, set) = task(4, Some(2)).examples(1, 1, 24).unwrap();
        assert_eq!(symbols, PINNED);
        let answers: Vec<(usize, usize)> =
            set.answers.iter().map(|a| (a.pos, a.distance)).collect();
        assert_eq!(answers, PINNED_ANSWERS);
    }

    /// Zoology's layout: random filler and power-law query places.
    fn zoology(pairs: usize) -> MqarConfig {
        MqarConfig {
            filler: Filler::Random,
            power_a: Some(0.01),
            ..task(pairs, None)
        }
    }

    #[test]
    fn among_random_filler_every_answer_is_still_the_value_paired_with_its_key() {
        let (pairs, len) = (8, 128);
        let (symbols, set) = zoology(pairs).examples(0, 64, len).unwrap();
        assert_eq!(set.answers.len(), 64 * pairs);
        let mut distractors = 0;
        for (n, e) in symbols.chunks(len).enumerate() {
            let region = &e[..2 * pairs];
            let answers: Vec<&Answer> = (set.answers.iter()).filter(|a| a.pos / len == n).collect();
            for a in &answers {
                let pos = a.pos % len;
                let (key, value) = (e[pos - 1], e[pos]);
                // The key is in the pair region once, with this value, as
                // far back as `distance` says.
                let given: Vec<usize> = (0..pairs).filter(|&i| region[2 * i] == key).collect();
                assert_eq!(given.len(), 1, "{key} in {region:?}");
                assert_eq!(region[2 * given[0] + 1], value);
                assert_eq!(pos - a.distance, 2 * given[0] + 1);
            }
            // Filler: every symbol of the vocabulary, keys of this example
            // among them, each followed by whatever came.
            let asked: Vec<usize> = answers
                .iter()
                .flat_map(|a| [a.pos % len - 1, a.pos % len])
                .collect();
            for p in (2 * pairs..len).filter(|p| !asked.contains(p)) {
                assert!(e[p] < 64);
                distractors += usize::from((0..pairs).any(|i| region[2 * i] == e[p]));
            }
        }
        assert!(
            distractors > 64,
            "{distractors} distractor keys in 64 examples"
        );
    }

    #[test]
    fn a_small_power_a_puts_queries_near_the_pairs() {
        // The share of queries in the first quarter of the query region:
        // about a quarter when places are uniform, most under Zoology's
        // power law (0.73 expected with 0.01 and 56 slots).
        let near = |cfg: &MqarConfig| {
            let (pairs, len) = (cfg.pairs, 128);
            let (_, set) = cfg.examples(0, 200, len).unwrap();
            let slots = (len - 2 * pairs) / 2;
            let near = (set.answers.iter())
                .filter(|a| (a.pos % len - 1 - 2 * pairs) / 2 < slots / 4)
                .count();
            near as f64 / set.answers.len() as f64
        };
        let (uniform, power) = (near(&task(8, None)), near(&zoology(8)));
        assert!((0.15..0.35).contains(&uniform), "uniform: {uniform}");
        assert!(power > 0.6, "power law: {power}");
        // power_a = 1 is uniform again.
        let flat = near(&MqarConfig {
            power_a: Some(1.0),
            ..task(8, None)
        });
        assert!((0.15..0.35).contains(&flat), "power_a = 1: {flat}");
    }

    /// `zoology(4)`'s first validation example of 32 tokens: symbols and
    /// answers (position, distance).
    const PINNED_ZOOLOGY: [u8; 32] = [
        5, 36, 20, 51, 23, 36, 17, 42, 5, 36, 23, 36, 61, 55, 11, 53, 12, 38, 20, 51, 17, 42, 49,
        58, 9, 40, 41, 23, 27, 41, 53, 25,
    ];
    const PINNED_ZOOLOGY_ANSWERS: [(usize, usize); 4] = [(9, 8), (11, 6), (19, 16), (21, 14)];

    #[test]
    fn zoology_layout_examples_do_not_change_across_versions() {
        let (symbols, set) = zoology(4).examples(1, 1, 32).unwrap();
        let answers: Vec<(usize, usize)> =
            set.answers.iter().map(|a| (a.pos, a.distance)).collect();
        assert_eq!(symbols, PINNED_ZOOLOGY);
        assert_eq!(answers, PINNED_ZOOLOGY_ANSWERS);
    }

    #[test]
    fn a_power_a_outside_zero_to_one_is_one_line() {
        for a in [0.0, -1.0, 1.5, f64::NAN, f64::INFINITY] {
            let cfg = MqarConfig {
                power_a: Some(a),
                ..task(4, None)
            };
            let e = cfg.check(64).unwrap_err().to_string();
            assert!(
                e.starts_with("data.mqar: power_a") && !e.contains('\n'),
                "{e}"
            );
        }
        // And the filler's names are these two.
        let cfg: MqarConfig = serde_json::from_str(r#"{"filler": "random"}"#).unwrap();
        assert_eq!(cfg.filler, Filler::Random);
        assert!(serde_json::from_str::<MqarConfig>(r#"{"filler": "noise"}"#).is_err());
    }

    #[test]
    fn a_role_period_keeps_every_symbols_role_as_the_vocabulary_grows() {
        let small = task(12, None);
        let grown = MqarConfig {
            vocab: 128,
            role_period: Some(64),
            pairs: 40,
            ..small.clone()
        };
        let keys_and_values = |cfg: &MqarConfig| {
            let len = 4 * cfg.pairs;
            let (symbols, _) = cfg.examples(0, 64, len).unwrap();
            let (mut keys, mut values) = (vec![], vec![]);
            for e in symbols.chunks(len) {
                for pair in e[..2 * cfg.pairs].chunks(2) {
                    keys.push(pair[0]);
                    values.push(pair[1]);
                }
            }
            for v in [&mut keys, &mut values] {
                v.sort();
                v.dedup();
            }
            (keys, values)
        };
        let (small_keys, small_values) = keys_and_values(&small);
        assert_eq!(small_keys, (1..32).collect::<Vec<u8>>());
        assert_eq!(small_values, (32..64).collect::<Vec<u8>>());
        // 128 symbols: every key and value of 64 keeps its role, and the
        // new symbols repeat the split.
        let (grown_keys, grown_values) = keys_and_values(&grown);
        assert_eq!(grown_keys, (1..32).chain(64..96).collect::<Vec<u8>>());
        assert_eq!(grown_values, (32..64).chain(96..128).collect::<Vec<u8>>());
        // One period over the whole vocabulary is the default's halves.
        let one_period = MqarConfig {
            role_period: Some(64),
            ..small.clone()
        };
        assert_eq!(
            one_period.examples(0, 8, 48).unwrap(),
            small.examples(0, 8, 48).unwrap()
        );
    }

    #[test]
    fn splits_are_deterministic_distinct_and_seeded() {
        let cfg = task(4, Some(2));
        let a = cfg.examples(1, 4, 32).unwrap();
        assert_eq!(a, cfg.examples(1, 4, 32).unwrap());
        assert_ne!(a.0, cfg.examples(2, 4, 32).unwrap().0);
        let other = MqarConfig {
            seed: 8,
            ..cfg.clone()
        };
        assert_ne!(a.0, other.examples(1, 4, 32).unwrap().0);
        assert_eq!(a.1.answers.len(), 4 * 2);
        // A set's first examples do not depend on how many it holds.
        assert_eq!(cfg.examples(1, 2, 32).unwrap().0, a.0[..64]);
    }

    #[test]
    fn a_passkey_is_asked_for_at_the_end_of_its_filler() {
        let text = b"In the beginning God created the heaven and the earth. ".repeat(20);
        let cfg = PasskeyConfig {
            digits: 5,
            train_examples: 6,
            eval_examples: 2,
            seed: 3,
            score_text: false,
            answer_only_share: 0.0,
        };
        let len = 160;
        let (symbols, set) = cfg
            .examples(0, true, 6, len, |i| text[i], text.len())
            .unwrap();
        assert_eq!((symbols.len(), set.answers.len()), (6 * len, 6 * 5));
        let mut depths = vec![];
        for (e, example) in symbols.chunks(len).enumerate() {
            let s = String::from_utf8(example.to_vec()).unwrap();
            let asked = s.rfind(QUESTION).unwrap() + QUESTION.len();
            let key = &s[asked..];
            assert_eq!(key.len(), 5);
            assert!(key.bytes().all(|b| b.is_ascii_digit()));
            let given = s.find(NEEDLE[0]).unwrap() + NEEDLE[0].len();
            assert_eq!(&s[given..given + 5], key);
            assert!(s[given + 5..].starts_with(NEEDLE[1]));
            depths.push(given);
            // The answers are the final digits, each `asked - given` back.
            let answers: Vec<_> = set.answers[e * 5..(e + 1) * 5].to_vec();
            for (i, a) in answers.iter().enumerate() {
                assert_eq!(a.pos, e * len + asked + i);
                assert_eq!(a.distance, asked - given);
                assert_eq!(symbols[a.pos], key.as_bytes()[i]);
            }
        }
        // Needles at several depths, and the same examples again.
        depths.dedup();
        assert!(depths.len() > 1, "{depths:?}");
        let again = cfg
            .examples(0, true, 6, len, |i| text[i], text.len())
            .unwrap();
        assert_eq!(again.0, symbols);
        // Only the digits are scored, unless the text is too: then every
        // target is, and the examples and their answers are the same.
        let scored = |set: &RecallSet| (0..6 * len).filter(|&i| set.is_scored(i)).count();
        assert_eq!(scored(&set), 6 * 5);
        let text_too = PasskeyConfig {
            score_text: true,
            ..cfg.clone()
        };
        let mixed = text_too
            .examples(0, true, 6, len, |i| text[i], text.len())
            .unwrap();
        assert_eq!((&mixed.0, &mixed.1.answers), (&symbols, &set.answers));
        assert_eq!(scored(&mixed.1), 6 * len);
        // A third of the training examples answer-only: examples 2 and 5
        // score their digits alone, the others every target; validation
        // examples are scored whole.
        let a_third = PasskeyConfig {
            answer_only_share: 1.0 / 3.0,
            ..text_too.clone()
        };
        let train = a_third
            .examples(0, true, 6, len, |i| text[i], text.len())
            .unwrap();
        assert_eq!((&train.0, &train.1.answers), (&symbols, &set.answers));
        let per_example: Vec<usize> = (0..6)
            .map(|e| {
                (e * len..(e + 1) * len)
                    .filter(|&i| train.1.is_scored(i))
                    .count()
            })
            .collect();
        assert_eq!(per_example, [len, len, 5, len, len, 5]);
        let valid = a_third
            .examples(1, false, 6, len, |i| text[i], text.len())
            .unwrap();
        assert_eq!(scored(&valid.1), 6 * len);
        for bad in [
            PasskeyConfig {
                answer_only_share: 1.5,
                ..text_too.clone()
            },
            PasskeyConfig {
                answer_only_share: 0.5,
                ..cfg.clone()
            },
        ] {
            let e = bad.check(len, text.len()).unwrap_err().to_string();
            assert!(e.contains("answer_only_share") && !e.contains('\n'), "{e}");
        }
        // Too short to hold the needle and the question, or a text shorter
        // than an example: one line each.
        for (len, text_len) in [(60, 1000), (160, 100)] {
            let e = cfg.check(len, text_len).unwrap_err().to_string();
            assert!(e.starts_with("data.passkey:") && !e.contains('\n'), "{e}");
        }
    }

    #[test]
    fn impossible_tasks_are_one_line_errors() {
        let too_long = task(12, None).examples(0, 8, 40).unwrap_err();
        assert!(
            too_long.to_string().contains("data.sequence_len"),
            "{too_long}"
        );
        for bad in [
            MqarConfig {
                vocab: 512,
                ..task(4, None)
            },
            MqarConfig {
                vocab: 63,
                ..task(4, None)
            },
            task(32, None),
            task(0, None),
            MqarConfig {
                role_period: Some(0),
                ..task(4, None)
            },
            MqarConfig {
                role_period: Some(6),
                ..task(4, None)
            },
            MqarConfig {
                role_period: Some(128),
                ..task(4, None)
            },
            task(4, Some(5)),
            task(4, Some(0)),
            MqarConfig {
                train_examples: 0,
                ..task(4, None)
            },
        ] {
            let e = bad.check(1024).unwrap_err().to_string();
            assert!(e.starts_with("data.mqar:") && !e.contains('\n'), "{e}");
        }
    }

    #[test]
    fn a_task_file_reads_back_padded_with_its_answers_and_bad_lines_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("task.jsonl");
        let write = |text: &str| std::fs::write(&path, text).unwrap();
        write(concat!(
            r#"{"tokens": [5, 6, 7, 8, 6], "answers": [{"pos": 4, "token": 6, "distance": 3}]}"#,
            "\n\n",
            r#"{"tokens": [9, 10, 9], "answers": [{"pos": 2, "token": 9}, {"pos": 1, "token": 10}]}"#,
            "\n",
        ));
        let (ids, set) = read_task_file(&path, 16).unwrap();
        assert_eq!(ids, [5, 6, 7, 8, 6, 9, 10, 9, 0, 0]);
        assert_eq!((set.example_len, set.examples()), (5, 2));
        let answers: Vec<(usize, usize)> =
            set.answers.iter().map(|a| (a.pos, a.distance)).collect();
        // Sorted by position within each example, whatever the file's order.
        assert_eq!(answers, [(4, 3), (6, 1), (7, 2)]);
        let scored: Vec<usize> = (0..10).filter(|&p| set.is_scored(p)).collect();
        assert_eq!(scored, [4, 6, 7]);
        for (text, reason) in [
            ("{\"tokens\": [1, 2]}", "line 1: missing field `answers`"),
            ("{\"tokens\": [], \"answers\": []}", "line 1: no tokens"),
            (
                "{\"tokens\": [1, 99], \"answers\": []}",
                "line 1: token 99 is outside",
            ),
            (
                "\n{\"tokens\": [1, 2], \"answers\": [{\"pos\": 2, \"token\": 2}]}",
                "line 2: an answer at 2",
            ),
            (
                "{\"tokens\": [1, 2], \"answers\": [{\"pos\": 1, \"token\": 1}]}",
                "line 1: the answer at 1 is 1, not 2",
            ),
            (
                "{\"tokens\": [1, 2], \"answers\": [{\"pos\": 1, \"token\": 2}, {\"pos\": 1, \"token\": 2}]}",
                "two answers at 1",
            ),
            (
                "{\"tokens\": [1, 2], \"answers\": []}",
                "no example has an answer",
            ),
            ("not json", "line 1:"),
        ] {
            write(text);
            let e = read_task_file(&path, 16).unwrap_err().to_string();
            assert!(e.contains(reason) && !e.contains('\n'), "{text}: {e}");
        }
    }
}
