//! The run configuration: TOML with `[model]`, `[data]`, `[train]` and `[eval]`.
//!
//! Every section rejects unknown keys; [`RunConfig::validate`] checks the
//! values and names the offending key. `key.path=value` overrides (the CLI's
//! `--set`) are applied to the TOML before it is read, so they are checked
//! the same way.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tvq_data::{CorpusKind, CorpusSpec, TrainLayout};
use tvq_model::{AttentionForm, CacheGrad, RelativeBias, TransformerVqConfig};

use crate::error::TrainError;

/// The whole run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunConfig {
    /// The network.
    #[serde(default)]
    pub model: ModelSection,
    /// The corpus and the batch layout.
    pub data: DataSection,
    /// Optimization.
    #[serde(default)]
    pub train: TrainSection,
    /// Periodic and final evaluation.
    #[serde(default)]
    pub eval: EvalSection,
}

/// `[model]`: every [`TransformerVqConfig`] field but the vocabulary size,
/// which comes from the corpus.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelSection {
    /// Model width D.
    pub d_model: usize,
    /// Key width K per head.
    pub d_k: usize,
    /// Value width V per head.
    pub d_v: usize,
    /// Codebook size S.
    pub n_code: usize,
    /// Heads H.
    pub n_head: usize,
    /// Layers N (two GAU sublayers each).
    pub n_layer: usize,
    /// Block length L.
    pub block_len: usize,
    /// `toeplitz` or `xl`.
    pub bias: RelativeBias,
    /// `window`, `none` or `full`.
    pub cache_grad: CacheGrad,
    /// `vq` or `quadratic`.
    pub attention: AttentionForm,
    /// RMS norm before the output.
    pub final_norm: bool,
    /// Tie output and embedding.
    pub tie_embeddings: bool,
    /// Multiplier on the logits.
    pub logit_scale: f64,
    /// Residual dropout.
    pub dropout_residual: f64,
    /// Layer drop.
    pub dropout_layer: f64,
    /// XL sinusoid dropout.
    pub dropout_sinusoid: f64,
    /// XL sinusoid base.
    pub sinusoid_base: f64,
}

impl Default for ModelSection {
    fn default() -> Self {
        let d = TransformerVqConfig::new(1);
        Self {
            d_model: d.d_model,
            d_k: d.d_k,
            d_v: d.d_v,
            n_code: d.n_code,
            n_head: d.n_head,
            n_layer: d.n_layer,
            block_len: d.block_len,
            bias: d.bias,
            cache_grad: d.cache_grad,
            attention: d.attention,
            final_norm: d.final_norm,
            tie_embeddings: d.tie_embeddings,
            logit_scale: d.logit_scale,
            dropout_residual: d.dropout_residual,
            dropout_layer: d.dropout_layer,
            dropout_sinusoid: d.dropout_sinusoid,
            sinusoid_base: d.sinusoid_base,
        }
    }
}

impl ModelSection {
    /// The model config for a vocabulary of `vocab_size` ids.
    pub fn to_model(&self, vocab_size: usize) -> TransformerVqConfig {
        TransformerVqConfig::new(vocab_size)
            .with_d_model(self.d_model)
            .with_d_k(self.d_k)
            .with_d_v(self.d_v)
            .with_n_code(self.n_code)
            .with_n_head(self.n_head)
            .with_n_layer(self.n_layer)
            .with_block_len(self.block_len)
            .with_bias(self.bias)
            .with_cache_grad(self.cache_grad)
            .with_attention(self.attention)
            .with_final_norm(self.final_norm)
            .with_tie_embeddings(self.tie_embeddings)
            .with_logit_scale(self.logit_scale)
            .with_dropout_residual(self.dropout_residual)
            .with_dropout_layer(self.dropout_layer)
            .with_dropout_sinusoid(self.dropout_sinusoid)
            .with_sinusoid_base(self.sinusoid_base)
    }
}

/// `[data]`: where the corpus is (the fields of [`CorpusSpec`], repeated
/// because serde's `flatten` cannot be combined with `deny_unknown_fields`)
/// and how it is cut into batches.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataSection {
    /// `enwik8`, `text` or `pg19`.
    pub kind: CorpusKind,
    /// Corpus file or directory (relative paths are relative to the working directory).
    pub path: PathBuf,
    /// `tokenizer.json` for tokenized text; byte-level when absent.
    #[serde(default)]
    pub tokenizer: Option<PathBuf>,
    /// Accept an enwik8 file of another size, split 90/5/5.
    #[serde(default)]
    pub allow_proportional_split: bool,
    /// Where token caches go (default: beside the corpus).
    #[serde(default)]
    pub cache_dir: Option<PathBuf>,
    /// Rows per optimizer step (the global batch).
    #[serde(default = "defaults::batch_size")]
    pub batch_size: usize,
    /// Tokens per row per step (one segment, `T`); a multiple of `block_len`.
    #[serde(default = "defaults::update_len")]
    pub update_len: usize,
    /// Tokens per sequence: the state is carried across its segments; a multiple of `update_len`.
    #[serde(default = "defaults::update_len")]
    pub sequence_len: usize,
    /// Reset the state at every sequence (false: only at epoch starts).
    #[serde(default = "defaults::yes")]
    pub reset_each_sequence: bool,
}

/// `[train]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainSection {
    /// Optimizer steps.
    pub steps: u64,
    /// Peak learning rate.
    pub lr: f64,
    /// Linear warm-up steps.
    pub warmup_steps: u64,
    /// Step where the cosine reaches its floor (default: `steps`).
    pub decay_steps: Option<u64>,
    /// Floor of the learning rate, as a fraction of the peak.
    pub lr_floor: f64,
    /// AdamW beta 1.
    pub beta1: f64,
    /// AdamW beta 2.
    pub beta2: f64,
    /// AdamW epsilon.
    pub epsilon: f64,
    /// Decoupled weight decay, on matrices only.
    pub weight_decay: f64,
    /// Clip the global gradient norm to this (0: off).
    pub grad_clip: f64,
    /// Weight of the commitment loss (beta).
    pub commit_weight: f64,
    /// EMA decay of the codebooks (gamma).
    pub codebook_decay: f64,
    /// Micro-batches per step (gradient accumulation): each worker runs its
    /// rows in this many passes, one after another, to save memory.
    pub micro_batches: usize,
    /// Threads that run shards of the batch at once (data parallel over
    /// rows; the CPU backend's elementwise ops use one core per thread).
    /// The batch is cut into `workers x micro_batches` shards of equal rows;
    /// the result does not depend on the thread timing. With dropout the
    /// shards draw their masks in turn (the draws must stay in order).
    pub workers: usize,
    /// Seed of initialization, data order and dropout.
    pub seed: u64,
    /// Write a checkpoint every this many steps (and at the end).
    pub checkpoint_every: u64,
    /// Keep this many recent checkpoints (plus the best by validation loss).
    pub keep_checkpoints: usize,
}

impl TrainSection {
    /// Shards each batch is cut into: `workers x micro_batches`.
    pub fn shards(&self) -> usize {
        self.workers * self.micro_batches
    }
}

impl Default for TrainSection {
    fn default() -> Self {
        Self {
            steps: 1000,
            lr: 4e-4,
            warmup_steps: 100,
            decay_steps: None,
            lr_floor: 0.1,
            beta1: 0.9,
            beta2: 0.98,
            epsilon: 1e-9,
            weight_decay: 2e-4,
            grad_clip: 0.1,
            commit_weight: 1e-4,
            codebook_decay: 0.99,
            micro_batches: 1,
            workers: 1,
            seed: 0,
            checkpoint_every: 200,
            keep_checkpoints: 2,
        }
    }
}

/// `[eval]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EvalSection {
    /// Validate every this many steps (0: only at the end).
    pub every: u64,
    /// Validation segments per periodic evaluation (the final one covers the whole split).
    pub segments: usize,
    /// Rows of evaluation batches.
    pub batch_size: usize,
    /// Tokens per evaluation segment (a multiple of `block_len`).
    pub update_len: usize,
}

impl Default for EvalSection {
    fn default() -> Self {
        Self {
            every: 200,
            segments: 8,
            batch_size: 8,
            update_len: 512,
        }
    }
}

mod defaults {
    pub fn batch_size() -> usize {
        8
    }
    pub fn update_len() -> usize {
        512
    }
    pub fn yes() -> bool {
        true
    }
}

fn invalid(key: &str, reason: impl Into<String>) -> TrainError {
    TrainError::Config {
        key: key.to_string(),
        reason: reason.into(),
    }
}

/// Sets `key.path = value` in a TOML table; the value is parsed as TOML
/// (a number, boolean, quoted string, array) and taken as a bare string otherwise.
fn set_key(root: &mut toml::Table, assignment: &str) -> Result<(), TrainError> {
    let (path, raw) = assignment
        .split_once('=')
        .ok_or_else(|| invalid(assignment, "an override must look like section.key=value"))?;
    let path = path.trim();
    let value: toml::Value = toml::from_str::<toml::Table>(&format!("v = {raw}"))
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| toml::Value::String(raw.trim().to_string()));
    let mut keys: Vec<&str> = path.split('.').collect();
    let last = keys
        .pop()
        .filter(|k| !k.is_empty())
        .ok_or_else(|| invalid(path, "empty key"))?;
    let mut table = root;
    for k in keys {
        table = table
            .entry(k)
            .or_insert_with(|| toml::Value::Table(toml::Table::new()))
            .as_table_mut()
            .ok_or_else(|| invalid(path, format!("`{k}` is not a section")))?;
    }
    table.insert(last.to_string(), value);
    Ok(())
}

impl RunConfig {
    /// Reads a TOML config, applies `overrides` (`section.key=value`), validates.
    pub fn load(path: &Path, overrides: &[String]) -> Result<Self, TrainError> {
        let text = std::fs::read_to_string(path).map_err(|e| TrainError::io(path, e))?;
        Self::parse(&text, overrides).map_err(|e| match e {
            TrainError::Toml(msg) => TrainError::Toml(format!("{}: {msg}", path.display())),
            other => other,
        })
    }

    /// Parses TOML text (see [`RunConfig::load`]).
    pub fn parse(text: &str, overrides: &[String]) -> Result<Self, TrainError> {
        let mut table: toml::Table =
            toml::from_str(text).map_err(|e| TrainError::Toml(e.to_string()))?;
        for o in overrides {
            set_key(&mut table, o)?;
        }
        let config: RunConfig = toml::Value::Table(table)
            .try_into()
            .map_err(|e: toml::de::Error| TrainError::Toml(e.to_string()))?;
        config.validate()?;
        Ok(config)
    }

    /// Checks the values (the model's own checks run when it is built).
    pub fn validate(&self) -> Result<(), TrainError> {
        let (m, d, t, e) = (&self.model, &self.data, &self.train, &self.eval);
        if d.batch_size == 0 {
            return Err(invalid("data.batch_size", "must be at least 1"));
        }
        if d.update_len == 0 || !d.update_len.is_multiple_of(m.block_len.max(1)) {
            return Err(invalid(
                "data.update_len",
                format!(
                    "must be a positive multiple of model.block_len ({})",
                    m.block_len
                ),
            ));
        }
        if !d.sequence_len.is_multiple_of(d.update_len) || d.sequence_len == 0 {
            return Err(invalid(
                "data.sequence_len",
                format!(
                    "must be a positive multiple of data.update_len ({})",
                    d.update_len
                ),
            ));
        }
        if t.micro_batches == 0 || !d.batch_size.is_multiple_of(t.micro_batches) {
            return Err(invalid(
                "train.micro_batches",
                format!("must divide data.batch_size ({})", d.batch_size),
            ));
        }
        if t.workers == 0 || !d.batch_size.is_multiple_of(t.shards()) {
            return Err(invalid(
                "train.workers",
                format!(
                    "must be positive, and train.workers x train.micro_batches ({}) must divide data.batch_size ({})",
                    t.shards(),
                    d.batch_size
                ),
            ));
        }
        if !(t.lr.is_finite() && t.lr > 0.0) {
            return Err(invalid("train.lr", "must be a positive number"));
        }
        if !(0.0..=1.0).contains(&t.lr_floor) {
            return Err(invalid("train.lr_floor", "must be in [0, 1]"));
        }
        for (key, v) in [
            ("train.beta1", t.beta1),
            ("train.beta2", t.beta2),
            ("train.codebook_decay", t.codebook_decay),
        ] {
            if !(0.0..1.0).contains(&v) {
                return Err(invalid(key, "must be in [0, 1)"));
            }
        }
        if t.grad_clip < 0.0 || t.weight_decay < 0.0 || t.commit_weight < 0.0 {
            return Err(invalid(
                "train",
                "grad_clip, weight_decay and commit_weight must not be negative",
            ));
        }
        if t.steps == 0 {
            return Err(invalid("train.steps", "must be at least 1"));
        }
        if t.checkpoint_every == 0 {
            return Err(invalid("train.checkpoint_every", "must be at least 1"));
        }
        if t.keep_checkpoints == 0 {
            return Err(invalid("train.keep_checkpoints", "must be at least 1"));
        }
        if e.batch_size == 0
            || e.update_len == 0
            || !e.update_len.is_multiple_of(m.block_len.max(1))
        {
            return Err(invalid(
                "eval.update_len",
                format!(
                    "eval.batch_size must be positive and eval.update_len a positive multiple of model.block_len ({})",
                    m.block_len
                ),
            ));
        }
        self.model
            .to_model(2)
            .validate()
            .map_err(|e| invalid(&format!("model.{}", e.key), e.reason))
    }

    /// Where the corpus is.
    pub fn corpus_spec(&self) -> CorpusSpec {
        let d = &self.data;
        CorpusSpec {
            kind: d.kind,
            path: d.path.clone(),
            tokenizer: d.tokenizer.clone(),
            allow_proportional_split: d.allow_proportional_split,
            cache_dir: d.cache_dir.clone(),
        }
    }

    /// The layout of the training batches (all shards' rows).
    pub fn train_layout(&self) -> TrainLayout {
        let d = &self.data;
        TrainLayout {
            batch: d.batch_size,
            update_len: d.update_len,
            sequence_len: d.sequence_len,
            seed: self.train.seed,
            reset_each_sequence: d.reset_each_sequence,
        }
    }

    /// The config as TOML text (written into the run directory).
    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self).expect("a config serializes")
    }
}
