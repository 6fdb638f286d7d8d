//! What a run logs: `metrics.jsonl`, one JSON line per training step and
//! per evaluation; `samples.jsonl`, the samples drawn while training; the
//! same in TensorBoard event files ([`tensorboard`]).

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::Serialize;

use tvq_model::{CodebookMetrics, Precision};

use crate::config::ActivationCheckpointing;
use crate::error::TrainError;
use crate::fault::{self, Point};
use crate::inference::evaluate::EvalReport;
use crate::trainer::StepOutcome;

pub mod tensorboard;

use tensorboard::EventWriter;

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
    /// GPU memory held after the step, in bytes, over this node's devices:
    /// on CUDA the memory that is not free, on wgpu burn's memory pools
    /// ([`crate::placement::device::device_memory_bytes`]; absent on the CPU).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device_memory_bytes: Option<u64>,
}

/// What a step's metrics read from the run, beside the step's outcome.
#[derive(Clone, Copy, Debug)]
pub struct RunFacts {
    /// Bytes of text per token of the training split (bits per token to
    /// bits per byte).
    pub bytes_per_token: f64,
    /// Model FLOPs of one training token ([`crate::mfu::training_flops_per_token`]).
    pub flops_per_token: f64,
    /// Peak FLOP/s of every device of every node together (`None`: unknown,
    /// no MFU).
    pub peak_flops: Option<f64>,
    /// `train.precision`.
    pub precision: Precision,
    /// `train.activation_checkpointing`.
    pub activation_checkpointing: ActivationCheckpointing,
}

impl StepMetrics {
    /// The metrics of step `o` in a run of `facts`, with `tokens` trained
    /// on so far.
    pub fn new(o: &StepOutcome, facts: &RunFacts, tokens: u64) -> Self {
        let mean = |f: fn(&CodebookMetrics) -> f64| {
            let n = o.codebooks.len().max(1) as f64;
            o.codebooks.iter().map(f).sum::<f64>() / n
        };
        let bits_per_token = o.ce / std::f64::consts::LN_2;
        let tokens_per_s = o.tokens as f64 / o.elapsed.as_secs_f64();
        Self {
            kind: "train",
            step: o.step,
            lr: o.lr,
            loss: o.loss,
            ce: o.ce,
            bits_per_token,
            bits_per_byte: bits_per_token / facts.bytes_per_token,
            commitment: o.commitment,
            grad_norm: o.grad_norm,
            codebook_usage: mean(|c| c.usage),
            code_perplexity: mean(|c| c.perplexity),
            quantization_error: mean(|c| c.relative_error),
            tokens_per_s,
            mfu: facts
                .peak_flops
                .map(|peak| tokens_per_s * facts.flops_per_token / peak),
            precision: facts.precision,
            activation_checkpointing: facts.activation_checkpointing,
            loss_scale: o.loss_scale,
            skipped: o.skipped,
            tokens,
            peak_rss_bytes: peak_rss_bytes(),
            device_memory_bytes: o.device_memory_bytes,
        }
    }

    /// A short line for the progress bar.
    pub fn summary(&self) -> String {
        let mfu = self
            .mfu
            .map_or(String::new(), |m| format!(" mfu {:.0}%", 100.0 * m));
        let gib = |label: &str, bytes: Option<u64>| {
            bytes.map_or(String::new(), |b| {
                format!(" {label} {:.2} GiB", b as f64 / (1u64 << 30) as f64)
            })
        };
        let rss = gib("rss", self.peak_rss_bytes);
        let gpu = gib("gpu", self.device_memory_bytes);
        format!(
            "loss {:.3} bpb {:.3} {:.0} tok/s{mfu}{rss}{gpu}",
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

/// A sample drawn while training (`eval.sample_every`): one line of
/// `samples.jsonl`, and a text entry in TensorBoard.
#[derive(Clone, Debug, PartialEq, Serialize, serde::Deserialize)]
pub struct SampleLine {
    /// The step it was drawn after.
    pub step: u64,
    /// The prompt it continues (`eval.sample_prompt`).
    pub prompt: String,
    /// The continuation, without the prompt.
    pub text: String,
}

/// The logs of a run directory, opened for appending: `metrics.jsonl`,
/// `samples.jsonl` and, unless off, TensorBoard's event files in `tb/`.
/// The JSON files are the record; the event files are rebuilt from them
/// when the log opens, so after any kill they hold exactly the same rows.
pub struct MetricsLog {
    metrics: JsonLines,
    samples: JsonLines,
    tensorboard: Option<(EventWriter, PathBuf)>,
}

impl MetricsLog {
    /// Opens the logs of `run_dir`, keeping only the lines up to `step`
    /// (a resumed run writes the rest again, exactly) and dropping a torn
    /// last line. With `redo_final`, a `final_eval` line at `step` goes too:
    /// the resumed run ends at `step` and writes it again. The kept lines
    /// replace the files atomically, so a kill while opening loses nothing.
    /// With `tensorboard`, `tb/` is rewritten from the kept lines.
    pub fn open(
        run_dir: &Path,
        step: u64,
        redo_final: bool,
        tensorboard: bool,
    ) -> Result<Self, TrainError> {
        let (metrics, rows) = JsonLines::open(&run_dir.join("metrics.jsonl"), |v| {
            let s = v["step"].as_u64();
            s.is_some_and(|s| s <= step)
                && !(redo_final && v["kind"] == "final_eval" && s == Some(step))
        })?;
        let (samples, drawn) = JsonLines::open(&run_dir.join("samples.jsonl"), |v| {
            v["step"].as_u64().is_some_and(|s| s <= step)
        })?;
        let tensorboard = match tensorboard {
            true => Some(rebuild_tensorboard(&run_dir.join("tb"), &rows, &drawn)?),
            false => None,
        };
        Ok(Self {
            metrics,
            samples,
            tensorboard,
        })
    }

    /// Appends one row ([`StepMetrics`], [`EvalLine`]) to `metrics.jsonl`
    /// and its numbers to TensorBoard, as `KIND/FIELD` (`train/loss`).
    pub fn append(&mut self, row: &impl Serialize) -> Result<(), TrainError> {
        let row = serde_json::to_value(row).expect("metrics serialize");
        fault::inject(Point::MetricsAppend).map_err(|e| TrainError::io(&self.metrics.path, e))?;
        self.metrics.append(&row)?;
        if let Some((events, path)) = &mut self.tensorboard {
            let (step, scalars) = scalars_of(&row);
            events
                .scalars(step, &scalars)
                .map_err(|e| TrainError::io(&*path, e))?;
        }
        Ok(())
    }

    /// Appends a sample to `samples.jsonl` and to TensorBoard's text tab.
    pub fn append_sample(&mut self, sample: &SampleLine) -> Result<(), TrainError> {
        let line = serde_json::to_value(sample).expect("samples serialize");
        self.samples.append(&line)?;
        if let Some((events, path)) = &mut self.tensorboard {
            write_sample(events, sample).map_err(|e| TrainError::io(&*path, e))?;
        }
        Ok(())
    }
}

/// The step of a metrics row and its numbers as TensorBoard scalars,
/// tagged `KIND/FIELD`; fields that are not numbers (the precision, lists
/// of buckets) are left out.
fn scalars_of(row: &serde_json::Value) -> (u64, Vec<(String, f64)>) {
    let kind = row["kind"].as_str().unwrap_or("metrics");
    let scalars = row
        .as_object()
        .into_iter()
        .flatten()
        .filter(|(k, _)| *k != "step")
        .filter_map(|(k, v)| Some((format!("{kind}/{k}"), v.as_f64()?)))
        .collect();
    (row["step"].as_u64().unwrap_or(0), scalars)
}

/// TensorBoard's text entry of a sample: the prompt and its continuation
/// as a Markdown code block, so that line breaks show.
fn sample_markdown(sample: &SampleLine) -> String {
    format!("{}{}", sample.prompt, sample.text)
        .lines()
        .map(|l| format!("    {l}\n"))
        .collect()
}

fn write_sample(events: &mut EventWriter, sample: &SampleLine) -> std::io::Result<()> {
    events.text(sample.step, "samples", &sample_markdown(sample))
}

/// Writes `dir`'s event file anew from the rows of `metrics.jsonl` and
/// `samples.jsonl`: into a temporary file TensorBoard does not read (its
/// name lacks `tfevents`), synced, then in place of every older event file.
/// Returns the writer, open for appending, and the file's path.
fn rebuild_tensorboard(
    dir: &Path,
    rows: &[serde_json::Value],
    samples: &[serde_json::Value],
) -> Result<(EventWriter, PathBuf), TrainError> {
    let io = |p: &Path| {
        let p = p.to_owned();
        move |e| TrainError::io(&p, e)
    };
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let tmp = dir.join("rebuild.tmp");
    let mut events = EventWriter::create(&tmp).map_err(io(&tmp))?;
    for row in rows {
        let (step, scalars) = scalars_of(row);
        events.scalars(step, &scalars).map_err(io(&tmp))?;
    }
    for sample in samples {
        if let Ok(sample) = serde_json::from_value::<SampleLine>(sample.clone()) {
            write_sample(&mut events, &sample).map_err(io(&tmp))?;
        }
    }
    events.sync().map_err(io(&tmp))?;
    for entry in std::fs::read_dir(dir).map_err(io(dir))?.flatten() {
        if entry.file_name().to_string_lossy().contains("tfevents") {
            std::fs::remove_file(entry.path()).map_err(io(&entry.path()))?;
        }
    }
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let path = dir.join(format!("events.out.tfevents.{secs}.tvq"));
    std::fs::rename(&tmp, &path).map_err(io(&path))?;
    Ok((events, path))
}

/// A JSON-lines file opened for appending (created by the first line).
struct JsonLines {
    file: Option<File>,
    path: PathBuf,
}

impl JsonLines {
    /// Opens `path` keeping the lines that parse and satisfy `keep` (the
    /// kept lines replace the file atomically when any went), and returns
    /// them.
    fn open(
        path: &Path,
        keep: impl Fn(&serde_json::Value) -> bool,
    ) -> Result<(Self, Vec<serde_json::Value>), TrainError> {
        let mut kept = vec![];
        if let Ok(text) = std::fs::read_to_string(path) {
            let mut kept_text = String::new();
            for line in text.lines() {
                if let Ok(v) = serde_json::from_str::<serde_json::Value>(line)
                    && keep(&v)
                {
                    kept_text += line;
                    kept_text.push('\n');
                    kept.push(v);
                }
            }
            if kept_text != text {
                let name = path.file_name().unwrap_or_default().to_string_lossy();
                let tmp = path.with_file_name(format!(".{name}.tmp"));
                crate::nofollow::write(&tmp, kept_text.as_bytes())
                    .and_then(|()| std::fs::rename(&tmp, path))
                    .map_err(|e| TrainError::io(&*path, e))?;
            }
        }
        let path = path.to_owned();
        Ok((Self { file: None, path }, kept))
    }

    /// Appends one JSON line and flushes it.
    fn append(&mut self, value: &serde_json::Value) -> Result<(), TrainError> {
        // One write of the whole line: appended at once, never interleaved.
        let line = value.to_string() + "\n";
        let file = match &mut self.file {
            Some(file) => file,
            None => self.file.insert(
                crate::nofollow::append(&self.path).map_err(|e| TrainError::io(&self.path, e))?,
            ),
        };
        file.write_all(line.as_bytes())
            .and_then(|()| file.flush())
            .map_err(|e| TrainError::io(&self.path, e))
    }
}

#[cfg(test)]
mod tests {
    use super::MetricsLog;

    #[test]
    fn reopening_keeps_the_lines_up_to_the_resumed_step_and_drops_a_torn_one() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metrics.jsonl");
        let mut log = MetricsLog::open(dir.path(), 0, false, true).unwrap();
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
        drop(MetricsLog::open(dir.path(), 5, true, true).unwrap());
        assert_eq!(steps().len(), 5);
        // A kill in the middle of an append tore the last line.
        let mut text = std::fs::read_to_string(&path).unwrap();
        text += r#"{"kind":"train","st"#;
        std::fs::write(&path, text).unwrap();
        let mut log = MetricsLog::open(dir.path(), 3, false, true).unwrap();
        log.append(&serde_json::json!({"kind": "train", "step": 4}))
            .unwrap();
        let train = |s: u64| ("train".to_string(), s);
        assert_eq!(steps(), [train(1), train(2), train(3), train(4)]);
        assert!(!dir.path().join(".metrics.jsonl.tmp").exists());
    }

    #[cfg(unix)]
    #[test]
    fn a_link_placed_during_a_run_is_not_written_through() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("elsewhere.txt");
        std::fs::write(&target, "theirs").unwrap();
        // The run has started (its start refuses links); then a link
        // appears where the first row goes.
        let mut log = MetricsLog::open(dir.path(), 0, false, false).unwrap();
        std::os::unix::fs::symlink(&target, dir.path().join("metrics.jsonl")).unwrap();
        let e = (log.append(&serde_json::json!({"kind": "train", "step": 1})))
            .unwrap_err()
            .to_string();
        assert!(e.contains("symbolic link") && !e.contains('\n'), "{e}");
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "theirs");
    }

    #[test]
    fn tensorboard_holds_exactly_the_kept_rows_after_a_reopen() {
        use super::tensorboard::{Content, What, read_events};
        use super::{SampleLine, scalars_of};
        let dir = tempfile::tempdir().unwrap();
        let mut log = MetricsLog::open(dir.path(), 0, false, true).unwrap();
        for step in 1..=5u64 {
            let row = serde_json::json!({"kind": "train", "step": step, "loss": 1.0 / step as f64, "precision": "f32"});
            log.append(&row).unwrap();
            log.append_sample(&SampleLine {
                step,
                prompt: "In".into(),
                text: format!(" the {step}\nline"),
            })
            .unwrap();
        }
        drop(log);
        drop(MetricsLog::open(dir.path(), 3, false, true).unwrap());
        let files: Vec<_> = std::fs::read_dir(dir.path().join("tb"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        assert_eq!(files.len(), 1, "one event file, no leftovers: {files:?}");
        let mut scalars = vec![];
        let mut texts = vec![];
        for event in read_events(&files[0]).unwrap() {
            let Some(What::Summary(s)) = event.what else {
                continue;
            };
            for v in s.value {
                match v.content {
                    Some(Content::SimpleValue(x)) => scalars.push((event.step as u64, v.tag, x)),
                    Some(Content::Tensor(t)) => texts.push((
                        event.step,
                        String::from_utf8(t.string_val[0].clone()).unwrap(),
                    )),
                    None => panic!("a value without content"),
                }
            }
        }
        let expected: Vec<_> = (1..=3u64)
            .flat_map(|step| {
                let row =
                    serde_json::json!({"kind": "train", "step": step, "loss": 1.0 / step as f64});
                scalars_of(&row)
                    .1
                    .into_iter()
                    .map(move |(t, x)| (step, t, x as f32))
            })
            .collect();
        assert_eq!(scalars, expected);
        assert_eq!(texts.len(), 3);
        assert_eq!(texts[1], (2, "    In the 2\n    line\n".to_string()));
        let kept_samples = std::fs::read_to_string(dir.path().join("samples.jsonl")).unwrap();
        assert_eq!(kept_samples.lines().count(), 3);
    }
}
