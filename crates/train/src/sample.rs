//! Sampling with the recurrent form: constant work and memory per token.

use burn::prelude::*;
use tvq_data::hash::SplitMix64;
use tvq_model::TransformerVq;

use crate::error::TrainError;
use crate::optim::B;

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
}

/// Draws a token from `logits` with temperature and nucleus sampling.
pub fn draw(logits: &[f32], temperature: f64, top_p: f64, u: f64) -> u32 {
    if temperature <= 0.0 {
        return (0..logits.len())
            .max_by(|&a, &b| logits[a].total_cmp(&logits[b]))
            .unwrap_or(0) as u32;
    }
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let mut probs: Vec<(usize, f64)> = logits
        .iter()
        .enumerate()
        .map(|(i, &l)| (i, ((l as f64 - max) / temperature).exp()))
        .collect();
    let total: f64 = probs.iter().map(|p| p.1).sum();
    probs.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    let mut kept = 0.0;
    let mut cut = probs.len();
    for (n, p) in probs.iter().enumerate() {
        kept += p.1 / total;
        if kept >= top_p {
            cut = n + 1;
            break;
        }
    }
    let mass: f64 = probs[..cut].iter().map(|p| p.1).sum();
    let mut target = u * mass;
    for &(i, p) in &probs[..cut] {
        target -= p;
        if target <= 0.0 {
            return i as u32;
        }
    }
    probs[cut - 1].0 as u32
}

/// Feeds `prompt` (after the end-of-document token `eos` that starts every
/// stream) and generates up to `max_tokens`, calling `emit` with each new
/// token; stops early when `emit` returns `false`.
pub fn sample(
    model: &TransformerVq<B>,
    prompt: &[u32],
    eos: u32,
    opts: SampleOptions,
    mut emit: impl FnMut(u32) -> bool,
) -> Result<Vec<u32>, TrainError> {
    let device = model.embedding.weight.device();
    let token =
        |t: u32| Tensor::<B, 2, Int>::from_data(TensorData::new(vec![t as i64], [1, 1]), &device);
    let mut state = model.empty_state();
    let mut logits = None;
    for &t in std::iter::once(&eos).chain(prompt) {
        let (l, s) = model.step(token(t), state)?;
        state = s;
        logits = Some(l);
    }
    let mut rng = SplitMix64(opts.seed);
    let mut out = Vec::with_capacity(opts.max_tokens);
    for _ in 0..opts.max_tokens {
        let l: Vec<f32> = logits
            .take()
            .expect("at least one step")
            .into_data()
            .convert::<f32>()
            .to_vec()
            .unwrap_or_default();
        let next = draw(&l, opts.temperature, opts.top_p, rng.uniform());
        out.push(next);
        if !emit(next) {
            break;
        }
        let (l, s) = model.step(token(next), state)?;
        state = s;
        logits = Some(l);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::draw;

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
