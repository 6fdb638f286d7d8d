//! The GPU devices that the backend tests compare with the CPU: wgpu's
//! (Mesa's lavapipe in CI, `TVQ_REQUIRE_WGPU=1`), or CUDA's when
//! `TVQ_TEST_DEVICE=cuda` names it (`scripts/gpu-check.sh`).

use std::io::Write;

use burn::DispatchDevice;
use burn::backend::wgpu::WgpuDevice;
use tvq_model::device::{DeviceSpec, wgpu_adapter};

/// Two wgpu devices (the default adapter and the CPU-type one: Mesa's
/// lavapipe, which CI installs, is both), or `None` after a visible
/// SKIPPED line where there are none; `TVQ_REQUIRE_WGPU` makes that a
/// failure.
pub fn two_wgpu_devices() -> Option<[DispatchDevice; 2]> {
    let pair = [WgpuDevice::DefaultDevice, WgpuDevice::Cpu];
    if pair.iter().all(|d| wgpu_adapter(d).is_some()) {
        return Some(pair.map(DispatchDevice::Wgpu));
    }
    let message = "two wgpu adapters (default and CPU-type; install Mesa's lavapipe, \
                   Debian's mesa-vulkan-drivers)";
    assert!(
        std::env::var_os("TVQ_REQUIRE_WGPU").is_none(),
        "no {message}, and TVQ_REQUIRE_WGPU is set"
    );
    // Straight to stderr: libtest hides `eprintln!` of a passing test.
    let _ = writeln!(std::io::stderr(), "SKIPPED: no {message}");
    None
}

/// The GPU compared with the CPU: CUDA device 0 when
/// `TVQ_TEST_DEVICE=cuda` (which must then exist), else wgpu's default
/// adapter (`None`, with a SKIPPED line, where there is none; see
/// [`two_wgpu_devices`]).
pub fn gpu_under_test() -> Option<DispatchDevice> {
    if std::env::var("TVQ_TEST_DEVICE").as_deref() == Ok("cuda") {
        let (device, _) = DeviceSpec::Cuda(0)
            .init()
            .expect("TVQ_TEST_DEVICE=cuda needs a CUDA GPU");
        return Some(device);
    }
    two_wgpu_devices().map(|[a, _]| a)
}
