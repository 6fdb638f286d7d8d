//! `metrics.jsonl`: one JSON line per training step and per evaluation.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

use tvq_model::Precision;

use crate::config::ActivationCheckpointing;
use crate::error::TrainError;
use crate::evaluate::EvalReport;
use crate::fault::{self, Point};

/// One line of `metrics.jsonl` per optimizer step.
#[derive(Clone, Debug, Serialize)]
pub struct StepMetrics {
    /// `"train"`.
    pub kind: &'static str,
    /// Optimizer step (1-based).
    pub step: u64,
    /// Learning rate used.
    pub lr: f64,
    /// Cross-entropy + commit_weight * commitment (what was minimised).
    pub loss: f64,
    /// Cross-entropy, nats per token.
    pub ce: f64,
    /// Cross-entropy, bits per token.
    pub bits_per_token: f64,
    /// Cross-entropy, bits per byte of text.
    pub bits_per_byte: f64,
    /// Commitment loss (summed over sublayers).
    pub commitment: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Fraction of codes used this step (mean over sublayers).
    pub codebook_usage: f64,
    /// Perplexity of the code distribution (mean over sublayers).
    pub code_perplexity: f64,
    /// Relative quantization error |k - k_hat| / |k| (mean over sublayers).
    pub quantization_error: f64,
    /// Training tokens per second over this step.
    pub tokens_per_s: f64,
    /// Model FLOPs utilisation over this step: the model's FLOPs per
    /// training token ([`crate::mfu`]) times `tokens_per_s`, over the peak
    /// of every device of the run (absent where the peak is unknown).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mfu: Option<f64>,
    /// Type of the sublayers' matrix products (`train.precision`).
    pub precision: Precision,
    /// What the backward pass recomputed (`train.activation_checkpointing`).
    pub activation_checkpointing: ActivationCheckpointing,
    /// The loss scale this step's objective was multiplied by (`f16` only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub loss_scale: Option<f64>,
    /// The gradients overflowed under loss scaling: weights and codebooks
    /// were left as they were (written only when true).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub skipped: bool,
    /// Training tokens so far.
    pub tokens: u64,
    /// The most host memory (resident set) the process has held so far, in
    /// bytes (absent where the system does not say: Linux only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peak_rss_bytes: Option<u64>,
    /// The run was asked to stop (on any node) and stops after this step.
    #[serde(skip)]
    pub stop: bool,
}

impl StepMetrics {
    /// A short line for the progress bar.
    pub fn summary(&self) -> String {
        let mfu = self
            .mfu
            .map_or(String::new(), |m| format!(" mfu {:.0}%", 100.0 * m));
        let rss = self.peak_rss_bytes.map_or(String::new(), |b| {
            format!(" rss {:.2} GiB", b as f64 / (1u64 << 30) as f64)
        });
        format!(
            "loss {:.3} bpb {:.3} {:.0} tok/s{mfu}{rss}",
            self.loss, self.bits_per_byte, self.tokens_per_s
        )
    }
}

/// The peak resident set size of this process in bytes (`VmHWM` of
/// `/proc/self/status`; `None` where there is no such file).
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
}

/// One line of `metrics.jsonl` per evaluation.
#[derive(Serialize)]
pub struct EvalLine<'a> {
    /// `"eval"` (periodic, part of the split) or `"final_eval"` (whole split).
    pub kind: &'static str,
    /// The step evaluated after.
    pub step: u64,
    /// The results.
    #[serde(flatten)]
    pub report: &'a EvalReport,
}

impl<'a> EvalLine<'a> {
    /// The line of `report`, evaluated after `step`.
    pub fn new(kind: &'static str, step: u64, report: &'a EvalReport) -> Self {
        Self { kind, step, report }
    }
}

/// The metrics log of a run directory, opened for appending.
pub struct MetricsLog {
    file: File,
    path: PathBuf,
}

impl MetricsLog {
    /// Opens `run_dir/metrics.jsonl`, keeping only the lines up to `step`
    /// (a resumed run writes the rest again, exactly) and dropping a torn
    /// last line. With `redo_final`, a `final_eval` line at `step` goes too:
    /// the resumed run ends at `step` and writes it again. The kept lines
    /// replace the file atomically, so a kill while opening loses nothing.
    pub fn open(run_dir: &Path, step: u64, redo_final: bool) -> Result<Self, TrainError> {
        let path = run_dir.join("metrics.jsonl");
        if let Ok(text) = std::fs::read_to_string(&path) {
            let kept: String = text
                .lines()
                .filter(|l| {
                    serde_json::from_str::<serde_json::Value>(l).is_ok_and(|v| {
                        let s = v["step"].as_u64();
                        s.is_some_and(|s| s <= step)
                            && !(redo_final && v["kind"] == "final_eval" && s == Some(step))
                    })
                })
                .map(|l| format!("{l}\n"))
                .collect();
            if kept != text {
                let tmp = run_dir.join(".metrics.jsonl.tmp");
                std::fs::write(&tmp, kept)
                    .and_then(|()| std::fs::File::open(&tmp)?.sync_all())
                    .and_then(|()| std::fs::rename(&tmp, &path))
                    .map_err(|e| TrainError::io(&path, e))?;
            }
        }
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(|e| TrainError::io(&path, e))?;
        Ok(Self { file, path })
    }

    /// Appends one JSON line and flushes it.
    pub fn append(&mut self, value: &impl Serialize) -> Result<(), TrainError> {
        // One write of the whole line: appended at once, never interleaved.
        let line = serde_json::to_string(value).expect("metrics serialize") + "\n";
        fault::inject(Point::MetricsAppend)
            .and_then(|()| self.file.write_all(line.as_bytes()))
            .and_then(|()| self.file.flush())
            .map_err(|e| TrainError::io(&self.path, e))
    }
}

/// A progress bar of `len` units drawn with indicatif's `template` (which
/// places `{bar:30}`), or a hidden one when `show` is false.
pub(crate) fn progress_bar(show: bool, len: u64, template: &str) -> ProgressBar {
    let bar = if show {
        ProgressBar::new(len)
    } else {
        ProgressBar::hidden()
    };
    bar.set_style(
        ProgressStyle::with_template(template)
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar
}

#[cfg(test)]
mod tests {
    use super::MetricsLog;

    #[test]
    fn reopening_keeps_the_lines_up_to_the_resumed_step_and_drops_a_torn_one() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metrics.jsonl");
        let mut log = MetricsLog::open(dir.path(), 0, false).unwrap();
        for step in 1..=5u64 {
            log.append(&serde_json::json!({"kind": "train", "step": step}))
                .unwrap();
        }
        log.append(&serde_json::json!({"kind": "final_eval", "step": 5}))
            .unwrap();
        drop(log);
        let steps = || -> Vec<(String, u64)> {
            std::fs::read_to_string(&path)
                .unwrap()
                .lines()
                .map(|l| {
                    let v: serde_json::Value = serde_json::from_str(l).unwrap();
                    (
                        v["kind"].as_str().unwrap().into(),
                        v["step"].as_u64().unwrap(),
                    )
                })
                .collect()
        };
        // Resumed at the last step: the final evaluation is done again.
        drop(MetricsLog::open(dir.path(), 5, true).unwrap());
        assert_eq!(steps().len(), 5);
        // A kill in the middle of an append tore the last line.
        let mut text = std::fs::read_to_string(&path).unwrap();
        text += r#"{"kind":"train","st"#;
        std::fs::write(&path, text).unwrap();
        let mut log = MetricsLog::open(dir.path(), 3, false).unwrap();
        log.append(&serde_json::json!({"kind": "train", "step": 4}))
            .unwrap();
        let train = |s: u64| ("train".to_string(), s);
        assert_eq!(steps(), [train(1), train(2), train(3), train(4)]);
        assert!(!dir.path().join(".metrics.jsonl.tmp").exists());
    }
}
