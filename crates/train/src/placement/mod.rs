//! Where tensors live: the backend and model types of training, the
//! autodiff devices of each activation-checkpointing mode, forks of the
//! model onto worker devices, random draws on the CPU whatever the device
//! (so that a run's numbers depend on its seed only), and host copies.

pub mod device;
pub mod memory;

use std::sync::Mutex;

use burn::module::{Module, ModuleMapper, Param};
use burn::prelude::*;
use burn::tensor::backend::DeviceOps;
use burn::{CheckpointingStrategy, Dispatch, DispatchDevice};
use tvq_model::TransformerVq;
use tvq_model::device::to_device_via_host;

use crate::config::ActivationCheckpointing;

/// The backend of training.
pub type B = Dispatch;
/// The model being trained.
pub type Model = TransformerVq<B>;

/// The CPU device with autodiff, where the trainer draws every random
/// number (initial weights and dropout masks) whatever device it trains
/// on, so that a run's numbers depend on its config and seed, not on the
/// backend's generator.
pub(crate) fn cpu_autodiff() -> DispatchDevice {
    DispatchDevice::autodiff(DispatchDevice::Flex(Default::default()))
}

/// The autodiff device a shard's passes run on over the plain `device`:
/// burn's balanced checkpointing under `selective` and `full` (whose
/// recomputed sublayers keep less that way), plain autodiff under `none`.
/// Every tensor of a pass must come from such a device: burn checks that
/// the operands of each op share a strategy.
pub fn autodiff_device(device: &DispatchDevice, mode: ActivationCheckpointing) -> DispatchDevice {
    let strategy = match mode {
        ActivationCheckpointing::Selective | ActivationCheckpointing::Full => {
            CheckpointingStrategy::Balanced
        }
        ActivationCheckpointing::None => CheckpointingStrategy::None,
    };
    DispatchDevice::autodiff_checkpointed(device.inner().clone(), strategy)
}

/// `draw()` after seeding `device`'s generator with `seed` (when given).
/// The backends' generators are shared by the whole process, so seeding and
/// drawing happen under one process-wide lock: what is drawn depends on the
/// seed only, whatever other threads (worker threads, trainers built at
/// once) draw meanwhile.
pub(crate) fn seeded_draw<R>(
    device: &DispatchDevice,
    seed: Option<u64>,
    draw: impl FnOnce() -> R,
) -> R {
    static LOCK: Mutex<()> = Mutex::new(());
    let _drawing = LOCK.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some(seed) = seed {
        B::seed(device, seed);
    }
    draw()
}

/// `model` forked onto `device` (an autodiff graph of its own, the same
/// parameter ids), its weights copied through the host when they move
/// ([`to_device_via_host`]): how a model reaches each device of a run.
pub fn fork_onto(model: &Model, device: &DispatchDevice) -> Model {
    struct ViaHost<'a>(&'a DispatchDevice);
    impl ModuleMapper<B> for ViaHost<'_> {
        fn map_float<const D: usize>(&mut self, p: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            p.map(|t| {
                let trained = t.is_require_grad();
                let t = to_device_via_host(t.detach(), self.0);
                if trained { t.require_grad() } else { t }
            })
        }
    }
    if model.embedding.weight.device() == *device {
        model.clone().fork(device)
    } else {
        model.clone().map(&mut ViaHost(device))
    }
}

/// A tensor's values on the host, as `f32`.
pub(crate) fn host_values<const D: usize>(t: &Tensor<B, D>) -> Vec<f32> {
    t.to_data().convert::<f32>().to_vec().expect("f32 data")
}
