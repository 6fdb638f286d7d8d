//! `tvq bench`: what a run's speed depends on, one benchmark each
//! ([`BenchmarkArg`]): the GAU stack's passes and the whole training step by
//! sequence length, the fused kernels against the composed ops, the matrix
//! products at the model's shapes, generation, the data loader,
//! checkpoints, and the device's peak.

mod kernels;
mod products;
mod profile;

use std::time::Instant;

use anyhow::{Context, Result};
use burn::Dispatch;
use burn::prelude::*;
use clap::{Args, ValueEnum};
use serde::Deserialize;
use serde_json::json;
use tvq_data::{Batch, TrainCursor};
use tvq_model::{AttentionForm, Precision, TransformerVqConfig};
use tvq_train::config::{ActivationCheckpointing, TrainSection};
use tvq_train::placement::device::{DeviceSpec, precision_on};
use tvq_train::placement::{OnTrainBackend, TrainBackend, TrainOn};
use tvq_train::{SampleOptions, Trainer, mfu, sample};

type B = Dispatch;

/// What `tvq bench` measures: one benchmark each (the command's first
/// argument).
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum BenchmarkArg {
    /// The GAU stack's forward and backward passes: tokens/s and MFU by
    /// sequence length, form, precision and activation checkpointing.
    Attention,
    /// The whole training step: forward, backward, global-norm clipping,
    /// the optimizer (`train.optimizer`) and the EMA codebook update.
    Step,
    /// The fused attention and quantizer kernels against the composed ops,
    /// in the model's forward and backward passes on the device's own
    /// backend (the CPU's; wgpu's or cuda's cubecl, without burn's fusion):
    /// tokens/s of each, the sublayers that reached the kernels, and the
    /// two passes' loss and gradient difference.
    Kernels,
    /// Each matrix product of the model's forward pass at its own shapes
    /// (the projections, the codebook distances, the window and cache
    /// products or the quadratic scores, the head), and the backward
    /// pass's two products of each (an operand transposed): GFLOP/s by
    /// sequence length, precision and pass, each product once per form
    /// that has it (`scripts/torch_reference.py products` times the same
    /// shapes in PyTorch from the JSON lines).
    Products,
    /// Generation: for each --seq-len as the prompt length, the time to the
    /// first new token (block-form prefill) and per generated token, and the
    /// recurrent form's rate on the prompt.
    Generate,
    /// Training-batch production from the byte-level text file or directory
    /// PATH, for each --seq-len as the segment length (no model runs).
    Loader,
    /// Checkpoints, in a temporary directory under PATH (removed after; put
    /// it on the disk runs go to): one training step, then --steps rounds of
    /// saving the checkpoint (written and synced) and verifying it (read back
    /// and hashed), each against a plain copy of the same files; and the
    /// checksum's rate on one core.
    Checkpoint,
    /// The device's f32 matrix-product rate (the peak the MFU of a CPU is
    /// reported against): 1024 x 1024 products for half a second.
    Peak,
}

/// The benchmark to run, with its path where it takes one.
#[derive(Debug, Clone, PartialEq)]
enum Benchmark {
    Attention,
    Step,
    Kernels,
    Products,
    Generate,
    Loader(std::path::PathBuf),
    Checkpoint(std::path::PathBuf),
    Peak,
}

/// Options of `tvq bench`, shared by every benchmark (each reads those it
/// needs).
#[derive(Args, Debug)]
pub struct BenchArgs {
    /// The benchmark [default: attention].
    #[arg(value_enum)]
    benchmark: Option<BenchmarkArg>,
    /// The text file or directory (loader), or where the temporary
    /// directory goes (checkpoint).
    #[arg(value_name = "PATH")]
    path: Option<std::path::PathBuf>,
    /// Device: cpu, wgpu, wgpu:N, cuda or cuda:N.
    #[arg(long, default_value = "cpu", value_parser = crate::args::parse_device)]
    device: DeviceSpec,
    /// Sequence lengths to measure (one segment each), comma separated.
    #[arg(long, value_delimiter = ',', default_value = "512,2048,8192,32768",
          value_parser = crate::args::at_least(1))]
    seq_len: Vec<usize>,
    /// Attention forms to measure: vq, quadratic.
    #[arg(long, value_delimiter = ',', default_value = "vq,quadratic")]
    form: Vec<String>,
    /// Batch rows.
    #[arg(long, default_value_t = 4, value_parser = crate::args::at_least(1))]
    batch: usize,
    /// Precisions to measure, comma separated: f32, bf16, f16 [default:
    /// the config's train.precision on the device, where `auto` is bf16 on
    /// CUDA and f32 elsewhere].
    #[arg(long, value_delimiter = ',')]
    precision: Vec<Precision>,
    /// Activation checkpointing modes to measure, comma separated: none,
    /// selective, full [default: the config's train.activation_checkpointing].
    #[arg(long, value_delimiter = ',')]
    checkpointing: Vec<ActivationCheckpointing>,
    /// Vocabulary size of the benchmark model (default: a byte-level
    /// corpus's 256 bytes and 3 special tokens). A large vocabulary weighs
    /// on the output head.
    #[arg(long, default_value_t = 259,
          value_parser = clap::value_parser!(u32).range(4..))]
    vocab_size: u32,
    /// A run config whose [model] and [train] tables set the model and the
    /// step (default: their defaults; [data] and [eval] are ignored).
    #[arg(long)]
    config: Option<std::path::PathBuf>,
    /// Override a [model] or [train] value, e.g. --set model.d_model=512 or
    /// --set train.workers=2 (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    overrides: Vec<String>,
    /// Timed passes (or rounds) per setting, after one untimed warm-up.
    #[arg(long, default_value_t = 2, value_parser = crate::args::at_least(1))]
    steps: usize,
    /// Skip a quadratic setting whose score matrix alone would exceed this
    /// many GiB (products: a product whose operand or output would).
    #[arg(long, default_value_t = 4.0)]
    max_score_gib: f64,
    /// With products on wgpu or cuda: time each product once for each of
    /// cubek's strategies that burn's autotuning chooses among, beside
    /// burn's untuned choice (`auto`), each result checked against
    /// `auto`'s (the rel. diff column).
    #[arg(long)]
    strategies: bool,
    /// Print one JSON object per setting instead of a table.
    #[arg(long)]
    json: bool,
    /// With step or attention on wgpu or cuda: after each setting, where
    /// its timed steps' device time went, by kernel (launches, time,
    /// share). cubecl then times each launch alone, so the setting's own
    /// line (timed with profiling on) is slower than without.
    #[arg(long)]
    profile: bool,
    /// Tokens generated per prompt (generate).
    #[arg(long, default_value_t = 64, value_parser = crate::args::at_least(2))]
    new_tokens: usize,
    /// Peak TFLOP/s of the device for the mfu column [default: measured on
    /// the CPU; a table of known GPUs; none otherwise].
    #[arg(long, value_name = "TFLOPS", value_parser = crate::args::positive)]
    peak_tflops: Option<f64>,
    /// Write a Chrome/Perfetto trace of every timed step's phases (forward,
    /// backward, recomputation, all-reduce, optimizer, EMA, checkpoint,
    /// evaluation) on each thread to FILE (open it in ui.perfetto.dev or
    /// chrome://tracing).
    #[arg(long, value_name = "FILE")]
    pub trace: Option<std::path::PathBuf>,
    /// Old spelling of `tvq bench step` (kept for a release).
    #[arg(long, hide = true)]
    optimizer: bool,
    /// Old spelling of `tvq bench generate` (kept for a release).
    #[arg(long, hide = true)]
    generate: bool,
    /// Old spelling of `tvq bench peak` (kept for a release).
    #[arg(long, hide = true)]
    peak: bool,
    /// Old spelling of `tvq bench loader PATH` (kept for a release).
    #[arg(long, hide = true)]
    loader: Option<std::path::PathBuf>,
    /// Old spelling of `tvq bench checkpoint DIR` (kept for a release).
    #[arg(long, value_name = "DIR", hide = true)]
    checkpoint: Option<std::path::PathBuf>,
}

impl BenchArgs {
    /// The benchmark asked for: the first argument (with its path), or one
    /// of the old flags that named it; more than one is an error.
    fn benchmark(&self) -> Result<Benchmark> {
        let named = match (self.benchmark, self.path.clone()) {
            (None, None) => None,
            (Some(BenchmarkArg::Loader), Some(path)) => Some(Benchmark::Loader(path)),
            (Some(BenchmarkArg::Checkpoint), Some(dir)) => Some(Benchmark::Checkpoint(dir)),
            (Some(BenchmarkArg::Loader | BenchmarkArg::Checkpoint), None) => {
                anyhow::bail!("tvq bench loader and checkpoint need a PATH")
            }
            (_, Some(path)) => {
                anyhow::bail!(
                    "only loader and checkpoint take a PATH, not {}",
                    path.display()
                )
            }
            (Some(BenchmarkArg::Attention), None) => Some(Benchmark::Attention),
            (Some(BenchmarkArg::Step), None) => Some(Benchmark::Step),
            (Some(BenchmarkArg::Kernels), None) => Some(Benchmark::Kernels),
            (Some(BenchmarkArg::Products), None) => Some(Benchmark::Products),
            (Some(BenchmarkArg::Generate), None) => Some(Benchmark::Generate),
            (Some(BenchmarkArg::Peak), None) => Some(Benchmark::Peak),
        };
        let old = [
            self.optimizer.then_some(Benchmark::Step),
            self.generate.then_some(Benchmark::Generate),
            self.peak.then_some(Benchmark::Peak),
            self.loader.clone().map(Benchmark::Loader),
            self.checkpoint.clone().map(Benchmark::Checkpoint),
        ];
        let mut asked: Vec<Benchmark> =
            named.into_iter().chain(old.into_iter().flatten()).collect();
        match asked.len() {
            0 => Ok(Benchmark::Attention),
            1 => Ok(asked.pop().expect("one")),
            _ => anyhow::bail!("one benchmark at a time, not {asked:?}"),
        }
    }
}

/// Tokens per second of training-batch production (the model is not run).
fn bench_loader(args: &BenchArgs, path: &std::path::Path) -> Result<()> {
    use tvq_data::{Corpus, CorpusKind, DataConfig, Split, TrainBatches, TrainCursor, TrainLayout};
    let corpus = Corpus::open(&DataConfig::new(CorpusKind::Text, path))?;
    if !args.json {
        println!("{:<10} {:>8} {:>14}", "form", "seq_len", "tokens/s");
    }
    for &t in &args.seq_len {
        let layout = TrainLayout {
            batch: args.batch,
            update_len: t,
            sequence_len: t,
            seed: 0,
            reset_each_sequence: true,
        };
        let mut batches =
            TrainBatches::new(corpus.split(Split::Train), layout, TrainCursor::default())?;
        let start = Instant::now();
        let mut tokens = 0usize;
        while start.elapsed().as_secs_f64() < 1.0 {
            let b = batches.next().expect("training batches never end");
            tokens += b.inputs.len();
        }
        let tokens_per_s = tokens as f64 / start.elapsed().as_secs_f64();
        if args.json {
            println!(
                "{}",
                json!({"form": "loader", "seq_len": t, "batch": args.batch, "tokens_per_s": tokens_per_s})
            );
        } else {
            println!("{:<10} {t:>8} {tokens_per_s:>14.0}", "loader");
        }
    }
    Ok(())
}

/// Peak resident set size of this process in bytes (Linux), or 0.
fn peak_rss_bytes() -> u64 {
    tvq_train::run::metrics::peak_rss_bytes().unwrap_or(0)
}

/// Resets the peak RSS counter so each setting reports its own peak (Linux).
fn reset_peak_rss() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

fn parse_form(s: &str) -> Result<AttentionForm> {
    match s {
        "vq" => Ok(AttentionForm::Vq),
        "quadratic" => Ok(AttentionForm::Quadratic),
        other => anyhow::bail!("unknown attention form `{other}`: expected vq or quadratic"),
    }
}

/// The `[model]` and `[train]` tables the benchmark runs with.
#[derive(Deserialize)]
struct Measured {
    #[serde(default)]
    model: TransformerVqConfig,
    #[serde(default)]
    train: TrainSection,
}

/// The token ids of the benchmark batch: a fixed pattern over 256 ids.
fn pattern_batch(rows: usize, len: usize, vocab: u32) -> Batch {
    let tokens: Vec<u32> = (0..rows * len)
        .map(|i| (i as u64 * 31 % vocab as u64) as u32)
        .collect();
    Batch {
        batch: rows,
        len,
        targets: tokens.clone(),
        inputs: tokens,
        valid: vec![true; rows * len],
        reset: true,
    }
}

/// Generation from prompts of each --seq-len: time to first token, time per
/// new token and peak memory, through `tvq_train::sample` itself.
fn bench_generate(
    args: &BenchArgs,
    model: &TransformerVqConfig,
    device: &burn::DispatchDevice,
    info: &str,
) -> Result<()> {
    if !args.json {
        println!(
            "{:>8} {:>12} {:>16} {:>16} {:>10} {:>14}",
            "context",
            "first tok s",
            "prefill tok/s",
            "recurrent tok/s",
            "ms/token",
            "peak RSS MiB"
        );
    }
    for &n in &args.seq_len {
        B::seed(device, 0);
        let vocab = args.vocab_size;
        let net = model
            .clone()
            .with_vocab_size(vocab as usize)
            .init::<B>(device)?;
        // Ordinary tokens only: ids 0-2 are the special ones.
        let prompt: Vec<u32> = (0..n.max(1) as u64 - 1)
            .map(|i| 3 + (i * 31 % (vocab as u64 - 3)) as u32)
            .collect();
        let opts = SampleOptions {
            max_tokens: args.new_tokens,
            temperature: 1.0,
            top_p: 1.0,
            seed: 0,
            progress: false,
        };
        reset_peak_rss();
        let start = Instant::now();
        let mut stamps = Vec::with_capacity(args.new_tokens);
        sample(&net, &prompt, 1, opts, |_| {
            stamps.push(start.elapsed().as_secs_f64());
            true
        })?;
        let rss = peak_rss_bytes();
        let first = stamps[0];
        let per_token = (stamps[stamps.len() - 1] - first) / (stamps.len() - 1) as f64;
        // The recurrent form alone on the prompt's first tokens: what
        // prefill cost before it used the block form.
        let probe = prompt.len().clamp(1, 256);
        let started = Instant::now();
        let mut state = net.empty_state();
        for &t in std::iter::once(&1).chain(&prompt).take(probe) {
            let token =
                Tensor::<B, 2, Int>::from_data(TensorData::new(vec![t as i64], [1, 1]), device);
            state = net.decode(token, state)?.1;
        }
        let recurrent = probe as f64 / started.elapsed().as_secs_f64();
        let prefill = n as f64 / first;
        if args.json {
            println!(
                "{}",
                json!({
                    "form": "generate", "context": n, "time_to_first_token_s": first,
                    "prefill_tokens_per_s": prefill, "recurrent_tokens_per_s": recurrent,
                    "per_token_ms": per_token * 1e3, "new_tokens": args.new_tokens,
                    "peak_rss_bytes": rss, "device": info,
                })
            );
        } else {
            println!(
                "{n:>8} {first:>12.3} {prefill:>16.0} {recurrent:>16.0} {:>10.2} {:>14.0}",
                per_token * 1e3,
                rss as f64 / (1 << 20) as f64
            );
        }
    }
    Ok(())
}

/// `--peak`: the measured matrix-product peak of each precision.
fn print_peaks(
    args: &BenchArgs,
    device: &burn::DispatchDevice,
    info: &str,
    precisions: &[Precision],
) {
    for &precision in precisions {
        let flops = mfu::measure_matmul_peak(device, precision);
        if args.json {
            println!(
                "{}",
                json!({"form": "peak", "precision": precision, "flops_per_s": flops, "device": info})
            );
        } else {
            println!(
                "device: {info}; {precision} matrix products: {:.1} GFLOP/s",
                flops / 1e9
            );
        }
    }
}

/// The table's heading: the device, the model, the peaks the MFU is
/// measured against, the columns.
fn print_header(
    args: &BenchArgs,
    info: &str,
    model: &TransformerVqConfig,
    train: &TrainSection,
    precisions: &[Precision],
    peaks: &[Option<f64>],
) {
    println!(
        "device: {info}; batch {} on {} workers, d_model {}, d_k {}, d_v {}, {} layers, S {}, L {}",
        args.batch,
        train.workers,
        model.d_model,
        model.d_k,
        model.d_v,
        model.n_layer,
        model.n_code,
        model.block_len
    );
    for (precision, peak) in precisions.iter().zip(peaks) {
        if let Some(p) = peak {
            println!("mfu of {precision} against {:.1} GFLOP/s", p / 1e9);
        }
    }
    println!(
        "{:<10} {:>8} {:>9} {:>9} {:>14} {:>6} {:>14}",
        "form", "seq_len", "precision", "ckpt", "tokens/s", "mfu", "peak RSS MiB"
    );
}

/// Runs the benchmark and prints the results.
pub fn run(args: BenchArgs) -> Result<()> {
    let benchmark = args.benchmark()?;
    if let Benchmark::Loader(path) = &benchmark {
        return bench_loader(&args, path);
    }
    let text = match &args.config {
        Some(path) => {
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?
        }
        None => String::new(),
    };
    let Measured { model, train } = tvq_train::config::parse_toml(&text, &args.overrides)?;
    if !args.batch.is_multiple_of(train.shards()) {
        anyhow::bail!(
            "train.workers x train.micro_batches ({}) must divide --batch {}",
            train.shards(),
            args.batch
        );
    }
    if args.strategies && !matches!(benchmark, Benchmark::Products) {
        anyhow::bail!("--strategies is for tvq bench products, not {benchmark:?}")
    }
    let log = match (&benchmark, args.profile) {
        (_, false) => None,
        (Benchmark::Step | Benchmark::Attention, true) => {
            Some(profile::KernelLog::start(args.device)?)
        }
        (other, true) => {
            anyhow::bail!("--profile is for tvq bench step and attention, not {other:?}")
        }
    };
    let (device, info) = args.device.init()?;
    let precisions = given_or(&args.precision, precision_on(&device, train.precision));
    let whole_step = match &benchmark {
        Benchmark::Peak => {
            print_peaks(&args, &device, &info, &precisions);
            return Ok(());
        }
        Benchmark::Kernels => {
            return kernels::run(&args, &model, &train, &precisions, (&device, &info));
        }
        Benchmark::Products => return products::run(&args, &model, &precisions, (&device, &info)),
        Benchmark::Generate => return bench_generate(&args, &model, &device, &info),
        Benchmark::Checkpoint(dir) => {
            return bench_checkpoint(&args, &model, &train, &device, dir);
        }
        Benchmark::Step => true,
        Benchmark::Attention | Benchmark::Loader(_) => false,
    };
    // Each precision is measured against the peak of its own products.
    let peaks: Vec<Option<f64>> = precisions
        .iter()
        .map(|&p| mfu::device_peak(&device, p, args.peak_tflops).map(|(peak, _)| peak))
        .collect();
    let forms = args
        .form
        .iter()
        .map(|f| parse_form(f))
        .collect::<Result<Vec<_>>>()?;
    if !args.json {
        print_header(&args, &info, &model, &train, &precisions, &peaks);
    }
    let modes = given_or(&args.checkpointing, train.activation_checkpointing);
    for &form in &forms {
        for &t in &args.seq_len {
            for (&precision, &peak) in precisions.iter().zip(&peaks) {
                for &activation_checkpointing in &modes {
                    let train = TrainSection {
                        precision: precision.into(),
                        activation_checkpointing,
                        ..train.clone()
                    };
                    let on = Measuring {
                        model: &model,
                        train: &train,
                        device: &device,
                        info: &info,
                        peak,
                        whole_step,
                        log: log.as_ref(),
                    };
                    struct Bench<'a>(&'a BenchArgs, &'a Measuring<'a>, AttentionForm, usize);
                    impl OnTrainBackend for Bench<'_> {
                        type Output = Result<()>;
                        fn run<Bk: TrainBackend>(self) -> Result<()> {
                            bench_training::<Bk>(self.0, self.1, self.2, self.3)
                        }
                    }
                    TrainOn::choose(&train, std::slice::from_ref(&device))
                        .run(Bench(&args, &on, form, t))?;
                }
            }
        }
    }
    Ok(())
}

/// Removes a directory when dropped (the checkpoint benchmark's scratch).
struct Scratch(std::path::PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Copies every file of `from` into a new directory `to`, syncing each and
/// the directory: what `cp -r` and `sync` do for these files.
fn plain_copy(from: &std::path::Path, to: &std::path::Path) -> Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let path = entry?.path();
        let target = to.join(path.file_name().context("a file name")?);
        std::fs::copy(&path, &target)?;
        std::fs::File::open(&target)?.sync_all()?;
    }
    std::fs::File::open(to)?.sync_all()?;
    Ok(())
}

/// The median of `xs`.
fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

/// Saves and verifies a checkpoint of the configured model after one
/// training step, --steps times, against a plain copy of its files; prints
/// the medians and the checksum's single-core rate.
fn bench_checkpoint(
    args: &BenchArgs,
    model: &TransformerVqConfig,
    train: &TrainSection,
    device: &burn::DispatchDevice,
    under: &std::path::Path,
) -> Result<()> {
    use tvq_train::checkpoint;
    let scratch = Scratch(under.join(format!(".tvq-bench-checkpoint-{}", std::process::id())));
    std::fs::create_dir_all(&scratch.0)
        .with_context(|| format!("creating {}", scratch.0.display()))?;
    let cfg = model.clone().with_vocab_size(args.vocab_size as usize);
    let mut trainer =
        Trainer::new(&cfg, train, std::slice::from_ref(device)).context("benchmark model")?;
    // One real step, so that every parameter has its optimizer moments.
    let batch = pattern_batch(train.shards(), cfg.block_len, args.vocab_size);
    trainer.step(&batch, TrainCursor::default())?;
    let (mut save, mut verify, mut copy, mut bytes) = (vec![], vec![], vec![], 0u64);
    for round in 0..args.steps {
        let run = scratch.0.join(format!("run-{round}"));
        let start = Instant::now();
        let dir = trainer.save(&run)?;
        save.push(start.elapsed().as_secs_f64());
        let start = Instant::now();
        checkpoint::verify(&dir)?;
        verify.push(start.elapsed().as_secs_f64());
        let start = Instant::now();
        plain_copy(&dir, &scratch.0.join(format!("copy-{round}")))?;
        copy.push(start.elapsed().as_secs_f64());
        bytes = std::fs::read_dir(&dir)?
            .map(|e| Ok(e?.metadata()?.len()))
            .sum::<Result<u64>>()?;
        // Keep the page cache and the disk as they were for the next round.
        std::fs::remove_dir_all(&run)?;
        std::fs::remove_dir_all(scratch.0.join(format!("copy-{round}")))?;
    }
    // The checksum alone, on one core, over as many bytes as the checkpoint
    // (at most 1 GiB, in memory).
    let data: Vec<u8> = (0..bytes.min(1 << 30))
        .map(|i| i.wrapping_mul(0x9E37_79B9) as u8)
        .collect();
    let rate = |f: &dyn Fn(&[u8]) -> u64| {
        let start = Instant::now();
        std::hint::black_box(f(&data));
        data.len() as f64 / start.elapsed().as_secs_f64() / 1e9
    };
    let xxh3 = rate(&checkpoint::checksum);
    let fnv1a = rate(&tvq_data::hash::fnv1a);
    let (save, verify, copy) = (median(save), median(verify), median(copy));
    if args.json {
        println!(
            "{}",
            json!({
                "form": "checkpoint", "bytes": bytes, "save_s": save, "verify_s": verify,
                "plain_copy_s": copy, "save_over_copy": save / copy,
                "xxh3_gb_per_s": xxh3, "fnv1a_gb_per_s": fnv1a, "rounds": args.steps,
            })
        );
    } else {
        let ms = |s: f64| format!("{:.1} ms", s * 1e3);
        println!(
            "checkpoint of {:.1} MB (median of {} rounds): save {} (write + sync), verify {}, \
             plain copy {} (copy + sync); save / copy {:.2}x",
            bytes as f64 / 1e6,
            args.steps,
            ms(save),
            ms(verify),
            ms(copy),
            save / copy
        );
        println!(
            "checksum on one core: xxh3-64 {xxh3:.1} GB/s (FNV-1a, format 1's: {fnv1a:.2} GB/s)"
        );
    }
    Ok(())
}

/// The values given on the command line, or the config's one.
fn given_or<T: Copy>(given: &[T], configured: T) -> Vec<T> {
    if given.is_empty() {
        vec![configured]
    } else {
        given.to_vec()
    }
}

/// What the training benchmarks run on: the model, the step's settings,
/// the device (with its description) and its peak FLOP/s, if known.
struct Measuring<'a> {
    model: &'a TransformerVqConfig,
    train: &'a TrainSection,
    device: &'a burn::DispatchDevice,
    info: &'a str,
    peak: Option<f64>,
    /// The whole training step (`tvq bench step`), not only its passes.
    whole_step: bool,
    /// cubecl's log of every launch, under `--profile`.
    log: Option<&'a profile::KernelLog>,
}

/// Times `--steps` training steps (or forward and backward passes) of
/// `--batch` rows of `t` tokens with attention `form` on the backend `Bk`
/// (the one `tvq train` would use), after one warm-up, and prints one line.
fn bench_training<Bk: TrainBackend>(
    args: &BenchArgs,
    on: &Measuring,
    form: AttentionForm,
    t: usize,
) -> Result<()> {
    let Measuring {
        model,
        train,
        device,
        info,
        peak,
        whole_step,
        log,
    } = *on;
    let form_name = match form {
        AttentionForm::Vq => "vq",
        AttentionForm::Quadratic => "quadratic",
    };
    let (precision, mode) = (train.precision, train.activation_checkpointing);
    let score_gib = (args.batch * t * t * 4) as f64 / (1u64 << 30) as f64;
    if form == AttentionForm::Quadratic && score_gib > args.max_score_gib {
        let reason = format!("scores alone need {score_gib:.1} GiB (> --max-score-gib)");
        if args.json {
            println!(
                "{}",
                json!({
                    "form": form_name, "seq_len": t, "batch": args.batch, "skipped": reason,
                    "precision": precision, "activation_checkpointing": mode,
                })
            );
        } else {
            println!(
                "{form_name:<10} {t:>8} {precision:>9} {mode:>9} {:>14} {:>6} {:>14}",
                "skipped", "-", "-"
            );
        }
        return Ok(());
    }
    let cfg = model
        .clone()
        .with_vocab_size(args.vocab_size as usize)
        .with_attention(form);
    let mut trainer = Trainer::<Bk>::start(&cfg, train, std::slice::from_ref(device))
        .context("benchmark model")?;
    let batch = pattern_batch(args.batch, t, args.vocab_size);
    let mut step = || -> Result<()> {
        let _step = tracing::debug_span!("step").entered();
        if whole_step {
            trainer.step(&batch, TrainCursor::default())?;
        } else {
            trainer.gradients(&batch)?;
        }
        B::sync(device).map_err(|e| anyhow::anyhow!("device sync failed: {e:?}"))?;
        Ok(())
    };
    reset_peak_rss();
    // The warm-up compiles (and on a GPU autotunes) the step's kernels: a
    // fresh node's cold start.
    let warm_up = Instant::now();
    step()?;
    let first_step_s = warm_up.elapsed().as_secs_f64();
    let mark = log.map(profile::KernelLog::settled);
    let start = Instant::now();
    for _ in 0..args.steps {
        step()?;
    }
    let secs = start.elapsed().as_secs_f64();
    let kernels = match (log, mark) {
        (Some(log), Some(mark)) => Some(log.since(mark)?),
        _ => None,
    };
    let tokens_per_s = (args.steps * args.batch * t) as f64 / secs;
    let utilisation = peak.map(|p| tokens_per_s * mfu::training_flops_per_token(&cfg, t) / p);
    let rss = peak_rss_bytes();
    let gpu = trainer.device_memory_bytes();
    if args.json {
        println!(
            "{}",
            json!({
                "form": form_name, "seq_len": t, "batch": args.batch,
                "tokens_per_s": tokens_per_s, "first_step_s": first_step_s,
                "mfu": utilisation, "peak_flops_per_s": peak,
                "flops_per_token": mfu::training_flops_per_token(&cfg, t),
                "peak_rss_bytes": rss, "device_memory_bytes": gpu, "device": info,
                "precision": precision, "activation_checkpointing": mode,
                "workers": train.workers, "kernels": TrainOn::choose(train, std::slice::from_ref(device)).fused(),
                "step": if whole_step { "full" } else { "forward+backward" },
            })
        );
    } else {
        let shown = utilisation.map_or("-".into(), |m| format!("{:.1}%", 100.0 * m));
        println!(
            "{form_name:<10} {t:>8} {precision:>9} {mode:>9} {tokens_per_s:>14.0} {shown:>6} {:>14.0}",
            rss as f64 / (1 << 20) as f64
        );
    }
    if let Some(kernels) = kernels {
        profile::print(&kernels, args.steps, t, args.json);
    }
    Ok(())
}
