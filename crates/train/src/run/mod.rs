//! A training run in a run directory: set up or resume, then step, log,
//! evaluate and checkpoint until done or interrupted.
//!
//! Over several nodes every node runs this same loop on its rows of each
//! batch; node 0 alone writes the run directory (config, metrics,
//! checkpoints, plots) and runs the final evaluation. It holds the run
//! directory's lock while it runs, so no second writer can start there.

pub mod lock;
pub mod metrics;
pub mod plot;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use burn::DispatchDevice;
use indicatif::ProgressBar;
use tvq_data::{Corpus, Split, TokenSplit, TrainBatches, Vocab};
use tvq_model::Precision;

use self::lock::RunLock;
use self::metrics::{EvalLine, MetricsLog, RunFacts, SampleLine, StepMetrics};
use crate::checkpoint;
use crate::config::{EvalSection, RunConfig, Schedule, TrainSection};
use crate::error::TrainError;
use crate::inference::evaluate::{EvalOptions, EvalReport, evaluate};
use crate::inference::sample::{SampleOptions, sample};
use crate::mfu::training_flops_per_token;
use crate::parallel::collective::{ClusterSpec, Collective};
use crate::placement::device::precision_on;
use crate::placement::memory;
use crate::placement::{OnTrainBackend, TrainBackend, TrainOn};
use crate::progress::progress_bar;
use crate::trainer::{Trainer, check_devices};

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
    /// This process's place in a run over several processes (`None`: alone).
    pub cluster: Option<ClusterSpec>,
    /// Resume from a checkpoint of another shard count, with fresh carried states.
    pub reshard: bool,
    /// Peak TFLOP/s of one device for the MFU in the metrics, where the
    /// user gives it ([`crate::mfu::device_peak`] otherwise).
    pub peak_tflops: Option<f64>,
}

/// How a call to [`train`] ended.
#[derive(Debug)]
pub struct TrainSummary {
    /// Steps done in total.
    pub step: u64,
    /// Whether it stopped because of an interrupt.
    pub interrupted: bool,
    /// The final full validation (absent when interrupted, and on nodes
    /// other than node 0).
    pub validation: Option<EvalReport>,
    /// The last checkpoint (written by node 0).
    pub checkpoint: PathBuf,
}

/// Trains (or continues) the run described by `cfg` on `devices` (plain
/// devices of one backend: the model lives on the first, the worker
/// threads are spread over all; see [`Trainer::new`]).
pub fn train(
    cfg: &RunConfig,
    devices: &[DispatchDevice],
    opts: &TrainOptions,
) -> Result<TrainSummary, TrainError> {
    let on = TrainOn::choose(&cfg.train, devices);
    tracing::info!("attention and quantizer: {on}");
    struct Train<'a>(&'a RunConfig, &'a [DispatchDevice], &'a TrainOptions);
    impl OnTrainBackend for Train<'_> {
        type Output = Result<TrainSummary, TrainError>;
        fn run<Bk: TrainBackend>(self) -> Self::Output {
            train_on::<Bk>(self.0, self.1, self.2)
        }
    }
    on.run(Train(cfg, devices, opts))
}

/// [`train`] on the backend `Bk`.
fn train_on<Bk: TrainBackend>(
    cfg: &RunConfig,
    devices: &[DispatchDevice],
    opts: &TrainOptions,
) -> Result<TrainSummary, TrainError> {
    let (rank, nodes) = opts.cluster.as_ref().map_or((0, 1), |c| (c.rank, c.nodes));
    // What can be checked without files, before anything is written.
    let node_rows = node_rows(cfg, rank, nodes)?;
    check_devices::<Bk>(devices, cfg.train.workers)?;
    let corpus = Corpus::open(&cfg.data)?;
    let train_split = corpus.split(Split::Train);
    // The lock is held until the run returns; released by the OS however
    // it ends.
    let (mut trainer, facts, _lock) =
        set_up_trainer::<Bk>(cfg, devices, opts, &corpus, (rank, nodes))?;
    let total = opts
        .max_steps
        .map_or(cfg.train.steps, |m| m.min(cfg.train.steps));
    let resumed_at = trainer.state().step;
    let mut log = match rank {
        0 => Some(MetricsLog::open(
            &opts.run_dir,
            resumed_at,
            resumed_at == total,
            cfg.log.tensorboard,
        )?),
        _ => None,
    };
    let periodic = Periodic {
        cfg,
        valid_split: corpus.split(Split::Validation),
        vocab: &corpus.vocab,
        prompt: corpus.vocab.encode(&cfg.eval.sample_prompt)?,
        run_dir: &opts.run_dir,
        total,
    };
    let layout = cfg.data.train_layout(cfg.train.seed);
    let mut loader =
        TrainBatches::new(train_split, layout, trainer.state().cursor)?.with_rows(node_rows)?;
    let bar = step_bar(opts.progress, total, trainer.state().step);
    let mut first_step = FirstStep::start(&bar, !matches!(devices[0], DispatchDevice::Flex(_)));

    // Alone, an interrupt stops before the next step; over several nodes it
    // travels with the next step's sum, so that every node stops after it.
    trainer.watch_interrupt(opts.interrupt.clone());
    let alone = opts.cluster.is_none();
    while trainer.state().step < total && !(alone && opts.interrupt.load(Ordering::SeqCst)) {
        let batch = tracing::debug_span!("data")
            .in_scope(|| loader.next().expect("training batches never end"));
        let step_span = tracing::debug_span!("step", step = trainer.state().step + 1);
        let outcome = step_span.in_scope(|| trainer.step(&batch, loader.cursor()))?;
        if let Some(first) = first_step.take() {
            first.done(&bar);
        }
        let m = StepMetrics::new(&outcome, &facts, trainer.state().tokens);
        if let Some(log) = &mut log {
            log.append(&m)?;
        }
        bar.set_position(m.step);
        bar.set_message(m.summary());
        periodic.after_step(&mut trainer, m.step, log.as_mut(), &bar)?;
        if outcome.interrupted {
            break;
        }
    }

    finish(
        &mut trainer,
        log.as_mut(),
        &bar,
        total,
        &opts.run_dir,
        |t| periodic.validate(t, None, opts.progress),
    )
}

/// The trainer of the run, ready for its next step: built for the model of
/// the corpus's vocabulary, the run directory locked and prepared (node 0),
/// resumed with `--resume`, and joined to the other nodes; with what the
/// metrics of its steps read from the run, and the run directory's lock.
///
/// Everything that can be refused without the run directory (the corpus,
/// the memory the sizes need) is checked before the directory is made, so
/// that a refused run leaves no directory behind.
fn set_up_trainer<Bk: TrainBackend>(
    cfg: &RunConfig,
    devices: &[DispatchDevice],
    opts: &TrainOptions,
    corpus: &Corpus,
    (rank, nodes): (usize, usize),
) -> Result<(Trainer<Bk>, RunFacts, Option<RunLock>), TrainError> {
    let model = cfg.model_config(corpus.vocab.size());
    let node_batch = cfg.data.batch_size / nodes;
    let rows_in_flight = node_batch / cfg.train.micro_batches;
    let precision = precision_on(&devices[0], cfg.train.precision);
    let free = memory::available(&devices[0]);
    for estimate in [
        memory::training(
            &model,
            precision,
            cfg.train.activation_checkpointing,
            rows_in_flight,
            cfg.data.update_len,
            node_batch,
        ),
        memory::evaluation(&model, cfg.eval.batch_size, cfg.eval.update_len),
    ] {
        memory::check(&estimate, free, opts.force)?;
    }
    let mut trainer = Trainer::<Bk>::start(&model, &cfg.train, devices)?.on_node(rank, nodes);
    tracing::info!(
        "products in {precision} (train.precision = {}), activation checkpointing {}",
        cfg.train.precision,
        cfg.train.activation_checkpointing
    );
    if matches!(devices[0], DispatchDevice::Flex(_)) {
        hint_cpu_micro_batches(cfg, nodes);
    }
    let peak = peak_flops(&devices[0], precision, opts.peak_tflops);
    let facts = RunFacts {
        bytes_per_token: corpus.split(Split::Train).bytes_per_token(),
        flops_per_token: training_flops_per_token(&model, cfg.data.update_len),
        peak_flops: peak.map(|p| p * (devices.len() * nodes) as f64),
        precision,
        activation_checkpointing: cfg.train.activation_checkpointing,
    };
    let lock = match rank {
        0 => Some(lock_run_dir(&opts.run_dir)?),
        _ => None,
    };
    let previous = match rank {
        0 => prepare_run_dir(cfg, opts)?,
        _ => None,
    };
    // Resumed (or started from train.init_from) before the config is
    // written: weights that do not fit this config leave the run directory
    // as it was.
    resume_latest(&mut trainer, opts)?;
    if let Some(source) = cfg.train.init_from.as_deref()
        && trainer.last_checkpoint().is_none()
    {
        trainer.start_from(source)?;
        tracing::info!("starting from the weights of {}", source.display());
    }
    if rank == 0 {
        write_config(cfg, &opts.run_dir)?;
    }
    if let Some(old) = previous {
        warn_if_the_past_schedule_changed(&old.train, &cfg.train, trainer.state().step);
    }
    if let Some(spec) = &opts.cluster {
        trainer.join(Collective::join(spec, &devices[0])?, fingerprint(cfg))?;
        tracing::info!("node {rank} of {nodes}: joined at {}", spec.coordinator);
    }
    Ok((trainer, facts, lock))
}

/// What a run does between steps, as its config says: validations,
/// samples and checkpoints.
struct Periodic<'a> {
    cfg: &'a RunConfig,
    valid_split: TokenSplit,
    vocab: &'a Vocab,
    /// `eval.sample_prompt`, encoded.
    prompt: Vec<u32>,
    run_dir: &'a Path,
    /// The last step of this call to [`train`].
    total: u64,
}

impl Periodic<'_> {
    /// Validation on the first `max_segments` batches (`None`: the whole
    /// split), on every device of the run.
    fn validate<Bk: TrainBackend>(
        &self,
        trainer: &Trainer<Bk>,
        max_segments: Option<usize>,
        progress: bool,
    ) -> Result<EvalReport, TrainError> {
        let opts = EvalOptions {
            max_segments,
            progress,
            workers: self.cfg.train.workers,
            ..EvalOptions::default()
        };
        evaluate(
            &trainer.inference_models(),
            &self.valid_split,
            &self.cfg.eval,
            &opts,
        )
    }

    /// After `step`: validates, samples and writes a checkpoint where it
    /// is due. Every node validates (the nodes stay in step; it is cheap
    /// next to waiting) and saves (node 0 writes); node 0, the one with the
    /// `log`, records and samples.
    fn after_step<Bk: TrainBackend>(
        &self,
        trainer: &mut Trainer<Bk>,
        step: u64,
        mut log: Option<&mut MetricsLog>,
        bar: &ProgressBar,
    ) -> Result<(), TrainError> {
        let (eval, due) = (&self.cfg.eval, |every: u64| {
            every > 0 && step.is_multiple_of(every)
        });
        if due(eval.every) {
            let report = tracing::debug_span!("evaluation")
                .in_scope(|| self.validate(trainer, Some(eval.segments), false))?;
            trainer.record_validation(report.loss);
            if let Some(log) = &mut log {
                log.append(&EvalLine::new("eval", step, &report))?;
            }
            bar.println(format!("step {step}: validation {}", report.summary()));
        }
        if let Some(log) = &mut log
            && due(eval.sample_every)
        {
            let sample = tracing::debug_span!("sample")
                .in_scope(|| draw_sample(trainer, self.vocab, &self.prompt, eval, step))?;
            bar.println(format!("step {step}: sample {:?}", sample.text));
            log.append_sample(&sample)?;
        }
        if due(self.cfg.train.checkpoint_every) || step == self.total {
            tracing::debug_span!("checkpoint").in_scope(|| trainer.save(self.run_dir))?;
        }
        Ok(())
    }
}

/// A sample of the model as it is after `step` (`eval.sample_every`),
/// drawn as `tvq sample` draws: the prompt read in block form, then the
/// recurrent form, from the sample's own seeded stream, so that the run
/// itself is untouched.
fn draw_sample<Bk: TrainBackend>(
    trainer: &Trainer<Bk>,
    vocab: &Vocab,
    prompt: &[u32],
    eval: &EvalSection,
    step: u64,
) -> Result<SampleLine, TrainError> {
    let opts = SampleOptions {
        max_tokens: eval.sample_tokens,
        temperature: eval.sample_temperature,
        top_p: eval.sample_top_p,
        seed: eval.sample_seed,
        progress: false,
    };
    let eos = vocab.eos();
    let tokens = sample(&trainer.inference_model(), prompt, eos, opts, |t| t != eos)?;
    let end = tokens
        .iter()
        .position(|&t| t == eos)
        .unwrap_or(tokens.len());
    Ok(SampleLine {
        step,
        prompt: eval.sample_prompt.clone(),
        text: vocab.decode(&tokens[..end])?,
    })
}

/// Ends a run after its loop: the last checkpoint (written unless the loop
/// just wrote it), then, unless interrupted, the final validation over the
/// whole split (node 0, the one with the `log`) and the loss curves.
fn finish<Bk: TrainBackend>(
    trainer: &mut Trainer<Bk>,
    log: Option<&mut MetricsLog>,
    bar: &ProgressBar,
    total: u64,
    run_dir: &Path,
    final_validation: impl FnOnce(&Trainer<Bk>) -> Result<EvalReport, TrainError>,
) -> Result<TrainSummary, TrainError> {
    let (step, interrupted) = (trainer.state().step, trainer.state().step < total);
    // Every node takes the same branch (all save, or none).
    let current = checkpoint::checkpoint_dir(run_dir, step);
    let checkpoint = match trainer.last_checkpoint() {
        Some(c) if c == current => current,
        _ => trainer.save(run_dir)?,
    };
    let validation = if interrupted {
        bar.abandon_with_message("interrupted");
        let who = if trainer.is_writer() {
            ""
        } else {
            " (by node 0)"
        };
        tracing::info!(
            "interrupted: checkpoint written{who} to {}",
            checkpoint.display()
        );
        None
    } else {
        bar.finish_and_clear();
        match log {
            Some(log) => {
                let report = final_validation(trainer)?;
                log.append(&EvalLine::new("final_eval", step, &report))?;
                Some(report)
            }
            None => None,
        }
    };
    if trainer.is_writer() {
        draw_curves(run_dir);
    }
    Ok(TrainSummary {
        step,
        interrupted,
        validation,
        checkpoint,
    })
}

/// The rows of every batch that node `rank` of `nodes` trains on: an equal
/// share of whole shards.
fn node_rows(
    cfg: &RunConfig,
    rank: usize,
    nodes: usize,
) -> Result<std::ops::Range<usize>, TrainError> {
    let batch = cfg.data.batch_size;
    let shards = nodes * cfg.train.shards();
    if !batch.is_multiple_of(shards) {
        return Err(TrainError::Config {
            key: "data.batch_size".into(),
            reason: format!(
                "({batch}) must be a multiple of nodes x train.workers x train.micro_batches ({shards})"
            ),
        });
    }
    let per_node = batch / nodes;
    Ok(rank * per_node..(rank + 1) * per_node)
}

/// What every node of a run must agree on: the model, the training
/// settings and the batch layout (not the data's paths, which may differ
/// between machines).
fn fingerprint(cfg: &RunConfig) -> u64 {
    let text = format!(
        "{}\n{}\n{:?}",
        toml::to_string(&cfg.model).unwrap_or_default(),
        toml::to_string(&cfg.train).unwrap_or_default(),
        cfg.data.train_layout(cfg.train.seed)
    );
    tvq_data::hash::fnv1a(text.as_bytes())
}

/// With `--resume`, continues from the run directory's newest valid
/// checkpoint (there is none without it: [`prepare_run_dir`]).
fn resume_latest<Bk: TrainBackend>(
    trainer: &mut Trainer<Bk>,
    opts: &TrainOptions,
) -> Result<(), TrainError> {
    if !opts.resume {
        return Ok(());
    }
    if let Some(dir) = checkpoint::latest_valid(&opts.run_dir) {
        trainer.resume(&dir, opts.reshard)?;
        let step = trainer.state().step;
        tracing::info!("resuming from {} (step {step})", dir.display());
        return Ok(());
    }
    let damaged: Vec<String> = checkpoint::list(&opts.run_dir)
        .iter()
        .filter_map(|(_, dir)| checkpoint::verify(dir).err())
        .map(|e| e.to_string())
        .collect();
    if damaged.is_empty() {
        tracing::info!(
            "no checkpoint in {} yet: starting from step 0",
            opts.run_dir.display()
        );
        return Ok(());
    }
    // Starting over would replace the damaged checkpoints: a user's run is
    // theirs to give up, never tvq's.
    Err(TrainError::Checkpoint {
        path: opts.run_dir.join("checkpoints"),
        reason: format!(
            "no checkpoint can be resumed ({}); nothing was changed: restore one, or start \
             over with --force and no --resume (which deletes them)",
            damaged.join("; ")
        ),
    })
}

/// Takes the run directory for this process alone ([`RunLock`]), then
/// removes what a writer before it left half done.
fn lock_run_dir(run_dir: &Path) -> Result<RunLock, TrainError> {
    let lock = RunLock::acquire(run_dir)?;
    let cleared = checkpoint::remove_leftovers(run_dir);
    if cleared > 0 {
        tracing::info!(
            "removed {cleared} temporary entries left in {} by an interrupted writer",
            run_dir.display()
        );
    }
    Ok(lock)
}

/// The peak FLOP/s of one device that the MFU is reported against
/// ([`crate::mfu::device_peak`]), said in the log.
fn peak_flops(
    device: &DispatchDevice,
    precision: Precision,
    override_tflops: Option<f64>,
) -> Option<f64> {
    match crate::mfu::device_peak(device, precision, override_tflops) {
        Some((peak, source)) => {
            tracing::info!(
                "MFU against {:.3} TFLOP/s per device ({source})",
                peak / 1e12
            );
            Some(peak)
        }
        None => {
            tracing::info!("no MFU: this device's peak is not known; give --peak-tflops");
            None
        }
    }
}

/// Tokens in one pass of a worker above which a CPU step slows down: 4 rows
/// x 8,192 tokens ran at about 0.7x the tokens/s of passes of 8,192 tokens
/// (docs/benchmarks.md, "What makes long rows slower").
const CPU_PASS_TOKENS: usize = 8_192;

/// The `train.micro_batches` that would keep a worker's passes within
/// [`CPU_PASS_TOKENS`] tokens, splitting `rows_per_pass` rows of `seg_len`
/// tokens into equal groups, or `None` if they already are within it or
/// the rows cannot be split finer.
fn cpu_micro_batches(rows_per_pass: usize, seg_len: usize, micro_batches: usize) -> Option<usize> {
    if rows_per_pass * seg_len <= CPU_PASS_TOKENS {
        return None;
    }
    let split = (2..=rows_per_pass)
        .find(|k| {
            rows_per_pass.is_multiple_of(*k) && rows_per_pass / k * seg_len <= CPU_PASS_TOKENS
        })
        .unwrap_or(rows_per_pass);
    (split > 1).then_some(micro_batches * split)
}

/// Says in the log when a CPU run's passes hold more tokens than run fast
/// there, and the `micro_batches` that would not. Not applied by itself:
/// it changes the sum's rounding and the checkpoint's shards.
fn hint_cpu_micro_batches(cfg: &RunConfig, nodes: usize) {
    let shards = nodes * cfg.train.shards();
    let rows_per_pass = cfg.data.batch_size / shards;
    let seg_len = cfg.data.update_len;
    if let Some(m) = cpu_micro_batches(rows_per_pass, seg_len, cfg.train.micro_batches) {
        tracing::info!(
            "hint: each pass of a worker holds {rows_per_pass} rows x {seg_len} tokens; on a CPU, \
             train.micro_batches = {m} would run them in smaller passes, faster and in less \
             memory (docs/training.md; a resumed run changes it with --reshard)"
        );
    }
}

/// Warns when a resumed run's learning rate differs from its own past: the
/// steps already done (`done`) had the rates of `old`, the config the run
/// goes on with is `new`.
fn warn_if_the_past_schedule_changed(old: &TrainSection, new: &TrainSection, done: u64) {
    if let Some(step) = crate::step::optim::schedule_differs(old, new, done) {
        let extendable = match new.schedule {
            Schedule::Cosine => {
                "a cosine's whole course follows train.steps; \
                                 schedule = \"wsd\" or \"constant\" can be extended"
            }
            _ => "a wsd run extends exactly only from a checkpoint before its decay starts",
        };
        tracing::warn!(
            "the learning-rate schedule changed for steps already done (first at step {step}): \
             the run goes on with the new schedule from step {}, but is not the run this \
             config trains from the start ({extendable})",
            done + 1
        );
    }
}

/// The entries tvq writes at the top of a run directory.
const RUN_FILES: [&str; 7] = [
    "config.toml",
    "metrics.jsonl",
    "samples.jsonl",
    "loss.png",
    "tb",
    "checkpoints",
    lock::LOCK_FILE,
];

/// Prepares the run directory for this run: refuses another run's
/// directory, and a directory tvq did not set up (files there and no tvq
/// `config.toml`), unless `--force`; refuses symbolic links among tvq's
/// own entries (writing through one would write outside the run); with
/// `--force` and no `--resume` deletes the checkpoints and logs of the run
/// there. Returns the config the run directory held, if any; the new one
/// is written by [`write_config`] once the run has resumed.
fn prepare_run_dir(cfg: &RunConfig, opts: &TrainOptions) -> Result<Option<RunConfig>, TrainError> {
    let dir = &opts.run_dir;
    std::fs::create_dir_all(dir).map_err(|e| TrainError::io(dir, e))?;
    refuse_links(dir)?;
    let config_path = dir.join("config.toml");
    let has_checkpoints = !checkpoint::list(dir).is_empty();
    let old = std::fs::read_to_string(&config_path)
        .ok()
        .and_then(|text| RunConfig::parse(&text, &[]).ok());
    if old.is_none() && !opts.force {
        let mut entries = std::fs::read_dir(dir)
            .map_err(|e| TrainError::io(dir, e))?
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|name| name != lock::LOCK_FILE)
            .collect::<Vec<_>>();
        entries.sort();
        if let Some(first) = entries.first() {
            let what = match config_path.exists() {
                true => "a config.toml that is not a tvq config".to_string(),
                false => format!("{first} ({} entries) but no tvq config.toml", entries.len()),
            };
            return Err(TrainError::Config {
                key: "--run-dir".into(),
                reason: format!(
                    "{} holds {what}: tvq did not set it up; use another --run-dir, \
                     or --force to train there (tvq's files in it are then replaced)",
                    dir.display()
                ),
            });
        }
    }
    if has_checkpoints && !opts.force {
        let same = old.as_ref().is_some_and(|old| {
            old.model == cfg.model && old.data == cfg.data && old.train.seed == cfg.train.seed
        });
        if !same && config_path.exists() {
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
        let _ = std::fs::remove_file(dir.join("samples.jsonl"));
        let _ = std::fs::remove_dir_all(dir.join("tb"));
    }
    Ok(old)
}

/// Refuses symbolic links among tvq's entries of `dir` and inside its
/// `tb/` and `checkpoints/`: tvq writes, truncates and deletes there, and
/// through a link it would do so elsewhere.
fn refuse_links(dir: &Path) -> Result<(), TrainError> {
    let link =
        |path: &Path| std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink());
    let inside = |sub: &str| -> Vec<PathBuf> {
        match link(&dir.join(sub)) {
            true => vec![],
            false => std::fs::read_dir(dir.join(sub))
                .into_iter()
                .flatten()
                .flatten()
                .map(|e| e.path())
                .collect(),
        }
    };
    let found = RUN_FILES
        .iter()
        .map(|name| dir.join(name))
        .chain(inside("tb"))
        .chain(inside("checkpoints"))
        .find(|p| link(p));
    match found {
        Some(path) => Err(TrainError::Config {
            key: "--run-dir".into(),
            reason: format!(
                "{} is a symbolic link: tvq writes its run directory's files itself and \
                 follows no link there (writing through it would change a file elsewhere); \
                 remove the link",
                path.display()
            ),
        }),
        None => Ok(()),
    }
}

/// Writes the run's config into its directory (atomically).
fn write_config(cfg: &RunConfig, dir: &Path) -> Result<(), TrainError> {
    let config_path = dir.join("config.toml");
    let tmp = dir.join(".config.toml.tmp");
    crate::nofollow::write(&tmp, cfg.to_toml().as_bytes()).map_err(|e| TrainError::io(&tmp, e))?;
    std::fs::rename(&tmp, &config_path).map_err(|e| TrainError::io(&config_path, e))
}

/// The step bar's template.
const STEP_BAR: &str = "[{bar:30}] step {pos}/{len} {msg} eta {eta}";

/// The progress bar of the steps (hidden when `show` is false).
fn step_bar(show: bool, total: u64, done: u64) -> ProgressBar {
    let bar = progress_bar(show, total, STEP_BAR);
    bar.set_position(done);
    bar
}

/// A GPU's first step of a process compiles its kernels and, in the
/// default build, tunes them for each new shape: minutes on a node that has
/// never run tvq, seconds once cubecl's caches hold them (`~/.cache/tvq`).
/// Until it is done the step bar says so and counts the seconds; then the
/// log says how long it took.
struct FirstStep(std::time::Instant);

impl FirstStep {
    /// On a GPU, the notice on `bar`; on the CPU, nothing.
    fn start(bar: &ProgressBar, gpu: bool) -> Option<Self> {
        if !gpu {
            return None;
        }
        bar.set_style(crate::progress::style(
            "[{bar:30}] step {pos}/{len} {msg} {elapsed}",
        ));
        bar.set_message(
            "first step: compiling and tuning kernels (kept in the cache for later runs)",
        );
        bar.enable_steady_tick(std::time::Duration::from_millis(500));
        Some(Self(std::time::Instant::now()))
    }

    /// Back to the step bar, and the first step's time in the log.
    fn done(self, bar: &ProgressBar) {
        bar.disable_steady_tick();
        bar.set_style(crate::progress::style(STEP_BAR));
        tracing::info!(
            "first step in {:.1} s (its kernels compiled and tuned, or read from the cache)",
            self.0.elapsed().as_secs_f64()
        );
    }
}

/// Draws `loss.png` into the run directory from the metrics so far: into
/// a fresh file beside it, renamed in place, so that a link placed at
/// `loss.png` is replaced rather than written through. A failure only
/// warns: the run itself is complete and saved.
fn draw_curves(run_dir: &Path) {
    let out = run_dir.join("loss.png");
    // (The plotting backend takes the format from the extension.)
    let tmp = run_dir.join(".loss.tmp.png");
    let _ = std::fs::remove_file(&tmp);
    let drawn = plot::plot_run(run_dir, &tmp)
        .and_then(|()| std::fs::rename(&tmp, &out).map_err(|e| TrainError::io(&out, e)));
    if drawn.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    match drawn {
        Ok(()) => tracing::info!("loss curves: {}", out.display()),
        Err(e) => tracing::warn!("no loss curves: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::cpu_micro_batches;

    #[test]
    fn long_passes_on_the_cpu_are_split_to_at_most_8192_tokens() {
        // 2 rows of 8,192 per pass: one row per pass.
        assert_eq!(cpu_micro_batches(2, 8_192, 1), Some(2));
        // 8 rows of 2,048: passes of 4 rows; on top of 3 micro-batches.
        assert_eq!(cpu_micro_batches(8, 2_048, 3), Some(6));
        // 6 rows of 2,048: 3 rows would be 6,144 tokens, so 2 passes.
        assert_eq!(cpu_micro_batches(6, 2_048, 1), Some(2));
        // 3 rows of 4,096: only whole rows, one per pass.
        assert_eq!(cpu_micro_batches(3, 4_096, 1), Some(3));
    }

    #[test]
    fn short_passes_and_single_rows_get_no_hint() {
        assert_eq!(cpu_micro_batches(16, 512, 1), None);
        assert_eq!(cpu_micro_batches(1, 8_192, 1), None);
        // One row is as small as a pass gets, however long.
        assert_eq!(cpu_micro_batches(1, 32_768, 2), None);
    }
}
