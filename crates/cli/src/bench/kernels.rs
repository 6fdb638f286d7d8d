//! `tvq bench kernels`: the fused attention and quantizer kernels against
//! the composed ops they replace, in the model's forward and backward passes on the
//! device's own backend (burn's wgpu or CUDA backend, with burn's fusion in
//! the default build, as the trainer has them; the CPU: `Flex`), where the
//! kernels plug in (`tvq_model::kernel`).
//!
//! For each segment length, the same model, batch and dropout masks run
//! both ways, alternating pass by pass; each line gives both rates, how
//! many sublayers reached each kernel, and how far the two passes' loss and
//! gradient lie apart, so that a figure of the fused path is never the
//! composed path's under another name.

use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use burn::DispatchDevice;
use burn::backend::flex::Flex;
use burn::backend::{Autodiff, Cuda, Wgpu};
use burn::prelude::*;
use serde_json::json;
use tvq_model::kernel::{Kernels, VqKernels, fused_attention_calls, fused_quantize_calls};
use tvq_model::{Loss, Pass, Precision, TransformerVq, TransformerVqConfig};
use tvq_train::config::TrainSection;

use super::{BenchArgs, pattern_batch};

/// Runs the benchmark on `device` (the CPU, wgpu or CUDA) for each
/// `--seq-len` and precision.
pub(super) fn run(
    args: &BenchArgs,
    model: &TransformerVqConfig,
    train: &TrainSection,
    precisions: &[Precision],
    (device, info): (&DispatchDevice, &str),
) -> Result<()> {
    let cube = match device {
        DispatchDevice::Wgpu(d) => Cube::Wgpu(d),
        DispatchDevice::Cuda(d) => Cube::Cuda(d),
        DispatchDevice::Flex(d) => Cube::Cpu(d),
        _ => bail!("the fused kernels run on the cpu, wgpu and cuda, not on {info}"),
    };
    let on = On {
        args,
        model,
        train,
        info,
    };
    if !args.json {
        println!(
            "device: {info}; batch {}, d_model {}, {} layers, S {}, L {}",
            args.batch, model.d_model, model.n_layer, model.n_code, model.block_len
        );
        println!(
            "{:>8} {:>9} {:>14} {:>14} {:>8} {:>9} {:>9} {:>11} {:>11}",
            "seq_len",
            "precision",
            "fused tok/s",
            "composed tok/s",
            "speedup",
            "attention",
            "quantizer",
            "loss diff",
            "grad diff"
        );
    }
    for &t in &args.seq_len {
        for &precision in precisions {
            match cube {
                Cube::Wgpu(d) => on.measure::<Wgpu>(d, t, precision)?,
                Cube::Cuda(d) => on.measure::<Cuda>(d, t, precision)?,
                Cube::Cpu(d) => on.measure::<Flex>(d, t, precision)?,
            }
        }
    }
    Ok(())
}

/// The device as its own backend sees it.
#[derive(Clone, Copy)]
enum Cube<'a> {
    Cpu(&'a burn::backend::flex::FlexDevice),
    Wgpu(&'a burn::backend::wgpu::WgpuDevice),
    Cuda(&'a burn::backend::cuda::CudaDevice),
}

/// What every line is measured with.
struct On<'a> {
    args: &'a BenchArgs,
    model: &'a TransformerVqConfig,
    train: &'a TrainSection,
    info: &'a str,
}

/// One pass's results: the loss and the embedding's gradient (which every
/// sublayer's attention reaches), as host values.
struct Passed {
    loss: f32,
    grad: Vec<f32>,
}

impl On<'_> {
    /// One line: `--steps` forward and backward passes of `--batch` rows of
    /// `t` tokens each way, after a warm-up each.
    fn measure<C: VqKernels>(
        &self,
        device: &C::Device,
        t: usize,
        precision: Precision,
    ) -> Result<()> {
        let args = self.args;
        let (b, vocab) = (args.batch, args.vocab_size);
        C::seed(device, 0);
        let cfg = self.model.clone().with_vocab_size(vocab as usize);
        let mut net = cfg.init::<Autodiff<C>>(device)?;
        net.set_precision(precision);
        let sublayers = net.sublayers.len();
        let batch = pattern_batch(b, t, vocab);
        let ids = |ids: &[u32]| {
            let ids = ids.iter().map(|&i| i as i64).collect::<Vec<_>>();
            Tensor::<Autodiff<C>, 2, Int>::from_data(TensorData::new(ids, [b, t]), device)
        };
        let (inputs, targets) = (ids(&batch.inputs), ids(&batch.targets));
        // The same masks both ways, so that the two passes compute the same thing.
        let masks = net.uses_dropout().then(|| net.dropout_masks([b, t]));
        let commit_weight = self.train.commit_weight;
        let pass = |net: &TransformerVq<Autodiff<C>>| -> Result<Passed> {
            let mut pass = Pass::new();
            if let Some(masks) = &masks {
                pass = pass.with_masks(masks.clone());
            }
            let out = net.forward(inputs.clone(), net.empty_state(), pass)?;
            let loss = Loss::new(&out, targets.clone(), None).total(commit_weight);
            let grads = loss.backward();
            let grad = net
                .embedding
                .weight
                .grad(&grads)
                .expect("the embedding is trained");
            Ok(Passed {
                loss: loss.into_scalar().elem(),
                grad: grad
                    .into_data()
                    .convert::<f32>()
                    .into_vec()
                    .unwrap_or_default(),
            })
        };
        // One pass with `kernels`: its results, its time, its fused
        // attention and quantizer calls.
        let mut timed = |kernels: Kernels| -> Result<(Passed, Duration, [u64; 2])> {
            net.set_kernels(kernels);
            let calls = [fused_attention_calls(), fused_quantize_calls()];
            let start = Instant::now();
            let passed = pass(&net)?;
            let elapsed = start.elapsed();
            let after = [fused_attention_calls(), fused_quantize_calls()];
            Ok((passed, elapsed, [after[0] - calls[0], after[1] - calls[1]]))
        };
        let (fused, _, [reached, quantized]) = timed(Kernels::Fused)?;
        let (composed, _, _) = timed(Kernels::Composed)?;
        let (mut fused_s, mut composed_s) = (Duration::ZERO, Duration::ZERO);
        for _ in 0..args.steps {
            fused_s += timed(Kernels::Fused)?.1;
            composed_s += timed(Kernels::Composed)?.1;
        }
        let rate = |d: Duration| (args.steps * b * t) as f64 / d.as_secs_f64();
        let (fused_rate, composed_rate) = (rate(fused_s), rate(composed_s));
        let loss_diff = (fused.loss - composed.loss).abs();
        let grad_diff = fused
            .grad
            .iter()
            .zip(&composed.grad)
            .map(|(a, b)| (a - b).abs())
            // NaN where any is: `f32::max` would skip it.
            .fold(0.0f32, |m, d| {
                if m.is_nan() || d.is_nan() {
                    f32::NAN
                } else {
                    m.max(d)
                }
            });
        if args.json {
            println!(
                "{}",
                json!({
                    "form": "kernels", "seq_len": t, "batch": b, "precision": precision,
                    "fused_tokens_per_s": fused_rate, "composed_tokens_per_s": composed_rate,
                    "speedup": fused_rate / composed_rate, "fused_sublayers": reached,
                    "fused_quantizers": quantized, "sublayers": sublayers, "loss": composed.loss, "loss_diff": loss_diff,
                    "grad_max_diff": grad_diff, "device": self.info,
                })
            );
        } else {
            println!(
                "{t:>8} {precision:>9} {fused_rate:>14.0} {composed_rate:>14.0} {:>7.2}x {:>9} {:>9} {loss_diff:>11.2e} {grad_diff:>11.2e}",
                fused_rate / composed_rate,
                format!("{reached}/{sublayers}"),
                format!("{quantized}/{sublayers}"),
            );
        }
        Ok(())
    }
}
