//! The fault suite: faults injected at each stage of a short run where they
//! can happen (`TVQ_FAULT`, see `tvq_train`'s `fault` module), a second
//! writer, damaged checkpoints and a torn metrics line. After each, the run
//! is resumed and must end exactly as an uninterrupted run: every metrics
//! row (but its timing) and the final weights bit for bit, and the same
//! checkpoints kept, every file of them byte for byte.

use super::*;

/// Steps, checkpoint interval and checkpoints kept of the suite's run.
const TOTAL: u64 = 8;
const EVERY: u64 = 2;
const KEEP: &str = "train.keep_checkpoints=2";

/// `tvq train --quiet` on `config` into `run` with `extra` arguments and
/// `TVQ_FAULT=fault` (none if empty), not yet run.
fn train_command(config: &Path, run: &Path, fault: &str, extra: &[&str]) -> Command {
    let mut cmd = Command::new(TVQ);
    cmd.args(["train", "--config", config.to_str().unwrap()])
        .args(["--run-dir", run.to_str().unwrap(), "--quiet", "--set", KEEP])
        .args(extra);
    if !fault.is_empty() {
        cmd.env("TVQ_FAULT", fault);
    }
    cmd
}

/// [`train_command`] run to its end, whatever its exit.
fn train_with_fault(config: &Path, run: &Path, fault: &str, extra: &[&str]) -> Output {
    train_command(config, run, fault, extra)
        .output()
        .expect("tvq runs")
}

/// `tvq train --resume` of `run` without a fault; it must succeed.
fn resume(config: &Path, run: &Path) -> Output {
    succeeds(&mut train_command(config, run, "", &["--resume"]))
}

/// Every line of `metrics.jsonl`, without the timing and the memory (which
/// no two runs share).
pub(super) fn rows(run: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let mut v: serde_json::Value = serde_json::from_str(l).unwrap();
            let row = v.as_object_mut().unwrap();
            row.remove("tokens_per_s");
            row.remove("mfu");
            // Memory is a fact of the process, and present in every row.
            let rss = row.remove("peak_rss_bytes");
            if row["kind"] == "train" {
                assert!(rss.and_then(|r| r.as_u64()).is_some_and(|r| r > 1 << 20));
            }
            v
        })
        .collect()
}

/// The names in `run/checkpoints`, sorted (temporary entries included).
fn checkpoint_names(run: &Path) -> Vec<String> {
    let mut names: Vec<String> = checkpoint_list(run)
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// Every file of every checkpoint kept in `run`, by path under
/// `checkpoints/`, with its bytes' hash.
fn checkpoint_files(run: &Path) -> Vec<(String, u64)> {
    let mut files = vec![];
    for dir in checkpoint_list(run) {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let name = format!(
                "{}/{}",
                dir.file_name().unwrap().to_string_lossy(),
                path.file_name().unwrap().to_string_lossy()
            );
            files.push((
                name,
                tvq_train::checkpoint::checksum(&std::fs::read(&path).unwrap()),
            ));
        }
    }
    files.sort();
    files
}

/// What an uninterrupted run leaves: its rows, final weights and checkpoints.
struct Reference {
    rows: Vec<serde_json::Value>,
    weights: Vec<(String, Vec<u8>)>,
    checkpoints: Vec<String>,
    files: Vec<(String, u64)>,
}

impl Reference {
    fn of(config: &Path, dir: &Path) -> Self {
        let run = dir.join("reference");
        succeeds(&mut train_command(config, &run, "", &[]));
        // Every training row reports its MFU (against the CPU's measured peak).
        let text = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
        for line in text.lines().filter(|l| l.contains(r#""kind":"train""#)) {
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            let mfu = v["mfu"].as_f64().unwrap();
            assert!(mfu > 0.0 && mfu < 1.0, "{line}");
        }
        let rows = rows(&run);
        let train_rows = rows.iter().filter(|r| r["kind"] == "train").count();
        assert_eq!(train_rows, TOTAL as usize);
        assert_eq!(rows.last().unwrap()["kind"], "final_eval");
        Self {
            rows,
            weights: final_weights(&run, TOTAL),
            checkpoints: checkpoint_names(&run),
            files: checkpoint_files(&run),
        }
    }

    /// `run`, once resumed to its end, equals the reference.
    fn assert_matches(&self, run: &Path, what: &str) {
        assert!(
            rows(run) == self.rows,
            "{what}: metrics rows differ from the uninterrupted run's"
        );
        assert_eq!(checkpoint_names(run), self.checkpoints, "{what}");
        super::logs::assert_tensorboard_matches_logs(run, what);
        assert!(
            final_weights(run, TOTAL) == self.weights,
            "{what}: final weights differ"
        );
        // The same run writes the same bytes, however often interrupted.
        assert_eq!(
            checkpoint_files(run),
            self.files,
            "{what}: checkpoint bytes"
        );
    }
}

/// Every `step-N` checkpoint in `run` is complete (has its manifest): a
/// fault never leaves a half-written one under a name readers list.
fn assert_no_partial_checkpoint(run: &Path, what: &str) {
    for dir in checkpoint_list(run) {
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        if name.starts_with("step-") {
            assert!(
                dir.join("manifest.json").is_file(),
                "{what}: {name} is incomplete"
            );
        }
    }
}

#[cfg(unix)]
fn killed(out: &Output) -> bool {
    use std::os::unix::process::ExitStatusExt;
    out.status.signal() == Some(9)
}

/// A fault at `spec`, then `--resume`: the resumed run ends as the reference.
fn fault_then_resume(config: &Path, dir: &Path, reference: &Reference, spec: &str) {
    let run = dir.join(spec.replace([':', '@'], "-"));
    let out = train_with_fault(config, &run, spec, &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked"), "{spec}: {err}");
    if spec.ends_with("prune:error@1") {
        // The checkpoint is written; an old one left undeleted only warns.
        assert!(out.status.success(), "{spec}: {err}");
        assert!(
            err.contains("could not delete old checkpoint"),
            "{spec}: {err}"
        );
    } else if spec.contains(":kill") {
        assert!(killed(&out), "{spec}: not killed: {err}");
    } else {
        assert_eq!(out.status.code(), Some(1), "{spec}: {err}");
        let errors: Vec<_> = err.lines().filter(|l| l.starts_with("error")).collect();
        assert_eq!(errors.len(), 1, "{spec}: {err}");
        assert!(errors[0].contains("injected fault"), "{spec}: {err}");
        // A failed write takes its temporary files with it.
        let names = checkpoint_names(&run);
        assert!(
            names.iter().all(|n| n.starts_with("step-")),
            "{spec}: {names:?}"
        );
    }
    assert_no_partial_checkpoint(&run, spec);
    let resumed = resume(config, &run);
    let err = String::from_utf8_lossy(&resumed.stderr);
    assert!(
        !err.contains("skipping"),
        "{spec}: a damaged checkpoint: {err}"
    );
    reference.assert_matches(&run, spec);
}

/// I/O errors and kills at each stage of writing a checkpoint and of
/// appending a metrics line. The run checkpoints at steps 2, 4, 6, 8 and
/// prunes from the third checkpoint on; it logs 8 train rows, eval rows
/// after steps 3 and 6, and the final evaluation (11 appends).
#[test]
fn faults_at_every_stage_of_a_write_lose_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let config = tiny_config(dir.path(), TOTAL, EVERY);
    let reference = Reference::of(&config, dir.path());
    for spec in [
        "checkpoint-data:error@2",
        "checkpoint-manifest:error@2",
        "checkpoint-rename:error@3",
        "checkpoint-prune:error@1",
        "metrics-append:error@4",
        "metrics-append:error@11",
        "checkpoint-data:kill@2",
        "checkpoint-manifest:kill@3",
        "checkpoint-rename:kill@2",
        "checkpoint-prune:kill@1",
        "checkpoint-rename:kill@4",
        "metrics-append:kill@5",
        "metrics-append:kill@11",
    ] {
        fault_then_resume(&config, dir.path(), &reference, spec);
    }
}

/// `kill -9` from outside at several moments of one run (each resumed in
/// turn, so later kills land in resumed runs), then to the end.
#[test]
fn repeated_kills_and_resumes_end_as_an_uninterrupted_run() {
    let dir = tempfile::tempdir().unwrap();
    let config = tiny_config(dir.path(), TOTAL, EVERY);
    let reference = Reference::of(&config, dir.path());
    let run = dir.path().join("killed");
    for (i, after_lines) in [1, 4, 8].into_iter().enumerate() {
        let mut cmd = Command::new(TVQ);
        cmd.args(["train", "--config", config.to_str().unwrap()])
            .args(["--run-dir", run.to_str().unwrap(), "--quiet", "--set", KEEP])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null());
        if i > 0 {
            cmd.arg("--resume");
        }
        let mut child = cmd.spawn().unwrap();
        wait_for(&mut child, &format!("{after_lines} metrics lines"), || {
            metrics_lines(&run) >= after_lines
        });
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        assert_no_partial_checkpoint(&run, "after a kill");
    }
    resume(&config, &run);
    reference.assert_matches(&run, "killed three times");
}

/// Damages `file` of a checkpoint: one byte flipped, or cut in half.
fn damage(file: &Path, truncate: bool) {
    let mut bytes = std::fs::read(file).unwrap();
    if truncate {
        bytes.truncate(bytes.len() / 2);
    } else {
        let middle = bytes.len() / 2;
        bytes[middle] ^= 0x20;
    }
    std::fs::write(file, bytes).unwrap();
}

/// The newest checkpoint damaged, each of its files in turn (flipped or
/// truncated, alternately): the run resumes from the one before, with a
/// warning, replaces the damaged one when it gets there, and ends as the
/// reference. A torn last metrics line is dropped and written again.
#[test]
fn a_damaged_newest_checkpoint_or_a_torn_metrics_line_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let config = tiny_config(dir.path(), TOTAL, EVERY);
    let reference = Reference::of(&config, dir.path());
    let base = dir.path().join("base");
    succeeds(&mut train_command(
        &config,
        &base,
        "",
        &["--max-steps", "6"],
    ));
    let newest = base.join("checkpoints/step-00000006");
    let mut files: Vec<String> = std::fs::read_dir(&newest)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    files.sort();
    assert_eq!(
        files,
        [
            "manifest.json",
            "model.safetensors",
            "optimizer.safetensors",
            "state.safetensors",
            "trainer.json"
        ]
    );
    for (i, file) in files.iter().enumerate() {
        let run = dir.path().join(format!("damaged-{file}"));
        copy_tree(&base, &run);
        let truncate = i % 2 == 1;
        damage(&run.join("checkpoints/step-00000006").join(file), truncate);
        let what = format!("{file} {}", if truncate { "truncated" } else { "flipped" });
        let err = String::from_utf8_lossy(&resume(&config, &run).stderr).into_owned();
        assert!(
            err.contains("skipping checkpoint") && err.contains("step-00000006"),
            "{what}: no warning:\n{err}"
        );
        assert!(
            err.contains("resuming from") && err.contains("step-00000004"),
            "{what}: {err}"
        );
        reference.assert_matches(&run, &what);
    }

    // A torn last line (a kill in the middle of an append): `tvq plot`
    // reads past it, and the resumed run writes the line again.
    let run = dir.path().join("torn");
    copy_tree(&base, &run);
    let metrics = run.join("metrics.jsonl");
    let mut text = std::fs::read_to_string(&metrics).unwrap();
    text.truncate(text.trim_end().rfind('\n').unwrap() + 1);
    text += r#"{"kind":"final_eval","step":6,"split":"valid"#;
    std::fs::write(&metrics, text).unwrap();
    ok(&["plot", "--run-dir", run.to_str().unwrap()]);
    resume(&config, &run);
    reference.assert_matches(&run, "torn metrics line");
}

/// A non-finite loss stops the run with one line naming the last good
/// checkpoint, which stays (however few checkpoints are kept) and from
/// which the run resumes.
#[test]
fn a_non_finite_loss_stops_the_run_and_keeps_the_last_good_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let config = tiny_config(dir.path(), TOTAL, EVERY);
    let reference = Reference::of(&config, dir.path());
    let run = dir.path().join("nan");
    let out = train_with_fault(
        &config,
        &run,
        "loss:error@5",
        &["--set", "train.keep_checkpoints=1"],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    let errors: Vec<_> = err.lines().filter(|l| l.starts_with("error")).collect();
    assert_eq!(errors.len(), 1, "{err}");
    assert!(
        errors[0].contains("loss is NaN at step 5") && errors[0].contains("step-00000004"),
        "{err}"
    );
    assert_eq!(checkpoint_names(&run), ["step-00000004"]);
    let logged: Vec<_> = rows(&run)
        .iter()
        .map(|r| r["step"].as_u64().unwrap())
        .collect();
    assert_eq!(
        logged,
        [1, 2, 3, 3, 4],
        "the steps before the NaN, and the eval at 3"
    );
    resume(&config, &run);
    reference.assert_matches(&run, "non-finite loss");
}

/// A second `tvq train` on a run directory in use (plain, resumed, forced,
/// or as a second node 0) is refused with the holder named and changes
/// nothing; meanwhile `export`, `eval` and `plot` read the run's latest
/// complete checkpoint while it writes and deletes them every step. The
/// run is long enough to outlive all that however slow the machine, and
/// stopped by an interrupt.
#[test]
fn a_second_writer_is_refused_and_readers_see_complete_checkpoints() {
    let dir = tempfile::tempdir().unwrap();
    let config = tiny_config(dir.path(), 100_000, 1);
    let config = config.to_str().unwrap();
    let run = dir.path().join("run");
    let mut first = Command::new(TVQ)
        .args([
            "train",
            "--config",
            config,
            "--run-dir",
            run.to_str().unwrap(),
        ])
        .args(["--quiet", "--set", "train.keep_checkpoints=1"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Any complete checkpoint: each one lives a single step.
    wait_for(&mut first, "a checkpoint", || {
        checkpoint_list(&run)
            .iter()
            .any(|c| c.join("manifest.json").exists())
    });
    let holder = format!("pid {}", first.id());
    let run_arg = run.to_str().unwrap();
    let port = free_ports(4).to_string();
    let coordinator = format!("127.0.0.1:{port}");
    for extra in [
        &[][..],
        &["--resume"],
        &["--force"],
        &[
            "--nodes",
            "2",
            "--node-rank",
            "0",
            "--coordinator",
            &coordinator,
        ],
    ] {
        let args = [
            &["train", "--config", config, "--run-dir", run_arg][..],
            extra,
        ]
        .concat();
        assert!(
            first.try_wait().unwrap().is_none(),
            "the first run ended too soon"
        );
        let out = tvq(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        let errors: Vec<_> = err.lines().filter(|l| l.starts_with("error")).collect();
        assert!(
            !out.status.success() && errors.len() == 1,
            "{extra:?}: {err}"
        );
        assert!(
            errors[0].contains("is in use by another `tvq train`") && errors[0].contains(&holder),
            "{extra:?}: {err}"
        );
    }
    // Readers while the run writes a checkpoint and deletes the one before
    // it at every step.
    let out = dir.path().join("while.safetensors");
    for _ in 0..3 {
        ok(&[
            "export",
            "--checkpoint",
            run_arg,
            "--out",
            out.to_str().unwrap(),
        ]);
        ok(&[
            "plot",
            "--run-dir",
            run_arg,
            "--out",
            dir.path().join("p.png").to_str().unwrap(),
        ]);
    }
    assert!(
        first.try_wait().unwrap().is_none(),
        "the first run ended too soon"
    );
    super::interrupt_once_under_way(&run, &mut first);
    let status = first.wait().unwrap();
    assert!(status.success());
    let steps: Vec<u64> = rows(&run)
        .iter()
        .filter(|r| r["kind"] == "train")
        .map(|r| r["step"].as_u64().unwrap())
        .collect();
    assert_eq!(
        steps,
        (1..=steps.len() as u64).collect::<Vec<_>>(),
        "one writer's rows, in order"
    );
    ok(&["eval", "--checkpoint", run_arg]);
}

/// Writes `payload` as one masked binary websocket frame (as a client
/// must) after the opening handshake on `route`, then drops the connection
/// without closing it. Whatever happens is ignored: a stranger does not care.
fn websocket_stranger(port: u16, route: &str, payload: &[u8]) {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return;
    };
    let _ = s.set_read_timeout(Some(Duration::from_millis(100)));
    let _ = write!(
        s,
        "GET {route} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n\
         Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\
         Sec-WebSocket-Version: 13\r\n\r\n"
    );
    let mut buf = [0u8; 1024];
    let _ = s.read(&mut buf);
    let mask = [0x5a, 0x13, 0xc4, 0x7e];
    let mut frame = vec![0x82, 0x80 | payload.len() as u8];
    frame.extend(mask);
    frame.extend(payload.iter().enumerate().map(|(i, b)| b ^ mask[i % 4]));
    let _ = s.write_all(&frame);
    let _ = s.read(&mut buf);
}

/// A newtype enum variant `name(u64)` as the engine's MessagePack
/// encoding writes it: `{name: [u64]}` (`wrapped`: the u64 in a
/// one-field struct) or `{name: u64}`.
fn engine_message(name: &str, value: u64, wrapped: bool) -> Vec<u8> {
    let mut m = vec![0x81, 0xa0 | name.len() as u8];
    m.extend(name.as_bytes());
    if wrapped {
        m.push(0x91);
    }
    m.push(0xcf);
    m.extend(value.to_be_bytes());
    m
}

/// One round of a stranger at every port of a run: raw garbage, a bare
/// HTTP request, garbage and well-formed but foreign engine messages on
/// each of the engine's websocket routes.
fn stranger_round(ports: std::ops::Range<u16>, round: u64) {
    use std::io::Write;
    for port in ports {
        if let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) {
            let _ = s.write_all(b"\x00\xff\x13garbage\r\n\r\n\x81\x82");
        }
        if let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) {
            let _ = s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n");
        }
        for route in ["/request", "/response", "/data", "/sync"] {
            websocket_stranger(port, route, b"\x93\xff\x00not msgpack");
            // A session the coordinator never opened; a tensor transfer
            // that may be a real one (the ids count from 0).
            websocket_stranger(port, route, &engine_message("Init", 1 << 40 | round, true));
            websocket_stranger(
                port,
                route,
                &engine_message("TensorRequest", round % 4, false),
            );
        }
    }
}

/// A stranger that speaks the engine's protocol through the engine itself:
/// registers with the run's coordinators as a node would and offers a
/// vector of its own to sum, again and again (until a call never returns).
fn engine_stranger(coordinator: u16, own_port: u16, stop: &std::sync::atomic::AtomicBool) {
    use burn::prelude::*;
    use burn_collective::{CollectiveConfig, PeerId, ReduceOperation};
    type E = burn::Dispatch;
    let device = burn::DispatchDevice::Flex(Default::default());
    let mut round = 0u16;
    while !stop.load(std::sync::atomic::Ordering::SeqCst) {
        let (to, own) = (coordinator + round % 2, own_port + round % 2);
        round += 1;
        let parse = |s: String| s.parse().unwrap();
        let config = CollectiveConfig::default()
            .with_num_devices(1)
            .with_num_nodes(2)
            .with_global_address(parse(format!("ws://127.0.0.1:{to}")))
            .with_node_address(parse(format!("ws://127.0.0.1:{own}")))
            .with_data_service_port(own);
        let garbage: Vec<f32> = (0..4096).map(|i| (i as f32).sin() * 1e3).collect();
        let tensor = Tensor::<E, 1>::from_data(TensorData::new(garbage, [4096]), &device);
        let peer = PeerId(7);
        if burn_collective::register::<E>(peer, device.clone(), config).is_ok() {
            let _ = burn_collective::all_reduce::<E>(
                peer,
                tensor.into_primitive().tensor(),
                ReduceOperation::Sum,
            );
        }
        let _ = burn_collective::finish_collective::<E>(peer);
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The arguments of a node of the two-node fault tests: one shard per
/// node, two checkpoints kept, `peer_timeout` seconds for the other node,
/// resuming when `resume`.
fn node_args(peer_timeout: &str, resume: bool) -> Vec<String> {
    let mut args = [
        "--peer-timeout",
        peer_timeout,
        "--set",
        KEEP,
        "--set",
        "train.micro_batches=1",
    ]
    .map(String::from)
    .to_vec();
    if resume {
        args.push("--resume".into());
    }
    args
}

/// Waits for resumed `nodes` (in rank order); each must succeed.
fn assert_nodes_succeed(nodes: [std::process::Child; 2]) {
    for (rank, child) in nodes.into_iter().enumerate() {
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "resumed node {rank}:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// A foreign vector in a sum, deterministically: `TVQ_FAULT=sum:error@3`
/// adds one to the third sum each node receives (what a stranger in the
/// ring does), so the sum check must refuse it on both nodes: one error
/// line each naming it, no checkpoint of the step, and a resumed run that
/// ends exactly as the uninterrupted one. (The strangers test below sends
/// real foreign processes, whose timing decides whether they get in.)
#[test]
fn a_sum_with_a_foreign_vector_is_refused_and_never_stepped_with() {
    let dir = tempfile::tempdir().unwrap();
    let config = tiny_config(dir.path(), TOTAL, EVERY);
    let reference = Reference::of(&config, dir.path());
    let run = dir.path().join("nodes");
    let node = |rank: usize, fault: Option<&str>, resume: bool, at: &str| {
        let extra = node_args("60", resume);
        let mut cmd = node_command(config.to_str().unwrap(), &run, at, rank, &extra);
        if let Some(f) = fault {
            cmd.env("TVQ_FAULT", f);
        }
        cmd.spawn().unwrap()
    };
    let at = format!("127.0.0.1:{}", free_ports(6));
    let nodes = [0, 1].map(|rank| node(rank, Some("sum:error@3"), false, &at));
    for (rank, child) in nodes.into_iter().enumerate() {
        let out = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success(),
            "node {rank} stepped with a foreign sum:\n{err}"
        );
        let errors: Vec<_> = err.lines().filter(|l| l.starts_with("error")).collect();
        assert_eq!(errors.len(), 1, "node {rank}: one error line:\n{err}");
        assert!(err.contains("does not add up"), "node {rank}:\n{err}");
    }
    assert_no_partial_checkpoint(&run, "a foreign sum");
    let at = format!("127.0.0.1:{}", free_ports(6));
    assert_nodes_succeed([0, 1].map(|rank| node(rank, None, true, &at)));
    reference.assert_matches(&run, "a foreign sum refused");
}

/// Strangers at every port of a two-node run (coordinator, both nodes'
/// tensor services): malformed bytes, a bare HTTP request, garbage and
/// foreign engine messages, and a process that registers as a node and
/// offers its own vector. No node panics or waits past `--peer-timeout`;
/// a sum the stranger got into is refused (one error line), never stepped
/// with; resumed without strangers, the run ends exactly as one that never
/// met them.
#[test]
fn strangers_on_the_network_never_panic_hang_or_change_the_weights() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    let dir = tempfile::tempdir().unwrap();
    let config = tiny_config(dir.path(), TOTAL, EVERY);
    // One process with two shards is what two nodes of one shard compute.
    let reference = Reference::of(&config, dir.path());
    let run = dir.path().join("nodes");
    let port = free_ports(8);
    // The resumed nodes meet elsewhere: a stranger's call still under way
    // at the old ports stays there.
    let resume_at = format!("127.0.0.1:{}", free_ports(6));
    let node = |rank: usize, resume: bool| {
        let coordinator = match resume {
            false => format!("127.0.0.1:{port}"),
            true => resume_at.clone(),
        };
        let extra = node_args("5", resume);
        (
            Instant::now(),
            spawn_node(config.to_str().unwrap(), &run, &coordinator, rank, &extra),
        )
    };
    let nodes = [node(0, false), node(1, false)];
    let stop = Arc::new(AtomicBool::new(false));
    let strangers = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut round = 0;
            while !stop.load(Ordering::SeqCst) {
                stranger_round(port..port + 6, round);
                round += 1;
            }
            round
        })
    };
    {
        let stop = stop.clone();
        // Detached: its last call may wait forever on a session it broke.
        std::thread::spawn(move || engine_stranger(port, port + 6, &stop));
    }
    let mut failed = false;
    for (rank, (started, child)) in nodes.into_iter().enumerate() {
        let out = child.wait_with_output().unwrap();
        let took = started.elapsed();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!err.contains("panicked at"), "node {rank} panicked:\n{err}");
        assert!(
            took < Duration::from_secs(60),
            "node {rank} took {took:?}:\n{err}"
        );
        if !out.status.success() {
            let errors: Vec<_> = err.lines().filter(|l| l.starts_with("error")).collect();
            assert_eq!(errors.len(), 1, "node {rank}: one error line:\n{err}");
            failed = true;
        }
    }
    stop.store(true, Ordering::SeqCst);
    assert!(strangers.join().unwrap() > 0, "the strangers came");
    if failed {
        assert_no_partial_checkpoint(&run, "strangers");
        assert_nodes_succeed([node(0, true).1, node(1, true).1]);
    }
    reference.assert_matches(&run, "strangers on the network");
}
