//! `tvq plot`: a run's curves as a PNG.

use std::path::{Path, PathBuf};

use anyhow::{Result, bail};
use clap::Args;

/// Options of `tvq plot`.
#[derive(Args, Debug)]
pub struct PlotArgs {
    /// Run directory holding metrics.jsonl (training may still be going on);
    /// repeat it to compare several runs on one chart.
    #[arg(long, required = true)]
    run_dir: Vec<PathBuf>,
    /// PNG to write [default, for one run: RUN_DIR/loss.png].
    #[arg(long)]
    out: Option<PathBuf>,
}

/// Runs `tvq plot`.
pub fn run(args: PlotArgs) -> Result<()> {
    let out = match (args.out, args.run_dir.as_slice()) {
        (out, [one]) => {
            let out = out.unwrap_or_else(|| one.join("loss.png"));
            tvq_train::run::plot::plot_run(one, &out)?;
            out
        }
        (Some(out), several) => {
            let dirs: Vec<&Path> = several.iter().map(PathBuf::as_path).collect();
            tvq_train::run::plot::plot_runs(&dirs, &out)?;
            out
        }
        (None, _) => bail!("--out is needed to compare several runs (where should the chart go?)"),
    };
    println!("wrote {}", out.display());
    Ok(())
}
