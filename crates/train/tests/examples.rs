//! The examples of `crates/train/examples/` run, small: `custom_loop`
//! trains the quick-start model for 3 steps and exports it; `generate`,
//! `attention_map` and `embed` read that export. Each must succeed and
//! print what it promises.

use std::path::PathBuf;
use std::process::Command;

/// The built example `name` (cargo builds the examples with the tests).
fn example(name: &str) -> PathBuf {
    let deps = std::env::current_exe().unwrap();
    deps.parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("examples")
        .join(name)
}

fn repo() -> PathBuf {
    tvq_testkit::crate_dir().join("../..")
}

/// Runs example `name` with `args` from the repository root; its stdout.
fn run(name: &str, args: &[&str]) -> String {
    let out = Command::new(example(name))
        .args(args)
        .current_dir(repo())
        .output()
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{name} {args:?} failed:\n{stderr}");
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn the_examples_train_generate_map_attention_and_embed() {
    let dir = tempfile::tempdir().unwrap();
    let export = dir.path().join("m.safetensors");
    let export_s = export.to_str().unwrap();
    let config = "configs/quickstart.toml";

    let trained = run("custom_loop", &[config, "3", export_s]);
    let steps: Vec<&str> = trained.lines().filter(|l| l.starts_with("step")).collect();
    assert_eq!(steps.len(), 3, "{trained}");
    for (i, line) in steps.iter().enumerate() {
        assert!(line.starts_with(&format!("step {:>4}", i + 1)), "{line}");
        let loss: f64 = line.split("loss ").nth(1).unwrap()[..6].parse().unwrap();
        assert!(loss.is_finite() && loss > 0.0, "{line}");
    }
    assert!(export.exists() && export.with_extension("json").exists());

    let text = run("generate", &[export_s, "And God said", "40"]);
    assert!(text.starts_with("And God said"), "{text}");
    assert!(
        text.len() > "And God said".len() + 1,
        "something generated: {text}"
    );

    let map = run("attention_map", &[export_s, config, "1"]);
    let rows: Vec<Vec<f64>> = map
        .lines()
        .skip(2)
        .map(|l| {
            l.split_whitespace()
                .skip(1)
                .take(3)
                .map(|x| x.parse().unwrap())
                .collect()
        })
        .collect();
    assert_eq!(rows.len(), 4, "one row per sublayer (2 layers):\n{map}");
    for shares in rows {
        let total: f64 = shares.iter().sum();
        assert!((total - 1.0).abs() < 2e-3, "shares sum to one: {shares:?}");
    }

    let embedded = run("embed", &[export_s, "In the beginning"]);
    assert!(embedded.contains("16 tokens -> 128 features"), "{embedded}");
}
