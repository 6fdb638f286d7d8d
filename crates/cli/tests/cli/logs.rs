//! What a run logs besides its checkpoints: TensorBoard event files that
//! hold exactly the rows of `metrics.jsonl` and `samples.jsonl`, however
//! the run was interrupted, and samples drawn while training that change
//! nothing in the run.

use super::*;
use std::io::Write;
use tvq_train::run::metrics::tensorboard::{Content, What, read_events};

/// TensorBoard's content: scalars `(step, tag, value)` and texts `(step,
/// text)`.
type Board = (Vec<(u64, String, f32)>, Vec<(u64, String)>);

/// A run's TensorBoard content, in file order, read with tvq's reader from
/// its one event file.
fn tensorboard_of(run: &Path) -> Board {
    let files: Vec<PathBuf> = std::fs::read_dir(run.join("tb"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(files.len(), 1, "one event file and nothing else: {files:?}");
    assert!(files[0].to_string_lossy().contains("tfevents"));
    let (mut scalars, mut texts) = (vec![], vec![]);
    for event in read_events(&files[0]).unwrap() {
        let Some(What::Summary(summary)) = event.what else {
            continue;
        };
        let step = event.step as u64;
        for value in summary.value {
            match value.content {
                Some(Content::SimpleValue(x)) => scalars.push((step, value.tag, x)),
                Some(Content::Tensor(t)) => {
                    texts.push((step, String::from_utf8(t.string_val[0].clone()).unwrap()))
                }
                None => panic!("a value without content"),
            }
        }
    }
    (scalars, texts)
}

/// What TensorBoard should hold for a run: every number of every
/// `metrics.jsonl` row as `KIND/FIELD` in `f32`, and every sample of
/// `samples.jsonl` (prompt and continuation, indented as Markdown code).
fn expected_tensorboard(run: &Path) -> Board {
    let mut scalars = vec![];
    for row in json_lines(&run.join("metrics.jsonl")) {
        let step = row["step"].as_u64().unwrap();
        let kind = row["kind"].as_str().unwrap();
        for (field, value) in row.as_object().unwrap() {
            if let (true, Some(x)) = (field != "step", value.as_f64()) {
                scalars.push((step, format!("{kind}/{field}"), x as f32));
            }
        }
    }
    let texts = json_lines(&run.join("samples.jsonl"))
        .iter()
        .map(|s| {
            let text = format!(
                "{}{}",
                s["prompt"].as_str().unwrap(),
                s["text"].as_str().unwrap()
            );
            let markdown = text.lines().map(|l| format!("    {l}\n")).collect();
            (s["step"].as_u64().unwrap(), markdown)
        })
        .collect();
    (scalars, texts)
}

/// The run's event file holds exactly its metrics and samples: no step
/// lost, none twice (the fault suite checks this after every fault).
pub(super) fn assert_tensorboard_matches_logs(run: &Path, what: &str) {
    let (scalars, texts) = tensorboard_of(run);
    let (want_scalars, want_texts) = expected_tensorboard(run);
    assert!(!want_scalars.is_empty(), "{what}: no metrics");
    assert!(
        scalars == want_scalars,
        "{what}: TensorBoard's scalars differ from metrics.jsonl"
    );
    assert_eq!(texts, want_texts, "{what}: TensorBoard's samples");
}

/// Reads the run's event files with Python's `tensorboard` package, the
/// reader TensorBoard itself uses, and checks every scalar and text against
/// the JSON logs. Skipped, with a `SKIPPED` line, where the package is not
/// installed (`pip install tensorboard`).
fn assert_python_tensorboard_reads(run: &Path) {
    let has_it = Command::new("python3")
        .args(["-c", "import tensorboard"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !has_it {
        // Straight to stderr: the test harness hides what `eprintln!`
        // prints in a passing test.
        let _ = writeln!(
            std::io::stderr(),
            "SKIPPED: Python's tensorboard is not installed (pip install tensorboard); \
             its reading of the event files is not checked"
        );
        return;
    }
    let out = succeeds(
        Command::new("python3")
            .arg(crate_dir().join("tests/read_tensorboard.py"))
            .arg(run.join("tb")),
    );
    let read: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let (want_scalars, want_texts) = expected_tensorboard(run);
    let mut scalars: Vec<(u64, String, f32)> = vec![];
    for (tag, points) in read["scalars"].as_object().unwrap() {
        for p in points.as_array().unwrap() {
            let step = p[0].as_u64().unwrap();
            let value = p[1].as_f64().unwrap();
            // serde_json reads Python's shortest repr to within an f64 ulp;
            // rounded to f32 it is the f32 TensorBoard holds.
            scalars.push((step, tag.clone(), value as f32));
        }
    }
    let mut want = want_scalars;
    let order = |a: &(u64, String, f32), b: &(u64, String, f32)| (&a.1, a.0).cmp(&(&b.1, b.0));
    want.sort_by(order);
    scalars.sort_by(order);
    assert!(
        scalars == want,
        "Python's tensorboard reads other scalars than metrics.jsonl"
    );
    let texts: Vec<(u64, String)> = read["texts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| (t[0].as_u64().unwrap(), t[1].as_str().unwrap().to_string()))
        .collect();
    assert_eq!(
        texts, want_texts,
        "Python's tensorboard reads other samples"
    );
}

/// Samples every 2 steps (with a prompt) leave every metrics row and the
/// final weights bit for bit as a run without them; a run stopped and
/// resumed draws the same samples; each sample is what `tvq sample` draws
/// from that step's checkpoint; TensorBoard (tvq's reader and Python's)
/// holds exactly the logged rows and samples.
#[test]
fn samples_while_training_change_nothing_and_tensorboard_holds_every_row() {
    let dir = tempfile::tempdir().unwrap();
    let config = tiny_config(dir.path(), 6, 2);
    let config = config.to_str().unwrap();
    let sampling = [
        "--set",
        "eval.sample_every=2",
        "--set",
        "eval.sample_prompt='And God said'",
        "--set",
        "eval.sample_tokens=24",
        "--set",
        "eval.sample_seed=7",
    ];
    let train = |run: &Path, extra: &[&str]| {
        train_quietly(config, run, extra);
    };
    let plain = dir.path().join("plain");
    train(&plain, &["--set", "log.tensorboard=false"]);
    assert!(
        !plain.join("tb").exists(),
        "log.tensorboard = false writes none"
    );
    assert!(!plain.join("samples.jsonl").exists());
    let sampled = dir.path().join("sampled");
    train(&sampled, &sampling);
    let resumed = dir.path().join("resumed");
    train(&resumed, &[&sampling[..], &["--max-steps", "3"]].concat());
    train(&resumed, &[&sampling[..], &["--resume"]].concat());

    let without_timing = super::faults::rows;
    // `--max-steps 3` ended a run: its final evaluation at step 3 stays.
    let mut resumed_rows = without_timing(&resumed);
    let early_final = resumed_rows
        .iter()
        .position(|r| r["kind"] == "final_eval" && r["step"] == 3)
        .expect("a final evaluation at step 3");
    resumed_rows.remove(early_final);
    assert!(
        resumed_rows == without_timing(&plain),
        "the resumed run's metrics"
    );
    for run in [&sampled, &resumed] {
        assert!(
            run == &resumed || without_timing(run) == without_timing(&plain),
            "{}: sampling changed the metrics",
            run.display()
        );
        assert!(final_weights(run, 6) == final_weights(&plain, 6));
        assert_tensorboard_matches_logs(run, &run.display().to_string());
    }
    let samples = json_lines(&sampled.join("samples.jsonl"));
    assert_eq!(samples, json_lines(&resumed.join("samples.jsonl")));
    let steps: Vec<u64> = samples
        .iter()
        .map(|s| s["step"].as_u64().unwrap())
        .collect();
    assert_eq!(steps, [2, 4, 6]);
    assert!(samples.iter().all(|s| s["prompt"] == "And God said"));
    assert_ne!(samples[0]["text"], samples[2]["text"], "the model learnt");

    // The same draw as `tvq sample` from the checkpoint of that step.
    let checkpoint = sampled.join("checkpoints/step-00000006");
    let printed = ok(&[
        "sample",
        "--checkpoint",
        checkpoint.to_str().unwrap(),
        "--prompt",
        "And God said",
        "--no-echo",
        "--max-tokens",
        "24",
        "--seed",
        "7",
    ]);
    assert_eq!(
        printed,
        format!("{}\n", samples[2]["text"].as_str().unwrap())
    );

    assert_python_tensorboard_reads(&resumed);
}

/// The events of a Chrome trace file.
fn trace_events(trace: &Path) -> Vec<serde_json::Value> {
    serde_json::from_str(&std::fs::read_to_string(trace).unwrap()).unwrap()
}

/// How many spans named `name` a trace opens.
fn span_count(events: &[serde_json::Value], name: &str) -> usize {
    events
        .iter()
        .filter(|e| e["name"] == name && e["ph"] == "B")
        .count()
}

/// `--trace` writes a Chrome trace with every phase of every step, the
/// recomputation of `activation_checkpointing = "full"` inside the backward
/// pass, each worker's shards on its own thread, and every span closed.
#[test]
fn a_trace_shows_every_phase_of_every_step_on_each_worker() {
    let dir = tempfile::tempdir().unwrap();
    let config = tiny_config(dir.path(), 4, 2);
    let trace = dir.path().join("trace.json");
    train_quietly(
        config.to_str().unwrap(),
        &dir.path().join("run"),
        &[
            "--trace",
            trace.to_str().unwrap(),
            "--set",
            "train.workers=2",
            "--set",
            "train.activation_checkpointing='full'",
            "--set",
            "model.n_layer=2",
        ],
    );
    let events = trace_events(&trace);
    let count = |name: &str| span_count(&events, name);
    // 4 steps of 4 shards (2 workers x 2 micro-batches); 2 layers of 2
    // sublayers each, of which the backward pass recomputes all but the
    // last; a periodic evaluation at step 3; checkpoints at steps 2 and 4.
    for (phase, n) in [
        ("data", 4),
        ("step", 4),
        ("shard", 16),
        ("forward", 16),
        ("backward", 16),
        ("recompute", 16 * 3),
        ("optimizer", 4),
        ("ema", 4),
        ("checkpoint", 2),
        ("evaluation", 1),
    ] {
        assert_eq!(count(phase), n, "{phase} spans");
    }
    // Spans open and close in order on each thread.
    let mut open: std::collections::HashMap<u64, Vec<&str>> = Default::default();
    for e in events.iter().filter(|e| e["ph"] == "B" || e["ph"] == "E") {
        let stack = open.entry(e["tid"].as_u64().unwrap()).or_default();
        let name = e["name"].as_str().unwrap();
        match e["ph"].as_str() {
            Some("B") => stack.push(name),
            _ => assert_eq!(stack.pop(), Some(name), "spans nest"),
        }
    }
    assert!(open.values().all(Vec::is_empty), "every span closed");
    // Within each step, its 4 shards run on 2 threads (one per worker).
    let times = |name: &str, ph: &str| -> Vec<f64> {
        events
            .iter()
            .filter(|e| e["name"] == name && e["ph"] == ph)
            .map(|e| e["ts"].as_f64().unwrap())
            .collect()
    };
    let steps = times("step", "B").into_iter().zip(times("step", "E"));
    for (begin, end) in steps {
        let threads: std::collections::HashSet<u64> = events
            .iter()
            .filter(|e| e["name"] == "shard" && e["ph"] == "B")
            .filter(|e| (begin..end).contains(&e["ts"].as_f64().unwrap()))
            .map(|e| e["tid"].as_u64().unwrap())
            .collect();
        assert_eq!(threads.len(), 2, "one thread per worker");
    }
    // Without checkpointing nothing is recomputed.
    let plain = dir.path().join("plain.json");
    train_quietly(
        config.to_str().unwrap(),
        &dir.path().join("plain"),
        &[
            "--trace",
            plain.to_str().unwrap(),
            "--set",
            "model.n_layer=2",
        ],
    );
    let events = trace_events(&plain);
    assert_eq!(span_count(&events, "backward"), 8);
    assert_eq!(span_count(&events, "recompute"), 0);
}

/// A run with `bf16` products and `full` activation checkpointing trains
/// (its rows say so, and its losses are not the `f32` run's), stops and
/// resumes exactly, and evaluates.
#[test]
fn a_bf16_run_with_full_checkpointing_trains_resumes_and_evaluates() {
    let dir = tempfile::tempdir().unwrap();
    let config = tiny_config(dir.path(), 4, 2);
    let config = config.to_str().unwrap();
    let modes = [
        "--set",
        "train.precision='bf16'",
        "--set",
        "train.activation_checkpointing='full'",
    ];
    let train = |run: &Path, extra: &[&str]| {
        train_quietly(config, run, extra);
    };
    let (straight, resumed, f32_run) = (
        dir.path().join("straight"),
        dir.path().join("resumed"),
        dir.path().join("f32"),
    );
    train(&straight, &modes);
    train(&resumed, &[&modes[..], &["--max-steps", "2"]].concat());
    train(&resumed, &[&modes[..], &["--resume"]].concat());
    train(&f32_run, &[]);
    let rows = json_lines(&straight.join("metrics.jsonl"));
    let train_rows: Vec<_> = rows.iter().filter(|r| r["kind"] == "train").collect();
    assert_eq!(train_rows.len(), 4);
    assert!(
        train_rows
            .iter()
            .all(|r| r["precision"] == "bf16" && r["activation_checkpointing"] == "full")
    );
    assert_ne!(losses(&straight), losses(&f32_run), "bf16 products");
    assert_eq!(losses(&resumed), losses(&straight), "resumed exactly");
    assert!(final_weights(&resumed, 4) == final_weights(&straight, 4));
    let report: serde_json::Value = serde_json::from_str(&ok(&[
        "eval",
        "--checkpoint",
        straight.to_str().unwrap(),
        "--json",
    ]))
    .unwrap();
    assert_eq!(report["complete"], true);
    assert!(report["bits_per_byte"].as_f64().unwrap().is_finite());
}
