//! Vocabularies: raw bytes (the official code's `bytes + 3` convention) or a
//! `tokenizers` tokenizer.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use tokenizers::Tokenizer;

use crate::error::DataError;
use crate::hash::fnv1a;

/// Padding: the target of positions past the end of a split; never predicted.
pub const PAD: u32 = 0;
/// End of document; also the input before the first token of a stream.
pub const EOS: u32 = 1;
/// Unknown (unused by byte-level text).
pub const UNK: u32 = 2;
/// Number of special tokens before the bytes.
pub const N_SPECIAL: u32 = 3;
/// Vocabulary size of byte-level text.
pub const BYTE_VOCAB_SIZE: usize = 256 + N_SPECIAL as usize;
/// Names tried, in order, for a tokenizer's end-of-document token.
pub const EOS_NAMES: [&str; 4] = ["<eod>", "</s>", "<|endoftext|>", "<eos>"];

/// Most bytes of one added (special) token's text. Real ones are a few
/// dozen; `tokenizers` builds a matching automaton over them whose cost
/// grows with the square of a repetitive token's length (one of 64 KiB
/// took minutes to load).
pub const ADDED_TOKEN_MAX_BYTES: usize = 256;

/// Most added tokens a tokenizer file may declare.
pub const ADDED_TOKENS_MAX: usize = 1 << 14;

/// What is wrong with a tokenizer file's added tokens, if anything: more
/// than [`ADDED_TOKENS_MAX`], or one longer than [`ADDED_TOKEN_MAX_BYTES`]
/// (checked before `tokenizers` builds anything from them). Malformed JSON
/// is left for `tokenizers` to report.
fn check_added_tokens(bytes: &[u8]) -> Result<(), String> {
    #[derive(serde::Deserialize)]
    struct File {
        #[serde(default)]
        added_tokens: Vec<Added>,
    }
    #[derive(serde::Deserialize)]
    struct Added {
        content: String,
    }
    let Ok(file) = serde_json::from_slice::<File>(bytes) else {
        return Ok(());
    };
    if file.added_tokens.len() > ADDED_TOKENS_MAX {
        return Err(format!(
            "{} added tokens, more than the {ADDED_TOKENS_MAX} tvq reads",
            file.added_tokens.len()
        ));
    }
    match file
        .added_tokens
        .iter()
        .find(|t| t.content.len() > ADDED_TOKEN_MAX_BYTES)
    {
        Some(t) => Err(format!(
            "an added token of {} bytes, longer than the {ADDED_TOKEN_MAX_BYTES} tvq reads",
            t.content.len()
        )),
        None => Ok(()),
    }
}

/// Token of a byte.
pub fn byte_token(b: u8) -> u32 {
    b as u32 + N_SPECIAL
}

/// Byte of a token, or `None` for a special token.
pub fn token_byte(t: u32) -> Option<u8> {
    t.checked_sub(N_SPECIAL).and_then(|b| u8::try_from(b).ok())
}

/// How text becomes tokens and back.
#[derive(Clone)]
pub enum Vocab {
    /// Byte `b` is token `b + 3`; 0, 1, 2 are padding, end of document, unknown.
    Bytes,
    /// A `tokenizers` tokenizer loaded from a `tokenizer.json`.
    Tokenizer {
        /// The tokenizer.
        tokenizer: Arc<Tokenizer>,
        /// Its end-of-document token.
        eos: u32,
        /// Where it was loaded from.
        path: PathBuf,
        /// FNV-1a hash of the file, part of every cache key.
        hash: u64,
    },
}

impl std::fmt::Debug for Vocab {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Vocab::Bytes => write!(f, "Vocab::Bytes"),
            Vocab::Tokenizer { path, eos, .. } => {
                write!(f, "Vocab::Tokenizer({}, eos {eos})", path.display())
            }
        }
    }
}

/// The largest `tokenizer.json` read (those of the largest public
/// vocabularies hold tens of MiB).
const TOKENIZER_LIMIT: u64 = 1 << 30;

impl Vocab {
    /// Loads a `tokenizer.json`; it must define an end-of-document token
    /// (one of [`EOS_NAMES`]).
    pub fn load_tokenizer(path: &Path) -> Result<Self, DataError> {
        // The path may come from a downloaded export: a special file
        // (`/dev/zero`) or a huge one is refused before it is read.
        let meta = std::fs::metadata(path);
        if let Ok(meta) = &meta
            && (!meta.is_file() || meta.len() > TOKENIZER_LIMIT)
        {
            return Err(DataError::BadTokenizer {
                path: path.to_path_buf(),
                reason: format!(
                    "not a regular file of at most {} MiB",
                    TOKENIZER_LIMIT >> 20
                ),
            });
        }
        let bytes = std::fs::read(path).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => DataError::BadTokenizer {
                path: path.to_path_buf(),
                reason: "no such file (train one with `tvq tokenizer train --corpus ... --out` that path)".into(),
            },
            _ => DataError::io(path, e),
        })?;
        check_added_tokens(&bytes).map_err(|reason| DataError::BadTokenizer {
            path: path.to_path_buf(),
            reason,
        })?;
        let tokenizer = Tokenizer::from_bytes(&bytes).map_err(|e| DataError::BadTokenizer {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
        let eos = EOS_NAMES
            .iter()
            .find_map(|n| tokenizer.token_to_id(n))
            .ok_or_else(|| DataError::BadTokenizer {
                path: path.to_path_buf(),
                reason: format!("it has no end-of-document token (one of {EOS_NAMES:?})"),
            })?;
        // Ids index the embedding and are stored in caches as wide as the
        // vocabulary needs: one beyond it would read outside the table.
        let size = tokenizer.get_vocab_size(true);
        if let Some((token, id)) = tokenizer
            .get_vocab(true)
            .into_iter()
            .find(|(_, id)| *id as usize >= size)
        {
            return Err(DataError::BadTokenizer {
                path: path.to_path_buf(),
                reason: format!("token {token:?} has id {id}, beyond its vocabulary of {size} ids"),
            });
        }
        Ok(Vocab::Tokenizer {
            tokenizer: Arc::new(tokenizer),
            eos,
            path: path.to_path_buf(),
            hash: fnv1a(&bytes),
        })
    }

    /// Number of token ids.
    pub fn size(&self) -> usize {
        match self {
            Vocab::Bytes => BYTE_VOCAB_SIZE,
            Vocab::Tokenizer { tokenizer, .. } => tokenizer.get_vocab_size(true),
        }
    }

    /// End-of-document token (also the prompt at the start of a stream).
    pub fn eos(&self) -> u32 {
        match self {
            Vocab::Bytes => EOS,
            Vocab::Tokenizer { eos, .. } => *eos,
        }
    }

    /// A short identity for cache keys and configs.
    pub fn id(&self) -> String {
        match self {
            Vocab::Bytes => "bytes+3".to_string(),
            Vocab::Tokenizer { hash, .. } => format!("tokenizer-{hash:016x}"),
        }
    }

    /// Tokens of a text (no end-of-document token added).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, DataError> {
        match self {
            Vocab::Bytes => Ok(text.bytes().map(byte_token).collect()),
            Vocab::Tokenizer {
                tokenizer, path, ..
            } => tokenizer
                .encode(text, false)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| DataError::BadTokenizer {
                    path: path.clone(),
                    reason: e.to_string(),
                }),
        }
    }

    /// The name of the end-of-document token (`<eos>` for bytes).
    pub fn eos_name(&self) -> String {
        match self {
            Vocab::Bytes => BYTE_SPECIALS[EOS as usize].to_string(),
            Vocab::Tokenizer { tokenizer, eos, .. } => {
                tokenizer.id_to_token(*eos).unwrap_or_default()
            }
        }
    }

    /// The vocabulary as a `tokenizers` JSON file (what a Hugging Face
    /// `PreTrainedTokenizerFast` loads) that gives tvq's ids and, with
    /// special tokens, puts the end-of-document token before a text, where
    /// tvq's evaluation and sampling start a stream: a tokenizer's own
    /// (its post-processor followed by that), or for bytes one where byte
    /// `b` is `b + 3` (through `tokenizers`' byte-level alphabet, every
    /// byte its own token).
    pub fn tokenizer_json(&self) -> Result<String, DataError> {
        match self {
            Vocab::Bytes => Ok(byte_tokenizer_json()),
            Vocab::Tokenizer {
                tokenizer,
                path,
                eos,
                ..
            } => {
                let bad = |reason: String| DataError::BadTokenizer {
                    path: path.clone(),
                    reason,
                };
                let text = tokenizer.to_string(false).map_err(|e| bad(e.to_string()))?;
                let mut json: serde_json::Value =
                    serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
                let own = json.get("post_processor").cloned();
                json["post_processor"] = eos_first(own, &self.eos_name(), *eos);
                Ok(json.to_string())
            }
        }
    }

    /// Text of tokens. Byte-level: specials are dropped and invalid UTF-8
    /// becomes U+FFFD.
    pub fn decode(&self, tokens: &[u32]) -> Result<String, DataError> {
        match self {
            Vocab::Bytes => {
                let bytes: Vec<u8> = tokens.iter().filter_map(|&t| token_byte(t)).collect();
                Ok(String::from_utf8_lossy(&bytes).into_owned())
            }
            Vocab::Tokenizer {
                tokenizer, path, ..
            } => tokenizer
                .decode(tokens, false)
                .map_err(|e| DataError::BadTokenizer {
                    path: path.clone(),
                    reason: e.to_string(),
                }),
        }
    }
}

/// The names of the byte vocabulary's special tokens, by id.
const BYTE_SPECIALS: [&str; N_SPECIAL as usize] = ["<pad>", "<eos>", "<unk>"];

/// The character `tokenizers`' byte-level alphabet (GPT-2's) gives each
/// byte: printable Latin-1 bytes stand for themselves, the others take the
/// code points from U+0100 up, in byte order.
fn byte_level_char(b: u8) -> char {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    if printable(b) {
        return char::from(b);
    }
    let before = (0..b).filter(|&c| !printable(c)).count() as u32;
    char::from_u32(256 + before).expect("below U+0200")
}

/// [`Vocab::tokenizer_json`] of the byte vocabulary.
fn byte_tokenizer_json() -> String {
    use serde_json::{Map, json};
    let mut vocab = Map::new();
    for (id, name) in BYTE_SPECIALS.iter().enumerate() {
        vocab.insert(name.to_string(), json!(id));
    }
    for b in 0..=255u8 {
        vocab.insert(byte_level_char(b).to_string(), json!(byte_token(b)));
    }
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false});
    let json = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        // No added tokens: a special token's name in a text is its bytes,
        // as tvq reads it (the template puts the token itself by id).
        "added_tokens": [],
        "normalizer": null,
        "pre_tokenizer": byte_level,
        "post_processor": eos_first(None, BYTE_SPECIALS[EOS as usize], EOS),
        "decoder": byte_level,
        "model": {
            "type": "BPE", "dropout": null, "unk_token": BYTE_SPECIALS[UNK as usize],
            "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": false,
            "byte_fallback": false, "ignore_merges": false, "vocab": vocab, "merges": [],
        },
    });
    json.to_string()
}

/// A `tokenizers` post-processor that puts the end-of-document token
/// `name` (id `id`) before a text, after `own` (a tokenizer's own
/// post-processor, if it has one).
fn eos_first(own: Option<serde_json::Value>, name: &str, id: u32) -> serde_json::Value {
    use serde_json::json;
    let special = json!({"SpecialToken": {"id": name, "type_id": 0}});
    let template = json!({
        "type": "TemplateProcessing",
        "single": [special, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [special, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {name: {"id": name, "ids": [id], "tokens": [name]}},
    });
    match own {
        Some(own) if !own.is_null() => json!({"type": "Sequence", "processors": [own, template]}),
        _ => template,
    }
}
