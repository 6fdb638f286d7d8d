//! `tvq check`: a self-test of one device against the CPU, for a new
//! machine, driver or GPU.
//!
//! A small seeded model computes each part of training and inference on the
//! device and on the CPU from the same weights and inputs, and every pair of
//! results is compared: the largest difference, relative to the CPU
//! result's largest magnitude, against a tolerance that `f32` (or `bf16`)
//! rounding in another summation order stays far inside and a wrong kernel
//! does not (ten times wider for matrix products on CUDA, which rounds
//! `f32` operands to TF32). On the CPU itself every check compares the CPU
//! with itself, a trivial pass, but the fused kernels' gradients against
//! the composed ops'. The last two checks are the fused trainer's: its
//! gradients and its update (the AdamW kernel on a GPU).
//!
//! `TVQ_FAULT=device-result:error@N` scales the device's values of the
//! `N`-th comparison by 1.01 (`crate::fault`): how the tests show that a
//! wrong device result fails the check.

use std::path::{Path, PathBuf};

use burn::DispatchDevice;
use burn::module::{Module, ModuleVisitor, Param};
use burn::prelude::*;
use tvq_data::{Batch, TrainCursor};
use tvq_model::{
    Loss, ModelState, Pass, Precision, RelativeBias, TransformerVq, TransformerVqConfig,
};

use crate::config::{KernelsSetting, OptimizerName, TrainSection};
use crate::error::TrainError;
use crate::fault::{Point, inject};
use crate::inference::sample::{SampleOptions, sample};
use crate::placement::device::{check_precision, device_name};
use crate::placement::{
    B, Model, OnTrainBackend, TrainBackend, TrainOn, fork_onto, host_values, seeded_draw,
};
use crate::step::gradients::{flat_grads, flatten_grads, shared_grads};
use crate::trainer::Trainer;

/// One comparison of the device with the CPU.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Check {
    /// What was computed, e.g. `gradients`.
    pub name: String,
    /// The largest difference between the device's values and the CPU's,
    /// relative to the CPU's largest magnitude (for generated tokens: the
    /// share of tokens that differ); `None` when skipped.
    pub worst: Option<f64>,
    /// The largest `worst` that passes.
    pub tolerance: f64,
    /// Why the check did not run (the device cannot compute it), if so.
    pub skipped: Option<String>,
}

impl Check {
    /// Whether the check passed; a skipped check passes, a NaN fails.
    pub fn passed(&self) -> bool {
        self.worst.is_none_or(|w| w <= self.tolerance)
    }

    /// `PASS`, `FAIL` or `skip`.
    pub fn verdict(&self) -> &'static str {
        match (self.worst, self.passed()) {
            (None, _) => "skip",
            (_, true) => "PASS",
            (_, false) => "FAIL",
        }
    }
}

/// The measured matrix-product rate of the device in one precision.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Peak {
    /// The products' type.
    pub precision: Precision,
    /// FLOP/s of the fastest 1024 x 1024 product
    /// ([`crate::mfu::measure_matmul_peak`]); `None` where the device
    /// cannot compute in that type.
    pub flops_per_s: Option<f64>,
}

/// What [`check_device`] found.
#[derive(Clone, Debug, serde::Serialize)]
pub struct CheckReport {
    /// The device checked, as the backend names it.
    pub device: String,
    /// Every comparison, in the order run.
    pub checks: Vec<Check>,
    /// The device's matrix-product peaks, f32 and bf16.
    pub peaks: Vec<Peak>,
}

impl CheckReport {
    /// Whether every check passed.
    pub fn passed(&self) -> bool {
        self.checks.iter().all(Check::passed)
    }
}

/// The checked model: two layers (four sublayers), blocks of 8, 16 codes,
/// dropout on (its masks are drawn on the CPU, so both sides use the same).
fn model_config(bias: RelativeBias) -> TransformerVqConfig {
    TransformerVqConfig {
        d_model: 64,
        d_k: 16,
        d_v: 32,
        n_code: 16,
        n_head: 2,
        n_layer: 2,
        block_len: 8,
        bias,
        dropout_residual: 0.1,
        ..TransformerVqConfig::new(VOCAB)
    }
}

const VOCAB: usize = 48;
const SEED: u64 = 7;
/// Rows and tokens of a segment: four blocks, so the later blocks attend
/// to a compressed cache.
const ROWS: usize = 2;
const LEN: usize = 32;

/// The training settings of the check: a large learning rate, no warm-up,
/// so that one step moves every weight visibly.
fn settings(precision: Precision) -> TrainSection {
    TrainSection {
        lr: 1e-2,
        warmup_steps: 0,
        precision: precision.into(),
        seed: SEED,
        ..TrainSection::default()
    }
}

/// The checked model's weights, drawn once on the CPU (with autodiff) for
/// both sides: two draws could differ where other threads of the process
/// draw from the backend's shared generator meanwhile.
fn drawn(cfg: &TransformerVqConfig) -> Result<Model, TrainError> {
    let cpu = B::cpu().expect("Dispatch has a CPU device");
    Ok(seeded_draw::<B, _>(&cpu, Some(SEED), || {
        cfg.init::<B>(&cpu)
    })?)
}

/// Segment `i` of a fixed token stream, `ROWS x LEN`.
fn segment(i: usize, reset: bool) -> Batch {
    let token = |n: usize| ((n * 7 + n / 5 + 3) % VOCAB) as u32;
    let start = i * LEN;
    let ids = |shift: usize| {
        (0..ROWS)
            .flat_map(|r| (0..LEN).map(move |t| token(r * 1000 + start + t + shift)))
            .collect::<Vec<u32>>()
    };
    Batch {
        batch: ROWS,
        len: LEN,
        inputs: ids(0),
        targets: ids(1),
        valid: vec![true; ROWS * LEN],
        reset,
    }
}

/// The largest difference of `device` from `cpu`, relative to `cpu`'s
/// largest magnitude; infinite when the lengths differ, NaN when any value
/// is (so the check fails).
pub fn relative_difference(device: &[f32], cpu: &[f32]) -> f64 {
    if device.len() != cpu.len() {
        return f64::INFINITY;
    }
    let scale = cpu.iter().fold(0f64, |m, &c| m.max(c.abs() as f64));
    let mut worst = 0f64;
    for (&d, &c) in device.iter().zip(cpu) {
        let diff = (d as f64 - c as f64).abs();
        if diff.is_nan() {
            return f64::NAN;
        }
        worst = worst.max(diff);
    }
    worst / scale.max(f64::MIN_POSITIVE)
}

/// The device's values as compared: scaled by 1.01 where `TVQ_FAULT` asks
/// for a wrong device result here.
fn as_reported(mut values: Vec<f32>) -> Vec<f32> {
    if inject(Point::DeviceResult).is_err() {
        values.iter_mut().for_each(|v| *v *= 1.01);
    }
    values
}

/// A comparison that ran.
fn compared(name: &str, device: Vec<f32>, cpu: &[f32], tolerance: f64) -> Check {
    Check {
        name: name.into(),
        worst: Some(relative_difference(&as_reported(device), cpu)),
        tolerance,
        skipped: None,
    }
}

/// Every parameter's values in module order, trained (`true`) or not
/// (the codebooks' EMA sums and counts, `false`).
fn parameters<Bk: Backend>(model: &TransformerVq<Bk>) -> Vec<(bool, Vec<f32>)> {
    struct Values(Vec<(bool, Vec<f32>)>);
    impl<Bk: Backend> ModuleVisitor<Bk> for Values {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<Bk, D>>) {
            let t = p.val();
            self.0.push((t.is_require_grad(), host_values(&t)));
        }
    }
    let mut v = Values(vec![]);
    model.visit(&mut v);
    v.0
}

/// The trained (`true`) or codebook (`false`) parameters, concatenated.
fn flat(params: &[(bool, Vec<f32>)], trained: bool) -> Vec<f32> {
    params
        .iter()
        .filter(|(t, _)| *t == trained)
        .flat_map(|(_, v)| v.iter().copied())
        .collect()
}

/// Removes a directory when dropped (the checkpoint check's scratch).
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Runs every check of `device` against the CPU, writing a checkpoint under
/// `scratch` (a directory of its own there, removed after).
pub fn check_device(device: &DispatchDevice, scratch: &Path) -> Result<CheckReport, TrainError> {
    let cpu = DispatchDevice::Flex(Default::default());
    let mut checks = vec![];
    for bias in [
        RelativeBias::Toeplitz,
        RelativeBias::Xl,
        RelativeBias::Rotary,
    ] {
        checks.push(forward(device, &cpu, bias)?);
    }
    checks.extend(training_step(device, &cpu, scratch)?);
    checks.extend(reduced_precision(device, &cpu, Precision::Bf16)?);
    checks.push(generation(device, &cpu)?);
    // Last, so that the comparisons before them keep their numbers.
    checks.extend(fused_step(device, &cpu)?);
    let peaks = [Precision::F32, Precision::Bf16]
        .into_iter()
        .map(|precision| Peak {
            precision,
            flops_per_s: check_precision(device, precision)
                .ok()
                .map(|()| crate::mfu::measure_matmul_peak(device, precision)),
        })
        .collect();
    Ok(CheckReport {
        device: device_name(device),
        checks,
        peaks,
    })
}

/// How much wider than `f32` rounding the comparisons of matrix products
/// are on `device`: 10 on CUDA, 1 elsewhere. cubecl's matrix product on a
/// tensor-core GPU rounds `f32` operands to TF32 (10 bits of mantissa, as
/// PyTorch's `allow_tf32` and JAX's default precision do), so `f32` on CUDA
/// differs from the CPU by about 1e-3 of the result: on an H200, 3.4e-4 in
/// the forward pass and 1.2e-3 in the gradients (docs/benchmarks.md). A
/// wrong kernel is off by far more.
fn f32_product_allowance(device: &DispatchDevice) -> f64 {
    match device {
        DispatchDevice::Cuda(_) => 10.0,
        _ => 1.0,
    }
}

/// The logits and the loss of two segments (the second from the state the
/// first left), with the bias `bias`.
fn forward(
    device: &DispatchDevice,
    cpu: &DispatchDevice,
    bias: RelativeBias,
) -> Result<Check, TrainError> {
    let cfg = model_config(bias);
    let on_cpu: TransformerVq<B> = seeded_draw::<B, _>(cpu, Some(SEED), || cfg.init::<B>(cpu))?;
    let on_device = fork_onto(&on_cpu, device);
    let run = |model: &Model| -> Result<Vec<f32>, TrainError> {
        let d = model.embedding.weight.device();
        let mut state = ModelState::new(cfg.n_sublayers());
        let mut values = vec![];
        for i in 0..2 {
            let b = segment(i, i == 0);
            let t = crate::batch::BatchTensors::rows(&b, 0..ROWS, &d);
            let out = model.forward(t.inputs, state, Pass::new())?;
            let loss = Loss::new(&out, t.targets, None);
            values.extend(host_values(
                out.logits.as_ref().expect("every position's logits"),
            ));
            values.extend(host_values(&loss.ce));
            state = out.state;
        }
        Ok(values)
    };
    let name = format!("forward: logits and loss ({bias:?} bias)").to_lowercase();
    let tolerance = 1e-4 * f32_product_allowance(device);
    Ok(compared(&name, run(&on_device)?, &run(&on_cpu)?, tolerance))
}

/// Trainers of the weights `net` with `settings`, one on `device` and one on
/// `cpu`, after one update from the CPU's gradients and codebook statistics
/// of `batch` (so that only the update itself is compared); with the
/// trained parameters before it.
fn updated_from_cpu_gradients(
    cfg: &TransformerVqConfig,
    net: Model,
    settings: &TrainSection,
    device: &DispatchDevice,
    cpu: &DispatchDevice,
    batch: &Batch,
) -> Result<([Trainer; 2], Vec<f32>), TrainError> {
    let on = |net, d| Trainer::with_weights(cfg, net, settings, std::slice::from_ref(d));
    let mut on_device = on(net.clone(), device)?;
    let mut on_cpu = on(net, cpu)?;
    let before = flat(&parameters(on_cpu.model()), true);
    let g = on_cpu.gradients(batch)?;
    let [cpu_grads, device_grads] = shared_grads(on_cpu.model(), g.grads, on_device.model());
    let home = on_device.model().embedding.weight.device();
    let stats: Vec<_> = g
        .stats
        .iter()
        .map(|s| s.clone().into_device(&home))
        .collect();
    on_device.apply(device_grads, &stats);
    on_cpu.apply(cpu_grads, &g.stats);
    Ok(([on_device, on_cpu], before))
}

/// The change of the trained parameters from `before` to `after`.
fn update(after: &[(bool, Vec<f32>)], before: &[f32]) -> Vec<f32> {
    flat(after, true)
        .iter()
        .zip(before)
        .map(|(a, b)| a - b)
        .collect()
}

/// One training step in `f32`: the gradients of each side; the AdamW step,
/// the Muon step and the EMA codebook update, both sides from the CPU's
/// gradients and codebook statistics; a checkpoint of the device's trainer
/// loaded on the CPU.
fn training_step(
    device: &DispatchDevice,
    cpu: &DispatchDevice,
    scratch: &Path,
) -> Result<Vec<Check>, TrainError> {
    let cfg = model_config(RelativeBias::Toeplitz);
    let settings = settings(Precision::F32);
    let net = drawn(&cfg)?;
    let batch = segment(0, true);
    let grads_of = |t: &mut Trainer| -> Result<_, TrainError> {
        let mut g = t.gradients(&batch)?;
        let mut values = vec![];
        flatten_grads(t.model(), &mut g.grads, &mut values);
        Ok(values)
    };
    let trainer = |d: &DispatchDevice| {
        Trainer::with_weights(&cfg, net.clone(), &settings, std::slice::from_ref(d))
    };
    let gradients = compared(
        "gradients of one step",
        grads_of(&mut trainer(device)?)?,
        &grads_of(&mut trainer(cpu)?)?,
        1e-3 * f32_product_allowance(device),
    );
    let ([mut on_device, on_cpu], before) =
        updated_from_cpu_gradients(&cfg, net.clone(), &settings, device, cpu, &batch)?;
    let (after_device, after_cpu) = (parameters(on_device.model()), parameters(on_cpu.model()));
    // The update itself, so that the tolerance is relative to a step.
    let adamw = compared(
        "AdamW step (the CPU's gradients)",
        update(&after_device, &before),
        &update(&after_cpu, &before),
        1e-4,
    );
    let mut muon_settings = settings.clone();
    muon_settings.optimizer.name = OptimizerName::Muon;
    let ([muon_device, muon_cpu], _) =
        updated_from_cpu_gradients(&cfg, net, &muon_settings, device, cpu, &batch)?;
    // Newton-Schulz iterations are matrix products: the device's rounding.
    let muon = compared(
        "Muon step (the CPU's gradients)",
        update(&parameters(muon_device.model()), &before),
        &update(&parameters(muon_cpu.model()), &before),
        1e-4 * f32_product_allowance(device),
    );
    let ema = compared(
        "EMA codebook update",
        flat(&after_device, false),
        &flat(&after_cpu, false),
        1e-5,
    );
    // Saved from the device, loaded on the CPU: the same numbers.
    let scratch = Scratch(scratch.join(format!("tvq-check-{}", std::process::id())));
    let dir = on_device.save(&scratch.0)?;
    let mut loaded = Trainer::new(&cfg, &settings, std::slice::from_ref(cpu))?;
    loaded.resume(&dir, false)?;
    let every = |m: &Model| -> Vec<f32> {
        parameters(m)
            .into_iter()
            .flat_map(|(_, v)| v.into_iter())
            .collect()
    };
    let checkpoint = compared(
        "checkpoint saved on the device, loaded on the CPU",
        every(loaded.model()),
        &every(on_device.model()),
        0.0,
    );
    // And the next step from the loaded checkpoint computes on the CPU
    // what the device computes.
    let next = segment(1, false);
    let loss_of = |t: &mut Trainer| -> Result<Vec<f32>, TrainError> {
        Ok(vec![t.step(&next, TrainCursor::default())?.loss as f32])
    };
    let resumed = compared(
        "the step after it, on each side",
        loss_of(&mut on_device)?,
        &loss_of(&mut loaded)?,
        1e-4 * f32_product_allowance(device),
    );
    Ok(vec![gradients, adamw, muon, ema, checkpoint, resumed])
}

/// One `f32` step by the trainer a run on `device` uses under
/// `train.kernels = "fused"` ([`TrainOn`]) against the composed ops' on
/// the CPU, from the same weights (every trainer draws them on the CPU):
/// the gradients, then the update from the CPU's gradients (so that only
/// the update is compared: the AdamW kernel where the device has one). On
/// the CPU itself too, where it compares the CPU's kernels with the
/// composed ops. Skipped where `device` has no fused trainer.
fn fused_step(device: &DispatchDevice, cpu: &DispatchDevice) -> Result<Vec<Check>, TrainError> {
    let names = [
        "gradients of one step, fused kernels against composed ops",
        "AdamW step of the fused trainer (the CPU's gradients)",
    ];
    let cfg = model_config(RelativeBias::Toeplitz);
    let fused = TrainSection {
        kernels: KernelsSetting::Fused,
        ..settings(Precision::F32)
    };
    let on = TrainOn::choose(&fused, std::slice::from_ref(device));
    if !on.fused() {
        return Ok(names
            .map(|name| Check {
                name: name.into(),
                worst: None,
                tolerance: 0.0,
                skipped: Some(format!("{} has no fused kernels", device_name(device))),
            })
            .into());
    }
    let batch = segment(0, true);
    /// The gradients [`flatten_grads`] takes: shapes and values.
    type Flat = (Vec<Option<Vec<usize>>>, Vec<f32>);
    /// One step on the backend chosen: its gradients, and the update
    /// from `given` gradients (its own where `None`).
    struct Step<'a> {
        cfg: &'a TransformerVqConfig,
        settings: &'a TrainSection,
        device: &'a DispatchDevice,
        batch: &'a Batch,
        given: Option<&'a Flat>,
    }
    impl OnTrainBackend for Step<'_> {
        type Output = Result<(Flat, Vec<f32>), TrainError>;
        fn run<Bk: TrainBackend>(self) -> Self::Output {
            let devices = std::slice::from_ref(self.device);
            let mut t = Trainer::<Bk>::start(self.cfg, self.settings, devices)?;
            let before = flat(&parameters(t.model()), true);
            let mut g = t.gradients(self.batch)?;
            let mut values = vec![];
            let shapes = flatten_grads(t.model(), &mut g.grads, &mut values);
            let own = (shapes, values);
            let (shapes, values) = self.given.unwrap_or(&own);
            t.apply(flat_grads(t.model(), shapes.clone(), values), &g.stats);
            let after = parameters(t.model());
            Ok((own, update(&after, &before)))
        }
    }
    let composed = TrainSection {
        kernels: KernelsSetting::Composed,
        ..fused.clone()
    };
    let (want, want_update) = TrainOn::Composed.run(Step {
        cfg: &cfg,
        settings: &composed,
        device: cpu,
        batch: &batch,
        given: None,
    })?;
    let ((_, got), got_update) = on.run(Step {
        cfg: &cfg,
        settings: &fused,
        device,
        batch: &batch,
        given: Some(&want),
    })?;
    Ok(vec![
        compared(names[0], got, &want.1, 1e-3 * f32_product_allowance(device)),
        // As the composed AdamW's check: rounding in another order only.
        compared(names[1], got_update, &want_update, 1e-4),
    ])
}

/// The loss and gradients of one step with products in `precision`; skipped
/// where the device cannot compute in it. The tolerance allows for one
/// rounding of a `bf16` product (`2^-8` relative) spreading through the
/// step, not for a product done in the wrong type.
fn reduced_precision(
    device: &DispatchDevice,
    cpu: &DispatchDevice,
    precision: Precision,
) -> Result<Vec<Check>, TrainError> {
    let names = [
        format!("{precision} step: loss"),
        format!("{precision} step: gradients"),
    ];
    if let Err(reason) = check_precision(device, precision) {
        return Ok(names
            .into_iter()
            .map(|name| Check {
                name,
                worst: None,
                tolerance: 0.0,
                skipped: Some(reason.clone()),
            })
            .collect());
    }
    let cfg = model_config(RelativeBias::Toeplitz);
    let net = drawn(&cfg)?;
    let batch = segment(0, true);
    let run = |d: &DispatchDevice| -> Result<(Vec<f32>, Vec<f32>), TrainError> {
        let devices = std::slice::from_ref(d);
        let mut t = Trainer::with_weights(&cfg, net.clone(), &settings(precision), devices)?;
        let mut g = t.gradients(&batch)?;
        let mut values = vec![];
        flatten_grads(t.model(), &mut g.grads, &mut values);
        Ok((vec![g.ce_sum], values))
    };
    let ((loss_d, grads_d), (loss_c, grads_c)) = (run(device)?, run(cpu)?);
    let [loss_name, grads_name] = names;
    Ok(vec![
        compared(&loss_name, loss_d, &loss_c, 1e-2),
        compared(&grads_name, grads_d, &grads_c, 5e-2),
    ])
}

/// 16 tokens drawn greedily after a prompt of two blocks and a half (block
/// prefill, then the recurrent form): the share of tokens that differ.
fn generation(device: &DispatchDevice, cpu: &DispatchDevice) -> Result<Check, TrainError> {
    let cfg = model_config(RelativeBias::Toeplitz);
    let on_cpu: TransformerVq<B> = seeded_draw::<B, _>(cpu, Some(SEED), || cfg.init::<B>(cpu))?;
    let on_device = fork_onto(&on_cpu, device);
    let prompt: Vec<u32> = segment(0, true).inputs[..20].to_vec();
    let opts = SampleOptions {
        max_tokens: 16,
        temperature: 0.0,
        top_p: 1.0,
        seed: SEED,
        progress: false,
    };
    let draw = |m: &Model| sample(m, &prompt, 1, opts, |_| true);
    let (d, c) = (
        as_reported(tokens_as_f32(draw(&on_device)?)),
        tokens_as_f32(draw(&on_cpu)?),
    );
    let differing = if d.len() == c.len() {
        d.iter().zip(&c).filter(|(a, b)| a != b).count() as f64 / c.len().max(1) as f64
    } else {
        1.0
    };
    Ok(Check {
        name: "16 generated tokens (prefill, recurrent)".into(),
        worst: Some(differing),
        tolerance: 0.0,
        skipped: None,
    })
}

fn tokens_as_f32(tokens: Vec<u32>) -> Vec<f32> {
    tokens.into_iter().map(|t| t as f32).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_difference_is_against_the_largest_cpu_magnitude() {
        assert_eq!(relative_difference(&[1.0, 2.0], &[1.0, 2.0]), 0.0);
        assert!((relative_difference(&[1.0, 4.1], &[1.0, 4.0]) - 0.025).abs() < 1e-6);
        assert_eq!(relative_difference(&[1.0], &[1.0, 2.0]), f64::INFINITY);
        assert!(relative_difference(&[f32::NAN], &[1.0]).is_nan());
        let nan = Check {
            name: "x".into(),
            worst: Some(f64::NAN),
            tolerance: 1.0,
            skipped: None,
        };
        assert!(!nan.passed(), "a NaN never passes");
    }

    /// On the CPU every comparison is of the CPU with itself, all pass at
    /// zero difference, but the fused trainer's against the composed
    /// ops': its gradients within rounding, not equal, and its update from
    /// the same gradients within rounding (its gradient norm's sum of
    /// squares is taken in `f64`, so clipping scales by another rounding
    /// of the factor; its AdamW does burn's operations in burn's order).
    #[test]
    fn the_cpu_checks_as_itself() {
        let cpu = DispatchDevice::Flex(Default::default());
        let dir = tempfile::tempdir().unwrap();
        let report = check_device(&cpu, dir.path()).unwrap();
        assert!(report.passed(), "{report:#?}");
        assert!(report.checks.len() >= 10);
        let (rest, fused) = report.checks.split_at(report.checks.len() - 2);
        for c in rest {
            assert_eq!(c.worst, Some(0.0), "{}", c.name);
        }
        assert!(fused[0].name.contains("fused kernels"), "{}", fused[0].name);
        assert!(fused[1].name.contains("fused trainer"), "{}", fused[1].name);
        assert!(
            fused[0].worst.is_some_and(|w| w > 0.0 && w <= 1e-5),
            "{fused:?}"
        );
        assert!(fused[1].worst.is_some_and(|w| w <= 1e-5), "{fused:?}");
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            0,
            "the scratch checkpoint is removed"
        );
    }
}
