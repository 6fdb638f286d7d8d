//! Recall tasks end to end: a model trained on MQAR (`data.kind = "mqar"`)
//! and its accuracy from `tvq eval`.

use super::*;

/// A small MQAR task the quadratic form solves in a few hundred steps:
/// 4 pairs in 64-token examples over a 64-symbol vocabulary.
fn mqar_config(dir: &Path, form: &str) -> PathBuf {
    let path = dir.join(format!("mqar-{form}.toml"));
    std::fs::write(
        &path,
        format!(
            r#"
[model]
d_model = 64
d_k = 32
d_v = 128
n_code = 32
n_layer = 2
block_len = 16
attention = "{form}"
dropout_residual = 0.0
dropout_layer = 0.0
dropout_sinusoid = 0.0

[data]
kind = "mqar"
batch_size = 32
update_len = 64
sequence_len = 64

[data.mqar]
pairs = 4
vocab = 64
train_examples = 16384
eval_examples = 256

[train]
steps = 400
lr = 3e-3
warmup_steps = 20
workers = 2
checkpoint_every = 1000

[eval]
every = 200
segments = 2
batch_size = 32
update_len = 64
sample_every = 0

[log]
tensorboard = false
"#
        ),
    )
    .unwrap();
    path
}

#[test]
fn the_quadratic_form_solves_a_small_mqar_task() {
    let dir = tempfile::tempdir().unwrap();
    let config = mqar_config(dir.path(), "quadratic");
    let run = dir.path().join("run");
    let printed = train_quietly(config.to_str().unwrap(), &run, &[]);
    assert!(printed.contains("recall accuracy"), "{printed}");
    let run_s = run.to_str().unwrap();

    // The run's own validation scores answers only, with their accuracy.
    let log = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    let final_eval: serde_json::Value = log
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .find(|v| v["kind"] == "final_eval")
        .expect("a final validation");
    assert_eq!(final_eval["tokens"], 256 * 4, "{final_eval}");

    // As dense attention does in Zoology, it recalls (nearly) every answer.
    let report: serde_json::Value =
        serde_json::from_str(&ok(&["eval", "--checkpoint", run_s, "--json"])).unwrap();
    let recall = &report["recall"];
    let accuracy = recall["accuracy"].as_f64().unwrap();
    assert!(accuracy >= 0.99, "{report}");
    assert_eq!(recall["answers"], 1024);
    assert_eq!(
        recall, &final_eval["recall"],
        "eval agrees with the run's validation"
    );
    let by_distance = recall["by_distance"].as_array().unwrap();
    let summed: u64 = by_distance
        .iter()
        .map(|b| b["answers"].as_u64().unwrap())
        .sum();
    assert_eq!(summed, 1024);

    // --task mqar with the run's own settings is the same evaluation; a
    // longer sequence than it was trained on is another.
    let same: serde_json::Value = serde_json::from_str(&ok(&[
        "eval",
        "--checkpoint",
        run_s,
        "--json",
        "--task",
        "mqar",
        "--pairs",
        "4",
    ]))
    .unwrap();
    assert_eq!(same["recall"], *recall);
    let longer = ok(&[
        "eval",
        "--checkpoint",
        run_s,
        "--task",
        "mqar",
        "--sequence-len",
        "128",
    ]);
    assert!(
        longer.contains("of 1024 answers") && longer.contains("65-128"),
        "{longer}"
    );

    // The same validation examples written to a task file, as a program
    // elsewhere would: the same evaluation, answer for answer.
    let mqar = tvq_data::recall::MqarConfig {
        pairs: 4,
        vocab: 64,
        eval_examples: 256,
        ..Default::default()
    };
    let (symbols, set) = mqar.examples(1, 256, 64).unwrap(); // 1: validation
    let mut lines = String::new();
    for (n, example) in symbols.chunks(64).enumerate() {
        let ids: Vec<u32> = example.iter().map(|&b| b as u32 + 3).collect();
        let answers: Vec<serde_json::Value> = (set.answers.iter())
            .filter(|a| a.pos / 64 == n)
            .map(|a| {
                let pos = a.pos % 64;
                serde_json::json!({"pos": pos, "token": ids[pos], "distance": a.distance})
            })
            .collect();
        lines += &serde_json::json!({"tokens": ids, "answers": answers}).to_string();
        lines.push('\n');
    }
    let file = dir.path().join("task.jsonl");
    std::fs::write(&file, lines).unwrap();
    let file_s = file.to_str().unwrap();
    let from_file: serde_json::Value = serde_json::from_str(&ok(&[
        "eval",
        "--checkpoint",
        run_s,
        "--json",
        "--task-file",
        file_s,
    ]))
    .unwrap();
    assert_eq!(from_file["recall"], *recall);
    std::fs::write(
        &file,
        "{\"tokens\": [1, 2], \"answers\": [{\"pos\": 1, \"token\": 7}]}\n",
    )
    .unwrap();
    fails(
        &["eval", "--checkpoint", run_s, "--task-file", file_s],
        "line 1: the answer at 1 is 7, not 2",
    );
    fails(
        &[
            "eval",
            "--checkpoint",
            run_s,
            "--task-file",
            file_s,
            "--task",
            "mqar",
        ],
        "cannot be used with",
    );

    // Settings that cannot work are one line each.
    fails(
        &["eval", "--checkpoint", run_s, "--pairs", "3"],
        "--task mqar",
    );
    fails(
        &[
            "eval",
            "--checkpoint",
            run_s,
            "--task",
            "mqar",
            "--pairs",
            "40",
        ],
        "data.mqar: pairs",
    );
    fails(
        &["eval", "--checkpoint", run_s, "--by-position", "x.json"],
        "do not apply to a recall task",
    );
}

#[test]
fn a_text_model_is_measured_on_passkeys_hidden_in_its_own_text() {
    let dir = tempfile::tempdir().unwrap();
    let config = tiny_config(dir.path(), 2, 2);
    let run = dir.path().join("run");
    train_quietly(config.to_str().unwrap(), &run, &[]);
    let run = run.to_str().unwrap();
    let report: serde_json::Value = serde_json::from_str(&ok(&[
        "eval",
        "--checkpoint",
        run,
        "--json",
        "--task",
        "passkey",
        "--sequence-len",
        "128",
    ]))
    .unwrap();
    // The default 256 validation examples, 5 digits each, every one counted
    // once by distance; a model of two steps knows no passkey.
    let recall = &report["recall"];
    assert_eq!(recall["answers"], 256 * 5, "{report}");
    let by_distance = recall["by_distance"].as_array().unwrap();
    let summed: u64 = by_distance
        .iter()
        .map(|b| b["answers"].as_u64().unwrap())
        .sum();
    assert_eq!(summed, 256 * 5);
    assert!(recall["accuracy"].as_f64().unwrap() < 0.5, "{report}");
    fails(
        &[
            "eval",
            "--checkpoint",
            run,
            "--task",
            "passkey",
            "--sequence-len",
            "40",
        ],
        "data.passkey",
    );
    fails(
        &[
            "eval",
            "--checkpoint",
            run,
            "--task",
            "passkey",
            "--pairs",
            "4",
        ],
        "--task mqar",
    );
}

#[test]
fn passkeys_mixed_into_text_score_every_token_and_count_the_digits() {
    let dir = tempfile::tempdir().unwrap();
    let config = tiny_config(dir.path(), 2, 2);
    let run = dir.path().join("run");
    let set = |kv: &'static str| ["--set", kv];
    let extra: Vec<&str> = [
        "data.kind=passkey",
        "data.passkey.score_text=true",
        "data.passkey.train_examples=16",
        "data.passkey.eval_examples=8",
    ]
    .into_iter()
    .flat_map(set)
    .collect();
    train_quietly(config.to_str().unwrap(), &run, &extra);
    let report: serde_json::Value = serde_json::from_str(&ok(&[
        "eval",
        "--checkpoint",
        run.to_str().unwrap(),
        "--json",
    ]))
    .unwrap();
    // Every target of the 8 examples of 128 tokens is scored (the text is
    // a language-modelling corpus), and the accuracy counts the digits.
    assert_eq!(report["tokens"], 8 * 128, "{report}");
    assert_eq!(report["recall"]["answers"], 8 * 5, "{report}");
}
