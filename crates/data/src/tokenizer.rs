//! Training a tokenizer on a corpus's train split (`tvq tokenizer train`).
//!
//! Both kinds work on bytes mapped to printable characters (GPT-2's
//! byte-level scheme), so every text, whatever its characters, encodes and
//! decodes back to itself exactly. The special tokens come first: `<pad>`
//! 0, `<eod>` 1, `<unk>` 2 — the same ids as the byte vocabulary's.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tokenizers::models::bpe::{BPE, BpeTrainerBuilder};
use tokenizers::models::unigram::{Unigram, UnigramTrainerBuilder};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{
    AddedToken, DecoderWrapper, Model, NormalizerWrapper, PostProcessorWrapper,
    PreTokenizerWrapper, Trainer,
};
use tokenizers::{TokenizerBuilder, TokenizerImpl};

use crate::error::DataError;

/// Which subword model to train.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TokenizerKind {
    /// Unigram language model (SentencePiece's default, as PG-19 in the paper).
    Unigram,
    /// Byte-pair encoding.
    Bpe,
}

/// Special tokens, in id order.
pub const SPECIAL_TOKENS: [&str; 3] = ["<pad>", "<eod>", "<unk>"];

fn train_with<M, T>(
    model: M,
    mut trainer: T,
    files: &[PathBuf],
    out: &Path,
) -> Result<(), DataError>
where
    M: Model<Trainer = T> + Send + Sync + serde::Serialize,
    T: Trainer<Model = M> + Sync,
{
    let byte_level = ByteLevel::new(false, true, true);
    let mut tokenizer: TokenizerImpl<
        M,
        NormalizerWrapper,
        PreTokenizerWrapper,
        PostProcessorWrapper,
        DecoderWrapper,
    > = TokenizerBuilder::new()
        .with_model(model)
        .with_pre_tokenizer(Some(byte_level.into()))
        .with_decoder(Some(byte_level.into()))
        .build()
        .map_err(|e| DataError::Unsupported(format!("cannot build the tokenizer: {e}")))?;
    let names = files
        .iter()
        .map(|f| f.to_string_lossy().into_owned())
        .collect();
    tokenizer
        .train_from_files(&mut trainer, names)
        .map_err(|e| DataError::Unsupported(format!("tokenizer training failed: {e}")))?;
    let tmp = out.with_extension(format!("tmp-{}", std::process::id()));
    tokenizer
        .save(&tmp, false)
        .map_err(|e| DataError::io(&tmp, std::io::Error::other(e.to_string())))?;
    std::fs::rename(&tmp, out).map_err(|e| DataError::io(out, e))
}

/// Trains a `kind` tokenizer of `vocab_size` ids on `files` and writes it
/// as a `tokenizer.json` to `out` (atomically).
pub fn train_tokenizer(
    files: &[PathBuf],
    kind: TokenizerKind,
    vocab_size: usize,
    out: &Path,
) -> Result<(), DataError> {
    if files.is_empty() {
        return Err(DataError::Unsupported(
            "no training files for the tokenizer".into(),
        ));
    }
    let min = 256 + SPECIAL_TOKENS.len();
    if vocab_size < min {
        return Err(DataError::Unsupported(format!(
            "vocab_size {vocab_size} is too small: a byte-level tokenizer needs at least {min}"
        )));
    }
    let specials: Vec<AddedToken> = SPECIAL_TOKENS
        .iter()
        .map(|t| AddedToken::from(*t, true))
        .collect();
    let alphabet = ByteLevel::alphabet();
    match kind {
        TokenizerKind::Bpe => {
            let trainer = BpeTrainerBuilder::new()
                .vocab_size(vocab_size)
                .min_frequency(0)
                .special_tokens(specials)
                .initial_alphabet(alphabet.into_iter().collect())
                .show_progress(true)
                .build();
            train_with(BPE::default(), trainer, files, out)
        }
        TokenizerKind::Unigram => {
            let trainer = UnigramTrainerBuilder::default()
                .vocab_size(vocab_size as u32)
                .special_tokens(specials)
                .initial_alphabet(alphabet)
                .unk_token(Some("<unk>".to_string()))
                .show_progress(true)
                .build()
                .map_err(|e| DataError::Unsupported(format!("tokenizer trainer: {e}")))?;
            train_with(Unigram::default(), trainer, files, out)
        }
    }
}
