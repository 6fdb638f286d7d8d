//! The GPU devices that the backend tests compare with the CPU, probed with
//! this crate's own probes; what their absence means is
//! [`tvq_testkit::Gpu`]'s to say.

use burn::DispatchDevice;
use burn::backend::wgpu::WgpuDevice;
use tvq_testkit::Gpu;

use crate::placement::device::{DeviceSpec, wgpu_adapter};

/// Two wgpu devices (the default adapter and the CPU-type one: Mesa's
/// lavapipe, which CI installs, is both), or `None` after [`Gpu::missing`]
/// where there are none.
pub fn two_wgpu_devices(test: &str) -> Option<[DispatchDevice; 2]> {
    let pair = [WgpuDevice::DefaultDevice, WgpuDevice::Cpu];
    if pair.iter().all(|d| wgpu_adapter(d).is_some()) {
        return Some(pair.map(DispatchDevice::Wgpu));
    }
    Gpu::Wgpu.missing(
        test,
        "two wgpu adapters, the default and a CPU-type one, are needed",
    );
    None
}

/// The GPU compared with the CPU ([`Gpu::under_test`]): CUDA device 0, or
/// wgpu's default adapter; `None` after [`Gpu::missing`] where there is
/// none.
pub fn gpu_under_test(test: &str) -> Option<DispatchDevice> {
    let gpu = Gpu::under_test();
    if gpu == Gpu::Wgpu {
        return two_wgpu_devices(test).map(|[a, _]| a);
    }
    match DeviceSpec::Cuda(0).init() {
        Ok((device, _)) => Some(device),
        Err(e) => {
            gpu.missing(test, &e.to_string());
            None
        }
    }
}
