//! `tvq`: train, evaluate and benchmark Transformer-VQ language models.

mod bench;

use anyhow::Result;
use clap::{Parser, Subcommand};
use tvq_model::device::DeviceSpec;

/// Transformer-VQ: linear-time attention through vector-quantized keys.
///
/// Models run on the CPU, or on a GPU through wgpu or CUDA, chosen with
/// --device at run time.
#[derive(Parser, Debug)]
#[command(name = "tvq", version, about, long_about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Measure forward+backward throughput of the GAU stack, VQ attention
    /// against the quadratic baseline, over several sequence lengths.
    Bench(bench::BenchArgs),
}

/// Parses `--device` values (`cpu`, `wgpu`, `wgpu:N`, `cuda`, `cuda:N`).
pub fn parse_device(s: &str) -> Result<DeviceSpec, String> {
    s.parse::<DeviceSpec>().map_err(|e| e.to_string())
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Bench(args) => bench::run(args),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
