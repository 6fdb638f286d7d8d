//! Sampling with the recurrent form: constant work and memory per token.

use burn::prelude::*;
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

/// SplitMix64 stream: reproducible draws without a dependency.
struct Rng(u64);

impl Rng {
    fn uniform(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    }
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
    let mut rng = Rng(opts.seed);
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
