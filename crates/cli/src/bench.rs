//! `tvq bench`: training-step throughput of the GAU stack by sequence length.

use std::time::Instant;

use anyhow::{Context, Result};
use burn::prelude::*;
use burn::{Dispatch, DispatchDevice};
use clap::Args;
use serde_json::json;
use tvq_model::device::DeviceSpec;
use tvq_model::{AttentionForm, TransformerVqConfig};
use tvq_train::step::{Shard, compute_gradients};

type B = Dispatch;

/// Options of `tvq bench`.
#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Device: cpu, wgpu, wgpu:N, cuda or cuda:N.
    #[arg(long, default_value = "cpu", value_parser = crate::parse_device)]
    device: DeviceSpec,
    /// Sequence lengths to measure (one segment each), comma separated.
    #[arg(long, value_delimiter = ',', default_value = "512,2048,8192,32768")]
    seq_len: Vec<usize>,
    /// Attention forms to measure: vq, quadratic.
    #[arg(long, value_delimiter = ',', default_value = "vq,quadratic")]
    form: Vec<String>,
    /// Batch rows.
    #[arg(long, default_value_t = 4)]
    batch: usize,
    /// Model width D.
    #[arg(long, default_value_t = 256)]
    d_model: usize,
    /// Key width K.
    #[arg(long, default_value_t = 64)]
    d_k: usize,
    /// Value width V.
    #[arg(long, default_value_t = 512)]
    d_v: usize,
    /// Layers (two GAU sublayers each).
    #[arg(long, default_value_t = 2)]
    n_layer: usize,
    /// Codebook size S.
    #[arg(long, default_value_t = 128)]
    n_code: usize,
    /// Block length L.
    #[arg(long, default_value_t = 128)]
    block_len: usize,
    /// Timed forward+backward passes per setting (after one untimed warm-up).
    #[arg(long, default_value_t = 2)]
    steps: usize,
    /// Skip a quadratic setting whose score matrix alone would exceed this many GiB.
    #[arg(long, default_value_t = 4.0)]
    max_score_gib: f64,
    /// Print one JSON object per setting instead of a table.
    #[arg(long)]
    json: bool,
    /// Time a full training step: forward, backward, global-norm clipping,
    /// AdamW and the EMA codebook update (default: forward and backward only).
    #[arg(long)]
    optimizer: bool,
    /// Threads that run shards of the batch at once, as `train.workers`
    /// (divides --batch).
    #[arg(long, default_value_t = 1)]
    workers: usize,
    /// Measure the data loader instead: training-batch production from this
    /// byte-level text file or directory, for each --seq-len as the segment length.
    #[arg(long)]
    loader: Option<std::path::PathBuf>,
}

/// Tokens per second of training-batch production (the model is not run).
fn bench_loader(args: &BenchArgs, path: &std::path::Path) -> Result<()> {
    use tvq_data::{Corpus, CorpusKind, CorpusSpec, Split, TrainBatches, TrainCursor, TrainLayout};
    let spec = CorpusSpec {
        kind: CorpusKind::Text,
        path: path.to_path_buf(),
        tokenizer: None,
        allow_proportional_split: false,
        cache_dir: None,
    };
    let corpus = Corpus::open(&spec)?;
    if !args.json {
        println!("{:<10} {:>8} {:>14}", "form", "seq_len", "tokens/s");
    }
    for &t in &args.seq_len {
        let layout = TrainLayout {
            batch: args.batch,
            update_len: t,
            sequence_len: t,
            seed: 0,
            reset_each_sequence: true,
        };
        let mut batches =
            TrainBatches::new(corpus.split(Split::Train), layout, TrainCursor::default())?;
        let start = Instant::now();
        let mut tokens = 0usize;
        while start.elapsed().as_secs_f64() < 1.0 {
            let b = batches.next().expect("training batches never end");
            tokens += b.inputs.len();
        }
        let tokens_per_s = tokens as f64 / start.elapsed().as_secs_f64();
        if args.json {
            println!(
                "{}",
                json!({"form": "loader", "seq_len": t, "batch": args.batch, "tokens_per_s": tokens_per_s})
            );
        } else {
            println!("{:<10} {t:>8} {tokens_per_s:>14.0}", "loader");
        }
    }
    Ok(())
}

/// Peak resident set size of this process in bytes (Linux), or 0.
fn peak_rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// Resets the peak RSS counter so each setting reports its own peak (Linux).
fn reset_peak_rss() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

fn parse_form(s: &str) -> Result<AttentionForm> {
    match s {
        "vq" => Ok(AttentionForm::Vq),
        "quadratic" => Ok(AttentionForm::Quadratic),
        other => anyhow::bail!("unknown attention form `{other}`: expected vq or quadratic"),
    }
}

/// Runs the benchmark and prints the results.
pub fn run(args: BenchArgs) -> Result<()> {
    if let Some(path) = &args.loader {
        return bench_loader(&args, path);
    }
    if args.workers == 0 || !args.batch.is_multiple_of(args.workers) {
        anyhow::bail!(
            "--workers {} must be positive and divide --batch {}",
            args.workers,
            args.batch
        );
    }
    let (device, info) = args.device.init()?;
    let device = DispatchDevice::autodiff(device);
    let forms = args
        .form
        .iter()
        .map(|f| parse_form(f))
        .collect::<Result<Vec<_>>>()?;
    if !args.json {
        println!(
            "device: {info}; batch {} on {} workers, d_model {}, d_k {}, d_v {}, {} layers, S {}, L {}",
            args.batch,
            args.workers,
            args.d_model,
            args.d_k,
            args.d_v,
            args.n_layer,
            args.n_code,
            args.block_len
        );
        println!(
            "{:<10} {:>8} {:>14} {:>14}",
            "form", "seq_len", "tokens/s", "peak RSS MiB"
        );
    }
    for &form in &forms {
        for &t in &args.seq_len {
            let form_name = match form {
                AttentionForm::Vq => "vq",
                AttentionForm::Quadratic => "quadratic",
            };
            let score_gib = (args.batch * t * t * 4) as f64 / (1u64 << 30) as f64;
            if form == AttentionForm::Quadratic && score_gib > args.max_score_gib {
                let reason = format!("scores alone need {score_gib:.1} GiB (> --max-score-gib)");
                if args.json {
                    println!(
                        "{}",
                        json!({"form": form_name, "seq_len": t, "batch": args.batch, "skipped": reason})
                    );
                } else {
                    println!("{form_name:<10} {t:>8} {:>14} {:>14}", "skipped", "-");
                }
                continue;
            }
            let cfg = TransformerVqConfig::new(256)
                .with_d_model(args.d_model)
                .with_d_k(args.d_k)
                .with_d_v(args.d_v)
                .with_n_layer(args.n_layer)
                .with_n_code(args.n_code)
                .with_block_len(args.block_len)
                .with_attention(form);
            B::seed(&device, 0);
            let mut model = Some(cfg.init::<B>(&device).context("benchmark model")?);
            let train_cfg = tvq_train::config::TrainSection::default();
            let mut optim = tvq_train::optim::Optimizers::new(&train_cfg);
            let tokens: Vec<i64> = (0..args.batch * t).map(|i| (i * 31 % 256) as i64).collect();
            let tokens =
                Tensor::<B, 2, Int>::from_data(TensorData::new(tokens, [args.batch, t]), &device);
            let rows = args.batch / args.workers;
            let mut step = || -> Result<()> {
                let m = model.take().expect("the model is put back after each step");
                let shards = (0..args.workers)
                    .map(|w| {
                        let part = tokens.clone().slice([w * rows..(w + 1) * rows, 0..t]);
                        Shard {
                            inputs: part.clone(),
                            targets: part,
                            valid: Tensor::<B, 2, Bool>::full([rows, t], true, &device),
                            state: m.empty_state(),
                        }
                    })
                    .collect();
                let step = compute_gradients(&m, shards, args.workers, train_cfg.commit_weight)?;
                let m = if args.optimizer {
                    let mut grads = step.grads;
                    tvq_train::optim::clip_global_norm(&m, &mut grads, train_cfg.grad_clip);
                    optim
                        .step(train_cfg.lr, m, grads)
                        .update_codebooks(&step.stats, train_cfg.codebook_decay)
                } else {
                    m
                };
                B::sync(&device).map_err(|e| anyhow::anyhow!("device sync failed: {e:?}"))?;
                model = Some(m);
                Ok(())
            };
            reset_peak_rss();
            step()?; // warm-up
            let start = Instant::now();
            for _ in 0..args.steps {
                step()?;
            }
            let secs = start.elapsed().as_secs_f64();
            let tokens_per_s = (args.steps * args.batch * t) as f64 / secs;
            let rss = peak_rss_bytes();
            if args.json {
                println!(
                    "{}",
                    json!({
                        "form": form_name, "seq_len": t, "batch": args.batch,
                        "tokens_per_s": tokens_per_s, "peak_rss_bytes": rss, "device": info,
                        "workers": args.workers,
                        "step": if args.optimizer { "full" } else { "forward+backward" },
                    })
                );
            } else {
                println!(
                    "{form_name:<10} {t:>8} {tokens_per_s:>14.0} {:>14.0}",
                    rss as f64 / (1 << 20) as f64
                );
            }
        }
    }
    Ok(())
}
