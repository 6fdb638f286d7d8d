//! The `tvq` binary end to end on a tiny config: kill-and-resume equality,
//! worker threads, evaluation, sampling, export, importing an official
//! checkpoint, runs written by earlier versions, and errors on bad input;
//! the fault suite in `cli/faults.rs`.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use tvq_testkit::{Gpu, crate_dir, wait_for};

const TVQ: &str = env!("CARGO_BIN_EXE_tvq");

fn repo() -> PathBuf {
    crate_dir().join("../..")
}

/// A tiny run on a slice of the KJV: a few hundred milliseconds a step.
fn tiny_config(dir: &Path, steps: u64, checkpoint_every: u64) -> PathBuf {
    let corpus = dir.join("kjv-small.txt");
    if !corpus.exists() {
        let text = std::fs::read(repo().join("data/kjv.txt")).unwrap();
        std::fs::write(&corpus, &text[..400_000]).unwrap();
    }
    let path = dir.join(format!("tiny-{steps}-{checkpoint_every}.toml"));
    std::fs::write(
        &path,
        format!(
            r#"
[model]
d_model = 32
d_k = 16
d_v = 64
n_code = 16
n_layer = 1
block_len = 16
dropout_residual = 0.1
dropout_layer = 0.1

[data]
kind = "text"
path = "{corpus}"
batch_size = 4
update_len = 64
sequence_len = 128

[train]
steps = {steps}
lr = 3e-3
warmup_steps = 2
micro_batches = 2
checkpoint_every = {checkpoint_every}
keep_checkpoints = 10

[eval]
every = 3
segments = 2
batch_size = 4
update_len = 64
"#,
            corpus = corpus.display()
        ),
    )
    .unwrap();
    path
}

fn tvq(args: &[&str]) -> Output {
    Command::new(TVQ).args(args).output().expect("tvq runs")
}

/// `tvq args`, which must succeed; what it printed.
fn ok(args: &[&str]) -> String {
    String::from_utf8(succeeds(Command::new(TVQ).args(args)).stdout).unwrap()
}

/// Runs `command`, which must succeed (else the test fails with its
/// output), and returns its output.
fn succeeds(command: &mut Command) -> Output {
    let out = command.output().expect("the command starts");
    assert!(
        out.status.success(),
        "{command:?} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// `tvq args` must fail with a one-line error containing `needle`, and no panic.
fn fails(args: &[&str], needle: &str) {
    assert_one_error_line(&format!("tvq {args:?}"), &tvq(args), needle);
}

/// `out` (of `what`) is a failure with one error line, containing
/// `needle`, and no panic.
fn assert_one_error_line(what: &str, out: &Output, needle: &str) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{what} should fail");
    assert!(!err.contains("panicked at"), "{what} panicked:\n{err}");
    let last = err
        .lines()
        .filter(|l| l.starts_with("error"))
        .collect::<Vec<_>>();
    assert_eq!(last.len(), 1, "one error line expected:\n{err}");
    assert!(
        last[0].contains(needle),
        "error should mention `{needle}`:\n{err}"
    );
}

/// `tvq train --quiet` on `config` into `run` with `extra` arguments; it
/// must succeed. Returns what it printed.
fn train_quietly(config: &str, run: &Path, extra: &[&str]) -> String {
    let run = run.to_str().unwrap();
    ok(&[
        &["train", "--config", config, "--run-dir", run, "--quiet"][..],
        extra,
    ]
    .concat())
}

/// `tvq train --quiet` on `config` into `run` in the background, its stdout
/// and stderr made by `stdio`.
fn spawn_train(
    config: &str,
    run: &Path,
    stdio: fn() -> std::process::Stdio,
) -> std::process::Child {
    Command::new(TVQ)
        .args([
            "train",
            "--config",
            config,
            "--run-dir",
            run.to_str().unwrap(),
            "--quiet",
        ])
        .stdout(stdio())
        .stderr(stdio())
        .spawn()
        .unwrap()
}

/// Lines in the run's metrics.jsonl (0 before it exists).
fn metrics_lines(run: &Path) -> usize {
    std::fs::read_to_string(run.join("metrics.jsonl")).map_or(0, |m| m.lines().count())
}

/// The lines of a run's JSON-lines file (none when it does not exist).
fn json_lines(path: &Path) -> Vec<serde_json::Value> {
    parse_json_lines(&std::fs::read_to_string(path).unwrap_or_default())
}

/// Each line of `text` (a JSON-lines file, or `--json` output) as JSON.
fn parse_json_lines(text: &str) -> Vec<serde_json::Value> {
    text.lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect()
}

fn checkpoint_list(run: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(run.join("checkpoints"))
        .map_or(vec![], |d| d.map(|e| e.unwrap().path()).collect())
}

/// Losses per step from metrics.jsonl.
fn losses(run: &Path) -> Vec<(u64, String)> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v["kind"] == "train")
        .map(|v| {
            (
                v["step"].as_u64().unwrap(),
                format!("{} {} {}", v["loss"], v["grad_norm"], v["commitment"]),
            )
        })
        .collect()
}

/// Every tensor of a checkpoint's model, by name, via `tvq export`.
fn final_weights(run: &Path, step: u64) -> Vec<(String, Vec<u8>)> {
    let out = run.join("weights.safetensors");
    let checkpoint = run.join(format!("checkpoints/step-{step:08}"));
    ok(&[
        "export",
        "--checkpoint",
        checkpoint.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    tensors_of(&out)
}

/// Every tensor of a safetensors file, as (name, bytes), sorted by name.
fn tensors_of(file: &Path) -> Vec<(String, Vec<u8>)> {
    let bytes = std::fs::read(file).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<_> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.data().to_vec()))
        .collect();
    tensors.sort();
    tensors
}

/// One run, whatever the device: the quick start's model and settings (on
/// a 400 kB piece of its corpus, so that the final validation is short)
/// draw their weights and dropout masks on the CPU wherever they train, so
/// 10 steps on wgpu (Mesa's lavapipe in CI) log the CPU's losses within
/// 1e-4 relative (f32 rounding in other kernels; seen: 1e-6), and so does
/// the final validation. Before, each backend's generator drew its own
/// weights: 6.054 against 6.197 at step 1. (CUDA instead of wgpu when
/// `TVQ_TEST_DEVICE=cuda`.)
#[test]
fn the_quick_start_trains_alike_on_wgpu_and_the_cpu() {
    let gpu = Gpu::under_test();
    let dir = tempfile::tempdir().unwrap();
    tiny_config(dir.path(), 1, 1); // writes the corpus piece
    let corpus = format!("data.path={}", dir.path().join("kjv-small.txt").display());
    let config = repo().join("configs/quickstart.toml");
    let run = |device: &str| {
        let run_dir = dir.path().join(device);
        let out = tvq(&[
            "train",
            "--config",
            config.to_str().unwrap(),
            "--run-dir",
            run_dir.to_str().unwrap(),
            "--max-steps",
            "10",
            "--device",
            device,
            "--quiet",
            "--set",
            &corpus,
        ]);
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        (out.status.success(), err, run_dir)
    };
    let (gpu_ok, err, gpu_run) = run(gpu.name());
    if !gpu_ok && err.contains("is not available") {
        gpu.missing("the_quick_start_trains_alike_on_wgpu_and_the_cpu", &err);
        return;
    }
    assert!(gpu_ok, "{err}");
    // The GPU's first step (kernels compiled and tuned) is told, not the CPU's.
    assert!(err.contains("first step in"), "{err}");
    let (cpu_ok, err, cpu_run) = run("cpu");
    assert!(cpu_ok, "{err}");
    assert!(!err.contains("first step in"), "{err}");
    let logged = |run: &Path| -> Vec<(String, f64)> {
        std::fs::read_to_string(run.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .map(|v| {
                (
                    v["kind"].as_str().unwrap().to_string(),
                    v["loss"].as_f64().unwrap(),
                )
            })
            .collect()
    };
    // Every GPU step row says the GPU memory it held, at least the weights
    // and AdamW moments that live there (the last checkpoint's files hold
    // them in f32); the CPU has none to say.
    let held_at_least: u64 = checkpoint_list(&gpu_run)
        .into_iter()
        .max()
        .map(|last| ["model.safetensors", "optimizer.safetensors"].map(|f| last.join(f)))
        .unwrap()
        .iter()
        .map(|f| f.metadata().unwrap().len())
        .sum();
    let memory = |run: &Path| -> Vec<Option<u64>> {
        json_lines(&run.join("metrics.jsonl"))
            .iter()
            .filter(|v| v["kind"] == "train")
            .map(|v| v["device_memory_bytes"].as_u64())
            .collect()
    };
    let on_gpu = memory(&gpu_run);
    assert!(
        on_gpu.iter().all(|m| m.is_some_and(|b| b >= held_at_least)),
        "GPU memory {on_gpu:?} against {held_at_least} bytes of weights and moments"
    );
    assert!(memory(&cpu_run).iter().all(Option::is_none));
    let (cpu, gpu) = (logged(&cpu_run), logged(&gpu_run));
    assert_eq!(cpu.len(), 11, "10 steps and the final validation: {cpu:?}");
    assert_eq!(cpu.len(), gpu.len());
    for ((kind, c), (gpu_kind, g)) in cpu.iter().zip(&gpu) {
        assert_eq!(kind, gpu_kind);
        assert!((c - g).abs() <= 1e-4 * c, "{cpu:?}\n{gpu:?}");
    }
}

#[test]
fn killed_and_resumed_training_equals_uninterrupted_training() {
    let dir = tempfile::tempdir().unwrap();
    let (k, total) = (4, 8);
    let config = tiny_config(dir.path(), total, k);
    let config = config.to_str().unwrap();
    let straight = dir.path().join("straight");
    ok(&[
        "train",
        "--config",
        config,
        "--run-dir",
        straight.to_str().unwrap(),
        "--quiet",
    ]);

    // Second run: SIGKILL as soon as checkpoint K exists, then resume.
    let killed = dir.path().join("killed");
    let mut child = spawn_train(config, &killed, std::process::Stdio::null);
    let marker = killed.join(format!("checkpoints/step-{k:08}/manifest.json"));
    wait_for(&mut child, &format!("a checkpoint at step {k}"), || {
        marker.exists()
    });
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    assert!(
        !killed.join(format!("checkpoints/step-{total:08}")).exists(),
        "the kill must land before the run finishes"
    );
    ok(&[
        "train",
        "--config",
        config,
        "--run-dir",
        killed.to_str().unwrap(),
        "--resume",
        "--quiet",
    ]);

    let (a, b) = (losses(&straight), losses(&killed));
    assert_eq!(a.len(), total as usize);
    assert_eq!(
        a, b,
        "every step's loss, gradient norm and commitment match"
    );
    let (wa, wb) = (
        final_weights(&straight, total),
        final_weights(&killed, total),
    );
    assert!(wa.len() > 10, "{} tensors", wa.len());
    assert!(wa == wb, "final weights differ");
}

/// `train.init_from`: a run starts from another run's weights, named by
/// its run directory or an export of the same checkpoint alike, and so
/// from a lower loss than a fresh start; it records the source in its
/// config, resumes from its own checkpoints once the source is gone, and a
/// source of another model or none at all is a one-line error.
#[test]
fn a_run_starts_from_another_runs_weights() {
    let dir = tempfile::tempdir().unwrap();
    let config = tiny_config(dir.path(), 6, 3);
    let config = config.to_str().unwrap();
    let source = dir.path().join("source");
    train_quietly(config, &source, &[]);
    let export = dir.path().join("source.safetensors");
    ok(&[
        "export",
        "--checkpoint",
        source.to_str().unwrap(),
        "--out",
        export.to_str().unwrap(),
    ]);
    let init = |from: &Path| format!("train.init_from={}", from.display());
    let fresh = dir.path().join("fresh");
    let from_run = dir.path().join("from-run");
    let from_export = dir.path().join("from-export");
    train_quietly(config, &fresh, &[]);
    train_quietly(
        config,
        &from_run,
        &["--set", &init(&source), "--max-steps", "3"],
    );
    train_quietly(config, &from_export, &["--set", &init(&export)]);

    let first = |run: &Path| {
        losses(run)[0]
            .1
            .split(' ')
            .next()
            .unwrap()
            .parse::<f64>()
            .unwrap()
    };
    assert!(
        first(&from_run) < first(&fresh) - 0.1,
        "{} against a fresh start's {}",
        first(&from_run),
        first(&fresh)
    );
    let recorded = std::fs::read_to_string(from_run.join("config.toml")).unwrap();
    assert!(recorded.contains("init_from"), "{recorded}");

    // The source gone, the run resumes from its own step 3 and ends where
    // the run from the export did.
    std::fs::remove_dir_all(&source).unwrap();
    train_quietly(config, &from_run, &["--resume", "--set", &init(&source)]);
    assert_eq!(losses(&from_run), losses(&from_export));

    let other = dir.path().join("other");
    let train_other = [
        "train",
        "--config",
        config,
        "--run-dir",
        other.to_str().unwrap(),
        "--quiet",
    ];
    let (from, missing) = (init(&export), init(&source));
    let other_model = ["--set", &from, "--set", "model.n_code=8"];
    fails(&[&train_other[..], &other_model].concat(), "c_sum");
    let no_source = ["--force", "--set", &missing];
    fails(&[&train_other[..], &no_source].concat(), "source");
}

#[test]
fn worker_threads_train_exactly_like_sequential_micro_batches() {
    let dir = tempfile::tempdir().unwrap();
    let total = 5;
    let config = tiny_config(dir.path(), total, 5);
    let config = config.to_str().unwrap();
    let args = |run: &Path, dropout: &str, workers: &str, micro: &str| -> Vec<String> {
        let run = run.to_str().unwrap();
        let set = [
            format!("model.dropout_residual={dropout}"),
            format!("model.dropout_layer={dropout}"),
            format!("model.dropout_sinusoid={dropout}"),
            "model.bias=xl".to_string(),
            format!("train.workers={workers}"),
            format!("train.micro_batches={micro}"),
        ];
        let mut args: Vec<String> = ["train", "--config", config, "--run-dir", run, "--quiet"]
            .map(String::from)
            .into();
        for s in set {
            args.extend(["--set".to_string(), s]);
        }
        args
    };
    let run = |args: Vec<String>| ok(&args.iter().map(String::as_str).collect::<Vec<_>>());
    // The same two shards of two rows: one after another, or on two threads;
    // with dropout (residual, layer and XL sinusoid) the two threads must
    // draw the masks in the same order.
    let mut parallel = PathBuf::new();
    let mut runs = Vec::new();
    for dropout in ["0", "0.2"] {
        let sequential = dir.path().join(format!("seq-{dropout}"));
        parallel = dir.path().join(format!("par-{dropout}"));
        run(args(&sequential, dropout, "1", "2"));
        run(args(&parallel, dropout, "2", "1"));
        let (a, b) = (losses(&sequential), losses(&parallel));
        assert_eq!(a.len(), total as usize);
        assert_eq!(
            a, b,
            "dropout {dropout}: every step's loss, gradient norm and commitment match"
        );
        assert!(
            final_weights(&sequential, total) == final_weights(&parallel, total),
            "dropout {dropout}: final weights differ"
        );
        runs.push(a);
    }
    assert_ne!(runs[0], runs[1], "dropout 0.2 must change the losses");

    // Evaluation on two threads scores the same tokens to the same loss
    // (up to the summation order of the row groups).
    let eval = |workers: &str| -> serde_json::Value {
        serde_json::from_str(&ok(&[
            "eval",
            "--checkpoint",
            parallel.to_str().unwrap(),
            "--json",
            "--workers",
            workers,
        ]))
        .unwrap()
    };
    let (one, two) = (eval("1"), eval("2"));
    assert_eq!(one["tokens"], two["tokens"]);
    let (l1, l2) = (one["loss"].as_f64().unwrap(), two["loss"].as_f64().unwrap());
    assert!((l1 - l2).abs() < 1e-5 * l1, "eval loss {l1} vs {l2}");

    // A checkpoint's carried states belong to its shard layout.
    let mut resume = args(&parallel, "0.2", "1", "1");
    resume.extend(["--resume", "--set", "train.steps=6"].map(String::from));
    fails(
        &resume.iter().map(String::as_str).collect::<Vec<_>>(),
        "train.workers",
    );
}

#[test]
fn eval_sample_and_export_on_a_trained_run() {
    let dir = tempfile::tempdir().unwrap();
    let config = tiny_config(dir.path(), 6, 3);
    let run = dir.path().join("run");
    let run_s = run.to_str().unwrap();
    let out = ok(&[
        "train",
        "--config",
        config.to_str().unwrap(),
        "--run-dir",
        run_s,
        "--quiet",
    ]);
    assert!(
        out.contains("bits/byte"),
        "training ends with a validation line: {out}"
    );
    let png = std::fs::read(run.join("loss.png")).expect("training draws loss.png");
    assert_eq!(&png[..4], b"\x89PNG");
    let replot = dir.path().join("curves.png");
    ok(&[
        "plot",
        "--run-dir",
        run_s,
        "--out",
        replot.to_str().unwrap(),
    ]);
    assert!(replot.exists(), "tvq plot draws on demand");
    // Several runs (here the same one twice) on one chart need --out.
    fails(&["plot", "--run-dir", run_s, "--run-dir", run_s], "--out");
    let compared = dir.path().join("compared.png");
    let compared_s = compared.to_str().unwrap();
    ok(&[
        "plot",
        "--run-dir",
        run_s,
        "--run-dir",
        run_s,
        "--out",
        compared_s,
    ]);
    assert!(compared.exists(), "tvq plot compares runs");

    let report: serde_json::Value =
        serde_json::from_str(&ok(&["eval", "--checkpoint", run_s, "--json"])).unwrap();
    let validation_bytes = 400_000 * 19 / 20 - 400_000 * 9 / 10;
    assert_eq!(
        report["tokens"], validation_bytes,
        "the whole validation split is scored"
    );
    assert_eq!(report["complete"], true);
    assert_eq!(report["step"], 6);
    let bpb = report["bits_per_byte"].as_f64().unwrap();
    assert!(bpb > 1.0 && bpb < 8.5, "bits per byte {bpb}");
    let test: serde_json::Value = serde_json::from_str(&ok(&[
        "eval",
        "--checkpoint",
        run_s,
        "--split",
        "test",
        "--json",
    ]))
    .unwrap();
    assert_eq!(test["split"], "test");
    // A cache limit as large as a training sequence's cache (128 - 2 x 16
    // keys) changes nothing within training-length sequences, and changes
    // the score of rows carried far beyond them; 0 is no limit.
    let bits = |extra: &[&str]| -> f64 {
        let args = [&["eval", "--checkpoint", run_s, "--json"], extra].concat();
        let v: serde_json::Value = serde_json::from_str(&ok(&args)).unwrap();
        v["bits_per_byte"].as_f64().unwrap()
    };
    assert_eq!(
        bits(&["--reset-every", "128", "--cache-limit", "96"]),
        bits(&["--reset-every", "128"])
    );
    assert_eq!(bits(&["--cache-limit", "0"]), bpb);
    assert_ne!(bits(&["--cache-limit", "96"]), bpb);
    // So does a code limit: no code of such a cache holds more than its 96
    // keys, and carried rows' codes do.
    assert_eq!(
        bits(&["--reset-every", "128", "--code-limit", "96"]),
        bits(&["--reset-every", "128"])
    );
    assert_eq!(bits(&["--code-limit", "0"]), bpb);
    assert_ne!(bits(&["--code-limit", "1"]), bpb);
    // The composed ops (the oracle) score as the default's fused kernels
    // do, within rounding in another summation order.
    let composed = bits(&["--kernels", "composed"]);
    assert!((composed - bpb).abs() < 1e-5, "{composed} against {bpb}");
    // A device list is checked as training checks it (scoring on two
    // devices is tested in the train crate, on two wgpu adapters).
    fails(
        &["eval", "--checkpoint", run_s, "--device", "cpu,cpu"],
        "--device names cpu twice",
    );

    // Loss by position: buckets that cover every token, the same total, a
    // PNG; with where the attention went (which the kernels do not
    // report, so the composed ops run), which changes no loss.
    let positions = dir.path().join("positions.json");
    let by_position: serde_json::Value = serde_json::from_str(&ok(&[
        "eval",
        "--checkpoint",
        run_s,
        "--json",
        "--by-position",
        positions.to_str().unwrap(),
        "--attention",
    ]))
    .unwrap();
    assert_eq!(by_position["bits_per_byte"].as_f64(), Some(composed));
    let shares = |a: &serde_json::Value| -> Vec<f64> {
        let share = a["share"].as_array().unwrap();
        share.iter().map(|x| x.as_f64().unwrap()).collect()
    };
    let sublayers = by_position["attention"].as_array().unwrap();
    assert_eq!(sublayers.len(), 2, "one entry per GAU sublayer");
    for a in sublayers {
        let s = shares(a);
        assert!((s.iter().sum::<f64>() - 1.0).abs() < 1e-4, "{a}");
        assert!(s.iter().all(|&x| x > 0.0), "every group is used: {a}");
        let entropy = a["entropy"].as_array().unwrap();
        assert!(entropy.iter().all(|x| x.as_f64().unwrap() >= -1e-6), "{a}");
    }
    let buckets: Vec<serde_json::Value> =
        serde_json::from_slice(&std::fs::read(&positions).unwrap()).unwrap();
    assert_eq!(
        serde_json::Value::from(buckets.clone()),
        by_position["by_position"]
    );
    let counted: u64 = buckets.iter().map(|b| b["tokens"].as_u64().unwrap()).sum();
    assert_eq!(counted, validation_bytes as u64);
    let nats: f64 = buckets
        .iter()
        .map(|b| b["bits_per_token"].as_f64().unwrap() * b["tokens"].as_f64().unwrap())
        .sum::<f64>()
        * std::f64::consts::LN_2;
    let loss = report["loss"].as_f64().unwrap() * validation_bytes as f64;
    assert!((nats - loss).abs() < 1e-3 * loss, "{nats} vs {loss}");
    assert_eq!(buckets[0]["first"], 1);
    // Blocks of 16: the first 16 tokens see only their own block, tokens
    // from 33 on (beyond two blocks) also the compressed cache.
    for b in &buckets {
        let last = b["last"].as_u64().unwrap();
        for a in b["attention"].as_array().unwrap() {
            let s = shares(a);
            if last <= 16 {
                assert!((s[0] - 1.0).abs() < 1e-6, "{b}");
            }
            if b["first"].as_u64().unwrap() > 32 {
                assert!(s[2] > 0.0, "{b}");
            }
        }
    }
    let png = std::fs::read(positions.with_extension("png")).expect("a PNG beside the JSON");
    assert_eq!(&png[..4], b"\x89PNG");
    // Resetting the state every segment scores the same tokens with less context.
    let reset: serde_json::Value = serde_json::from_str(&ok(&[
        "eval",
        "--checkpoint",
        run_s,
        "--json",
        "--reset-every",
        "64",
    ]))
    .unwrap();
    assert_eq!(reset["tokens"], report["tokens"]);
    assert_eq!(reset["reset_every"], 64);
    assert_ne!(reset["loss"], report["loss"]);
    fails(
        &["eval", "--checkpoint", run_s, "--reset-every", "50"],
        "--reset-every",
    );

    let sample = |seed: &str, extra: &[&str]| {
        let args = [
            "sample",
            "--checkpoint",
            run_s,
            "--prompt",
            "And God",
            "--max-tokens",
            "40",
            "--seed",
            seed,
        ];
        ok(&[&args[..], extra].concat())
    };
    let (a, b, c) = (sample("3", &[]), sample("3", &[]), sample("4", &[]));
    assert_eq!(a, b, "sampling is reproducible for a seed");
    assert_ne!(a, c, "another seed, another sample");
    assert!(a.starts_with("And God"));
    // A long sample streamed line by line reads as the batch decodes it whole.
    let long = |n: &str, extra: &[&str]| {
        let args = [
            "sample",
            "--checkpoint",
            run_s,
            "--max-tokens",
            "400",
            "--seed",
            "5",
            "--num-samples",
            n,
        ];
        ok(&[&args[..], extra].concat())
    };
    let streamed = long("1", &[]);
    assert!(streamed.trim_end().contains('\n'), "{streamed}");
    // Sampling reads the limits too: a code that weighs one key changes
    // the distributions a 400-token sample draws from.
    assert_ne!(long("1", &["--code-limit", "1"]), streamed);
    let batched = long("2", &[]);
    let first = batched.split("--- sample 2 ---").next().unwrap();
    assert_eq!(first, format!("--- sample 1 ---\n{streamed}"));
    // --no-echo prints the same continuation without the prompt.
    let continuation = sample("3", &["--no-echo"]);
    assert_eq!(Some(continuation.as_str()), a.strip_prefix("And God"));
    // Three samples in one batch: the first is the single sample of the seed.
    let three = sample("3", &["--num-samples", "3"]);
    let texts: Vec<&str> = three.split("--- sample ").skip(1).collect();
    assert_eq!(texts.len(), 3, "{three}");
    assert_eq!(texts[0].strip_prefix("1 ---\n").unwrap(), a, "{three}");
    assert_ne!(texts[1], texts[2]);
    // Two prompts of different lengths: each as it would be alone.
    let two = sample("3", &["--prompt", "In the beginning", "--num-samples", "3"]);
    assert!(
        two.contains("--- prompt 2, sample 3 ---\nIn the beginning"),
        "{two}"
    );
    let first = two.split("--- prompt 1, sample 2 ---").next().unwrap();
    assert_eq!(first, format!("--- prompt 1, sample 1 ---\n{a}"), "{two}");
    let two_bare = sample(
        "3",
        &[
            "--prompt",
            "In the beginning",
            "--num-samples",
            "3",
            "--no-echo",
        ],
    );
    assert_eq!(
        two_bare,
        two.replace("---\nAnd God", "---\n")
            .replace("---\nIn the beginning", "---\n")
    );
    // A prompt file holds the same prompt as the flag: the same samples.
    let file = dir.path().join("prompt.txt");
    std::fs::write(&file, "In the beginning").unwrap();
    let from_file = sample(
        "3",
        &[
            "--prompt-file",
            file.to_str().unwrap(),
            "--num-samples",
            "3",
        ],
    );
    assert_eq!(from_file, two);
    fails(
        &[
            "sample",
            "--checkpoint",
            run_s,
            "--prompt-file",
            "nowhere.txt",
        ],
        "nowhere.txt",
    );

    let weights = dir.path().join("model.safetensors");
    ok(&[
        "export",
        "--checkpoint",
        run_s,
        "--out",
        weights.to_str().unwrap(),
    ]);
    let bytes = std::fs::read(&weights).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let names = st.names();
    assert!(names.contains(&"sublayers.0.kvg_proj.weight"), "{names:?}");
    assert!(names.contains(&"sublayers.1.quantizer.c_sum"));
    let info: serde_json::Value =
        serde_json::from_slice(&std::fs::read(weights.with_extension("json")).unwrap()).unwrap();
    assert_eq!(info["model"]["vocab_size"], 259);
    // The export evaluates exactly like the checkpoint it came from.
    let from_export: serde_json::Value = serde_json::from_str(&ok(&[
        "eval",
        "--checkpoint",
        weights.to_str().unwrap(),
        "--config",
        config.to_str().unwrap(),
        "--json",
    ]))
    .unwrap();
    assert_eq!(from_export["loss"], report["loss"]);

    // The same export against a corpus of another vocabulary is refused.
    let tokenizer = dir.path().join("bpe.json");
    ok(&[
        "tokenizer",
        "train",
        "--corpus",
        repo().join("data/pg19-sample").to_str().unwrap(),
        "--kind",
        "bpe",
        "--vocab-size",
        "300",
        "--out",
        tokenizer.to_str().unwrap(),
    ]);
    let tokenized = dir.path().join("tokenized.toml");
    let text = std::fs::read_to_string(&config).unwrap();
    let tokenizer_line = format!("[data]\ntokenizer = \"{}\"", tokenizer.display());
    std::fs::write(&tokenized, text.replace("[data]", &tokenizer_line)).unwrap();
    fails(
        &[
            "eval",
            "--checkpoint",
            weights.to_str().unwrap(),
            "--config",
            tokenized.to_str().unwrap(),
        ],
        "vocabulary of 259 tokens",
    );
}

#[test]
fn bad_input_is_a_one_line_error() {
    let dir = tempfile::tempdir().unwrap();
    let config = tiny_config(dir.path(), 2, 1);
    let text = std::fs::read_to_string(&config).unwrap();
    let write = |name: &str, body: String| {
        let p = dir.path().join(name);
        std::fs::write(&p, body).unwrap();
        p.to_str().unwrap().to_string()
    };
    let unknown = write(
        "unknown.toml",
        text.replace("[train]", "[train]\nlearning_rate = 1.0"),
    );
    fails(&["train", "--config", &unknown], "learning_rate");
    let missing = write("missing.toml", text.replace("kjv-small.txt", "nowhere.txt"));
    fails(
        &[
            "train",
            "--config",
            &missing,
            "--run-dir",
            dir.path().join("r0").to_str().unwrap(),
        ],
        "nowhere.txt",
    );
    let c = config.to_str().unwrap();
    fails(
        &["train", "--config", c, "--set", "model.block_len=48"],
        "update_len",
    );
    fails(
        &["train", "--config", c, "--set", "model.n_code=1"],
        "n_code",
    );
    fails(&["train", "--config", c, "--device", "cuda:7"], "cuda:7");
    let r1 = dir.path().join("r1");
    let r1 = r1.to_str().unwrap();
    fails(
        &[
            "train",
            "--config",
            c,
            "--run-dir",
            r1,
            "--device",
            "cpu,cpu",
        ],
        "names cpu twice",
    );
    assert!(
        !Path::new(r1).exists(),
        "nothing is written before the check"
    );
    fails(
        &["train", "--config", "/no/such/config.toml"],
        "config.toml",
    );
    fails(
        &["train", "--config", c, "--run-dir", "/proc/tvq-run"],
        "/proc/tvq-run",
    );
    // A diverging run stops at the first non-finite loss and names the last good checkpoint.
    let diverged = dir.path().join("diverged");
    let diverged_s = diverged.to_str().unwrap();
    let blow_up = [
        "train.lr=1e30",
        "train.warmup_steps=0",
        "train.grad_clip=0",
        "train.checkpoint_every=1",
    ];
    let mut args = vec!["train", "--config", c, "--run-dir", diverged_s, "--quiet"];
    for s in &blow_up {
        args.extend(["--set", s]);
    }
    fails(&args, "the last good checkpoint is kept in");
    assert!(
        !checkpoint_list(&diverged).is_empty(),
        "the good checkpoints stay"
    );

    // A run directory holding another config's checkpoints is refused.
    let run = dir.path().join("run");
    let run_s = run.to_str().unwrap();
    ok(&["train", "--config", c, "--run-dir", run_s, "--quiet"]);
    fails(
        &[
            "train",
            "--config",
            c,
            "--run-dir",
            run_s,
            "--set",
            "model.d_k=8",
            "--resume",
        ],
        "--force",
    );
    fails(&["train", "--config", c, "--run-dir", run_s], "--resume");

    // A corrupt newest checkpoint is skipped with a warning on resume.
    let newest = run.join("checkpoints/step-00000002/model.safetensors");
    std::fs::write(&newest, b"corrupt").unwrap();
    let out = succeeds(Command::new(TVQ).args([
        "train",
        "--config",
        c,
        "--run-dir",
        run_s,
        "--resume",
        "--quiet",
    ]));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("skipping"),
        "a warning names the skipped checkpoint"
    );
    fails(
        &[
            "eval",
            "--checkpoint",
            dir.path().join("nothing").to_str().unwrap(),
        ],
        "nothing",
    );
    fails(&["sample", "--checkpoint", run_s, "--top-p", "0"], "top-p");
    fails(
        &["sample", "--checkpoint", run_s, "--num-samples", "0"],
        "--num-samples",
    );
    fails(
        &["sample", "--checkpoint", run_s, "--max-tokens", "0"],
        "--max-tokens",
    );
    fails(
        &["eval", "--checkpoint", run_s, "--workers", "0"],
        "--workers",
    );
    // Benchmark sizes of zero are refused before a model is built.
    fails(&["bench", "--seq-len", "512,0"], "--seq-len");
    fails(&["bench", "--generate", "--batch", "0"], "--batch");
    fails(&["bench", "--steps", "0"], "--steps");
    // A length the block length does not divide: the error alone, before
    // any table header.
    let args = [
        "bench",
        "products",
        "--seq-len",
        "256,100",
        "--device",
        "cpu",
    ];
    let out = tvq(&args);
    assert_one_error_line(
        &format!("tvq {args:?}"),
        &out,
        "not a multiple of the block length",
    );
    assert_eq!(out.stdout, b"", "nothing printed before the error");
}

/// Waits until the run in `run` has logged 3 lines, then sends `child`
/// SIGINT as a terminal's Ctrl-C would.
fn interrupt_once_under_way(run: &Path, child: &mut std::process::Child) {
    signal_once_under_way(run, child, "INT");
}

/// Waits until the run in `run` has logged 3 lines, then sends `child` the
/// signal `name`.
fn signal_once_under_way(run: &Path, child: &mut std::process::Child, name: &str) {
    wait_for(child, "3 metrics lines", || metrics_lines(run) >= 3);
    send_signal(child, name);
}

/// A tiny `tvq train` of 100,000 steps, there to be stopped, in a fresh
/// directory (kept while the returned guard lives), its output piped: the
/// directory, the run directory and the process.
fn endless_run() -> (tempfile::TempDir, PathBuf, std::process::Child) {
    let dir = tempfile::tempdir().unwrap();
    let config = tiny_config(dir.path(), 100_000, 100_000);
    let run = dir.path().join("run");
    let child = spawn_train(config.to_str().unwrap(), &run, std::process::Stdio::piped);
    (dir, run, child)
}

/// Sends `child` the signal `name` (`kill -NAME`).
fn send_signal(child: &std::process::Child, name: &str) {
    let status = Command::new("kill")
        .args([&format!("-{name}"), &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
}

/// An interrupted `tvq train` (`who`) exited cleanly and said how to continue.
fn assert_stopped_cleanly(out: &std::process::Output, who: &str) {
    assert!(
        out.status.success(),
        "{who} exits cleanly: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("--resume"),
        "{who} says how to continue"
    );
}

/// The run in `run` has a checkpoint at its last logged step.
fn assert_checkpoint_at_last_step(run: &Path) {
    let steps = losses(run).len() as u64;
    let checkpoint = run.join(format!("checkpoints/step-{steps:08}/manifest.json"));
    assert!(
        checkpoint.exists(),
        "a checkpoint at the last finished step ({steps})"
    );
}

#[test]
fn ctrl_c_writes_a_checkpoint_and_exits_cleanly() {
    let (_dir, run, mut child) = endless_run();
    interrupt_once_under_way(&run, &mut child);
    assert_stopped_cleanly(&child.wait_with_output().unwrap(), "tvq train");
    assert_checkpoint_at_last_step(&run);
}

#[test]
fn sigterm_writes_a_checkpoint_and_exits_cleanly() {
    let (_dir, run, mut child) = endless_run();
    signal_once_under_way(&run, &mut child, "TERM");
    assert_stopped_cleanly(&child.wait_with_output().unwrap(), "tvq train");
    assert_checkpoint_at_last_step(&run);
}

/// `nohup` keeps a run going when its terminal closes (SIGHUP ignored),
/// and Ctrl-C still stops it with a checkpoint.
#[test]
fn under_nohup_a_hangup_leaves_the_run_going() {
    let dir = tempfile::tempdir().unwrap();
    let config = tiny_config(dir.path(), 100_000, 100_000);
    let run = dir.path().join("run");
    let mut child = Command::new("nohup")
        .args([TVQ, "train", "--config", config.to_str().unwrap()])
        .args(["--run-dir", run.to_str().unwrap(), "--quiet"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    wait_for(&mut child, "3 metrics lines", || metrics_lines(&run) >= 3);
    send_signal(&child, "HUP");
    let after = metrics_lines(&run);
    wait_for(&mut child, "more steps after the hangup", || {
        metrics_lines(&run) >= after + 3
    });
    send_signal(&child, "INT");
    assert_stopped_cleanly(&child.wait_with_output().unwrap(), "tvq train under nohup");
    assert_checkpoint_at_last_step(&run);
}

/// GNU `timeout -s INT` signals its child, then its process group: the
/// same interrupt twice. A second signal right after the first has been
/// handled (as a multi-threaded process may handle both) must not count as
/// a second Ctrl-C, which exits without a checkpoint.
#[test]
fn an_interrupt_delivered_twice_still_writes_its_checkpoint() {
    use std::io::BufRead;
    let (_dir, run, mut child) = endless_run();
    let stderr = std::io::BufReader::new(child.stderr.take().unwrap());
    let (heard, handled) = std::sync::mpsc::channel();
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        for line in stderr.lines().map_while(Result::ok) {
            if line.starts_with("interrupt:") {
                heard.send(()).ok();
            }
            text += &line;
            text.push('\n');
        }
        text
    });
    interrupt_once_under_way(&run, &mut child);
    handled
        .recv_timeout(std::time::Duration::from_secs(60))
        .expect("tvq train says it is stopping");
    send_signal(&child, "INT");
    let out = child.wait_with_output().unwrap();
    let stderr = reader.join().unwrap();
    assert!(out.status.success(), "tvq train exits cleanly: {stderr}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("--resume"));
    assert_checkpoint_at_last_step(&run);
}

/// The fixture tensor `name` as f32 (int32 tensors converted).
fn fixture_tensor(file: &Path, name: &str) -> (Vec<usize>, Vec<f32>) {
    let bytes = std::fs::read(file).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let view = st.tensor(name).unwrap();
    let data = view
        .data()
        .chunks_exact(4)
        .map(|c| {
            let c = [c[0], c[1], c[2], c[3]];
            match view.dtype() {
                safetensors::Dtype::I32 => i32::from_le_bytes(c) as f32,
                _ => f32::from_le_bytes(c),
            }
        })
        .collect();
    (view.shape().to_vec(), data)
}

#[test]
fn an_imported_official_checkpoint_reproduces_the_official_log_probs() {
    use burn::prelude::*;
    let dir = tempfile::tempdir().unwrap();
    let fixture = repo().join("crates/model/tests/fixtures/official-gtc0");
    let (config, weights) = (
        fixture.join("config.json"),
        fixture.join("eval.safetensors"),
    );
    let out = dir.path().join("official.safetensors");
    let out_s = out.to_str().unwrap();
    let import = |config: &Path, weights: &Path| -> Vec<String> {
        ["import", "--official-config", config.to_str().unwrap()]
            .into_iter()
            .chain(["--weights", weights.to_str().unwrap(), "--out", out_s])
            .map(String::from)
            .collect()
    };
    let run = |args: Vec<String>| ok(&args.iter().map(String::as_str).collect::<Vec<_>>());
    run(import(&config, &weights));

    // The export loads back and scores the fixture's text as the official
    // code did.
    let device = tvq_train::placement::device::DeviceSpec::Cpu
        .init()
        .unwrap()
        .0;
    let (info, model) = tvq_train::inference::export::load_export(&out, &device).unwrap();
    assert_eq!((info.vocab.as_str(), info.step), ("bytes+3", 0));
    let (shape, inputs) = fixture_tensor(&weights, "inputs");
    let inputs: Vec<i64> = inputs.iter().map(|&x| x as i64).collect();
    let inputs = Tensor::<tvq_train::placement::B, 2, Int>::from_data(
        TensorData::new(inputs, [shape[0], shape[1]]),
        &device,
    );
    let logits = model
        .forward(inputs, model.empty_state(), tvq_model::Pass::new())
        .unwrap()
        .logits
        .unwrap();
    let logprobs: Vec<f32> = burn::tensor::activation::log_softmax(logits, 2)
        .into_data()
        .to_vec()
        .unwrap();
    let (_, want) = fixture_tensor(&weights, "logprobs");
    let worst = tvq_testkit::max_abs_diff(&logprobs, &want);
    assert!(worst <= 1e-4, "log-probs differ by {worst}");

    // Sampling and evaluation take the import like any export.
    ok(&["sample", "--checkpoint", out_s, "--max-tokens", "8"]);
    let corpus = tiny_config(dir.path(), 1, 1);
    let eval = ok(&[
        "eval",
        "--checkpoint",
        out_s,
        "--config",
        corpus.to_str().unwrap(),
        "--json",
    ]);
    let eval: serde_json::Value = serde_json::from_str(&eval).unwrap();
    assert!(eval["bits_per_byte"].as_f64().unwrap().is_finite());

    // A flax tree saved whole, parameters under `params/`, imports the same.
    let bytes = std::fs::read(&weights).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let prefixed: Vec<(String, safetensors::tensor::TensorView)> = st
        .tensors()
        .into_iter()
        .map(|(name, view)| (format!("params/{name}"), view))
        .collect();
    let nested = dir.path().join("nested.safetensors");
    safetensors::serialize_to_file(prefixed, None, &nested).unwrap();
    let first = tensors_of(&out);
    run(import(&config, &nested));
    assert!(
        tensors_of(&out) == first,
        "params/ prefix changes the import"
    );

    // Wrong files are one-line errors naming them.
    let bad = |config: &Path, weights: &Path, needle: &str| {
        let args = import(config, weights);
        fails(&args.iter().map(String::as_str).collect::<Vec<_>>(), needle);
    };
    bad(&config, &config, "not a safetensors file");
    bad(&weights, &weights, "not JSON");
    let mut json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&config).unwrap()).unwrap();
    json["config"]["mem_len"] = 16.into();
    let changed = dir.path().join("mem_len.json");
    std::fs::write(&changed, json.to_string()).unwrap();
    bad(&changed, &weights, "mem_len");
    json["config"]["mem_len"] = 8.into();
    json["config"]["d_model"] = 32.into();
    std::fs::write(&changed, json.to_string()).unwrap();
    bad(&changed, &weights, "has shape");
}

/// Copies the directory tree `from` to `to`.
fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let path = entry.unwrap().path();
        let target = to.join(path.file_name().unwrap());
        if path.is_dir() {
            copy_tree(&path, &target);
        } else {
            std::fs::copy(&path, &target).unwrap();
        }
    }
}

/// A copy of the committed run directory `fixtures/NAME` in `dir`, its
/// corpus the first 400,000 bytes of the KJV; returns the run directory.
fn fixture_run(dir: &Path, name: &str) -> PathBuf {
    let run = dir.join(name);
    copy_tree(&crate_dir().join("tests/fixtures").join(name), &run);
    let corpus = dir.join("kjv-small.txt");
    let text = std::fs::read(repo().join("data/kjv.txt")).unwrap();
    std::fs::write(&corpus, &text[..400_000]).unwrap();
    let config = run.join("config.toml");
    let toml = std::fs::read_to_string(&config).unwrap();
    std::fs::write(&config, toml.replace("CORPUS", corpus.to_str().unwrap())).unwrap();
    run
}

/// Runs of each checkpoint format evaluate and resume, continuing as they
/// did when the format was current: the bits per byte, and the resumed
/// steps' loss, gradient norm and commitment, equal what was logged then
/// (format 1: the release before format 2 resuming this very directory;
/// format 2: an uninterrupted run of the fixture's config). Equal to float
/// rounding, not bit for bit: the matrix kernels' accumulation order follows
/// the CPU's vector width (AVX-512 or AVX2), so two machines part in the
/// seventh digit, while a misread tensor or optimizer moment moves these
/// figures by far more. (Bit-exact resume on one machine is
/// `killed_and_resumed_training_equals_uninterrupted_training`.) A resumed
/// format-1 run writes format 2.
#[test]
fn a_run_written_by_an_earlier_version_evaluates_and_resumes() {
    let logged = [
        (
            "run-format-1",
            8.589750307821747,
            [
                [5.8521983801841735, 0.8489067592440278, 4.241644859313965],
                [5.878555007719994, 0.7602364618337236, 3.773648977279663],
            ],
        ),
        (
            "run-format-2",
            8.587114965655022,
            [
                [5.861923299312592, 0.8420039229879258, 4.16837215423584],
                [5.88014134759903, 0.7562802348122404, 3.6630029678344727],
            ],
        ),
    ];
    let close = |got: f64, want: f64| (got - want).abs() <= 1e-5 * want.abs();
    for (name, bits_per_byte, want) in logged {
        let dir = tempfile::tempdir().unwrap();
        let run = fixture_run(dir.path(), name);
        let config = run.join("config.toml");
        let (run_s, config_s) = (run.to_str().unwrap(), config.to_str().unwrap());
        let eval: serde_json::Value =
            serde_json::from_str(&ok(&["eval", "--checkpoint", run_s, "--json"])).unwrap();
        assert_eq!(eval["step"], 2, "{name}");
        let got = eval["bits_per_byte"].as_f64().unwrap();
        assert!(
            close(got, bits_per_byte),
            "{name}: {got} bits per byte, logged {bits_per_byte}"
        );
        ok(&[
            "train",
            "--config",
            config_s,
            "--run-dir",
            run_s,
            "--resume",
            "--quiet",
        ]);
        let resumed = losses(&run);
        assert_eq!(
            resumed.iter().map(|(step, _)| *step).collect::<Vec<_>>(),
            [3, 4],
            "{name}: the run goes on from its step 2"
        );
        for ((step, line), want) in resumed.iter().zip(want) {
            let got: Vec<f64> = line.split(' ').map(|x| x.parse().unwrap()).collect();
            assert!(
                got.iter().zip(want).all(|(&g, w)| close(g, w)),
                "{name}: step {step} logged loss, gradient norm and commitment {got:?}, \
                 as before {want:?}"
            );
        }
        let manifest: serde_json::Value = serde_json::from_slice(
            &std::fs::read(run.join("checkpoints/step-00000004/manifest.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(manifest["format"], 2, "{name}: {manifest}");
    }
}

/// `tvq eval --json`'s loss of the export `weights` on the corpus of `config`.
fn export_loss(weights: &Path, config: &Path) -> f64 {
    let out = ok(&[
        "eval",
        "--checkpoint",
        weights.to_str().unwrap(),
        "--config",
        config.to_str().unwrap(),
        "--json",
    ]);
    serde_json::from_str::<serde_json::Value>(&out).unwrap()["loss"]
        .as_f64()
        .unwrap()
}

/// A safetensors file's metadata.
type Metadata = std::collections::HashMap<String, String>;
/// A safetensors tensor as stored: name, type, shape, bytes.
type Stored = (String, safetensors::Dtype, Vec<usize>, Vec<u8>);

/// The safetensors `bytes` written again after `change` on their metadata
/// and tensors.
fn rewritten_safetensors(
    bytes: &[u8],
    change: impl FnOnce(&mut Metadata, &mut Vec<Stored>),
) -> Vec<u8> {
    use safetensors::{SafeTensors, tensor::TensorView};
    let (_, header) = SafeTensors::read_metadata(bytes).unwrap();
    let mut meta = header.metadata().clone().unwrap_or_default();
    let file = SafeTensors::deserialize(bytes).unwrap();
    let mut tensors: Vec<Stored> = file
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec()))
        .collect();
    change(&mut meta, &mut tensors);
    let views: Vec<_> = tensors
        .iter()
        .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize(views, Some(meta)).unwrap()
}

/// `weights` rewritten with tensor `name` stored as `dtype`: its F32
/// values converted (BF16, F16), or its bytes declared as that type (I32,
/// U8: what a careless or hostile writer could do).
fn retyped(weights: &Path, name: &str, dtype: safetensors::Dtype) -> Vec<u8> {
    use safetensors::Dtype;
    rewritten_safetensors(&std::fs::read(weights).unwrap(), |_, tensors| {
        let (_, stored, shape, data) = tensors.iter_mut().find(|t| t.0 == name).unwrap();
        if dtype == Dtype::BF16 {
            *data = data
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .flat_map(|x| ((x.to_bits() >> 16) as u16).to_le_bytes())
                .collect();
        }
        if dtype == Dtype::U8 {
            *shape = vec![data.len()];
        }
        *stored = dtype;
    })
}

/// An export whose tensor is declared another type than F32 is refused
/// with one line naming the tensor (before burn's loader, which panicked
/// and then spun forever on it); one stored as BF16 loads, widened, and
/// scores about as the F32 original.
#[test]
fn exports_of_other_tensor_types_are_refused_or_widened() {
    use safetensors::Dtype;
    let dir = tempfile::tempdir().unwrap();
    let run = fixture_run(dir.path(), "run-format-2");
    let export = dir.path().join("m.safetensors");
    let (run_s, export_s) = (run.to_str().unwrap(), export.to_str().unwrap());
    ok(&["export", "--checkpoint", run_s, "--out", export_s]);
    let config = run.join("config.toml");
    let eval = |weights: &Path| export_loss(weights, &config);
    let original = eval(&export);
    let info = std::fs::read(export.with_extension("json")).unwrap();
    let name = "sublayers.0.kvg_proj.weight";
    for (dtype, tag) in [
        (Dtype::I32, "I32"),
        (Dtype::U8, "U8"),
        (Dtype::BF16, "BF16"),
    ] {
        let other = dir.path().join(format!("{tag}.safetensors"));
        std::fs::write(&other, retyped(&export, name, dtype)).unwrap();
        std::fs::write(other.with_extension("json"), &info).unwrap();
        if dtype == Dtype::BF16 {
            let widened = eval(&other);
            assert!(
                (widened - original).abs() <= 1e-2 * original,
                "{widened} {original}"
            );
            continue;
        }
        let args = [
            "eval",
            "--checkpoint",
            other.to_str().unwrap(),
            "--config",
            config.to_str().unwrap(),
        ];
        fails(&args, &format!("tensor {name} is stored as {tag}"));
    }
}

/// A checkpoint read with the safetensors crate alone (no burn): every
/// parameter of the config under its path with its shape, float32; both
/// moments of every trained parameter, and its step count; and the step in
/// trainer.json.
#[test]
fn a_checkpoint_reads_without_tvq() {
    let dir = tempfile::tempdir().unwrap();
    let run = fixture_run(dir.path(), "run-format-2");
    let ckpt = run.join("checkpoints/step-00000002");
    let toml: toml::Table = std::fs::read_to_string(run.join("config.toml"))
        .unwrap()
        .parse()
        .unwrap();
    let m = &toml["model"];
    let get = |k: &str| m[k].as_integer().unwrap() as usize;
    let (d, k, v, s, h) = (
        get("d_model"),
        get("d_k"),
        get("d_v"),
        get("n_code"),
        get("n_head"),
    );
    let vocab = 259;
    let mut want: Vec<(String, Vec<usize>)> = vec![
        ("embedding.weight".into(), vec![vocab, d]),
        ("output.weight".into(), vec![d, vocab]),
        ("output.bias".into(), vec![vocab]),
    ];
    assert_eq!(m["bias"].as_str(), Some("xl"));
    for i in 0..2 * get("n_layer") {
        let p = format!("sublayers.{i}");
        want.extend([
            (format!("{p}.input_norm.gain"), vec![d]),
            (format!("{p}.input_norm.bias"), vec![d]),
            (format!("{p}.q_proj.weight"), vec![d, h * k]),
            (format!("{p}.kvg_proj.weight"), vec![d, h * k + 2 * h * v]),
            (format!("{p}.out_proj.weight"), vec![h * v, d]),
            (format!("{p}.quantizer.c_sum"), vec![h, s, k]),
            (format!("{p}.quantizer.c_count"), vec![h, s]),
            (format!("{p}.bias.xl.r_proj.weight"), vec![d, h * k]),
            (format!("{p}.bias.xl.u"), vec![h, k]),
            (format!("{p}.bias.xl.w"), vec![h, k]),
        ]);
    }
    want.sort();
    let read = |file: &str| std::fs::read(ckpt.join(file)).unwrap();
    let model = read("model.safetensors");
    let model = safetensors::SafeTensors::deserialize(&model).unwrap();
    let mut got: Vec<(String, Vec<usize>)> = model
        .tensors()
        .into_iter()
        .map(|(n, t)| {
            assert_eq!(t.dtype(), safetensors::Dtype::F32, "{n}");
            (n, t.shape().to_vec())
        })
        .collect();
    got.sort();
    assert_eq!(got, want);

    let bytes = read("optimizer.safetensors");
    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let meta = header.metadata().clone().unwrap();
    let optim = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    // The codebook statistics follow the EMA, not AdamW: no moments.
    let trained: Vec<&(String, Vec<usize>)> = want
        .iter()
        .filter(|(n, _)| !n.contains(".quantizer."))
        .collect();
    for (name, shape) in &trained {
        let group = if shape.len() >= 2 {
            "decay"
        } else {
            "no_decay"
        };
        for moment in ["m1", "m2"] {
            let t = optim
                .tensor(&format!("{group}/{name}.{moment}"))
                .unwrap_or_else(|_| panic!("{group}/{name}.{moment}"));
            assert_eq!(
                (t.dtype(), t.shape()),
                (safetensors::Dtype::F32, &shape[..])
            );
        }
        assert_eq!(meta[&format!("{group}/{name}.step")], "2", "{name}");
    }
    assert_eq!(optim.len(), 2 * trained.len());
    assert_eq!(meta["decay/step"], "2");
    assert_eq!(
        meta["toeplitz/step"], "0",
        "an XL model has no Toeplitz tables"
    );
    let trainer: serde_json::Value = serde_json::from_slice(&read("trainer.json")).unwrap();
    assert_eq!(trainer["step"], 2);
}

/// A `wsd` or `constant` run stopped before its decay and resumed with
/// `train.steps` doubled trains exactly as one started with the larger
/// `steps` (every loss, the final weights); a cosine one warns that the
/// schedule of the steps already done changed, and goes on differently.
#[test]
fn wsd_and_constant_runs_extend_on_resume_and_a_cosine_one_warns() {
    let dir = tempfile::tempdir().unwrap();
    let config = tiny_config(dir.path(), 6, 2);
    let config = config.to_str().unwrap();
    for schedule in ["wsd", "constant", "cosine"] {
        let train = |run: &Path, steps: u64, extra: &[&str]| -> Output {
            let run_s = run.to_str().unwrap();
            let schedule = format!("train.schedule=\"{schedule}\"");
            let steps = format!("train.steps={steps}");
            let args = [
                &["train", "--config", config, "--run-dir", run_s, "--quiet"][..],
                &["--set", &schedule, "--set", "train.decay_fraction=0.5"],
                &["--set", &steps],
                extra,
            ]
            .concat();
            succeeds(Command::new(TVQ).args(&args))
        };
        let reference = dir.path().join(format!("{schedule}-12"));
        train(&reference, 12, &[]);
        // 6 steps, stopped after 3: warm-up (2) and, for wsd, the last
        // stable step (its decay takes steps 4 to 6).
        let run = dir.path().join(format!("{schedule}-extended"));
        train(&run, 6, &["--max-steps", "3"]);
        let out = train(&run, 12, &["--resume"]);
        let err = String::from_utf8_lossy(&out.stderr);
        let warned = err.contains("the learning-rate schedule changed for steps already done");
        if schedule == "cosine" {
            assert!(warned && err.contains("first at step 3"), "{err}");
            assert_ne!(losses(&run), losses(&reference));
        } else {
            assert!(!warned, "{schedule}: {err}");
            assert_eq!(losses(&run), losses(&reference), "{schedule}");
            assert!(final_weights(&run, 12) == final_weights(&reference, 12));
        }
        assert_eq!(losses(&run).len(), 12);
    }
}

/// `tvq bench --checkpoint DIR` saves, verifies and copies a real
/// checkpoint of the configured model, reports every figure, and leaves
/// nothing behind in DIR.
#[test]
fn bench_times_checkpoints_and_cleans_up() {
    let dir = tempfile::tempdir().unwrap();
    let config = tiny_config(dir.path(), 2, 2);
    let scratch = dir.path().join("scratch");
    std::fs::create_dir_all(&scratch).unwrap();
    let out = ok(&[
        "bench",
        "--config",
        config.to_str().unwrap(),
        "checkpoint",
        scratch.to_str().unwrap(),
        "--steps",
        "2",
        "--json",
    ]);
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["form"], "checkpoint", "{v}");
    // Weights and two moments per trained parameter: more than 2x the
    // weights' bytes of the tiny model (d_model 32).
    assert!(v["bytes"].as_u64().unwrap() > 100_000, "{v}");
    for key in [
        "save_s",
        "verify_s",
        "plain_copy_s",
        "xxh3_gb_per_s",
        "fnv1a_gb_per_s",
    ] {
        assert!(v[key].as_f64().unwrap() > 0.0, "{key}: {v}");
    }
    assert_eq!(
        std::fs::read_dir(&scratch).unwrap().count(),
        0,
        "left behind"
    );
}

#[test]
fn bench_times_the_training_step_of_the_configured_model() {
    let dir = tempfile::tempdir().unwrap();
    let config = tiny_config(dir.path(), 2, 2);
    let config = config.to_str().unwrap();
    let common = [
        "bench",
        "--config",
        config,
        "--form",
        "vq,quadratic",
        "--seq-len",
        "32,64",
        "--batch",
        "2",
        "--steps",
        "1",
        "--json",
        "--set",
        "train.micro_batches=1",
        "--peak-tflops",
        "1",
    ];
    for (extra, step) in [
        (&["step", "--set", "train.workers=2"][..], "full"),
        (&["--set", "model.d_model=16"][..], "forward+backward"),
    ] {
        let out = ok(&[&common[..], extra].concat());
        let lines = parse_json_lines(&out);
        assert_eq!(lines.len(), 4, "{out}");
        for l in &lines {
            assert_eq!(l["step"], step, "{l}");
            assert!(l["tokens_per_s"].as_f64().unwrap() > 0.0, "{l}");
        }
        assert_eq!(lines[0]["workers"], if step == "full" { 2 } else { 1 });
        // The FLOPs per token behind the mfu: the same for VQ at 32 and 64
        // tokens (linear time), growing with the length for quadratic.
        let flops: Vec<f64> = lines
            .iter()
            .map(|l| l["mfu"].as_f64().unwrap() * 1e12 / l["tokens_per_s"].as_f64().unwrap())
            .collect();
        assert!((flops[0] / flops[1] - 1.0).abs() < 1e-9, "{flops:?}");
        assert!(flops[3] > flops[2], "{flops:?}");
    }
    // The old flags that named a benchmark still do, one at a time.
    for args in [&["bench", "peak", "--json"], &["bench", "--peak", "--json"]] {
        let out = ok(args);
        let peak: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
        assert!(peak["flops_per_s"].as_f64().unwrap() > 1e9, "{peak}");
    }
    fails(&["bench", "peak", "--generate"], "one benchmark at a time");
    // Generation: time to the first token and per token, per prompt length.
    let out = ok(&[
        "bench",
        "generate",
        "--config",
        config,
        "--seq-len",
        "5,40",
        "--new-tokens",
        "3",
        "--json",
    ]);
    let lines = parse_json_lines(&out);
    assert_eq!(lines.len(), 2, "{out}");
    for (l, context) in lines.iter().zip([5, 40]) {
        assert_eq!(l["context"], context, "{l}");
        for key in [
            "time_to_first_token_s",
            "per_token_ms",
            "prefill_tokens_per_s",
            "recurrent_tokens_per_s",
        ] {
            assert!(l[key].as_f64().unwrap() > 0.0, "{key}: {l}");
        }
    }
    fails(
        &[&common[..], &["--set", "model.d_modle=16"]].concat(),
        "d_modle",
    );
    fails(
        &[&common[..], &["--set", "train.workers=3"]].concat(),
        "must divide --batch 2",
    );
}

/// A port `p` such that `p..p + n` are free now, below the range the
/// system hands out to outgoing connections (which could take them later).
/// Each call (tests run in parallel) starts past the ports handed out before.
fn free_ports(n: u16) -> u16 {
    use std::sync::atomic::{AtomicU16, Ordering};
    static NEXT: AtomicU16 = AtomicU16::new(0);
    let base = 20_000 + (std::process::id() % 2_000) as u16 * 4;
    loop {
        let p = base + NEXT.fetch_add(n, Ordering::SeqCst) % 10_000;
        let held: Vec<_> = (p..p + n)
            .map_while(|q| std::net::TcpListener::bind(("0.0.0.0", q)).ok())
            .collect();
        if held.len() == n as usize {
            return p;
        }
    }
}

/// Node `rank` of a 2-node `tvq train --quiet` on `config` into `run`,
/// with `extra` arguments; stdout and stderr piped.
fn spawn_node(
    config: &str,
    run: &Path,
    coordinator: &str,
    rank: usize,
    extra: &[String],
) -> std::process::Child {
    node_command(config, run, coordinator, rank, extra)
        .spawn()
        .unwrap()
}

/// The command of node `rank` of a two-node run ([`spawn_node`]), its
/// output piped, to add to before it starts.
fn node_command(
    config: &str,
    run: &Path,
    coordinator: &str,
    rank: usize,
    extra: &[String],
) -> Command {
    let rank = rank.to_string();
    let args = [
        "train",
        "--config",
        config,
        "--run-dir",
        run.to_str().unwrap(),
        "--quiet",
        "--nodes",
        "2",
        "--node-rank",
        &rank,
        "--coordinator",
        coordinator,
    ];
    let mut cmd = Command::new(TVQ);
    cmd.args(args)
        .args(extra)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    cmd
}

#[test]
fn two_processes_train_like_one_and_resume_after_one_dies() {
    let dir = tempfile::tempdir().unwrap();
    let (k, total) = (4u64, 12u64);
    let config = tiny_config(dir.path(), total, k);
    let config = config.to_str().unwrap();
    // Dropout everywhere (residual, layer, the XL sinusoid).
    let sets = [
        "model.bias=xl",
        "model.dropout_sinusoid=0.1",
        "train.micro_batches=1",
    ];
    let with_sets = |mut args: Vec<String>, sets: &[&str]| {
        for s in sets {
            args.extend(["--set".to_string(), s.to_string()]);
        }
        args
    };

    // One process, the batch's two shards one after the other.
    let single = dir.path().join("single");
    let args = [
        "train",
        "--config",
        config,
        "--run-dir",
        single.to_str().unwrap(),
        "--quiet",
    ]
    .map(String::from)
    .to_vec();
    let args = with_sets(args, &sets);
    let mut one_process = args.clone();
    one_process.extend(["--set", "train.micro_batches=2"].map(String::from));
    ok(&one_process.iter().map(String::as_str).collect::<Vec<_>>());

    // Two processes, one shard each.
    let port = free_ports(6);
    let coordinator = format!("127.0.0.1:{port}");
    let nodes = dir.path().join("nodes");
    // Long enough for both nodes to meet on a loaded machine (under the
    // parallel test run node 1 once took more than 5 s to answer node 0's
    // first check), short beside the test's run.
    let node = |rank: usize, resume: bool| {
        let mut extra = vec!["--peer-timeout", "20"];
        if resume {
            extra.push("--resume");
        }
        let args = with_sets(extra.iter().map(|s| s.to_string()).collect(), &sets);
        spawn_node(config, &nodes, &coordinator, rank, &args)
    };
    let mut writer = node(0, false);
    let mut other = node(1, false);
    // Kill node 1 once node 0 has written checkpoint K.
    let marker = nodes.join(format!("checkpoints/step-{k:08}/manifest.json"));
    wait_for(
        &mut writer,
        &format!("node 0's checkpoint at step {k}"),
        || marker.exists(),
    );
    other.kill().unwrap(); // SIGKILL
    other.wait().unwrap();
    let killed_at = Instant::now();
    let out = writer.wait_with_output().unwrap();
    let waited = killed_at.elapsed();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "node 0 must fail without node 1:\n{err}"
    );
    assert!(
        waited < Duration::from_secs(20 + 10),
        "node 0 took {waited:?} to give up (timeout 20 s)"
    );
    let errors: Vec<_> = err.lines().filter(|l| l.starts_with("error")).collect();
    assert_eq!(errors.len(), 1, "one error line:\n{err}");
    assert!(
        errors[0].contains("node 1"),
        "the error names node 1:\n{err}"
    );
    assert!(!err.contains("stack backtrace"), "no backtrace:\n{err}");
    assert!(
        !nodes.join(format!("checkpoints/step-{total:08}")).exists(),
        "the kill must land before the run finishes"
    );

    // Both resume from the last checkpoint and finish.
    let (writer, other) = (node(0, true), node(1, true));
    for (rank, child) in [(0, writer), (1, other)] {
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "resumed node {rank} failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    // Every step's loss, gradient norm and commitment, and the final
    // weights, are those of the single process, bit for bit.
    let (a, b) = (losses(&single), losses(&nodes));
    assert_eq!(a.len(), total as usize);
    assert_eq!(a, b, "two processes must train exactly like one");
    assert!(
        final_weights(&single, total) == final_weights(&nodes, total),
        "final weights differ"
    );

    // The two-shard checkpoint continues in one process with two shards;
    // with one shard it is refused unless the states start afresh.
    let mut more = with_sets(
        [
            "train",
            "--config",
            config,
            "--run-dir",
            nodes.to_str().unwrap(),
            "--quiet",
            "--resume",
        ]
        .map(String::from)
        .to_vec(),
        &sets,
    );
    more.extend(["--set".into(), format!("train.steps={}", total + 1)]);
    fails(
        &more.iter().map(String::as_str).collect::<Vec<_>>(),
        "--reshard",
    );
    more.push("--reshard".into());
    ok(&more.iter().map(String::as_str).collect::<Vec<_>>());
}

#[test]
fn ctrl_c_on_node_0_stops_both_nodes_after_one_step_with_a_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let config = tiny_config(dir.path(), 100_000, 100_000);
    let config = config.to_str().unwrap();
    let run = dir.path().join("run");
    let coordinator = format!("127.0.0.1:{}", free_ports(6));
    let extra = ["--set", "train.micro_batches=1"].map(String::from);
    let mut writer = spawn_node(config, &run, &coordinator, 0, &extra);
    let other = spawn_node(config, &run, &coordinator, 1, &extra);
    interrupt_once_under_way(&run, &mut writer);
    for (rank, child) in [(0, writer), (1, other)] {
        assert_stopped_cleanly(&child.wait_with_output().unwrap(), &format!("node {rank}"));
    }
    assert_checkpoint_at_last_step(&run);
}

#[test]
fn nodes_that_never_meet_or_disagree_fail_with_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let config = tiny_config(dir.path(), 4, 4);
    let config = config.to_str().unwrap();
    let run = dir.path().join("run");
    let one_line_error = |child: std::process::Child, needle: &str| {
        assert_one_error_line("a node", &child.wait_with_output().unwrap(), needle);
    };
    let base = ["--set", "train.micro_batches=1", "--peer-timeout", "3"].map(String::from);

    // Node 1 never starts.
    let coordinator = format!("127.0.0.1:{}", free_ports(6));
    let started = Instant::now();
    one_line_error(
        spawn_node(config, &run, &coordinator, 0, &base),
        "no answer from node 1 within 3 s",
    );
    assert!(started.elapsed() < Duration::from_secs(3 + 10));

    // Node 1 runs another learning rate. Both start, so the nodes meet
    // however loaded the machine: a longer timeout than above, which only
    // a node that never comes would use up.
    let coordinator = format!("127.0.0.1:{}", free_ports(6));
    let patient = ["--set", "train.micro_batches=1", "--peer-timeout", "60"].map(String::from);
    let mut other = patient.to_vec();
    other.extend(["--set", "train.lr=1e-3"].map(String::from));
    let writer = spawn_node(config, &run, &coordinator, 0, &patient);
    let node1 = spawn_node(config, &run, &coordinator, 1, &other);
    one_line_error(writer, "differ in their config");
    one_line_error(node1, "differ in their config");
}

/// The fault suite: injected faults, second writers, damaged files, strangers.
#[path = "cli/faults.rs"]
mod faults;
#[path = "cli/gpu_node.rs"]
mod gpu_node;
/// Hugging Face folders: `transformers` against tvq, and back.
#[path = "cli/hf.rs"]
mod hf;
/// Files from anywhere: forged checkpoints, lying sizes, foreign run directories.
#[path = "cli/hostile.rs"]
mod hostile;
#[path = "cli/layering.rs"]
mod layering;
#[path = "cli/logs.rs"]
mod logs;
#[path = "cli/recall.rs"]
mod recall;
