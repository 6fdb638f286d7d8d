//! PG-19 layout, tokenizer training and tokenized corpora.

use std::path::{Path, PathBuf};

use tvq_data::{
    Corpus, CorpusKind, DataConfig, DataError, EvalBatches, SPECIAL_TOKENS, Split, TokenizerKind,
    Vocab, train_tokenizer,
};

/// The sample shipped in `data/`, found from this crate's directory as cargo
/// gives it when the test runs: `env!` would bake in the directory of the
/// checkout that built the binary, which another checkout sharing the
/// target directory may have reused.
fn sample() -> PathBuf {
    let crate_dir = std::env::var_os("CARGO_MANIFEST_DIR").expect("tests run by cargo");
    Path::new(&crate_dir).join("../../data/pg19-sample")
}

/// A copy of the sample in a temporary directory (caches are written beside the corpus).
fn sample_copy(dir: &Path) -> PathBuf {
    let root = dir.join("pg19");
    for split in ["train", "validation", "test"] {
        std::fs::create_dir_all(root.join(split)).unwrap();
        for e in std::fs::read_dir(sample().join(split)).unwrap() {
            let p = e.unwrap().path();
            std::fs::copy(&p, root.join(split).join(p.file_name().unwrap())).unwrap();
        }
    }
    std::fs::copy(sample().join("metadata.csv"), root.join("metadata.csv")).unwrap();
    root
}

fn train_files(root: &Path) -> Vec<PathBuf> {
    let mut files: Vec<_> = std::fs::read_dir(root.join("train"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    files
}

#[test]
fn trained_tokenizers_round_trip_and_tokenize_pg19() {
    let dir = tempfile::tempdir().unwrap();
    let root = sample_copy(dir.path());
    let probe = "In the beginning God created the heaven and the earth.\n\n  Ünïcödé, tabs\\t and 日本語 — all survive.";
    for kind in [TokenizerKind::Bpe, TokenizerKind::Unigram] {
        let out = dir.path().join(format!("{kind:?}.json"));
        train_tokenizer(&train_files(&root), kind, 1000, &out).unwrap();
        let vocab = Vocab::load_tokenizer(&out).unwrap();
        assert!(
            vocab.size() <= 1000 && vocab.size() > 300,
            "{kind:?}: vocab {}",
            vocab.size()
        );
        for (id, name) in SPECIAL_TOKENS.iter().enumerate() {
            let Vocab::Tokenizer { tokenizer, .. } = &vocab else {
                unreachable!()
            };
            assert_eq!(
                tokenizer.token_to_id(name),
                Some(id as u32),
                "{kind:?}: {name}"
            );
        }
        let ids = vocab.encode(probe).unwrap();
        assert!(ids.len() < probe.len(), "{kind:?} compresses");
        assert_eq!(
            vocab.decode(&ids).unwrap(),
            probe,
            "{kind:?}: decode(encode(text)) == text"
        );

        // The whole corpus, tokenized per split, decodes back to the books.
        // The cache directory does not exist yet: opening creates it.
        let cache_dir = dir.path().join(format!("caches/{kind:?}"));
        let spec = DataConfig {
            tokenizer: Some(out.clone()),
            cache_dir: Some(cache_dir.clone()),
            ..DataConfig::new(CorpusKind::Pg19, &root)
        };
        let corpus = Corpus::open(&spec).unwrap();
        for split in Split::ALL {
            assert!(cache_dir.join(format!("pg19.{split}.tvq-cache")).is_file());
        }
        let val = corpus.split(Split::Validation);
        let mut books: Vec<_> = std::fs::read_dir(root.join("validation"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        books.sort();
        let text: String = books
            .iter()
            .map(|b| std::fs::read_to_string(b).unwrap())
            .collect();
        assert_eq!(val.stats.bytes, text.len() as u64);
        assert_eq!(
            val.stats.words,
            Some(text.split_whitespace().count() as u64)
        );
        assert_eq!(val.stats.documents, books.len() as u64);
        let ids: Vec<u32> = (0..val.len()).map(|i| val.get(i)).collect();
        assert_eq!(
            ids.iter().filter(|&&t| t == vocab.eos()).count(),
            books.len(),
            "one <eod> per book"
        );
        let docs: Vec<String> = ids
            .split(|&t| t == vocab.eos())
            .filter(|d| !d.is_empty())
            .map(|d| vocab.decode(d).unwrap())
            .collect();
        let want: Vec<String> = books
            .iter()
            .map(|b| std::fs::read_to_string(b).unwrap())
            .collect();
        assert_eq!(docs, want, "{kind:?}: the books come back");
        // Evaluation over tokenized text uses the tokenizer's <eod> as the prompt.
        let first = EvalBatches::new(val, 2, 64).unwrap().next().unwrap();
        assert_eq!(first.inputs[0], vocab.eos());
    }
}

#[test]
fn pg19_bad_inputs_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let root = sample_copy(dir.path());
    let spec = |tokenizer: Option<PathBuf>| DataConfig {
        tokenizer,
        ..DataConfig::new(CorpusKind::Pg19, &root)
    };
    let bad = dir.path().join("tokenizer.json");
    std::fs::write(&bad, "{ not json").unwrap();
    let err = Corpus::open(&spec(Some(bad))).unwrap_err();
    assert!(
        matches!(err, DataError::BadTokenizer { .. }) && err.to_string().contains("tokenizer.json"),
        "{err}"
    );

    std::fs::remove_dir_all(root.join("validation")).unwrap();
    let err = Corpus::open(&spec(None)).unwrap_err();
    assert!(
        matches!(err, DataError::MissingSplit { ref split, .. } if split == "validation"),
        "{err}"
    );
}

#[test]
fn invalid_utf8_is_replaced_for_tokenizers_and_kept_for_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let root = sample_copy(dir.path());
    let tok = dir.path().join("bpe.json");
    train_tokenizer(&train_files(&root), TokenizerKind::Bpe, 400, &tok).unwrap();
    let text = dir.path().join("latin1.txt");
    std::fs::write(&text, b"caf\xe9 au lait, na\xefve ".repeat(40)).unwrap();
    let spec = |tokenizer| DataConfig {
        tokenizer,
        ..DataConfig::new(CorpusKind::Text, &text)
    };
    let corpus = Corpus::open(&spec(Some(tok))).unwrap();
    let train = corpus.split(Split::Train);
    assert_eq!(train.stats.invalid_utf8_documents, 1);
    let ids: Vec<u32> = (0..train.len()).map(|i| train.get(i)).collect();
    assert!(
        corpus
            .vocab
            .decode(&ids)
            .unwrap()
            .starts_with("caf\u{fffd} au lait")
    );
    // Byte-level needs no UTF-8: the bytes are the tokens.
    let bytes = Corpus::open(&spec(None)).unwrap();
    assert_eq!(
        bytes.split(Split::Train).get(3),
        tvq_data::vocab::byte_token(0xe9)
    );
}

#[test]
fn a_missing_tokenizer_says_how_to_make_one() {
    let dir = tempfile::tempdir().unwrap();
    let err = Vocab::load_tokenizer(&dir.path().join("none.json"))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("none.json") && err.contains("tvq tokenizer train"),
        "{err}"
    );
}
