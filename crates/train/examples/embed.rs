//! The model's hidden states for a text, e.g. as features for a probe: the
//! embeddings run through every sublayer in block form, `[1, T, D]`, here
//! mean-pooled to one vector of `D` features.
//!
//!     cargo run --release -p tvq-train --example embed -- \
//!         quickstart-20.safetensors "In the beginning God created the heaven"

use anyhow::{Context, Result};
use burn::prelude::*;
use tvq_model::{Logits, Pass};
use tvq_train::inference::load::load_for_inference;
use tvq_train::placement::B;
use tvq_train::placement::device::DeviceSpec;

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let model = args.get(1).context("usage: embed MODEL TEXT")?;
    let text = args.get(2).context("a text to embed")?;

    let (device, _) = DeviceSpec::Cpu.init()?;
    let loaded = load_for_inference(model.as_ref(), None, &device)?;
    let model = &loaded.model;

    // The block form reads whole blocks: pad the tokens to a multiple of
    // the block length with the end-of-document token, and pool over the
    // text's own positions only.
    let mut ids: Vec<i64> = loaded
        .vocab
        .encode(text)?
        .iter()
        .map(|&t| t as i64)
        .collect();
    let len = ids.len();
    let padded = len.max(1).next_multiple_of(model.block_len());
    ids.resize(padded, loaded.vocab.eos() as i64);
    let tokens = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [1, padded]), &device);

    // The hidden states after the last sublayer; no logits.
    let pass = Pass::new().with_logits(Logits::None);
    let h = model.forward(tokens, model.empty_state(), pass)?.h; // [1, T, D]
    let features = h.slice([0..1, 0..len.max(1)]).mean_dim(1); // [1, 1, D]
    let values: Vec<f32> = features.into_data().convert::<f32>().into_vec().unwrap();
    println!("{} tokens -> {} features", len, values.len());
    let shown: Vec<String> = values.iter().take(8).map(|v| format!("{v:+.3}")).collect();
    println!("[{}, ...]", shown.join(", "));
    Ok(())
}
