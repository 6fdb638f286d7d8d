//! Sampling with the recurrent form: constant work and memory per token.

use std::sync::Mutex;
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};

use burn::prelude::*;
use indicatif::ProgressBar;
use tvq_data::hash::{SplitMix64, splitmix64};
use tvq_model::{AttentionState, ModelError, ModelState, TransformerVq};

use crate::error::TrainError;
use crate::parallel::workers::{CREWS, lock};
use crate::placement::B;
use crate::progress::progress_bar;

/// How to draw tokens.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SampleOptions {
    /// Tokens to generate.
    pub max_tokens: usize,
    /// Softmax temperature (0: greedy).
    pub temperature: f64,
    /// Nucleus: sample among the most likely tokens holding this much probability.
    pub top_p: f64,
    /// Seed of the draws.
    pub seed: u64,
    /// Show a progress bar (on a terminal) while reading a prompt longer
    /// than one prefill chunk.
    pub progress: bool,
}

/// Draws a token from `logits` with temperature and nucleus sampling: the
/// most likely tokens (ties: the lower id first) up to probability `top_p`,
/// renormalised, and `u` in `[0, 1)` picks among them in that order.
pub fn draw(logits: &[f32], temperature: f64, top_p: f64, u: f64) -> u32 {
    if temperature <= 0.0 {
        return (0..logits.len())
            .max_by(|&a, &b| logits[a].total_cmp(&logits[b]))
            .unwrap_or(0) as u32;
    }
    let mut probs = softmax_weights(logits, temperature);
    let total: f64 = probs.iter().map(|p| p.1).sum();
    let nucleus = most_likely_first(&mut probs, top_p * total);
    let mass: f64 = nucleus.iter().map(|p| p.1).sum();
    let mut target = u * mass;
    for &(i, p) in nucleus {
        target -= p;
        if target <= 0.0 {
            return i as u32;
        }
    }
    nucleus[nucleus.len() - 1].0 as u32
}

/// `(id, exp((logit - max) / temperature))` for every token: the softmax's
/// unnormalised weights.
fn softmax_weights(logits: &[f32], temperature: f64) -> Vec<(usize, f64)> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    logits
        .iter()
        .enumerate()
        .map(|(i, &l)| (i, ((l as f64 - max) / temperature).exp()))
        .collect()
}

/// The shortest run of the most likely `(id, weight)` pairs whose weights
/// reach `mass`, in order (weight descending, then id), with `probs`
/// reordered to start with it. A trained model's nucleus is usually a few
/// tokens: the 64 most likely are selected in linear time and only they
/// are sorted; everything is sorted only when they do not hold the mass.
fn most_likely_first(probs: &mut [(usize, f64)], mass: f64) -> &[(usize, f64)] {
    const FEW: usize = 64;
    let order = |a: &(usize, f64), b: &(usize, f64)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    let in_few = if probs.len() > FEW {
        probs.select_nth_unstable_by(FEW, order);
        probs[..FEW].sort_unstable_by(order);
        prefix_holding(&probs[..FEW], mass)
    } else {
        None
    };
    let cut = in_few.unwrap_or_else(|| {
        probs.sort_unstable_by(order);
        prefix_holding(probs, mass).unwrap_or(probs.len())
    });
    &probs[..cut]
}

/// The length of the shortest prefix of `sorted` whose weights reach `mass`.
fn prefix_holding(sorted: &[(usize, f64)], mass: f64) -> Option<usize> {
    let mut kept = 0.0;
    sorted
        .iter()
        .position(|p| {
            kept += p.1;
            kept >= mass
        })
        .map(|j| j + 1)
}

/// Most tokens the block form reads at once while prefilling (a multiple
/// of the block length is taken): bounds the memory of a long prompt, and
/// gives the pipeline of [`prefill`] chunks to overlap. As fast per token
/// as 2,048 on one thread (docs/benchmarks.md).
pub const PREFILL_CHUNK: usize = 512;

fn logits_vec(logits: Tensor<B, 3>) -> Vec<f32> {
    logits
        .into_data()
        .convert::<f32>()
        .to_vec()
        .expect("f32 logits")
}

/// Reads the stream `eos, prompt...` from a fresh state and returns the
/// logits of the token after it, `[vocab]`, and the state. Whole blocks go
/// through the block-parallel form (chunks of up to [`PREFILL_CHUNK`]
/// tokens; on the CPU, a pipeline of threads over the sublayers), the
/// remaining `< L` tokens through the recurrent form, so the result equals
/// feeding every token to the recurrent form, at the block form's speed.
pub fn prefill(
    model: &TransformerVq<B>,
    eos: u32,
    prompt: &[u32],
) -> Result<(Vec<f32>, ModelState<B>), TrainError> {
    prefill_rows(model, eos, &[prompt], PREFILL_CHUNK, false)
}

/// [`prefill`] of several prompts of the same length, one batch row each,
/// in chunks of up to `chunk` tokens: the logits `[rows * vocab]` and the
/// state of the rows. With `progress`, a bar counts the tokens read when
/// there is more than one chunk.
fn prefill_rows(
    model: &TransformerVq<B>,
    eos: u32,
    prompts: &[&[u32]],
    chunk: usize,
    progress: bool,
) -> Result<(Vec<f32>, ModelState<B>), TrainError> {
    let device = model.embedding.weight.device();
    let rows = prompts.len();
    let len = 1 + prompts[0].len();
    assert!(prompts.iter().all(|p| 1 + p.len() == len), "one length");
    // Position `i` of every row's stream `eos, prompt...`.
    let column = |i: usize| {
        prompts
            .iter()
            .map(move |p| if i == 0 { eos } else { p[i - 1] })
    };
    let l = model.block_len();
    let whole = len / l * l;
    let span = (chunk / l).max(1) * l;
    let chunks = (0..whole).step_by(span).map(|start| {
        let n = span.min(whole - start);
        let mut ids = vec![0i64; rows * n]; // [rows, n], row-major
        for i in 0..n {
            for (r, t) in column(start + i).enumerate() {
                ids[r * n + i] = t as i64;
            }
        }
        Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [rows, n]), &device)
    });
    let bar = progress_bar(
        progress && whole > span,
        whole as u64,
        "prompt [{bar:30}] {pos}/{len} tokens eta {eta}",
    );
    let stages = pipeline_stages(model, whole.div_ceil(span));
    let (h, mut state) = read_blocks(model, chunks, model.empty_state(), stages, &bar)?;
    bar.finish_and_clear();
    let mut logits = h.map(|h| model.head_last(h)); // [rows, 1, vocab]
    for i in whole..len {
        let ids: Vec<i64> = column(i).map(|t| t as i64).collect();
        let tokens = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [rows, 1]), &device);
        let (next, s) = model.step(tokens, state)?;
        (logits, state) = (Some(next), s);
    }
    let logits = logits.expect("the stream holds at least the end-of-document token");
    Ok((logits_vec(logits), state))
}

/// How many threads read a prompt of `chunks` chunks: on the CPU one per
/// core, up to one per sublayer, since the CPU backend runs elementwise
/// work on the calling thread only (one pass keeps about 1.1 cores busy);
/// a GPU gets one, its kernels already run in parallel.
fn pipeline_stages(model: &TransformerVq<B>, chunks: usize) -> usize {
    if chunks < 2
        || !matches!(
            model.embedding.weight.device(),
            burn::DispatchDevice::Flex(_)
        )
    {
        return 1;
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    cores.min(model.sublayers.len())
}

/// Reads `chunks` (`[rows, n]` tokens, `n` a multiple of `L`) with the block
/// form from `state`: the final hidden states of the last chunk `[rows, n,
/// D]` (none without chunks) and the state after it. With `stages > 1` the
/// sublayers are cut into that many consecutive groups, each on a thread of
/// a worker crew (`parallel::workers`) that owns their states, and a chunk
/// passes from group to group, so that while group 2 reads chunk 1, group 1
/// reads chunk 2. Every group
/// computes what it would in one pass, in the same order: the result is
/// the one-thread result, bit for bit.
fn read_blocks(
    model: &TransformerVq<B>,
    chunks: impl Iterator<Item = Tensor<B, 2, Int>>,
    state: ModelState<B>,
    stages: usize,
    bar: &ProgressBar,
) -> Result<(Option<Tensor<B, 3>>, ModelState<B>), TrainError> {
    let n = model.sublayers.len();
    let stages = stages.clamp(1, n);
    if stages == 1 {
        let (mut last, mut state) = (None, state);
        for tokens in chunks {
            let len = tokens.dims()[1] as u64;
            let (h, s) = model.forward_sublayers(0..n, model.embed(tokens)?, state.sublayers)?;
            (last, state) = (Some(h), ModelState { sublayers: s });
            bar.inc(len);
        }
        return Ok((last, state));
    }
    // Each group's sublayers, their states and its two ends, taken by the
    // crew thread that runs it. Bounded channels: at most one chunk waits
    // between two groups.
    let mut states = state.sublayers.into_iter();
    let (feed, mut input) = sync_channel::<Tensor<B, 3>>(1);
    let mut stage_parts = Vec::with_capacity(stages);
    for g in 0..stages {
        let range = g * n / stages..(g + 1) * n / stages;
        let own: Vec<_> = states.by_ref().take(range.len()).collect();
        // The last group keeps its output; the others pass it on.
        let (output, next) = if g + 1 < stages {
            let (tx, rx) = sync_channel(1);
            (Some(tx), rx)
        } else {
            (None, sync_channel(0).1)
        };
        let input = std::mem::replace(&mut input, next);
        stage_parts.push(Mutex::new(Some((range, own, input, output))));
    }
    // The groups run on a crew, so each computes its own matrix products
    // (parallel::workers); this thread feeds them meanwhile. The crew is
    // lent to this thread, which keeps the states the groups end with.
    let crew = CREWS.lease(stages);
    std::thread::scope(|scope| {
        let stages_done = scope.spawn(|| {
            crew.run(|g| {
                let (range, own, input, output) =
                    lock(&stage_parts[g]).take().expect("each group runs once");
                read_stage(model, range, own, input, output)
            })
        });
        let mut fed = Ok(());
        for tokens in chunks {
            let len = tokens.dims()[1] as u64;
            match model.embed(tokens) {
                // A failed send means a group failed: its error is reported.
                Ok(h) => match feed.send(h) {
                    Ok(()) => bar.inc(len),
                    Err(_) => break,
                },
                Err(e) => {
                    fed = Err(e);
                    break;
                }
            }
        }
        drop(feed);
        let ends = stages_done
            .join()
            .unwrap_or_else(|e| std::panic::resume_unwind(e));
        let mut last = None;
        let mut sublayers = Vec::with_capacity(n);
        for end in ends {
            let (h, own) = end?;
            (last, sublayers) = (h.or(last), [sublayers, own].concat());
        }
        fed?;
        Ok((last, ModelState { sublayers }))
    })
}

/// What a pipeline stage ends with: the last chunk's hidden states `[rows,
/// n, D]` (the last stage only) and its sublayers' states.
type StageEnd = (Option<Tensor<B, 3>>, Vec<AttentionState<B>>);

/// One pipeline stage of [`read_blocks`]: sublayers `range` from their
/// states `own` over every chunk's hidden states from `input`, each passed
/// on to `output` (or the last one kept, for the last stage).
fn read_stage(
    model: &TransformerVq<B>,
    range: std::ops::Range<usize>,
    mut own: Vec<AttentionState<B>>,
    input: Receiver<Tensor<B, 3>>,
    output: Option<SyncSender<Tensor<B, 3>>>,
) -> Result<StageEnd, ModelError> {
    let mut last = None;
    for h in input {
        let (h, s) = model.forward_sublayers(range.clone(), h, own)?;
        own = s;
        match &output {
            // A later group that failed hung up: its error is reported.
            Some(tx) => {
                if tx.send(h).is_err() {
                    break;
                }
            }
            None => last = Some(h),
        }
    }
    Ok((last, own))
}

/// Reads `prompt` (after the end-of-document token `eos` that starts every
/// stream; [`prefill`]) and generates up to `max_tokens` with the recurrent
/// form, calling `emit` with each new token; stops early when `emit`
/// returns `false`. The same as [`sample_many`] with one sample.
pub fn sample(
    model: &TransformerVq<B>,
    prompt: &[u32],
    eos: u32,
    opts: SampleOptions,
    mut emit: impl FnMut(u32) -> bool,
) -> Result<Vec<u32>, TrainError> {
    let mut out = sample_many(model, prompt, eos, 1, opts, |_, t| emit(t))?;
    Ok(out.pop().expect("one sample"))
}

/// The draws of sample `i` of a seed: sample 0 uses the seed's own stream,
/// so one sample is the same alone or first of many.
fn sample_rng(seed: u64, i: usize) -> SplitMix64 {
    match i {
        0 => SplitMix64(seed),
        _ => SplitMix64(splitmix64(seed) ^ splitmix64(i as u64)),
    }
}

/// `n` continuations of one prompt, generated as one batch: the prompt is
/// read once ([`prefill`]), its state copied to `n` rows, and each row
/// draws from its own seeded stream, so sample `i` is the same text
/// whatever `n` is. `emit(i, token)` gets each new token of sample `i`;
/// a sample ends when `emit` returns `false` or after `max_tokens`, and
/// generation stops when every sample has ended.
pub fn sample_many(
    model: &TransformerVq<B>,
    prompt: &[u32],
    eos: u32,
    n: usize,
    opts: SampleOptions,
    mut emit: impl FnMut(usize, u32) -> bool,
) -> Result<Vec<Vec<u32>>, TrainError> {
    let mut out = sample_prompts(model, &[prompt.to_vec()], eos, n, opts, |_, i, t| {
        emit(i, t)
    })?;
    Ok(out.pop().expect("one prompt"))
}

/// `n` continuations of each of `prompts`: `[prompt][sample]` tokens.
/// Prompts of one length share a batch (its rows stand at one position of
/// their streams): they are read together ([`prefill`] with a row each),
/// their states copied `n` times, and every row draws from its own stream;
/// groups of different lengths run one after another. Sample `i` of a
/// prompt draws from stream `i` of the seed, so it is the same text as
/// [`sample_many`] of that prompt alone, whatever the other prompts and
/// `n`. `emit(p, i, token)` gets each new token of sample `i` of prompt
/// `p`; a sample ends when `emit` returns `false` or after `max_tokens`.
pub fn sample_prompts(
    model: &TransformerVq<B>,
    prompts: &[Vec<u32>],
    eos: u32,
    n: usize,
    opts: SampleOptions,
    mut emit: impl FnMut(usize, usize, u32) -> bool,
) -> Result<Vec<Vec<Vec<u32>>>, TrainError> {
    let mut out = vec![vec![]; prompts.len()];
    let mut lengths: Vec<usize> = prompts.iter().map(Vec::len).collect();
    lengths.sort_unstable();
    lengths.dedup();
    for len in lengths {
        let group: Vec<usize> = (0..prompts.len())
            .filter(|&p| prompts[p].len() == len)
            .collect();
        let texts: Vec<&[u32]> = group.iter().map(|&p| prompts[p].as_slice()).collect();
        let samples = sample_group(model, &texts, eos, n, opts, |row, t| {
            emit(group[row % group.len()], row / group.len(), t)
        })?;
        for (row, tokens) in samples.into_iter().enumerate() {
            out[group[row % group.len()]].push(tokens);
        }
    }
    Ok(out)
}

/// Generation for prompts of one length, `n` samples each, one batch:
/// row `r` is sample `r / g` of prompt `r % g` (`g` prompts; the state is
/// tiled). Returns each row's tokens; `emit(row, token)`.
fn sample_group(
    model: &TransformerVq<B>,
    prompts: &[&[u32]],
    eos: u32,
    n: usize,
    opts: SampleOptions,
    mut emit: impl FnMut(usize, u32) -> bool,
) -> Result<Vec<Vec<u32>>, TrainError> {
    let device = model.embedding.weight.device();
    let g = prompts.len();
    let rows = g * n;
    let (first, state) = prefill_rows(model, eos, prompts, PREFILL_CHUNK, opts.progress)?;
    let vocab = first.len() / g;
    let mut state = state.repeat_rows(n);
    let mut logits = first.repeat(n); // [rows * vocab]
    let mut rngs: Vec<SplitMix64> = (0..rows).map(|r| sample_rng(opts.seed, r / g)).collect();
    // Grown as tokens come: a sample may end long before `max_tokens`.
    let mut out = vec![Vec::with_capacity(opts.max_tokens.min(1 << 16)); rows];
    let mut open = vec![true; rows];
    for _ in 0..opts.max_tokens {
        let mut next = vec![eos as i64; rows];
        for r in 0..rows {
            if !open[r] {
                continue;
            }
            let row = &logits[r * vocab..(r + 1) * vocab];
            let t = draw(row, opts.temperature, opts.top_p, rngs[r].uniform());
            out[r].push(t);
            open[r] = emit(r, t);
            next[r] = t as i64;
        }
        if !open.iter().any(|&o| o) {
            break;
        }
        // Ended rows keep running (their tokens are ignored): the batch's
        // rows share one position in the stream.
        let tokens = Tensor::<B, 2, Int>::from_data(TensorData::new(next, [rows, 1]), &device);
        let (l, s) = model.step(tokens, state)?;
        (logits, state) = (logits_vec(l), s);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::placement::device::DeviceSpec;
    use tvq_model::RelativeBias;

    fn one_token(t: u32, device: &burn::DispatchDevice) -> Tensor<B, 2, Int> {
        Tensor::from_data(TensorData::new(vec![t as i64], [1, 1]), device)
    }

    /// The stream `eos, prompt...` token by token: the recurrent form alone.
    fn token_by_token(
        model: &TransformerVq<B>,
        eos: u32,
        prompt: &[u32],
    ) -> (Vec<f32>, ModelState<B>) {
        let device = model.embedding.weight.device();
        let mut state = model.empty_state();
        let mut logits = vec![];
        for &t in std::iter::once(&eos).chain(prompt) {
            let (l, s) = model.step(one_token(t, &device), state).unwrap();
            (logits, state) = (logits_vec(l), s);
        }
        (logits, state)
    }

    fn worst(a: &[f32], b: &[f32]) -> f32 {
        assert_eq!(a.len(), b.len());
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max)
    }

    fn floats<const D: usize>(t: &Tensor<B, D>) -> Vec<f32> {
        t.to_data().convert::<f32>().to_vec().unwrap()
    }

    /// The tiny model with 13 tokens and 2 layers (4 sublayers), drawn
    /// from `seed`.
    fn tiny_model(bias: RelativeBias, seed: u64) -> TransformerVq<B> {
        let device = DeviceSpec::Cpu.init().unwrap().0;
        let cfg = tvq_testkit::tiny_model(13).with_n_layer(2).with_bias(bias);
        crate::placement::seeded_draw(&device, Some(seed), || cfg.init::<B>(&device)).unwrap()
    }

    /// Draws from the whole softmax at temperature 1.
    fn plain_draws(max_tokens: usize, seed: u64) -> SampleOptions {
        SampleOptions {
            max_tokens,
            temperature: 1.0,
            top_p: 1.0,
            seed,
            progress: false,
        }
    }

    #[test]
    fn a_sample_is_the_same_text_whatever_the_batch_size() {
        let model = tiny_model(RelativeBias::Toeplitz, 4);
        let opts = plain_draws(11, 9);
        let prompt = [3, 4, 5, 6, 7, 8];
        let many = sample_many(&model, &prompt, 1, 4, opts, |_, _| true).unwrap();
        assert_eq!(many[0], sample(&model, &prompt, 1, opts, |_| true).unwrap());
        let two = sample_many(&model, &prompt, 1, 2, opts, |_, _| true).unwrap();
        assert_eq!(two[..], many[..2]);
        assert!(many.iter().all(|s| s.len() == 11));
        assert_ne!(many[0], many[1], "each sample draws from its own stream");
        // A sample that ends early does not change the others.
        let stopped = sample_many(&model, &prompt, 1, 4, opts, |i, _| i != 2).unwrap();
        assert_eq!(stopped[2], many[2][..1]);
        assert_eq!(stopped[3], many[3]);
    }

    #[test]
    fn prompts_of_different_lengths_sample_as_each_would_alone() {
        let model = tiny_model(RelativeBias::Xl, 6);
        let opts = plain_draws(9, 5);
        // Lengths 6, 0, 11 (two blocks and more) and 6 again: two of them
        // share a batch.
        let prompts = [
            vec![3, 4, 5, 6, 7, 8],
            vec![],
            vec![2, 9, 9, 4, 11, 12, 3, 3, 5, 6, 7],
            vec![8, 7, 6, 5, 4, 3],
        ];
        let mut emitted = vec![vec![vec![]; 2]; prompts.len()];
        let all = sample_prompts(&model, &prompts, 1, 2, opts, |p, i, t| {
            emitted[p][i].push(t);
            true
        })
        .unwrap();
        assert_eq!(
            all, emitted,
            "every token is emitted to its prompt and sample"
        );
        for (p, prompt) in prompts.iter().enumerate() {
            let alone = sample_many(&model, prompt, 1, 2, opts, |_, _| true).unwrap();
            assert_eq!(all[p], alone, "prompt {p}");
        }
        assert_ne!(
            all[0], all[3],
            "prompts sharing a batch keep their own state"
        );
        // A sample that stops early leaves the others as they were.
        let stopped = sample_prompts(&model, &prompts, 1, 2, opts, |p, _, _| p != 3).unwrap();
        assert_eq!(stopped[3][1], all[3][1][..1]);
        assert_eq!(stopped[0], all[0]);
    }

    #[test]
    fn prefill_in_blocks_equals_the_recurrent_form() {
        for bias in [RelativeBias::Toeplitz, RelativeBias::Xl] {
            let l = 4;
            let model = tiny_model(bias, 3);
            let text: Vec<u32> = (0..40).map(|i| (i * 5 + 2) % 13).collect();
            // Streams (eos + prompt) shorter than, equal to and longer than
            // a block, and not a multiple of it.
            for n in [0, l - 2, l - 1, l, 2 * l + 1, 3 * l - 1, 9 * l + 2] {
                let prompt = &text[..n];
                // Chunks of two blocks: the state also carries between chunks.
                let (fast, fast_state) = prefill_rows(&model, 1, &[prompt], 2 * l, false).unwrap();
                let one_chunk = prefill(&model, 1, prompt).unwrap().0;
                assert!(
                    worst(&one_chunk, &fast) <= 1e-5,
                    "{bias:?}, prompt of {n}: chunking"
                );
                let (slow, slow_state) = token_by_token(&model, 1, prompt);
                let what = format!("{bias:?}, prompt of {n}");
                assert!(
                    worst(&fast, &slow) <= 1e-5,
                    "{what}: logits differ by {}",
                    worst(&fast, &slow)
                );
                for (a, b) in fast_state.sublayers.iter().zip(&slow_state.sublayers) {
                    assert_eq!(a.pos, n + 1, "{what}");
                    assert_eq!(a.pos, b.pos, "{what}");
                    let (pa, pb) = (a.prev.as_ref(), b.prev.as_ref());
                    assert_eq!(pa.is_some(), pb.is_some(), "{what}");
                    if let (Some(pa), Some(pb)) = (pa, pb) {
                        assert!(
                            worst(&floats(&pa.v), &floats(&pb.v)) <= 1e-5,
                            "{what}: previous block"
                        );
                    }
                    let (ca, cb) = (a.cache.as_ref().unwrap(), b.cache.as_ref().unwrap());
                    assert_eq!(
                        floats(&ca.counts),
                        floats(&cb.counts),
                        "{what}: cache counts"
                    );
                    assert!(
                        worst(&floats(&ca.means), &floats(&cb.means)) <= 1e-5,
                        "{what}: cache means"
                    );
                }
            }
        }
    }

    /// The block-form prefill and sampling with a fixed seed compute on the
    /// GPU what they compute on the CPU: the logits after a prompt of two
    /// prefill chunks and a partial block, and the state's numbers, within
    /// 1e-4 (f32 rounding, summed in another order by other kernels, over
    /// four sublayers: the CPU's own block and recurrent forms agree to
    /// 1e-5 above), and the same sampled text (a draw changes only where
    /// rounding moves a cumulative probability across its uniform).
    #[test]
    fn prefill_and_sampling_on_the_gpu_equal_the_cpu() {
        let Some(gpu) =
            crate::gpu_under_test::gpu_under_test("prefill_and_sampling_on_the_gpu_equal_the_cpu")
        else {
            return;
        };
        let on_cpu = tiny_model(RelativeBias::Toeplitz, 12);
        let on_gpu = crate::placement::fork_onto(&on_cpu, &gpu);
        let prompt: Vec<u32> = (0..37).map(|i| (i * 3 + 1) % 13).collect();
        let read = |m| prefill_rows(m, 1, &[&prompt], 16, false).unwrap();
        let ((l_cpu, s_cpu), (l_gpu, s_gpu)) = (read(&on_cpu), read(&on_gpu));
        assert!(worst(&l_cpu, &l_gpu) <= 1e-4, "{}", worst(&l_cpu, &l_gpu));
        let (s_cpu, s_gpu) = (state_floats(&s_cpu), state_floats(&s_gpu));
        assert_eq!(s_cpu.len(), s_gpu.len());
        for (c, g) in s_cpu.iter().zip(&s_gpu) {
            assert!(worst(c, g) <= 1e-4, "state differs by {}", worst(c, g));
        }
        let opts = plain_draws(24, 3);
        let draw = |m| sample_many(m, &prompt, 1, 2, opts, |_, _| true).unwrap();
        assert_eq!(draw(&on_cpu), draw(&on_gpu));
    }

    /// Every number a state holds, sublayer by sublayer.
    fn state_floats(state: &ModelState<B>) -> Vec<Vec<f32>> {
        let mut out = vec![];
        for s in &state.sublayers {
            out.push(vec![s.pos as f32]);
            if let Some(p) = &s.prev {
                out.extend([
                    floats(&p.k_hat),
                    floats(&p.v),
                    floats(&p.codes.clone().float()),
                ]);
            }
            if let Some(c) = &s.cache {
                out.extend([floats(&c.counts), floats(&c.means)]);
            }
        }
        out
    }

    #[test]
    fn reading_on_a_pipeline_of_threads_is_the_one_thread_result_bit_for_bit() {
        let model = tiny_model(RelativeBias::Toeplitz, 8); // 4 sublayers
        let device = model.embedding.weight.device();
        let l = model.block_len();
        let chunk = |c: usize, len: usize| {
            let ids = (0..2 * len)
                .map(|i| ((i * 7 + c * 3) % 13) as i64)
                .collect();
            Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [2, len]), &device)
        };
        // Seven chunks of one to three blocks, two rows.
        let chunks = || (0..7).map(|c| chunk(c, (1 + c % 3) * l));
        let bar = ProgressBar::hidden();
        let read = |stages| read_blocks(&model, chunks(), model.empty_state(), stages, &bar);
        let (h, state) = read(1).unwrap();
        let (h, state) = (floats(&h.unwrap()), state_floats(&state));
        for stages in 2..=4 {
            let (h2, state2) = read(stages).unwrap();
            // (Not assert_eq: a failure would print every number.)
            assert!(floats(&h2.unwrap()) == h, "{stages} stages: hidden states");
            assert!(state_floats(&state2) == state, "{stages} stages: state");
        }
        // A chunk that is not whole blocks fails in the first group: an
        // error comes back, nothing hangs.
        let bad = (0..5).map(|c| chunk(c, if c == 2 { l + 1 } else { l }));
        for stages in [1, 2, 4] {
            let err = read_blocks(&model, bad.clone(), model.empty_state(), stages, &bar);
            assert!(
                matches!(
                    err,
                    Err(TrainError::Model(ModelError::SegmentNotBlockAligned { .. }))
                ),
                "{stages} stages: {err:?}"
            );
        }
    }

    /// How often each token is drawn over `n` evenly spaced uniforms.
    fn frequencies(logits: &[f32], temperature: f64, top_p: f64, n: usize) -> Vec<f64> {
        let mut counts = vec![0usize; logits.len()];
        for i in 0..n {
            let u = (i as f64 + 0.5) / n as f64;
            counts[draw(logits, temperature, top_p, u) as usize] += 1;
        }
        counts.iter().map(|&c| c as f64 / n as f64).collect()
    }

    #[test]
    fn temperature_zero_is_greedy() {
        assert_eq!(draw(&[0.1, 2.0, -1.0, 1.9], 0.0, 0.9, 0.99), 1);
    }

    #[test]
    fn draws_follow_the_softmax_at_temperature_one() {
        let logits = [0.0f32, 1.0, 2.0];
        let z: f64 = logits.iter().map(|&l| (l as f64).exp()).sum();
        let f = frequencies(&logits, 1.0, 1.0, 10_000);
        for (i, &l) in logits.iter().enumerate() {
            let p = (l as f64).exp() / z;
            assert!((f[i] - p).abs() < 1e-3, "token {i}: {} vs {p}", f[i]);
        }
        // A higher temperature flattens the distribution.
        let hot = frequencies(&logits, 4.0, 1.0, 10_000);
        assert!(hot[0] > f[0] && hot[2] < f[2]);
    }

    /// `draw` as the definition reads: every token sorted, the nucleus cut
    /// from the sorted list (the same weights: what is checked is the cut).
    fn draw_by_full_sort(logits: &[f32], temperature: f64, top_p: f64, u: f64) -> u32 {
        let mut probs = softmax_weights(logits, temperature);
        let total: f64 = probs.iter().map(|p| p.1).sum();
        probs.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        let (mut kept, mut cut) = (0.0, probs.len());
        for (n, p) in probs.iter().enumerate() {
            kept += p.1;
            if kept >= top_p * total {
                cut = n + 1;
                break;
            }
        }
        let mut target = u * probs[..cut].iter().map(|p| p.1).sum::<f64>();
        for &(i, p) in &probs[..cut] {
            target -= p;
            if target <= 0.0 {
                return i as u32;
            }
        }
        probs[cut - 1].0 as u32
    }

    #[test]
    fn the_nucleus_without_a_full_sort_draws_what_a_full_sort_does() {
        let mut rng = SplitMix64(5);
        for vocab in [3, 64, 65, 1000, 5000] {
            // Peaked and flat distributions, with ties (rounded logits).
            for spread in [0.5, 4.0, 12.0] {
                let logits: Vec<f32> = (0..vocab)
                    .map(|_| ((rng.uniform() * spread) * 4.0).round() as f32 / 4.0)
                    .collect();
                for (temperature, top_p) in [(1.0, 0.9), (0.7, 0.5), (1.0, 1.0), (2.0, 0.99)] {
                    for _ in 0..20 {
                        let u = rng.uniform();
                        assert_eq!(
                            draw(&logits, temperature, top_p, u),
                            draw_by_full_sort(&logits, temperature, top_p, u),
                            "vocab {vocab}, spread {spread}, t {temperature}, p {top_p}, u {u}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn the_nucleus_keeps_only_the_most_likely_tokens() {
        // Probabilities about 0.665, 0.245, 0.090: top_p 0.5 keeps one
        // token, 0.8 keeps two (renormalised), 1.0 all three.
        let logits = [2.0f32, 1.0, 0.0];
        assert_eq!(frequencies(&logits, 1.0, 0.5, 1000), [1.0, 0.0, 0.0]);
        let two = frequencies(&logits, 1.0, 0.8, 10_000);
        assert_eq!(two[2], 0.0);
        let e = std::f64::consts::E;
        assert!((two[0] - e / (e + 1.0)).abs() < 1e-3, "{two:?}");
        assert!(frequencies(&logits, 1.0, 1.0, 1000)[2] > 0.0);
    }
}
