//! `tvq train`: a run from a config, resumed where it stopped.

use std::path::PathBuf;

use crate::args::Devices;
use anyhow::Result;
use clap::Args;
use tvq_train::parallel::collective::ClusterSpec;
use tvq_train::{RunConfig, TrainOptions, train};

/// Options of `tvq train`.
#[derive(Args, Debug)]
pub struct TrainArgs {
    /// The run's TOML config (sections [model], [data], [train], [eval]).
    #[arg(long)]
    config: PathBuf,
    #[command(flatten)]
    devices: Devices,
    /// Run directory for the config, metrics and checkpoints [default: runs/<config name>].
    #[arg(long)]
    run_dir: Option<PathBuf>,
    /// Continue from the run directory's latest valid checkpoint.
    #[arg(long)]
    resume: bool,
    /// Use a run directory that holds another run or files tvq did not
    /// write (deletes its checkpoints unless resuming); also train when the
    /// memory estimate exceeds the memory free.
    #[arg(long)]
    force: bool,
    /// Override a config value, e.g. --set train.lr=3e-4 (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    overrides: Vec<String>,
    /// Stop after this many steps in total (the schedule still follows train.steps).
    #[arg(long)]
    max_steps: Option<u64>,
    /// No progress bars (logs only).
    #[arg(long)]
    quiet: bool,
    /// Peak TFLOP/s of one device, for the model FLOPs utilisation (mfu)
    /// in the logs [default: measured on the CPU; a table of known GPUs].
    #[arg(long, value_name = "TFLOPS", value_parser = crate::args::positive)]
    peak_tflops: Option<f64>,
    /// Number of processes (nodes: one per machine, or several on one)
    /// that train this one model together, each on its share of every batch.
    #[arg(
        long,
        default_value_t = 1,
        help_heading = "Several processes or machines"
    )]
    nodes: usize,
    /// This process's rank, 0..nodes. Node 0 hosts the coordinator and alone
    /// writes the run directory (config, metrics, checkpoints).
    #[arg(
        long,
        default_value_t = 0,
        help_heading = "Several processes or machines"
    )]
    node_rank: usize,
    /// HOST:PORT of the coordinator, on node 0's machine; the same on every
    /// node (it uses PORT and PORT+1).
    #[arg(
        long,
        default_value = "127.0.0.1:29500",
        help_heading = "Several processes or machines"
    )]
    coordinator: String,
    /// Host name or IP under which the other nodes reach this one
    /// [default: this machine's address on the route to the coordinator].
    #[arg(long, help_heading = "Several processes or machines")]
    node_host: Option<String>,
    /// First of the two ports of this node's tensor service
    /// [default: coordinator port + 2 + 2 x rank].
    #[arg(long, help_heading = "Several processes or machines")]
    data_port: Option<u16>,
    /// Seconds a node waits for the others (to join, at each step) before
    /// it stops with an error naming them.
    #[arg(
        long,
        default_value_t = 120.0,
        help_heading = "Several processes or machines"
    )]
    peer_timeout: f64,
    /// Resume from a checkpoint written with another number of shards
    /// (nodes x workers x micro-batches): the carried states start afresh.
    #[arg(long)]
    reshard: bool,
    /// Write a Chrome/Perfetto trace of every step's phases (data,
    /// forward, backward, recomputation, all-reduce, optimizer, EMA,
    /// checkpoint, evaluation) on each thread to FILE (open it in
    /// ui.perfetto.dev or chrome://tracing).
    #[arg(long, value_name = "FILE")]
    pub trace: Option<PathBuf>,
}

impl TrainArgs {
    /// The cluster flags as a spec (`None` for a run in one process).
    fn cluster(&self) -> Result<Option<ClusterSpec>> {
        if self.nodes <= 1 {
            anyhow::ensure!(
                self.node_rank == 0,
                "--node-rank {} needs --nodes greater than {}",
                self.node_rank,
                self.node_rank
            );
            return Ok(None);
        }
        anyhow::ensure!(
            self.peer_timeout.is_finite() && self.peer_timeout > 0.0,
            "--peer-timeout must be a positive number of seconds"
        );
        Ok(Some(ClusterSpec {
            nodes: self.nodes,
            rank: self.node_rank,
            coordinator: self.coordinator.clone(),
            host: self.node_host.clone(),
            data_port: self.data_port,
            timeout: std::time::Duration::from_secs_f64(self.peer_timeout),
        }))
    }
}

/// Runs `tvq train`.
pub fn run(args: TrainArgs) -> Result<()> {
    let cfg = RunConfig::load(&args.config, &args.overrides)?;
    let cluster = args.cluster()?;
    let devices = args.devices.init()?;
    let run_dir = args.run_dir.clone().unwrap_or_else(|| {
        let stem = args
            .config
            .file_stem()
            .map_or("run".into(), |s| s.to_string_lossy().into_owned());
        PathBuf::from("runs").join(stem)
    });
    let interrupt = crate::interrupt::install()?;
    let opts = TrainOptions {
        run_dir: run_dir.clone(),
        resume: args.resume,
        force: args.force,
        max_steps: args.max_steps,
        interrupt,
        progress: !args.quiet,
        cluster,
        reshard: args.reshard,
        peak_tflops: args.peak_tflops,
    };
    tracing::info!("run directory: {}", run_dir.display());
    let summary = {
        let _silenced = opts.cluster.is_some().then(SilencedStdout::new);
        train(&cfg, &devices, &opts)?
    };
    println!("checkpoint: {}", summary.checkpoint.display());
    match summary.validation {
        Some(v) if v.recall.is_some() => {
            println!("step {}: validation {}", summary.step, v.summary())
        }
        Some(v) => println!(
            "step {}: validation loss {:.4} nats/token, {:.4} bits/byte over {} tokens",
            summary.step, v.loss, v.bits_per_byte, v.tokens
        ),
        None if summary.interrupted => {
            println!("stopped at step {}; continue with --resume", summary.step)
        }
        None => println!(
            "step {}: done (node {}; node 0 reports the validation)",
            summary.step, args.node_rank
        ),
    }
    Ok(())
}

/// Sends the standard output to /dev/null while it lives: burn-collective
/// prints a line to it on every connection, which in a run over several
/// nodes is every step. Logs and progress bars go to the standard error.
struct SilencedStdout {
    #[cfg(unix)]
    saved: Option<std::os::fd::OwnedFd>,
}

impl SilencedStdout {
    fn new() -> Self {
        use std::io::Write;
        let _ = std::io::stdout().flush();
        #[cfg(unix)]
        {
            use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
            let Ok(null) = std::fs::OpenOptions::new().write(true).open("/dev/null") else {
                return Self { saved: None };
            };
            // SAFETY: plain descriptor calls on descriptors this process
            // owns; `dup` gives a fresh descriptor that `saved` then owns.
            let saved = unsafe {
                let saved = libc::dup(1);
                if saved < 0 || libc::dup2(null.as_raw_fd(), 1) < 0 {
                    return Self { saved: None };
                }
                OwnedFd::from_raw_fd(saved)
            };
            Self { saved: Some(saved) }
        }
        #[cfg(not(unix))]
        Self {}
    }
}

impl Drop for SilencedStdout {
    fn drop(&mut self) {
        use std::io::Write;
        let _ = std::io::stdout().flush();
        #[cfg(unix)]
        if let Some(saved) = &self.saved {
            use std::os::fd::AsRawFd;
            // SAFETY: restores the descriptor saved in `new`.
            unsafe { libc::dup2(saved.as_raw_fd(), 1) };
        }
    }
}
