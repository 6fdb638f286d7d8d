//! Where tensors live: the backend and model types of training, the
//! autodiff devices of each activation-checkpointing mode, forks of the
//! model onto worker devices, random draws on the CPU whatever the device
//! (so that a run's numbers depend on its seed only), and host copies.

pub mod device;
pub mod memory;

use std::sync::Mutex;

use burn::backend::Autodiff;
use burn::backend::flex::Flex;
use burn::module::AutodiffModule;
use burn::module::{Module, ModuleMapper, Param};
use burn::prelude::*;
use burn::tensor::backend::{AutodiffBackend, DeviceOps};
use burn::{CheckpointingStrategy, Dispatch, DispatchDevice};
use tvq_model::device::to_device_via_host;
use tvq_model::{TransformerVq, VqBackend};

use crate::config::ActivationCheckpointing;

/// The backend of inference, and of training wherever the trainer runs on
/// [`Dispatch`].
pub type B = Dispatch;
/// A model on [`B`].
pub type Model = TransformerVq<B>;

/// A backend the [`crate::Trainer`] runs on: burn's autodiff over a backend
/// with the model's kernel seam ([`VqBackend`]).
///
/// - [`Dispatch`]: every device, every setting; its autodiff graph takes
///   no kernel's backward step, so training composes.
/// - `Autodiff<Flex>` ([`CpuFused`]): the CPU with its fused attention
///   and quantizer, forward and backward; one or more worker threads, no
///   activation checkpointing (a strategy is part of the type there).
///
/// The run's devices are named as [`DispatchDevice`]s whatever the backend
/// (memory, precision and naming ask about those); this trait maps them
/// to the backend's own.
pub trait TrainBackend: AutodiffBackend + VqBackend {
    /// This backend's autodiff device on the plain run device `device`,
    /// with `strategy` (burn's activation checkpointing).
    fn device_on(device: &DispatchDevice, strategy: CheckpointingStrategy) -> Self::Device;
    /// The device without autodiff under `device`: where gradients and
    /// optimizer moments live.
    fn inner_device(device: &Self::Device) -> burn::tensor::Device<Self::InnerBackend>;
    /// `model` without autodiff as a model of [`B`], where it is one
    /// already (on [`B`] itself); `None` elsewhere, where the trainer
    /// copies it through the bytes of a weights file.
    fn on_dispatch(model: &TransformerVq<Self>) -> Option<Model>;
}

impl TrainBackend for Dispatch {
    fn device_on(device: &DispatchDevice, strategy: CheckpointingStrategy) -> DispatchDevice {
        DispatchDevice::autodiff_checkpointed(device.inner().clone(), strategy)
    }

    fn inner_device(device: &DispatchDevice) -> DispatchDevice {
        device.inner().clone()
    }

    fn on_dispatch(model: &Model) -> Option<Model> {
        Some(model.valid())
    }
}

/// The CPU's backend with its fused kernels reachable in training.
pub type CpuFused = Autodiff<Flex>;

impl TrainBackend for CpuFused {
    fn device_on(device: &DispatchDevice, strategy: CheckpointingStrategy) -> Self::Device {
        debug_assert!(
            matches!(device.inner(), DispatchDevice::Flex(_))
                && matches!(strategy, CheckpointingStrategy::None),
            "CpuFused trains on the CPU without activation checkpointing"
        );
        Default::default()
    }

    fn inner_device(device: &Self::Device) -> Self::Device {
        *device
    }

    fn on_dispatch(_: &TransformerVq<Self>) -> Option<Model> {
        None
    }
}

/// The CPU device with autodiff of `Bk`, where the trainer draws every
/// random number (initial weights and dropout masks) whatever device it
/// trains on, so that a run's numbers depend on its config and seed, not
/// on the backend's generator (every backend here draws with `Flex`'s).
pub(crate) fn cpu_autodiff<Bk: TrainBackend>() -> Bk::Device {
    Bk::device_on(
        &DispatchDevice::Flex(Default::default()),
        CheckpointingStrategy::None,
    )
}

/// The autodiff device a shard's passes run on over the plain `device`:
/// burn's balanced checkpointing under `selective` and `full` (whose
/// recomputed sublayers keep less that way), plain autodiff under `none`.
/// Every tensor of a pass must come from such a device: burn checks that
/// the operands of each op share a strategy.
pub fn autodiff_device<Bk: TrainBackend>(
    device: &DispatchDevice,
    mode: ActivationCheckpointing,
) -> Bk::Device {
    let strategy = match mode {
        ActivationCheckpointing::Selective | ActivationCheckpointing::Full => {
            CheckpointingStrategy::Balanced
        }
        ActivationCheckpointing::None => CheckpointingStrategy::None,
    };
    Bk::device_on(device, strategy)
}

/// `draw()` after seeding `device`'s generator with `seed` (when given).
/// The backends' generators are shared by the whole process, so seeding and
/// drawing happen under one process-wide lock: what is drawn depends on the
/// seed only, whatever other threads (worker threads, trainers built at
/// once) draw meanwhile.
pub(crate) fn seeded_draw<Bk: Backend, R>(
    device: &Bk::Device,
    seed: Option<u64>,
    draw: impl FnOnce() -> R,
) -> R {
    static LOCK: Mutex<()> = Mutex::new(());
    let _drawing = LOCK.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some(seed) = seed {
        Bk::seed(device, seed);
    }
    draw()
}

/// `model` forked onto `device` (an autodiff graph of its own, the same
/// parameter ids), its weights copied through the host when they move
/// ([`to_device_via_host`]): how a model reaches each device of a run.
pub fn fork_onto<Bk: Backend>(model: &TransformerVq<Bk>, device: &Bk::Device) -> TransformerVq<Bk> {
    struct ViaHost<'a, Bk: Backend>(&'a Bk::Device);
    impl<Bk: Backend> ModuleMapper<Bk> for ViaHost<'_, Bk> {
        fn map_float<const D: usize>(&mut self, p: Param<Tensor<Bk, D>>) -> Param<Tensor<Bk, D>> {
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
        model.clone().map(&mut ViaHost::<Bk>(device))
    }
}

/// A tensor's values on the host, as `f32`.
pub(crate) fn host_values<Bk: Backend, const D: usize>(t: &Tensor<Bk, D>) -> Vec<f32> {
    t.to_data().convert::<f32>().to_vec().expect("f32 data")
}
