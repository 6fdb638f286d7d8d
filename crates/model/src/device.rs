//! Moving tensors between devices. Which device a run uses, and probing
//! it, belong to the training crate (`tvq_train::placement::device`).

use burn::tensor::backend::DeviceOps;
use burn::tensor::{BasicOps, Tensor};

/// Whether the GPU backends fuse elementwise kernels and autotune kernels
/// (the crate's default `fusion` feature; the CPU backend does neither).
pub const GPU_FUSION: bool = cfg!(feature = "fusion");

/// `t` on `device`, copied through the host when it is on another device
/// (autodiff or not: they compare by their plain device), or when both are
/// autodiff devices with different checkpointing strategies (burn checks
/// that the operands of each op share one; integer and boolean tensors
/// report their plain device and are not copied). wgpu (cubecl 0.10) has no
/// copy between two of its devices, so training on several devices moves
/// weights, gradients and states this way on every backend.
pub fn to_device_via_host<B, const D: usize, K>(
    t: Tensor<B, D, K>,
    device: &B::Device,
) -> Tensor<B, D, K>
where
    B: burn::prelude::Backend,
    K: BasicOps<B>,
{
    let here = t.device();
    let other_strategy = here != *device && B::ad_enabled(&here) && B::ad_enabled(device);
    if here.inner() == device.inner() && !other_strategy {
        return t;
    }
    Tensor::from_data(t.into_data(), device)
}
