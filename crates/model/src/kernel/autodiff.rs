//! The fused kernels under burn's `Autodiff`: the forward kernel runs
//! once, keeping its output and each query's log-sum-exp, and the
//! backward kernel recomputes the scores from them.

use burn::backend::autodiff::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::tensor::activation::silu;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ops::FloatTensor;

use burn::tensor::ops::IntTensor;
use burn::tensor::{Int, Tensor, TensorPrimitive};

use std::sync::{Arc, Mutex};

use super::{
    AdamwParam, AttentionKernelInput, BlockCaches, COLUMN_BLOCKS_CALLS, COMMITMENT_CALLS,
    CodeTotals, FUSED_CALLS, NORM_CALLS, Nearest, QUANTIZE_CALLS, RMS_CALLS, SILU_CALLS,
    STRAIGHT_THROUGH_CALLS, TOKEN_NLL_CALLS, TOTALS_CALLS, VqBackend, VqKernels, count,
    sum_over_heads,
};
use crate::norm::{reciprocal_rms, rms_normalize};

/// The backward step of the fused attention; its parents are the six
/// differentiable inputs in [`AttentionKernelGrads`](super::AttentionKernelGrads)'s order.
#[derive(Debug)]
struct AttentionBackward;

impl<B: VqKernels> Backward<B, 6> for AttentionBackward {
    /// The inputs, the output and the log-sum-exp.
    type State = (AttentionKernelInput<B>, FloatTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 6>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let (input, out, lse) = ops.state;
        let computed = B::vq_attention_backward(input, out, lse, grad).into_array();
        for (parent, grad) in ops.parents.into_iter().zip(computed) {
            if let Some(node) = parent {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

/// The backward step of [`VqBackend::vq_rms_normalize`] over rank-`D`
/// tensors; its parent is the input.
#[derive(Debug)]
struct RmsBackward<const D: usize>;

impl<B: VqKernels, const D: usize> Backward<B, 1> for RmsBackward<D> {
    /// The input `x` `[..., K]` and its `r = 1 / sqrt(mean(x^2) + eps)`
    /// `[..., 1]`.
    type State = (FloatTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = float::<B, D>(grads.consume::<B>(&ops.node));
        let [Some(node)] = ops.parents else {
            return;
        };
        let (x, r) = ops.state;
        let (x, r) = (float::<B, D>(x), float::<B, D>(r));
        // y = x r: dx = r g + x dr/dx . g, with dr/dx = -r^3 x / K. In this
        // order burn's fusion takes the `[..., 1]` products into the
        // reduction's kernel and the rest into one elementwise kernel.
        let gx = (grad.clone() * x.clone()).mean_dim(D - 1); // [..., 1]
        let c = gx * r.clone() * r.clone() * r.clone(); // [..., 1]
        let dx = grad * r - x * c;
        grads.register::<B>(node.id, dx.into_primitive().tensor());
    }
}

/// The backward step of [`VqBackend::vq_silu`]; its parent is the input.
#[derive(Debug)]
struct SiluBackward;

impl<B: VqKernels> Backward<B, 1> for SiluBackward {
    /// The input `x`: the pass recomputes `sigmoid(x)` rather than keep it.
    type State = FloatTensor<B>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        if let [Some(node)] = ops.parents {
            grads.register::<B>(node.id, B::vq_silu_backward(ops.state, grad));
        }
    }
}

/// The backward step of [`VqBackend::vq_commitment`]; its parents are the
/// keys and the codewords.
#[derive(Debug)]
struct CommitmentBackward;

impl<B: VqKernels> Backward<B, 2> for CommitmentBackward {
    /// The keys and the codewords, `[B, H, T, K]` each: their difference
    /// is taken here, in the pass that scales it, rather than as a launch
    /// of its own in the forward pass.
    type State = (FloatTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = float::<B, 2>(grads.consume::<B>(&ops.node)); // [B, T]
        let (k, words) = ops.state;
        let diff = float::<B, 4>(k) - float::<B, 4>(words); // [B, H, T, K]
        let [b, _, t, _] = diff.dims();
        // The factor 2 on the full shape, where burn's fusion takes it into
        // the product's kernel (on `[B, T]` it is a launch of its own).
        let dk = diff * grad.reshape([b, 1, t, 1]) * 2.0; // [B, H, T, K]
        let [k, words] = ops.parents;
        if let Some(words) = words {
            grads.register::<B>(words.id, dk.clone().neg().into_primitive().tensor());
        }
        if let Some(k) = k {
            grads.register::<B>(k.id, dk.into_primitive().tensor());
        }
    }
}

/// The backward step of [`VqBackend::vq_straight_through`]; its parent is
/// the keys, whose gradient is the output's.
#[derive(Debug)]
struct StraightThroughBackward;

impl<B: VqKernels> Backward<B, 1> for StraightThroughBackward {
    type State = ();

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        if let [Some(k)] = ops.parents {
            grads.register::<B>(k.id, grad);
        }
    }
}

/// The backward step of [`VqBackend::vq_token_nll`]; its parent is the
/// logits.
#[derive(Debug)]
struct TokenNllBackward;

impl<B: VqKernels> Backward<B, 1> for TokenNllBackward {
    /// The logits `[B, T, V]`, the targets `[B, T, 1]` and each position's
    /// log-sum-exp of the logits `[B, T, 1]`.
    type State = (FloatTensor<B>, IntTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = float::<B, 2>(grads.consume::<B>(&ops.node)); // [B, T]
        let [Some(node)] = ops.parents else {
            return;
        };
        let (logits, targets, lse) = ops.state;
        let (logits, lse) = (float::<B, 3>(logits), float::<B, 3>(lse));
        let [b, t, v] = logits.dims();
        let vocab = Tensor::<B, 1, Int>::arange(0..v as i64, &logits.device()).reshape([1, 1, v]);
        let target = vocab.equal(Tensor::<B, 3, Int>::from_primitive(targets)); // [B, T, V]
        // Every term has the logits' shape (the rest broadcast): burn's
        // fusion takes them into one kernel.
        let p = (logits - lse).exp(); // softmax, [B, T, V]
        let dx = p.clone().mask_where(target, p - 1.0) * grad.reshape([b, t, 1]);
        grads.register::<B>(node.id, dx.into_primitive().tensor());
    }
}

/// Where a later block of [`VqBackend::vq_column_blocks`] leaves its
/// gradient for the first block's step.
type Slot<B> = Arc<Mutex<Option<FloatTensor<B>>>>;

/// The backward step of [`VqBackend::vq_column_blocks`]; its parents are
/// `x` and `w`, its output the first block. The other blocks are its
/// children ([`StashGradient`]), so theirs run first (burn runs the deeper
/// steps first) and leave their gradients in its slots.
#[derive(Debug)]
struct ColumnBlocksBackward;

/// What [`ColumnBlocksBackward`] keeps.
#[derive(Clone, Debug)]
struct ColumnBlocksState<B: burn::prelude::Backend> {
    /// `[B, T, D]`.
    x: FloatTensor<B>,
    /// `[D, N]`.
    w: FloatTensor<B>,
    /// The blocks' widths (they sum to `N`).
    widths: Vec<usize>,
    /// The later blocks' gradients, one slot each.
    slots: Vec<Slot<B>>,
}

impl<B: VqKernels> Backward<B, 2> for ColumnBlocksBackward {
    type State = ColumnBlocksState<B>;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let first = float::<B, 3>(grads.consume::<B>(&ops.node)); // [B, T, widths[0]]
        let ColumnBlocksState {
            x,
            w,
            widths,
            slots,
        } = ops.state;
        let [b, t, _] = first.dims();
        let device = first.device();
        let mut blocks = vec![first];
        for (slot, &n) in slots.iter().zip(&widths[1..]) {
            let grad = slot.lock().unwrap_or_else(|e| e.into_inner()).take();
            blocks.push(grad.map_or_else(|| Tensor::zeros([b, t, n], &device), float::<B, 3>));
        }
        let [px, pw] = ops.parents;
        let parts: Vec<_> = blocks
            .iter()
            .map(|t| t.clone().into_primitive().tensor())
            .collect();
        if B::PROJECTS
            && let Some([dx, dw]) = B::vq_column_backward(x.clone(), w.clone(), parts.clone())
        {
            if let Some(pw) = pw {
                grads.register::<B>(pw.id, dw);
            }
            if let Some(px) = px {
                grads.register::<B>(px.id, dx);
            }
            return;
        }
        // One launch where the backend joins, else one a block.
        let dy = match B::vq_join(parts) {
            Some(dy) => float::<B, 3>(dy),
            None => Tensor::cat(blocks, 2),
        }; // [B, T, N]
        if let Some(pw) = pw {
            let x = float::<B, 3>(x);
            let (d, n) = (x.dims()[2], dy.dims()[2]);
            let x = x.reshape([b * t, d]).transpose(); // [D, B T]
            let dw = x.matmul(dy.clone().reshape([b * t, n])); // [D, N]
            grads.register::<B>(pw.id, dw.into_primitive().tensor());
        }
        if let Some(px) = px {
            let wt = float::<B, 2>(w).transpose().unsqueeze::<3>(); // [1, N, D]
            grads.register::<B>(px.id, dy.matmul(wt).into_primitive().tensor());
        }
    }
}

/// The backward step of a later block of [`VqBackend::vq_column_blocks`]:
/// its gradient into its slot, for the first block's step (its parent).
#[derive(Debug)]
struct StashGradient;

impl<B: VqKernels> Backward<B, 1> for StashGradient {
    type State = Slot<B>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        *ops.state.lock().unwrap_or_else(|e| e.into_inner()) = Some(grad);
    }
}

/// A float primitive as a rank-`D` tensor.
fn float<B: burn::prelude::Backend, const D: usize>(t: FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

impl<B: VqKernels, C: CheckpointStrategy> VqBackend for Autodiff<B, C> {
    const FUSES_ATTENTION: bool = true;
    const STEPS_ADAMW: bool = <B as VqKernels>::STEPS_ADAMW;

    fn vq_quantize(keys: FloatTensor<Self>, codebook: FloatTensor<Self>) -> Option<Nearest<Self>> {
        count(&QUANTIZE_CALLS);
        // Nothing here carries gradient: the kernel's outputs are new leaves.
        let n = B::vq_quantize(keys.primitive, codebook.primitive);
        Some(Nearest {
            codes: n.codes,
            words: Self::from_inner(n.words),
            error: Self::from_inner(n.error),
            norm: Self::from_inner(n.norm),
        })
    }

    fn vq_code_totals(
        codes: IntTensor<Self>,
        weight: Option<FloatTensor<Self>>,
        values: FloatTensor<Self>,
        n_code: usize,
        rows: usize,
    ) -> Option<CodeTotals<Self>> {
        count(&TOTALS_CALLS);
        // The values carry no gradient (the caller's promise): new leaves.
        let t = B::vq_code_totals(
            codes,
            weight.map(|w| w.primitive),
            values.primitive,
            n_code,
            rows,
        );
        Some(CodeTotals {
            counts: Self::from_inner(t.counts),
            sums: Self::from_inner(t.sums),
        })
    }

    fn vq_block_caches(
        carried_codes: IntTensor<Self>,
        carried_values: FloatTensor<Self>,
        codes: IntTensor<Self>,
        values: FloatTensor<Self>,
        counts: FloatTensor<Self>,
        means: FloatTensor<Self>,
        fresh: bool,
    ) -> Option<BlockCaches<Self>> {
        count(&TOTALS_CALLS);
        // Nothing carries gradient (the caller's promise): new leaves.
        let c = B::vq_block_caches(
            carried_codes,
            carried_values.primitive,
            codes,
            values.primitive,
            counts.primitive,
            means.primitive,
            fresh,
        );
        Some(BlockCaches::from_array(
            c.into_array().map(Self::from_inner),
        ))
    }

    fn vq_sum_squares(tensors: Vec<FloatTensor<Self>>) -> Option<FloatTensor<Self>> {
        // A value, not a step of the graph: a new leaf.
        let total = B::vq_sum_squares(tensors.into_iter().map(|t| t.primitive).collect())?;
        count(&NORM_CALLS);
        Some(Self::from_inner(total))
    }

    fn vq_adamw(params: Vec<AdamwParam<Self>>) -> Option<Vec<[FloatTensor<Self>; 3]>> {
        // Values, not steps of the graph: new leaves.
        let inner = params
            .into_iter()
            .map(|p| AdamwParam {
                param: p.param.primitive,
                grad: p.grad.primitive,
                moments: p.moments.map(|m| m.map(|t| t.primitive)),
                scalars: p.scalars,
            })
            .collect();
        let stepped = <B as VqBackend>::vq_adamw(inner)?;
        Some(
            stepped
                .into_iter()
                .map(|three| three.map(Self::from_inner))
                .collect(),
        )
    }

    fn vq_totals_by_group(_: &Self::Device) -> bool {
        B::TOTALS_BY_GROUP
    }

    fn vq_silu<const D: usize>(x: Tensor<Self, D>) -> Tensor<Self, D> {
        if !B::SILU {
            return silu(x);
        }
        count(&SILU_CALLS);
        let x = x.into_primitive().tensor();
        let y = B::vq_silu(x.primitive.clone());
        let out = match SiluBackward
            .prepare::<C>([x.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(x.primitive, y),
            OpsKind::UnTracked(prep) => prep.finish(y),
        };
        float::<Self, D>(out)
    }

    fn vq_rms_normalize<const D: usize>(x: Tensor<Self, D>) -> Tensor<Self, D> {
        if !B::OWN_BACKWARDS {
            return rms_normalize(x);
        }
        count(&RMS_CALLS);
        let x = x.into_primitive().tensor();
        // The composed forward ops, on the inner backend.
        let inner = float::<B, D>(x.primitive.clone());
        let r = reciprocal_rms(inner.clone());
        let y = (inner * r.clone()).into_primitive().tensor();
        let out = match RmsBackward::<D>
            .prepare::<C>([x.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((x.primitive, r.into_primitive().tensor()), y),
            OpsKind::UnTracked(prep) => prep.finish(y),
        };
        float::<Self, D>(out)
    }

    fn vq_commitment(
        k: Tensor<Self, 4>,
        words: Tensor<Self, 4>,
        errors: Tensor<Self, 4>,
    ) -> Option<Tensor<Self, 2>> {
        if !B::OWN_BACKWARDS {
            return None;
        }
        count(&COMMITMENT_CALLS);
        let (k, words) = (k.into_primitive().tensor(), words.into_primitive().tensor());
        let errors = float::<B, 4>(errors.into_primitive().tensor().primitive); // [B, H, T, 1]
        let err = sum_over_heads(errors).into_primitive().tensor(); // [B, T]
        let out = match CommitmentBackward
            .prepare::<C>([k.node, words.node])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((k.primitive, words.primitive), err),
            OpsKind::UnTracked(prep) => prep.finish(err),
        };
        Some(float::<Self, 2>(out))
    }

    fn vq_straight_through(k: Tensor<Self, 4>, words: Tensor<Self, 4>) -> Option<Tensor<Self, 4>> {
        if !B::OWN_BACKWARDS {
            return None;
        }
        count(&STRAIGHT_THROUGH_CALLS);
        let k = k.into_primitive().tensor();
        // The codewords' own values: no launch.
        let words = words.into_primitive().tensor().primitive;
        let out = StraightThroughBackward
            .prepare::<C>([k.node])
            .compute_bound()
            .stateless(words);
        Some(float::<Self, 4>(out))
    }

    fn vq_token_nll(
        logits: Tensor<Self, 3>,
        targets: Tensor<Self, 2, Int>,
    ) -> Option<Tensor<Self, 2>> {
        if !B::OWN_BACKWARDS {
            return None;
        }
        count(&TOKEN_NLL_CALLS);
        let [b, t, _] = logits.dims();
        let logits = logits.into_primitive().tensor();
        // The composed forward ops, on the inner backend: `lse - x_t` with
        // `x_t - m` as the log-softmax's `(x - m)_t`, the same value.
        let x = float::<B, 3>(logits.primitive.clone());
        let targets =
            Tensor::<B, 2, Int>::from_primitive(targets.into_primitive()).reshape([b, t, 1]);
        let m = x.clone().max_dim(2); // [B, T, 1]
        let log_sum = (x.clone() - m.clone()).exp().sum_dim(2).log(); // [B, T, 1]
        let picked = x.gather(2, targets.clone()) - m.clone(); // [B, T, 1]
        let nll = (log_sum.clone() - picked)
            .reshape([b, t])
            .into_primitive()
            .tensor();
        let out = match TokenNllBackward
            .prepare::<C>([logits.node])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let lse = (log_sum + m).into_primitive().tensor();
                prep.finish((logits.primitive, targets.into_primitive(), lse), nll)
            }
            OpsKind::UnTracked(prep) => prep.finish(nll),
        };
        Some(float::<Self, 2>(out))
    }

    fn vq_column_blocks<const N: usize>(
        x: Tensor<Self, 3>,
        w: Tensor<Self, 2>,
        widths: [usize; N],
    ) -> Option<[Tensor<Self, 3>; N]> {
        let own = B::PROJECTS;
        if !(own || B::OWN_BACKWARDS && N > 1) || w.dims()[1] != widths.iter().sum::<usize>() {
            return None;
        }
        let (x, w) = (x.into_primitive().tensor(), w.into_primitive().tensor());
        // The products of the blocks of columns, on the inner backend.
        let own_products =
            own.then(|| B::vq_column_products(x.primitive.clone(), w.primitive.clone(), &widths));
        let products = match own_products.flatten() {
            Some(products) => products,
            None if B::OWN_BACKWARDS && N > 1 => {
                let (xi, wi) = (
                    float::<B, 3>(x.primitive.clone()),
                    float::<B, 2>(w.primitive.clone()),
                );
                let d = wi.dims()[0];
                let mut start = 0;
                widths
                    .map(|n| {
                        let cols = wi.clone().slice([0..d, start..start + n]).unsqueeze::<3>(); // [1, D, n]
                        start += n;
                        xi.clone().matmul(cols).into_primitive().tensor() // [B, T, n]
                    })
                    .to_vec()
            }
            None => return None,
        };
        count(&COLUMN_BLOCKS_CALLS);
        let slots: Vec<Slot<B>> = (1..N).map(|_| Slot::<B>::default()).collect();
        let mut products = products.into_iter();
        let first = products.next()?;
        let first = match ColumnBlocksBackward
            .prepare::<C>([x.node, w.node])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let state = ColumnBlocksState {
                    x: x.primitive,
                    w: w.primitive,
                    widths: widths.to_vec(),
                    slots: slots.clone(),
                };
                prep.finish(state, first)
            }
            OpsKind::UnTracked(prep) => prep.finish(first),
        };
        let mut blocks = vec![float::<Self, 3>(first.clone())];
        for (product, slot) in products.zip(slots) {
            let block = match StashGradient
                .prepare::<C>([first.node.clone()])
                .compute_bound()
                .stateful()
            {
                OpsKind::Tracked(prep) => prep.finish(slot, product),
                OpsKind::UnTracked(prep) => prep.finish(product),
            };
            blocks.push(float::<Self, 3>(block));
        }
        blocks.try_into().ok()
    }

    fn vq_attention(x: AttentionKernelInput<Self>) -> Option<FloatTensor<Self>> {
        count(&FUSED_CALLS);
        let parents = [
            x.q.node.clone(),
            x.k.node.clone(),
            x.v.node.clone(),
            x.bias.node.clone(),
            x.means.node.clone(),
            x.count_weight.node.clone(),
        ];
        // The carried block, codebook, counts and shift carry no gradient:
        // their primitives only.
        let inner = AttentionKernelInput::<B> {
            q: x.q.primitive,
            k: x.k.primitive,
            v: x.v.primitive,
            k_carried: x.k_carried.primitive,
            v_carried: x.v_carried.primitive,
            bias: x.bias.primitive,
            codebook: x.codebook.primitive,
            log_counts: x.log_counts.primitive,
            shift: x.shift.primitive,
            count_weight: x.count_weight.primitive,
            means: x.means.primitive,
            flags: x.flags,
        };
        Some(
            match AttentionBackward
                .prepare::<C>(parents)
                .compute_bound()
                .stateful()
            {
                OpsKind::Tracked(prep) => {
                    let (out, lse) = B::vq_attention_forward(&inner);
                    prep.finish((inner, out.clone(), lse), out)
                }
                OpsKind::UnTracked(prep) => prep.finish(B::vq_attention_forward(&inner).0),
            },
        )
    }
}
