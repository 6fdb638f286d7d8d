//! Corpora on disk to the token batches the trainer needs: enwik8 (raw or
//! zipped), PG-19 (a directory of books, tokenized with a `tokenizers`
//! tokenizer), any text file or directory (byte-level or tokenized), and
//! synthetic recall tasks ([`recall`]: MQAR) made from a seed.
//!
//! The crate knows nothing about tensors or the model: it opens a corpus
//! ([`Corpus`], from the `[data]` table [`DataConfig`]), hands out the tokens of a split as a memory-mapped array
//! ([`TokenSplit`]), and cuts them into batches for stateful training
//! ([`TrainBatches`], resumable from a [`TrainCursor`]) or for evaluation
//! ([`EvalBatches`], every token exactly once).
//!
//! Byte-level text uses the official implementation's vocabulary (see
//! [`vocab`]): 0 padding, 1 end of document (also the prompt at the start
//! of a stream), 2 unknown, and byte `b` is token `b + 3`, 259 tokens in all.
//! A model trained by tvq on bytes is therefore interchangeable with an
//! official one.

mod batch;
mod cache;
mod config;
mod corpus;
mod error;
pub mod hash;
pub mod recall;
mod tokenizer;
pub mod vocab;

pub use batch::{Batch, EvalBatches, TrainBatches, TrainCursor, TrainLayout};
pub use config::{CorpusKind, DataConfig};
pub use corpus::{Corpus, Split, TextStats, TokenSplit, text_files};
pub use error::DataError;
pub use tokenizer::{SPECIAL_TOKENS, TokenizerKind, train_tokenizer};
pub use vocab::Vocab;
