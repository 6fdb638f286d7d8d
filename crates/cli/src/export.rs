//! `tvq export`: a run's weights as a portable file, or as a folder that
//! Hugging Face `transformers` loads.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Args, ValueEnum};
use tvq_train::inference::export::{ExportInfo, export};
use tvq_train::inference::hf::export_hf;
use tvq_train::inference::load::load_for_inference;
use tvq_train::placement::device::DeviceSpec;

/// Options of `tvq export`.
#[derive(Args, Debug)]
pub struct ExportArgs {
    /// A checkpoint directory or a run directory (its latest checkpoint).
    #[arg(long)]
    checkpoint: PathBuf,
    /// Output: the .safetensors file (a .json with the config is written
    /// beside it), or with `--format hf` the folder (created if missing).
    #[arg(long)]
    out: PathBuf,
    /// What to write: `tvq` (a safetensors file and its config, what tvq's
    /// commands read) or `hf` (a folder for Hugging Face `transformers`:
    /// `AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)`,
    /// `generate()`, lm-evaluation-harness; docs/training.md).
    #[arg(long, value_enum, default_value_t = Format::Tvq)]
    format: Format,
}

/// What `tvq export` writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Format {
    /// A safetensors file and its config.
    Tvq,
    /// A Hugging Face folder.
    Hf,
}

/// Runs `tvq export`.
pub fn run(args: ExportArgs) -> Result<()> {
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
    if args.format == Format::Hf {
        export_hf(&loaded.model, &info, &loaded.vocab, &args.out)?;
        println!("wrote {}", args.out.display());
        return Ok(());
    }
    export(&loaded.model, &info, &args.out)?;
    println!(
        "wrote {} and {}",
        args.out.display(),
        tvq_train::inference::export::info_path(&args.out).display()
    );
    Ok(())
}
