//! `tvq bench products`: the rate of each matrix product of the model's
//! forward pass at its own shapes ([`TransformerVqConfig::matrix_products`]),
//! by sequence length and precision, so that a step's speed can be read
//! against what the device's products reach at those shapes (and against
//! PyTorch's: `scripts/torch_reference.py products` times the same shapes
//! from this benchmark's JSON lines).

use std::collections::HashSet;
use std::time::Instant;

use anyhow::{Context, Result};
use burn::Dispatch;
use burn::DispatchDevice;
use burn::prelude::*;
use burn::tensor::Distribution;
use serde_json::json;
use tvq_model::{MatrixProduct, Precision, TransformerVqConfig};

use super::{BenchArgs, parse_form};

/// How long each product is repeated for: long enough that launch and
/// synchronisation costs do not dominate a small product on a GPU.
const TIMED_SECONDS: f64 = 0.1;

/// Times every matrix product of `model`'s forward pass (each --form, each
/// --seq-len with --batch rows, each precision) on `device`; a product is
/// listed once where several forms share it, and one whose output would
/// exceed --max-score-gib is skipped with a row that says so.
pub(super) fn run(
    args: &BenchArgs,
    model: &TransformerVqConfig,
    precisions: &[Precision],
    (device, info): (&DispatchDevice, &str),
) -> Result<()> {
    // Every form and length checked before the header, so that a bad flag
    // gives its error alone.
    let forms = args
        .form
        .iter()
        .map(|form| {
            let cfg = model
                .clone()
                .with_vocab_size(args.vocab_size as usize)
                .with_attention(parse_form(form)?);
            let uneven = args
                .seq_len
                .iter()
                .find(|t| !t.is_multiple_of(cfg.block_len));
            if cfg.attention == tvq_model::AttentionForm::Vq
                && let Some(t) = uneven
            {
                anyhow::bail!(
                    "--seq-len {t} is not a multiple of the block length {}",
                    cfg.block_len
                );
            }
            Ok((form.as_str(), cfg))
        })
        .collect::<Result<Vec<_>>>()?;
    if !args.json {
        println!("device: {info}; batch {}", args.batch);
        println!(
            "{:<10} {:>8} {:>9} {:<32} {:>26} {:>12}",
            "form", "seq_len", "precision", "product", "batch x [m, k] x [k, n]", "GFLOP/s"
        );
    }
    for &t in &args.seq_len {
        for &precision in precisions {
            let mut measured = HashSet::new();
            for (form, cfg) in &forms {
                for product in cfg.matrix_products(args.batch, t) {
                    if measured.insert(product) {
                        let rate = time_product(&product, precision, args.max_score_gib, device)
                            .with_context(|| format!("{} at T = {t}", product.name))?;
                        print_row(args, form, t, precision, &product, rate, info);
                    }
                }
            }
        }
    }
    Ok(())
}

/// The product's rate in FLOP/s, or `None` where an operand or the output
/// would exceed `max_gib`: random operands of its shape in `precision`,
/// multiplied once untimed (compilation, tuning), then in rounds of
/// doubling length until a round lasts [`TIMED_SECONDS`], the device
/// synchronised at the end of each round.
fn time_product(
    p: &MatrixProduct,
    precision: Precision,
    max_gib: f64,
    device: &DispatchDevice,
) -> Result<Option<f64>> {
    let largest = [p.m * p.k, p.k * p.n, p.m * p.n]
        .into_iter()
        .max()
        .unwrap_or(0);
    let bytes = (p.batch * largest * 4) as f64;
    if bytes > max_gib * (1u64 << 30) as f64 {
        return Ok(None);
    }
    let random = |shape: [usize; 3]| {
        Tensor::<Dispatch, 3>::random(shape, Distribution::Default, device).cast(precision.dtype())
    };
    let (a, b) = (random([p.batch, p.m, p.k]), random([p.batch, p.k, p.n]));
    let sync = || Dispatch::sync(device).context("synchronising the device");
    drop(a.clone().matmul(b.clone()));
    sync()?;
    let mut rounds = 1usize;
    loop {
        let start = Instant::now();
        for _ in 0..rounds {
            drop(a.clone().matmul(b.clone()));
        }
        sync()?;
        let seconds = start.elapsed().as_secs_f64();
        if seconds >= TIMED_SECONDS {
            return Ok(Some(rounds as f64 * p.flops_once() / seconds));
        }
        rounds *= 2;
    }
}

fn print_row(
    args: &BenchArgs,
    form: &str,
    t: usize,
    precision: Precision,
    p: &MatrixProduct,
    rate: Option<f64>,
    info: &str,
) {
    if args.json {
        let mut row = json!({
            "form": "products", "attention": form, "seq_len": t, "rows": args.batch,
            "precision": precision, "name": p.name, "count": p.count, "batch": p.batch,
            "m": p.m, "k": p.k, "n": p.n, "flops": p.flops_once(), "device": info,
        });
        match rate {
            Some(rate) => row["flops_per_s"] = json!(rate),
            None => row["skipped"] = json!(format!("over --max-score-gib {}", args.max_score_gib)),
        }
        println!("{row}");
    } else {
        let shape = format!("{} x [{}, {}] x [{}, {}]", p.batch, p.m, p.k, p.k, p.n);
        let shown = rate.map_or("skipped".into(), |r| format!("{:.1}", r / 1e9));
        println!(
            "{form:<10} {t:>8} {precision:>9} {:<32} {shape:>26} {shown:>12}",
            p.name
        );
    }
}
