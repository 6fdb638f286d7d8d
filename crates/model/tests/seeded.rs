//! Tests that need the backend's random generator to themselves.
//!
//! Flex keeps one generator for the whole process, so two networks built
//! under one seed are equal only when no other thread draws between the
//! seeding and the last draw. In the `model` binary, tests run in parallel
//! threads and do draw; cargo runs test binaries one after another, so a
//! test here is alone in its process.

#[allow(dead_code)]
#[path = "model/common.rs"]
mod common;
#[allow(dead_code)]
#[path = "model/tiny.rs"]
mod tiny;

use tvq_model::{CountWeight, RelativeBias};

use crate::common::*;
use crate::tiny::*;

/// The learned count weight: its columns start at zero and take no random
/// draw, so a new model is the paper's model of the same seed (which a
/// paired comparison of the two needs); once they are not zero, the
/// outputs that read the compressed cache move and no other, and the
/// recurrent form still computes what the block form does (what the
/// weight computes is the oracle's, in the attention tests).
#[test]
fn a_learned_count_weight_starts_as_the_paper_cache_and_moves_only_cache_reads() {
    use burn::module::Param;
    let device = cpu();
    for bias in [RelativeBias::Toeplitz, RelativeBias::Rotary] {
        let cfg = config(bias).with_count_weight(CountWeight::Learned);
        let m = model(&cfg, 5, &device);
        let (b, t, l) = (2, 28, cfg.block_len);
        let data = random_tokens(b, t, cfg.vocab_size, 11);
        let learned = logits_of(&m, &data, b, &device);
        let paper = model(&config(bias), 5, &device);
        assert_close(
            learned.clone(),
            logits_of(&paper, &data, b, &device),
            1e-6,
            &format!("{bias:?}: a new model against the paper's of the same seed"),
        );

        let mut m = m;
        for gau in &mut m.sublayers {
            let w = gau.q_proj.weight.val();
            let [d, cols] = w.dims();
            let columns = randn([d, cfg.n_head], &device) * 3.0;
            let w = w.slice_assign([0..d, cols - cfg.n_head..cols], columns);
            gau.q_proj.weight = Param::from_tensor(w);
        }
        let weighed = logits_of(&m, &data, b, &device);
        assert_close(
            at(weighed.clone(), 0..2 * l),
            at(learned.clone(), 0..2 * l),
            0.0,
            &format!("{bias:?}: nothing cached yet"),
        );
        let moved = max_abs_diff(at(weighed.clone(), 3 * l..t), at(learned, 3 * l..t));
        assert!(
            moved > 1e-4,
            "{bias:?}: the count weight is ignored ({moved:e})"
        );

        assert_close(
            decoded_logits(&m, &data, b, &device).0,
            weighed,
            1e-5,
            &format!("{bias:?}: token by token vs block"),
        );
    }
}
