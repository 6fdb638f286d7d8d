//! The small two-layer network the whole-network tests build, and the
//! ways they read it: block form, token by token, positions.

use burn::prelude::*;
use tvq_model::position::PositionTerm;
use tvq_model::{ModelState, Pass, RelativeBias, TransformerVq, TransformerVqConfig};

use crate::common::*;

/// The network of the tests: 37 symbols, 6 codes, two layers.
pub fn config(bias: RelativeBias) -> TransformerVqConfig {
    tvq_testkit::tiny_model(37)
        .with_n_code(6)
        .with_n_layer(2)
        .with_bias(bias)
        // Used by the rotary form only: the position channel is part of
        // what its tests check.
        .with_rotary_channel(Some(4))
}

/// The network of `cfg` drawn under `seed`, its biases random too. The
/// backend's generator is shared by the whole process, so two calls with one
/// seed give the same network only where no other thread draws meanwhile
/// (the tests in `tests/seeded.rs`, which run alone).
pub fn model(
    cfg: &TransformerVqConfig,
    seed: u64,
    device: &burn::DispatchDevice,
) -> TransformerVq<B> {
    B::seed(device, seed);
    let m = cfg.init::<B>(device).unwrap();
    randomize_biases(m, device)
}

/// Biases start at zero; give them values so the tests see them.
fn randomize_biases(mut m: TransformerVq<B>, device: &burn::DispatchDevice) -> TransformerVq<B> {
    use burn::module::Param;
    for gau in m.sublayers.iter_mut() {
        match &mut gau.bias {
            PositionTerm::toeplitz(t) => *t = Param::from_tensor(randn(t.dims(), device)),
            PositionTerm::xl(xl) => {
                xl.u = Param::from_tensor(randn(xl.u.dims(), device));
                xl.w = Param::from_tensor(randn(xl.w.dims(), device));
            }
            PositionTerm::rotary(_) => {}
        }
    }
    m
}

/// `b * t` tokens below `vocab`, row-major.
pub fn random_tokens(b: usize, t: usize, vocab: usize, seed: u64) -> Vec<i64> {
    // A small LCG keeps the data independent of the backend's RNG.
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..b * t)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 33) % vocab as u64) as i64
        })
        .collect()
}

pub fn tokens(data: &[i64], b: usize, device: &burn::DispatchDevice) -> Tensor<B, 2, Int> {
    Tensor::from_data(TensorData::new(data.to_vec(), [b, data.len() / b]), device)
}

/// The logits of `m` on `data` (`b` rows) from an empty state, `[b, T, vocab]`.
pub fn logits_of(
    m: &TransformerVq<B>,
    data: &[i64],
    b: usize,
    device: &burn::DispatchDevice,
) -> Tensor<B, 3> {
    m.forward(tokens(data, b, device), m.empty_state(), Pass::new())
        .unwrap()
        .logits
        .unwrap()
}

/// The logits of `m` on `data` (`b` rows) read token by token with the
/// recurrent form from an empty state, `[b, T, vocab]`, and the state after.
pub fn decoded_logits(
    m: &TransformerVq<B>,
    data: &[i64],
    b: usize,
    device: &burn::DispatchDevice,
) -> (Tensor<B, 3>, ModelState<B>) {
    let t = data.len() / b;
    let mut state = m.empty_state();
    let mut steps = vec![];
    for i in 0..t {
        let col: Vec<i64> = (0..b).map(|r| data[r * t + i]).collect();
        let (logits, s) = m.decode(tokens(&col, b, device), state).unwrap();
        steps.push(logits);
        state = s;
    }
    (Tensor::cat(steps, 1), state)
}

/// Positions `r` of logits `[B, T, vocab]`.
pub fn at(x: Tensor<B, 3>, r: std::ops::Range<usize>) -> Tensor<B, 3> {
    let [b, _, v] = x.dims();
    x.slice([0..b, r, 0..v])
}
