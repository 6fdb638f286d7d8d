//! Model FLOPs utilisation (MFU): the model FLOPs a training step does per
//! second as a share of what the hardware could do at most, as nanoGPT,
//! torchtitan and nanochat report it. The FLOPs come from the model's
//! shapes ([`TransformerVqConfig::forward_flops_per_token`]); the peak from
//! a short matrix-product probe on the CPU, a table of known GPUs, or the
//! user (`--peak-tflops`).

use std::time::Instant;

use burn::prelude::*;
use burn::tensor::backend::DeviceOps;
use burn::{Dispatch, DispatchDevice};
use tvq_model::TransformerVqConfig;
use tvq_model::device::{cuda_device_name, wgpu_adapter};

/// Model FLOPs of one training token in a segment of `seq_len` tokens:
/// the forward pass and the backward pass, which costs twice as much.
pub fn training_flops_per_token(model: &TransformerVqConfig, seq_len: usize) -> f64 {
    3.0 * model.forward_flops_per_token(seq_len)
}

/// Dense `f32` peaks (FLOP/s, without tensor cores) of GPUs by a part of
/// their name, the more specific names first: the vendors' data sheets.
const KNOWN_GPUS: &[(&str, f64)] = &[
    ("H100 PCIe", 51.2e12),
    ("H100 NVL", 60.0e12),
    ("H100", 66.9e12),
    ("H200", 66.9e12),
    ("A100", 19.5e12),
    ("L40S", 91.6e12),
    ("L40", 90.5e12),
    ("L4", 30.3e12),
    ("A10", 31.2e12),
    ("RTX 4090", 82.6e12),
    ("V100", 15.7e12),
    ("T4", 8.1e12),
];

/// The `f32` peak of a GPU named `name` (as its driver reports it), if known.
pub fn known_gpu_peak(name: &str) -> Option<f64> {
    KNOWN_GPUS
        .iter()
        .find(|(part, _)| name.contains(part))
        .map(|&(_, peak)| peak)
}

/// Measures the `f32` matrix-product rate of `device` (FLOP/s): products
/// of two 1024 x 1024 matrices for half a second, the fastest one counting.
/// The first products of a process run slower (threads starting, fresh
/// pages, the clock rising), so a shorter probe reads low by up to 2x on
/// the development machine. On the CPU this is the peak MFU is measured
/// against (tvq's own backend at its best, not a data sheet's figure).
pub fn measure_matmul_peak(device: &DispatchDevice) -> f64 {
    const N: usize = 1024;
    let a = Tensor::<Dispatch, 2>::random([N, N], burn::tensor::Distribution::Default, device);
    let b = Tensor::<Dispatch, 2>::random([N, N], burn::tensor::Distribution::Default, device);
    let probe = Instant::now();
    let mut best = f64::INFINITY;
    while probe.elapsed().as_secs_f64() < 0.5 {
        let start = Instant::now();
        let _ = a.clone().matmul(b.clone()).into_data();
        best = best.min(start.elapsed().as_secs_f64());
    }
    2.0 * (N * N * N) as f64 / best
}

/// The peak one device of a run is measured against, and where it came
/// from: `override_tflops` if given, else the probe on the CPU and the
/// table for a GPU by the name its driver gives; `None` for an unknown GPU.
pub fn device_peak(device: &DispatchDevice, override_tflops: Option<f64>) -> Option<(f64, String)> {
    if let Some(t) = override_tflops {
        return Some((t * 1e12, "--peak-tflops".into()));
    }
    let name = match device.inner() {
        DispatchDevice::Flex(_) => {
            let measured = measure_matmul_peak(device.inner());
            return Some((measured, "measured f32 matrix products".into()));
        }
        DispatchDevice::Cuda(d) => cuda_device_name(d.index),
        DispatchDevice::Wgpu(d) => wgpu_adapter(d),
        _ => None,
    }?;
    known_gpu_peak(&name).map(|p| (p, format!("the data-sheet f32 peak of {name}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_gpus_are_found_by_name_most_specific_first() {
        assert_eq!(known_gpu_peak("NVIDIA H100 80GB HBM3"), Some(66.9e12));
        assert_eq!(known_gpu_peak("NVIDIA H100 PCIe"), Some(51.2e12));
        assert_eq!(known_gpu_peak("NVIDIA A100-SXM4-80GB"), Some(19.5e12));
        assert_eq!(known_gpu_peak("NVIDIA L40"), Some(90.5e12));
        assert_eq!(known_gpu_peak("NVIDIA L4"), Some(30.3e12));
        assert_eq!(known_gpu_peak("llvmpipe (LLVM 15.0.6, 256 bits)"), None);
    }

    #[test]
    fn the_cpu_probe_measures_a_plausible_rate_and_a_given_peak_wins() {
        let cpu = DispatchDevice::Flex(Default::default());
        let (peak, source) = device_peak(&cpu, None).unwrap();
        // Between a slow core without SIMD and a large server.
        assert!(peak > 1e9 && peak < 1e14, "{peak}");
        assert!(source.contains("measured"));
        let (given, _) = device_peak(&cpu, Some(2.5)).unwrap();
        assert_eq!(given, 2.5e12);
    }
}
