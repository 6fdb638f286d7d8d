//! `tvq tokenizer train`: a tokenizer from a corpus's training text.

use std::path::PathBuf;

use anyhow::{Result, bail};
use clap::{Args, Subcommand, ValueEnum};
use tvq_data::{TokenizerKind, Vocab, text_files, train_tokenizer};

/// Tokenizer commands.
#[derive(Subcommand, Debug)]
pub enum TokenizerCommand {
    /// Train a byte-level unigram or BPE tokenizer and write it as tokenizer.json.
    Train(TrainArgs),
}

/// Subword model.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum Kind {
    /// Unigram language model (as SentencePiece; the paper's PG-19 setting).
    Unigram,
    /// Byte-pair encoding.
    Bpe,
}

/// Options of `tvq tokenizer train`.
#[derive(Args, Debug)]
pub struct TrainArgs {
    /// A PG-19 directory (its train/ books are used), a directory of .txt
    /// files, or one text file.
    #[arg(long)]
    corpus: PathBuf,
    /// Where to write the tokenizer.
    #[arg(long, default_value = "tokenizer.json")]
    out: PathBuf,
    /// Subword model.
    #[arg(long, value_enum, default_value = "unigram")]
    kind: Kind,
    /// Vocabulary size, special tokens included.
    #[arg(long, default_value_t = 32000)]
    vocab_size: usize,
}

/// Runs a tokenizer command.
pub fn run(cmd: TokenizerCommand) -> Result<()> {
    let TokenizerCommand::Train(args) = cmd;
    let corpus = &args.corpus;
    let files = if corpus.join("train").is_dir() {
        text_files(&corpus.join("train"))?
    } else if corpus.is_dir() {
        text_files(corpus)?
    } else if corpus.is_file() {
        vec![corpus.clone()]
    } else {
        bail!("{} does not exist", corpus.display());
    };
    if files.is_empty() {
        bail!("{} holds no .txt files to train on", corpus.display());
    }
    let kind = match args.kind {
        Kind::Unigram => TokenizerKind::Unigram,
        Kind::Bpe => TokenizerKind::Bpe,
    };
    tracing::info!(
        "training a {kind:?} tokenizer of {} ids on {} file(s)",
        args.vocab_size,
        files.len()
    );
    train_tokenizer(&files, kind, args.vocab_size, &args.out)?;
    let vocab = Vocab::load_tokenizer(&args.out)?;
    println!(
        "wrote {} ({} ids, end of document = {})",
        args.out.display(),
        vocab.size(),
        vocab.eos()
    );
    Ok(())
}
