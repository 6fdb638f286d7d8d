//! Reading a prompt: whole blocks with the block-parallel form (in chunks;
//! on the CPU, a pipeline of threads over the sublayers), the rest with the
//! recurrent form, so that generation ([`super::sample`]) starts from the
//! state the recurrent form would reach, at the block form's speed.

use std::sync::Mutex;
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};

use burn::prelude::*;
use indicatif::ProgressBar;
use tvq_model::{AttentionState, Logits, ModelError, ModelState, Pass, PassInput, TransformerVq};

use crate::error::TrainError;
use crate::parallel::workers::{CREWS, lock};
use crate::placement::B;
use crate::progress::progress_bar;

/// Most tokens the block form reads at once while prefilling (a multiple
/// of the block length is taken): bounds the memory of a long prompt, and
/// gives the pipeline of [`prefill`] chunks to overlap. As fast per token
/// as 2,048 on one thread (docs/benchmarks.md).
pub const PREFILL_CHUNK: usize = 512;

/// The values of `logits` (any shape), in order.
pub(crate) fn logits_vec(logits: Tensor<B, 3>) -> Vec<f32> {
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
pub(crate) fn prefill_rows(
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
    let (last, mut state) = read_blocks(model, chunks, model.empty_state(), stages, &bar)?;
    bar.finish_and_clear();
    let mut logits = last; // [rows, 1, vocab]
    for i in whole..len {
        let ids: Vec<i64> = column(i).map(|t| t as i64).collect();
        let tokens = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [rows, 1]), &device);
        let (next, s) = model.decode(tokens, state)?;
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
/// form from `state`: the logits `[rows, 1, vocab]` of the last chunk's last
/// position (none without chunks) and the state after it. With `stages > 1` the
/// sublayers are cut into that many consecutive stages, each on a thread of
/// a worker crew (`parallel::workers`) that owns their states, and a chunk
/// passes from stage to stage, so that while stage 2 reads chunk 1, stage 1
/// reads chunk 2. Every stage
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
            let out = model.forward(tokens, state, Pass::new().with_logits(Logits::Last))?;
            (last, state) = (out.logits, out.state);
            bar.inc(len);
        }
        return Ok((last, state));
    }
    // Each stage's sublayers, their states and its two ends, taken by the
    // crew thread that runs it. Bounded channels: at most one chunk waits
    // between two stages.
    let mut states = state.sublayers.into_iter();
    let (feed, mut input) = sync_channel::<PassInput<B>>(1);
    let mut stage_parts = Vec::with_capacity(stages);
    for g in 0..stages {
        let range = g * n / stages..(g + 1) * n / stages;
        let own: Vec<_> = states.by_ref().take(range.len()).collect();
        // The last stage keeps its output; the others pass it on.
        let (output, next) = if g + 1 < stages {
            let (tx, rx) = sync_channel(1);
            (Some(tx), rx)
        } else {
            (None, sync_channel(0).1)
        };
        let input = std::mem::replace(&mut input, next);
        stage_parts.push(Mutex::new(Some((range, own, input, output))));
    }
    // The stages run on a crew, so each computes its own matrix products
    // (parallel::workers); this thread feeds them meanwhile. The crew is
    // lent to this thread, which keeps the states the stages end with.
    let crew = CREWS.lease(stages);
    std::thread::scope(|scope| {
        let stages_done = scope.spawn(|| {
            crew.run(|g| {
                let (range, own, input, output) =
                    lock(&stage_parts[g]).take().expect("each stage runs once");
                read_stage(model, range, own, input, output)
            })
        });
        for tokens in chunks {
            let len = tokens.dims()[1] as u64;
            // A failed send means a stage failed: its error is reported.
            match feed.send(PassInput::Tokens(tokens)) {
                Ok(()) => bar.inc(len),
                Err(_) => break,
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
        Ok((last, ModelState { sublayers }))
    })
}

/// What a pipeline stage ends with: the last chunk's last logits `[rows,
/// 1, vocab]` (the last stage only) and its sublayers' states.
type StageEnd = (Option<Tensor<B, 3>>, Vec<AttentionState<B>>);

/// One pipeline stage of [`read_blocks`]: sublayers `range` from their
/// states `own` over every chunk from `input` (tokens for the first stage,
/// hidden states for the others), each passed on to `output`, or, for the
/// last stage, the last chunk's last logits kept.
fn read_stage(
    model: &TransformerVq<B>,
    range: std::ops::Range<usize>,
    mut own: Vec<AttentionState<B>>,
    input: Receiver<PassInput<B>>,
    output: Option<SyncSender<PassInput<B>>>,
) -> Result<StageEnd, ModelError> {
    let logits = match output {
        Some(_) => Logits::None,
        None => Logits::Last,
    };
    let mut last = None;
    for chunk in input {
        let pass = Pass::new()
            .with_sublayers(range.clone())
            .with_logits(logits);
        let out = model.forward(chunk, ModelState { sublayers: own }, pass)?;
        own = out.state.sublayers;
        match &output {
            // A later stage that failed hung up: its error is reported.
            Some(tx) => {
                if tx.send(PassInput::Hidden(out.h)).is_err() {
                    break;
                }
            }
            None => last = out.logits,
        }
    }
    Ok((last, own))
}

#[cfg(test)]
pub(crate) mod tests {
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
            let (l, s) = model.decode(one_token(t, &device), state).unwrap();
            (logits, state) = (logits_vec(l), s);
        }
        (logits, state)
    }

    pub(crate) fn worst(a: &[f32], b: &[f32]) -> f32 {
        tvq_testkit::max_abs_diff(a, b)
    }

    pub(crate) fn floats<const D: usize>(t: &Tensor<B, D>) -> Vec<f32> {
        t.to_data().convert::<f32>().to_vec().unwrap()
    }

    /// The tiny model with 13 tokens and 2 layers (4 sublayers), drawn
    /// from `seed`.
    pub(crate) fn tiny_model(bias: RelativeBias, seed: u64) -> TransformerVq<B> {
        let device = DeviceSpec::Cpu.init().unwrap().0;
        let cfg = tvq_testkit::tiny_model(13).with_n_layer(2).with_bias(bias);
        crate::placement::seeded_draw::<B, _>(&device, Some(seed), || cfg.init::<B>(&device))
            .unwrap()
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

    /// Every number a state holds, sublayer by sublayer.
    pub(crate) fn state_floats(state: &ModelState<B>) -> Vec<Vec<f32>> {
        let mut out = vec![];
        for s in &state.sublayers {
            out.push(vec![s.pos as f32]);
            if let Some(p) = &s.prev {
                out.extend([
                    floats(&p.k_window),
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
        let (logits, state) = read(1).unwrap();
        let (logits, state) = (floats(&logits.unwrap()), state_floats(&state));
        for stages in 2..=4 {
            let (l2, state2) = read(stages).unwrap();
            // (Not assert_eq: a failure would print every number.)
            assert!(floats(&l2.unwrap()) == logits, "{stages} stages: logits");
            assert!(state_floats(&state2) == state, "{stages} stages: state");
        }
        // A chunk that is not whole blocks fails in the first stage: an
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
}
