//! Where tensors live: the backend and model types of training, the
//! autodiff devices of each activation-checkpointing mode, forks of the
//! model onto worker devices, random draws on the CPU whatever the device
//! (so that a run's numbers depend on its seed only), and host copies.

pub mod device;
pub mod memory;

use std::sync::Mutex;

use burn::backend::flex::Flex;
use burn::backend::{Autodiff, Cuda, Wgpu};
use burn::module::AutodiffModule;
use burn::module::{Module, ModuleMapper, Param};
use burn::prelude::*;
use burn::tensor::backend::{AutodiffBackend, DeviceOps};
use burn::{CheckpointingStrategy, Dispatch, DispatchDevice};
use tvq_model::device::to_device_via_host;
use tvq_model::{DropoutMasks, TransformerVq, VqBackend};

use crate::config::{ActivationCheckpointing, KernelsSetting, TrainSection};

/// The backend of inference, and of training wherever the trainer runs on
/// [`Dispatch`].
pub type B = Dispatch;
/// A model on [`B`].
pub type Model = TransformerVq<B>;

/// A backend the [`crate::Trainer`] runs on: burn's autodiff over a backend
/// with the model's kernel seam ([`VqBackend`]). [`TrainOn::choose`] picks
/// one per run.
///
/// - [`Dispatch`]: every device, every setting; its autodiff graph takes
///   no kernel's backward step, so training composes.
/// - `Autodiff<Flex>` ([`CpuFused`]): the CPU with its fused attention
///   and quantizer, forward and backward; one or more worker threads, no
///   activation checkpointing (a strategy is part of the type there; the
///   trainer refuses one).
/// - `Autodiff<Wgpu>`, `Autodiff<Cuda>` ([`WgpuFused`], [`CudaFused`]):
///   one GPU runtime with the cubecl kernels, each a custom operation of
///   burn's fusion stream (the elementwise ops around it stay fused);
///   likewise without activation checkpointing.
///
/// The run's devices are named as [`DispatchDevice`]s whatever the backend
/// (memory, precision and naming ask about those); this trait maps them
/// to the backend's own.
pub trait TrainBackend: AutodiffBackend<InnerBackend: VqBackend> + VqBackend {
    /// Whether it takes burn's activation checkpointing, a strategy per
    /// device (`train.activation_checkpointing` other than `none`).
    const CHECKPOINTS: bool;
    /// Whether this backend has the plain run device `device`.
    fn runs_on(device: &DispatchDevice) -> bool;
    /// This backend's autodiff device on the plain run device `device`
    /// (one it [`Self::runs_on`]), with `strategy` (burn's activation
    /// checkpointing).
    fn device_on(device: &DispatchDevice, strategy: CheckpointingStrategy) -> Self::Device;
    /// The device without autodiff under `device`: where gradients and
    /// optimizer moments live.
    fn inner_device(device: &Self::Device) -> burn::tensor::Device<Self::InnerBackend>;
    /// `model` without autodiff as a model of [`B`], where it is one
    /// already (on [`B`] itself); `None` elsewhere, where the trainer
    /// copies it through the bytes of a weights file.
    fn on_dispatch(model: &TransformerVq<Self>) -> Option<Model>;
    /// This backend's CPU device with autodiff, where the trainer draws
    /// every random number (initial weights, dropout masks) whatever
    /// device it trains on, so that a run's numbers depend on its config
    /// and seed, not on the backend's generator (every backend here draws
    /// with `Flex`'s). `None` on a backend of one GPU runtime: it draws on
    /// [`CpuFused`] and copies.
    fn cpu() -> Option<Self::Device>;
}

impl TrainBackend for Dispatch {
    const CHECKPOINTS: bool = true;

    fn runs_on(_: &DispatchDevice) -> bool {
        true
    }

    fn device_on(device: &DispatchDevice, strategy: CheckpointingStrategy) -> DispatchDevice {
        DispatchDevice::autodiff_checkpointed(device.inner().clone(), strategy)
    }

    fn inner_device(device: &DispatchDevice) -> DispatchDevice {
        device.inner().clone()
    }

    fn on_dispatch(model: &Model) -> Option<Model> {
        Some(model.valid())
    }

    fn cpu() -> Option<DispatchDevice> {
        let cpu = DispatchDevice::Flex(Default::default());
        Some(Self::device_on(&cpu, CheckpointingStrategy::None))
    }
}

/// The CPU's backend with its fused kernels reachable in training.
pub type CpuFused = Autodiff<Flex>;

impl TrainBackend for CpuFused {
    const CHECKPOINTS: bool = false;

    fn runs_on(device: &DispatchDevice) -> bool {
        matches!(device.inner(), DispatchDevice::Flex(_))
    }

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

    fn cpu() -> Option<Self::Device> {
        Some(Default::default())
    }
}

/// burn's wgpu backend (with burn's fusion where the `fusion` feature is
/// on, as in the default build) with the fused kernels reachable in
/// training (on lavapipe too, in CI).
pub type WgpuFused = Autodiff<Wgpu>;

/// burn's CUDA backend (with burn's fusion where the `fusion` feature is
/// on) with the fused kernels reachable in training.
pub type CudaFused = Autodiff<Cuda>;

/// [`TrainBackend`] for burn's autodiff over one cubecl runtime, whose
/// devices are those of `DispatchDevice::$variant`.
macro_rules! gpu_train_backend {
    ($backend:ty, $variant:ident) => {
        impl TrainBackend for $backend {
            const CHECKPOINTS: bool = false;

            fn runs_on(device: &DispatchDevice) -> bool {
                matches!(device.inner(), DispatchDevice::$variant(_))
            }

            fn device_on(device: &DispatchDevice, strategy: CheckpointingStrategy) -> Self::Device {
                debug_assert!(
                    matches!(strategy, CheckpointingStrategy::None),
                    "{} trains without activation checkpointing",
                    stringify!($backend)
                );
                match device.inner() {
                    DispatchDevice::$variant(d) => d.clone(),
                    other => panic!(
                        "{} trains on {} devices, not on {other:?}",
                        stringify!($backend),
                        stringify!($variant)
                    ),
                }
            }

            fn inner_device(device: &Self::Device) -> Self::Device {
                device.clone()
            }

            fn on_dispatch(_: &TransformerVq<Self>) -> Option<Model> {
                None
            }

            fn cpu() -> Option<Self::Device> {
                None
            }
        }
    };
}

gpu_train_backend!(WgpuFused, Wgpu);
gpu_train_backend!(CudaFused, Cuda);

/// The backend a run trains on, chosen once at the top from its settings
/// and devices ([`Self::choose`]); [`Self::run`] calls code generic over
/// [`TrainBackend`] on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TrainOn {
    /// [`Dispatch`], composed.
    Composed,
    /// [`CpuFused`].
    CpuFused,
    /// [`WgpuFused`].
    WgpuFused,
    /// [`CudaFused`].
    CudaFused,
}

/// Code generic over the trainer's backend, run by [`TrainOn::run`].
pub trait OnTrainBackend {
    /// What it returns.
    type Output;
    /// Runs it on `Bk`.
    fn run<Bk: TrainBackend>(self) -> Self::Output;
}

impl TrainOn {
    /// The backend of a run of `settings` on `devices`: a fused one where
    /// `train.kernels` asks for the kernels on these devices (`auto`: on
    /// the CPU; `fused`: on the CPU, wgpu and CUDA), no activation
    /// checkpointing asks for burn's strategies (which [`Dispatch`] chooses
    /// per device, the fused backends per type) and every device is of one
    /// backend with kernels, in any precision (the attention kernel widens
    /// reduced operands to `f32`). [`Dispatch`], composed, everywhere else.
    pub fn choose(settings: &TrainSection, devices: &[DispatchDevice]) -> Self {
        let fused = settings.kernels != KernelsSetting::Composed
            && settings.activation_checkpointing == ActivationCheckpointing::None
            && !devices.is_empty();
        let gpus = settings.kernels == KernelsSetting::Fused;
        let all = |kind: fn(&DispatchDevice) -> bool| devices.iter().all(|d| kind(d.inner()));
        if !fused {
            Self::Composed
        } else if all(|d| matches!(d, DispatchDevice::Flex(_))) {
            Self::CpuFused
        } else if gpus && all(|d| matches!(d, DispatchDevice::Wgpu(_))) {
            Self::WgpuFused
        } else if gpus && all(|d| matches!(d, DispatchDevice::Cuda(_))) {
            Self::CudaFused
        } else {
            Self::Composed
        }
    }

    /// Whether the attention and quantizer run as fused kernels.
    pub fn fused(self) -> bool {
        self != Self::Composed
    }

    /// Runs `f` on this backend.
    pub fn run<F: OnTrainBackend>(self, f: F) -> F::Output {
        match self {
            Self::Composed => f.run::<Dispatch>(),
            Self::CpuFused => f.run::<CpuFused>(),
            Self::WgpuFused => f.run::<WgpuFused>(),
            Self::CudaFused => f.run::<CudaFused>(),
        }
    }
}

impl std::fmt::Display for TrainOn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Composed => "composed ops",
            Self::CpuFused => "the CPU's fused kernels",
            Self::WgpuFused => "wgpu's fused kernels",
            Self::CudaFused => "CUDA's fused kernels",
        })
    }
}

/// The dropout masks of `model`'s forward pass over `shape` tokens, drawn
/// from `seed` on the CPU ([`TrainBackend::cpu`]) and placed on `device`.
pub(crate) fn drawn_masks<Bk: TrainBackend>(
    model: &TransformerVq<Bk>,
    shape: [usize; 2],
    seed: Option<u64>,
    device: &Bk::Device,
) -> DropoutMasks<Bk> {
    match Bk::cpu() {
        Some(cpu) => seeded_draw::<Bk, _>(&cpu, seed, || model.dropout_masks_on::<Bk>(shape, &cpu))
            .to_device(device),
        None => {
            let cpu = Default::default();
            seeded_draw::<CpuFused, _>(&cpu, seed, || {
                model.dropout_masks_on::<CpuFused>(shape, &cpu)
            })
            .onto::<Bk>(device)
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::PrecisionSetting;
    use burn::backend::wgpu::WgpuDevice;
    use tvq_model::Kernels;
    use tvq_model::Precision;

    /// The fused backends where their kernels cover the run (any
    /// precision, no activation checkpointing, one kind of device), and
    /// composed ops wherever anything else is asked. (Devices are only
    /// named here, not used.)
    #[test]
    fn a_run_trains_fused_only_where_the_kernels_cover_it() {
        let cpu: &[DispatchDevice] = &[DispatchDevice::Flex(Default::default())];
        let wgpu: &[DispatchDevice] = &[DispatchDevice::Wgpu(WgpuDevice::DefaultDevice)];
        let auto = TrainSection::default();
        assert_eq!(auto.kernels, KernelsSetting::Auto, "the default");
        let with = |kernels| TrainSection {
            kernels,
            ..auto.clone()
        };
        let choose = |settings: &TrainSection, devices: &[DispatchDevice]| {
            TrainOn::choose(settings, devices)
        };
        // `auto`: the CPU's kernels; the GPUs compose.
        assert_eq!(choose(&auto, cpu), TrainOn::CpuFused);
        assert_eq!(choose(&auto, wgpu), TrainOn::Composed);
        let fused = with(KernelsSetting::Fused);
        assert_eq!(choose(&fused, cpu), TrainOn::CpuFused);
        assert_eq!(choose(&fused, wgpu), TrainOn::WgpuFused);
        let composed = with(KernelsSetting::Composed);
        assert_eq!(choose(&composed, cpu), TrainOn::Composed);
        assert_eq!(choose(&composed, wgpu), TrainOn::Composed);
        for mode in [
            ActivationCheckpointing::Selective,
            ActivationCheckpointing::Full,
        ] {
            let checkpointed = TrainSection {
                activation_checkpointing: mode,
                ..fused.clone()
            };
            assert_eq!(choose(&checkpointed, cpu), TrainOn::Composed);
        }
        let bf16 = TrainSection {
            precision: PrecisionSetting::Fixed(Precision::Bf16),
            ..fused.clone()
        };
        assert_eq!(choose(&bf16, cpu), TrainOn::CpuFused);
        assert_eq!(choose(&bf16, wgpu), TrainOn::WgpuFused);
        assert_eq!(
            choose(&fused, &[cpu[0].clone(), wgpu[0].clone()]),
            TrainOn::Composed
        );
        assert_eq!(choose(&fused, &[]), TrainOn::Composed);
        assert!(TrainOn::WgpuFused.fused() && !TrainOn::Composed.fused());
        assert_eq!(KernelsSetting::Auto.model(), Kernels::Fused);
        assert_eq!(KernelsSetting::Composed.model(), Kernels::Composed);
    }
}
