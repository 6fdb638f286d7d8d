//! `tvq train`, `eval`, `sample` and `export`: parse, load, call the train crate.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use burn::DispatchDevice;
use clap::{Args, ValueEnum};
use tvq_data::recall::read_task_file;
use tvq_data::{Corpus, CorpusKind, Split, TokenSplit, Vocab};
use tvq_model::AttentionForm;
use tvq_train::config::EvalSection;
use tvq_train::inference::code_sharing::{CodeSharing, SharingBucket};
use tvq_train::inference::export::{ExportInfo, export};
use tvq_train::inference::load::{Loaded, load_for_inference};
use tvq_train::parallel::collective::ClusterSpec;
use tvq_train::placement::device::DeviceSpec;
use tvq_train::placement::{Model, fork_onto, memory};
use tvq_train::{
    AttentionShare, EvalOptions, PositionBucket, RunConfig, SampleOptions, TrainOptions, evaluate,
    inference::sample::sample_prompts, sample, train,
};

/// Options of `tvq train`.
#[derive(Args, Debug)]
pub struct TrainArgs {
    /// The run's TOML config (sections [model], [data], [train], [eval]).
    #[arg(long)]
    config: PathBuf,
    #[command(flatten)]
    devices: Devices,
    /// Run directory for the config, metrics and checkpoints [default: runs/<config name>].
    #[arg(long)]
    run_dir: Option<PathBuf>,
    /// Continue from the run directory's latest valid checkpoint.
    #[arg(long)]
    resume: bool,
    /// Use a run directory that holds another run or files tvq did not
    /// write (deletes its checkpoints unless resuming); also train when the
    /// memory estimate exceeds the memory free.
    #[arg(long)]
    force: bool,
    /// Override a config value, e.g. --set train.lr=3e-4 (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    overrides: Vec<String>,
    /// Stop after this many steps in total (the schedule still follows train.steps).
    #[arg(long)]
    max_steps: Option<u64>,
    /// No progress bars (logs only).
    #[arg(long)]
    quiet: bool,
    /// Peak TFLOP/s of one device, for the model FLOPs utilisation (mfu)
    /// in the logs [default: measured on the CPU; a table of known GPUs].
    #[arg(long, value_name = "TFLOPS", value_parser = crate::positive)]
    peak_tflops: Option<f64>,
    /// Number of processes (nodes: one per machine, or several on one)
    /// that train this one model together, each on its share of every batch.
    #[arg(
        long,
        default_value_t = 1,
        help_heading = "Several processes or machines"
    )]
    nodes: usize,
    /// This process's rank, 0..nodes. Node 0 hosts the coordinator and alone
    /// writes the run directory (config, metrics, checkpoints).
    #[arg(
        long,
        default_value_t = 0,
        help_heading = "Several processes or machines"
    )]
    node_rank: usize,
    /// HOST:PORT of the coordinator, on node 0's machine; the same on every
    /// node (it uses PORT and PORT+1).
    #[arg(
        long,
        default_value = "127.0.0.1:29500",
        help_heading = "Several processes or machines"
    )]
    coordinator: String,
    /// Host name or IP under which the other nodes reach this one
    /// [default: this machine's address on the route to the coordinator].
    #[arg(long, help_heading = "Several processes or machines")]
    node_host: Option<String>,
    /// First of the two ports of this node's tensor service
    /// [default: coordinator port + 2 + 2 x rank].
    #[arg(long, help_heading = "Several processes or machines")]
    data_port: Option<u16>,
    /// Seconds a node waits for the others (to join, at each step) before
    /// it stops with an error naming them.
    #[arg(
        long,
        default_value_t = 120.0,
        help_heading = "Several processes or machines"
    )]
    peer_timeout: f64,
    /// Resume from a checkpoint written with another number of shards
    /// (nodes x workers x micro-batches): the carried states start afresh.
    #[arg(long)]
    reshard: bool,
    /// Write a Chrome/Perfetto trace of every step's phases (data,
    /// forward, backward, recomputation, all-reduce, optimizer, EMA,
    /// checkpoint, evaluation) on each thread to FILE (open it in
    /// ui.perfetto.dev or chrome://tracing).
    #[arg(long, value_name = "FILE")]
    pub trace: Option<PathBuf>,
}

impl TrainArgs {
    /// The cluster flags as a spec (`None` for a run in one process).
    fn cluster(&self) -> Result<Option<ClusterSpec>> {
        if self.nodes <= 1 {
            anyhow::ensure!(
                self.node_rank == 0,
                "--node-rank {} needs --nodes greater than {}",
                self.node_rank,
                self.node_rank
            );
            return Ok(None);
        }
        anyhow::ensure!(
            self.peer_timeout.is_finite() && self.peer_timeout > 0.0,
            "--peer-timeout must be a positive number of seconds"
        );
        Ok(Some(ClusterSpec {
            nodes: self.nodes,
            rank: self.node_rank,
            coordinator: self.coordinator.clone(),
            host: self.node_host.clone(),
            data_port: self.data_port,
            timeout: std::time::Duration::from_secs_f64(self.peer_timeout),
        }))
    }
}

/// Split to evaluate.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum SplitArg {
    /// The validation split.
    Validation,
    /// The test split.
    Test,
}

/// A synthetic task to evaluate on instead of the config's corpus.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum TaskArg {
    /// Multi-query associative recall (the config's `[data.mqar]`, or its
    /// defaults): exact-match accuracy on the answers, by distance.
    Mqar,
    /// Passkey retrieval in the config's byte-level text (`[data.passkey]`,
    /// or its defaults): accuracy on the key's digits, by distance.
    Passkey,
}

/// Options of `tvq eval`.
#[derive(Args, Debug)]
pub struct EvalArgs {
    /// A checkpoint directory, a run directory (its latest checkpoint) or an exported .safetensors.
    #[arg(long, visible_alias = "run-dir")]
    checkpoint: PathBuf,
    /// Config naming the corpus (default: the run directory's config.toml).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Split to evaluate.
    #[arg(long, value_enum, default_value = "validation")]
    split: SplitArg,
    #[command(flatten)]
    devices: Devices,
    /// Threads that score shards of the batch's rows at once, shard g on
    /// device g mod the number of devices (default: the config's
    /// train.workers).
    #[arg(long, value_parser = crate::at_least(1))]
    workers: Option<usize>,
    /// Reset the state every N tokens of each row (a multiple of the config's
    /// eval.update_len), as the official validation does per sequence
    /// (default: carry it through the row).
    #[arg(long, value_name = "N")]
    reset_every: Option<usize>,
    #[command(flatten)]
    cache_limits: CacheLimits,
    /// Also measure the loss by position in the document (log2 buckets):
    /// written as JSON to this file, and drawn to the same name with .png.
    #[arg(long, value_name = "FILE.json")]
    by_position: Option<PathBuf>,
    /// Also measure where each sublayer's attention goes: its share on the
    /// present block, the previous block and the compressed cache, and the
    /// attention entropy, and the queries' learned count weight when the
    /// model has one (over the whole split and, with --by-position, by
    /// position; on a recall task, at the answers, by distance).
    #[arg(long)]
    attention: bool,
    /// Evaluate on a synthetic task instead of the config's corpus (a run
    /// trained on one is evaluated on it without this flag). Reports the
    /// answers' accuracy by distance and, for VQ, by how many other pairs
    /// of the example share a cached answer's code.
    #[arg(long, value_enum)]
    task: Option<TaskArg>,
    /// With --task mqar, or on a run trained on MQAR: key-value pairs per
    /// example (default: the config's data.mqar.pairs, else 16); every key
    /// is asked for.
    #[arg(long, value_parser = crate::at_least(1))]
    pairs: Option<usize>,
    /// With --task, or on a run trained on a recall task: tokens per
    /// example (default: the config's data.sequence_len).
    #[arg(long, value_parser = crate::at_least(1))]
    sequence_len: Option<usize>,
    /// Evaluate on recall examples made elsewhere: a JSON Lines file, one
    /// example per line, {"tokens": [ids], "answers": [{"pos": P, "token":
    /// ID, "distance": D}]}, ids of the model's vocabulary (docs/data.md,
    /// "Recall tasks"). Needs no corpus: an export will do.
    #[arg(long, value_name = "F.jsonl",
          conflicts_with_all = ["task", "pairs", "sequence_len", "split", "by_position"])]
    task_file: Option<PathBuf>,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
    /// Go on when the memory estimate exceeds the memory free.
    #[arg(long)]
    force: bool,
}

/// Options of `tvq sample`.
#[derive(Args, Debug)]
pub struct SampleArgs {
    /// A checkpoint directory, a run directory (its latest checkpoint) or an exported .safetensors.
    #[arg(long)]
    checkpoint: PathBuf,
    /// Text to continue. Repeat the flag for several prompts, generated
    /// together (prompts of one length in token share a batch) and printed
    /// when all are done; none: an empty prompt.
    #[arg(long)]
    prompt: Vec<String>,
    /// A file whose text is a prompt (UTF-8): for prompts too long for the
    /// command line. Repeatable; these prompts follow the --prompt ones.
    #[arg(long, value_name = "FILE")]
    prompt_file: Vec<PathBuf>,
    /// Tokens to generate.
    #[arg(long, default_value_t = 256, value_parser = crate::at_least(1))]
    max_tokens: usize,
    /// Print only the generated text, not the prompt before it (for a long
    /// --prompt-file, or to pipe the continuation on).
    #[arg(long)]
    no_echo: bool,
    /// Sampling temperature (0: greedy).
    #[arg(long, default_value_t = 1.0)]
    temperature: f64,
    /// Nucleus sampling: keep the most likely tokens holding this much probability.
    #[arg(long, default_value_t = 0.9)]
    top_p: f64,
    /// Seed of the draws.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Continuations of the prompt to generate, as one batch (each from its
    /// own stream of the seed: sample i is the same whatever N is). With
    /// more than one, they are printed when all are done.
    #[arg(long, default_value_t = 1, value_name = "N", value_parser = crate::at_least(1))]
    num_samples: usize,
    #[command(flatten)]
    cache_limits: CacheLimits,
    /// Device: cpu, wgpu, wgpu:N, cuda or cuda:N.
    #[arg(long, default_value = "cpu", value_parser = crate::parse_device)]
    device: DeviceSpec,
    /// Go on when the memory estimate exceeds the memory free.
    #[arg(long)]
    force: bool,
}

/// Options of `tvq export`.
#[derive(Args, Debug)]
pub struct ExportArgs {
    /// A checkpoint directory or a run directory (its latest checkpoint).
    #[arg(long)]
    checkpoint: PathBuf,
    /// Output .safetensors file (a .json with the config is written beside it).
    #[arg(long)]
    out: PathBuf,
}

/// Options of `tvq import`.
#[derive(Args, Debug)]
pub struct ImportArgs {
    /// The official model config as JSON: the `config` object of the official
    /// code (n_vocab, d_model, d_k, d_v, n_code, n_head, n_layer, block_len,
    /// mem_len, ...), alone or under a `config` key.
    #[arg(long)]
    official_config: PathBuf,
    /// Safetensors file with the official parameters under their official
    /// names (e.g. `transformer_layers_0/scanned_attn1/q_proj/kernel`), float32.
    #[arg(long)]
    weights: PathBuf,
    /// The tokenizer.json of a tokenized model (default: byte-level, the
    /// official bytes+3 ids).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Output .safetensors file in tvq's layout (a .json with the config is
    /// written beside it).
    #[arg(long)]
    out: PathBuf,
}

/// Options of `tvq plot`.
#[derive(Args, Debug)]
pub struct PlotArgs {
    /// Run directory holding metrics.jsonl (training may still be going on);
    /// repeat it to compare several runs on one chart.
    #[arg(long, required = true)]
    run_dir: Vec<PathBuf>,
    /// PNG to write [default, for one run: RUN_DIR/loss.png].
    #[arg(long)]
    out: Option<PathBuf>,
}

fn init_device(spec: DeviceSpec) -> Result<DispatchDevice> {
    let (device, info) = spec.init()?;
    tracing::info!("device: {info}");
    if spec != DeviceSpec::Cpu && tvq_model::device::GPU_FUSION {
        tracing::info!(
            "kernels are autotuned for each new shape on first use (slow first steps), \
             and the results kept for later runs"
        );
    }
    Ok(device)
}

/// The `--device` list of `tvq train` and `tvq eval`.
#[derive(Args, Debug)]
struct Devices {
    /// Device: cpu, wgpu, wgpu:N, cuda or cuda:N; a list (cuda:0,cuda:1)
    /// runs on several devices of one kind, the worker threads spread over
    /// them.
    #[arg(
        long,
        default_value = "cpu",
        value_delimiter = ',',
        value_parser = crate::parse_device
    )]
    device: Vec<DeviceSpec>,
}

impl Devices {
    fn init(&self) -> Result<Vec<DispatchDevice>> {
        self.device.iter().map(|&spec| init_device(spec)).collect()
    }
}

/// Runs `tvq train`.
pub fn run_train(args: TrainArgs) -> Result<()> {
    let cfg = RunConfig::load(&args.config, &args.overrides)?;
    let cluster = args.cluster()?;
    let devices = args.devices.init()?;
    let run_dir = args.run_dir.clone().unwrap_or_else(|| {
        let stem = args
            .config
            .file_stem()
            .map_or("run".into(), |s| s.to_string_lossy().into_owned());
        PathBuf::from("runs").join(stem)
    });
    let interrupt = crate::interrupt::install()?;
    let opts = TrainOptions {
        run_dir: run_dir.clone(),
        resume: args.resume,
        force: args.force,
        max_steps: args.max_steps,
        interrupt,
        progress: !args.quiet,
        cluster,
        reshard: args.reshard,
        peak_tflops: args.peak_tflops,
    };
    tracing::info!("run directory: {}", run_dir.display());
    let summary = {
        let _silenced = opts.cluster.is_some().then(SilencedStdout::new);
        train(&cfg, &devices, &opts)?
    };
    println!("checkpoint: {}", summary.checkpoint.display());
    match summary.validation {
        Some(v) if v.recall.is_some() => {
            println!("step {}: validation {}", summary.step, v.summary())
        }
        Some(v) => println!(
            "step {}: validation loss {:.4} nats/token, {:.4} bits/byte over {} tokens",
            summary.step, v.loss, v.bits_per_byte, v.tokens
        ),
        None if summary.interrupted => {
            println!("stopped at step {}; continue with --resume", summary.step)
        }
        None => println!(
            "step {}: done (node {}; node 0 reports the validation)",
            summary.step, args.node_rank
        ),
    }
    Ok(())
}

/// Sends the standard output to /dev/null while it lives: burn-collective
/// prints a line to it on every connection, which in a run over several
/// nodes is every step. Logs and progress bars go to the standard error.
struct SilencedStdout {
    #[cfg(unix)]
    saved: Option<std::os::fd::OwnedFd>,
}

impl SilencedStdout {
    fn new() -> Self {
        use std::io::Write;
        let _ = std::io::stdout().flush();
        #[cfg(unix)]
        {
            use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
            let Ok(null) = std::fs::OpenOptions::new().write(true).open("/dev/null") else {
                return Self { saved: None };
            };
            // SAFETY: plain descriptor calls on descriptors this process
            // owns; `dup` gives a fresh descriptor that `saved` then owns.
            let saved = unsafe {
                let saved = libc::dup(1);
                if saved < 0 || libc::dup2(null.as_raw_fd(), 1) < 0 {
                    return Self { saved: None };
                }
                OwnedFd::from_raw_fd(saved)
            };
            Self { saved: Some(saved) }
        }
        #[cfg(not(unix))]
        Self {}
    }
}

impl Drop for SilencedStdout {
    fn drop(&mut self) {
        use std::io::Write;
        let _ = std::io::stdout().flush();
        #[cfg(unix)]
        if let Some(saved) = &self.saved {
            use std::os::fd::AsRawFd;
            // SAFETY: restores the descriptor saved in `new`.
            unsafe { libc::dup2(saved.as_raw_fd(), 1) };
        }
    }
}

/// The `--cache-limit` and `--code-limit` flags of `tvq eval` and `tvq sample`.
#[derive(Args, Debug)]
struct CacheLimits {
    /// Weigh at most N keys of each compressed cache, whatever the model
    /// was trained with (model.cache_limit; 0: no limit): for streams far
    /// longer than the training sequences, give the most keys a training
    /// sequence cached (docs/learning.md).
    #[arg(long, value_name = "N")]
    cache_limit: Option<usize>,
    /// Weigh each code of the compressed cache as at most N keys, whatever
    /// the model was trained with (model.code_limit; 0: no limit): 1 keeps
    /// recall learned on short examples at far longer ones
    /// (docs/learning.md, "The cache's counts").
    #[arg(long, value_name = "N")]
    code_limit: Option<usize>,
}

impl CacheLimits {
    /// Sets the flags' limits on `model`, where given (0: no limit).
    fn apply(&self, model: &mut Model) {
        if let Some(n) = self.cache_limit {
            model.set_cache_limit((n > 0).then_some(n));
        }
        if let Some(n) = self.code_limit {
            model.set_code_limit((n > 0).then_some(n));
        }
    }
}

/// Runs `tvq eval`.
pub fn run_eval(args: EvalArgs) -> Result<()> {
    let devices = args.devices.init()?;
    let mut loaded = load_for_inference(&args.checkpoint, args.config.as_deref(), &devices[0])?;
    args.cache_limits.apply(&mut loaded.model);
    let split = match &args.task_file {
        Some(path) => {
            let (ids, recall) = read_task_file(path, loaded.model.vocab_size())?;
            TokenSplit::from_task(ids, recall, loaded.vocab.eos())
        }
        None => corpus_split(&args, &loaded)?,
    };
    // An export without a config evaluates in segments of whole blocks.
    let (eval, workers) = match &loaded.config {
        Some(cfg) => (cfg.eval.clone(), cfg.train.workers),
        None => {
            let update_len = EvalSection::default().update_len;
            let update_len = update_len.next_multiple_of(loaded.model.block_len());
            let eval = EvalSection {
                update_len,
                ..Default::default()
            };
            (eval, 1)
        }
    };
    let estimate = memory::evaluation(&loaded.model_config, eval.batch_size, eval.update_len);
    memory::check(&estimate, memory::available(&devices[0]), args.force)?;
    let opts = EvalOptions {
        max_segments: None,
        progress: !args.json,
        workers: args.workers.unwrap_or(workers),
        reset_every: args.reset_every,
        by_position: args.by_position.is_some(),
        attention: args.attention,
    };
    let quadratic = (loaded.model.sublayers.iter()).any(|g| g.form == AttentionForm::Quadratic);
    if args.attention && quadratic {
        bail!(
            "--attention measures the groups of VQ attention; this model uses the quadratic form"
        );
    }
    let models: Vec<Model> = (devices.iter())
        .map(|d| fork_onto(&loaded.model, d))
        .collect();
    let report = evaluate(&models, &split, &eval, &opts)?;
    if let (Some(path), Some(buckets)) = (&args.by_position, &report.by_position) {
        std::fs::write(path, serde_json::to_vec_pretty(buckets)?)
            .with_context(|| format!("writing {}", path.display()))?;
        let png = path.with_extension("png");
        let title = format!("{} split, step {}", report.split, loaded.step);
        tvq_train::run::plot::plot_by_position(buckets, &png, &title)?;
        if !args.json {
            println!("loss by position: {} and {}", path.display(), png.display());
        }
    }
    if args.json {
        let mut v = serde_json::to_value(&report)?;
        v["step"] = loaded.step.into();
        println!("{v}");
    } else if let Some(recall) = &report.recall {
        let what = match &args.task_file {
            Some(path) => path.display().to_string(),
            None => format!("{} split", report.split),
        };
        println!(
            "{what}, step {}: recall accuracy {:.2}% ({} of {} answers), loss {:.4} nats/answer",
            loaded.step,
            100.0 * recall.accuracy,
            recall.correct,
            recall.answers,
            report.loss
        );
        println!("by distance between the answer and where it was given (tokens):");
        for b in &recall.by_distance {
            println!(
                "  {:>7}-{:<7} {:>6.2}% of {}",
                b.first,
                b.last,
                100.0 * b.accuracy,
                b.answers
            );
        }
        print_code_sharing(&recall.code_sharing, &recall.code_sharing_joint);
        if let Some(sublayers) = &report.attention {
            print_attention(sublayers, &[]);
            let by_distance = |what: &str, figure: fn(&AttentionShare) -> f64| {
                println!("{what} at the answers, by distance (per sublayer):");
                for b in &recall.by_distance {
                    let figures: Vec<_> = b
                        .attention
                        .iter()
                        .map(|a| format!("{:.3}", figure(a)))
                        .collect();
                    println!("  {:>7}-{:<7} {}", b.first, b.last, figures.join(" "));
                }
            };
            // The cache's share tells whether a far answer came from it.
            by_distance("compressed cache's share", |a| a.share[2]);
            if learned_count_weight(sublayers) {
                by_distance("count weight", |a| a.count_weight);
            }
        }
    } else {
        println!(
            "{} split, step {}: {} tokens, loss {:.4} nats/token, {:.4} bits/token, {:.4} bits/byte{}",
            report.split,
            loaded.step,
            report.tokens,
            report.loss,
            report.bits_per_token,
            report.bits_per_byte,
            report
                .word_perplexity
                .map_or(String::new(), |p| format!(", word perplexity {p:.2}"))
        );
        if let Some(sublayers) = &report.attention {
            print_attention(sublayers, report.by_position.as_deref().unwrap_or_default());
        }
    }
    Ok(())
}

/// The split `tvq eval` reads from the run's corpus, or from the task that
/// replaces it (`--task`).
fn corpus_split(args: &EvalArgs, loaded: &Loaded) -> Result<TokenSplit> {
    let mut cfg = (loaded.config.clone())
        .context("an export carries no corpus: pass --config naming the data")?;
    // A run trained on a recall task is evaluated on it; --pairs and
    // --sequence-len reshape its examples as they do --task's.
    let reshaped = args.pairs.is_some() || args.sequence_len.is_some();
    let task = args.task.or(match cfg.data.kind {
        CorpusKind::Mqar if reshaped => Some(TaskArg::Mqar),
        CorpusKind::Passkey if reshaped => Some(TaskArg::Passkey),
        _ => None,
    });
    match task {
        Some(TaskArg::Mqar) => {
            let mut task = cfg.data.mqar_task();
            task.pairs = args.pairs.unwrap_or(task.pairs);
            task.queries = None;
            cfg.data.kind = CorpusKind::Mqar;
            cfg.data.tokenizer = None;
            cfg.data.mqar = Some(task);
            cfg.data.sequence_len = args.sequence_len.unwrap_or(cfg.data.sequence_len);
        }
        Some(TaskArg::Passkey) => {
            if args.pairs.is_some() {
                bail!("--pairs sets --task mqar's examples, not a passkey's");
            }
            cfg.data.kind = CorpusKind::Passkey;
            cfg.data.passkey.get_or_insert_with(Default::default);
            cfg.data.sequence_len = args.sequence_len.unwrap_or(cfg.data.sequence_len);
        }
        None if reshaped => {
            bail!(
                "--pairs and --sequence-len set a recall task's examples and the run's corpus is text: add --task mqar or --task passkey"
            )
        }
        None => {}
    }
    let corpus = Corpus::open(&cfg.data)?;
    if corpus.vocab.size() != loaded.model.vocab_size() {
        bail!(
            "the model has a vocabulary of {} tokens, the corpus's ({}) has {}: evaluate with the config of the data it was trained on",
            loaded.model.vocab_size(),
            corpus.vocab.id(),
            corpus.vocab.size()
        );
    }
    let split = corpus.split(match args.split {
        SplitArg::Validation => Split::Validation,
        SplitArg::Test => Split::Test,
    });
    Ok(split)
}

/// Accuracy of the answers recalled from the compressed cache, by how many
/// other pairs of their example took the same code, one line per codebook,
/// then one for the pairs on the same code in every codebook.
fn print_code_sharing(codebooks: &[CodeSharing], joint: &[SharingBucket]) {
    if codebooks.is_empty() {
        return;
    }
    println!(
        "answers from the compressed cache, by other pairs of the example on the pair's code \
         (accuracy of answers; mean keys on the code):"
    );
    let cells = |buckets: &[SharingBucket]| -> String {
        (buckets.iter())
            .map(|b| {
                let others = match (b.first, b.last) {
                    (0, _) => "alone".to_string(),
                    (f, l) if f == l => format!("{f} other"),
                    (f, l) => format!("{f}-{l} others"),
                };
                format!(
                    "{others} {:.1}% of {} ({:.1})",
                    100.0 * b.accuracy,
                    b.answers,
                    b.mean_code_load
                )
            })
            .collect::<Vec<_>>()
            .join(", ")
    };
    for c in codebooks {
        println!(
            "  sublayer {} head {}: {}",
            c.sublayer,
            c.head,
            cells(&c.buckets)
        );
    }
    println!(
        "  on the same code in every codebook (least loaded code): {}",
        cells(joint)
    );
}

/// Whether the figures come from a model whose queries weigh the cache's
/// counts by a learned weight (`model.count_weight`); in the paper's cache
/// it is 1 exactly.
fn learned_count_weight(sublayers: &[AttentionShare]) -> bool {
    sublayers.iter().any(|a| a.count_weight != 1.0)
}

/// The `--attention` tables: each sublayer's shares and entropy over the
/// split (and its mean count weight, when learned), then the shares (mean
/// over sublayers) by position.
fn print_attention(sublayers: &[AttentionShare], by_position: &[PositionBucket]) {
    let learned = learned_count_weight(sublayers);
    println!(
        "attention share: present / previous / cache, entropy (nats){}",
        if learned { ", count weight" } else { "" }
    );
    for (i, a) in sublayers.iter().enumerate() {
        let w = if learned {
            format!(", {:.3}", a.count_weight)
        } else {
            String::new()
        };
        println!(
            "  sublayer {i}: {:.3} / {:.3} / {:.3}, {:.2}{w}",
            a.share[0],
            a.share[1],
            a.share[2],
            a.entropy.iter().sum::<f64>()
        );
    }
    if by_position.is_empty() {
        return;
    }
    println!("by position (mean over sublayers):");
    for b in by_position {
        let n = b.attention.len().max(1) as f64;
        let mean = |f: &dyn Fn(&AttentionShare) -> f64| b.attention.iter().map(f).sum::<f64>() / n;
        println!(
            "  {:>7}-{:<7} {:.3} / {:.3} / {:.3}, {:.2}",
            b.first,
            b.last,
            mean(&|a| a.share[0]),
            mean(&|a| a.share[1]),
            mean(&|a| a.share[2]),
            mean(&|a| a.entropy.iter().sum()),
        );
    }
}

/// Runs `tvq sample`.
pub fn run_sample(args: SampleArgs) -> Result<()> {
    if !(args.top_p > 0.0 && args.top_p <= 1.0) {
        bail!("--top-p must be in (0, 1], got {}", args.top_p);
    }
    if !(args.temperature >= 0.0 && args.temperature.is_finite()) {
        bail!(
            "--temperature must be a number of at least 0, got {}",
            args.temperature
        );
    }
    let texts = prompt_texts(&args)?;
    let device = init_device(args.device)?;
    let mut loaded = load_for_inference(&args.checkpoint, None, &device)?;
    let rows = args.num_samples.saturating_mul(texts.len());
    let estimate = memory::sampling(&loaded.model_config, rows, args.max_tokens);
    memory::check(&estimate, memory::available(&device), args.force)?;
    args.cache_limits.apply(&mut loaded.model);
    let prompts = texts
        .iter()
        .map(|t| loaded.vocab.encode(t))
        .collect::<Result<Vec<_>, _>>()?;
    let opts = SampleOptions {
        max_tokens: args.max_tokens,
        temperature: args.temperature,
        top_p: args.top_p,
        seed: args.seed,
        progress: true,
    };
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let vocab = &loaded.vocab;
    // What is printed before each continuation.
    let echoed: Vec<&str> = texts
        .iter()
        .map(|t| if args.no_echo { "" } else { t.as_str() })
        .collect();
    if args.num_samples > 1 || prompts.len() > 1 {
        let eos = vocab.eos();
        let samples = sample_prompts(
            &loaded.model,
            &prompts,
            eos,
            args.num_samples,
            opts,
            |_, _, t| t != eos,
        )?;
        return print_samples(&mut out, vocab, &echoed, &samples);
    }
    let (text, prompt) = (echoed[0], &prompts[0]);
    write!(out, "{text}")?;
    let mut pending: Vec<u32> = vec![];
    let mut shown = String::new();
    sample(&loaded.model, prompt, vocab.eos(), opts, |t| {
        if t == vocab.eos() {
            return false;
        }
        // Decode the tokens of the current line and print what is new (UTF-8
        // may span tokens). A finished line is dropped, so that the decoding
        // cost per token stays bounded by the line, not the whole sample.
        pending.push(t);
        if let Ok(text) = vocab.decode(&pending)
            && !text.ends_with('\u{fffd}')
        {
            let _ = write!(out, "{}", text.get(shown.len()..).unwrap_or_default());
            let _ = out.flush();
            if text.ends_with('\n') {
                pending.clear();
                shown.clear();
            } else {
                shown = text;
            }
        }
        true
    })?;
    // What is still held back: an incomplete UTF-8 sequence at the end,
    // shown as the replacement character (as with --num-samples).
    let text = vocab.decode(&pending)?;
    writeln!(out, "{}", text.get(shown.len()..).unwrap_or_default())?;
    Ok(())
}

/// The prompts of `tvq sample`: every `--prompt`, then every
/// `--prompt-file`'s text; one empty prompt when none is given.
fn prompt_texts(args: &SampleArgs) -> Result<Vec<String>> {
    let mut texts = args.prompt.clone();
    for file in &args.prompt_file {
        let text = std::fs::read_to_string(file)
            .with_context(|| format!("cannot read prompt file {}", file.display()))?;
        texts.push(text);
    }
    if texts.is_empty() {
        texts.push(String::new());
    }
    Ok(texts)
}

/// Prints every sample of every prompt (`samples[p][i]`, cut at the end of
/// text) after its echoed prompt, under a heading naming it.
fn print_samples(
    out: &mut impl Write,
    vocab: &Vocab,
    echoed: &[&str],
    samples: &[Vec<Vec<u32>>],
) -> Result<()> {
    let eos = vocab.eos();
    for (p, (text, samples)) in echoed.iter().zip(samples).enumerate() {
        for (i, tokens) in samples.iter().enumerate() {
            let end = tokens
                .iter()
                .position(|&t| t == eos)
                .unwrap_or(tokens.len());
            let continued = vocab.decode(&tokens[..end])?;
            let which = match echoed.len() {
                1 => format!("sample {}", i + 1),
                _ => format!("prompt {}, sample {}", p + 1, i + 1),
            };
            writeln!(out, "--- {which} ---\n{text}{continued}")?;
        }
    }
    Ok(())
}

/// Runs `tvq export`.
pub fn run_export(args: ExportArgs) -> Result<()> {
    let device = DeviceSpec::Cpu.init()?.0;
    let loaded = load_for_inference(&args.checkpoint, None, &device)?;
    let cfg = loaded
        .config
        .context("export needs a checkpoint of a run")?;
    let info = ExportInfo {
        format: "tvq".into(),
        model: cfg.model_config(loaded.vocab.size()),
        vocab: loaded.vocab.id(),
        tokenizer: cfg.data.tokenizer.clone(),
        step: loaded.step,
    };
    export(&loaded.model, &info, &args.out)?;
    println!(
        "wrote {} and {}",
        args.out.display(),
        tvq_train::inference::export::info_path(&args.out).display()
    );
    Ok(())
}

/// Runs `tvq import`.
pub fn run_import(args: ImportArgs) -> Result<()> {
    let device = DeviceSpec::Cpu.init()?.0;
    let vocab = match &args.tokenizer {
        Some(t) => Vocab::load_tokenizer(t)?,
        None => Vocab::Bytes,
    };
    let (model_cfg, model) = tvq_train::inference::export::import_official(
        &args.official_config,
        &args.weights,
        &device,
    )?;
    if model_cfg.vocab_size != vocab.size() {
        bail!(
            "the official model has {} tokens, the {} vocabulary {}{}",
            model_cfg.vocab_size,
            vocab.id(),
            vocab.size(),
            match args.tokenizer {
                None => "; pass the model's --tokenizer",
                Some(_) => "",
            }
        );
    }
    let info = ExportInfo {
        format: "tvq".into(),
        model: model_cfg,
        vocab: vocab.id(),
        tokenizer: args.tokenizer,
        step: 0,
    };
    export(&model, &info, &args.out)?;
    println!(
        "wrote {} and {}",
        args.out.display(),
        tvq_train::inference::export::info_path(&args.out).display()
    );
    Ok(())
}

/// Runs `tvq plot`.
pub fn run_plot(args: PlotArgs) -> Result<()> {
    let out = match (args.out, args.run_dir.as_slice()) {
        (out, [one]) => {
            let out = out.unwrap_or_else(|| one.join("loss.png"));
            tvq_train::run::plot::plot_run(one, &out)?;
            out
        }
        (Some(out), several) => {
            let dirs: Vec<&Path> = several.iter().map(PathBuf::as_path).collect();
            tvq_train::run::plot::plot_runs(&dirs, &out)?;
            out
        }
        (None, _) => bail!("--out is needed to compare several runs (where should the chart go?)"),
    };
    println!("wrote {}", out.display());
    Ok(())
}
