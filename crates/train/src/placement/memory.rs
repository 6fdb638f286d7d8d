//! Memory budgeted before it is spent: from a config and a command's
//! sizes, the least memory the command will hold (weights, optimizer,
//! activations, caches), held against what the device has, so that a
//! setting off by orders of magnitude (`d_model = 1e9`, `--num-samples
//! 1e11`) is one line naming it, not the kernel's OOM killer.
//!
//! The estimates count only what must exist (every parameter and moment,
//! the activations each token of a pass keeps, the carried state of each
//! row), so they fall short of the real peak and never refuse a run that
//! fits. The CPU's memory is read from `MemAvailable` of Linux's
//! `/proc/meminfo`, a CUDA GPU's from its driver; on wgpu, and where it
//! cannot be read, nothing is checked.

use burn::DispatchDevice;
use tvq_model::{Precision, TransformerVqConfig};

use super::device::cuda_memory;
use crate::config::ActivationCheckpointing;
use crate::error::TrainError;

/// Bytes of an f32.
const F32: f64 = 4.0;

/// What a command will hold at least, and the settings it comes from.
#[derive(Clone, Debug, PartialEq)]
pub struct Estimate {
    /// Bytes, at least.
    pub bytes: f64,
    /// The settings behind the estimate, as the user wrote them
    /// (`model.d_model = 1000000000, data.batch_size = 8`).
    pub settings: String,
}

/// Bytes of the model's parameters.
fn weights(model: &TransformerVqConfig) -> f64 {
    model.num_params() as f64 * F32
}

/// Bytes one token of a pass keeps, `[sublayer input, matrix-product
/// outputs, one sublayer's whole activations, logits]`: a sublayer's input
/// `D`; the outputs of its projections `H (Q + K + 2 V)`; all it computes
/// (its input and the input normalised, the projections, the gated values
/// and the attention weights over the window and the codes), `2 D + H (Q +
/// K + 3 V) + H (2 L + S)`; the logits `vocab`. Products and the gated
/// values are counted in `precision`'s width, the rest in `f32`.
fn per_token(model: &TransformerVqConfig, precision: Precision) -> [f64; 4] {
    let [d, k, v, h, s, l] = sizes(model);
    let q = k + model.rotary_channel_width() as f64;
    let narrow = match precision {
        Precision::F32 => F32,
        Precision::Bf16 | Precision::F16 => F32 / 2.0,
    };
    let products = h * (q + k + 2.0 * v) * narrow;
    let whole = 2.0 * d * F32 + h * (q + k + 3.0 * v) * narrow + h * (2.0 * l + s) * F32;
    [
        d * F32,
        d * F32 + products,
        whole,
        model.vocab_size as f64 * F32,
    ]
}

/// `[D, K, V, H, S, L]` of a model, as floats (no overflow on absurd
/// configs).
fn sizes(model: &TransformerVqConfig) -> [f64; 6] {
    [
        model.d_model,
        model.d_k,
        model.d_v,
        model.n_head,
        model.n_code,
        model.block_len,
    ]
    .map(|x| x as f64)
}

/// Sublayers `N` of a model, as a float (no overflow on absurd configs).
fn sublayers(model: &TransformerVqConfig) -> f64 {
    2.0 * model.n_layer as f64
}

/// Bytes a token of a training pass keeps for the backward pass: every
/// sublayer's whole activations without recomputation; their inputs and
/// matrix products under `selective` (burn's balanced checkpointing
/// recomputes the elementwise rest); only their inputs, and the one
/// sublayer being recomputed, under `full`.
fn training_per_token(
    model: &TransformerVqConfig,
    precision: Precision,
    mode: ActivationCheckpointing,
) -> f64 {
    let [input, kept, whole, logits] = per_token(model, precision);
    let n = sublayers(model);
    logits
        + match mode {
            ActivationCheckpointing::None => n * whole,
            ActivationCheckpointing::Selective => n * kept,
            ActivationCheckpointing::Full => n * input + whole,
        }
}

/// Bytes a token of an inference pass holds (in `f32`, as inference
/// computes): one sublayer's activations at a time, and the logits.
fn inference_per_token(model: &TransformerVqConfig) -> f64 {
    let [_, _, whole, logits] = per_token(model, Precision::F32);
    whole + logits
}

/// Bytes of the state one row carries: per sublayer the previous and the
/// current block (keys, values, codes) and the compressed cache (a count
/// and a mean value per code).
fn state_per_row(model: &TransformerVqConfig) -> f64 {
    let [_, k, v, h, s, l] = sizes(model);
    sublayers(model) * h * (2.0 * l * (k + v + 1.0) + s * (v + 1.0)) * F32
}

/// The settings an estimate comes from, with their values, as its
/// message names them.
fn named(model: &TransformerVqConfig, rest: &[(&str, usize)]) -> String {
    let model_part = [
        ("model.d_model", model.d_model),
        ("model.n_layer", model.n_layer),
        ("model.d_v", model.d_v),
        ("model.n_code", model.n_code),
    ];
    model_part
        .iter()
        .chain(rest)
        .map(|(k, v)| format!("{k} = {v}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Training: the weights with their gradients and two AdamW moments, and
/// the activations of the `rows` in flight at once (the batch's rows over
/// its micro-batches) of `update_len` tokens with products in `precision`,
/// each with its carried state.
pub fn training(
    model: &TransformerVqConfig,
    precision: Precision,
    checkpointing: ActivationCheckpointing,
    rows: usize,
    update_len: usize,
    batch_size: usize,
) -> Estimate {
    let tokens = rows as f64 * update_len as f64;
    Estimate {
        bytes: 4.0 * weights(model)
            + tokens * training_per_token(model, precision, checkpointing)
            + batch_size as f64 * state_per_row(model),
        settings: named(
            model,
            &[
                ("data.batch_size", batch_size),
                ("data.update_len", update_len),
            ],
        ),
    }
}

/// Evaluation: the weights, and `batch` rows of `update_len` tokens with
/// their carried states.
pub fn evaluation(model: &TransformerVqConfig, batch: usize, update_len: usize) -> Estimate {
    Estimate {
        bytes: weights(model)
            + batch as f64
                * (update_len as f64 * inference_per_token(model) + state_per_row(model)),
        settings: named(
            model,
            &[("eval.batch_size", batch), ("eval.update_len", update_len)],
        ),
    }
}

/// Sampling: the weights, and per row (`--num-samples` times the prompts)
/// its state, its logits and the `max_tokens` it may generate.
pub fn sampling(model: &TransformerVqConfig, rows: usize, max_tokens: usize) -> Estimate {
    let row = state_per_row(model) + 2.0 * model.vocab_size as f64 * F32 + max_tokens as f64 * 4.0;
    Estimate {
        bytes: weights(model) + rows as f64 * row,
        settings: named(
            model,
            &[
                ("rows (--num-samples x prompts)", rows),
                ("--max-tokens", max_tokens),
            ],
        ),
    }
}

/// Bytes of memory the device has free, where known: the CPU's
/// `MemAvailable` on Linux, a CUDA GPU's free memory as its driver counts
/// it; `None` on wgpu (no such query) or where it cannot be read.
pub fn available(device: &DispatchDevice) -> Option<f64> {
    match device {
        DispatchDevice::Flex(_) => {
            let text = std::fs::read_to_string("/proc/meminfo").ok()?;
            mem_available(&text)
        }
        DispatchDevice::Cuda(d) => cuda_memory(d.index).map(|m| m.free as f64),
        DispatchDevice::Autodiff(inner) => available(inner),
        _ => None,
    }
}

/// `MemAvailable` of a `/proc/meminfo` text, in bytes.
fn mem_available(meminfo: &str) -> Option<f64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024.0)
}

/// Refuses `estimate` where it exceeds the memory `available` (unless
/// `force`): an error naming the settings, the estimate and the memory.
pub fn check(estimate: &Estimate, available: Option<f64>, force: bool) -> Result<(), TrainError> {
    match available {
        Some(free) if estimate.bytes > free && !force => Err(TrainError::Memory {
            needed: gib(estimate.bytes),
            available: gib(free),
            settings: estimate.settings.clone(),
        }),
        Some(free) if estimate.bytes > free => {
            tracing::warn!(
                "--force: going on although {} needs at least {} and {} is free",
                estimate.settings,
                gib(estimate.bytes),
                gib(free)
            );
            Ok(())
        }
        _ => Ok(()),
    }
}

/// Bytes in GiB, for a message.
fn gib(bytes: f64) -> String {
    match bytes / f64::from(1u32 << 30) {
        g if g >= 1e6 => format!("{g:.2e} GiB"),
        g => format!("{g:.2} GiB"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model() -> TransformerVqConfig {
        tvq_testkit::tiny_model(256)
    }

    #[test]
    fn meminfo_is_read_in_bytes() {
        let text = "MemTotal:       24000000 kB\nMemAvailable:    1000 kB\n";
        assert_eq!(mem_available(text), Some(1_024_000.0));
        assert_eq!(mem_available("MemTotal: 1 kB\n"), None);
    }

    /// An estimate beyond the memory is refused naming its settings, and
    /// passes with `force`; one within it passes.
    #[test]
    fn estimates_beyond_memory_are_refused_unless_forced() {
        let small = sampling(&model(), 1, 256);
        assert!(check(&small, Some(1e9), false).is_ok());
        let huge = sampling(&model(), 100_000_000_000, 256);
        let err = check(&huge, Some(1e9), false).unwrap_err().to_string();
        assert!(
            err.contains("--num-samples") && err.contains("100000000000"),
            "{err}"
        );
        assert!(check(&huge, Some(1e9), true).is_ok());
        assert!(
            check(&huge, None, false).is_ok(),
            "nothing known, nothing refused"
        );
    }

    /// Each estimate grows with the sizes it names: linearly in rows and
    /// tokens, and by at least the weights, gradients and moments (16
    /// bytes a parameter) for training.
    #[test]
    fn estimates_count_what_must_exist() {
        let m = model();
        let p = m.num_params() as f64;
        let none = ActivationCheckpointing::None;
        let f32 = Precision::F32;
        let one = training(&m, f32, none, 1, 64, 1).bytes;
        assert!(one > 16.0 * p);
        let rows = |r: usize| training(&m, f32, none, r, 64, r).bytes - 16.0 * p;
        assert!((rows(8) - 8.0 * rows(1)).abs() < 1e-6 * rows(8));
        // Recomputation keeps less, `full` least: the estimate follows, so
        // a run that fits only with it is not refused.
        let long = |mode| training(&m.clone().with_n_layer(8), f32, mode, 4, 8192, 4).bytes;
        let selective = long(ActivationCheckpointing::Selective);
        let full = long(ActivationCheckpointing::Full);
        assert!(
            full < selective && selective < long(none),
            "{full} {selective}"
        );
        // Products kept in bf16 take half the bytes; the rest stays f32.
        let activations = |precision| training(&m, precision, none, 4, 8192, 4).bytes - 16.0 * p;
        let (f32_bytes, bf16_bytes) = (activations(f32), activations(Precision::Bf16));
        assert!(
            bf16_bytes < f32_bytes && bf16_bytes > 0.5 * f32_bytes,
            "{bf16_bytes} {f32_bytes}"
        );
        let wide = m.clone().with_d_model(1_000_000_000);
        assert!(
            evaluation(&wide, 1, 1).bytes > 4e9 * 256.0,
            "the embedding alone"
        );
        assert!(sampling(&m, 1, 1 << 40).bytes > 4.0 * (1u64 << 40) as f64);
    }
}
