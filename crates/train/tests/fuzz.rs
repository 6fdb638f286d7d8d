//! Mutation fuzzing of everything tvq reads from a run or an export:
//! seeded mutations of a committed checkpoint and of an export made from
//! it, each file's manifest entry forged to match so that the checks past
//! the checksums are reached; of configs, token caches, tokenizer files
//! and task files. Two kinds of mutation: of bytes (bit flips,
//! bytes and 64-bit words set to edge values, truncations, numbers in the
//! JSON made huge), and of structure ([`mutate_structure`]: the file
//! parsed, one to three of its fields (a number, a string, a shape, an
//! offset, a metadata entry) set to boundary values, and written back
//! well-formed, which byte mutations almost never achieve). Each case
//! must end in `Ok` or a one-line error, never a panic, and hold less than
//! [`HEAP_LIMIT`] more heap than before (counted by this binary's
//! allocator; an allocation far beyond it aborts the binary, which fails
//! too).
//!
//! `TVQ_FUZZ_CASES=N` runs N cases per target instead of the default (a
//! few seconds in CI); the seed of a failing case is printed.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use tvq_data::hash::SplitMix64;
use tvq_testkit::CountingAllocator;
use tvq_train::placement::device::{DeviceSpec, precision_on};
use tvq_train::{RunConfig, Trainer, checkpoint};

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

/// The most heap one case may add: the fixture's model and optimizer take
/// well under a MiB, so this is room for the CPU backend's pools, far
/// below what a size believed from a file could claim.
const HEAP_LIMIT: usize = 256 << 20;

/// One target at a time: the heap counts are process-wide.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn cases() -> u64 {
    std::env::var("TVQ_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(150)
}

/// The committed run whose checkpoint seeds the mutations.
fn fixture() -> PathBuf {
    tvq_testkit::crate_dir().join("../cli/tests/fixtures/run-format-2")
}

/// `bytes` changed by one to four seeded mutations.
fn mutate(bytes: &mut Vec<u8>, rng: &mut SplitMix64) {
    const WORDS: [u64; 6] = [0, 1, u64::MAX, 1 << 40, 1 << 62, 0x7fff_ffff];
    let pick = |rng: &mut SplitMix64, n: usize| (rng.next_u64() % n.max(1) as u64) as usize;
    for _ in 0..=pick(rng, 4) {
        if bytes.is_empty() {
            return;
        }
        let at = pick(rng, bytes.len());
        match pick(rng, 6) {
            0 => bytes[at] ^= 1 << pick(rng, 8),
            1 => bytes[at] = [0, 0xff, 0x7f, b'9', b'-', b'"'][pick(rng, 6)],
            2 => {
                let word = WORDS[pick(rng, WORDS.len())].to_le_bytes();
                let end = (at + 8).min(bytes.len());
                bytes[at..end].copy_from_slice(&word[..end - at]);
            }
            3 => bytes.truncate(at),
            4 => {
                // A number in a JSON text (or header) made huge.
                if let Some(d) = bytes[at..].iter().position(u8::is_ascii_digit) {
                    let s = at + d;
                    let huge = b"999999999";
                    bytes.splice(s..s + 1, huge.iter().copied());
                }
            }
            _ => {
                let n = pick(rng, 16);
                bytes.splice(at..at, std::iter::repeat_n(b'1', n));
            }
        }
    }
}

/// Rewrites the manifest of `ckpt` to match its files as they are now.
fn forge_manifest(ckpt: &Path) {
    let path = ckpt.join("manifest.json");
    let Ok(mut m) = serde_json::from_slice::<serde_json::Value>(&std::fs::read(&path).unwrap())
    else {
        return;
    };
    let Some(files) = m.get_mut("files").and_then(|f| f.as_object_mut()) else {
        return;
    };
    for (name, entry) in files.iter_mut() {
        if let Ok(bytes) = std::fs::read(ckpt.join(name)) {
            entry["bytes"] = bytes.len().into();
            entry["xxh3"] = format!("{:016x}", checkpoint::checksum(&bytes)).into();
        }
    }
    std::fs::write(&path, m.to_string()).unwrap();
}

/// Runs `case` for each seed under the heap and panic checks.
fn fuzz(target: &str, mut case: impl FnMut(&mut SplitMix64)) {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    for seed in 0..cases() {
        let mut rng = SplitMix64(seed ^ tvq_data::hash::splitmix64(target.len() as u64));
        let before = CountingAllocator::reset_peak();
        let ran = catch_unwind(AssertUnwindSafe(|| case(&mut rng)));
        let added = CountingAllocator::peak().saturating_sub(before);
        assert!(ran.is_ok(), "{target}: case {seed} panicked");
        assert!(
            added < HEAP_LIMIT,
            "{target}: case {seed} took {} MiB of heap",
            added >> 20
        );
    }
}

/// The fixture's config, its corpus path pointing nowhere (resuming reads
/// only the checkpoint).
fn fixture_config() -> RunConfig {
    let text = std::fs::read_to_string(fixture().join("config.toml")).unwrap();
    RunConfig::parse(&text, &[]).unwrap()
}

/// Values a field is set to: zero, one, minus one, the edges of 32- and
/// 64-bit integers, a trillion, not a number, an empty and a huge string.
const BOUNDARIES: [&str; 11] = [
    "0",
    "1",
    "-1",
    "2147483648",
    "4294967296",
    "9223372036854775808",
    "18446744073709551615",
    "1000000000000",
    "NaN",
    "",
    "HUGE",
];

/// A boundary value in the field's own kind: a JSON number where the field
/// is one (and the value can be), else a string (safetensors metadata
/// holds its numbers as strings).
fn boundary(rng: &mut SplitMix64, as_string: bool) -> serde_json::Value {
    let text = BOUNDARIES[(rng.next_u64() % BOUNDARIES.len() as u64) as usize];
    let text = match text {
        "HUGE" => "9".repeat(1 << 16),
        t => t.to_string(),
    };
    match serde_json::from_str::<serde_json::Value>(&text) {
        Ok(number @ serde_json::Value::Number(_)) if !as_string => number,
        _ => serde_json::Value::String(text),
    }
}

/// The JSON pointers of every number and string in `v` (under `at`).
fn leaves(v: &serde_json::Value, at: String, out: &mut Vec<String>) {
    match v {
        serde_json::Value::Object(m) => {
            for (k, v) in m {
                leaves(
                    v,
                    format!("{at}/{}", k.replace('~', "~0").replace('/', "~1")),
                    out,
                );
            }
        }
        serde_json::Value::Array(a) => {
            for (i, v) in a.iter().enumerate() {
                leaves(v, format!("{at}/{i}"), out);
            }
        }
        serde_json::Value::Number(_) | serde_json::Value::String(_) => out.push(at),
        _ => {}
    }
}

/// A file as structure: a safetensors header (with the tensor bytes after
/// it) or a JSON text.
enum Parsed {
    Safetensors(serde_json::Value, Vec<u8>),
    Json(serde_json::Value),
}

fn parse(bytes: &[u8]) -> Option<Parsed> {
    if let Ok(json) = serde_json::from_slice(bytes) {
        return Some(Parsed::Json(json));
    }
    let n = u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?) as usize;
    let header = serde_json::from_slice(bytes.get(8..8usize.checked_add(n)?)?).ok()?;
    Some(Parsed::Safetensors(header, bytes[8 + n..].to_vec()))
}

fn serialise(parsed: &Parsed) -> Vec<u8> {
    match parsed {
        Parsed::Json(json) => json.to_string().into_bytes(),
        Parsed::Safetensors(header, data) => {
            let header = header.to_string().into_bytes();
            let mut out = (header.len() as u64).to_le_bytes().to_vec();
            out.extend(header);
            out.extend(data);
            out
        }
    }
}

/// `bytes` (a safetensors file or a JSON text) with one to three of its
/// fields changed, written back well-formed: a number or string set to a
/// boundary value or to another field's value, or an array (a shape, a
/// pair of offsets) with two entries swapped, a 1 inserted or an entry
/// removed. Half the picks in a safetensors file fall on its
/// `__metadata__`, where the counts live.
fn mutate_structure(bytes: &mut Vec<u8>, rng: &mut SplitMix64) {
    let Some(mut parsed) = parse(bytes) else {
        return;
    };
    let root = match &mut parsed {
        Parsed::Json(v) | Parsed::Safetensors(v, _) => v,
    };
    let pick = |rng: &mut SplitMix64, n: usize| (rng.next_u64() % n.max(1) as u64) as usize;
    for _ in 0..=pick(rng, 3) {
        let mut all = vec![];
        leaves(root, String::new(), &mut all);
        let meta: Vec<&String> = all
            .iter()
            .filter(|p| p.starts_with("/__metadata__/"))
            .collect();
        let at = if !meta.is_empty() && rng.next_u64().is_multiple_of(2) {
            meta[pick(rng, meta.len())].clone()
        } else if all.is_empty() {
            return;
        } else {
            all[pick(rng, all.len())].clone()
        };
        let other = root.pointer(&all[pick(rng, all.len())]).cloned();
        let is_string = root.pointer(&at).is_some_and(|v| v.is_string());
        match pick(rng, 4) {
            0 | 1 => *root.pointer_mut(&at).expect("a leaf") = boundary(rng, is_string),
            2 => *root.pointer_mut(&at).expect("a leaf") = other.expect("a leaf"),
            _ => {
                // The array holding the leaf: a shape or offsets.
                let parent = &at[..at.rfind('/').unwrap_or(0)];
                if let Some(serde_json::Value::Array(a)) = root.pointer_mut(parent) {
                    let (i, j) = (pick(rng, a.len()), pick(rng, a.len()));
                    match pick(rng, 3) {
                        0 => a.swap(i, j),
                        1 => a.insert(i, 1.into()),
                        _ => drop(a.remove(i)),
                    }
                }
            }
        }
    }
    *bytes = serialise(&parsed);
}

/// An error shown to a user is one line.
fn one_line(err: impl std::fmt::Display, target: &str) {
    let text = err.to_string();
    assert!(
        !text.contains('\n'),
        "{target}: an error of more than one line: {text}"
    );
}

/// Mutated checkpoints, resumed by a trainer of the fixture's config: a
/// seeded file of the five mutated by `mutate`, the manifest forged to
/// match (unless it is the one mutated). Some mutations leave a loadable
/// checkpoint: both outcomes are fine, a panic, a runaway allocation or an
/// error of many lines is not.
fn checkpoint_cases(target: &str, mutate: fn(&mut Vec<u8>, &mut SplitMix64)) {
    let cfg = fixture_config();
    let model = cfg.model_config(tvq_data::Vocab::Bytes.size());
    let device = DeviceSpec::Cpu.init().unwrap().0;
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("run/checkpoints/step-00000002");
    let source = fixture().join("checkpoints/step-00000002");
    let names = [
        "model.safetensors",
        "optimizer.safetensors",
        "state.safetensors",
        "trainer.json",
        "manifest.json",
    ];
    let mut loaded = 0;
    fuzz(target, |rng| {
        std::fs::create_dir_all(&ckpt).unwrap();
        for name in names {
            std::fs::copy(source.join(name), ckpt.join(name)).unwrap();
        }
        let name = names[(rng.next_u64() % names.len() as u64) as usize];
        let mut bytes = std::fs::read(ckpt.join(name)).unwrap();
        mutate(&mut bytes, rng);
        std::fs::write(ckpt.join(name), bytes).unwrap();
        if name != "manifest.json" {
            forge_manifest(&ckpt);
        }
        let mut trainer = Trainer::new(&model, &cfg.train, std::slice::from_ref(&device)).unwrap();
        match trainer.resume(&ckpt, false) {
            Ok(_) => loaded += 1,
            Err(e) => one_line(e, target),
        }
    });
    assert!(
        loaded < cases(),
        "every mutation loaded: the mutations do nothing"
    );
}

#[test]
fn mutated_checkpoints_load_or_fail_cleanly() {
    checkpoint_cases("checkpoint", mutate);
}

#[test]
fn checkpoints_with_fields_at_their_boundaries_load_or_fail_cleanly() {
    checkpoint_cases("checkpoint fields", mutate_structure);
}

/// Mutated exports (the weights or the JSON beside them, by `mutate`)
/// load for inference or fail cleanly.
fn export_cases(target: &str, mutate: fn(&mut Vec<u8>, &mut SplitMix64)) {
    let cfg = fixture_config();
    let model = cfg.model_config(tvq_data::Vocab::Bytes.size());
    let device = DeviceSpec::Cpu.init().unwrap().0;
    let dir = tempfile::tempdir().unwrap();
    let mut trainer = Trainer::new(&model, &cfg.train, std::slice::from_ref(&device)).unwrap();
    trainer
        .resume(&fixture().join("checkpoints/step-00000002"), false)
        .unwrap();
    let weights = dir.path().join("seed.safetensors");
    let info = tvq_train::inference::export::ExportInfo {
        format: "tvq".into(),
        model: model.clone(),
        vocab: "bytes+3".into(),
        tokenizer: None,
        step: 2,
    };
    tvq_train::inference::export::export(trainer.model(), &info, &weights).unwrap();
    let seed = [
        std::fs::read(&weights).unwrap(),
        std::fs::read(weights.with_extension("json")).unwrap(),
    ];
    let case_path = dir.path().join("case.safetensors");
    let mut loaded = 0;
    fuzz(target, |rng| {
        let mut files = seed.clone();
        let which = (rng.next_u64() % 2) as usize;
        mutate(&mut files[which], rng);
        std::fs::write(&case_path, &files[0]).unwrap();
        std::fs::write(case_path.with_extension("json"), &files[1]).unwrap();
        let result = tvq_train::inference::load::load_for_inference(&case_path, None, &device);
        match result {
            Ok(_) => loaded += 1,
            Err(e) => one_line(e, target),
        }
    });
    assert!(
        loaded < cases(),
        "every mutation loaded: the mutations do nothing"
    );
}

#[test]
fn mutated_exports_load_or_fail_cleanly() {
    export_cases("export", mutate);
}

#[test]
fn exports_with_fields_at_their_boundaries_load_or_fail_cleanly() {
    export_cases("export fields", mutate_structure);
}

/// Mutated config texts parse or fail cleanly (the sizes they claim are
/// the memory budget's to refuse, not the parser's).
#[test]
fn mutated_configs_parse_or_fail_cleanly() {
    let seed = std::fs::read(fixture().join("config.toml")).unwrap();
    let mut parsed = 0;
    fuzz("config", |rng| {
        let mut text = seed.clone();
        mutate(&mut text, rng);
        if RunConfig::parse(&String::from_utf8_lossy(&text), &[]).is_ok() {
            parsed += 1;
        }
    });
    assert!(
        parsed < cases(),
        "every mutation parsed: the mutations do nothing"
    );
}

/// Mutated token caches (of a directory of text files, tokenized once)
/// open or fail cleanly, and what opens hands out tokens within the
/// vocabulary for every position of every split.
#[test]
fn mutated_token_caches_open_or_fail_cleanly() {
    use tvq_data::{Corpus, CorpusKind, DataConfig, Split};
    let dir = tempfile::tempdir().unwrap();
    let corpus = dir.path().join("corpus");
    std::fs::create_dir_all(&corpus).unwrap();
    for (name, text) in [("a.txt", "In the beginning. "), ("b.txt", "And God said. ")] {
        std::fs::write(corpus.join(name), text.repeat(40)).unwrap();
    }
    let mut spec = DataConfig::new(CorpusKind::Text, &corpus);
    spec.cache_dir = Some(dir.path().join("cache"));
    Corpus::open(&spec).unwrap();
    let caches: Vec<(PathBuf, Vec<u8>)> = std::fs::read_dir(dir.path().join("cache"))
        .unwrap()
        .map(|e| {
            let path = e.unwrap().path();
            let bytes = std::fs::read(&path).unwrap();
            (path, bytes)
        })
        .collect();
    assert!(!caches.is_empty(), "the corpus is cached");
    let mut opened = 0;
    fuzz("token cache", |rng| {
        for (path, bytes) in &caches {
            std::fs::write(path, bytes).unwrap();
        }
        let (path, bytes) = &caches[(rng.next_u64() % caches.len() as u64) as usize];
        let mut bytes = bytes.clone();
        mutate(&mut bytes, rng);
        std::fs::write(path, bytes).unwrap();
        if let Ok(c) = Corpus::open(&spec) {
            opened += 1;
            for split in Split::ALL {
                let s = c.split(split);
                for i in 0..s.len() {
                    assert!((s.get(i) as usize) < tvq_data::Vocab::Bytes.size());
                }
            }
        }
    });
    assert!(
        opened < cases(),
        "every mutation opened: the mutations do nothing"
    );
}

/// Values a TOML field is set to: integers at zero, one, minus one, the
/// edges of 32- and 64-bit integers and a trillion; floats not a number,
/// infinite, huge, zero and negative zero; an empty and a huge string; a
/// boolean; an empty table.
fn toml_boundary(rng: &mut SplitMix64) -> toml::Value {
    use toml::Value::{Boolean, Float, Integer, String, Table};
    let all = [
        Integer(0),
        Integer(1),
        Integer(-1),
        Integer(1 << 31),
        Integer(1 << 32),
        Integer(i64::MAX),
        Integer(1_000_000_000_000),
        Float(f64::NAN),
        Float(f64::INFINITY),
        Float(f64::NEG_INFINITY),
        Float(1e300),
        Float(0.0),
        Float(-0.0),
        String(std::string::String::new()),
        String("9".repeat(1 << 16)),
        Boolean(true),
        Table(toml::Table::new()),
    ];
    all[(rng.next_u64() % all.len() as u64) as usize].clone()
}

/// A config text with one to three of its fields set to a TOML boundary
/// value or to another field's value, or removed, written back
/// well-formed.
fn mutate_toml(text: &str, rng: &mut SplitMix64) -> String {
    let mut table: toml::Table = text.parse().expect("the seed config is TOML");
    let pick = |rng: &mut SplitMix64, n: usize| (rng.next_u64() % n.max(1) as u64) as usize;
    for _ in 0..=pick(rng, 3) {
        let fields: Vec<(String, String)> = table
            .iter()
            .filter_map(|(name, v)| Some((name, v.as_table()?)))
            .flat_map(|(name, t)| t.keys().map(move |k| (name.clone(), k.clone())))
            .collect();
        if fields.is_empty() {
            break;
        }
        let (section, key) = fields[pick(rng, fields.len())].clone();
        let (other_section, other_key) = &fields[pick(rng, fields.len())];
        let other = table[other_section][other_key.as_str()].clone();
        let Some(section) = table.get_mut(&section).and_then(|t| t.as_table_mut()) else {
            continue;
        };
        match pick(rng, 5) {
            0..=2 => drop(section.insert(key, toml_boundary(rng))),
            3 => drop(section.insert(key, other)),
            _ => drop(section.remove(&key)),
        }
    }
    toml::to_string(&table).expect("a table serialises")
}

/// Configs with fields at their boundaries parse or fail in one line; one
/// that parses is refused by the memory budget (held against 64 MiB, as
/// `tvq train` holds it against the machine's memory) or builds its
/// trainer, within the heap limit.
#[test]
fn configs_with_fields_at_their_boundaries_build_or_fail_cleanly() {
    use tvq_train::placement::memory;
    let seed = std::fs::read_to_string(fixture().join("config.toml")).unwrap();
    let device = DeviceSpec::Cpu.init().unwrap().0;
    let mut built = 0;
    fuzz("config fields", |rng| {
        let text = mutate_toml(&seed, rng);
        let cfg = match RunConfig::parse(&text, &[]) {
            Ok(cfg) => cfg,
            Err(e) => return one_line(e, "config fields"),
        };
        let model = cfg.model_config(tvq_data::Vocab::Bytes.size());
        let rows = cfg.data.batch_size / cfg.train.micro_batches.max(1);
        let estimate = memory::training(
            &model,
            precision_on(
                &burn::DispatchDevice::Flex(Default::default()),
                cfg.train.precision,
            ),
            cfg.train.activation_checkpointing,
            rows,
            cfg.data.update_len,
            cfg.data.batch_size,
        );
        if let Err(e) = memory::check(&estimate, Some(64.0 * 1024.0 * 1024.0), false) {
            return one_line(e, "config fields");
        }
        match Trainer::new(&model, &cfg.train, std::slice::from_ref(&device)) {
            Ok(_) => built += 1,
            Err(e) => one_line(e, "config fields"),
        }
    });
    assert!(
        built < cases(),
        "every mutation built: the mutations do nothing"
    );
}

/// A tokenizer trained here (byte-level BPE of 300 ids), as the seed of
/// the tokenizer targets.
fn tokenizer_seed(dir: &Path) -> Vec<u8> {
    let text = dir.join("text.txt");
    std::fs::write(
        &text,
        "In the beginning God created the heaven and the earth. ".repeat(50),
    )
    .unwrap();
    let out = dir.join("seed-tokenizer.json");
    tvq_data::train_tokenizer(&[text], tvq_data::TokenizerKind::Bpe, 300, &out).unwrap();
    std::fs::read(out).unwrap()
}

/// Tokenizer files with fields at their boundaries (ids, merges, added
/// tokens, settings) load or fail in one line; one that loads encodes and
/// decodes a text with every id inside its vocabulary.
#[test]
fn tokenizers_with_fields_at_their_boundaries_load_or_fail_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let seed = tokenizer_seed(dir.path());
    let path = dir.path().join("tokenizer.json");
    let mut loaded = 0;
    fuzz("tokenizer fields", |rng| {
        let mut bytes = seed.clone();
        mutate_structure(&mut bytes, rng);
        std::fs::write(&path, bytes).unwrap();
        let vocab = match tvq_data::Vocab::load_tokenizer(&path) {
            Ok(vocab) => vocab,
            Err(e) => return one_line(e, "tokenizer fields"),
        };
        loaded += 1;
        match vocab.encode("In the beginning was the Word.") {
            Ok(ids) => {
                assert!(ids.iter().all(|&id| (id as usize) < vocab.size()));
                if let Err(e) = vocab.decode(&ids) {
                    one_line(e, "tokenizer fields");
                }
            }
            Err(e) => one_line(e, "tokenizer fields"),
        }
    });
    assert!(
        loaded < cases(),
        "every mutation loaded: the mutations do nothing"
    );
}

/// Task files (`tvq eval --task-file`) with fields at their boundaries
/// (token ids, answer places, distances, the lists themselves) read or
/// fail in one line; one that reads has every answer inside its tokens.
#[test]
fn task_files_with_fields_at_their_boundaries_read_or_fail_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("task.jsonl");
    let lines = [
        r#"{"tokens": [5, 6, 7, 8, 5, 6], "answers": [{"pos": 5, "token": 6, "distance": 4}]}"#,
        r#"{"tokens": [9, 10, 9, 10], "answers": [{"pos": 3, "token": 10}]}"#,
    ];
    let vocab = tvq_data::Vocab::Bytes.size();
    let mut read = 0;
    fuzz("task file fields", |rng| {
        let mut text = String::new();
        for (i, line) in lines.iter().enumerate() {
            let mut bytes = line.as_bytes().to_vec();
            if rng.next_u64() % 2 == 0 || i == 1 {
                mutate_structure(&mut bytes, rng);
            }
            text.push_str(&String::from_utf8(bytes).unwrap());
            text.push('\n');
        }
        std::fs::write(&path, text).unwrap();
        match tvq_data::recall::read_task_file(&path, vocab) {
            Ok((tokens, set)) => {
                read += 1;
                assert!(set.answers.iter().all(|a| a.pos < tokens.len()));
            }
            Err(e) => one_line(e, "task file fields"),
        }
    });
    assert!(
        read < cases(),
        "every mutation read: the mutations do nothing"
    );
}
