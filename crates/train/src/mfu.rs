//! Model FLOPs utilisation (MFU): the model FLOPs a training step does per
//! second as a share of what the hardware could do at most, as nanoGPT,
//! torchtitan and nanochat report it. The FLOPs come from the model's
//! shapes ([`TransformerVqConfig::forward_flops_per_token`]); the peak from
//! a short matrix-product probe on the CPU, a table of known GPUs, or the
//! user (`--peak-tflops`).

use std::time::Instant;

use crate::placement::device::{cuda_device_name, wgpu_adapter};
use burn::prelude::*;
use burn::tensor::backend::DeviceOps;
use burn::{Dispatch, DispatchDevice};
use tvq_model::{Precision, TransformerVqConfig};

/// Model FLOPs of one training token in a segment of `seq_len` tokens:
/// the forward pass and the backward pass, which costs twice as much.
pub fn training_flops_per_token(model: &TransformerVqConfig, seq_len: usize) -> f64 {
    3.0 * model.forward_flops_per_token(seq_len)
}

/// Dense peaks (FLOP/s) of GPUs by a part of their name, the more specific
/// names first, from the vendors' data sheets (without sparsity): `f32`
/// products without tensor cores, `f32` products on tensor cores in TF32
/// (from Ampere on; none on V100 and T4), and 16-bit products (bf16, f16;
/// f16 only on V100 and T4) on tensor cores with `f32` accumulation.
const KNOWN_GPUS: &[(&str, f64, Option<f64>, f64)] = &[
    ("H100 PCIe", 51.2e12, Some(378.0e12), 756.0e12),
    ("H100 NVL", 60.0e12, Some(417.5e12), 835.0e12),
    ("H100", 66.9e12, Some(494.7e12), 989.4e12),
    ("H200", 66.9e12, Some(494.7e12), 989.4e12),
    ("A100", 19.5e12, Some(156.0e12), 312.0e12),
    ("L40S", 91.6e12, Some(183.0e12), 362.1e12),
    ("L40", 90.5e12, Some(90.5e12), 181.0e12),
    ("L4", 30.3e12, Some(60.0e12), 121.0e12),
    ("A10", 31.2e12, Some(62.5e12), 125.0e12),
    ("RTX 4090", 82.6e12, Some(82.6e12), 165.2e12),
    ("V100", 15.7e12, None, 125.0e12),
    ("T4", 8.1e12, None, 65.0e12),
];

/// The peak of a GPU named `name` (as its driver reports it) for products
/// in `precision`, if known, and which peak it is: for `f32`, its TF32
/// tensor-core peak when `f32_on_tensor_cores` (the CUDA backend's
/// matrix products take `f32` inputs to TF32 on GPUs that have it) and it
/// has one, else its `f32` peak; for `bf16` and `f16`, its 16-bit
/// tensor-core peak.
pub fn known_gpu_peak(
    name: &str,
    precision: Precision,
    f32_on_tensor_cores: bool,
) -> Option<(f64, &'static str)> {
    let &(_, f32_peak, tf32_peak, half_peak) =
        KNOWN_GPUS.iter().find(|(part, ..)| name.contains(part))?;
    Some(match (precision, tf32_peak) {
        (Precision::F32, Some(tf32)) if f32_on_tensor_cores => (tf32, "TF32 tensor-core"),
        (Precision::F32, _) => (f32_peak, "f32"),
        (Precision::Bf16 | Precision::F16, _) => (half_peak, "16-bit tensor-core"),
    })
}

/// Measures the matrix-product rate of `device` in `precision` (FLOP/s):
/// products of two 1024 x 1024 matrices of that type for half a second, the
/// fastest one counting.
/// The first products of a process run slower (threads starting, fresh
/// pages, the clock rising), so a shorter probe reads low by up to 2x on
/// the development machine. On the CPU this is the peak MFU is measured
/// against (tvq's own backend at its best, not a data sheet's figure).
pub fn measure_matmul_peak(device: &DispatchDevice, precision: Precision) -> f64 {
    const N: usize = 1024;
    let random = || {
        Tensor::<Dispatch, 2>::random([N, N], burn::tensor::Distribution::Default, device)
            .cast(precision.dtype())
    };
    // Under the draw lock: the generator is shared with every thread.
    let (a, b) =
        crate::placement::seeded_draw::<Dispatch, _>(device, None, || (random(), random()));
    let probe = Instant::now();
    let mut best = f64::INFINITY;
    while probe.elapsed().as_secs_f64() < 0.5 {
        let start = Instant::now();
        let _ = a.clone().matmul(b.clone()).into_data();
        best = best.min(start.elapsed().as_secs_f64());
    }
    2.0 * (N * N * N) as f64 / best
}

/// The peak one device of a run is measured against when its products run
/// in `precision`, and where it came from: `override_tflops` if given, else
/// the probe on the CPU (in that type) and the table for a GPU by the name
/// its driver gives; `None` for an unknown GPU.
pub fn device_peak(
    device: &DispatchDevice,
    precision: Precision,
    override_tflops: Option<f64>,
) -> Option<(f64, String)> {
    if let Some(t) = override_tflops {
        return Some((t * 1e12, "--peak-tflops".into()));
    }
    // cubecl's matrix products run `f32` inputs in TF32 on CUDA's tensor
    // cores (`tvq check` on CUDA allows for its rounding); WGSL has no TF32.
    let (name, f32_on_tensor_cores) = match device.inner() {
        DispatchDevice::Flex(_) => {
            let measured = measure_matmul_peak(device.inner(), precision);
            return Some((measured, format!("measured {precision} matrix products")));
        }
        DispatchDevice::Cuda(d) => (cuda_device_name(d.index)?, true),
        DispatchDevice::Wgpu(d) => (wgpu_adapter(d)?, false),
        _ => return None,
    };
    known_gpu_peak(&name, precision, f32_on_tensor_cores)
        .map(|(peak, kind)| (peak, format!("the data-sheet {kind} peak of {name}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_gpus_are_found_by_name_most_specific_first() {
        let f32_peak = |name| known_gpu_peak(name, Precision::F32, false).map(|(p, _)| p);
        assert_eq!(f32_peak("NVIDIA H100 80GB HBM3"), Some(66.9e12));
        assert_eq!(f32_peak("NVIDIA H100 PCIe"), Some(51.2e12));
        assert_eq!(f32_peak("NVIDIA A100-SXM4-80GB"), Some(19.5e12));
        assert_eq!(f32_peak("NVIDIA L40"), Some(90.5e12));
        assert_eq!(f32_peak("NVIDIA L4"), Some(30.3e12));
        assert_eq!(f32_peak("llvmpipe (LLVM 15.0.6, 256 bits)"), None);
        // 16-bit products are measured against the tensor cores' peak,
        // whatever the backend does with f32.
        for half in [Precision::Bf16, Precision::F16] {
            for tensor_cores in [false, true] {
                assert_eq!(
                    known_gpu_peak("NVIDIA H100 80GB HBM3", half, tensor_cores),
                    Some((989.4e12, "16-bit tensor-core"))
                );
                assert_eq!(
                    known_gpu_peak("NVIDIA A100-SXM4-80GB", half, tensor_cores),
                    Some((312.0e12, "16-bit tensor-core"))
                );
            }
        }
    }

    #[test]
    fn f32_on_tensor_cores_is_measured_against_tf32_where_the_gpu_has_it() {
        let expected = [
            ("NVIDIA H100 80GB HBM3", 494.7e12, "TF32 tensor-core"),
            ("NVIDIA H200", 494.7e12, "TF32 tensor-core"),
            ("NVIDIA A100-SXM4-80GB", 156.0e12, "TF32 tensor-core"),
            // Volta and Turing have no TF32: their f32 products use the f32 cores.
            ("Tesla V100-SXM2-16GB", 15.7e12, "f32"),
            ("Tesla T4", 8.1e12, "f32"),
        ];
        for (name, peak, kind) in expected {
            assert_eq!(
                known_gpu_peak(name, Precision::F32, true),
                Some((peak, kind)),
                "{name}"
            );
        }
    }

    #[test]
    fn the_cpu_probe_measures_a_plausible_rate_in_each_type_and_a_given_peak_wins() {
        let cpu = DispatchDevice::Flex(Default::default());
        for precision in Precision::ALL {
            let (peak, source) = device_peak(&cpu, precision, None).unwrap();
            // Between a slow core without SIMD and a large server.
            assert!(peak > 1e8 && peak < 1e14, "{precision}: {peak}");
            assert_eq!(source, format!("measured {precision} matrix products"));
        }
        let (given, _) = device_peak(&cpu, Precision::Bf16, Some(2.5)).unwrap();
        assert_eq!(given, 2.5e12);
    }
}
