//! `tvq sample`: text from a model, prompted or not.

use std::io::Write;
use std::path::PathBuf;

use crate::args::{CacheLimits, KernelChoice, init_device};
use anyhow::{Context, Result, bail};
use clap::Args;
use tvq_data::Vocab;
use tvq_train::inference::load::load_for_inference;
use tvq_train::placement::device::DeviceSpec;
use tvq_train::placement::memory;
use tvq_train::{SampleOptions, inference::sample::sample_prompts, sample};

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
    #[arg(long, default_value_t = 256, value_parser = crate::args::at_least(1))]
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
    #[arg(long, default_value_t = 1, value_name = "N", value_parser = crate::args::at_least(1))]
    num_samples: usize,
    #[command(flatten)]
    cache_limits: CacheLimits,
    #[command(flatten)]
    kernels: KernelChoice,
    /// Device: cpu, wgpu, wgpu:N, cuda or cuda:N.
    #[arg(long, default_value = "cpu", value_parser = crate::args::parse_device)]
    device: DeviceSpec,
    /// Go on when the memory estimate exceeds the memory free.
    #[arg(long)]
    force: bool,
}

/// Runs `tvq sample`.
pub fn run(args: SampleArgs) -> Result<()> {
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
    args.kernels.apply(&mut loaded.model);
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
