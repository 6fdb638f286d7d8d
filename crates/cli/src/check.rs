//! `tvq check`: the device self-test, printed as a table.

use anyhow::{Result, bail};
use clap::Args;
use tvq_train::check::{CheckReport, check_device};
use tvq_train::placement::device::DeviceSpec;

/// Options of `tvq check`.
#[derive(Args, Debug)]
pub struct CheckArgs {
    /// The device to check against the CPU: cpu, wgpu, wgpu:N, cuda or cuda:N.
    #[arg(long, default_value = "cpu", value_parser = crate::args::parse_device)]
    device: DeviceSpec,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
}

/// Runs the checks, prints the table (or JSON) and fails if any check failed.
pub fn run(args: CheckArgs) -> Result<()> {
    let (device, info) = args.device.init()?;
    let report = check_device(&device, &std::env::temp_dir())?;
    if args.json {
        let mut value = serde_json::to_value(&report)?;
        value["passed"] = report.passed().into();
        value["device_info"] = info.clone().into();
        println!("{value}");
    } else {
        print_table(&report, &info);
    }
    let failed = report.checks.iter().filter(|c| !c.passed()).count();
    if failed > 0 {
        bail!(
            "{failed} of {} checks failed on {info}",
            report.checks.len()
        );
    }
    Ok(())
}

/// The report as a Markdown table, then the peaks and the verdict.
fn print_table(report: &CheckReport, info: &str) {
    println!("tvq check: {info} against the CPU\n");
    println!("| check | largest relative difference | tolerance | verdict |");
    println!("|---|---|---|---|");
    for c in &report.checks {
        let worst = match (c.worst, &c.skipped) {
            (Some(w), _) => number(w),
            (None, Some(why)) => why.clone(),
            (None, None) => "-".into(),
        };
        println!(
            "| {} | {worst} | {} | {} |",
            c.name,
            number(c.tolerance),
            c.verdict()
        );
    }
    println!();
    for p in &report.peaks {
        match p.flops_per_s {
            Some(f) => println!(
                "{} matrix products (1024 x 1024): {:.1} GFLOP/s",
                p.precision,
                f / 1e9
            ),
            None => println!("{} matrix products: not supported here", p.precision),
        }
    }
    let passed = report.checks.iter().filter(|c| c.passed()).count();
    println!(
        "\n{passed} of {} checks passed{}",
        report.checks.len(),
        if report.passed() {
            ""
        } else {
            " (see FAIL above)"
        }
    );
}

/// `0` for zero, else two significant digits in scientific notation.
fn number(x: f64) -> String {
    if x == 0.0 {
        "0".into()
    } else {
        format!("{x:.1e}")
    }
}
