//! Run-time choice of the compute device: `cpu` (burn's flex backend),
//! `wgpu[:N]` or `cuda[:N]`, all compiled into one binary through
//! `burn::Dispatch`, and the process-wide set-up of the GPU runtimes
//! (where cubecl keeps its autotuning cache).
//!
//! burn panics on the first operation on a GPU that is not there, so a GPU
//! is probed before it is handed out, and its absence is a [`DeviceError`].

use std::fmt;
use std::str::FromStr;

use crate::config::PrecisionSetting;
use burn::backend::cuda::CudaDevice;
use burn::backend::flex::FlexDevice;
use burn::backend::wgpu::WgpuDevice;
use burn::tensor::backend::DeviceOps;
use burn::tensor::{StreamId, Tensor};
use burn::{Dispatch, DispatchDevice};
use thiserror::Error;
use tvq_model::Precision;
use tvq_model::device::GPU_FUSION;

/// A device named on the command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceSpec {
    /// The CPU (flex backend; AVX-512 matmul where the CPU has it).
    Cpu,
    /// A GPU through wgpu (Vulkan, Metal or DX12): the default adapter, or the
    /// `N`-th discrete GPU.
    Wgpu(Option<usize>),
    /// The `N`-th NVIDIA GPU through CUDA.
    Cuda(usize),
}

/// Why a device cannot be used.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum DeviceError {
    /// The name is not one of `cpu`, `wgpu[:N]`, `cuda[:N]`.
    #[error("unknown device `{0}`: expected cpu, wgpu, wgpu:N, cuda or cuda:N")]
    Unknown(String),
    /// No usable CUDA driver or device.
    #[error("device `{spec}` is not available: {reason}")]
    Unavailable {
        /// The device as asked for.
        spec: String,
        /// What the probe found.
        reason: String,
    },
    /// [`profile_kernels`] after the GPU runtime read its settings.
    #[error("kernel profiling must be asked for before the first GPU use")]
    ProfileTooLate,
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Cpu => write!(f, "cpu"),
            Self::Wgpu(None) => write!(f, "wgpu"),
            Self::Wgpu(Some(i)) => write!(f, "wgpu:{i}"),
            Self::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

impl FromStr for DeviceSpec {
    type Err = DeviceError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let unknown = || DeviceError::Unknown(s.to_string());
        let (name, index) = match s.split_once(':') {
            Some((name, i)) => (name, Some(i.parse::<usize>().map_err(|_| unknown())?)),
            None => (s, None),
        };
        match (name, index) {
            ("cpu", None) => Ok(Self::Cpu),
            ("wgpu", i) => Ok(Self::Wgpu(i)),
            ("cuda", i) => Ok(Self::Cuda(i.unwrap_or(0))),
            _ => Err(unknown()),
        }
    }
}

/// Runs a probe that may panic (the backends panic where a device or a type
/// is missing), its panic caught and its message kept off stderr. The
/// panic hook is process-wide: every swap of it happens under one lock, so
/// that probes on several threads restore the hook they found.
fn silently<R>(probe: impl FnOnce() -> R + std::panic::UnwindSafe) -> std::thread::Result<R> {
    static HOOK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _swapping = HOOK.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let result = std::panic::catch_unwind(probe);
    std::panic::set_hook(hook);
    result
}

/// The type of the matrix products a run on `device` gets from its
/// `train.precision`: the type it names, or for `auto` bf16 on a CUDA GPU
/// that computes it (tensor cores at twice TF32's rate, half the bytes
/// moved; within 0.4% of f32's bits per byte, docs/learning.md) and f32 on
/// every other device (the CPU emulates bf16, wgpu has none).
pub fn precision_on(device: &DispatchDevice, setting: PrecisionSetting) -> Precision {
    match (setting, device.inner()) {
        (PrecisionSetting::Fixed(precision), _) => precision,
        (PrecisionSetting::Auto, DispatchDevice::Cuda(_))
            if check_precision(device, Precision::Bf16).is_ok() =>
        {
            Precision::Bf16
        }
        (PrecisionSetting::Auto, _) => Precision::F32,
    }
}

/// Whether `device` computes matrix products in `precision`: `Err` with a
/// one-line reason where it does not, found before training starts (the
/// backends panic on a type they cannot compile). bf16 is refused on wgpu
/// outright (its WGSL compiler has no bfloat16); otherwise a small product
/// is tried, its panic caught and silenced, once per device and precision
/// in a process (a run asks before it sizes its memory and again as its
/// trainer starts).
pub fn check_precision(device: &DispatchDevice, precision: Precision) -> Result<(), String> {
    if !precision.is_reduced() {
        return Ok(());
    }
    let plain = device.inner().clone();
    let mut checked = CHECKED
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some((_, _, found)) = checked
        .iter()
        .find(|(d, p, _)| *d == plain && *p == precision)
    {
        return found.clone();
    }
    let found = probe_precision(&plain, precision);
    checked.push((plain, precision, found.clone()));
    found
}

/// Each plain device and reduced precision [`check_precision`] has probed
/// in this process, with the answer.
type Checked = Vec<(DispatchDevice, Precision, Result<(), String>)>;
static CHECKED: std::sync::Mutex<Checked> = std::sync::Mutex::new(Vec::new());

/// [`check_precision`]'s probe of the plain device `plain`, uncached.
fn probe_precision(plain: &DispatchDevice, precision: Precision) -> Result<(), String> {
    let name = device_name(plain);
    if precision == Precision::Bf16 && matches!(plain, DispatchDevice::Wgpu(_)) {
        return Err(format!(
            "bf16 does not run on {name}: wgpu's WGSL compiler has no bfloat16 \
             (use --device cuda, or f16 on an adapter with shader f16, or f32)"
        ));
    }
    let plain = plain.clone();
    let probe = move || {
        let a = Tensor::<Dispatch, 2>::ones([8, 8], &plain).cast(precision.dtype());
        let product = a.clone().matmul(a).cast(burn::tensor::FloatDType::F32);
        product.into_data().to_vec::<f32>().ok()
    };
    match silently(probe) {
        Ok(Some(values)) if values.iter().all(|&v| v == 8.0) => Ok(()),
        Ok(_) => Err(format!(
            "{precision} does not run on {name}: a test product came back wrong"
        )),
        Err(panic) => {
            let why = panic
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| panic.downcast_ref::<&str>().copied())
                .unwrap_or("the backend panicked");
            let why = why.lines().next().unwrap_or_default();
            Err(format!("{precision} does not run on {name}: {why}"))
        }
    }
}

/// A device as `--device` names it (`cpu`, `cuda:N`, `wgpu`, `wgpu:N`),
/// autodiff or not; other wgpu devices by their burn name.
pub fn device_name(device: &DispatchDevice) -> String {
    match device.inner() {
        DispatchDevice::Flex(_) => DeviceSpec::Cpu.to_string(),
        DispatchDevice::Cuda(d) => DeviceSpec::Cuda(d.index).to_string(),
        DispatchDevice::Wgpu(WgpuDevice::DefaultDevice) => DeviceSpec::Wgpu(None).to_string(),
        DispatchDevice::Wgpu(WgpuDevice::DiscreteGpu(i)) => DeviceSpec::Wgpu(Some(*i)).to_string(),
        other => format!("{other:?}"),
    }
}

/// Number of CUDA devices the driver reports; 0 when there is no driver.
pub fn cuda_device_count() -> usize {
    // SAFETY: only checks whether the driver library can be loaded.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return 0;
    }
    if cudarc::driver::result::init().is_err() {
        return 0;
    }
    cudarc::driver::result::device::get_count().map_or(0, |n| n.max(0) as usize)
}

/// The name the driver gives CUDA device `index` (e.g. "NVIDIA H100 80GB
/// HBM3"), where there is a driver and such a device.
pub fn cuda_device_name(index: usize) -> Option<String> {
    if index >= cuda_device_count() {
        return None;
    }
    let device = cudarc::driver::result::device::get(index as i32).ok()?;
    cudarc::driver::result::device::get_name(device).ok()
}

/// GPU memory held for a run, in bytes, summed over `devices` (`None` when
/// none is a GPU). On CUDA it is the device's memory that is not free, as
/// `nvidia-smi` counts it (this process's pools, and any other process's on
/// the same GPU). wgpu has no such query, so there it is what burn's memory
/// pools of `streams` (the run's threads' GPU streams) have reserved.
pub fn device_memory_bytes(devices: &[DispatchDevice], streams: &[StreamId]) -> Option<u64> {
    let held: Vec<Option<u64>> = devices
        .iter()
        .filter_map(|device| match device.inner() {
            DispatchDevice::Cuda(d) => {
                Some(cuda_memory(d.index).map(|m| (m.total - m.free) as u64))
            }
            DispatchDevice::Wgpu(d) => Some(wgpu_memory_reserved(d, streams)),
            _ => None,
        })
        .collect();
    // One failed query makes the sum unknown rather than low.
    (!held.is_empty()).then(|| held.into_iter().sum()).flatten()
}

/// Free and total memory of a CUDA device, in bytes, as its driver counts
/// them (every process's allocations, this one's pools included).
pub(crate) struct CudaMemory {
    /// Bytes free.
    pub free: usize,
    /// Bytes in all.
    pub total: usize,
}

/// The memory of CUDA device `index`, read in its primary context (the one
/// burn's CUDA runtime uses, so this creates nothing). Call only for a
/// device that was opened: without a CUDA driver the query cannot load.
pub(crate) fn cuda_memory(index: usize) -> Option<CudaMemory> {
    use cudarc::driver::result::{ctx, device, mem_get_info, primary_ctx};
    let dev = device::get(index as i32).ok()?;
    let previous = ctx::get_current().ok()?;
    // SAFETY: `dev` is a valid device; the context retained here is current
    // on this thread for the query only (the previous one is restored; burn's
    // runtime sets its own before each command anyway) and released after.
    unsafe {
        let context = primary_ctx::retain(dev).ok()?;
        let info = ctx::set_current(context).and_then(|()| mem_get_info());
        if let Some(previous) = previous {
            let _ = ctx::set_current(previous);
        }
        let _ = primary_ctx::release(dev);
        info.ok().map(|(free, total)| CudaMemory { free, total })
    }
}

/// What cubecl's memory pools of `streams` on `device` have reserved (each
/// stream of a cubecl device has a pool of its own).
fn wgpu_memory_reserved(device: &WgpuDevice, streams: &[StreamId]) -> Option<u64> {
    use burn::backend::wgpu::WgpuRuntime;
    use cubecl_runtime::runtime::Runtime;
    let client = WgpuRuntime::client(device);
    streams
        .iter()
        .map(|stream| {
            let usage = stream.executes(|| client.memory_usage()).ok()?;
            Some(usage.bytes_reserved)
        })
        .sum()
}

/// Where cubecl keeps what it learns about a device, so that a kernel is
/// compiled and a shape tuned once per machine rather than once per process:
/// under `$XDG_CACHE_HOME/tvq/` or `~/.cache/tvq/`, autotuning's measurements
/// in `autotune/` and the CUDA kernels NVRTC compiled in
/// [`COMPILED_KERNELS_FOLDER`] (a training step compiles hundreds;
/// cubecl's own defaults keep no kernels and scatter autotune caches over
/// the `target/` directory of whatever Rust project `tvq` runs in). A `cubecl.toml` that names other caches, and cubecl's
/// `CUBECL_*` variables, are obeyed as cubecl would.
/// Runs before the first GPU use (cubecl reads its settings once); whether
/// this call set them (false: they were set already).
fn configure_gpu_runtime() -> bool {
    use cubecl_runtime::config::{CubeClRuntimeConfig, RuntimeConfig};
    let mut settings = CubeClRuntimeConfig::storage().lock();
    if settings.is_some() {
        return false; // already read: too late to change
    }
    let home = std::env::var_os("XDG_CACHE_HOME")
        .map(std::path::PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| std::path::Path::new(&h).join(".cache")));
    let mut config = with_tvq_caches(
        CubeClRuntimeConfig::from_current_dir().override_from_env(),
        home,
    );
    if let Some(log) = KERNEL_LOG.get() {
        use cubecl_runtime::config::profiling::ProfilingLogLevel;
        config.profiling.logger.file = Some(log.clone());
        config.profiling.logger.append = false;
        config.profiling.logger.level = ProfilingLogLevel::Basic;
    }
    *settings = Some(std::sync::Arc::new(config));
    true
}

/// How many independent blocks of queued ops burn's fusion searches at
/// once. burn's default (5) lets an op that no fuser starts with (a slice
/// of a weight), queued beside an open block, open a second block that
/// then takes every later op unfused, one kernel each: with one block the
/// stream is fused in order, and a training step launches fewer kernels
/// (docs/benchmarks.md, "launches per training step").
const FUSION_BLOCKS: usize = 1;

/// Sets burn's fusion search to [`FUSION_BLOCKS`] blocks, unless burn's
/// settings (a `burn.toml` in the current directory or above) chose a
/// number other than burn's default. Runs before the first fused op (burn
/// reads its settings once); whether this call set them.
fn configure_fusion() -> bool {
    use burn_std::config::{BurnConfig, RuntimeConfig};
    let mut settings = BurnConfig::storage().lock();
    if settings.is_some() {
        return false; // already read: too late to change
    }
    let config = with_tvq_fusion(BurnConfig::from_current_dir().override_from_env());
    *settings = Some(std::sync::Arc::new(config));
    true
}

/// `config` with [`FUSION_BLOCKS`] where it has burn's default.
fn with_tvq_fusion(mut config: burn_std::config::BurnConfig) -> burn_std::config::BurnConfig {
    use burn_std::config::fusion::BeamSearchConfig;
    let search = &mut config.fusion.beam_search;
    if search.max_blocks == BeamSearchConfig::default().max_blocks {
        search.max_blocks = FUSION_BLOCKS;
    }
    config
}

/// Where [`profile_kernels`] has cubecl log each kernel launch.
static KERNEL_LOG: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();

/// Has cubecl time every kernel launch on wgpu and CUDA and write one line
/// per launch to `log`, `| <duration> | <kernel name>` (each launch then
/// waits for the one before it, so that its time is its own: profiled work
/// runs slower). Before the first GPU use of the process, else
/// [`DeviceError::ProfileTooLate`].
pub fn profile_kernels(log: &std::path::Path) -> Result<(), DeviceError> {
    if KERNEL_LOG.set(log.to_path_buf()).is_err() || !configure_gpu_runtime() {
        return Err(DeviceError::ProfileTooLate);
    }
    Ok(())
}

/// The folder of `$XDG_CACHE_HOME/tvq/` (or `~/.cache/tvq/`) that holds
/// the kernels cubecl compiled, burn's and tvq's: one for every build,
/// since each of tvq's kernels is known by the hash of their sources
/// ([`tvq_model::kernel::SOURCE_HASH`]) as well as its name and settings.
pub const COMPILED_KERNELS_FOLDER: &str = "kernels";

/// `config` with its caches moved under `cache_home/tvq`, where cubecl's
/// defaults would put them (autotuning: `target/`; compiled kernels: none),
/// the compiled kernels in [`COMPILED_KERNELS_FOLDER`]. A cache the user
/// chose is left as it is.
fn with_tvq_caches(
    mut config: cubecl_runtime::config::CubeClRuntimeConfig,
    cache_home: Option<std::path::PathBuf>,
) -> cubecl_runtime::config::CubeClRuntimeConfig {
    use cubecl_runtime::config::cache::CacheConfig;
    if let Some(dir) = cache_home.map(|home| home.join("tvq")) {
        if let CacheConfig::Target = config.autotune.cache {
            config.autotune.cache = CacheConfig::File(dir.clone());
        }
        config
            .compilation
            .cache
            .get_or_insert(CacheConfig::File(dir.join(COMPILED_KERNELS_FOLDER)));
    }
    config
}

/// Initialises the wgpu adapter for `device` and describes it ("name (type,
/// api)"), or returns `None` when there is none. cubecl panics when no
/// adapter exists, so the panic is caught and its message silenced. A
/// device's runtime can be set up once per process (a second set-up
/// panics too), so each device's answer is remembered.
pub fn wgpu_adapter(device: &WgpuDevice) -> Option<String> {
    use burn::backend::wgpu::{RuntimeOptions, graphics::AutoGraphicsApi, init_setup};
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};
    static PROBED: OnceLock<Mutex<HashMap<WgpuDevice, Option<String>>>> = OnceLock::new();
    configure_gpu_runtime();
    let mut probed = PROBED
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some(found) = probed.get(device) {
        return found.clone();
    }
    let found = silently(|| {
        let setup = init_setup::<AutoGraphicsApi>(device, RuntimeOptions::default());
        let info = setup.adapter.get_info();
        format!("{} ({:?}, {:?})", info.name, info.device_type, info.backend)
    })
    .ok();
    probed.insert(device.clone(), found.clone());
    found
}

impl DeviceSpec {
    /// Probes the device and returns it (plain, without autodiff), with a
    /// one-line description (a GPU's says "unfused" in a build without
    /// [`GPU_FUSION`]). Never panics.
    pub fn init(self) -> Result<(DispatchDevice, String), DeviceError> {
        let (device, info) = self.probe()?;
        let unfused = !GPU_FUSION && !matches!(device, DispatchDevice::Flex(_));
        Ok((
            device,
            if unfused {
                format!("{info} (unfused)")
            } else {
                info
            },
        ))
    }

    fn probe(self) -> Result<(DispatchDevice, String), DeviceError> {
        configure_gpu_runtime();
        configure_fusion();
        let unavailable = |reason: String| DeviceError::Unavailable {
            spec: self.to_string(),
            reason,
        };
        match self {
            Self::Cpu => Ok((DispatchDevice::Flex(FlexDevice), "cpu (flex)".to_string())),
            Self::Cuda(index) => {
                let count = cuda_device_count();
                if index >= count {
                    return Err(unavailable(if count == 0 {
                        "no CUDA driver or no CUDA GPU on this machine".to_string()
                    } else {
                        format!("only {count} CUDA GPU(s) found")
                    }));
                }
                let name = cuda_device_name(index).unwrap_or_default();
                Ok((
                    DispatchDevice::Cuda(CudaDevice { index }),
                    format!("cuda:{index} {name}").trim_end().to_string(),
                ))
            }
            Self::Wgpu(index) => {
                let device = match index {
                    None => WgpuDevice::DefaultDevice,
                    Some(i) => WgpuDevice::DiscreteGpu(i),
                };
                match wgpu_adapter(&device) {
                    Some(info) => Ok((DispatchDevice::Wgpu(device), format!("wgpu: {info}"))),
                    None => Err(unavailable(
                        "no wgpu adapter found (no Vulkan, Metal or DX12 driver?)".to_string(),
                    )),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use burn::module::Module;
    use burn::prelude::*;
    use burn::record::{BinBytesRecorder, FullPrecisionSettings, Recorder};
    use tvq_model::{Pass, RelativeBias};

    use super::*;
    use crate::placement::B;

    fn cpu() -> DispatchDevice {
        DispatchDevice::Flex(FlexDevice)
    }

    #[test]
    fn gpu_caches_go_under_the_users_cache_unless_chosen() {
        use cubecl_runtime::config::CubeClRuntimeConfig;
        use cubecl_runtime::config::cache::CacheConfig;
        let home = std::path::PathBuf::from("/home/u/.cache");
        let root = |c: &Option<CacheConfig>| c.as_ref().map(CacheConfig::root);
        let moved = with_tvq_caches(CubeClRuntimeConfig::default(), Some(home.clone()));
        assert_eq!(moved.autotune.cache.root(), home.join("tvq"));
        let compiled = home.join("tvq").join(COMPILED_KERNELS_FOLDER);
        assert_eq!(root(&moved.compilation.cache), Some(compiled));

        let mut chosen = CubeClRuntimeConfig::default();
        chosen.autotune.cache = CacheConfig::File("/mine/a".into());
        chosen.compilation.cache = Some(CacheConfig::File("/mine/k".into()));
        let kept = with_tvq_caches(chosen, Some(home));
        assert_eq!(
            kept.autotune.cache.root(),
            std::path::PathBuf::from("/mine/a")
        );
        assert_eq!(root(&kept.compilation.cache), Some("/mine/k".into()));

        let homeless = with_tvq_caches(CubeClRuntimeConfig::default(), None);
        assert!(homeless.compilation.cache.is_none());
    }

    #[test]
    fn fusion_searches_one_block_unless_chosen() {
        use burn_std::config::BurnConfig;
        let ours = with_tvq_fusion(BurnConfig::default());
        assert_eq!(ours.fusion.beam_search.max_blocks, FUSION_BLOCKS);
        assert_ne!(
            FUSION_BLOCKS,
            BurnConfig::default().fusion.beam_search.max_blocks
        );
        let mut chosen = BurnConfig::default();
        chosen.fusion.beam_search.max_blocks = 3;
        let kept = with_tvq_fusion(chosen);
        assert_eq!(kept.fusion.beam_search.max_blocks, 3);
    }

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
        match DeviceSpec::Cuda(n).init() {
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

    /// The model computes on the GPU under test (wgpu, or CUDA with
    /// `TVQ_TEST_DEVICE=cuda`) what it computes on the CPU: the same codes,
    /// and logits and gradients within 1e-4, for both position terms.
    #[test]
    fn the_model_computes_on_the_gpu_what_it_computes_on_the_cpu() {
        let Some(gpu) = crate::gpu_under_test::gpu_under_test(
            "the_model_computes_on_the_gpu_what_it_computes_on_the_cpu",
        ) else {
            return;
        };
        let cpu_ad = DispatchDevice::autodiff(cpu());
        let gpu_ad = DispatchDevice::autodiff(gpu);
        let recorder = BinBytesRecorder::<FullPrecisionSettings>::default();
        let floats = |t: TensorData| t.convert::<f32>().to_vec::<f32>().unwrap();
        for bias in [RelativeBias::Toeplitz, RelativeBias::Xl] {
            let cfg = tvq_testkit::tiny_model(29).with_bias(bias);
            let on_cpu =
                crate::placement::seeded_draw::<B, _>(&cpu(), Some(5), || cfg.init::<B>(&cpu_ad))
                    .unwrap();
            let bytes = recorder.record(on_cpu.clone().into_record(), ()).unwrap();
            let on_gpu =
                crate::placement::seeded_draw::<B, _>(&gpu_ad, None, || cfg.init::<B>(&gpu_ad))
                    .unwrap()
                    .load_record(recorder.load(bytes, &gpu_ad).unwrap());

            let data: Vec<i64> = (0..2 * 16).map(|i| (i * 7 % 29) as i64).collect();
            let run = |m: &tvq_model::TransformerVq<B>, device: &DispatchDevice| {
                let tokens =
                    Tensor::<B, 2, Int>::from_data(TensorData::new(data.clone(), [2, 16]), device);
                let out = m.forward(tokens, m.empty_state(), Pass::new()).unwrap();
                let logits = out.logits.unwrap();
                let loss = logits.clone().square().mean() + out.commitment.mean();
                let grads = loss.backward();
                let g = m.sublayers[0].kvg_proj.weight.grad(&grads).unwrap();
                let codes = out.codes[0].clone().into_data().convert::<i64>();
                (
                    floats(logits.inner().into_data()),
                    floats(g.into_data()),
                    codes.to_vec::<i64>().unwrap(),
                )
            };
            let (l_cpu, g_cpu, z_cpu) = run(&on_cpu, &cpu_ad);
            let (l_gpu, g_gpu, z_gpu) = run(&on_gpu, &gpu_ad);
            assert_eq!(z_cpu, z_gpu, "{bias:?}: codes");
            let worst = tvq_testkit::max_abs_diff;
            let (dl, dg) = (worst(&l_cpu, &l_gpu), worst(&g_cpu, &g_gpu));
            assert!(dl <= 1e-4, "{bias:?}: logits differ by {dl}");
            assert!(dg <= 1e-4, "{bias:?}: gradients differ by {dg}");
        }
    }

    /// The GPU memory of a run grows by at least a tensor's bytes when a
    /// thread whose stream is counted puts a 64 MiB tensor on the GPU under
    /// test, and not when no counted stream holds it; a CPU has none to
    /// report.
    #[test]
    fn device_memory_counts_a_tensor_put_on_the_gpu() {
        assert_eq!(device_memory_bytes(&[cpu()], &[]), None);
        let Some(gpu) =
            crate::gpu_under_test::gpu_under_test("device_memory_counts_a_tensor_put_on_the_gpu")
        else {
            return;
        };
        let devices = [cpu(), gpu.clone()];
        let mine = [StreamId::current()];
        let other = std::thread::spawn(StreamId::current).join().unwrap();
        let both = [mine[0], other];
        let held = |streams: &[StreamId]| device_memory_bytes(&devices, streams).unwrap();
        let (before, before_mine) = (held(&both), held(&mine));
        let n = 16 << 20; // f32s: 64 MiB
        let tensor =
            other.executes(|| Tensor::<B, 1>::from_data(TensorData::new(vec![1f32; n], [n]), &gpu));
        let (after, after_mine) = (held(&both), held(&mine));
        assert!(
            after >= before + 4 * n as u64,
            "{before} bytes, then {after} with a {} byte tensor",
            4 * n
        );
        if !matches!(gpu, DispatchDevice::Cuda(_)) {
            // wgpu counts the pools of the streams it is given, no others.
            assert_eq!(after_mine, before_mine);
        }
        drop(tensor);
    }

    /// `auto` is f32 on the CPU and on wgpu (with or without autodiff), a
    /// named type is itself everywhere.
    #[test]
    fn auto_precision_is_f32_off_cuda() {
        let wgpu = DispatchDevice::Wgpu(WgpuDevice::DefaultDevice);
        for device in [cpu(), wgpu] {
            let autodiff = DispatchDevice::autodiff(device.clone());
            for d in [&device, &autodiff] {
                assert_eq!(precision_on(d, PrecisionSetting::Auto), Precision::F32);
            }
        }
        let bf16 = PrecisionSetting::Fixed(Precision::Bf16);
        assert_eq!(precision_on(&cpu(), bf16), Precision::Bf16);
    }

    /// bf16 on wgpu is refused with one line before any adapter is touched;
    /// the CPU computes in every precision.
    #[test]
    fn precisions_a_device_cannot_run_are_refused() {
        let wgpu = DispatchDevice::Wgpu(WgpuDevice::DefaultDevice);
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

    /// A device and precision is probed once a process: asked again (with
    /// or without autodiff) the answer is remembered.
    #[test]
    fn a_precision_is_probed_once_per_device() {
        let device = cpu();
        for d in [&device, &device, &DispatchDevice::autodiff(device.clone())] {
            assert_eq!(check_precision(d, Precision::F16), Ok(()));
        }
        let checked = CHECKED.lock().unwrap();
        let probed = checked
            .iter()
            .filter(|(d, p, _)| *d == device && *p == Precision::F16);
        assert_eq!(probed.count(), 1, "asked three times, probed once");
    }
}
