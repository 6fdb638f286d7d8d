//! `--profile` of `tvq bench step` and `tvq bench attention` on wgpu and
//! CUDA: where the timed steps' device time goes, by kernel. cubecl times
//! every launch (each then waits for the one before it, so a profiled step
//! runs slower than a plain one; the shares are what the profile is for)
//! and logs `| <duration> | <name>` per launch; the lines of the timed
//! steps are summed by kernel name, its generic parameters dropped.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::json;
use tvq_train::placement::device::{DeviceSpec, profile_kernels};

/// Launches and time of one kind of kernel.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct KernelTime {
    /// The kernel's name without its generic parameters.
    pub kernel: String,
    /// How many times it was launched.
    pub launches: u64,
    /// Its total time, in seconds.
    pub seconds: f64,
}

/// cubecl's log of the process's launches, removed when dropped.
pub(super) struct KernelLog {
    path: PathBuf,
}

impl KernelLog {
    /// Has cubecl log every launch on `device` (wgpu or CUDA): before the
    /// device is first used.
    pub(super) fn start(device: DeviceSpec) -> Result<Self> {
        if device == DeviceSpec::Cpu {
            bail!("--profile times GPU kernels: use --device wgpu or cuda");
        }
        let path = std::env::temp_dir().join(format!("tvq-kernels-{}.log", std::process::id()));
        profile_kernels(&path)?;
        Ok(Self { path })
    }

    /// The log's length once cubecl has written every launch made so far
    /// (its logger writes from a thread of its own: the length stops
    /// changing).
    pub(super) fn settled(&self) -> u64 {
        let len = || std::fs::metadata(&self.path).map_or(0, |m| m.len());
        let (start, mut last, mut quiet) = (Instant::now(), len(), 0);
        while quiet < 4 && start.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(50));
            let now = len();
            quiet = if now == last { quiet + 1 } else { 0 };
            last = now;
        }
        last
    }

    /// The launches logged since the log was `from` bytes long, by kernel.
    pub(super) fn since(&self, from: u64) -> Result<Vec<KernelTime>> {
        let end = self.settled();
        let bytes = read_range(&self.path, from, end)
            .with_context(|| format!("reading cubecl's log {}", self.path.display()))?;
        Ok(by_kernel(&String::from_utf8_lossy(&bytes)))
    }
}

impl Drop for KernelLog {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Bytes `from..end` of `path`.
fn read_range(path: &Path, from: u64, end: u64) -> std::io::Result<Vec<u8>> {
    use std::io::{Read, Seek, SeekFrom};
    let mut file = std::fs::File::open(path)?;
    file.seek(SeekFrom::Start(from))?;
    let mut bytes = vec![];
    file.take(end.saturating_sub(from))
        .read_to_end(&mut bytes)?;
    Ok(bytes)
}

/// A `Duration`'s `Debug` text (`1.5s`, `12.25ms`, `3.1µs`, `800ns`) in
/// seconds.
fn seconds(text: &str) -> Option<f64> {
    let text = text.trim();
    let split = text.find(|c: char| !(c.is_ascii_digit() || c == '.'))?;
    let (value, unit) = text.split_at(split);
    let scale = match unit {
        "s" => 1.0,
        "ms" => 1e-3,
        "µs" | "us" => 1e-6,
        "ns" => 1e-9,
        _ => return None,
    };
    Some(value.parse::<f64>().ok()? * scale)
}

/// The profiled launches of a log's `text` (`| <duration> | <name>` lines;
/// any other line is not a launch), summed by kernel name without its
/// generic parameters, the most time first.
pub(super) fn by_kernel(text: &str) -> Vec<KernelTime> {
    let mut rows: Vec<KernelTime> = vec![];
    for line in text.lines() {
        let mut fields = line.strip_prefix('|').unwrap_or("").splitn(2, '|');
        let (Some(duration), Some(name)) = (fields.next(), fields.next()) else {
            continue;
        };
        let Some(secs) = seconds(duration) else {
            continue;
        };
        let kernel = name.split('<').next().unwrap_or("").trim();
        let kernel = if kernel.is_empty() {
            "(unnamed)"
        } else {
            kernel
        };
        match rows.iter_mut().find(|r| r.kernel == kernel) {
            Some(row) => {
                row.launches += 1;
                row.seconds += secs;
            }
            None => rows.push(KernelTime {
                kernel: kernel.to_string(),
                launches: 1,
                seconds: secs,
            }),
        }
    }
    rows.sort_by(|a, b| b.seconds.total_cmp(&a.seconds));
    rows
}

/// A kernel's name for the table: cubecl lists a kernel's type parameters
/// after ` | `; those that say nothing about the kernel (sizes and scalars
/// of a generic signature, `()`, the runtime) are dropped and the rest cut
/// to 60 characters. The JSON keeps the whole name.
fn short(kernel: &str) -> String {
    let kept: Vec<&str> = kernel
        .split(" | ")
        .filter(|part| {
            !(part.starts_with("__")
                || part.starts_with("Dynamic")
                || part.ends_with("Runtime")
                || matches!(*part, "()" | "Option" | "TensorArgs"))
        })
        .collect();
    let name = kept.join(" ");
    if name.chars().count() <= 60 {
        return name;
    }
    format!("{}…", name.chars().take(59).collect::<String>())
}

/// Prints the profile of `steps` timed steps at segment length `t`: a
/// table, or one JSON object per kernel (`"form": "profile"`).
pub(super) fn print(rows: &[KernelTime], steps: usize, t: usize, json: bool) {
    let total: f64 = rows.iter().map(|r| r.seconds).sum();
    let launches: u64 = rows.iter().map(|r| r.launches).sum();
    let share = |s: f64| if total > 0.0 { s / total } else { 0.0 };
    if json {
        for r in rows {
            println!(
                "{}",
                json!({
                    "form": "profile", "seq_len": t, "steps": steps, "kernel": r.kernel,
                    "launches": r.launches, "launches_per_step": r.launches as f64 / steps as f64,
                    "seconds": r.seconds, "share": share(r.seconds),
                })
            );
        }
        return;
    }
    println!(
        "  profile of {steps} step(s) at T = {t}: {launches} launches ({:.0} per step), {:.3} s of kernels",
        launches as f64 / steps as f64,
        total
    );
    println!(
        "  {:<60} {:>9} {:>11} {:>7}",
        "kernel", "launches", "time ms", "share"
    );
    for r in rows {
        println!(
            "  {:<60} {:>9} {:>11.3} {:>6.1}%",
            short(&r.kernel),
            r.launches,
            r.seconds * 1e3,
            100.0 * share(r.seconds)
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_in_every_unit() {
        for (text, want) in [
            ("1.5s", 1.5),
            (" 12.25ms   ", 0.012_25),
            ("4µs", 4e-6),
            ("800ns", 8e-7),
        ] {
            let got = seconds(text).unwrap();
            assert!((got - want).abs() <= 1e-12 * want, "{text}: {got}");
        }
        assert_eq!(seconds("12 parsecs"), None);
        assert_eq!(seconds("ms"), None);
    }

    #[test]
    fn launches_are_summed_by_kernel_without_generics() {
        let log = "\
| 2ms        | matmul_entry<f32, Tile<16>>
| 1ms        | elemwise<f32>
Executing something else
| 3ms        | matmul_entry<bf16>
| junk | nothing
";
        let rows = by_kernel(log);
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0].kernel, "matmul_entry");
        assert_eq!(rows[0].launches, 2);
        assert!((rows[0].seconds - 5e-3).abs() < 1e-12);
        assert_eq!(rows[1].kernel, "elemwise");
        assert_eq!(rows[1].launches, 1);
    }

    #[test]
    fn table_names_keep_what_tells_kernels_apart() {
        assert_eq!(
            short("KernelBinop | MulOp | WgpuRuntime"),
            "KernelBinop MulOp"
        );
        let matmul = "MatmulEntry | TensorArgs | DynamicScalar | __Lhs | DynamicSize | \
                      SimpleMatmulFamily | UnitMatmulFamily | () | SyncFullCyclicLoading | \
                      ColMajorTilingOrder | RowMajorGlobalPartitionMatmul | CudaRuntime";
        let shown = short(matmul);
        assert!(
            shown.starts_with("MatmulEntry SimpleMatmulFamily UnitMatmulFamily"),
            "{shown}"
        );
        assert_eq!(shown.chars().count(), 60, "{shown}");
        assert!(shown.ends_with('…'), "{shown}");
    }
}
