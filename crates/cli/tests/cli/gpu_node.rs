//! What a GPU node without Rust runs: `tvq check` (on wgpu here, CUDA with
//! `TVQ_TEST_DEVICE=cuda`), the PyTorch reference against tvq, and the
//! bundle's `run.sh --device cpu --small` from a directory with no Rust on
//! the PATH.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use super::{TVQ, parse_json_lines, repo, succeeds, tiny_config, tvq};
use tvq_testkit::{Gpu, python_with};

/// `tvq check --json` on `device`, with `TVQ_FAULT` set to `fault` if given.
fn check(device: &str, fault: Option<&str>) -> (Output, Option<serde_json::Value>) {
    let mut cmd = Command::new(TVQ);
    cmd.args(["check", "--device", device, "--json"]);
    if let Some(f) = fault {
        cmd.env("TVQ_FAULT", f);
    }
    let out = cmd.output().expect("tvq runs");
    let report = serde_json::from_slice(&out.stdout).ok();
    (out, report)
}

/// The checks' names with their verdicts, as `(name, passed, skipped)`.
fn verdicts(report: &serde_json::Value) -> Vec<(String, bool, bool)> {
    report["checks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let tol = c["tolerance"].as_f64().unwrap();
            let worst = c["worst"].as_f64();
            let skipped = c["worst"].is_null();
            (
                c["name"].as_str().unwrap().to_string(),
                skipped || worst.is_some_and(|w| w <= tol),
                skipped,
            )
        })
        .collect()
}

/// Every check passes on the GPU (wgpu: Mesa's lavapipe in CI; bf16 is
/// skipped there, wgpu has none), and a device result made wrong on
/// purpose (the gradients scaled by 1.01, then the generated tokens, then
/// the fused trainer's update) fails the check that compares it, and the
/// command.
#[test]
fn tvq_check_passes_on_the_gpu_and_fails_on_a_wrong_device_result() {
    let gpu = Gpu::under_test();
    let (out, report) = check(gpu.name(), None);
    let err = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() && err.contains("is not available") {
        gpu.missing(
            "tvq_check_passes_on_the_gpu_and_fails_on_a_wrong_device_result",
            &err,
        );
        return;
    }
    assert!(out.status.success(), "{err}");
    let report = report.expect("one JSON object");
    assert_eq!(report["passed"], true);
    let all = verdicts(&report);
    assert!(all.len() >= 10, "{all:?}");
    let ran = all.iter().filter(|(_, _, skipped)| !skipped).count();
    assert!(ran >= 9, "most checks run: {all:?}");
    assert_eq!(report["peaks"].as_array().unwrap().len(), 2);
    assert!(report["peaks"][0]["flops_per_s"].as_f64().unwrap() > 0.0);

    // The 4th comparison is the gradients'; the tokens' is the 10th when
    // bf16's two are skipped (wgpu), the 12th when they run (CUDA); the
    // last is the fused trainer's update (its AdamW kernel).
    let tokens = if all.iter().any(|(n, _, s)| n.contains("bf16") && *s) {
        10
    } else {
        12
    };
    for (nth, wrong) in [
        (4, "gradients of one step"),
        (tokens, "16 generated tokens"),
        (ran, "AdamW step of the fused trainer"),
    ] {
        let (out, report) = check(gpu.name(), Some(&format!("device-result:error@{nth}")));
        assert!(!out.status.success(), "a wrong {wrong} must fail");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("1 of") && err.contains("checks failed"),
            "{err}"
        );
        let failed: Vec<_> = verdicts(&report.unwrap())
            .into_iter()
            .filter(|(_, passed, _)| !passed)
            .map(|(name, ..)| name)
            .collect();
        assert_eq!(failed.len(), 1, "{failed:?}");
        assert!(failed[0].starts_with(wrong), "{failed:?}");
    }
}

/// On the CPU every check compares the CPU with itself: all pass, and the
/// table says so.
#[test]
fn tvq_check_on_the_cpu_is_a_trivial_pass() {
    let out = tvq(&["check", "--device", "cpu"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("| check | largest relative difference"),
        "{text}"
    );
    assert!(!text.contains("FAIL"), "{text}");
    assert!(text.contains("f32 matrix products"), "{text}");
}

/// The Python with PyTorch the tests use ([`python_with`]).
fn python_with_torch(test: &str) -> Option<PathBuf> {
    python_with(test, &["torch"])
}

/// `scripts/torch_reference.py`, written from docs/architecture.md, scores
/// a trained tiny model's export on the corpus's validation split as
/// `tvq eval` does, within 1e-4 relative, with the Toeplitz bias and with
/// the XL bias under a cache limit that binds (the whole split streams
/// through the carried state: previous block and compressed cache).
#[test]
fn the_torch_reference_scores_an_export_as_tvq_does() {
    let test = "the_torch_reference_scores_an_export_as_tvq_does";
    let Some(python) = python_with_torch(test) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let config = tiny_config(dir.path(), 4, 4);
    let corpus = dir.path().join("kjv-small.txt");
    for (name, sets) in [
        ("toeplitz", vec![]),
        ("xl", vec!["model.bias=\"xl\"", "model.cache_limit=40"]),
    ] {
        let run = dir.path().join(name);
        let mut args = vec!["train", "--config", config.to_str().unwrap(), "--quiet"];
        args.extend(["--run-dir", run.to_str().unwrap()]);
        for s in &sets {
            args.extend(["--set", s]);
        }
        super::ok(&args);
        let export = dir.path().join(format!("{name}.safetensors"));
        super::ok(&[
            "export",
            "--checkpoint",
            run.to_str().unwrap(),
            "--out",
            export.to_str().unwrap(),
        ]);
        let tvq_loss = super::export_loss(&export, &run.join("config.toml"));
        let out = succeeds(
            Command::new(&python)
                .arg(repo().join("scripts/torch_reference.py"))
                .args(["eval", "--export", export.to_str().unwrap()])
                .args(["--text", corpus.to_str().unwrap()])
                .args(["--batch-size", "4", "--update-len", "64"]),
        );
        let torch: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let torch_loss = torch["loss"].as_f64().unwrap();
        assert!(
            (torch_loss - tvq_loss).abs() <= 1e-4 * tvq_loss,
            "{name}: PyTorch {torch_loss}, tvq {tvq_loss}"
        );
    }
}

/// The bundle as `scripts/gpu-bundle.sh` makes it, from this build's
/// binary, unpacked and run with `--device cpu --small` where no Rust is
/// on the PATH: every part passes (PyTorch's where torch is installed).
#[test]
fn the_bundle_runs_every_part_small_on_the_cpu_without_rust() {
    let test = "the_bundle_runs_every_part_small_on_the_cpu_without_rust";
    let python = python_with_torch(test);
    let dir = tempfile::tempdir().unwrap();
    succeeds(
        Command::new(repo().join("scripts/gpu-bundle.sh"))
            .arg(dir.path())
            .env("TVQ_BIN", TVQ)
            .env("TVQ_BUNDLE_XZ", "-0"),
    );
    let bundle = dir.path().join("tvq-gpu");
    let size = std::fs::metadata(dir.path().join("tvq-gpu.tar"))
        .unwrap()
        .len();
    assert!(size <= 40 << 20, "the bundle is {size} bytes");
    assert!(
        !bundle.join("bin/tvq").exists(),
        "the binary ships compressed"
    );
    // No cargo or rustc: the system's directories, and torch's Python first.
    let mut path = vec![PathBuf::from("/usr/bin"), PathBuf::from("/bin")];
    if let Some(p) = python.as_ref().and_then(|p| p.parent()) {
        path.insert(0, p.to_path_buf());
    }
    let packed = dir.path().join("results.tar.gz");
    let out = succeeds(
        Command::new(bundle.join("run.sh"))
            .args(["--device", "cpu", "--small", "--pack"])
            .arg(&packed)
            .env("PATH", std::env::join_paths(&path).unwrap())
            .env_remove("CARGO_TARGET_DIR"),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    let results = read_results(&bundle.join("results/results.jsonl"));
    let status = |part: &str| {
        results
            .iter()
            .find(|r| r["form"] == "part" && r["part"] == part)
            .map(|r| r["status"].as_str().unwrap().to_string())
    };
    for part in [
        "first-light",
        "check",
        "train",
        "train-fused",
        "products",
        "generate",
        "quickstart",
    ] {
        assert_eq!(status(part).as_deref(), Some("passed"), "{part}: {stderr}");
    }
    let torch = if python.is_some() {
        "passed"
    } else {
        "skipped"
    };
    assert_eq!(status("torch").as_deref(), Some(torch), "{stderr}");
    // The model's products at its shapes in each pass (the forward one
    // and the backward pass's two gradients), tvq's and (with torch)
    // PyTorch's at the same shapes, side by side in the table.
    let products = |torch: bool| {
        results
            .iter()
            .filter(|r| r["form"] == "products" && r["impl"].is_string() == torch)
            .filter(|r| r["flops_per_s"].as_f64().is_some_and(|f| f > 0.0))
            .map(|r| {
                let text = |key: &str| r[key].as_str().unwrap().to_string();
                (text("name"), text("pass"), r["m"].clone())
            })
            .collect::<Vec<_>>()
    };
    let ours = products(false);
    for pass in ["forward", "grad_left", "grad_right"] {
        assert!(
            ours.iter()
                .any(|(name, p, _)| name == "window scores" && p == pass),
            "{pass}: {ours:?}"
        );
    }
    if python.is_some() {
        assert_eq!(products(true), ours, "PyTorch times every product of tvq's");
    }
    // Figures of each part reached the results and the table.
    // The step, on the CPU's fused kernels (as `auto` and `fused` train).
    assert!(
        results.iter().any(|r| r["form"] == "vq"
            && r["kernels"] == true
            && r["tokens_per_s"].as_f64().is_some()),
        "{results:?}"
    );
    assert!(results.iter().any(|r| r["form"] == "generate"));
    assert!(results.iter().any(|r| r["form"] == "quickstart"));
    if python.is_some() {
        for implementation in ["eager", "compiled", "sdpa"] {
            assert!(
                results
                    .iter()
                    .any(|r| r["impl"] == implementation && r["tokens_per_s"].as_f64().is_some()),
                "PyTorch {implementation}: {results:?}"
            );
        }
    }
    // The parts ran on the bundle's one build, the default.
    let node = results.iter().find(|r| r["form"] == "node").unwrap();
    assert_eq!(node["build"], "default", "{node}");
    let summary = std::fs::read_to_string(bundle.join("results/summary.md")).unwrap();
    assert!(summary.contains("| tvq step"), "{summary}");
    assert!(summary.contains("tvq check on cpu"), "{summary}");
    assert!(summary.contains("| window scores |"), "{summary}");
    // What the products alone cost a step, over the three passes, and
    // PyTorch's at the same shapes where it timed them.
    let floor = "A VQ step's products at T = 512, f32 (forward, grad_left, grad_right): tvq";
    assert!(summary.contains(floor), "{summary}");
    assert_eq!(
        summary.contains(" ms (tvq / PyTorch "),
        python.is_some(),
        "{summary}"
    );
    // --pack: the results directory as one file.
    let listed = Command::new("tar")
        .arg("-tzf")
        .arg(&packed)
        .output()
        .unwrap();
    let listed = String::from_utf8_lossy(&listed.stdout);
    assert!(listed.contains("results/results.jsonl"), "{listed}");
    assert!(listed.contains("results/logs/first-light.log"), "{listed}");
    // A spent budget skips the parts left, each with a line that says so.
    succeeds(
        Command::new(bundle.join("run.sh"))
            .args([
                "--device", "cpu", "--small", "--parts", "check", "--budget", "1",
            ])
            .env("PATH", std::env::join_paths(&path).unwrap()),
    );
    let results = read_results(&bundle.join("results/results.jsonl"));
    let check = results.iter().find(|r| r["part"] == "check").unwrap();
    assert_eq!(check["status"], "skipped", "{check}");
    assert!(check["why"].as_str().unwrap().contains("budget"), "{check}");
    // A build the bundle lacks, or no build at all, is one line and exit 2.
    for (build, said) in [
        ("unfused", "this bundle has no unfused build"),
        ("fast", "--build is default or unfused, not fast"),
    ] {
        let out = Command::new(bundle.join("run.sh"))
            .args(["--device", "cpu", "--small", "--build", build])
            .env("PATH", std::env::join_paths(&path).unwrap())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{build}: {err}");
        assert_eq!(err.trim(), format!("run.sh: {said}"), "{build}");
    }
}

fn read_results(path: &Path) -> Vec<serde_json::Value> {
    parse_json_lines(&std::fs::read_to_string(path).unwrap())
}

/// `tvq bench kernels` reaches the fused attention and quantizer kernels
/// from the binary (every sublayer of the Toeplitz and XL models, dropout
/// on) and the fused passes agree with the composed ones; with the rotary
/// term, which the attention kernel does not cover, it says that no
/// sublayer's attention reached it (every quantizer still does). On the
/// CPU (its kernels in Rust) and on the GPU under test.
#[test]
fn bench_kernels_reaches_the_fused_kernel_and_agrees_with_the_composed_ops() {
    let gpu = Gpu::under_test();
    let dir = tempfile::tempdir().unwrap();
    let config = tiny_config(dir.path(), 2, 2);
    let config = config.to_str().unwrap();
    let bench = |device: &str, bias: &str| {
        tvq(&[
            "bench",
            "kernels",
            "--device",
            device,
            "--config",
            config,
            "--seq-len",
            "16,48",
            "--batch",
            "2",
            "--steps",
            "1",
            "--json",
            "--set",
            &format!("model.bias={bias}"),
        ])
    };
    let lines = |out: &Output| -> Vec<serde_json::Value> {
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        parse_json_lines(&String::from_utf8_lossy(&out.stdout))
    };
    for device in ["cpu", gpu.name()] {
        let out = bench(device, "toeplitz");
        let err = String::from_utf8_lossy(&out.stderr);
        if device != "cpu" && !out.status.success() && err.contains("is not available") {
            gpu.missing(
                "bench_kernels_reaches_the_fused_kernel_and_agrees_with_the_composed_ops",
                &err,
            );
            return;
        }
        for (bias, out) in [("toeplitz", out), ("xl", bench(device, "xl"))] {
            let lines = lines(&out);
            assert_eq!(lines.len(), 2, "{device}: {lines:?}");
            for l in &lines {
                assert_eq!(l["sublayers"], 2, "{device}, {bias}: {l}");
                assert_eq!(
                    l["fused_sublayers"], 2,
                    "{device}, {bias}: every sublayer fused: {l}"
                );
                assert_eq!(
                    l["fused_quantizers"], 2,
                    "{device}, {bias}: every quantizer fused: {l}"
                );
                assert!(
                    l["loss_diff"].as_f64().unwrap() < 1e-5,
                    "{device}, {bias}: {l}"
                );
                assert!(
                    l["grad_max_diff"].as_f64().unwrap() < 1e-6,
                    "{device}, {bias}: {l}"
                );
                for key in ["fused_tokens_per_s", "composed_tokens_per_s"] {
                    assert!(
                        l[key].as_f64().unwrap() > 0.0,
                        "{device}, {bias}: {key}: {l}"
                    );
                }
            }
        }
        for l in lines(&bench(device, "rotary")) {
            assert_eq!(l["fused_sublayers"], 0, "{device}: rotary composes: {l}");
            assert_eq!(
                l["fused_quantizers"], 2,
                "{device}: the quantizer fuses: {l}"
            );
            assert!(l["loss_diff"].as_f64().unwrap() < 1e-5, "{device}: {l}");
        }
    }
}

/// `tvq bench step --profile` on the GPU says where the timed steps' device
/// time went: kernels by name, their shares summing to one, about as many
/// launches per step at twice the segment length (the block-parallel form
/// runs every block in the same kernels), and the step's own line beside
/// them; on the CPU it is a one-line error.
#[test]
fn bench_step_profile_counts_the_launches_of_a_step() {
    let gpu = Gpu::under_test();
    let dir = tempfile::tempdir().unwrap();
    let config = tiny_config(dir.path(), 2, 2);
    let out = tvq(&[
        "bench",
        "step",
        "--device",
        gpu.name(),
        "--config",
        config.to_str().unwrap(),
        "--form",
        "vq",
        "--seq-len",
        "32,64",
        "--batch",
        "2",
        "--steps",
        "2",
        "--profile",
        "--json",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() && err.contains("is not available") {
        gpu.missing("bench_step_profile_counts_the_launches_of_a_step", &err);
        return;
    }
    assert!(out.status.success(), "{err}");
    let lines = parse_json_lines(&String::from_utf8_lossy(&out.stdout));
    let mut per_step = vec![];
    for t in [32, 64] {
        let at = |form: &str| -> Vec<&serde_json::Value> {
            (lines.iter())
                .filter(|l| l["form"] == form && l["seq_len"] == t)
                .collect()
        };
        assert_eq!(at("vq").len(), 1, "the step's line at {t}: {lines:?}");
        let kernels = at("profile");
        assert!(kernels.len() >= 5, "kernels at {t}: {kernels:?}");
        let share: f64 = kernels.iter().map(|k| k["share"].as_f64().unwrap()).sum();
        assert!((share - 1.0).abs() < 1e-9, "shares sum to {share}");
        let mut launches = 0.0;
        for k in &kernels {
            assert!(!k["kernel"].as_str().unwrap().contains('<'), "{k}");
            assert!(k["launches"].as_u64().unwrap() >= 1, "{k}");
            launches += k["launches_per_step"].as_f64().unwrap();
        }
        per_step.push(launches);
    }
    assert!(
        per_step[0] >= 20.0 && per_step[1] <= 1.1 * per_step[0],
        "launches per step at T = 32 and 64: {per_step:?}"
    );
    let out = tvq(&[
        "bench",
        "step",
        "--device",
        "cpu",
        "--profile",
        "--seq-len",
        "16",
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--device wgpu or cuda"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
}

/// `tvq bench products --strategies` on the GPU times each product, in
/// the forward pass and as the backward pass's two gradients, once with
/// burn's untuned choice (`auto`) and once for each of cubek's
/// strategies: every product and pass gets the same strategies, each either timed
/// with its result checked against `auto`'s (and agreeing: they compute
/// the same f32 product) or unavailable with cubek's reason, and at least
/// one besides `auto` runs each product; on the CPU, or with another
/// benchmark, the flag is a one-line error.
#[test]
fn bench_products_strategies_times_each_strategy_checked() {
    let gpu = Gpu::under_test();
    let dir = tempfile::tempdir().unwrap();
    let config = tiny_config(dir.path(), 2, 2);
    let config = config.to_str().unwrap();
    let bench = |device: &str, benchmark: &str| {
        tvq(&[
            "bench",
            benchmark,
            "--device",
            device,
            "--config",
            config,
            "--form",
            "vq",
            "--seq-len",
            "64",
            "--batch",
            "2",
            "--precision",
            "f32",
            "--strategies",
            "--json",
        ])
    };
    let out = bench(gpu.name(), "products");
    let err = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() && err.contains("is not available") {
        gpu.missing(
            "bench_products_strategies_times_each_strategy_checked",
            &err,
        );
        return;
    }
    assert!(out.status.success(), "{err}");
    let lines = parse_json_lines(&String::from_utf8_lossy(&out.stdout));
    let mut products: Vec<(&str, &str)> = lines
        .iter()
        .map(|l| (l["name"].as_str().unwrap(), l["pass"].as_str().unwrap()))
        .collect();
    products.dedup();
    // Every product in the forward pass and the backward pass's two
    // gradients (an operand read through a transposed view).
    assert!(products.len() >= 15, "{products:?}");
    for pass in ["forward", "grad_left", "grad_right"] {
        let each = products.iter().filter(|(_, p)| *p == pass).count();
        assert_eq!(each * 3, products.len(), "{pass}: {products:?}");
    }
    let mut names_of_first = None;
    for product in products {
        let rows: Vec<_> = lines
            .iter()
            .filter(|l| {
                (l["name"].as_str(), l["pass"].as_str()) == (Some(product.0), Some(product.1))
            })
            .collect();
        let names: Vec<&str> = rows
            .iter()
            .map(|l| l["strategy"].as_str().unwrap())
            .collect();
        assert_eq!(names[0], "auto", "{product:?}: {names:?}");
        assert!(
            rows[0]["flops_per_s"].as_f64().unwrap() > 0.0,
            "{}",
            rows[0]
        );
        let unique: std::collections::HashSet<_> = names.iter().collect();
        assert_eq!(unique.len(), names.len(), "{product:?}: {names:?}");
        assert!(names.len() >= 20, "{product:?}: {names:?}");
        assert_eq!(*names_of_first.get_or_insert(names.clone()), names);
        let mut ran = 0;
        for row in &rows[1..] {
            match (row["flops_per_s"].as_f64(), row["unavailable"].as_str()) {
                (Some(rate), None) => {
                    assert!(rate > 0.0, "{row}");
                    let diff = row["max_rel_diff"].as_f64().unwrap();
                    assert!(diff < 1e-4, "{product:?} disagrees with auto: {row}");
                    ran += 1;
                }
                (None, Some(why)) => assert!(!why.is_empty() && !why.contains('\n'), "{row}"),
                _ => panic!("neither timed nor unavailable: {row}"),
            }
        }
        assert!(ran >= 1, "no strategy but auto ran {product:?}: {rows:?}");
    }
    for (device, benchmark, says) in [
        ("cpu", "products", "--device wgpu or cuda"),
        (gpu.name(), "step", "is for tvq bench products"),
    ] {
        let out = bench(device, benchmark);
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(says), "{err}");
        assert_eq!(err.trim().lines().count(), 1, "{err}");
    }
}

/// A node tunes once: a training step on the GPU (wgpu: lavapipe in CI)
/// with an empty cache autotunes (cubecl's log says which kernel won for
/// each shape) and keeps the results under `$XDG_CACHE_HOME/tvq/`; a second
/// process with that cache runs the same step without tuning anything.
#[test]
fn a_second_process_reuses_the_tuned_kernels() {
    let test = "a_second_process_reuses_the_tuned_kernels";
    let gpu = Gpu::under_test();
    let dir = tempfile::tempdir().unwrap();
    let config = tiny_config(dir.path(), 2, 2);
    let cache = dir.path().join("cache");
    let step = |n: usize| {
        let log = dir.path().join(format!("cubecl-{n}.log"));
        let out = Command::new(TVQ)
            .args(["bench", "step", "--device", gpu.name(), "--config"])
            .arg(&config)
            .args([
                "--form",
                "vq",
                "--seq-len",
                "32",
                "--batch",
                "2",
                "--steps",
                "1",
                "--json",
            ])
            .env("XDG_CACHE_HOME", &cache)
            .env("CUBECL_DEBUG_LOG", &log)
            .output()
            .unwrap();
        (out, std::fs::read_to_string(&log).unwrap_or_default())
    };
    let (first, first_log) = step(1);
    let err = String::from_utf8_lossy(&first.stderr);
    if !first.status.success() && err.contains("is not available") {
        gpu.missing(test, &err);
        return;
    }
    assert!(first.status.success(), "{err}");
    let tuned = |log: &str| log.matches("Fastest result").count();
    assert!(
        tuned(&first_log) > 0,
        "the first process tuned nothing:\n{first_log}"
    );
    assert!(cache.join("tvq").is_dir(), "no cache written");
    let (second, second_log) = step(2);
    assert!(
        second.status.success(),
        "{}",
        String::from_utf8_lossy(&second.stderr)
    );
    assert_eq!(
        tuned(&second_log),
        0,
        "the second process tuned again:\n{second_log}"
    );
}
