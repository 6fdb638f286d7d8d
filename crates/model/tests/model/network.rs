//! Whole-network properties: forms agree, causality, state, dropout, EMA.

use burn::prelude::*;
use tvq_model::position::PositionTerm;
use tvq_model::{
    AttentionForm, CacheGrad, CountWeight, Logits, ModelError, Pass, RelativeBias, TransformerVq,
    TransformerVqConfig, WindowKeys,
};

use crate::common::*;
use crate::tiny::*;

#[test]
fn recurrent_network_matches_block_network() {
    let device = cpu();
    for (bias, keys) in [
        (RelativeBias::Toeplitz, WindowKeys::Quantized),
        (RelativeBias::Xl, WindowKeys::Quantized),
        (RelativeBias::Rotary, WindowKeys::Quantized),
        (RelativeBias::Toeplitz, WindowKeys::Exact),
        (RelativeBias::Rotary, WindowKeys::Exact),
    ] {
        let cfg = config(bias).with_window_keys(keys);
        let m = model(&cfg, 1, &device);
        let (b, t) = (2, 20);
        let data = random_tokens(b, t, cfg.vocab_size, 7);
        let block = m
            .forward(tokens(&data, b, &device), m.empty_state(), Pass::new())
            .unwrap()
            .logits
            .unwrap();
        let (steps, state) = decoded_logits(&m, &data, b, &device);
        assert_eq!(state.pos(), t);
        assert_close(
            steps,
            block,
            1e-5,
            &format!("{bias:?}, {keys:?} keys: token by token vs block"),
        );
    }
}

/// Within the two-block window nothing is cached, so with exact window
/// keys Transformer-VQ is the quadratic form on the same weights; with the
/// paper's quantized keys it is not (the keys are codewords).
#[test]
fn exact_window_keys_are_the_quadratic_form_within_the_window() {
    let device = cpu();
    let cfg = config(RelativeBias::Toeplitz);
    let m = model(&cfg, 3, &device);
    let (b, t) = (2, 2 * cfg.block_len);
    let data = random_tokens(b, t, cfg.vocab_size, 9);
    let logits = |form: AttentionForm, keys: WindowKeys| {
        let mut m = m.clone();
        for gau in &mut m.sublayers {
            gau.form = form;
            gau.compute.window_keys = keys;
        }
        logits_of(&m, &data, b, &device)
    };
    let quadratic = logits(AttentionForm::Quadratic, WindowKeys::Quantized);
    let exact = logits(AttentionForm::Vq, WindowKeys::Exact);
    let quantized = logits(AttentionForm::Vq, WindowKeys::Quantized);
    assert_close(exact, quadratic.clone(), 1e-5, "exact window keys");
    let diff = max_abs_diff(quantized, quadratic);
    assert!(
        diff > 1e-3,
        "quantized keys differ from the quadratic form by {diff}"
    );
}

#[test]
fn two_segments_with_carried_state_equal_one_segment() {
    let device = cpu();
    for bias in [
        RelativeBias::Toeplitz,
        RelativeBias::Xl,
        RelativeBias::Rotary,
    ] {
        let cfg = config(bias);
        let m = model(&cfg, 2, &device);
        let (b, t) = (3, 24);
        let data = random_tokens(b, t, cfg.vocab_size, 8);
        let whole = m
            .forward(tokens(&data, b, &device), m.empty_state(), Pass::new())
            .unwrap();
        let half = |r: std::ops::Range<usize>| -> Vec<i64> {
            (0..b)
                .flat_map(|row| data[row * t + r.start..row * t + r.end].to_vec())
                .collect()
        };
        let first = m
            .forward(
                tokens(&half(0..12), b, &device),
                m.empty_state(),
                Pass::new(),
            )
            .unwrap();
        let second = m
            .forward(tokens(&half(12..24), b, &device), first.state, Pass::new())
            .unwrap();
        let whole = whole.logits.unwrap();
        assert_close(
            Tensor::cat(vec![first.logits.unwrap(), second.logits.unwrap()], 1),
            whole.clone(),
            1e-5,
            &format!("{bias:?}"),
        );
        assert_eq!(second.state.pos(), t);
        // The last position alone, with the state carried the same way.
        let last_only = || Pass::new().with_logits(Logits::Last);
        let first = m
            .forward(
                tokens(&half(0..12), b, &device),
                m.empty_state(),
                last_only(),
            )
            .unwrap();
        let second = m
            .forward(tokens(&half(12..24), b, &device), first.state, last_only())
            .unwrap();
        let vocab = cfg.vocab_size;
        assert_close(
            second.logits.unwrap(),
            whole.slice([0..b, t - 1..t, 0..vocab]),
            1e-5,
            &format!("{bias:?}: the last position's logits"),
        );
        assert_eq!(second.state.pos(), t);
    }
}

#[test]
fn a_cache_limit_changes_only_the_queries_whose_cache_exceeds_it() {
    let device = cpu();
    for bias in [RelativeBias::Toeplitz, RelativeBias::Rotary] {
        let cfg = config(bias);
        let mut m = model(&cfg, 4, &device);
        let (b, t, l) = (2, 28, cfg.block_len);
        let data = random_tokens(b, t, cfg.vocab_size, 9);
        let mut logits = |limit: Option<usize>| -> Tensor<B, 3> {
            m.set_cache_limit(limit);
            logits_of(&m, &data, b, &device)
        };
        let exact = logits(None);
        // The last block's cache holds t - 2L keys: a limit that large binds nowhere.
        assert_close(
            logits(Some(t - 2 * l)),
            exact.clone(),
            0.0,
            "limit = largest cache",
        );
        // Limit 2L: blocks 0..=3 cache at most 2L keys and are unchanged;
        // from block 4 on (3L cached and more) every output moves.
        let limited = logits(Some(2 * l));
        assert_close(
            at(limited.clone(), 0..4 * l),
            at(exact.clone(), 0..4 * l),
            0.0,
            &format!("{bias:?}: within the limit"),
        );
        for i in 4 * l..t {
            let moved = max_abs_diff(at(limited.clone(), i..i + 1), at(exact.clone(), i..i + 1));
            assert!(
                moved > 1e-4,
                "{bias:?}: token {i} ignores the limit ({moved:e})"
            );
        }
    }
}

/// The code limit reaches every sublayer of a loaded model: no output moves
/// while nothing is cached (the first two blocks) or when the limit is above
/// every count; once codes are shared in the cache, weighing each as one
/// key moves the later outputs. (What it computes is the oracle's, in the
/// attention tests.)
#[test]
fn a_code_limit_changes_only_the_outputs_that_read_a_shared_code() {
    let device = cpu();
    let cfg = config(RelativeBias::Xl);
    let mut m = model(&cfg, 4, &device);
    let (b, t, l) = (2, 28, cfg.block_len);
    let data = random_tokens(b, t, cfg.vocab_size, 9);
    let mut logits = |limit: Option<usize>| -> Tensor<B, 3> {
        m.set_code_limit(limit);
        logits_of(&m, &data, b, &device)
    };
    let exact = logits(None);
    assert_close(
        logits(Some(t)),
        exact.clone(),
        0.0,
        "limit above every count",
    );
    let one = logits(Some(1));
    assert_close(
        at(one.clone(), 0..2 * l),
        at(exact.clone(), 0..2 * l),
        0.0,
        "nothing cached yet",
    );
    let moved = max_abs_diff(at(one, 3 * l..t), at(exact, 3 * l..t));
    assert!(moved > 1e-4, "the limit is ignored ({moved:e})");
}

#[test]
fn changing_a_token_changes_no_earlier_output() {
    let device = cpu();
    for bias in [RelativeBias::Xl, RelativeBias::Rotary] {
        let cfg = config(bias);
        let m = model(&cfg, 3, &device);
        let (b, t) = (2, 16);
        let data = random_tokens(b, t, cfg.vocab_size, 9);
        let base = m
            .forward(tokens(&data, b, &device), m.empty_state(), Pass::new())
            .unwrap()
            .logits
            .unwrap();
        for pos in [0, 3, 4, 9, 15] {
            let mut changed = data.clone();
            for row in 0..b {
                changed[row * t + pos] = (changed[row * t + pos] + 1) % cfg.vocab_size as i64;
            }
            let out = m
                .forward(tokens(&changed, b, &device), m.empty_state(), Pass::new())
                .unwrap()
                .logits
                .unwrap();
            let v = cfg.vocab_size;
            let before = |x: Tensor<B, 3>| x.slice([0..b, 0..pos.max(1), 0..v]);
            if pos > 0 {
                assert_eq!(
                    max_abs_diff(before(out.clone()), before(base.clone())),
                    0.0,
                    "{bias:?}: output before {pos} changed"
                );
            }
            let from = |x: Tensor<B, 3>| x.slice([0..b, pos..t, 0..v]);
            assert!(
                max_abs_diff(from(out), from(base.clone())) > 0.0,
                "{bias:?}: output from {pos} on must change"
            );
        }
    }
}

/// The model of `cfg` with every dropout at `p` (the same weights: tests
/// run in parallel and share the backend's generator, so two models built
/// under one seed need not be equal).
fn with_dropout(m: &TransformerVq<B>, p: f64) -> TransformerVq<B> {
    let mut m = m.clone();
    m.layer_drop = p;
    for g in m.sublayers.iter_mut() {
        g.dropout = p;
        if let PositionTerm::xl(xl) = &mut g.bias {
            xl.sinusoid_dropout = p;
        }
    }
    m
}

#[test]
fn dropout_is_off_in_evaluation_and_on_in_training() {
    let device = cpu_ad();
    let cfg = config(RelativeBias::Xl);
    let plain = model(&cfg, 4, &device);
    let dropped = with_dropout(&plain, 0.3);
    assert!(!plain.uses_dropout() && dropped.uses_dropout());
    let data = random_tokens(2, 8, cfg.vocab_size, 10);
    let eval = |m: &TransformerVq<B>| {
        let m = burn::module::AutodiffModule::valid(m);
        m.forward(tokens(&data, 2, &cpu()), m.empty_state(), Pass::new())
            .unwrap()
            .logits
            .unwrap()
    };
    assert_eq!(
        max_abs_diff(eval(&plain), eval(&dropped)),
        0.0,
        "dropout must not act in evaluation"
    );
    let train = |m: &TransformerVq<B>| logits_of(m, &data, 2, &device).inner();
    assert!(
        max_abs_diff(train(&plain), eval(&plain)) <= 1e-6,
        "p = 0 trains like it evaluates"
    );
    assert!(
        max_abs_diff(train(&dropped), eval(&dropped)) > 1e-3,
        "dropout must act in training"
    );

    // Masks drawn beforehand: the pass itself draws nothing (the same masks
    // give the same logits, whatever is drawn in between), and masks drawn
    // for another batch are an error, not a broadcast.
    let masks = dropped.dropout_masks([2, 8]);
    let with_masks = |masks| {
        dropped
            .forward(
                tokens(&data, 2, &device),
                dropped.empty_state(),
                Pass::new().with_masks(masks),
            )
            .unwrap()
            .logits
            .unwrap()
            .inner()
    };
    let first = with_masks(masks.clone());
    let _ = Tensor::<B, 2>::random([2, 8], burn::tensor::Distribution::Default, &device);
    assert_eq!(max_abs_diff(first.clone(), with_masks(masks)), 0.0);
    assert!(max_abs_diff(first, eval(&dropped)) > 1e-3, "the masks act");
    let err = dropped
        .forward(
            tokens(&data, 2, &device),
            dropped.empty_state(),
            Pass::new().with_masks(dropped.dropout_masks([1, 8])),
        )
        .unwrap_err();
    assert!(matches!(err, ModelError::MaskMismatch(_)), "{err}");
}

#[test]
fn state_and_segment_errors_are_reported_not_panicked() {
    let device = cpu();
    let cfg = config(RelativeBias::Toeplitz);
    let m = model(&cfg, 5, &device);
    let data = random_tokens(1, 6, cfg.vocab_size, 11);
    let err = m
        .forward(tokens(&data, 1, &device), m.empty_state(), Pass::new())
        .unwrap_err();
    assert_eq!(
        err,
        ModelError::SegmentNotBlockAligned {
            len: 6,
            block_len: 4
        }
    );
    let (_, state) = m
        .decode(tokens(&data[..1], 1, &device), m.empty_state())
        .unwrap();
    let err = m
        .forward(tokens(&data[..4], 1, &device), state, Pass::new())
        .unwrap_err();
    assert_eq!(
        err,
        ModelError::StateNotBlockAligned {
            pos: 1,
            block_len: 4
        }
    );
    let err = m
        .forward(
            tokens(&data[..4], 1, &device),
            tvq_model::ModelState::new(1),
            Pass::new(),
        )
        .unwrap_err();
    assert!(matches!(err, ModelError::StateMismatch(_)));
    // Sublayer ranges must exist and come with one state each; tokens
    // are the input of sublayer 0 only.
    let h = randn([1, 4, cfg.d_model], &device);
    let n = m.sublayers.len();
    #[allow(clippy::reversed_empty_ranges)]
    for (range, states) in [(0..n + 1, n + 1), (1..2, 2), (2..1, 0)] {
        let fresh = tvq_model::ModelState::new(states);
        let pass = Pass::new().with_sublayers(range.clone());
        let err = m.forward(h.clone(), fresh, pass);
        assert!(
            matches!(err, Err(ModelError::StateMismatch(_))),
            "{range:?}, {states} states"
        );
    }
    let pass = Pass::new().with_sublayers(1..2);
    let err = m.forward(
        tokens(&data[..4], 1, &device),
        tvq_model::ModelState::new(1),
        pass,
    );
    assert!(
        matches!(err, Err(ModelError::StateMismatch(_))),
        "tokens into sublayer 1"
    );
    // A state from a batch of 1 cannot continue a batch of 2.
    let first = m
        .forward(tokens(&data[..4], 1, &device), m.empty_state(), Pass::new())
        .unwrap();
    let two = random_tokens(2, 4, cfg.vocab_size, 12);
    assert!(matches!(
        m.forward(tokens(&two, 2, &device), first.state, Pass::new()),
        Err(ModelError::StateMismatch(_))
    ));
    // Nothing to read: an error, in every form, not a failed reshape.
    let empty = ModelError::EmptyInput { rows: 1, len: 0 };
    let none = || tokens(&[], 1, &device);
    assert_eq!(
        m.forward(none(), m.empty_state(), Pass::new()).unwrap_err(),
        empty
    );
    let last_only = Pass::new().with_logits(Logits::Last);
    assert_eq!(
        m.forward(none(), m.empty_state(), last_only).unwrap_err(),
        empty
    );
    assert_eq!(m.decode(none(), m.empty_state()).unwrap_err(), empty);
    let quadratic = model(
        &cfg.clone().with_attention(AttentionForm::Quadratic),
        5,
        &device,
    );
    assert_eq!(
        quadratic
            .forward(none(), quadratic.empty_state(), Pass::new())
            .unwrap_err(),
        empty
    );
}

#[test]
fn config_validation_names_the_key() {
    let bad = [
        (config(RelativeBias::Toeplitz).with_n_code(1), "n_code"),
        (config(RelativeBias::Toeplitz).with_d_model(15), "d_model"),
        (config(RelativeBias::Rotary).with_d_k(7), "d_k"),
        (
            config(RelativeBias::Rotary).with_rotary_channel(Some(3)),
            "rotary_channel",
        ),
        (
            config(RelativeBias::Toeplitz).with_block_len(0),
            "block_len",
        ),
        (
            config(RelativeBias::Toeplitz).with_dropout_layer(1.0),
            "dropout_layer",
        ),
        (
            config(RelativeBias::Toeplitz).with_logit_scale(0.0),
            "logit_scale",
        ),
        (
            config(RelativeBias::Toeplitz).with_cache_limit(Some(0)),
            "cache_limit",
        ),
        (
            config(RelativeBias::Toeplitz).with_code_limit(Some(0)),
            "code_limit",
        ),
        (
            config(RelativeBias::Toeplitz)
                .with_attention(AttentionForm::Quadratic)
                .with_count_weight(CountWeight::Learned),
            "count_weight",
        ),
    ];
    for (cfg, key) in bad {
        let err = cfg.init::<B>(&cpu()).expect_err("invalid config accepted");
        assert_eq!(err.key, key);
        assert!(err.to_string().contains(key));
    }
}

#[test]
fn codebooks_are_not_trained_by_the_loss_and_move_by_ema() {
    let device = cpu_ad();
    let cfg = config(RelativeBias::Toeplitz).with_cache_grad(CacheGrad::Full);
    let m = model(&cfg, 6, &device);
    let data = random_tokens(2, 8, cfg.vocab_size, 13);
    let out = m
        .forward(tokens(&data, 2, &device), m.empty_state(), Pass::new())
        .unwrap();
    let grads = burn::optim::GradientsParams::from_grads(out.logits.unwrap().sum().backward(), &m);
    for gau in &m.sublayers {
        assert!(grads.get::<B, 3>(gau.quantizer.c_sum.id).is_none());
        assert!(grads.get::<B, 2>(gau.quantizer.c_count.id).is_none());
    }
    // EMA: with gamma = 0 the codebook becomes the mean of its assigned keys.
    let stats = out.stats.clone();
    let ids: Vec<_> = m.sublayers.iter().map(|g| g.quantizer.c_sum.id).collect();
    let updated = m.update_codebooks(&stats, 0.0);
    for ((gau, s), id) in updated.sublayers.iter().zip(&stats).zip(ids) {
        assert_eq!(
            gau.quantizer.c_sum.id, id,
            "parameter ids survive the update"
        );
        assert_close(gau.quantizer.c_count.val(), s.counts.clone(), 0.0, "counts");
        assert_close(gau.quantizer.c_sum.val(), s.sums.clone(), 0.0, "sums");
        let total: f32 = s.counts.clone().sum().into_scalar().elem();
        assert_eq!(
            total,
            2.0 * 8.0 * cfg.n_head as f32,
            "every token counted once per head"
        );
        let metrics = s.metrics();
        assert!(metrics.usage > 0.0 && metrics.usage <= 1.0);
        assert!(metrics.perplexity >= 1.0 && metrics.perplexity <= cfg.n_code as f64 + 1e-9);
        assert!(metrics.relative_error > 0.0 && metrics.relative_error < 2.0);
    }
}

#[test]
fn padding_is_left_out_of_codebook_statistics() {
    let device = cpu();
    let cfg = config(RelativeBias::Toeplitz);
    let m = model(&cfg, 7, &device);
    let data = random_tokens(2, 8, cfg.vocab_size, 14);
    let valid: Vec<bool> = (0..16).map(|i| i % 8 < 5).collect();
    let valid = Tensor::<B, 2, Bool>::from_data(TensorData::new(valid, [2, 8]), &device);
    let out = m
        .forward(
            tokens(&data, 2, &device),
            m.empty_state(),
            Pass::new().with_valid(Some(valid)),
        )
        .unwrap();
    for s in &out.stats {
        let total: f32 = s.counts.clone().sum().into_scalar().elem();
        assert_eq!(total, 2.0 * 5.0 * cfg.n_head as f32);
    }
}

/// The rotary position channel takes part in the scores: the query
/// projection's channel columns receive gradient in every sublayer (none
/// would reach them if the keys' channel features were zero or left out),
/// and the logits depend on them.
#[test]
fn the_rotary_position_channel_scores_and_learns() {
    let device = cpu_ad();
    let cfg = config(RelativeBias::Rotary);
    let m = model(&cfg, 3, &device);
    let data = random_tokens(2, 12, cfg.vocab_size, 9);
    let logits = m
        .forward(tokens(&data, 2, &device), m.empty_state(), Pass::new())
        .unwrap()
        .logits
        .unwrap();
    let grads =
        burn::optim::GradientsParams::from_grads(logits.powi_scalar(2).sum().backward(), &m);
    let content = cfg.n_head * cfg.d_k;
    for (i, gau) in m.sublayers.iter().enumerate() {
        let g = grads
            .get::<B, 2>(gau.q_proj.weight.id)
            .expect("q_proj gradient");
        let [d, width] = g.dims();
        assert_eq!(width, cfg.n_head * (cfg.d_k + cfg.rotary_channel_width()));
        let channel = max_abs(g.slice([0..d, content..width]));
        assert!(channel > 1e-6, "sublayer {i}: channel gradient {channel}");
    }
    // And the forward pass depends on it: zeroing the channel's query
    // columns changes the logits.
    let m = model(&cfg, 3, &cpu());
    let mut zeroed = m.clone();
    let (d, width) = (
        cfg.d_model,
        cfg.n_head * (cfg.d_k + cfg.rotary_channel_width()),
    );
    for gau in zeroed.sublayers.iter_mut() {
        let w = gau.q_proj.weight.val();
        let zeros = Tensor::zeros([d, width - content], &cpu());
        gau.q_proj.weight =
            burn::module::Param::from_tensor(w.slice_assign([0..d, content..width], zeros));
    }
    let run = |m: &TransformerVq<B>| logits_of(m, &data, 2, &cpu());
    assert!(max_abs_diff(run(&m), run(&zeroed)) > 1e-3);
}

/// The parameter count read from the config (with nothing allocated)
/// is burn's count of the built model's floats, for each position term,
/// heads, a rotary channel, a tied or untied head and a final norm.
#[test]
fn the_config_counts_the_parameters_of_the_model_it_builds() {
    let device = cpu();
    let base = tvq_testkit::tiny_model(37).with_n_code(6).with_n_layer(2);
    let variants = [
        base.clone(),
        base.clone().with_bias(RelativeBias::Xl).with_n_head(2),
        base.clone()
            .with_bias(RelativeBias::Rotary)
            .with_rotary_channel(Some(4)),
        base.clone().with_bias(RelativeBias::Rotary),
        base.clone()
            .with_bias(RelativeBias::Rotary)
            .with_n_head(2)
            .with_count_weight(CountWeight::Learned),
        base.clone().with_tie_embeddings(true).with_final_norm(true),
        base.with_attention(AttentionForm::Quadratic)
            .with_block_len(3),
    ];
    for cfg in variants {
        let built = cfg.init::<B>(&device).unwrap().num_params();
        assert_eq!(cfg.num_params(), built, "{cfg:?}");
    }
    // Sizes far beyond memory count without overflow or allocation.
    let huge = TransformerVqConfig::new(usize::MAX).with_d_model(1 << 40);
    assert_eq!(huge.num_params(), usize::MAX);
}
