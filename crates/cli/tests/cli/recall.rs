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
    assert!(recall.get("code_sharing").is_none(), "no codes: {recall}");

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
    // On a run trained on MQAR, --sequence-len alone reshapes the run's own
    // task: the same examples as with --task mqar.
    let longer_json = |task: &[&str]| -> serde_json::Value {
        let mut args = vec![
            "eval",
            "--checkpoint",
            run_s,
            "--json",
            "--sequence-len",
            "128",
        ];
        args.extend_from_slice(task);
        serde_json::from_str(&ok(&args)).unwrap()
    };
    assert_eq!(
        longer_json(&[])["recall"],
        longer_json(&["--task", "mqar"])["recall"]
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

    // Where the attention went at the answers, on hand-made examples of one
    // 64-token segment (blocks of 16) with an answer in block 0, where a
    // token sees only its own block, and one in block 3, where it sees the
    // previous block and the compressed cache (blocks 0-1).
    let lines: String = (0..8)
        .map(|n| {
            let ids: Vec<u32> = (0..64).map(|i| 3 + (i * 7 + n * 13) % 200).collect();
            let answers = [(5, 1), (50, 40)]
                .map(|(pos, d)| serde_json::json!({"pos": pos, "token": ids[pos], "distance": d}));
            serde_json::json!({"tokens": ids, "answers": answers}).to_string() + "\n"
        })
        .collect();
    let file = dir.path().join("two-answers.jsonl");
    std::fs::write(&file, lines).unwrap();
    let eval_task_file = |file: &Path, extra: &[&str]| -> serde_json::Value {
        let file = file.to_str().unwrap();
        let args = [
            &["eval", "--checkpoint", run, "--json", "--task-file", file],
            extra,
        ]
        .concat();
        serde_json::from_str(&ok(&args)).unwrap()
    };
    let eval_file = |extra: &[&str]| eval_task_file(&file, extra);
    let (plain, measured) = (eval_file(&[]), eval_file(&["--attention"]));
    assert_eq!(
        plain["recall"]["correct"], measured["recall"]["correct"],
        "measuring changes no answer"
    );
    let buckets = measured["recall"]["by_distance"].as_array().unwrap();
    assert_eq!(buckets.len(), 2, "{measured}");
    // Each example's far answer was read at position 11 (block 0), in the
    // cache when asked for at 50, and so was the near answer's pair
    // (position 5): the far answer shares its code with at most that one
    // other pair, in each sublayer's codebook, on a code that 1 to 32
    // cached keys (blocks 0-1) share. The near answer, asked for in block
    // 0, is not counted.
    let sharing = plain["recall"]["code_sharing"].as_array().unwrap();
    assert_eq!(sharing.len(), 2, "{plain}");
    for c in sharing {
        let buckets = c["buckets"].as_array().unwrap();
        let answers: u64 = buckets.iter().map(|b| b["answers"].as_u64().unwrap()).sum();
        assert_eq!(answers, 8, "{c}");
        for b in buckets {
            assert!(b["last"].as_u64().unwrap() <= 1, "{c}");
            let load = b["mean_code_load"].as_f64().unwrap();
            assert!((1.0..=32.0).contains(&load), "{c}");
        }
    }
    // Jointly: the same 8 answers, at least as many of them alone as in any
    // one codebook.
    let joint = plain["recall"]["code_sharing_joint"].as_array().unwrap();
    let alone = |buckets: &[serde_json::Value]| -> u64 {
        (buckets.iter())
            .filter(|b| b["last"] == 0)
            .map(|b| b["answers"].as_u64().unwrap())
            .sum()
    };
    let answers: u64 = joint.iter().map(|b| b["answers"].as_u64().unwrap()).sum();
    assert_eq!(answers, 8, "{plain}");
    for c in sharing {
        assert!(
            alone(joint) >= alone(c["buckets"].as_array().unwrap()),
            "{plain}"
        );
    }
    // Examples longer than a segment: the codes of every segment count, so
    // reading them in two segments (the config's 64 tokens) or in one gives
    // the same tally.
    let long: String = (0..8)
        .map(|n| {
            let ids: Vec<u32> = (0..128).map(|i| 3 + (i * 5 + n * 11) % 200).collect();
            let answers = [(50, 40), (100, 89), (110, 60), (127, 120)]
                .map(|(pos, d)| serde_json::json!({"pos": pos, "token": ids[pos], "distance": d}));
            serde_json::json!({"tokens": ids, "answers": answers}).to_string() + "\n"
        })
        .collect();
    let long_file = dir.path().join("long.jsonl");
    std::fs::write(&long_file, long).unwrap();
    let saved = std::fs::read_to_string(Path::new(run).join("config.toml")).unwrap();
    let (head, eval) = saved.split_at(saved.find("[eval]").unwrap());
    let one_segment = dir.path().join("one-segment.toml");
    let eval = eval.replacen("update_len = 64", "update_len = 128", 1);
    std::fs::write(&one_segment, format!("{head}{eval}")).unwrap();
    let sharing_of = |extra: &[&str]| {
        let recall = eval_task_file(&long_file, extra)["recall"].clone();
        [
            recall["code_sharing"].clone(),
            recall["code_sharing_joint"].clone(),
        ]
    };
    let two = sharing_of(&[]);
    assert_eq!(two[0].as_array().map(Vec::len), Some(2), "{two:?}");
    assert!(two[1].as_array().is_some_and(|j| !j.is_empty()), "{two:?}");
    assert_eq!(
        two,
        sharing_of(&["--config", one_segment.to_str().unwrap()])
    );
    let shares = |a: &serde_json::Value| -> Vec<f64> {
        (0..3).map(|g| a["share"][g].as_f64().unwrap()).collect()
    };
    let overall = measured["attention"].as_array().unwrap();
    assert_eq!(overall.len(), 2, "one layer: two sublayers");
    for (sublayer, total) in overall.iter().enumerate() {
        let [near, far] = [0, 1].map(|b| shares(&buckets[b]["attention"][sublayer]));
        assert!(
            (near[0] - 1.0).abs() < 1e-5 && near[1] < 1e-6 && near[2] < 1e-6,
            "{near:?}"
        );
        assert!(far[1] > 1e-3 && far[2] > 1e-3, "{far:?}");
        // Over all answers: the mean of the two buckets (8 answers each).
        for ((t, n), f) in shares(total).into_iter().zip(near).zip(far) {
            assert!((t - (n + f) / 2.0).abs() < 1e-5);
        }
    }
    let printed = ok(&[
        "eval",
        "--checkpoint",
        run,
        "--task-file",
        file.to_str().unwrap(),
        "--attention",
    ]);
    assert!(
        printed.contains("compressed cache's share at the answers"),
        "{printed}"
    );
    // The paper's cache weighs its counts by 1 exactly and prints no count
    // weight; a learned one, moved by two steps, is printed per sublayer
    // and at the answers, and each figure is a weight in (0, 2).
    assert!(!printed.contains("count weight"), "{printed}");
    for a in overall {
        assert_eq!(a["count_weight"], 1.0, "{a}");
    }
    let learned = dir.path().join("learned");
    train_quietly(
        config.to_str().unwrap(),
        &learned,
        &["--set", "model.count_weight=learned"],
    );
    let learned = learned.to_str().unwrap();
    let file_s = file.to_str().unwrap();
    let eval_learned = |extra: &[&str]| {
        let args = [
            "eval",
            "--checkpoint",
            learned,
            "--task-file",
            file_s,
            "--attention",
        ];
        ok(&[&args[..], extra].concat())
    };
    let printed = eval_learned(&[]);
    assert!(printed.contains("count weight at the answers"), "{printed}");
    assert!(
        printed.contains("entropy (nats), count weight"),
        "{printed}"
    );
    let measured: serde_json::Value = serde_json::from_str(&eval_learned(&["--json"])).unwrap();
    let weights = measured["recall"]["by_distance"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|b| b["attention"].as_array().unwrap())
        .chain(measured["attention"].as_array().unwrap())
        .map(|a| a["count_weight"].as_f64().unwrap());
    for w in weights {
        assert!(w > 0.0 && w < 2.0 && w != 1.0, "{w}: {measured}");
    }
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
    fails(
        &["eval", "--checkpoint", run, "--sequence-len", "128"],
        "the run's corpus is text: add --task",
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
