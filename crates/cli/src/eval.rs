//! `tvq eval`: loss, bits and recall of a model on a split, a task or a task file, and the reports of where its attention went.

use std::path::PathBuf;

use crate::args::{CacheLimits, Devices, KernelChoice};
use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use tvq_data::recall::read_task_file;
use tvq_data::{Corpus, CorpusKind, Split, TokenSplit};
use tvq_model::AttentionForm;
use tvq_train::config::EvalSection;
use tvq_train::inference::code_sharing::{CodeSharing, SharingBucket};
use tvq_train::inference::load::{Loaded, load_for_inference};
use tvq_train::inference::recall::RecallReport;
use tvq_train::placement::{Model, fork_onto, memory};
use tvq_train::{AttentionShare, EvalOptions, EvalReport, PositionBucket, evaluate};

/// Split to evaluate.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum SplitArg {
    /// The validation split.
    Validation,
    /// The test split.
    Test,
}

/// A synthetic task to evaluate on instead of the config's corpus.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum TaskArg {
    /// Multi-query associative recall (the config's `[data.mqar]`, or its
    /// defaults): exact-match accuracy on the answers, by distance.
    Mqar,
    /// Passkey retrieval in the config's byte-level text (`[data.passkey]`,
    /// or its defaults): accuracy on the key's digits, by distance.
    Passkey,
}

/// Options of `tvq eval`.
#[derive(Args, Debug)]
pub struct EvalArgs {
    /// A checkpoint directory, a run directory (its latest checkpoint) or an exported .safetensors.
    #[arg(long, visible_alias = "run-dir")]
    checkpoint: PathBuf,
    /// Config naming the corpus (default: the run directory's config.toml).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Split to evaluate.
    #[arg(long, value_enum, default_value = "validation")]
    split: SplitArg,
    #[command(flatten)]
    devices: Devices,
    /// Threads that score shards of the batch's rows at once, shard g on
    /// device g mod the number of devices (default: the config's
    /// train.workers).
    #[arg(long, value_parser = crate::args::at_least(1))]
    workers: Option<usize>,
    /// Reset the state every N tokens of each row (a multiple of the config's
    /// eval.update_len), as the official validation does per sequence
    /// (default: carry it through the row).
    #[arg(long, value_name = "N")]
    reset_every: Option<usize>,
    #[command(flatten)]
    cache_limits: CacheLimits,
    #[command(flatten)]
    kernels: KernelChoice,
    /// Also measure the loss by position in the document (log2 buckets):
    /// written as JSON to this file, and drawn to the same name with .png.
    #[arg(long, value_name = "FILE.json")]
    by_position: Option<PathBuf>,
    /// Also measure where each sublayer's attention goes: its share on the
    /// present block, the previous block and the compressed cache, and the
    /// attention entropy, and the queries' learned count weight when the
    /// model has one (over the whole split and, with --by-position, by
    /// position; on a recall task, at the answers, by distance).
    #[arg(long)]
    attention: bool,
    /// Evaluate on a synthetic task instead of the config's corpus (a run
    /// trained on one is evaluated on it without this flag). Reports the
    /// answers' accuracy by distance and, for VQ, by how many other pairs
    /// of the example share a cached answer's code.
    #[arg(long, value_enum)]
    task: Option<TaskArg>,
    /// With --task mqar, or on a run trained on MQAR: key-value pairs per
    /// example (default: the config's data.mqar.pairs, else 16); every key
    /// is asked for.
    #[arg(long, value_parser = crate::args::at_least(1))]
    pairs: Option<usize>,
    /// With --task, or on a run trained on a recall task: tokens per
    /// example (default: the config's data.sequence_len).
    #[arg(long, value_parser = crate::args::at_least(1))]
    sequence_len: Option<usize>,
    /// Evaluate on recall examples made elsewhere: a JSON Lines file, one
    /// example per line, {"tokens": [ids], "answers": [{"pos": P, "token":
    /// ID, "distance": D}]}, ids of the model's vocabulary (docs/data.md,
    /// "Recall tasks"). Needs no corpus: an export will do.
    #[arg(long, value_name = "F.jsonl",
          conflicts_with_all = ["task", "pairs", "sequence_len", "split", "by_position"])]
    task_file: Option<PathBuf>,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
    /// Go on when the memory estimate exceeds the memory free.
    #[arg(long)]
    force: bool,
}

/// Runs `tvq eval`.
pub fn run(args: EvalArgs) -> Result<()> {
    let devices = args.devices.init()?;
    let mut loaded = load_for_inference(&args.checkpoint, args.config.as_deref(), &devices[0])?;
    args.cache_limits.apply(&mut loaded.model);
    args.kernels.apply(&mut loaded.model);
    let split = match &args.task_file {
        Some(path) => {
            let (ids, recall) = read_task_file(path, loaded.model.vocab_size())?;
            TokenSplit::from_task(ids, recall, loaded.vocab.eos())
        }
        None => corpus_split(&args, &loaded)?,
    };
    // An export without a config evaluates in segments of whole blocks.
    let (eval, workers) = match &loaded.config {
        Some(cfg) => (cfg.eval.clone(), cfg.train.workers),
        None => {
            let update_len = EvalSection::default().update_len;
            let update_len = update_len.next_multiple_of(loaded.model.block_len());
            let eval = EvalSection {
                update_len,
                ..Default::default()
            };
            (eval, 1)
        }
    };
    let estimate = memory::evaluation(&loaded.model_config, eval.batch_size, eval.update_len);
    memory::check(&estimate, memory::available(&devices[0]), args.force)?;
    let opts = EvalOptions {
        max_segments: None,
        progress: !args.json,
        workers: args.workers.unwrap_or(workers),
        reset_every: args.reset_every,
        by_position: args.by_position.is_some(),
        attention: args.attention,
    };
    let quadratic = (loaded.model.sublayers.iter()).any(|g| g.form == AttentionForm::Quadratic);
    if args.attention && quadratic {
        bail!(
            "--attention measures the groups of VQ attention; this model uses the quadratic form"
        );
    }
    let models: Vec<Model> = (devices.iter())
        .map(|d| fork_onto(&loaded.model, d))
        .collect();
    let report = evaluate(&models, &split, &eval, &opts)?;
    if let (Some(path), Some(buckets)) = (&args.by_position, &report.by_position) {
        std::fs::write(path, serde_json::to_vec_pretty(buckets)?)
            .with_context(|| format!("writing {}", path.display()))?;
        let png = path.with_extension("png");
        let title = format!("{} split, step {}", report.split, loaded.step);
        tvq_train::run::plot::plot_by_position(buckets, &png, &title)?;
        if !args.json {
            println!("loss by position: {} and {}", path.display(), png.display());
        }
    }
    if args.json {
        let mut v = serde_json::to_value(&report)?;
        v["step"] = loaded.step.into();
        println!("{v}");
    } else if let Some(recall) = &report.recall {
        let what = match &args.task_file {
            Some(path) => path.display().to_string(),
            None => format!("{} split", report.split),
        };
        print_recall(&what, loaded.step, recall, &report);
    } else {
        println!(
            "{} split, step {}: {} tokens, loss {:.4} nats/token, {:.4} bits/token, {:.4} bits/byte{}",
            report.split,
            loaded.step,
            report.tokens,
            report.loss,
            report.bits_per_token,
            report.bits_per_byte,
            report
                .word_perplexity
                .map_or(String::new(), |p| format!(", word perplexity {p:.2}"))
        );
        if let Some(sublayers) = &report.attention {
            print_attention(sublayers, report.by_position.as_deref().unwrap_or_default());
        }
    }
    Ok(())
}

/// The recall report of `tvq eval`: accuracy overall and by distance, the
/// codes the answers shared and, with `--attention`, where the attention
/// at the answers went.
fn print_recall(what: &str, step: u64, recall: &RecallReport, report: &EvalReport) {
    println!(
        "{what}, step {}: recall accuracy {:.2}% ({} of {} answers), loss {:.4} nats/answer",
        step,
        100.0 * recall.accuracy,
        recall.correct,
        recall.answers,
        report.loss
    );
    println!("by distance between the answer and where it was given (tokens):");
    for b in &recall.by_distance {
        println!(
            "  {:>7}-{:<7} {:>6.2}% of {}",
            b.first,
            b.last,
            100.0 * b.accuracy,
            b.answers
        );
    }
    print_code_sharing(&recall.code_sharing, &recall.code_sharing_joint);
    if let Some(sublayers) = &report.attention {
        print_attention(sublayers, &[]);
        let by_distance = |what: &str, figure: fn(&AttentionShare) -> f64| {
            println!("{what} at the answers, by distance (per sublayer):");
            for b in &recall.by_distance {
                let figures: Vec<_> = b
                    .attention
                    .iter()
                    .map(|a| format!("{:.3}", figure(a)))
                    .collect();
                println!("  {:>7}-{:<7} {}", b.first, b.last, figures.join(" "));
            }
        };
        // The cache's share tells whether a far answer came from it.
        by_distance("compressed cache's share", |a| a.share[2]);
        if learned_count_weight(sublayers) {
            by_distance("count weight", |a| a.count_weight);
        }
    }
}

/// The split `tvq eval` reads from the run's corpus, or from the task that
/// replaces it (`--task`).
fn corpus_split(args: &EvalArgs, loaded: &Loaded) -> Result<TokenSplit> {
    let mut cfg = (loaded.config.clone())
        .context("an export carries no corpus: pass --config naming the data")?;
    // A run trained on a recall task is evaluated on it; --pairs and
    // --sequence-len reshape its examples as they do --task's.
    let reshaped = args.pairs.is_some() || args.sequence_len.is_some();
    let task = args.task.or(match cfg.data.kind {
        CorpusKind::Mqar if reshaped => Some(TaskArg::Mqar),
        CorpusKind::Passkey if reshaped => Some(TaskArg::Passkey),
        _ => None,
    });
    match task {
        Some(TaskArg::Mqar) => {
            let mut task = cfg.data.mqar_task();
            task.pairs = args.pairs.unwrap_or(task.pairs);
            task.queries = None;
            cfg.data.kind = CorpusKind::Mqar;
            cfg.data.tokenizer = None;
            cfg.data.mqar = Some(task);
            cfg.data.sequence_len = args.sequence_len.unwrap_or(cfg.data.sequence_len);
        }
        Some(TaskArg::Passkey) => {
            if args.pairs.is_some() {
                bail!("--pairs sets --task mqar's examples, not a passkey's");
            }
            cfg.data.kind = CorpusKind::Passkey;
            cfg.data.passkey.get_or_insert_with(Default::default);
            cfg.data.sequence_len = args.sequence_len.unwrap_or(cfg.data.sequence_len);
        }
        None if reshaped => {
            bail!(
                "--pairs and --sequence-len set a recall task's examples and the run's corpus is text: add --task mqar or --task passkey"
            )
        }
        None => {}
    }
    let corpus = Corpus::open(&cfg.data)?;
    if corpus.vocab.size() != loaded.model.vocab_size() {
        bail!(
            "the model has a vocabulary of {} tokens, the corpus's ({}) has {}: evaluate with the config of the data it was trained on",
            loaded.model.vocab_size(),
            corpus.vocab.id(),
            corpus.vocab.size()
        );
    }
    let split = corpus.split(match args.split {
        SplitArg::Validation => Split::Validation,
        SplitArg::Test => Split::Test,
    });
    Ok(split)
}

/// Accuracy of the answers recalled from the compressed cache, by how many
/// other pairs of their example took the same code, one line per codebook,
/// then one for the pairs on the same code in every codebook.
fn print_code_sharing(codebooks: &[CodeSharing], joint: &[SharingBucket]) {
    if codebooks.is_empty() {
        return;
    }
    println!(
        "answers from the compressed cache, by other pairs of the example on the pair's code \
         (accuracy of answers; mean keys on the code):"
    );
    let cells = |buckets: &[SharingBucket]| -> String {
        (buckets.iter())
            .map(|b| {
                let others = match (b.first, b.last) {
                    (0, _) => "alone".to_string(),
                    (f, l) if f == l => format!("{f} other"),
                    (f, l) => format!("{f}-{l} others"),
                };
                format!(
                    "{others} {:.1}% of {} ({:.1})",
                    100.0 * b.accuracy,
                    b.answers,
                    b.mean_code_load
                )
            })
            .collect::<Vec<_>>()
            .join(", ")
    };
    for c in codebooks {
        println!(
            "  sublayer {} head {}: {}",
            c.sublayer,
            c.head,
            cells(&c.buckets)
        );
    }
    println!(
        "  on the same code in every codebook (least loaded code): {}",
        cells(joint)
    );
}

/// Whether the figures come from a model whose queries weigh the cache's
/// counts by a learned weight (`model.count_weight`); in the paper's cache
/// it is 1 exactly.
fn learned_count_weight(sublayers: &[AttentionShare]) -> bool {
    sublayers.iter().any(|a| a.count_weight != 1.0)
}

/// The `--attention` tables: each sublayer's shares and entropy over the
/// split (and its mean count weight, when learned), then the shares (mean
/// over sublayers) by position.
fn print_attention(sublayers: &[AttentionShare], by_position: &[PositionBucket]) {
    let learned = learned_count_weight(sublayers);
    println!(
        "attention share: present / previous / cache, entropy (nats){}",
        if learned { ", count weight" } else { "" }
    );
    for (i, a) in sublayers.iter().enumerate() {
        let w = if learned {
            format!(", {:.3}", a.count_weight)
        } else {
            String::new()
        };
        println!(
            "  sublayer {i}: {:.3} / {:.3} / {:.3}, {:.2}{w}",
            a.share[0],
            a.share[1],
            a.share[2],
            a.entropy.iter().sum::<f64>()
        );
    }
    if by_position.is_empty() {
        return;
    }
    println!("by position (mean over sublayers):");
    for b in by_position {
        let n = b.attention.len().max(1) as f64;
        let mean = |f: &dyn Fn(&AttentionShare) -> f64| b.attention.iter().map(f).sum::<f64>() / n;
        println!(
            "  {:>7}-{:<7} {:.3} / {:.3} / {:.3}, {:.2}",
            b.first,
            b.last,
            mean(&|a| a.share[0]),
            mean(&|a| a.share[1]),
            mean(&|a| a.share[2]),
            mean(&|a| a.entropy.iter().sum()),
        );
    }
}
