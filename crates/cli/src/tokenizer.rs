//! `tvq tokenizer train`: a tokenizer from a corpus's training text.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand, ValueEnum};
use tvq_data::{TokenizerKind, Vocab, train_tokenizer};

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

fn txt_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut files = vec![];
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in
            std::fs::read_dir(&d).with_context(|| format!("cannot read {}", d.display()))?
        {
            let path = entry?.path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "txt") {
                files.push(path);
            }
        }
    }
    files.sort();
    Ok(files)
}

/// Runs a tokenizer command.
pub fn run(cmd: TokenizerCommand) -> Result<()> {
    let TokenizerCommand::Train(args) = cmd;
    let corpus = &args.corpus;
    let files = if corpus.join("train").is_dir() {
        txt_files(&corpus.join("train"))?
    } else if corpus.is_dir() {
        txt_files(corpus)?
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
