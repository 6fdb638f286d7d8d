//! `tvq export`: a run's weights as a portable file.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use tvq_train::inference::export::{ExportInfo, export};
use tvq_train::inference::load::load_for_inference;
use tvq_train::placement::device::DeviceSpec;

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
    export(&loaded.model, &info, &args.out)?;
    println!(
        "wrote {} and {}",
        args.out.display(),
        tvq_train::inference::export::info_path(&args.out).display()
    );
    Ok(())
}
