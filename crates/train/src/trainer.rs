//! The training loop.
//!
//! One optimizer step: take the next batch (all rows advance one segment),
//! cut its rows into shards (`workers x micro_batches`), run each shard from
//! its carried state and sum the gradients ([`crate::step`]), clip them by
//! their global norm, step AdamW, then move the codebooks one EMA step with
//! the statistics of every shard. The state each shard leaves behind is
//! detached and carried into the next step, unless the batch starts new
//! sequences.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use burn::DispatchDevice;
use burn::module::AutodiffModule;
use burn::prelude::*;
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use tvq_data::{Corpus, Split, TrainBatches, TrainCursor};
use tvq_model::ModelState;

use crate::checkpoint::{self, TrainerState};
use crate::config::RunConfig;
use crate::error::TrainError;
use crate::evaluate::{EvalReport, batch_tensors, evaluate};
use crate::optim::{B, Model, Optimizers, clip_global_norm, learning_rate};
use crate::plot;
use crate::step::{Shard, StepGradients, compute_gradients};

/// How `train` is run.
#[derive(Clone, Debug)]
pub struct TrainOptions {
    /// Run directory: config, metrics, checkpoints.
    pub run_dir: PathBuf,
    /// Continue from the latest valid checkpoint.
    pub resume: bool,
    /// Train in a run directory that holds another run (its checkpoints are deleted).
    pub force: bool,
    /// Stop after this many steps in total (the schedule still follows `train.steps`).
    pub max_steps: Option<u64>,
    /// Set to stop: a checkpoint is written and `train` returns.
    pub interrupt: Arc<AtomicBool>,
    /// Draw progress bars.
    pub progress: bool,
}

/// One line of `metrics.jsonl` per optimizer step.
#[derive(Clone, Debug, Serialize)]
pub struct StepMetrics {
    /// `"train"`.
    pub kind: &'static str,
    /// Optimizer step (1-based).
    pub step: u64,
    /// Learning rate used.
    pub lr: f64,
    /// Cross-entropy + commit_weight * commitment (what was minimised).
    pub loss: f64,
    /// Cross-entropy, nats per token.
    pub ce: f64,
    /// Cross-entropy, bits per token.
    pub bits_per_token: f64,
    /// Cross-entropy, bits per byte of text.
    pub bits_per_byte: f64,
    /// Commitment loss (summed over sublayers).
    pub commitment: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Fraction of codes used this step (mean over sublayers).
    pub codebook_usage: f64,
    /// Perplexity of the code distribution (mean over sublayers).
    pub code_perplexity: f64,
    /// Relative quantization error |k - k_hat| / |k| (mean over sublayers).
    pub quantization_error: f64,
    /// Training tokens per second over this step.
    pub tokens_per_s: f64,
    /// Training tokens so far.
    pub tokens: u64,
}

/// How a call to [`train`] ended.
#[derive(Debug)]
pub struct TrainSummary {
    /// Steps done in total.
    pub step: u64,
    /// Whether it stopped because of an interrupt.
    pub interrupted: bool,
    /// The final full validation (absent when interrupted).
    pub validation: Option<EvalReport>,
    /// The last checkpoint.
    pub checkpoint: PathBuf,
}

fn step_seed(seed: u64, step: u64) -> u64 {
    seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ step.wrapping_mul(0xBF58_476D_1CE4_E5B9)
}

/// Prepares the run directory: refuses another run's directory, writes the config.
fn prepare_run_dir(cfg: &RunConfig, opts: &TrainOptions) -> Result<(), TrainError> {
    let dir = &opts.run_dir;
    std::fs::create_dir_all(dir).map_err(|e| TrainError::io(dir, e))?;
    let config_path = dir.join("config.toml");
    let has_checkpoints = !checkpoint::list(dir).is_empty();
    if let Ok(old) = std::fs::read_to_string(&config_path) {
        let same = RunConfig::parse(&old, &[]).is_ok_and(|old| {
            old.model == cfg.model && old.data == cfg.data && old.train.seed == cfg.train.seed
        });
        if has_checkpoints && !same && !opts.force {
            return Err(TrainError::ForeignRunDir { path: dir.clone() });
        }
    }
    if has_checkpoints && !opts.resume {
        if !opts.force {
            return Err(TrainError::Config {
                key: "--run-dir".into(),
                reason: format!(
                    "{} already holds checkpoints: pass --resume to continue, or --force to start over",
                    dir.display()
                ),
            });
        }
        let _ = std::fs::remove_dir_all(dir.join("checkpoints"));
        let _ = std::fs::remove_file(dir.join("metrics.jsonl"));
    }
    let tmp = dir.join(".config.toml.tmp");
    std::fs::write(&tmp, cfg.to_toml()).map_err(|e| TrainError::io(&tmp, e))?;
    std::fs::rename(&tmp, &config_path).map_err(|e| TrainError::io(&config_path, e))
}

/// Keeps the metrics lines up to `step` (a resumed run rewrites the rest).
fn truncate_metrics(path: &Path, step: u64) -> Result<(), TrainError> {
    let Ok(text) = std::fs::read_to_string(path) else {
        return Ok(());
    };
    let kept: String = text
        .lines()
        .filter(|l| {
            serde_json::from_str::<serde_json::Value>(l)
                .is_ok_and(|v| v["step"].as_u64().is_some_and(|s| s <= step))
        })
        .map(|l| format!("{l}\n"))
        .collect();
    std::fs::write(path, kept).map_err(|e| TrainError::io(path, e))
}

/// Appends one JSON line to the metrics log and flushes it.
fn append_json(
    file: &mut std::fs::File,
    path: &Path,
    value: &impl Serialize,
) -> Result<(), TrainError> {
    let line = serde_json::to_string(value).expect("metrics serialize");
    writeln!(file, "{line}")
        .and_then(|_| file.flush())
        .map_err(|e| TrainError::io(path, e))
}

fn mean(values: impl Iterator<Item = f64>) -> f64 {
    let (sum, n) = values.fold((0.0, 0usize), |(s, n), v| (s + v, n + 1));
    if n == 0 { 0.0 } else { sum / n as f64 }
}

/// Trains (or continues) the run described by `cfg` on `device` (a plain device).
pub fn train(
    cfg: &RunConfig,
    device: &DispatchDevice,
    opts: &TrainOptions,
) -> Result<TrainSummary, TrainError> {
    let corpus = Corpus::open(&cfg.corpus_spec())?;
    prepare_run_dir(cfg, opts)?;
    let t = &cfg.train;
    let ad = DispatchDevice::autodiff(device.clone());
    let model_cfg = cfg.model.to_model(corpus.vocab.size());
    B::seed(&ad, t.seed);
    let model = model_cfg.init::<B>(&ad).map_err(|e| TrainError::Config {
        key: format!("model.{}", e.key),
        reason: e.reason,
    })?;
    let optim = Optimizers::new(t);
    let n_shards = t.shards();
    let rows = cfg.data.batch_size / n_shards;
    let fresh_states = || vec![ModelState::<B>::new(model_cfg.n_sublayers()); n_shards];

    // Without --resume the run directory holds no checkpoints (prepare_run_dir).
    let resumed_from = opts
        .resume
        .then(|| checkpoint::latest_valid(&opts.run_dir))
        .flatten();
    let (mut model, mut optim, mut states, mut progress) = match &resumed_from {
        Some(dir) => {
            let loaded = checkpoint::load(dir, model, optim, &ad)?;
            if loaded.states.len() != n_shards {
                return Err(TrainError::Config {
                    key: "train.workers".into(),
                    reason: format!(
                        "{} carries the state of {} shards, but train.workers x train.micro_batches = {n_shards}: resume with the values it was written with",
                        dir.display(),
                        loaded.states.len()
                    ),
                });
            }
            tracing::info!(
                "resuming from {} (step {})",
                dir.display(),
                loaded.trainer.step
            );
            (loaded.model, loaded.optim, loaded.states, loaded.trainer)
        }
        None => {
            if opts.resume {
                tracing::warn!(
                    "no valid checkpoint in {}: starting from scratch",
                    opts.run_dir.display()
                );
            }
            (
                model,
                optim,
                fresh_states(),
                TrainerState {
                    step: 0,
                    cursor: TrainCursor::default(),
                    best: None,
                    tokens: 0,
                },
            )
        }
    };
    let metrics_path = opts.run_dir.join("metrics.jsonl");
    truncate_metrics(&metrics_path, progress.step)?;
    let mut metrics = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&metrics_path)
        .map_err(|e| TrainError::io(&metrics_path, e))?;

    let train_split = corpus.split(Split::Train);
    let valid_split = corpus.split(Split::Validation);
    let bytes_per_token = train_split.stats.bytes as f64 / train_split.len().max(1) as f64;
    let mut loader = TrainBatches::new(train_split, cfg.train_layout(), progress.cursor)?;
    let total = opts.max_steps.map_or(t.steps, |m| m.min(t.steps));
    let bar = if opts.progress {
        ProgressBar::new(total)
    } else {
        ProgressBar::hidden()
    };
    bar.set_style(
        ProgressStyle::with_template("[{bar:30}] step {pos}/{len} {msg} eta {eta}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar.set_position(progress.step);
    let mut last_checkpoint = resumed_from;
    let save = |model: &Model,
                optim: &Optimizers,
                states: &[ModelState<B>],
                progress: &TrainerState|
     -> Result<PathBuf, TrainError> {
        let dir = checkpoint::save(&opts.run_dir, model, optim, states, progress)?;
        checkpoint::prune(
            &opts.run_dir,
            t.keep_checkpoints,
            progress.best.map(|b| b.1),
        );
        Ok(dir)
    };

    while progress.step < total {
        if opts.interrupt.load(Ordering::SeqCst) {
            let dir = save(&model, &optim, &states, &progress)?;
            bar.abandon_with_message("interrupted");
            tracing::info!("interrupted: checkpoint written to {}", dir.display());
            draw_curves(&opts.run_dir);
            return Ok(TrainSummary {
                step: progress.step,
                interrupted: true,
                validation: None,
                checkpoint: dir,
            });
        }
        let started = Instant::now();
        let step = progress.step + 1;
        B::seed(&ad, step_seed(t.seed, step)); // dropout draws depend on (seed, step) only
        let batch = loader.next().expect("training batches never end");
        if batch.reset {
            states = fresh_states();
        }
        let shards = std::mem::take(&mut states)
            .into_iter()
            .enumerate()
            .map(|(i, state)| {
                let (inputs, targets, valid) = batch_tensors(&batch, i * rows..(i + 1) * rows, &ad);
                Shard {
                    inputs,
                    targets,
                    valid,
                    state,
                }
            })
            .collect();
        let StepGradients {
            mut grads,
            ce,
            commitment,
            stats,
            states: next_states,
        } = compute_gradients(&model, shards, t.workers, t.commit_weight)?;
        states = next_states;
        let loss = ce + t.commit_weight * commitment;
        if !loss.is_finite() {
            bar.abandon();
            let checkpoint =
                last_checkpoint.map_or("(none yet)".to_string(), |p| p.display().to_string());
            return Err(TrainError::NonFinite {
                step,
                loss,
                checkpoint,
            });
        }
        let grad_norm = clip_global_norm(&model, &mut grads, t.grad_clip);
        let lr = learning_rate(t, step);
        model = optim.step(lr, model, grads);
        model = model.update_codebooks(&stats, t.codebook_decay);

        progress.step = step;
        progress.cursor = loader.cursor();
        let tokens = batch.valid.iter().filter(|&&v| v).count() as u64;
        progress.tokens += tokens;
        let codebooks: Vec<_> = stats.iter().map(|s| s.metrics()).collect();
        let m = StepMetrics {
            kind: "train",
            step,
            lr,
            loss,
            ce,
            bits_per_token: ce / std::f64::consts::LN_2,
            bits_per_byte: ce / std::f64::consts::LN_2 / bytes_per_token,
            commitment,
            grad_norm,
            codebook_usage: mean(codebooks.iter().map(|c| c.usage)),
            code_perplexity: mean(codebooks.iter().map(|c| c.perplexity)),
            quantization_error: mean(codebooks.iter().map(|c| c.relative_error)),
            tokens_per_s: tokens as f64 / started.elapsed().as_secs_f64(),
            tokens: progress.tokens,
        };
        append_json(&mut metrics, &metrics_path, &m)?;
        bar.set_position(step);
        bar.set_message(format!(
            "loss {:.3} bpb {:.3} {:.0} tok/s",
            m.loss, m.bits_per_byte, m.tokens_per_s
        ));

        let eval_now = cfg.eval.every > 0 && step.is_multiple_of(cfg.eval.every);
        if eval_now {
            let report = evaluate(
                &model.valid(),
                &valid_split,
                cfg.eval.batch_size,
                cfg.eval.update_len,
                Some(cfg.eval.segments),
                false,
                t.workers,
            )?;
            if progress.best.is_none_or(|(best, _)| report.loss < best) {
                progress.best = Some((report.loss, step));
            }
            append_json(
                &mut metrics,
                &metrics_path,
                &EvalLine {
                    kind: "eval",
                    step,
                    report: &report,
                },
            )?;
            bar.println(format!(
                "step {step}: validation loss {:.4}, {:.4} bits/byte",
                report.loss, report.bits_per_byte
            ));
        }
        if step.is_multiple_of(t.checkpoint_every) || step == total {
            last_checkpoint = Some(save(&model, &optim, &states, &progress)?);
        }
    }
    bar.finish_and_clear();
    let checkpoint = match last_checkpoint {
        Some(c) => c,
        None => save(&model, &optim, &states, &progress)?,
    };
    let report = evaluate(
        &model.valid(),
        &valid_split,
        cfg.eval.batch_size,
        cfg.eval.update_len,
        None,
        opts.progress,
        t.workers,
    )?;
    append_json(
        &mut metrics,
        &metrics_path,
        &EvalLine {
            kind: "final_eval",
            step: progress.step,
            report: &report,
        },
    )?;
    draw_curves(&opts.run_dir);
    Ok(TrainSummary {
        step: progress.step,
        interrupted: false,
        validation: Some(report),
        checkpoint,
    })
}

/// Draws `loss.png` into the run directory from the metrics so far. A
/// failure only warns: the run itself is complete and saved.
fn draw_curves(run_dir: &Path) {
    let out = run_dir.join("loss.png");
    match plot::plot_run(run_dir, &out) {
        Ok(()) => tracing::info!("loss curves: {}", out.display()),
        Err(e) => tracing::warn!("no loss curves: {e}"),
    }
}

#[derive(Serialize)]
struct EvalLine<'a> {
    kind: &'static str,
    step: u64,
    #[serde(flatten)]
    report: &'a EvalReport,
}
