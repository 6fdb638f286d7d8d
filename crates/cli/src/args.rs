//! What several subcommands share: the argument parsers, the `--device`
//! list, the cache limit flags and `--kernels`.

use anyhow::Result;
use burn::DispatchDevice;
use clap::{Args, ValueEnum};
use tvq_model::kernel::Kernels;
use tvq_train::placement::Model;
use tvq_train::placement::device::DeviceSpec;

/// Parses `--device` values (`cpu`, `wgpu`, `wgpu:N`, `cuda`, `cuda:N`).
pub fn parse_device(s: &str) -> Result<DeviceSpec, String> {
    s.parse::<DeviceSpec>().map_err(|e| e.to_string())
}

/// A positive number (e.g. `--peak-tflops`).
pub fn positive(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(x) if x.is_finite() && x > 0.0 => Ok(x),
        _ => Err(format!("`{s}` is not a positive number")),
    }
}

/// A count flag's parser: a whole number no smaller than `min`, so that
/// `--steps 0` is a usage error rather than an empty or failed run.
pub fn at_least(min: u64) -> clap::builder::RangedU64ValueParser<usize> {
    clap::builder::RangedU64ValueParser::new().range(min..)
}

pub fn init_device(spec: DeviceSpec) -> Result<DispatchDevice> {
    let (device, info) = spec.init()?;
    tracing::info!("device: {info}");
    if spec != DeviceSpec::Cpu && tvq_model::device::GPU_FUSION {
        tracing::info!(
            "kernels are autotuned for each new shape on first use (slow first steps), \
             and the results kept for later runs"
        );
    }
    Ok(device)
}

/// The `--device` list of `tvq train` and `tvq eval`.
#[derive(Args, Debug)]
pub struct Devices {
    /// Device: cpu, wgpu, wgpu:N, cuda or cuda:N; a list (cuda:0,cuda:1)
    /// runs on several devices of one kind, the worker threads spread over
    /// them.
    #[arg(
        long,
        default_value = "cpu",
        value_delimiter = ',',
        value_parser = parse_device
    )]
    pub device: Vec<DeviceSpec>,
}

impl Devices {
    /// Each listed device, initialised.
    pub fn init(&self) -> Result<Vec<DispatchDevice>> {
        self.device.iter().map(|&spec| init_device(spec)).collect()
    }
}

#[derive(Args, Debug)]
pub struct CacheLimits {
    /// Weigh at most N keys of each compressed cache, whatever the model
    /// was trained with (model.cache_limit; 0: no limit): for streams far
    /// longer than the training sequences, give the most keys a training
    /// sequence cached (docs/learning.md).
    #[arg(long, value_name = "N")]
    cache_limit: Option<usize>,
    /// Weigh each code of the compressed cache as at most N keys, whatever
    /// the model was trained with (model.code_limit; 0: no limit): 1 keeps
    /// recall learned on short examples at far longer ones
    /// (docs/learning.md, "The cache's counts").
    #[arg(long, value_name = "N")]
    code_limit: Option<usize>,
}

/// `--kernels`: how inference computes each sublayer's attention and
/// quantizer.
#[derive(Args, Debug)]
pub struct KernelChoice {
    /// fused: as one kernel each where the device's kernels are reachable
    /// (the CPU; GPUs compose for now); composed: as tensor ops, the oracle
    /// the kernels are tested against.
    #[arg(long, value_enum, default_value = "fused")]
    kernels: KernelsArg,
}

/// The values of `--kernels`.
#[derive(Clone, Copy, Debug, ValueEnum)]
enum KernelsArg {
    Fused,
    Composed,
}

impl KernelChoice {
    /// Sets the choice on every sublayer of `model`.
    pub fn apply(&self, model: &mut Model) {
        model.set_kernels(match self.kernels {
            KernelsArg::Fused => Kernels::Fused,
            KernelsArg::Composed => Kernels::Composed,
        });
    }
}

impl CacheLimits {
    /// Sets the flags' limits on `model`, where given (0: no limit).
    pub fn apply(&self, model: &mut Model) {
        if let Some(n) = self.cache_limit {
            model.set_cache_limit((n > 0).then_some(n));
        }
        if let Some(n) = self.code_limit {
            model.set_code_limit((n > 0).then_some(n));
        }
    }
}
