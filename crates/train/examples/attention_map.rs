//! Where a model's attention goes: for each sublayer, the share of the
//! attention on the present block, the previous block and the compressed
//! cache (everything older, one entry per code), and the entropy of each,
//! over the first batches of a validation split. A model that uses its
//! long context puts weight on the cache.
//!
//!     cargo run --release -p tvq-train --example attention_map -- \
//!         quickstart-20.safetensors configs/quickstart.toml

use anyhow::{Context, Result};
use tvq_data::{Corpus, Split};
use tvq_train::inference::load::load_for_inference;
use tvq_train::placement::device::DeviceSpec;
use tvq_train::{EvalOptions, evaluate};

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let model = args
        .get(1)
        .context("usage: attention_map MODEL CONFIG [BATCHES]")?;
    let config = args.get(2).context("a config naming the corpus")?;
    let batches: usize = args.get(3).map_or(Ok(2), |s| s.parse())?;

    let (device, _) = DeviceSpec::Cpu.init()?;
    let loaded = load_for_inference(model.as_ref(), Some(config.as_ref()), &device)?;
    let cfg = loaded.config.context("the config")?;
    let split = Corpus::open(&cfg.data)?.split(Split::Validation);

    let opts = EvalOptions {
        max_segments: Some(batches),
        workers: 1,
        attention: true,
        ..EvalOptions::default()
    };
    let report = evaluate(&[loaded.model], &split, &cfg.eval, &opts)?;
    println!(
        "{:.4} bits/byte over {} tokens",
        report.bits_per_byte, report.tokens
    );
    println!("sublayer  present  previous  cache   (entropy, nats)");
    for (i, a) in report.attention.iter().flatten().enumerate() {
        let [p, q, c] = a.share;
        let [ep, eq, ec] = a.entropy;
        println!("{i:>8}  {p:>7.3}  {q:>8.3}  {c:>5.3}   ({ep:.2}, {eq:.2}, {ec:.2})");
    }
    Ok(())
}
