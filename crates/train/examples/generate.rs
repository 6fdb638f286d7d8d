//! Generate text from a model, streaming it as it comes: the prompt is
//! read in block form, then each token costs the same whatever the length
//! so far (the recurrent form over the compressed cache).
//!
//!     cargo run --release -p tvq-train --example generate -- \
//!         quickstart-20.safetensors "And God said" 200

use std::io::Write;

use anyhow::Result;
use tvq_train::inference::load::load_for_inference;
use tvq_train::placement::device::DeviceSpec;
use tvq_train::{SampleOptions, sample};

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let model = args
        .get(1)
        .expect("usage: generate MODEL [PROMPT] [TOKENS]");
    let prompt = args.get(2).map_or("", String::as_str);
    let tokens: usize = args.get(3).map_or(Ok(200), |s| s.parse())?;

    // An export, a checkpoint or a run directory (its newest checkpoint).
    let (device, _) = DeviceSpec::Cpu.init()?;
    let loaded = load_for_inference(model.as_ref(), None, &device)?;
    let vocab = &loaded.vocab;

    let opts = SampleOptions {
        max_tokens: tokens,
        temperature: 0.8,
        top_p: 0.95,
        seed: 1,
        progress: false,
    };
    print!("{prompt}");
    // Tokens are decoded as they come; bytes of one UTF-8 character may
    // span tokens, so what does not decode yet waits for the next.
    let mut pending = vec![];
    let eos = vocab.eos();
    sample(&loaded.model, &vocab.encode(prompt)?, eos, opts, |t| {
        pending.push(t);
        if let Ok(text) = vocab.decode(&pending)
            && !text.ends_with('\u{fffd}')
        {
            print!("{text}");
            let _ = std::io::stdout().flush();
            pending.clear();
        }
        t != eos
    })?;
    println!();
    Ok(())
}
