//! The run configuration: TOML with `[model]`, `[data]`, `[train]`, `[eval]`
//! and `[log]`.
//!
//! Every section rejects unknown keys; [`RunConfig::validate`] checks the
//! values and names the offending key. `key.path=value` overrides (the CLI's
//! `--set`) are applied to the TOML before it is read, so they are checked
//! the same way.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tvq_data::{CorpusKind, DataConfig};
use tvq_model::{Kernels, Precision, TransformerVqConfig};

use crate::error::TrainError;

/// The whole run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunConfig {
    /// `[model]`: the network; `vocab_size` comes from the corpus.
    #[serde(default)]
    pub model: TransformerVqConfig,
    /// `[data]`: the corpus and the batch layout.
    pub data: DataConfig,
    /// `[train]`: optimization.
    #[serde(default)]
    pub train: TrainSection,
    /// `[eval]`: periodic and final evaluation, samples while training.
    #[serde(default)]
    pub eval: EvalSection,
    /// `[log]`: what the run writes besides `metrics.jsonl`.
    #[serde(default)]
    pub log: LogSection,
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
    /// The learning rate after the warm-up ([`Schedule`]).
    pub schedule: Schedule,
    /// Step where the cosine reaches its floor (default: `steps`; `cosine`
    /// only).
    pub decay_steps: Option<u64>,
    /// Share of `steps` at the end over which `wsd` decays to the floor.
    pub decay_fraction: f64,
    /// Shape of the `wsd` decay ([`DecayShape`]).
    pub decay_shape: DecayShape,
    /// Floor of the learning rate, as a fraction of the peak.
    pub lr_floor: f64,
    /// `[train.optimizer]`: which optimizer steps the weights, and its
    /// settings.
    pub optimizer: OptimizerSection,
    /// Multiplier on the learning rate of the Toeplitz bias tables (1: the
    /// common rate).
    pub toeplitz_lr_scale: f64,
    /// Clip the global gradient norm to this (0: off).
    pub grad_clip: f64,
    /// Weight of the commitment loss (beta).
    pub commit_weight: f64,
    /// How the cross-entropy of a step's scored tokens is averaged
    /// ([`LossMean`]).
    pub loss_mean: LossMean,
    /// EMA decay of the codebooks (gamma).
    pub codebook_decay: f64,
    /// Micro-batches per step (gradient accumulation): each worker runs its
    /// rows in this many passes, one after another, to save memory.
    pub micro_batches: usize,
    /// Threads that run shards of the batch at once (data parallel over
    /// rows; the CPU backend's elementwise ops use one core per thread).
    /// The batch is cut into `workers x micro_batches` shards of equal rows;
    /// the result does not depend on the thread timing (with dropout each
    /// shard draws its masks from its own seed).
    pub workers: usize,
    /// Seed of initialization, data order and dropout.
    pub seed: u64,
    /// Write a checkpoint every this many steps (and at the end).
    pub checkpoint_every: u64,
    /// Keep this many recent checkpoints (plus the best by validation loss).
    pub keep_checkpoints: usize,
    /// What the backward pass recomputes instead of keeping
    /// ([`ActivationCheckpointing`]).
    pub activation_checkpointing: ActivationCheckpointing,
    /// Type of the sublayers' matrix products ([`PrecisionSetting`]:
    /// `auto`, `f32`, `bf16` or `f16`); weights, optimizer moments,
    /// codebooks and the loss stay `f32`.
    pub precision: PrecisionSetting,
    /// Whether each sublayer's attention and quantizer run as one fused
    /// kernel ([`KernelsSetting`]: `auto`, `fused` or `composed`). Every
    /// choice computes the same step to rounding (docs/architecture.md,
    /// "Fused kernels").
    pub kernels: KernelsSetting,
    /// Start from the weights and codebooks of this model instead of drawn
    /// ones: a `tvq export` file, a checkpoint directory, or a run
    /// directory (its newest valid checkpoint); relative to the working
    /// directory. Every tensor of the run's model must be there, in its
    /// shape, and nothing else; settings that shape no tensor (block and
    /// sequence lengths, attention form, data) may differ. The optimizer,
    /// the schedule and the data start afresh. Read only when the run
    /// starts: a resumed run continues from its own checkpoint.
    pub init_from: Option<PathBuf>,
}

/// The learning rate after the linear warm-up (docs/training.md,
/// "Learning-rate schedules").
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Schedule {
    /// Cosine from the peak down to `lr_floor` at `decay_steps` (default
    /// `steps`), then held there. Default. Its whole course depends on
    /// `steps`: a run cannot be extended without changing its past.
    #[default]
    Cosine,
    /// Warmup-stable-decay: the peak held until the last `decay_fraction`
    /// of `steps`, then down to `lr_floor` in `decay_shape`. Until the
    /// decay starts, `steps` can be raised on `--resume`: the run goes on
    /// exactly as one started with the larger `steps`.
    Wsd,
    /// The peak held after the warm-up, whatever `steps`.
    Constant,
}

/// The shape of the `wsd` decay from the peak to the floor, over the
/// decay's progress `p` in `[0, 1]` (torchtitan's names).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DecayShape {
    /// `1 - p`. Default.
    #[default]
    Linear,
    /// `1 - sqrt(p)`: most of the drop early.
    Sqrt,
    /// `(1 + cos(pi p)) / 2`.
    Cosine,
}

/// How the step averages the cross-entropy of its scored tokens. The two
/// agree wherever every row has as many scored tokens (text); they differ
/// where rows are scored on different numbers of tokens, as when
/// answer-only passkey examples are mixed into text
/// (`data.passkey.answer_only_share`). The logged training loss is the
/// per-token mean either way.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LossMean {
    /// The mean over every scored token of the batch (the official code's).
    /// Default.
    #[default]
    Token,
    /// The mean over the batch's rows of each row's mean over its scored
    /// tokens (0 for a row with none in this segment): a row scored on 5
    /// digits weighs as much as a row of 256 text tokens.
    Row,
}

/// What the backward pass recomputes instead of keeping (torchtitan's
/// names). Every mode computes the same gradients; they trade memory for
/// time (docs/training.md, "Memory").
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ActivationCheckpointing {
    /// Keep every activation the backward pass needs. Default.
    #[default]
    None,
    /// burn's balanced checkpointing: memory-bound ops (elementwise,
    /// softmax) are recomputed, matrix products keep their outputs.
    Selective,
    /// Each sublayer keeps only its input; its forward pass runs again in
    /// the backward pass with the same dropout masks and carried state (the
    /// official code's per-layer remat), itself under `selective`'s
    /// balanced checkpointing.
    Full,
}

impl ActivationCheckpointing {
    /// Every mode, in the order of their names.
    pub const ALL: [ActivationCheckpointing; 3] = [Self::None, Self::Selective, Self::Full];

    /// The name in configs and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Selective => "selective",
            Self::Full => "full",
        }
    }
}

impl std::fmt::Display for ActivationCheckpointing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.pad(self.name())
    }
}

impl std::str::FromStr for ActivationCheckpointing {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| {
                format!("unknown activation checkpointing {s:?} (none, selective or full)")
            })
    }
}

/// `train.kernels`: where the trainer runs each sublayer's attention and
/// quantizer as one fused kernel ([`crate::placement::TrainOn::choose`];
/// always without activation checkpointing, which the kernels do not
/// take).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KernelsSetting {
    /// Where the kernels are measured faster than the composed ops: the
    /// CPU. GPUs compose (the cubecl kernels are exact but not yet fast:
    /// docs/benchmarks.md). Default.
    #[default]
    Auto,
    /// On every device with kernels: the CPU, wgpu and CUDA.
    Fused,
    /// Composed tensor ops everywhere: the oracle.
    Composed,
}

impl KernelsSetting {
    /// What the model is told ([`tvq_model::TransformerVq::set_kernels`]):
    /// fused unless `composed` (a backend without kernels composes anyway).
    pub fn model(self) -> Kernels {
        match self {
            Self::Auto | Self::Fused => Kernels::Fused,
            Self::Composed => Kernels::Composed,
        }
    }
}

/// `train.precision` as a config writes it: a type of the matrix products,
/// or `auto`, the type a run on the device should get
/// ([`crate::placement::device::precision_on`]: bf16 on a CUDA GPU that
/// computes it, f32 elsewhere).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum PrecisionSetting {
    /// The device's type. Default.
    #[default]
    Auto,
    /// This type on every device.
    Fixed(Precision),
}

impl From<Precision> for PrecisionSetting {
    fn from(precision: Precision) -> Self {
        Self::Fixed(precision)
    }
}

impl std::fmt::Display for PrecisionSetting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Auto => f.pad("auto"),
            Self::Fixed(precision) => precision.fmt(f),
        }
    }
}

impl std::str::FromStr for PrecisionSetting {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(Self::Auto),
            _ => s
                .parse()
                .map(Self::Fixed)
                .map_err(|_| format!("unknown precision {s:?} (auto, f32, bf16 or f16)")),
        }
    }
}

impl TryFrom<String> for PrecisionSetting {
    type Error = String;

    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

impl From<PrecisionSetting> for String {
    fn from(setting: PrecisionSetting) -> Self {
        setting.to_string()
    }
}

impl TrainSection {
    /// Checks `[train]`'s own values.
    fn validate(&self) -> Result<(), TrainError> {
        let t = self;
        if !(t.lr.is_finite() && t.lr > 0.0) {
            return Err(invalid("train.lr", "must be a positive number"));
        }
        if !(0.0..=1.0).contains(&t.lr_floor) {
            return Err(invalid("train.lr_floor", "must be in [0, 1]"));
        }
        if !(0.0..=1.0).contains(&t.decay_fraction) {
            return Err(invalid("train.decay_fraction", "must be in [0, 1]"));
        }
        if t.decay_steps.is_some() && t.schedule != Schedule::Cosine {
            return Err(invalid(
                "train.decay_steps",
                "sets where the cosine ends; schedule \"wsd\" decays over the last \
                 train.decay_fraction of train.steps, \"constant\" never",
            ));
        }
        let (adamw, muon) = (&t.optimizer.adamw, &t.optimizer.muon);
        for (key, v) in [
            ("train.optimizer.adamw.beta1", adamw.beta1),
            ("train.optimizer.adamw.beta2", adamw.beta2),
            ("train.optimizer.muon.momentum", muon.momentum),
            ("train.codebook_decay", t.codebook_decay),
        ] {
            if !(0.0..1.0).contains(&v) {
                return Err(invalid(key, "must be in [0, 1)"));
            }
        }
        if !(t.toeplitz_lr_scale.is_finite() && t.toeplitz_lr_scale > 0.0) {
            return Err(invalid(
                "train.toeplitz_lr_scale",
                "must be a positive number",
            ));
        }
        if t.grad_clip < 0.0 || t.commit_weight < 0.0 {
            return Err(invalid(
                "train",
                "grad_clip and commit_weight must not be negative",
            ));
        }
        for (key, v) in [
            (
                "train.optimizer.adamw.weight_decay",
                Some(adamw.weight_decay),
            ),
            ("train.optimizer.adamw.epsilon", Some(adamw.epsilon)),
            ("train.optimizer.muon.weight_decay", muon.weight_decay),
        ] {
            if v.is_some_and(|v| !(v.is_finite() && v >= 0.0)) {
                return Err(invalid(key, "must be a number, not negative"));
            }
        }
        if !(1..=MuonSection::MAX_NS_STEPS).contains(&muon.ns_steps) {
            return Err(invalid(
                "train.optimizer.muon.ns_steps",
                format!("must be in 1..={}", MuonSection::MAX_NS_STEPS),
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
        Ok(())
    }

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
            schedule: Schedule::Cosine,
            decay_steps: None,
            decay_fraction: 0.2,
            decay_shape: DecayShape::Linear,
            lr_floor: 0.1,
            optimizer: OptimizerSection::default(),
            toeplitz_lr_scale: 30.0,
            grad_clip: 0.1,
            commit_weight: 1e-4,
            loss_mean: LossMean::Token,
            codebook_decay: 0.99,
            micro_batches: 1,
            workers: 1,
            seed: 0,
            checkpoint_every: 200,
            keep_checkpoints: 2,
            activation_checkpointing: ActivationCheckpointing::None,
            precision: PrecisionSetting::Auto,
            kernels: KernelsSetting::Auto,
            init_from: None,
        }
    }
}

/// `[train.optimizer]`: AdamW for every parameter, or Muon for the
/// sublayers' projection matrices with AdamW for the rest (docs/training.md,
/// "Optimizers").
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OptimizerSection {
    /// Which optimizer steps the sublayers' projection matrices.
    pub name: OptimizerName,
    /// `[train.optimizer.adamw]`: every parameter under `adamw`, and under
    /// `muon` the embedding, the position terms, gains and biases.
    pub adamw: AdamWSection,
    /// `[train.optimizer.muon]`: read when `name = "muon"`.
    pub muon: MuonSection,
}

/// The optimizer of the sublayers' projection matrices.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OptimizerName {
    /// AdamW with decoupled weight decay.
    #[default]
    Adamw,
    /// Muon: momentum orthogonalized by Newton-Schulz iterations.
    Muon,
}

impl OptimizerName {
    /// The name in configs and checkpoints.
    pub fn name(self) -> &'static str {
        match self {
            Self::Adamw => "adamw",
            Self::Muon => "muon",
        }
    }
}

/// `[train.optimizer.adamw]` (also read from `[train]`'s flat keys
/// `beta1`, `beta2`, `epsilon`, `weight_decay`, which older configs use).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdamWSection {
    /// Decay of the first moment.
    pub beta1: f64,
    /// Decay of the second moment.
    pub beta2: f64,
    /// Added to the root of the second moment.
    pub epsilon: f64,
    /// Decoupled weight decay, on matrices only (not the Toeplitz tables).
    pub weight_decay: f64,
}

impl Default for AdamWSection {
    fn default() -> Self {
        Self {
            beta1: 0.9,
            beta2: 0.98,
            epsilon: 1e-9,
            weight_decay: 2e-4,
        }
    }
}

/// `[train.optimizer.muon]`. Its step is scaled to AdamW's typical update
/// size (Moonshot's `0.2 * sqrt(max(rows, columns))`), so `train.lr` and
/// the schedule serve both optimizers.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MuonSection {
    /// Decay of the momentum.
    pub momentum: f64,
    /// Nesterov momentum.
    pub nesterov: bool,
    /// Newton-Schulz iterations that orthogonalize the momentum.
    pub ns_steps: usize,
    /// Decoupled weight decay of the Muon matrices (unset: AdamW's).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub weight_decay: Option<f64>,
}

impl MuonSection {
    /// Most Newton-Schulz iterations a config may ask for (each costs three
    /// matrix products per matrix).
    pub const MAX_NS_STEPS: usize = 20;
}

impl Default for MuonSection {
    fn default() -> Self {
        Self {
            momentum: 0.95,
            nesterov: true,
            ns_steps: 5,
            weight_decay: None,
        }
    }
}

/// `[train]`'s flat AdamW keys, read into `[train.optimizer.adamw]`.
const ADAMW_ALIASES: [&str; 4] = ["beta1", "beta2", "epsilon", "weight_decay"];

/// Moves `[train]`'s flat AdamW keys (configs and run directories written
/// before `[train.optimizer]`) into `[train.optimizer.adamw]`; a key set in
/// both places is an error.
fn read_aliases(root: &mut toml::Table) -> Result<(), TrainError> {
    let Some(train) = root.get_mut("train").and_then(|t| t.as_table_mut()) else {
        return Ok(());
    };
    let moved: Vec<(&str, toml::Value)> = ADAMW_ALIASES
        .iter()
        .filter_map(|k| train.remove(*k).map(|v| (*k, v)))
        .collect();
    if moved.is_empty() {
        return Ok(());
    }
    let adamw = train
        .entry("optimizer")
        .or_insert_with(|| toml::Value::Table(toml::Table::new()))
        .as_table_mut()
        .and_then(|o| {
            o.entry("adamw")
                .or_insert_with(|| toml::Value::Table(toml::Table::new()))
                .as_table_mut()
        })
        .ok_or_else(|| invalid("train.optimizer", "must be a table"))?;
    for (key, value) in moved {
        if adamw.contains_key(key) {
            return Err(invalid(
                &format!("train.{key}"),
                format!("is also set as train.optimizer.adamw.{key}: keep one"),
            ));
        }
        adamw.insert(key.to_string(), value);
    }
    Ok(())
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
    /// Draw a sample every this many steps (0: never), into `samples.jsonl`
    /// and TensorBoard; as `tvq sample` would from that step's checkpoint.
    pub sample_every: u64,
    /// The text each sample continues (empty: a fresh document).
    pub sample_prompt: String,
    /// Tokens per sample (it ends earlier at an end of document).
    pub sample_tokens: usize,
    /// Softmax temperature of the samples (0: greedy).
    pub sample_temperature: f64,
    /// Nucleus of the samples: draw among the most likely tokens holding
    /// this much probability.
    pub sample_top_p: f64,
    /// Seed of the samples' draws (the same at every step, so that samples
    /// differ only by what the model learnt).
    pub sample_seed: u64,
}

/// `[log]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LogSection {
    /// Write TensorBoard event files into the run directory's `tb/`.
    pub tensorboard: bool,
}

impl Default for LogSection {
    fn default() -> Self {
        Self { tensorboard: true }
    }
}

impl Default for EvalSection {
    fn default() -> Self {
        Self {
            every: 200,
            segments: 8,
            batch_size: 8,
            update_len: 512,
            sample_every: 0,
            sample_prompt: String::new(),
            sample_tokens: 256,
            sample_temperature: 1.0,
            sample_top_p: 0.9,
            sample_seed: 0,
        }
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

/// Reads TOML text into `T` after applying `overrides` (`section.key=value`).
pub fn parse_toml<T: serde::de::DeserializeOwned>(
    text: &str,
    overrides: &[String],
) -> Result<T, TrainError> {
    parse_toml_with(text, overrides, |_| Ok(()))
}

/// [`parse_toml`] with `edit` applied to the table before it is read.
fn parse_toml_with<T: serde::de::DeserializeOwned>(
    text: &str,
    overrides: &[String],
    edit: impl FnOnce(&mut toml::Table) -> Result<(), TrainError>,
) -> Result<T, TrainError> {
    let mut table: toml::Table =
        toml::from_str(text).map_err(|e| TrainError::Toml(one_line(&e, text)))?;
    for o in overrides {
        set_key(&mut table, o)?;
    }
    edit(&mut table)?;
    toml::Value::Table(table)
        .try_into()
        .map_err(|e: toml::de::Error| TrainError::Toml(one_line(&e, text)))
}

/// A TOML error as one line: `line L, column C: message` where the parser
/// knows the place, `` `section.key`: message `` where the deserializer
/// knows the key. The `toml` crate's own rendering spans several lines (a
/// source excerpt with a caret), which a one-line error report cannot hold.
fn one_line(e: &toml::de::Error, text: &str) -> String {
    let message = e.message().lines().map(str::trim).filter(|l| !l.is_empty());
    let message = message.collect::<Vec<_>>().join("; ");
    if let Some(span) = e.span() {
        // The text before the error, cut at a character boundary.
        let end = (0..=span.start.min(text.len()))
            .rev()
            .find(|&i| text.is_char_boundary(i));
        let before = &text[..end.unwrap_or(0)];
        let line = before.matches('\n').count() + 1;
        let column = before.rsplit('\n').next().unwrap_or("").chars().count() + 1;
        return format!("line {line}, column {column}: {message}");
    }
    // Without a place, the rendering ends with "in `key`" when the key is known.
    let key = e.to_string();
    let key = key
        .lines()
        .last()
        .and_then(|l| l.strip_prefix("in `")?.strip_suffix('`'));
    match key {
        Some(key) => format!("`{key}`: {message}"),
        None => message,
    }
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
        let config: RunConfig = parse_toml_with(text, overrides, read_aliases)?;
        config.validate()?;
        Ok(config)
    }

    /// Checks the values (the model's own checks run when it is built).
    pub fn validate(&self) -> Result<(), TrainError> {
        self.validate_layout()?;
        self.train.validate()?;
        self.validate_eval()?;
        // A synthetic task needs no file, so its settings are checked with
        // the rest of the config, by every command that reads one.
        if self.data.kind == CorpusKind::Mqar {
            self.data.mqar_task().check(self.data.sequence_len)?;
        }
        if self.model.vocab_size != 0 {
            return Err(invalid(
                "model.vocab_size",
                "is set by the corpus's vocabulary: remove it from [model]",
            ));
        }
        Ok(self.model_config(2).validate()?)
    }

    /// Checks how batches and segments are cut: into blocks, sequences,
    /// micro-batches and shards.
    fn validate_layout(&self) -> Result<(), TrainError> {
        let (m, d, t) = (&self.model, &self.data, &self.train);
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
        Ok(())
    }

    /// Checks `[eval]`.
    fn validate_eval(&self) -> Result<(), TrainError> {
        let (m, e) = (&self.model, &self.eval);
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
        if e.sample_every > 0 && e.sample_tokens == 0 {
            return Err(invalid("eval.sample_tokens", "must be at least 1"));
        }
        if e.sample_temperature.is_nan() || e.sample_temperature < 0.0 {
            return Err(invalid("eval.sample_temperature", "must not be negative"));
        }
        if !(e.sample_top_p > 0.0 && e.sample_top_p <= 1.0) {
            return Err(invalid("eval.sample_top_p", "must be in (0, 1]"));
        }
        Ok(())
    }

    /// The model config for a vocabulary of `vocab_size` ids.
    pub fn model_config(&self, vocab_size: usize) -> TransformerVqConfig {
        self.model.clone().with_vocab_size(vocab_size)
    }

    /// The config as TOML text (written into the run directory).
    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self).expect("a config serializes")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tvq_model::RelativeBias;

    const MINIMAL: &str = "[data]\nkind = \"text\"\npath = \"data/kjv.txt\"\n";

    #[test]
    fn every_shipped_config_loads() {
        let dir = tvq_testkit::crate_dir().join("../../configs");
        let mut loaded = vec![];
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "toml") {
                RunConfig::load(&path, &[]).unwrap_or_else(|e| panic!("{e}"));
                loaded.push(path.file_name().unwrap().to_string_lossy().into_owned());
            }
        }
        for name in ["quickstart.toml", "mqar.toml", "passkey-text.toml"] {
            assert!(loaded.iter().any(|l| l == name), "{name} in {loaded:?}");
        }
    }

    fn error(text: &str, overrides: &[&str]) -> String {
        let overrides: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
        RunConfig::parse(text, &overrides).unwrap_err().to_string()
    }

    #[test]
    fn missing_keys_take_the_model_and_data_defaults() {
        let cfg = RunConfig::parse(MINIMAL, &[]).unwrap();
        assert_eq!(cfg.model, TransformerVqConfig::default());
        assert_eq!(cfg.model_config(259), TransformerVqConfig::new(259));
        assert_eq!(cfg.data.batch_size, 8);
        assert_eq!(cfg.train, TrainSection::default());
        // The TOML written into a run directory reads back the same.
        assert_eq!(RunConfig::parse(&cfg.to_toml(), &[]).unwrap(), cfg);
    }

    /// `train.precision` reads `auto` (the default) and each type, writes
    /// them back as read, and refuses another name naming the choices.
    #[test]
    fn precision_is_auto_or_a_type() {
        assert_eq!(TrainSection::default().precision, PrecisionSetting::Auto);
        for (text, setting) in [
            ("auto", PrecisionSetting::Auto),
            ("f32", Precision::F32.into()),
            ("bf16", Precision::Bf16.into()),
            ("f16", Precision::F16.into()),
        ] {
            let set = format!("train.precision=\"{text}\"");
            let cfg = RunConfig::parse(MINIMAL, &[set]).unwrap();
            assert_eq!(cfg.train.precision, setting, "{text}");
            assert!(cfg.to_toml().contains(&format!("precision = \"{text}\"")));
        }
        let err = error(MINIMAL, &["train.precision=\"tf32\""]);
        assert!(
            err.contains("tf32") && err.contains("auto, f32, bf16 or f16"),
            "{err}"
        );
    }

    #[test]
    fn overrides_set_numbers_strings_and_booleans_in_any_section() {
        let overrides = [
            "model.d_model=64",
            "model.bias=xl",
            "model.logit_scale = 0.5",
            "data.reset_each_sequence=false",
            "data.path=\"other.txt\"",
            "train.lr=3e-4",
            "eval.every=0",
        ]
        .map(String::from);
        let cfg = RunConfig::parse(MINIMAL, &overrides).unwrap();
        assert_eq!(cfg.model.d_model, 64);
        assert_eq!(cfg.model.bias, RelativeBias::Xl);
        assert_eq!(cfg.model.logit_scale, 0.5);
        assert!(!cfg.data.reset_each_sequence);
        assert_eq!(cfg.data.path, std::path::PathBuf::from("other.txt"));
        assert_eq!(cfg.train.lr, 3e-4);
        assert_eq!(cfg.eval.every, 0);
    }

    /// Configs and run directories written before `[train.optimizer]` keep
    /// AdamW's settings as flat `[train]` keys: they read into the same place.
    #[test]
    fn the_flat_adamw_keys_read_into_the_optimizer_table() {
        let flat = format!("{MINIMAL}[train]\nbeta1 = 0.8\nweight_decay = 0.0\n");
        let nested = format!("{MINIMAL}[train.optimizer.adamw]\nbeta1 = 0.8\nweight_decay = 0.0\n");
        let (flat, nested) = (
            RunConfig::parse(&flat, &[]).unwrap(),
            RunConfig::parse(&nested, &[]).unwrap(),
        );
        assert_eq!(flat, nested);
        let adamw = &flat.train.optimizer.adamw;
        assert_eq!((adamw.beta1, adamw.weight_decay), (0.8, 0.0));
        assert_eq!(adamw.beta2, AdamWSection::default().beta2);
        let muon = [
            "train.optimizer.name=muon",
            "train.optimizer.muon.ns_steps=3",
        ];
        let muon = RunConfig::parse(MINIMAL, &muon.map(String::from)).unwrap();
        assert_eq!(muon.train.optimizer.name, OptimizerName::Muon);
        assert_eq!(muon.train.optimizer.muon.ns_steps, 3);
        // What a run directory keeps reads back the same.
        assert_eq!(RunConfig::parse(&muon.to_toml(), &[]).unwrap(), muon);
    }

    #[test]
    fn bad_keys_and_values_are_errors_naming_the_key() {
        assert!(error(MINIMAL, &["model.d_modle=64"]).contains("d_modle"));
        assert!(error(MINIMAL, &["data.batch_sise=4"]).contains("batch_sise"));
        assert!(error(MINIMAL, &["train.lr"]).contains("section.key=value"));
        assert!(error(MINIMAL, &["model.vocab_size=300"]).contains("model.vocab_size"));
        assert!(error(MINIMAL, &["model.d_model=0"]).contains("model.d_model"));
        assert!(error(MINIMAL, &["model.n_code=1"]).contains("model.n_code"));
        assert!(error(MINIMAL, &["data.update_len=100"]).contains("data.update_len"));
        assert!(error(MINIMAL, &["train.workers=3"]).contains("train.workers"));
        assert!(error(MINIMAL, &["train.beta2=1.0"]).contains("adamw.beta2"));
        let twice = ["train.beta2=0.9", "train.optimizer.adamw.beta2=0.95"];
        assert!(error(MINIMAL, &twice).contains("keep one"));
        assert!(error(MINIMAL, &["train.optimizer.name=sgd"]).contains("sgd"));
        assert!(error(MINIMAL, &["train.optimizer.muon.ns_steps=0"]).contains("ns_steps"));
        let negative = ["train.optimizer.muon.weight_decay=-1"];
        assert!(error(MINIMAL, &negative).contains("muon.weight_decay"));
        assert!(error(MINIMAL, &["train.schedule=\"step\""]).contains("schedule"));
        let wsd_with_decay_steps = ["train.schedule=\"wsd\"", "train.decay_steps=10"];
        assert!(error(MINIMAL, &wsd_with_decay_steps).contains("train.decay_steps"));
        assert!(error(MINIMAL, &["train.decay_fraction=1.5"]).contains("train.decay_fraction"));
        assert!(error(MINIMAL, &["data.kind.x=1"]).contains("not a section"));
        // A synthetic task's settings are checked with the rest.
        let mqar = "[data]\nkind = \"mqar\"\nsequence_len = 256\nupdate_len = 256\n";
        assert!(RunConfig::parse(mqar, &[]).is_ok());
        assert!(error(mqar, &["data.mqar.role_period=6"]).contains("role_period"));
        assert!(error(mqar, &["data.mqar.pairs=100"]).contains("data.mqar"));
        assert!(error("[model]\nd_model = 8\n", &[]).contains("data"));
    }

    #[test]
    fn toml_errors_are_one_line_naming_the_place_or_the_key() {
        let e = error(MINIMAL, &["train.loss_mean=mode"]);
        assert!(
            e.contains("`train.loss_mean`: unknown variant `mode`"),
            "{e}"
        );
        let e = error("[data]\nkind = \"text\"\npath = \n", &[]);
        assert!(e.contains("line 3, column 8: "), "{e}");
        let past_non_ascii = error("[data]\nkind = \"ü\" ü\n", &[]);
        assert!(
            past_non_ascii.contains("line 2, column "),
            "{past_non_ascii}"
        );
        for e in [e, past_non_ascii, error(MINIMAL, &["model.bias=sine"])] {
            assert!(!e.contains('\n'), "{e:?}");
        }
    }
}
