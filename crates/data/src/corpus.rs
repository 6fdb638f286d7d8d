//! Opening a corpus and cutting it into train / validation / test splits.
//!
//! Three ways a split's tokens are stored:
//! - a raw byte file (enwik8, or one byte-level text file) is memory-mapped as
//!   it is: its bytes are the tokens;
//! - a zipped enwik8 is extracted once into a byte cache;
//! - everything else (directories of books, tokenized text, PG-19) is
//!   tokenized once per split into a token cache, documents separated by
//!   the end-of-document token, with the split's text statistics.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use indicatif::{ProgressBar, ProgressStyle};
use serde::{Deserialize, Serialize};

use crate::cache::{CacheWriter, MappedTokens, open_cache};
use crate::config::{CorpusKind, DataConfig};
use crate::error::DataError;
use crate::recall::RecallSet;
use crate::vocab::{PAD, Vocab};

/// Bytes of enwik8 and its standard split points.
const ENWIK8_LEN: u64 = 100_000_000;
const ENWIK8_BOUNDS: [u64; 2] = [90_000_000, 95_000_000];
/// Books tokenized together (the tokenizer parallelises over them).
const DOCS_PER_CHUNK: usize = 32;

/// A split of a corpus.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Split {
    /// Training data.
    Train,
    /// Validation data.
    Validation,
    /// Test data.
    Test,
}

impl Split {
    /// All splits, in order.
    pub const ALL: [Split; 3] = [Split::Train, Split::Validation, Split::Test];
}

impl std::fmt::Display for Split {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Split::Train => "train",
            Split::Validation => "validation",
            Split::Test => "test",
        })
    }
}

/// What a split's text amounts to, for bits per byte and per-word perplexity.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TextStats {
    /// UTF-8 (or raw) bytes of the text.
    pub bytes: u64,
    /// Whitespace-separated words; `None` where not counted (raw byte files).
    pub words: Option<u64>,
    /// Documents (books, files).
    pub documents: u64,
    /// Documents that were not valid UTF-8 and were tokenized with U+FFFD
    /// in place of each invalid sequence.
    pub invalid_utf8_documents: u64,
}

/// The tokens of one split: a window onto a memory map.
#[derive(Clone, Debug)]
pub struct TokenSplit {
    tokens: MappedTokens,
    start: usize,
    len: usize,
    /// Which split.
    pub split: Split,
    /// The text behind the tokens.
    pub stats: TextStats,
    /// End-of-document token (the prompt at the start of a stream).
    pub eos: u32,
    /// For a recall task: its examples and which targets are scored
    /// (`None`: a text, where every target is).
    pub recall: Option<Arc<RecallSet>>,
}

impl TokenSplit {
    /// A recall split of examples made elsewhere: `ids` and their `recall`
    /// answers ([`crate::recall::read_task_file`]), with `eos` the
    /// vocabulary's end-of-document id. Its bits per byte are bits per
    /// token (the text behind the ids is not known).
    pub fn from_task(ids: Vec<u32>, recall: RecallSet, eos: u32) -> Self {
        let len = ids.len();
        Self {
            tokens: MappedTokens::from_ids(&ids),
            start: 0,
            len,
            split: Split::Test,
            stats: TextStats {
                bytes: len as u64,
                words: None,
                documents: recall.examples() as u64,
                invalid_utf8_documents: 0,
            },
            eos,
            recall: Some(Arc::new(recall)),
        }
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the split has no tokens.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes of text per token (1 for byte-level text).
    pub fn bytes_per_token(&self) -> f64 {
        self.stats.bytes as f64 / self.len.max(1) as f64
    }

    /// Token `i` of the split.
    pub fn get(&self, i: usize) -> u32 {
        debug_assert!(i < self.len);
        self.tokens.get(self.start + i)
    }

    /// The target at position `i`: its token where it is scored, `PAD`
    /// (which the loss skips) where it is not (a recall task's non-answers).
    pub fn target(&self, i: usize) -> u32 {
        match &self.recall {
            Some(recall) if !recall.is_scored(i) => PAD,
            _ => self.get(i),
        }
    }
}

/// An opened corpus: its vocabulary and its three splits.
#[derive(Clone, Debug)]
pub struct Corpus {
    /// How text maps to tokens.
    pub vocab: Vocab,
    splits: [TokenSplit; 3],
    /// Where the corpus was read from.
    pub spec: DataConfig,
}

/// A byte range of one file: part of a split's text.
#[derive(Clone, Debug)]
struct Piece {
    path: PathBuf,
    start: u64,
    end: u64,
}

fn file_len(path: &Path) -> Result<u64, DataError> {
    Ok(std::fs::metadata(path)
        .map_err(|e| DataError::io(path, e))?
        .len())
}

/// Identity of a file for cache keys: canonical path, size, modification time.
fn file_identity(path: &Path) -> Result<serde_json::Value, DataError> {
    let meta = std::fs::metadata(path).map_err(|e| DataError::io(path, e))?;
    let mtime = meta
        .modified()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos());
    let canonical = path.canonicalize().map_err(|e| DataError::io(path, e))?;
    Ok(serde_json::json!({"path": canonical, "len": meta.len(), "mtime_ns": mtime.to_string()}))
}

fn cache_path(spec: &DataConfig, name: &str) -> PathBuf {
    match &spec.cache_dir {
        Some(dir) => {
            let stem = spec
                .path
                .file_name()
                .map_or("corpus".into(), |n| n.to_string_lossy().into_owned());
            dir.join(format!("{stem}.{name}.tvq-cache"))
        }
        None => {
            let mut p = spec.path.as_os_str().to_owned();
            p.push(format!(".{name}.tvq-cache"));
            PathBuf::from(p)
        }
    }
}

/// The `.txt` files under `dir`, recursively, in name order, each real
/// file once: directories and files are told apart by their canonical
/// path, so a symbolic-link loop is walked once and a file reached by
/// several links (which would put the same text in two splits) is read
/// under its first name only.
pub fn text_files(dir: &Path) -> Result<Vec<PathBuf>, DataError> {
    let canonical = |p: &Path| std::fs::canonicalize(p).map_err(|e| DataError::io(p, e));
    let mut files = vec![];
    let mut seen_dirs = std::collections::HashSet::from([canonical(dir)?]);
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).map_err(|e| DataError::io(&d, e))? {
            let path = entry.map_err(|e| DataError::io(&d, e))?.path();
            if path.is_dir() {
                if seen_dirs.insert(canonical(&path)?) {
                    stack.push(path);
                }
            } else if path.extension().is_some_and(|e| e == "txt") {
                files.push(path);
            }
        }
    }
    files.sort();
    let mut seen_files = std::collections::HashSet::new();
    let mut unique = vec![];
    for file in files {
        if seen_files.insert(canonical(&file)?) {
            unique.push(file);
        }
    }
    Ok(unique)
}

/// Cuts the concatenation of `files` at byte fractions 90% and 95%.
fn proportional_pieces(files: &[PathBuf]) -> Result<[Vec<Piece>; 3], DataError> {
    let lens = files
        .iter()
        .map(|f| file_len(f))
        .collect::<Result<Vec<_>, _>>()?;
    let total: u64 = lens.iter().sum();
    let bounds = [0, total * 9 / 10, total * 19 / 20, total];
    let mut splits: [Vec<Piece>; 3] = Default::default();
    let mut offset = 0;
    for (file, len) in files.iter().zip(lens) {
        for (s, split) in splits.iter_mut().enumerate() {
            let (lo, hi) = (bounds[s].max(offset), bounds[s + 1].min(offset + len));
            if lo < hi {
                split.push(Piece {
                    path: file.clone(),
                    start: lo - offset,
                    end: hi - offset,
                });
            }
        }
        offset += len;
    }
    Ok(splits)
}

fn read_piece(p: &Piece) -> Result<Vec<u8>, DataError> {
    let io = |e| DataError::io(&p.path, e);
    let mut f = File::open(&p.path).map_err(io)?;
    f.seek(SeekFrom::Start(p.start)).map_err(io)?;
    let mut buf = vec![0; (p.end - p.start) as usize];
    f.read_exact(&mut buf).map_err(io)?;
    Ok(buf)
}

fn progress(total: u64, label: &str) -> ProgressBar {
    let bar = ProgressBar::new(total);
    bar.set_style(
        ProgressStyle::with_template(
            "{msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
        )
        .expect("valid template")
        .progress_chars("=> "),
    );
    bar.set_message(label.to_string());
    bar
}

/// Tokenizes `pieces` (one document each) into a cache, or opens the cache
/// if it was built from the same pieces and vocabulary.
fn document_cache(
    pieces: &[Piece],
    vocab: &Vocab,
    cache: &Path,
    label: &str,
) -> Result<(MappedTokens, TextStats), DataError> {
    let ids = pieces
        .iter()
        .map(|p| {
            Ok(serde_json::json!({"file": file_identity(&p.path)?, "range": [p.start, p.end]}))
        })
        .collect::<Result<Vec<_>, DataError>>()?;
    let fingerprint = serde_json::json!({"vocab": vocab.id(), "pieces": ids}).to_string();
    let bad_info = |_| DataError::BadCache {
        path: cache.to_path_buf(),
        reason: "unreadable statistics".into(),
    };
    if let Some((tokens, info)) = open_cache(cache, &fingerprint)? {
        // The ids index the model's embedding: a damaged cache must not
        // hand out one beyond the vocabulary (one pass over the map).
        if let Some(top) = tokens.max().filter(|&t| t as usize >= vocab.size()) {
            return Err(DataError::BadCache {
                path: cache.to_path_buf(),
                reason: format!(
                    "holds token id {top}, beyond the vocabulary of {}: delete it to rebuild it",
                    vocab.size()
                ),
            });
        }
        return Ok((tokens, serde_json::from_str(&info).map_err(bad_info)?));
    }
    let width = if vocab.size() <= 1 << 16 { 2 } else { 4 };
    let mut writer = CacheWriter::create(cache, &fingerprint, width)?;
    let mut stats = TextStats {
        words: Some(0),
        ..TextStats::default()
    };
    let bar = progress(pieces.iter().map(|p| p.end - p.start).sum(), label);
    for chunk in pieces.chunks(DOCS_PER_CHUNK) {
        let raw = chunk
            .iter()
            .map(read_piece)
            .collect::<Result<Vec<_>, _>>()?;
        let mut texts = Vec::with_capacity(raw.len());
        for bytes in &raw {
            stats.bytes += bytes.len() as u64;
            stats.documents += 1;
            let text = String::from_utf8_lossy(bytes);
            if matches!(text, std::borrow::Cow::Owned(_)) {
                stats.invalid_utf8_documents += 1;
            }
            *stats.words.as_mut().expect("counted") += text.split_whitespace().count() as u64;
            texts.push(text.into_owned());
        }
        let docs: Vec<Vec<u32>> = match vocab {
            // Byte-level keeps the bytes as they are, valid UTF-8 or not.
            Vocab::Bytes => raw
                .iter()
                .map(|b| b.iter().map(|&x| crate::vocab::byte_token(x)).collect())
                .collect(),
            Vocab::Tokenizer {
                tokenizer, path, ..
            } => tokenizer
                .encode_batch(texts, false)
                .map_err(|e| DataError::BadTokenizer {
                    path: path.clone(),
                    reason: e.to_string(),
                })?
                .iter()
                .map(|e| e.get_ids().to_vec())
                .collect(),
        };
        for doc in docs {
            for t in doc {
                writer.push(t)?;
            }
            writer.push(vocab.eos())?;
        }
        bar.inc(raw.iter().map(|b| b.len() as u64).sum());
    }
    bar.finish_and_clear();
    let info = serde_json::to_string(&stats).expect("serializable");
    writer.finish(&fingerprint, &info)?;
    let (tokens, _) = open_cache(cache, &fingerprint)?.ok_or_else(|| DataError::BadCache {
        path: cache.to_path_buf(),
        reason: "unreadable right after writing".into(),
    })?;
    Ok((tokens, stats))
}

/// A byte-level file (`len` bytes) cut into its three splits: enwik8's
/// standard 90M/5M/5M, or 90/5/5 per cent of any other file (of enwik8
/// only when `allow_proportional_split`).
fn byte_splits(spec: &DataConfig, len: u64, eos: u32) -> Result<[TokenSplit; 3], DataError> {
    let path = &spec.path;
    if len == 0 {
        return Err(DataError::Empty { path: path.clone() });
    }
    let tokens = if spec.kind == CorpusKind::Enwik8 && is_zip(path)? {
        unzip_enwik8(spec)?
    } else {
        MappedTokens::raw_bytes(path)?
    };
    let n = tokens.len() as u64;
    let bounds = match spec.kind {
        CorpusKind::Enwik8 if n == ENWIK8_LEN => ENWIK8_BOUNDS,
        CorpusKind::Enwik8 if !spec.allow_proportional_split => {
            return Err(DataError::NotEnwik8 {
                path: path.clone(),
                len: n,
            });
        }
        _ => [n * 9 / 10, n * 19 / 20],
    };
    let edges = [0, bounds[0] as usize, bounds[1] as usize, n as usize];
    Ok(Split::ALL.map(|split| {
        let i = split as usize;
        let len = edges[i + 1] - edges[i];
        let stats = TextStats {
            bytes: len as u64,
            words: None,
            documents: 1,
            invalid_utf8_documents: 0,
        };
        TokenSplit {
            tokens: tokens.clone(),
            start: edges[i],
            len,
            split,
            stats,
            eos,
            recall: None,
        }
    }))
}

/// The pieces of each split of a text file, or of a directory's text files
/// read as one stream (90/5/5 per cent).
fn text_pieces(path: &Path, is_dir: bool) -> Result<[Vec<Piece>; 3], DataError> {
    let files = if is_dir {
        text_files(path)?
    } else {
        vec![path.to_path_buf()]
    };
    if files.is_empty() {
        return Err(DataError::NoTextFiles {
            path: path.to_path_buf(),
        });
    }
    if files.iter().map(|f| file_len(f)).sum::<Result<u64, _>>()? == 0 {
        return Err(DataError::Empty {
            path: path.to_path_buf(),
        });
    }
    proportional_pieces(&files)
}

/// The books of each split of a PG-19 directory (`train/`, `validation/`,
/// `test/`), each book whole.
fn pg19_books(path: &Path) -> Result<Vec<Vec<Piece>>, DataError> {
    Split::ALL
        .iter()
        .map(|split| {
            let dir = path.join(split.to_string());
            if !dir.is_dir() {
                return Err(DataError::MissingSplit {
                    path: path.to_path_buf(),
                    split: split.to_string(),
                });
            }
            let files = text_files(&dir)?;
            if files.is_empty() {
                return Err(DataError::NoTextFiles { path: dir });
            }
            files
                .into_iter()
                .map(|f| {
                    Ok(Piece {
                        end: file_len(&f)?,
                        path: f,
                        start: 0,
                    })
                })
                .collect()
        })
        .collect()
}

fn is_zip(path: &Path) -> Result<bool, DataError> {
    let mut magic = [0u8; 4];
    let mut f = File::open(path).map_err(|e| DataError::io(path, e))?;
    let n = f.read(&mut magic).map_err(|e| DataError::io(path, e))?;
    Ok(n == 4 && &magic == b"PK\x03\x04")
}

/// Extracts the `enwik8` member of a zip into a byte cache (once).
fn unzip_enwik8(spec: &DataConfig) -> Result<MappedTokens, DataError> {
    let zip_path = &spec.path;
    let fingerprint =
        serde_json::json!({"kind": "enwik8-zip", "source": file_identity(zip_path)?}).to_string();
    let cache = cache_path(spec, "bytes");
    if let Some((t, _)) = open_cache(&cache, &fingerprint)? {
        return Ok(t);
    }
    let bad = |reason: String| DataError::BadZip {
        path: zip_path.clone(),
        reason,
    };
    let file = File::open(zip_path).map_err(|e| DataError::io(zip_path, e))?;
    let mut archive = zip::ZipArchive::new(file).map_err(|e| bad(e.to_string()))?;
    let index = (0..archive.len())
        .find(|&i| {
            archive.by_index(i).ok().and_then(|m| {
                m.name()
                    .ok()
                    .map(|n| n.rsplit('/').next() == Some("enwik8"))
            }) == Some(true)
        })
        .or_else(|| (archive.len() == 1).then_some(0))
        .ok_or_else(|| bad("no member named enwik8".to_string()))?;
    let mut member = archive.by_index(index).map_err(|e| bad(e.to_string()))?;
    let bar = progress(member.size(), "extracting enwik8");
    let mut writer = CacheWriter::create(&cache, &fingerprint, 1)?;
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = member.read(&mut buf).map_err(|e| bad(e.to_string()))?;
        if n == 0 {
            break;
        }
        writer.push_raw(&buf[..n])?;
        bar.inc(n as u64);
    }
    bar.finish_and_clear();
    writer.finish(&fingerprint, "{}")?;
    Ok(open_cache(&cache, &fingerprint)?
        .ok_or_else(|| DataError::BadCache {
            path: cache.clone(),
            reason: "unreadable right after writing".into(),
        })?
        .0)
}

impl Corpus {
    /// Opens a corpus: maps it, tokenizing it into caches first if needed.
    pub fn open(spec: &DataConfig) -> Result<Self, DataError> {
        if spec.kind == CorpusKind::Mqar {
            return Self::mqar(spec);
        }
        if spec.kind == CorpusKind::Passkey {
            return Self::passkey(spec);
        }
        let path = &spec.path;
        if path.as_os_str().is_empty() {
            return Err(DataError::Unsupported(format!(
                "data.path is required for a corpus of kind {:?}",
                spec.kind
            )));
        }
        if let Some(dir) = &spec.cache_dir {
            std::fs::create_dir_all(dir).map_err(|e| DataError::io(dir, e))?;
        }
        let meta = std::fs::metadata(path).map_err(|e| DataError::io(path, e))?;
        let vocab = match &spec.tokenizer {
            None => Vocab::Bytes,
            Some(_) if spec.kind == CorpusKind::Enwik8 => {
                return Err(DataError::Unsupported(
                    "enwik8 is modelled byte-level: remove `tokenizer` from the data config".into(),
                ));
            }
            Some(t) => Vocab::load_tokenizer(t)?,
        };
        let splits = match spec.kind {
            CorpusKind::Enwik8 | CorpusKind::Text
                if !meta.is_dir() && matches!(vocab, Vocab::Bytes) =>
            {
                byte_splits(spec, meta.len(), vocab.eos())?
            }
            CorpusKind::Enwik8 => {
                return Err(DataError::io(
                    path,
                    std::io::Error::other("expected the enwik8 file, found a directory"),
                ));
            }
            CorpusKind::Text => {
                let pieces = text_pieces(path, meta.is_dir())?;
                Self::tokenize_splits(spec, &vocab, |s| Ok(pieces[s as usize].clone()))?
            }
            CorpusKind::Pg19 => {
                let books = pg19_books(path)?;
                Self::tokenize_splits(spec, &vocab, |s| Ok(books[s as usize].clone()))?
            }
            CorpusKind::Mqar | CorpusKind::Passkey => unreachable!("opened above"),
        };
        Ok(Self {
            vocab,
            splits,
            spec: spec.clone(),
        })
    }

    fn tokenize_splits(
        spec: &DataConfig,
        vocab: &Vocab,
        pieces: impl Fn(Split) -> Result<Vec<Piece>, DataError>,
    ) -> Result<[TokenSplit; 3], DataError> {
        let mut out = Vec::with_capacity(3);
        for split in Split::ALL {
            let cache = cache_path(spec, &split.to_string());
            let (tokens, stats) = document_cache(
                &pieces(split)?,
                vocab,
                &cache,
                &format!("tokenizing {split}"),
            )?;
            out.push(TokenSplit {
                len: tokens.len(),
                tokens,
                start: 0,
                split,
                stats,
                eos: vocab.eos(),
                recall: None,
            });
        }
        Ok(out.try_into().expect("three splits"))
    }

    /// The MQAR task of `spec.mqar`, each example one `spec.sequence_len`
    /// sequence, byte-level, generated in memory.
    fn mqar(spec: &DataConfig) -> Result<Self, DataError> {
        let task = spec.mqar_task();
        let counts = (task.train_examples, task.eval_examples);
        Self::recall(spec, "an MQAR task", counts, |split, n| {
            task.examples(split as u64, n, spec.sequence_len)
        })
    }

    /// The passkey task of `spec.passkey`, its filler from each split of the
    /// byte-level text at `spec.path`.
    fn passkey(spec: &DataConfig) -> Result<Self, DataError> {
        let task = spec.passkey.clone().unwrap_or_default();
        // One raw byte file, whose tokens are all bytes (a directory's
        // documents are separated by end-of-document tokens).
        let meta = std::fs::metadata(&spec.path).map_err(|e| DataError::io(&spec.path, e))?;
        if !meta.is_file() {
            return Err(DataError::Unsupported(format!(
                "data.passkey: the filler text must be one byte-level file, and {} is not",
                spec.path.display()
            )));
        }
        let text = Self::open(&DataConfig {
            kind: CorpusKind::Text,
            tokenizer: None,
            passkey: None,
            ..spec.clone()
        })?;
        let counts = (task.train_examples, task.eval_examples);
        Self::recall(spec, "a passkey task", counts, |split, n| {
            let source = text.split(split);
            let byte = |i: usize| (source.get(i) - crate::vocab::N_SPECIAL) as u8;
            let training = split == Split::Train;
            task.examples(
                split as u64,
                training,
                n,
                spec.sequence_len,
                byte,
                source.len(),
            )
        })
    }

    /// A byte-level recall task whose splits `examples` makes: `counts.0`
    /// examples for training, `counts.1` for validation and for test.
    fn recall(
        spec: &DataConfig,
        what: &str,
        counts: (usize, usize),
        examples: impl Fn(Split, usize) -> Result<(Vec<u8>, RecallSet), DataError>,
    ) -> Result<Self, DataError> {
        if spec.tokenizer.is_some() {
            return Err(DataError::Unsupported(format!(
                "{what} is byte-level: remove `tokenizer` from the data config"
            )));
        }
        let vocab = Vocab::Bytes;
        let mut splits = Vec::with_capacity(3);
        for split in Split::ALL {
            let n = match split {
                Split::Train => counts.0,
                _ => counts.1,
            };
            let (symbols, recall) = examples(split, n)?;
            let len = symbols.len();
            splits.push(TokenSplit {
                tokens: MappedTokens::from_bytes(symbols),
                start: 0,
                len,
                split,
                // Bits per byte are bits per token: a symbol is a byte.
                stats: TextStats {
                    bytes: len as u64,
                    words: None,
                    documents: recall.examples() as u64,
                    invalid_utf8_documents: 0,
                },
                eos: vocab.eos(),
                recall: Some(Arc::new(recall)),
            });
        }
        Ok(Self {
            vocab,
            splits: splits.try_into().expect("three splits"),
            spec: spec.clone(),
        })
    }

    /// The tokens of a split.
    pub fn split(&self, split: Split) -> TokenSplit {
        self.splits[split as usize].clone()
    }
}
