//! `tvq export --format hf`: the folder Hugging Face `transformers` loads
//! computes tvq's logits, generates tvq's greedy text and tokenizes as tvq
//! does; `tvq import --hf` gives back the same weights, from the folder
//! and from `transformers`' own save of it.

use std::path::Path;
use std::process::Command;

use burn::prelude::*;
use tvq_data::Vocab;
use tvq_model::{ModelState, Pass};
use tvq_train::inference::load::load_for_inference;
use tvq_train::placement::B;
use tvq_train::placement::device::DeviceSpec;

use super::{fails, ok, repo, succeeds, tensors_of, tiny_config};
use tvq_testkit::python_with;

/// tvq's input ids (the end-of-document token, then the corpus's first
/// bytes) and logits `[T, vocab]` of the export `weights`, `T = blocks L`.
fn tvq_logits(weights: &Path, blocks: usize) -> serde_json::Value {
    let device = DeviceSpec::Cpu.init().unwrap().0;
    let loaded = load_for_inference(weights, None, &device).unwrap();
    let t = blocks * loaded.model.block_len();
    let text = std::fs::read(repo().join("data/kjv.txt")).unwrap();
    let ids: Vec<i64> = std::iter::once(1)
        .chain(text[..t - 1].iter().map(|&b| i64::from(b) + 3))
        .collect();
    let input = Tensor::<B, 2, Int>::from_data(TensorData::new(ids.clone(), [1, t]), &device);
    let state = ModelState::new(loaded.model.sublayers.len());
    let out = loaded.model.forward(input, state, Pass::new()).unwrap();
    let logits = out.logits.unwrap(); // [1, T, vocab]
    let vocab = logits.dims()[2];
    let values = logits.into_data().to_vec::<f32>().unwrap();
    let rows: Vec<&[f32]> = values.chunks(vocab).collect();
    serde_json::json!({"ids": ids, "logits": rows})
}

/// For a Toeplitz model, an XL model with every setting the PyTorch model
/// covers (two heads, a binding cache limit, a code limit, the learned
/// count weight, exact window keys), and a model of a BPE tokenizer's
/// vocabulary: `transformers` loads the
/// folder; its logits over 9 blocks equal tvq's within 1e-4 (a stream that
/// fills the previous block and the compressed cache), and again when the
/// stream goes through its cache a token at a time from inside a block,
/// and under right padding; left padding is refused; its greedy
/// `generate()` gives `tvq sample --temperature 0`'s 64 tokens; its
/// tokenizer gives tvq's ids (UTF-8 of 2 to 4 bytes) after the
/// end-of-document token; `tvq eval` of the folder gives the export's
/// loss; `tvq import --hf` of the folder, and of `transformers`' save of
/// it, gives the export's tensors bit for bit.
/// With the cache's count term dropped from the model file, the logits
/// test fails.
#[test]
fn a_hugging_face_export_computes_what_tvq_computes() {
    let test = "a_hugging_face_export_computes_what_tvq_computes";
    let Some(python) = python_with(test, &["torch", "transformers"]) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let config = tiny_config(dir.path(), 6, 6);
    let prompt = "And God said, \u{e9}\u{20ac}\u{1f600} ";
    let run_check = |folder: &Path, name: &str| {
        let out = succeeds(
            Command::new(&python)
                .arg(repo().join("crates/cli/tests/hf_check.py"))
                .arg(folder)
                .arg(dir.path().join(format!("{name}-stream.json")))
                .arg(prompt)
                .arg(dir.path().join(format!("{name}-saved"))),
        );
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    let xl = [
        "model.bias=\"xl\"",
        "model.n_head=2",
        "model.cache_limit=40",
        "model.code_limit=2",
        "model.count_weight=\"learned\"",
        "model.window_keys=\"exact\"",
    ];
    let bpe = dir.path().join("tokenizer-bpe.json");
    ok(&[
        "tokenizer",
        "train",
        "--corpus",
        dir.path().join("kjv-small.txt").to_str().unwrap(),
        "--kind",
        "bpe",
        "--vocab-size",
        "300",
        "--out",
        bpe.to_str().unwrap(),
    ]);
    let tokenized = format!("data.tokenizer=\"{}\"", bpe.display());
    let cases = [
        ("toeplitz", &[][..]),
        ("xl", &xl[..]),
        ("bpe", &[tokenized.as_str()][..]),
    ];
    for (name, sets) in cases {
        let run = dir.path().join(name);
        let sets: Vec<&str> = sets.iter().flat_map(|s| ["--set", *s]).collect();
        super::train_quietly(config.to_str().unwrap(), &run, &sets);
        let export = dir.path().join(format!("{name}.safetensors"));
        if name == "bpe" {
            // An export whose config would replace the tokenizer is refused.
            let over = bpe.with_extension("safetensors");
            fails(
                &["export", "--checkpoint", run.to_str().unwrap()]
                    .into_iter()
                    .chain(["--out", over.to_str().unwrap()])
                    .collect::<Vec<_>>(),
                "tokenizer",
            );
            assert!(
                Vocab::load_tokenizer(&bpe).is_ok(),
                "the tokenizer was changed"
            );
        }
        let folder = dir.path().join(format!("{name}-hf"));
        for (out, format) in [(&export, "tvq"), (&folder, "hf")] {
            ok(&["export", "--checkpoint", run.to_str().unwrap()]
                .into_iter()
                .chain(["--out", out.to_str().unwrap(), "--format", format])
                .collect::<Vec<_>>());
        }
        let stream = tvq_logits(&export, 9);
        std::fs::write(
            dir.path().join(format!("{name}-stream.json")),
            stream.to_string(),
        )
        .unwrap();
        let hf = run_check(&folder, name);
        for key in [
            "logits_max_diff",
            "cached_max_diff",
            "right_padded_max_diff",
        ] {
            let diff = hf[key].as_f64().unwrap();
            assert!(diff <= 1e-4, "{name}: {key} {diff}");
        }
        let left = hf["left_padding"].as_str().unwrap();
        assert!(left.contains("right padding"), "{name}: {left}");
        let tvq_greedy = ok(&[
            "sample",
            "--checkpoint",
            export.to_str().unwrap(),
            "--prompt",
            prompt,
            "--temperature",
            "0",
            "--max-tokens",
            "64",
            "--no-echo",
        ]);
        assert_eq!(
            hf["greedy"].as_str().unwrap(),
            tvq_greedy.trim_end_matches('\n'),
            "{name}"
        );
        let vocab = match name {
            "bpe" => Vocab::load_tokenizer(&bpe).unwrap(),
            _ => Vocab::Bytes,
        };
        let tvq_ids: Vec<u64> = (vocab.encode(prompt).unwrap().into_iter())
            .map(u64::from)
            .collect();
        let ids = |key: &str| -> Vec<u64> {
            hf[key]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap())
                .collect()
        };
        assert_eq!(ids("plain_ids"), tvq_ids, "{name}");
        assert_eq!(ids("prompt_ids")[0], u64::from(vocab.eos()), "{name}");
        assert_eq!(ids("prompt_ids")[1..], tvq_ids[..], "{name}");
        // tvq reads the folder itself as it reads the export.
        let config = run.join("config.toml");
        assert_eq!(
            super::export_loss(&folder, &config),
            super::export_loss(&export, &config),
            "{name}"
        );
        let saved = dir.path().join(format!("{name}-saved"));
        for (from, back) in [(&folder, "back"), (&saved, "saved-back")] {
            let back = dir.path().join(format!("{name}-{back}.safetensors"));
            ok(&[
                "import",
                "--hf",
                from.to_str().unwrap(),
                "--out",
                back.to_str().unwrap(),
            ]);
            assert_eq!(tensors_of(&back), tensors_of(&export), "{name}: {back:?}");
        }
        if name == "xl" {
            // The perturbed model file: the cache's codes weigh as one key
            // each (empty ones still masked).
            let modeling = folder.join("modeling_tvq.py");
            let text = std::fs::read_to_string(&modeling).unwrap();
            let line = "term = weight * capped.clamp_min(1.0).log()[:, :, :, None] + shift";
            assert!(text.contains(line));
            let dropped = "term = weight * 0 * capped[:, :, :, None] + shift";
            std::fs::write(&modeling, text.replace(line, dropped)).unwrap();
            let perturbed = run_check(&folder, name);
            let diff = perturbed["logits_max_diff"].as_f64().unwrap();
            assert!(diff > 1e-2, "the count term dropped: logits within {diff}");
        }
    }
    // What `transformers` cannot load is refused before anything is written.
    for (sets, needle) in [
        ("model.bias=\"rotary\"", "model.bias"),
        ("model.attention=\"quadratic\"", "model.attention"),
    ] {
        let run = dir.path().join("refused");
        let _ = std::fs::remove_dir_all(&run);
        super::train_quietly(
            config.to_str().unwrap(),
            &run,
            &["--set", sets, "--set", "train.steps=1"],
        );
        let out = dir.path().join("refused-hf");
        fails(
            &["export", "--checkpoint", run.to_str().unwrap(), "--out"]
                .into_iter()
                .chain([out.to_str().unwrap(), "--format", "hf"])
                .collect::<Vec<_>>(),
            needle,
        );
        assert!(!out.exists());
    }
    // A hostile folder: a config of a model far larger than its weights.
    let hostile = dir.path().join("hostile");
    copy_folder(&dir.path().join("toeplitz-hf"), &hostile);
    let cfg = hostile.join("config.json");
    let mut json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&cfg).unwrap()).unwrap();
    json["d_model"] = serde_json::json!(1u64 << 20);
    json["vocab_size"] = serde_json::json!(1u64 << 30);
    std::fs::write(&cfg, json.to_string()).unwrap();
    let back = dir.path().join("hostile.safetensors");
    fails(
        &[
            "import",
            "--hf",
            hostile.to_str().unwrap(),
            "--out",
            back.to_str().unwrap(),
        ],
        "parameters",
    );
    assert!(!back.exists());
}

fn copy_folder(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        if entry.file_type().unwrap().is_file() {
            std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
        }
    }
}

/// lm-evaluation-harness runs the repository's local task
/// (data/lm-eval/kjv_verse_ending.yaml, no network) on a folder of `tvq
/// export --format hf`, and its verdict on each of 40 items equals one
/// computed directly from the model's log-probabilities.
#[test]
fn lm_evaluation_harness_scores_an_export_as_its_log_probs_say() {
    let test = "lm_evaluation_harness_scores_an_export_as_its_log_probs_say";
    let Some(python) = python_with(test, &["torch", "transformers", "lm_eval"]) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let config = tiny_config(dir.path(), 6, 6);
    let run = dir.path().join("run");
    super::train_quietly(config.to_str().unwrap(), &run, &[]);
    let folder = dir.path().join("hf");
    ok(&[
        "export",
        "--checkpoint",
        run.to_str().unwrap(),
        "--out",
        folder.to_str().unwrap(),
        "--format",
        "hf",
    ]);
    let out = succeeds(
        Command::new(&python)
            .arg(repo().join("crates/cli/tests/lm_eval_check.py"))
            .arg(&folder)
            .arg(dir.path().join("lm-eval"))
            .arg("40")
            .current_dir(repo()),
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["items"], 40, "{report}");
    assert_eq!(report["agree"], 40, "{report}");
    assert_eq!(report["lm_eval_acc"], report["direct_acc"], "{report}");
}
