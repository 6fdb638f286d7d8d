//! Sampling: the prompt read by [`super::prefill`], then one token at a
//! time with the recurrent form, constant work and memory per token.

use burn::prelude::*;
use tvq_data::hash::{SplitMix64, splitmix64};
use tvq_model::TransformerVq;

use super::prefill::{PREFILL_CHUNK, logits_vec, prefill_rows};
use crate::error::TrainError;
use crate::placement::B;

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

/// Reads `prompt` (after the end-of-document token `eos` that starts every
/// stream; [`prefill`](super::prefill::prefill)) and generates up to `max_tokens` with the recurrent
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
/// read once ([`prefill`](super::prefill::prefill)), its state copied to `n` rows, and each row
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
/// their streams): they are read together ([`prefill`](super::prefill::prefill) with a row each),
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
        let samples = sample_same_length(model, &texts, eos, n, opts, |row, t| {
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
fn sample_same_length(
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
        let (l, s) = model.decode(tokens, state)?;
        (logits, state) = (logits_vec(l), s);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inference::prefill::tests::{state_floats, tiny_model, worst};
    use tvq_model::RelativeBias;

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
