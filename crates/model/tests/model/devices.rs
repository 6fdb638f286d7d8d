//! Device selection, and the wgpu backend against the CPU.

use burn::module::Module;
use burn::prelude::*;
use burn::record::{BinBytesRecorder, FullPrecisionSettings, Recorder};
use tvq_model::device::{DeviceError, DeviceSpec, cuda_device_count};
use tvq_model::{RelativeBias, TransformerVqConfig};

use crate::common::*;

#[test]
fn device_names_parse_and_bad_ones_are_errors() {
    assert_eq!("cpu".parse(), Ok(DeviceSpec::Cpu));
    assert_eq!("wgpu".parse(), Ok(DeviceSpec::Wgpu(None)));
    assert_eq!("wgpu:1".parse(), Ok(DeviceSpec::Wgpu(Some(1))));
    assert_eq!("cuda".parse(), Ok(DeviceSpec::Cuda(0)));
    assert_eq!("cuda:2".parse(), Ok(DeviceSpec::Cuda(2)));
    for bad in ["gpu", "cuda:x", "cpu:0", "", "cuda:"] {
        assert_eq!(
            bad.parse::<DeviceSpec>(),
            Err(DeviceError::Unknown(bad.to_string())),
            "{bad}"
        );
    }
    assert_eq!(DeviceSpec::Cuda(3).to_string(), "cuda:3");
}

#[test]
fn missing_cuda_is_an_error_not_a_panic() {
    let n = cuda_device_count();
    let beyond = DeviceSpec::Cuda(n).init();
    match beyond {
        Err(DeviceError::Unavailable { spec, reason }) => {
            assert_eq!(spec, format!("cuda:{n}"));
            assert!(!reason.is_empty());
        }
        other => panic!("cuda:{n} with {n} GPUs must be unavailable, got {other:?}"),
    }
    if n > 0 {
        assert!(DeviceSpec::Cuda(0).init().is_ok());
    }
}

/// What to do when no wgpu adapter opens: skip with a visible message on a
/// machine without a Vulkan driver, unless `TVQ_REQUIRE_WGPU` is set (CI
/// sets it, after installing Mesa's software driver, so there the test
/// runs for real or fails). Returns the skip message, or the failure.
fn no_adapter(e: &DeviceError, required: bool) -> Result<String, String> {
    if required {
        Err(format!(
            "{e}; TVQ_REQUIRE_WGPU is set: install a Vulkan driver (Debian: mesa-vulkan-drivers)"
        ))
    } else {
        Ok(format!(
            "SKIPPED wgpu_agrees_with_cpu: {e} (install a Vulkan driver, e.g. Debian's \
             mesa-vulkan-drivers, to run it; TVQ_REQUIRE_WGPU=1 makes this a failure)"
        ))
    }
}

#[test]
fn a_missing_wgpu_adapter_skips_unless_required() {
    let e = DeviceError::Unavailable {
        spec: "wgpu".into(),
        reason: "no adapter".into(),
    };
    assert!(no_adapter(&e, false).unwrap().starts_with("SKIPPED"));
    assert!(no_adapter(&e, true).unwrap_err().contains("no adapter"));
}

/// The wgpu backend computes what the CPU computes (CUDA's instead when
/// `TVQ_TEST_DEVICE=cuda`).
#[test]
fn wgpu_agrees_with_cpu() {
    let spec = match std::env::var("TVQ_TEST_DEVICE").as_deref() {
        Ok("cuda") => DeviceSpec::Cuda(0),
        _ => DeviceSpec::Wgpu(None),
    };
    let (gpu, info) = match spec.init() {
        Ok(found) => found,
        Err(e) => match no_adapter(&e, std::env::var_os("TVQ_REQUIRE_WGPU").is_some()) {
            Ok(skipped) => {
                // Straight to stderr: libtest hides `eprintln!` of a passing test.
                use std::io::Write;
                let _ = writeln!(std::io::stderr(), "{skipped}");
                return;
            }
            Err(failure) => panic!("{failure}"),
        },
    };
    eprintln!("GPU under test: {info}");
    let recorder = BinBytesRecorder::<FullPrecisionSettings>::default();
    for bias in [RelativeBias::Toeplitz, RelativeBias::Xl] {
        let cfg = TransformerVqConfig::new(29)
            .with_d_model(16)
            .with_d_k(8)
            .with_d_v(12)
            .with_n_code(5)
            .with_n_head(2)
            .with_n_layer(1)
            .with_block_len(4)
            .with_bias(bias);
        B::seed(&cpu(), 5);
        let on_cpu = cfg.init::<B>(&cpu_ad()).unwrap();
        let bytes = recorder.record(on_cpu.clone().into_record(), ()).unwrap();
        let gpu_ad = burn::DispatchDevice::autodiff(gpu.clone());
        let on_gpu = cfg
            .init::<B>(&gpu_ad)
            .unwrap()
            .load_record(recorder.load(bytes, &gpu_ad).unwrap());

        let data: Vec<i64> = (0..2 * 16).map(|i| (i * 7 % 29) as i64).collect();
        let run = |m: &tvq_model::TransformerVq<B>, device: &burn::DispatchDevice| {
            let tokens =
                Tensor::<B, 2, Int>::from_data(TensorData::new(data.clone(), [2, 16]), device);
            let out = m.forward(tokens, m.empty_state(), None).unwrap();
            let loss = out.logits.clone().square().mean() + out.commitment.mean();
            let grads = loss.backward();
            let g = m.sublayers[0].kvg_proj.weight.grad(&grads).unwrap();
            (
                to_vec(out.logits.inner()),
                to_vec(g),
                out.codes[0]
                    .clone()
                    .into_data()
                    .convert::<i64>()
                    .to_vec::<i64>()
                    .unwrap(),
            )
        };
        let (l_cpu, g_cpu, z_cpu) = run(&on_cpu, &cpu_ad());
        let (l_gpu, g_gpu, z_gpu) = run(&on_gpu, &gpu_ad);
        assert_eq!(z_cpu, z_gpu, "{bias:?}: codes");
        let worst = |a: &[f32], b: &[f32]| {
            a.iter()
                .zip(b)
                .map(|(x, y)| (x - y).abs())
                .fold(0f32, f32::max)
        };
        assert!(
            worst(&l_cpu, &l_gpu) <= 1e-4,
            "{bias:?}: logits differ by {}",
            worst(&l_cpu, &l_gpu)
        );
        assert!(
            worst(&g_cpu, &g_gpu) <= 1e-4,
            "{bias:?}: gradients differ by {}",
            worst(&g_cpu, &g_gpu)
        );
    }
}

/// bf16 on wgpu is refused with one line before any adapter is touched; the
/// CPU computes in every precision.
#[test]
fn precisions_a_device_cannot_run_are_refused() {
    use burn::backend::wgpu::WgpuDevice;
    use tvq_model::Precision;
    use tvq_model::device::check_precision;
    let wgpu = burn::DispatchDevice::Wgpu(WgpuDevice::DefaultDevice);
    let why = check_precision(&wgpu, Precision::Bf16).unwrap_err();
    assert!(
        why.starts_with("bf16 does not run on wgpu") && !why.contains('\n'),
        "{why}"
    );
    assert_eq!(check_precision(&wgpu, Precision::F32), Ok(()));
    for p in Precision::ALL {
        assert_eq!(check_precision(&cpu(), p), Ok(()), "{p}");
    }
}
