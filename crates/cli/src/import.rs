//! `tvq import`: an official checkpoint as a tvq export.

use std::path::PathBuf;

use anyhow::{Result, bail};
use clap::Args;
use tvq_data::Vocab;
use tvq_train::inference::export::{ExportInfo, export};
use tvq_train::placement::device::DeviceSpec;

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

/// Runs `tvq import`.
pub fn run(args: ImportArgs) -> Result<()> {
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
