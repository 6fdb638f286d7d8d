//! `tvq import`: an official checkpoint, or a Hugging Face folder of `tvq
//! export --format hf`, as a tvq export.

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
    #[arg(long, required_unless_present = "hf", requires = "weights")]
    official_config: Option<PathBuf>,
    /// Safetensors file with the official parameters under their official
    /// names (e.g. `transformer_layers_0/scanned_attn1/q_proj/kernel`), float32.
    #[arg(long, requires = "official_config")]
    weights: Option<PathBuf>,
    /// A Hugging Face folder written by `tvq export --format hf` (perhaps
    /// changed and saved again by `transformers`), instead of an official
    /// checkpoint: its settings and weights are checked, then exported.
    #[arg(long, conflicts_with_all = ["official_config", "weights", "tokenizer"])]
    hf: Option<PathBuf>,
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
    if let Some(dir) = &args.hf {
        let (info, model) = tvq_train::inference::hf::import_hf(dir, &device)?;
        return write(&model, &info, &args.out);
    }
    let (Some(official_config), Some(weights)) = (&args.official_config, &args.weights) else {
        bail!("--official-config and --weights, or --hf");
    };
    let vocab = match &args.tokenizer {
        Some(t) => Vocab::load_tokenizer(t)?,
        None => Vocab::Bytes,
    };
    let (model_cfg, model) =
        tvq_train::inference::export::import_official(official_config, weights, &device)?;
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
    write(&model, &info, &args.out)
}

/// Writes the export `out` and says so.
fn write(
    model: &tvq_train::placement::Model,
    info: &ExportInfo,
    out: &std::path::Path,
) -> Result<()> {
    export(model, info, out)?;
    println!(
        "wrote {} and {}",
        out.display(),
        tvq_train::inference::export::info_path(out).display()
    );
    Ok(())
}
