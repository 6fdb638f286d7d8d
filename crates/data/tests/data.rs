//! Corpora, splits, caches and batch order.

use std::io::Write;
use std::path::{Path, PathBuf};

use tvq_data::vocab::{EOS, PAD, byte_token};
use tvq_data::{
    Corpus, CorpusKind, DataConfig, DataError, EvalBatches, Split, TrainBatches, TrainCursor,
    TrainLayout,
};

fn spec(kind: CorpusKind, path: &Path) -> DataConfig {
    DataConfig::new(kind, path)
}

fn pattern(i: usize) -> u8 {
    ((i * 7 + i / 1000 + i / 999_983) % 256) as u8
}

fn write_enwik8_like(dir: &Path) -> PathBuf {
    let path = dir.join("enwik8");
    let mut f = std::io::BufWriter::new(std::fs::File::create(&path).unwrap());
    let chunk: Vec<u8> = (0..100_000_000).map(pattern).collect();
    f.write_all(&chunk).unwrap();
    path
}

fn check_enwik8_splits(corpus: &Corpus) {
    assert_eq!(
        Split::ALL
            .iter()
            .map(|&s| corpus.split(s).len())
            .sum::<usize>(),
        100_000_000
    );
    for (split, start, len) in [
        (Split::Train, 0, 90_000_000),
        (Split::Validation, 90_000_000, 5_000_000),
        (Split::Test, 95_000_000, 5_000_000),
    ] {
        let s = corpus.split(split);
        assert_eq!(s.len(), len, "{split}");
        for i in [0, 1, len / 2, len - 1] {
            assert_eq!(
                s.get(i),
                byte_token(pattern(start + i)),
                "{split} token {i}"
            );
        }
    }
}

#[test]
fn enwik8_raw_and_zip_split_at_exact_boundaries() {
    let dir = tempfile::tempdir().unwrap();
    let raw = write_enwik8_like(dir.path());
    check_enwik8_splits(&Corpus::open(&spec(CorpusKind::Enwik8, &raw)).unwrap());

    let zip_path = dir.path().join("enwik8.zip");
    {
        let mut zip = zip::ZipWriter::new(std::fs::File::create(&zip_path).unwrap());
        let options = zip::write::SimpleFileOptions::default()
            .compression_method(zip::CompressionMethod::Deflated)
            .compression_level(Some(1));
        zip.start_file("enwik8", options).unwrap();
        zip.write_all(&std::fs::read(&raw).unwrap()).unwrap();
        zip.finish().unwrap();
    }
    std::fs::remove_file(&raw).unwrap();
    let from_zip = Corpus::open(&spec(CorpusKind::Enwik8, &zip_path)).unwrap();
    check_enwik8_splits(&from_zip);
    // The extracted bytes are cached beside the zip and reused.
    let cache = dir.path().join("enwik8.zip.bytes.tvq-cache");
    let written = std::fs::metadata(&cache).unwrap().modified().unwrap();
    check_enwik8_splits(&Corpus::open(&spec(CorpusKind::Enwik8, &zip_path)).unwrap());
    assert_eq!(
        std::fs::metadata(&cache).unwrap().modified().unwrap(),
        written,
        "cache rebuilt needlessly"
    );
}

#[test]
fn bad_inputs_are_errors_that_name_the_path() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope.txt");
    let err = Corpus::open(&spec(CorpusKind::Text, &missing)).unwrap_err();
    assert!(
        matches!(err, DataError::Io { .. }) && err.to_string().contains("nope.txt"),
        "{err}"
    );

    let empty = dir.path().join("empty.txt");
    std::fs::write(&empty, b"").unwrap();
    let err = Corpus::open(&spec(CorpusKind::Text, &empty)).unwrap_err();
    assert!(
        matches!(err, DataError::Empty { .. }) && err.to_string().contains("empty.txt"),
        "{err}"
    );

    let small = dir.path().join("enwik8");
    std::fs::write(&small, b"not the real enwik8").unwrap();
    let err = Corpus::open(&spec(CorpusKind::Enwik8, &small)).unwrap_err();
    assert!(matches!(err, DataError::NotEnwik8 { len: 19, .. }), "{err}");
    let mut allowed = spec(CorpusKind::Enwik8, &small);
    allowed.allow_proportional_split = true;
    let c = Corpus::open(&allowed).unwrap();
    assert_eq!(
        c.split(Split::Train).len() + c.split(Split::Validation).len() + c.split(Split::Test).len(),
        19
    );

    // A zip cut short.
    let zip_path = dir.path().join("enwik8.zip");
    {
        let mut zip = zip::ZipWriter::new(std::fs::File::create(&zip_path).unwrap());
        zip.start_file("enwik8", zip::write::SimpleFileOptions::default())
            .unwrap();
        zip.write_all(&vec![b'x'; 10_000]).unwrap();
        zip.finish().unwrap();
    }
    let bytes = std::fs::read(&zip_path).unwrap();
    std::fs::write(&zip_path, &bytes[..bytes.len() / 2]).unwrap();
    let err = Corpus::open(&spec(CorpusKind::Enwik8, &zip_path)).unwrap_err();
    assert!(
        matches!(err, DataError::BadZip { .. }) && err.to_string().contains("enwik8.zip"),
        "{err}"
    );
    let leftovers: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("tvq-cache") || n.contains("tmp"))
        .collect();
    assert!(
        leftovers.is_empty(),
        "nothing left behind by a failed extraction: {leftovers:?}"
    );

    let no_txt = dir.path().join("books");
    std::fs::create_dir(&no_txt).unwrap();
    std::fs::write(no_txt.join("readme.md"), b"hi").unwrap();
    let err = Corpus::open(&spec(CorpusKind::Text, &no_txt)).unwrap_err();
    assert!(matches!(err, DataError::NoTextFiles { .. }), "{err}");
}

/// All tokens of a corpus, split after split.
fn all_tokens(c: &Corpus) -> Vec<u32> {
    Split::ALL
        .iter()
        .flat_map(|&s| {
            let s = c.split(s);
            (0..s.len()).map(move |i| s.get(i))
        })
        .collect()
}

#[test]
fn text_directory_cache_is_rebuilt_when_the_corpus_changes() {
    let dir = tempfile::tempdir().unwrap();
    let books = dir.path().join("books");
    std::fs::create_dir_all(books.join("more")).unwrap();
    let a: String = "the first book. ".repeat(50);
    let b: String = "and the second one! ".repeat(30);
    std::fs::write(books.join("a.txt"), &a).unwrap();
    std::fs::write(books.join("more/b.txt"), &b).unwrap();
    std::fs::write(books.join("notes.md"), "not a book").unwrap();
    let c = Corpus::open(&spec(CorpusKind::Text, &books)).unwrap();
    let text = |c: &Corpus| c.vocab.decode(&all_tokens(c)).unwrap();
    assert_eq!(
        text(&c),
        format!("{a}{b}"),
        "every byte of every .txt once, in name order"
    );
    let stats: Vec<_> = Split::ALL.iter().map(|&s| c.split(s).stats).collect();
    assert_eq!(
        stats.iter().map(|s| s.bytes).sum::<u64>(),
        (a.len() + b.len()) as u64
    );
    assert_eq!(
        stats[0].bytes,
        ((a.len() + b.len()) * 9 / 10) as u64,
        "90% of the bytes train"
    );
    // A word cut by a split boundary counts once on each side.
    let words = stats.iter().map(|s| s.words.unwrap()).sum::<u64>();
    assert!(
        (50 * 3 + 30 * 4..=50 * 3 + 30 * 4 + 2).contains(&words),
        "{words} words"
    );

    std::fs::write(books.join("more/b.txt"), "changed").unwrap();
    let c = Corpus::open(&spec(CorpusKind::Text, &books)).unwrap();
    assert_eq!(text(&c), format!("{a}changed"), "stale cache used");

    // A damaged cache is reported, not silently used.
    std::fs::write(dir.path().join("books.train.tvq-cache"), b"garbage").unwrap();
    let err = Corpus::open(&spec(CorpusKind::Text, &books)).unwrap_err();
    assert!(
        matches!(err, DataError::BadCache { .. }) && err.to_string().contains("delete it"),
        "{err}"
    );
}

fn text_corpus(dir: &Path, len: usize) -> Corpus {
    let path = dir.join("text.txt");
    std::fs::write(&path, (0..len).map(pattern).collect::<Vec<u8>>()).unwrap();
    Corpus::open(&spec(CorpusKind::Text, &path)).unwrap()
}

#[test]
fn evaluation_delivers_every_token_once_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = text_corpus(dir.path(), 10_000);
    for (batch, update_len) in [(1, 16), (3, 7), (4, 64), (7, 1000)] {
        let split = corpus.split(Split::Validation);
        let n = split.len();
        let batches: Vec<_> = EvalBatches::new(split.clone(), batch, update_len)
            .unwrap()
            .collect();
        // Rows are contiguous regions: read them back row by row.
        let mut rows = vec![vec![]; batch];
        for (k, b) in batches.iter().enumerate() {
            assert_eq!(b.reset, k == 0);
            for (row, read) in rows.iter_mut().enumerate() {
                for i in 0..update_len {
                    let at = row * update_len + i;
                    if b.valid[at] {
                        read.push((b.inputs[at], b.targets[at]));
                    } else {
                        assert_eq!(b.targets[at], PAD);
                    }
                }
            }
        }
        let targets: Vec<u32> = rows.iter().flatten().map(|&(_, t)| t).collect();
        let want: Vec<u32> = (0..n).map(|i| split.get(i)).collect();
        assert_eq!(targets, want, "batch {batch}, update_len {update_len}");
        for row in rows.iter().filter(|r| !r.is_empty()) {
            assert_eq!(
                row[0].0, EOS,
                "a row starts from the end-of-document prompt"
            );
            for w in row.windows(2) {
                assert_eq!(w[1].0, w[0].1, "input is the previous target");
            }
        }
    }
}

fn layout(seed: u64, reset_each_sequence: bool) -> TrainLayout {
    TrainLayout {
        batch: 3,
        update_len: 8,
        sequence_len: 32,
        seed,
        reset_each_sequence,
    }
}

#[test]
fn training_order_is_seeded_contiguous_and_resumable() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = text_corpus(dir.path(), 2_000);
    let train = corpus.split(Split::Train);
    let mut it = TrainBatches::new(train.clone(), layout(7, true), TrainCursor::default()).unwrap();
    let per_epoch = it.steps_per_epoch() as usize;
    assert!(per_epoch > 4);
    let first: Vec<_> = it.by_ref().take(2 * per_epoch + 3).collect();

    // Same seed, same batches; another seed moves the epoch offsets.
    let again: Vec<_> = TrainBatches::new(train.clone(), layout(7, true), TrainCursor::default())
        .unwrap()
        .take(first.len())
        .collect();
    assert_eq!(first, again);
    let other: Vec<_> = TrainBatches::new(train.clone(), layout(8, true), TrainCursor::default())
        .unwrap()
        .take(first.len())
        .collect();
    assert_ne!(
        other[..first.len()],
        first[..],
        "the seed must move the epoch offsets"
    );

    // Resume from a serialized cursor at every point: identical continuation.
    let mut walker =
        TrainBatches::new(train.clone(), layout(7, true), TrainCursor::default()).unwrap();
    for k in 0..first.len() - 2 {
        let json = serde_json::to_string(&walker.cursor()).unwrap();
        let cursor: TrainCursor = serde_json::from_str(&json).unwrap();
        let resumed: Vec<_> = TrainBatches::new(train.clone(), layout(7, true), cursor)
            .unwrap()
            .take(2)
            .collect();
        assert_eq!(resumed, first[k..k + 2], "resume at batch {k}");
        walker.next();
    }

    // Within a sequence each row continues where it stopped; a new sequence resets.
    let segs = 32 / 8;
    for (k, pair) in first.windows(2).enumerate() {
        let (a, b) = (&pair[0], &pair[1]);
        assert_eq!(a.reset, (k % per_epoch).is_multiple_of(segs));
        if !b.reset {
            for row in 0..3 {
                assert_eq!(
                    b.inputs[row * 8],
                    a.targets[row * 8 + 7],
                    "row {row} is contiguous"
                );
            }
        } else {
            assert!((0..3).all(|row| b.inputs[row * 8] == EOS));
        }
        for row in 0..3 {
            for i in 1..8 {
                assert_eq!(b.inputs[row * 8 + i], b.targets[row * 8 + i - 1]);
            }
        }
    }
}

/// The sequences (a row's tokens from one reset to the next) of one epoch.
fn epoch_sequences(train: &tvq_data::TokenSplit, layout: TrainLayout, epoch: u64) -> Vec<Vec<u32>> {
    let it = TrainBatches::new(
        train.clone(),
        layout.clone(),
        TrainCursor { epoch, step: 0 },
    )
    .unwrap();
    let per_epoch = it.steps_per_epoch() as usize;
    let segs = layout.sequence_len / layout.update_len;
    let batches: Vec<_> = it.take(per_epoch).collect();
    let mut out = vec![];
    for group in batches.chunks(segs) {
        for row in 0..layout.batch {
            let span = row * layout.update_len..(row + 1) * layout.update_len;
            out.push(
                group
                    .iter()
                    .flat_map(|b| b.targets[span.clone()].to_vec())
                    .collect(),
            );
        }
    }
    out
}

#[test]
fn an_epoch_deals_every_sequence_once_in_a_seeded_random_order() {
    let dir = tempfile::tempdir().unwrap();
    // Text that does not repeat, so a sequence's tokens identify it.
    let path = dir.path().join("counting.txt");
    let text: String = (0..700).map(|i| format!("{i} ")).collect();
    std::fs::write(&path, text).unwrap();
    let corpus = Corpus::open(&spec(CorpusKind::Text, &path)).unwrap();
    let train = corpus.split(Split::Train);
    // The contiguous walk (no resets) reads the same sequences, in order.
    let shuffled = epoch_sequences(&train, layout(7, true), 0);
    let mut walk = epoch_sequences(&train, layout(7, false), 0);
    assert!(shuffled.len() > 20);
    assert_ne!(shuffled, walk, "the order is shuffled");
    let mut sorted = shuffled.clone();
    sorted.sort();
    walk.sort();
    assert_eq!(sorted, walk, "every sequence exactly once");
    // The order changes with the epoch and with the seed.
    assert_ne!(
        epoch_sequences(&train, layout(7, true), 1)[..4],
        shuffled[..4]
    );
    assert_ne!(
        epoch_sequences(&train, layout(8, true), 0)[..4],
        shuffled[..4]
    );
}

#[test]
fn never_reset_layout_carries_state_through_the_epoch() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = text_corpus(dir.path(), 2_000);
    let mut it = TrainBatches::new(
        corpus.split(Split::Train),
        layout(3, false),
        TrainCursor::default(),
    )
    .unwrap();
    let per_epoch = it.steps_per_epoch() as usize;
    let batches: Vec<_> = it.by_ref().take(per_epoch + 1).collect();
    let resets: Vec<usize> = batches
        .iter()
        .enumerate()
        .filter(|(_, b)| b.reset)
        .map(|(i, _)| i)
        .collect();
    assert_eq!(resets, vec![0, per_epoch]);
    for pair in batches[..per_epoch].windows(2) {
        for row in 0..3 {
            assert_eq!(pair[1].inputs[row * 8], pair[0].targets[row * 8 + 7]);
        }
    }
}

#[test]
fn layouts_that_cannot_work_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = text_corpus(dir.path(), 200);
    let train = corpus.split(Split::Train);
    let bad = TrainLayout {
        sequence_len: 30,
        ..layout(0, true)
    };
    assert!(matches!(
        TrainBatches::new(train.clone(), bad, TrainCursor::default()),
        Err(DataError::Layout(_))
    ));
    let big = TrainLayout {
        batch: 10,
        ..layout(0, true)
    };
    let err = TrainBatches::new(train, big, TrainCursor::default()).unwrap_err();
    assert!(matches!(err, DataError::SplitTooSmall { .. }), "{err}");
}

#[test]
fn a_node_reads_only_its_rows_of_each_batch() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = text_corpus(dir.path(), 2_000);
    let train = corpus.split(Split::Train);
    for shuffled in [true, false] {
        let whole: Vec<_> =
            TrainBatches::new(train.clone(), layout(7, shuffled), TrainCursor::default())
                .unwrap()
                .take(12)
                .collect();
        let part: Vec<_> =
            TrainBatches::new(train.clone(), layout(7, shuffled), TrainCursor::default())
                .unwrap()
                .with_rows(1..3)
                .unwrap()
                .take(12)
                .collect();
        for (w, p) in whole.iter().zip(&part) {
            let rows = w.len..3 * w.len;
            assert_eq!((p.batch, p.reset), (2, w.reset));
            assert_eq!(p.inputs, w.inputs[rows.clone()]);
            assert_eq!(p.targets, w.targets[rows]);
        }
    }
    let it = TrainBatches::new(train, layout(7, true), TrainCursor::default()).unwrap();
    assert!(it.clone().with_rows(2..4).is_err());
    assert!(it.with_rows(1..1).is_err());
}

/// Sizes and positions from untrusted places (a config, a checkpoint's
/// cursor) are errors, not overflows, panics or allocations: a batch whose
/// tokens overflow, a cursor past the epoch (a corpus shrunk since the
/// checkpoint), an evaluation batch of more rows than tokens.
#[test]
fn sizes_and_cursors_beyond_the_corpus_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = text_corpus(dir.path(), 2_000);
    let train = corpus.split(Split::Train);
    let huge = TrainLayout {
        batch: 1 << 62,
        ..layout(0, true)
    };
    let err = TrainBatches::new(train.clone(), huge, TrainCursor::default()).unwrap_err();
    assert!(matches!(err, DataError::SplitTooSmall { .. }), "{err}");
    let batches =
        TrainBatches::new(train.clone(), layout(0, true), TrainCursor::default()).unwrap();
    let per_epoch = batches.steps_per_epoch();
    let last = TrainCursor {
        epoch: 3,
        step: per_epoch - 1,
    };
    assert!(TrainBatches::new(train.clone(), layout(0, true), last).is_ok());
    let past = TrainCursor {
        epoch: 0,
        step: per_epoch,
    };
    let err = TrainBatches::new(train, layout(0, true), past).unwrap_err();
    assert!(err.to_string().contains("corpus changed"), "{err}");
    let valid = corpus.split(Split::Validation);
    let rows = valid.len();
    assert!(EvalBatches::new(valid.clone(), rows, 8).is_ok());
    let err = EvalBatches::new(valid, 1_000_000_000_000, 8).unwrap_err();
    assert!(err.to_string().contains("1000000000000 rows"), "{err}");
}

/// A corpus directory holding a symbolic-link loop and a second link to
/// one of its files reads each real file once.
#[cfg(unix)]
#[test]
fn a_corpus_directory_reads_each_real_file_once() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("corpus");
    std::fs::create_dir_all(root.join("sub")).unwrap();
    std::fs::write(root.join("a.txt"), "first").unwrap();
    std::fs::write(root.join("sub/b.txt"), "second").unwrap();
    std::os::unix::fs::symlink(&root, root.join("sub/loop")).unwrap();
    std::os::unix::fs::symlink(root.join("a.txt"), root.join("z.txt")).unwrap();
    let files = tvq_data::text_files(&root).unwrap();
    assert_eq!(files, [root.join("a.txt"), root.join("sub/b.txt")]);
}

/// A tokenizer whose ids reach past its own vocabulary is refused (its
/// ids would index outside the embedding); one whose ids fit loads.
#[test]
fn a_tokenizer_with_ids_beyond_its_vocabulary_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let tokenizer = |top: u32| {
        let path = dir.path().join(format!("tok-{top}.json"));
        let json = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "pre_tokenizer": null, "post_processor": null, "decoder": null,
            "model": {"type": "WordLevel", "vocab": {"<eod>": 0, "a": 1, "b": top},
                      "unk_token": "<eod>"}
        });
        std::fs::write(&path, json.to_string()).unwrap();
        path
    };
    assert_eq!(
        tvq_data::Vocab::load_tokenizer(&tokenizer(2))
            .unwrap()
            .size(),
        3
    );
    let err = tvq_data::Vocab::load_tokenizer(&tokenizer(70_000)).unwrap_err();
    assert!(err.to_string().contains("id 70000"), "{err}");
}

/// A tokenizer file with an added token longer than tvq reads (64 KiB of
/// one character: `tokenizers` took minutes to build its automaton) is
/// refused, before anything is built from it, in one line; one at the
/// limit loads.
#[test]
fn a_tokenizer_with_an_overlong_added_token_is_refused_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let tokenizer = |content: String| {
        let path = dir.path().join(format!("tok-{}.json", content.len()));
        let json = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null,
            "added_tokens": [{"id": 3, "content": content, "single_word": false, "lstrip": false,
                              "rstrip": false, "normalized": false, "special": true}],
            "normalizer": null, "pre_tokenizer": null, "post_processor": null, "decoder": null,
            "model": {"type": "WordLevel", "vocab": {"<eod>": 0, "a": 1, "b": 2},
                      "unk_token": "<eod>"}
        });
        std::fs::write(&path, json.to_string()).unwrap();
        path
    };
    let limit = tvq_data::vocab::ADDED_TOKEN_MAX_BYTES;
    assert!(tvq_data::Vocab::load_tokenizer(&tokenizer("9".repeat(limit))).is_ok());
    let err = tvq_data::Vocab::load_tokenizer(&tokenizer("9".repeat(1 << 16))).unwrap_err();
    let text = err.to_string();
    assert!(text.contains("added token of 65536 bytes"), "{text}");
    assert!(!text.contains('\n'), "{text}");
}

fn mqar(pairs: usize, sequence_len: usize, update_len: usize) -> DataConfig {
    DataConfig {
        sequence_len,
        update_len,
        batch_size: 4,
        mqar: Some(tvq_data::recall::MqarConfig {
            pairs,
            vocab: 64,
            train_examples: 12,
            eval_examples: 4,
            ..Default::default()
        }),
        ..DataConfig::new(CorpusKind::Mqar, "")
    }
}

#[test]
fn an_mqar_corpus_deals_whole_examples_scoring_only_the_answers() {
    let cfg = mqar(6, 64, 32);
    let corpus = Corpus::open(&cfg).unwrap();
    assert_eq!(corpus.vocab.size(), 259);
    let train = corpus.split(Split::Train);
    let recall = train.recall.clone().unwrap();
    assert_eq!((train.len(), recall.answers.len()), (12 * 64, 12 * 6));
    let layout = cfg.train_layout(3);
    let batches = TrainBatches::new(train.clone(), layout.clone(), TrainCursor::default()).unwrap();
    // 12 examples in rows of 4: 3 sequences per row, 2 segments each.
    assert_eq!(batches.steps_per_epoch(), 6);
    let mut seen = vec![];
    for batch in batches.clone().take(12) {
        for row in 0..4 {
            let span = row * 32..(row + 1) * 32;
            seen.push(batch.inputs[span.clone()].to_vec());
            // Every target is PAD but the answers, each the value after
            // its key; the first segment of an example holds the pairs and
            // starts from end-of-document.
            for (i, (&input, &target)) in batch.inputs[span.clone()]
                .iter()
                .zip(&batch.targets[span])
                .enumerate()
            {
                if target != tvq_data::vocab::PAD {
                    assert!((3 + 32..3 + 64).contains(&target), "{target}");
                    assert!((3 + 1..3 + 32).contains(&input), "{input}");
                } else {
                    assert!(i == 0 || input > 0);
                }
            }
        }
        if batch.reset {
            assert!(
                batch
                    .inputs
                    .iter()
                    .step_by(32)
                    .all(|&t| t == tvq_data::vocab::EOS)
            );
        }
    }
    // An epoch deals every example once, whole: a row's two segments are
    // its 64 tokens in order.
    let tokens = all_tokens_of(&train);
    let mut dealt: Vec<usize> = (0..3)
        .flat_map(|seq| (0..4).map(move |row| (seq, row)))
        .map(|(seq, row)| {
            let (a, b) = (&seen[(2 * seq) * 4 + row], &seen[(2 * seq + 1) * 4 + row]);
            let read = [&a[1..], &b[..]].concat(); // inputs: tokens 0..63
            (0..12)
                .find(|e| tokens[e * 64..e * 64 + 63] == read[..])
                .expect("a whole example")
        })
        .collect();
    dealt.sort();
    assert_eq!(dealt, (0..12).collect::<Vec<_>>());
    let answers_per_epoch: usize =
        TrainBatches::new(train.clone(), layout.clone(), TrainCursor::default())
            .unwrap()
            .take(6)
            .map(|b| {
                b.targets
                    .iter()
                    .filter(|&&t| t != tvq_data::vocab::PAD)
                    .count()
            })
            .sum();
    assert_eq!(answers_per_epoch, 12 * 6);
    // Resumed at any step, the same batches follow.
    let all: Vec<_> = batches.clone().take(9).collect();
    for k in 0..9 {
        let cursor = TrainCursor {
            epoch: k as u64 / 6,
            step: k as u64 % 6,
        };
        let resumed = TrainBatches::new(train.clone(), layout.clone(), cursor).unwrap();
        assert_eq!(resumed.take(9 - k).collect::<Vec<_>>(), all[k..]);
    }
    // The same task on another machine is the same corpus.
    let again = Corpus::open(&cfg).unwrap().split(Split::Train);
    assert_eq!(all_tokens_of(&again), all_tokens_of(&train));
    // Examples that do not fit the sequence are one error line.
    let e = Corpus::open(&mqar(40, 64, 32)).unwrap_err().to_string();
    assert!(e.starts_with("data.mqar:") && !e.contains('\n'), "{e}");
}

fn all_tokens_of(split: &tvq_data::TokenSplit) -> Vec<u32> {
    (0..split.len()).map(|i| split.get(i)).collect()
}

#[test]
fn a_passkey_corpus_hides_keys_in_each_splits_text_and_scores_their_digits() {
    let dir = tempfile::tempdir().unwrap();
    let text = dir.path().join("text.txt");
    std::fs::write(
        &text,
        b"And God said, Let there be light: and there was light. ".repeat(400),
    )
    .unwrap();
    let cfg = DataConfig {
        sequence_len: 256,
        update_len: 128,
        batch_size: 2,
        passkey: Some(tvq_data::recall::PasskeyConfig {
            train_examples: 8,
            eval_examples: 3,
            ..Default::default()
        }),
        ..DataConfig::new(CorpusKind::Passkey, &text)
    };
    let corpus = Corpus::open(&cfg).unwrap();
    for (split, n) in [(Split::Train, 8), (Split::Validation, 3), (Split::Test, 3)] {
        let s = corpus.split(split);
        let recall = s.recall.clone().unwrap();
        assert_eq!((s.len(), recall.answers.len()), (n * 256, n * 5));
        for a in &recall.answers {
            let digit = s.target(a.pos);
            assert!((byte_token(b'0')..=byte_token(b'9')).contains(&digit));
            assert_eq!(
                s.get(a.pos - a.distance),
                digit,
                "the digit as it was given"
            );
        }
        let scored = (0..s.len()).filter(|&p| s.target(p) != PAD).count();
        assert_eq!(scored, n * 5);
    }
    // Training batches deal whole examples; the same corpus again is the same.
    let train = corpus.split(Split::Train);
    let batches =
        TrainBatches::new(train.clone(), cfg.train_layout(1), TrainCursor::default()).unwrap();
    assert_eq!(batches.steps_per_epoch(), 8);
    let again = Corpus::open(&cfg).unwrap().split(Split::Train);
    assert_eq!(all_tokens_of(&again), all_tokens_of(&train));
    // Text scored too, half the training examples answer-only: every
    // other training example scores its 5 digits alone, the validation
    // examples every target, and the tokens are the same.
    let mixed = Corpus::open(&DataConfig {
        passkey: Some(tvq_data::recall::PasskeyConfig {
            train_examples: 8,
            eval_examples: 3,
            score_text: true,
            answer_only_share: 0.5,
            ..Default::default()
        }),
        ..cfg.clone()
    })
    .unwrap();
    let scored = |s: &tvq_data::TokenSplit, e: usize| {
        (e * 256..(e + 1) * 256)
            .filter(|&p| s.target(p) != PAD)
            .count()
    };
    let mixed_train = mixed.split(Split::Train);
    assert_eq!(all_tokens_of(&mixed_train), all_tokens_of(&train));
    let per_example: Vec<usize> = (0..8).map(|e| scored(&mixed_train, e)).collect();
    assert_eq!(per_example, [256, 5, 256, 5, 256, 5, 256, 5]);
    let validation = mixed.split(Split::Validation);
    assert!((0..3).all(|e| scored(&validation, e) == 256));
    // A directory is not one text file.
    let e = Corpus::open(&DataConfig {
        path: dir.path().to_path_buf(),
        ..cfg
    })
    .unwrap_err()
    .to_string();
    assert!(e.contains("one byte-level file"), "{e}");
}

/// The byte vocabulary as a `tokenizers` file gives tvq's ids for every
/// byte (text with 2-, 3- and 4-byte UTF-8, control bytes, the specials'
/// names as plain text), the end-of-document token before a text when
/// special tokens are added, and the text back; its end-of-document token
/// is found by name.
#[test]
fn the_byte_vocabulary_as_a_tokenizer_file_gives_tvqs_ids() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tokenizer.json");
    let json = tvq_data::Vocab::Bytes.tokenizer_json().unwrap();
    std::fs::write(&path, &json).unwrap();
    let vocab = tvq_data::Vocab::load_tokenizer(&path).unwrap();
    assert_eq!(vocab.size(), tvq_data::vocab::BYTE_VOCAB_SIZE);
    assert_eq!(vocab.eos(), EOS);
    let text = "And God said \u{e9}\u{20ac}\u{1f600}\t\u{1}\u{7f} <eos> <pad>!~\u{a0}\u{ad}\u{ff}";
    let bytes = tvq_data::Vocab::Bytes.encode(text).unwrap();
    assert_eq!(vocab.encode(text).unwrap(), bytes);
    assert_eq!(vocab.decode(&bytes).unwrap(), text);
    let tokenizer = tokenizers::Tokenizer::from_file(&path).unwrap();
    let with_specials = tokenizer.encode(text, true).unwrap();
    assert_eq!(with_specials.get_ids()[0], EOS);
    assert_eq!(&with_specials.get_ids()[1..], &bytes[..]);
    let every: Vec<u8> = (0..=255).collect();
    let ids: Vec<u32> = every.iter().map(|&b| byte_token(b)).collect();
    assert_eq!(
        tokenizer.decode(&ids, false).unwrap().into_bytes(),
        String::from_utf8_lossy(&every).into_owned().into_bytes()
    );
}

/// A tokenizer's file for `transformers` gives its ids, and with special
/// tokens puts its end-of-document token before a text, whether or not
/// the tokenizer has a post-processor of its own (which still runs).
#[test]
fn a_tokenizers_file_for_transformers_puts_the_end_of_document_first() {
    let dir = tempfile::tempdir().unwrap();
    for own in [
        serde_json::Value::Null,
        serde_json::json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true}),
    ] {
        let path = dir.path().join("tok.json");
        let json = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": own,
            "decoder": null,
            "model": {"type": "WordLevel", "vocab": {"<unk>": 0, "<eod>": 1, "a": 2, "b": 3},
                      "unk_token": "<unk>"}
        });
        std::fs::write(&path, json.to_string()).unwrap();
        let vocab = tvq_data::Vocab::load_tokenizer(&path).unwrap();
        let out = dir.path().join("for-transformers.json");
        std::fs::write(&out, vocab.tokenizer_json().unwrap()).unwrap();
        let tokenizer = tokenizers::Tokenizer::from_file(&out).unwrap();
        assert_eq!(
            tokenizer.encode("a b a", false).unwrap().get_ids(),
            [2, 3, 2]
        );
        assert_eq!(
            tokenizer.encode("a b a", true).unwrap().get_ids(),
            [1, 2, 3, 2]
        );
        assert_eq!(vocab.eos_name(), "<eod>");
    }
}
