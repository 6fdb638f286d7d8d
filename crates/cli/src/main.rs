//! `tvq`: train, evaluate and benchmark Transformer-VQ language models.

// The doc comments of the argument structs are the command line's help
// text, written for the terminal (`[model]` is a TOML table there, not a
// link).
#![allow(rustdoc::broken_intra_doc_links, rustdoc::invalid_html_tags)]

mod args;
mod bench;
mod check;
mod eval;
mod export;
mod import;
mod interrupt;
mod panics;
mod plot;
mod sample;
mod tokenizer;
mod train;

use clap::{Parser, Subcommand};

/// The CPU backend allocates a fresh buffer for nearly every tensor op, many
/// of them megabytes; glibc returns those to the kernel on free, so each new
/// one page-faults in again. mimalloc keeps and reuses them (about 7% more
/// training tokens/s, measured with `tvq bench --optimizer`).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// `tvq --version`: the crate's version and the hash of its kernels'
/// sources, which its compiled kernels are known by in `~/.cache/tvq/`
/// (a cache shipped for other kernels still serves burn's).
fn version() -> &'static str {
    static VERSION: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    VERSION.get_or_init(|| {
        let hash = tvq_model::kernel::SOURCE_HASH;
        format!("{} (kernels {hash:016x})", env!("CARGO_PKG_VERSION"))
    })
}

/// Transformer-VQ: linear-time attention through vector-quantized keys.
///
/// Workflow: `tvq train --config configs/quickstart.toml` trains into
/// runs/quickstart (resume an interrupted run with --resume); `tvq eval
/// --checkpoint runs/quickstart` reports bits per byte; `tvq sample
/// --checkpoint runs/quickstart --prompt "..."` generates text; `tvq plot
/// --run-dir runs/quickstart` draws the loss curves; `tvq export` writes
/// safetensors (`tvq import` reads an official checkpoint). train, eval,
/// sample and bench take --device cpu|wgpu|cuda.
#[derive(Parser, Debug)]
#[command(name = "tvq", version = version(), about, long_about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Train a model from a TOML config (or continue one with --resume).
    Train(train::TrainArgs),
    /// Evaluate a checkpoint on a whole split: loss, bits per token and per byte.
    Eval(eval::EvalArgs),
    /// Generate text from a checkpoint with the recurrent form.
    Sample(sample::SampleArgs),
    /// Write a checkpoint's weights as safetensors, with its config as JSON,
    /// or as a folder Hugging Face `transformers` loads (`--format hf`).
    Export(export::ExportArgs),
    /// Convert a checkpoint of the official JAX implementation, or a
    /// Hugging Face folder of `tvq export --format hf`, into a tvq export
    /// (for eval, sample and `train.init_from`).
    Import(import::ImportArgs),
    /// Draw a run's loss curves (training and validation bits per byte) to a PNG.
    Plot(plot::PlotArgs),
    /// Benchmark one thing: the attention's passes, VQ against the
    /// quadratic baseline, by sequence length (the default), the whole
    /// training step, generation, the data loader, checkpoints, or the
    /// device's peak.
    Bench(bench::BenchArgs),
    /// Check a device against the CPU: a small model's forward pass,
    /// gradients, AdamW, Muon and EMA updates, bf16 step, checkpoint and
    /// generation, each compared within a tolerance; the device's
    /// matrix-product peaks. Exits non-zero if any check fails.
    Check(check::CheckArgs),
    /// Tokenizers for tokenized corpora (PG-19, plain text).
    #[command(subcommand)]
    Tokenizer(tokenizer::TokenizerCommand),
}

/// Logs to stderr and, with `trace`, tvq's spans to a Chrome trace in it
/// (flushed when the returned guard drops). The phase spans are at debug
/// level: without a trace no layer wants them, so they cost next to nothing.
fn init_tracing(trace: Option<std::fs::File>) -> Option<tracing_chrome::FlushGuard> {
    use tracing_subscriber::prelude::*;
    let logs = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
                // burn's collective engine logs every connection at info,
                // cubecl each autotuned shape and its whole adapter.
                "info,burn_collective=warn,burn_communication=warn,\
                 cubecl_runtime=warn,cubecl_wgpu=warn,cubecl_cuda=warn"
                    .into()
            }),
        );
    let (chrome, guard) = match trace {
        Some(file) => {
            let (layer, guard) = tracing_chrome::ChromeLayerBuilder::new()
                .writer(std::io::BufWriter::new(file))
                .include_args(true)
                .build();
            let tvq = tracing_subscriber::filter::Targets::new()
                .with_target("tvq_train", tracing::Level::DEBUG)
                .with_target("tvq", tracing::Level::DEBUG);
            (Some(layer.with_filter(tvq)), Some(guard))
        }
        None => (None, None),
    };
    tracing_subscriber::registry()
        .with(logs)
        .with(chrome)
        .init();
    guard
}

fn main() {
    let cli = Cli::parse();
    let trace = match &cli.command {
        Command::Train(args) => args.trace.clone(),
        Command::Bench(args) => args.trace.clone(),
        _ => None,
    };
    let trace = match trace.map(|p| std::fs::File::create(&p).map_err(|e| (p, e))) {
        Some(Err((path, e))) => {
            eprintln!(
                "error: cannot create the trace file {}: {e}",
                path.display()
            );
            std::process::exit(1);
        }
        Some(Ok(file)) => Some(file),
        None => None,
    };
    let guard = init_tracing(trace);
    panics::install();
    let result = match cli.command {
        Command::Train(args) => train::run(args),
        Command::Eval(args) => eval::run(args),
        Command::Sample(args) => sample::run(args),
        Command::Export(args) => export::run(args),
        Command::Import(args) => import::run(args),
        Command::Plot(args) => plot::run(args),
        Command::Bench(args) => bench::run(args),
        Command::Check(args) => check::run(args),
        Command::Tokenizer(cmd) => tokenizer::run(cmd),
    };
    drop(guard); // the trace is complete before the process exits
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
