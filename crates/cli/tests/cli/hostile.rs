//! Files from anywhere: checkpoints, exports, configs and run directories
//! as a hostile or careless user hands them over. Each case ends in one
//! line of error, in time, with nothing outside the run written and no
//! checkpoint lost (issue 44's table, case by case).

use super::*;

/// `tvq args` fails as [`fails`] does, within `secs` seconds (a hang is a
/// failure, not a stuck suite).
fn fails_within(secs: u64, args: &[&str], needle: &str) {
    let mut child = Command::new(TVQ)
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > Duration::from_secs(secs) {
            let _ = child.kill();
            panic!("tvq {args:?} still runs after {secs} s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    assert_one_error_line(&format!("tvq {args:?}"), &out, needle);
}

/// `tvq train --resume --quiet` of `config` in `run`, with `extra`
/// arguments, fails as [`fails_within`] says.
fn resume_fails_within(secs: u64, config: &Path, run: &Path, extra: &[&str], needle: &str) {
    let (config, run) = (config.to_str().unwrap(), run.to_str().unwrap());
    let resume = [
        "train",
        "--config",
        config,
        "--run-dir",
        run,
        "--resume",
        "--quiet",
    ];
    fails_within(secs, &[&resume[..], extra].concat(), needle);
}

/// The manifest of the checkpoint `ckpt` rewritten so that its entries
/// match the files as they are now (a forger's manifest), with `extra`
/// entries added.
fn forge_manifest(ckpt: &Path, extra: &[(&str, u64)]) {
    let path = ckpt.join("manifest.json");
    let mut m: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let files = m["files"].as_object_mut().unwrap();
    for (name, entry) in files.iter_mut() {
        let bytes = std::fs::read(ckpt.join(name)).unwrap();
        entry["bytes"] = bytes.len().into();
        entry["xxh3"] = format!("{:016x}", tvq_train::checkpoint::checksum(&bytes)).into();
    }
    for (name, bytes) in extra {
        files.insert(
            name.to_string(),
            serde_json::json!({"bytes": bytes, "xxh3": "0"}),
        );
    }
    std::fs::write(&path, m.to_string()).unwrap();
}

/// The safetensors file `path` rewritten in place by `change`
/// ([`rewritten_safetensors`]).
fn rewrite_safetensors(path: &Path, change: impl FnOnce(&mut Metadata, &mut Vec<Stored>)) {
    let bytes = rewritten_safetensors(&std::fs::read(path).unwrap(), change);
    std::fs::write(path, bytes).unwrap();
}

/// A checkpoint's files are checked before they are trusted: a manifest
/// naming `/dev/zero`, `/etc/passwd` or `../../x`, a file replaced by a
/// symbolic link, a `trainer.json` whose step is not its directory's, a
/// state whose counts lie or whose tensor has the wrong rank: each is one
/// line from `eval`, and `train --resume` (whose only checkpoint it is)
/// stops naming it, without a hang and without deleting it.
#[test]
fn damaged_and_forged_checkpoints_are_refused_in_time() {
    let dir = tempfile::tempdir().unwrap();
    let pristine = fixture_run(dir.path(), "run-format-2");
    let ckpt_of = |run: &Path| run.join("checkpoints/step-00000002");
    type Damage = Box<dyn Fn(&Path)>;
    let cases: Vec<(&str, Damage, &str)> = vec![
        (
            "dev-zero",
            Box::new(|c| forge_manifest(c, &[("/dev/zero", 1 << 40)])),
            "\"/dev/zero\", which is not a file of a checkpoint",
        ),
        (
            "passwd",
            Box::new(|c| forge_manifest(c, &[("/etc/passwd", 10)])),
            "not a file of a checkpoint",
        ),
        (
            "parent",
            Box::new(|c| forge_manifest(c, &[("../../x", 10)])),
            "not a file of a checkpoint",
        ),
        (
            "link",
            Box::new(|c| {
                let moved = c.with_file_name("elsewhere.json");
                std::fs::rename(c.join("trainer.json"), &moved).unwrap();
                #[cfg(unix)]
                std::os::unix::fs::symlink(&moved, c.join("trainer.json")).unwrap();
            }),
            "trainer.json is a symbolic link",
        ),
        (
            "step",
            Box::new(|c| {
                let path = c.join("trainer.json");
                let text = std::fs::read_to_string(&path).unwrap();
                let text = text.replacen("\"step\": 2", "\"step\": 1000000000000000", 1);
                std::fs::write(&path, text).unwrap();
                forge_manifest(c, &[]);
            }),
            "says step 1000000000000000",
        ),
        (
            "counts",
            Box::new(|c| {
                rewrite_safetensors(&c.join("state.safetensors"), |meta, _| {
                    meta.insert("micro_batches".into(), "1000000000000".into());
                });
                forge_manifest(c, &[]);
            }),
            "1000000000000 shards",
        ),
        (
            "rank",
            Box::new(|c| {
                rewrite_safetensors(&c.join("state.safetensors"), |_, tensors| {
                    let t = tensors.iter_mut().find(|t| t.0.ends_with("/v")).unwrap();
                    t.2 = vec![t.2.iter().product()];
                });
                forge_manifest(c, &[]);
            }),
            "not F32 of rank 4",
        ),
    ];
    for (name, damage, needle) in cases {
        let run = dir.path().join(name);
        copy_tree(&pristine, &run);
        let ckpt = ckpt_of(&run);
        damage(&ckpt);
        let before = tree_bytes(&run);
        // `eval` on the checkpoint itself reports why it is refused; the
        // resume finds no valid checkpoint and says why, changing nothing.
        if name != "counts" && name != "rank" {
            fails_within(
                60,
                &["eval", "--checkpoint", ckpt.to_str().unwrap()],
                needle,
            );
        }
        resume_fails_within(60, &run.join("config.toml"), &run, &[], needle);
        assert!(
            before == tree_bytes(&run),
            "{name}: the run directory changed"
        );
    }
}

/// Every file under `dir` with its bytes (the lock file aside, which a
/// refused run still takes).
fn tree_bytes(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut out = vec![];
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else if path.file_name().unwrap() != "train.lock" {
                out.push((path.clone(), std::fs::read(&path).unwrap_or_default()));
            }
        }
    }
    out.sort();
    out
}

/// A run directory is tvq's alone: a lock or metrics file that is a link
/// elsewhere is refused (the file elsewhere untouched); a directory holding
/// another tool's files is refused without `--force` (they stay); a
/// `--resume` whose every checkpoint is damaged stops and keeps them; a
/// `--resume --force` with another model stops before it rewrites the
/// config.
#[cfg(unix)]
#[test]
fn the_run_directory_is_tvqs_alone() {
    let dir = tempfile::tempdir().unwrap();
    let pristine = fixture_run(dir.path(), "run-format-2");
    let config = pristine.join("config.toml");
    let c = config.to_str().unwrap();
    let outside = dir.path().join("precious.txt");
    for name in ["train.lock", "metrics.jsonl"] {
        std::fs::write(&outside, "keep me").unwrap();
        let run = dir.path().join(format!("link-{name}"));
        copy_tree(&pristine, &run);
        std::os::unix::fs::symlink(&outside, run.join(name)).unwrap();
        resume_fails_within(60, &config, &run, &[], "symbolic link");
        assert_eq!(
            std::fs::read_to_string(&outside).unwrap(),
            "keep me",
            "{name}"
        );
    }

    let foreign = dir.path().join("foreign");
    std::fs::create_dir_all(&foreign).unwrap();
    std::fs::write(foreign.join("metrics.jsonl"), "{\"theirs\": 1}\n").unwrap();
    std::fs::write(foreign.join("events.out.tfevents.1.other"), "theirs").unwrap();
    let before = tree_bytes(&foreign);
    let f = foreign.to_str().unwrap();
    fails_within(
        60,
        &["train", "--config", c, "--run-dir", f, "--quiet"],
        "tvq did not set it up",
    );
    assert!(before == tree_bytes(&foreign), "another tool's files stay");
    ok(&[
        "train",
        "--config",
        c,
        "--run-dir",
        f,
        "--quiet",
        "--force",
        "--max-steps",
        "1",
    ]);

    // Every checkpoint damaged: no new run over them.
    let damaged = dir.path().join("damaged");
    copy_tree(&pristine, &damaged);
    let trainer = damaged.join("checkpoints/step-00000002/trainer.json");
    let mut bytes = std::fs::read(&trainer).unwrap();
    bytes[0] ^= 1;
    std::fs::write(&trainer, bytes).unwrap();
    let before = tree_bytes(&damaged);
    let needle = "no checkpoint can be resumed";
    resume_fails_within(60, &config, &damaged, &[], needle);
    assert!(
        before == tree_bytes(&damaged),
        "the damaged checkpoint stays"
    );

    // Another model size with --resume --force: refused before the config
    // is rewritten.
    let other = dir.path().join("other");
    copy_tree(&pristine, &other);
    let before = tree_bytes(&other);
    let extra = ["--force", "--set", "model.d_k=8"];
    resume_fails_within(60, &config, &other, &extra, "step-00000002");
    assert!(before == tree_bytes(&other), "the run's config stays");
}

/// Sizes beyond the machine are refused before they are spent, naming the
/// setting: a model of `d_model = 1e9` (from `--set`, or from an export's
/// JSON beside a tiny weights file), a billion evaluation rows, 1e11
/// samples, 1e14 tokens; `--force` lets a user past the estimate (here on
/// a size that fits a 2^62 batch still ends in an error, not a panic).
#[test]
fn sizes_beyond_memory_are_refused_before_they_are_spent() {
    let dir = tempfile::tempdir().unwrap();
    let run = fixture_run(dir.path(), "run-format-2");
    let config = run.join("config.toml");
    let (run_s, c) = (run.to_str().unwrap(), config.to_str().unwrap());
    let fresh = dir.path().join("fresh");
    let fresh_s = fresh.to_str().unwrap();
    let train = |set: &str, needle: &str| {
        fails_within(
            60,
            &["train", "--config", c, "--run-dir", fresh_s, "--set", set],
            needle,
        );
    };
    train("model.d_model=1000000000", "model.d_model = 1000000000");
    train("data.batch_size=4611686018427387904", "batch_size");
    train(
        "eval.batch_size=1000000000000",
        "eval.batch_size = 1000000000000",
    );
    // A run refused before it starts leaves no run directory behind: a
    // missing corpus too, which is only found when it is opened.
    let missing = dir.path().join("no-such-corpus.txt");
    train(
        &format!("data.path={:?}", missing.to_str().unwrap()),
        "no-such-corpus.txt",
    );
    assert!(!fresh.exists(), "a refused run left {fresh_s} behind");
    fails_within(
        60,
        &[
            "sample",
            "--checkpoint",
            run_s,
            "--num-samples",
            "100000000000",
        ],
        "--num-samples",
    );
    fails_within(
        60,
        &[
            "sample",
            "--checkpoint",
            run_s,
            "--max-tokens",
            "100000000000000",
        ],
        "--max-tokens",
    );
    let text = std::fs::read_to_string(&config).unwrap();
    let wide_eval = dir.path().join("wide-eval.toml");
    let (head, eval) = text.split_at(text.find("[eval]").unwrap());
    let eval: Vec<&str> = eval
        .lines()
        .map(|l| match l.starts_with("batch_size") {
            true => "batch_size = 1000000000000",
            false => l,
        })
        .collect();
    std::fs::write(&wide_eval, format!("{head}{}\n", eval.join("\n"))).unwrap();
    fails_within(
        60,
        &[
            "eval",
            "--checkpoint",
            run_s,
            "--config",
            wide_eval.to_str().unwrap(),
        ],
        "eval.batch_size",
    );

    let export = dir.path().join("m.safetensors");
    ok(&[
        "export",
        "--checkpoint",
        run_s,
        "--out",
        export.to_str().unwrap(),
    ]);
    let info_path = export.with_extension("json");
    let mut info: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&info_path).unwrap()).unwrap();
    let original = info.clone();
    info["model"]["d_model"] = 1_000_000_000.into();
    std::fs::write(&info_path, info.to_string()).unwrap();
    let export_s = export.to_str().unwrap();
    fails_within(60, &["sample", "--checkpoint", export_s], "parameters");

    // A tokenizer of more ids than the model reads (the prompt's ids
    // would index outside its embedding), and one named `/dev/zero`.
    let words: serde_json::Map<String, serde_json::Value> = (0..300)
        .map(|i| (format!("w{i}"), i.into()))
        .chain([("<eod>".to_string(), 300.into())])
        .collect();
    let tokenizer = dir.path().join("tokenizer.json");
    let json = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": null, "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": words, "unk_token": "<eod>"}
    });
    std::fs::write(&tokenizer, json.to_string()).unwrap();
    for (named, needle) in [
        (tokenizer.to_str().unwrap(), "more than the"),
        ("/dev/zero", "not a regular file"),
    ] {
        let mut info = original.clone();
        info["tokenizer"] = named.into();
        std::fs::write(&info_path, info.to_string()).unwrap();
        fails_within(60, &["sample", "--checkpoint", export_s], needle);
    }
}

/// Inputs that panicked: a corpus shrunk between a run and its resume, a
/// temperature that is not a number.
#[test]
fn inputs_that_panicked_are_one_line_errors() {
    let dir = tempfile::tempdir().unwrap();
    let run = fixture_run(dir.path(), "run-format-2");
    let (run_s, config) = (run.to_str().unwrap(), run.join("config.toml"));
    fails(
        &["sample", "--checkpoint", run_s, "--temperature", "nan"],
        "--temperature",
    );
    let corpus = dir.path().join("kjv-small.txt");
    let text = std::fs::read(&corpus).unwrap();
    std::fs::write(&corpus, &text[..700]).unwrap();
    resume_fails_within(120, &config, &run, &[], "corpus changed");
}
