//! The kernels under burn's fusion (`Fusion<B>`, burn's default GPU
//! backends): each kernel is a custom operation in the fusion stream, so
//! the elementwise ops around it stay fused. The stream runs the ops
//! queued before a kernel, hands the kernel its inputs as `B`'s tensors
//! and takes its outputs back; burn's own vision ops reach their kernels
//! the same way.

use std::marker::PhantomData;

use burn::tensor::DType;
use burn::tensor::Element;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Shape, TensorMetadata};
use burn_fusion::stream::{Operation, OperationStreams};
use burn_fusion::{Fusion, FusionBackend, FusionRuntime, FusionTensor};
use burn_ir::{CustomOpIr, HandleContainer, OperationIr, TensorIr};

use burn::tensor::ops::IntTensor;

use super::join::joined_shape;
use super::{
    AttentionFlags, AttentionKernelGrads, AttentionKernelInput, BlockCaches, CodeTotals, Nearest,
    VqKernels,
};

/// Which kernel a custom operation runs.
#[derive(Clone, Copy, Debug)]
enum Kernel {
    /// Inputs: keys, codebook. Outputs: codes, words, error, norm.
    Quantize,
    /// Inputs: codes, the weights when `weighted`, values. Outputs: counts,
    /// sums (whose shapes give the code count and the output rows).
    Totals { weighted: bool },
    /// Inputs: the carried block's codes and values, the segment's codes
    /// and values, the carried counts and means (not read when `fresh`).
    /// Outputs: [`BlockCaches`]' four.
    Caches { fresh: bool },
    /// Inputs: [`AttentionKernelInput`]'s eleven tensors. Outputs: the
    /// attention's output and log-sum-exp.
    Forward(AttentionFlags),
    /// Inputs: the forward pass's eleven, its output, its log-sum-exp and
    /// the output's gradient. Outputs: [`AttentionKernelGrads`]'s six.
    Backward(AttentionFlags),
    /// Inputs: the tensors. Output: the sum of their squares, `[1]`.
    SumSquares,
    /// Inputs: the parts. Output: them joined along their last axis.
    Join,
    /// Inputs: four tensors a parameter, then the table of scalars.
    /// Outputs: three a parameter (`VqKernels::vq_adamw`'s).
    Adamw,
}

impl Kernel {
    /// The operation's name in the stream; the flags are part of it, so
    /// that two operations that differ only there never look alike.
    fn name(self) -> String {
        let attention = |pass: &str, f: AttentionFlags| {
            let bit = |on: bool| if on { '1' } else { '0' };
            // mask_first, prev_grad, means_grad, shifted, weighted.
            let bits: String = [
                f.mask_first,
                f.prev_grad,
                f.means_grad,
                f.shifted,
                f.weighted,
            ]
            .map(bit)
            .into_iter()
            .collect();
            format!("tvq_attention_{pass}_{bits}")
        };
        match self {
            Self::Quantize => "tvq_quantize".into(),
            Self::Totals { weighted: true } => "tvq_code_totals_weighted".into(),
            Self::Totals { weighted: false } => "tvq_code_totals".into(),
            Self::Caches { fresh: true } => "tvq_block_caches_fresh".into(),
            Self::Caches { fresh: false } => "tvq_block_caches".into(),
            Self::Forward(flags) => attention("forward", flags),
            Self::Backward(flags) => attention("backward", flags),
            Self::SumSquares => "tvq_sum_squares".into(),
            Self::Join => "tvq_join".into(),
            Self::Adamw => "tvq_adamw".into(),
        }
    }
}

/// One kernel's call, queued in the fusion stream.
#[derive(Debug)]
struct Custom<B> {
    desc: CustomOpIr,
    kernel: Kernel,
    backend: PhantomData<B>,
}

type Handles<B> =
    HandleContainer<<<B as FusionBackend>::FusionRuntime as FusionRuntime>::FusionHandle>;

/// The attention's inputs, by their place in the operation's inputs.
fn input_from<B: FusionBackend>(
    handles: &mut Handles<B>,
    ir: &[TensorIr],
    flags: AttentionFlags,
) -> AttentionKernelInput<B> {
    let mut get = |i: usize| handles.get_float_tensor::<B>(&ir[i]);
    AttentionKernelInput {
        q: get(0),
        k: get(1),
        v: get(2),
        k_carried: get(3),
        v_carried: get(4),
        bias: get(5),
        codebook: get(6),
        log_counts: get(7),
        shift: get(8),
        count_weight: get(9),
        means: get(10),
        flags,
    }
}

impl<B: FusionBackend + VqKernels> Operation<B::FusionRuntime> for Custom<B> {
    fn execute(&self, handles: &mut Handles<B>) {
        let (inputs, outputs) = (&self.desc.inputs, &self.desc.outputs);
        match self.kernel {
            Kernel::Quantize => {
                let keys = handles.get_float_tensor::<B>(&inputs[0]);
                let codebook = handles.get_float_tensor::<B>(&inputs[1]);
                let n = B::vq_quantize(keys, codebook);
                handles.register_int_tensor::<B>(&outputs[0].id, n.codes);
                handles.register_float_tensor::<B>(&outputs[1].id, n.words);
                handles.register_float_tensor::<B>(&outputs[2].id, n.error);
                handles.register_float_tensor::<B>(&outputs[3].id, n.norm);
            }
            Kernel::Totals { weighted } => {
                let codes = handles.get_int_tensor::<B>(&inputs[0]);
                let weight = weighted.then(|| handles.get_float_tensor::<B>(&inputs[1]));
                let values = handles.get_float_tensor::<B>(&inputs[inputs.len() - 1]);
                let [rows, n_code] = outputs[0].shape.dims();
                let t = B::vq_code_totals(codes, weight, values, n_code, rows);
                handles.register_float_tensor::<B>(&outputs[0].id, t.counts);
                handles.register_float_tensor::<B>(&outputs[1].id, t.sums);
            }
            Kernel::Caches { fresh } => {
                let carried_codes = handles.get_int_tensor::<B>(&inputs[0]);
                let codes = handles.get_int_tensor::<B>(&inputs[2]);
                let mut get = |i: usize| handles.get_float_tensor::<B>(&inputs[i]);
                let (carried_values, values, counts, means) = (get(1), get(3), get(4), get(5));
                let c = B::vq_block_caches(
                    carried_codes,
                    carried_values,
                    codes,
                    values,
                    counts,
                    means,
                    fresh,
                );
                for (ir, t) in outputs.iter().zip(c.into_array()) {
                    handles.register_float_tensor::<B>(&ir.id, t);
                }
            }
            Kernel::Forward(flags) => {
                let input = input_from::<B>(handles, inputs, flags);
                let (out, lse) = B::vq_attention_forward(&input);
                handles.register_float_tensor::<B>(&outputs[0].id, out);
                handles.register_float_tensor::<B>(&outputs[1].id, lse);
            }
            Kernel::Backward(flags) => {
                let input = input_from::<B>(handles, &inputs[..11], flags);
                let mut get = |i: usize| handles.get_float_tensor::<B>(&inputs[i]);
                let (out, lse, grad) = (get(11), get(12), get(13));
                let computed = B::vq_attention_backward(input, out, lse, grad).into_array();
                for (ir, grad) in outputs.iter().zip(computed) {
                    handles.register_float_tensor::<B>(&ir.id, grad);
                }
            }
            Kernel::SumSquares => {
                let tensors = inputs
                    .iter()
                    .map(|ir| handles.get_float_tensor::<B>(ir))
                    .collect();
                let total =
                    B::vq_sum_squares(tensors).expect("queued only where the backend sums squares");
                handles.register_float_tensor::<B>(&outputs[0].id, total);
            }
            Kernel::Join => {
                let parts = inputs
                    .iter()
                    .map(|ir| handles.get_float_tensor::<B>(ir))
                    .collect();
                let out = B::vq_join(parts).expect("queued only where the backend joins");
                handles.register_float_tensor::<B>(&outputs[0].id, out);
            }
            Kernel::Adamw => {
                let mut tensors: Vec<_> = inputs
                    .iter()
                    .map(|ir| handles.get_float_tensor::<B>(ir))
                    .collect();
                let table = tensors.pop().expect("the table is the last input");
                let stepped =
                    B::vq_adamw(tensors, table).expect("queued only where the backend steps AdamW");
                for (ir, t) in outputs.iter().zip(stepped) {
                    handles.register_float_tensor::<B>(&ir.id, t);
                }
            }
        }
    }
}

/// Queues `kernel` on `inputs`' streams with new outputs of `outputs`'
/// shapes and types, and returns them.
fn queue<B: FusionBackend + VqKernels, const N: usize>(
    kernel: Kernel,
    inputs: Vec<FusionTensor<B::FusionRuntime>>,
    outputs: [(Shape, DType); N],
) -> [FusionTensor<B::FusionRuntime>; N] {
    queue_all::<B>(kernel, inputs, outputs.into())
        .try_into()
        .expect("one tensor an output")
}

/// [`queue`] for outputs counted at run time.
fn queue_all<B: FusionBackend + VqKernels>(
    kernel: Kernel,
    inputs: Vec<FusionTensor<B::FusionRuntime>>,
    outputs: Vec<(Shape, DType)>,
) -> Vec<FusionTensor<B::FusionRuntime>> {
    let client = inputs[0].client.clone();
    let streams = OperationStreams::with_inputs(&inputs);
    let outputs: Vec<TensorIr> = outputs
        .into_iter()
        .map(|(shape, dtype)| TensorIr::uninit(client.create_empty_handle(), shape, dtype))
        .collect();
    let inputs: Vec<TensorIr> = inputs.into_iter().map(FusionTensor::into_ir).collect();
    let desc = CustomOpIr {
        id: kernel.name(),
        inputs,
        outputs,
    };
    let op = Custom::<B> {
        desc: desc.clone(),
        kernel,
        backend: PhantomData,
    };
    client.register(streams, OperationIr::Custom(desc), op)
}

/// [`AttentionKernelInput`]'s eleven tensors in the operation's order.
fn attention_inputs<B: FusionBackend>(
    x: AttentionKernelInput<Fusion<B>>,
) -> Vec<FusionTensor<B::FusionRuntime>> {
    vec![
        x.q,
        x.k,
        x.v,
        x.k_carried,
        x.v_carried,
        x.bias,
        x.codebook,
        x.log_counts,
        x.shift,
        x.count_weight,
        x.means,
    ]
}

/// `t`'s shape and type: an output like it.
fn like(t: &impl TensorMetadata) -> (Shape, DType) {
    (t.shape(), t.dtype())
}

impl<B: FusionBackend + VqKernels> VqKernels for Fusion<B> {
    const TOTALS_BY_GROUP: bool = B::TOTALS_BY_GROUP;

    const SUMS_SQUARES: bool = B::SUMS_SQUARES;

    const JOINS: bool = B::JOINS;

    fn vq_join(parts: Vec<FloatTensor<Self>>) -> Option<FloatTensor<Self>> {
        // Decided before queuing: the kernel declines what `B`'s declines.
        let shape = joined_shape(parts.iter().map(|t| (t.shape().to_vec(), t.dtype())))
            .filter(|_| B::JOINS)?;
        let float = parts[0].dtype();
        let [out] = queue::<B, 1>(Kernel::Join, parts, [(Shape::from(shape), float)]);
        Some(out)
    }

    fn vq_sum_squares(tensors: Vec<FloatTensor<Self>>) -> Option<FloatTensor<Self>> {
        let float = tensors[0].dtype();
        // The kernel declines tensors of several types (as `B`'s does).
        if !B::SUMS_SQUARES || tensors.iter().any(|t| t.dtype() != float) {
            return None;
        }
        let [total] = queue::<B, 1>(Kernel::SumSquares, tensors, [(Shape::new([1]), float)]);
        Some(total)
    }

    const STEPS_ADAMW: bool = <B as VqKernels>::STEPS_ADAMW;

    const OWN_BACKWARDS: bool = B::OWN_BACKWARDS;

    fn vq_adamw(
        tensors: Vec<FloatTensor<Self>>,
        table: FloatTensor<Self>,
    ) -> Option<Vec<FloatTensor<Self>>> {
        let float = table.dtype();
        // The kernel declines tensors of other types (as `B`'s does).
        if !<B as VqKernels>::STEPS_ADAMW || tensors.iter().any(|t| t.dtype() != float) {
            return None;
        }
        // Each parameter's new value and moments are of its shape.
        let outputs = tensors
            .chunks(4)
            .flat_map(|four| [like(&four[0]), like(&four[2]), like(&four[3])])
            .collect();
        let mut inputs = tensors;
        inputs.push(table);
        Some(queue_all::<B>(Kernel::Adamw, inputs, outputs))
    }

    fn vq_quantize(keys: FloatTensor<Self>, codebook: FloatTensor<Self>) -> Nearest<Self> {
        let [g, t, _] = keys.shape().dims();
        let float = keys.dtype();
        let outputs = [
            (Shape::new([g, t]), <B::IntElem as Element>::dtype()),
            (keys.shape(), float),
            (Shape::new([g, t]), float),
            (Shape::new([g, t]), float),
        ];
        let [codes, words, error, norm] =
            queue::<B, 4>(Kernel::Quantize, vec![keys, codebook], outputs);
        Nearest {
            codes,
            words,
            error,
            norm,
        }
    }

    fn vq_code_totals(
        codes: IntTensor<Self>,
        weight: Option<FloatTensor<Self>>,
        values: FloatTensor<Self>,
        n_code: usize,
        rows: usize,
    ) -> CodeTotals<Self> {
        let width = values.shape().dims::<3>()[2];
        let float = values.dtype();
        let outputs = [
            (Shape::new([rows, n_code]), float),
            (Shape::new([rows, n_code, width]), float),
        ];
        let kernel = Kernel::Totals {
            weighted: weight.is_some(),
        };
        let inputs = [Some(codes), weight, Some(values)]
            .into_iter()
            .flatten()
            .collect();
        let [counts, sums] = queue::<B, 2>(kernel, inputs, outputs);
        CodeTotals { counts, sums }
    }

    fn vq_block_caches(
        carried_codes: IntTensor<Self>,
        carried_values: FloatTensor<Self>,
        codes: IntTensor<Self>,
        values: FloatTensor<Self>,
        counts: FloatTensor<Self>,
        means: FloatTensor<Self>,
        fresh: bool,
    ) -> BlockCaches<Self> {
        let [g, s] = counts.shape().dims();
        let [_, n, width] = values.shape().dims();
        let blocks = n / carried_codes.shape().dims::<2>()[1];
        let float = values.dtype();
        let outputs = [
            (Shape::new([g, blocks, s]), float),
            (Shape::new([g, blocks, s, width]), float),
            (Shape::new([g, s]), float),
            (Shape::new([g, s, width]), float),
        ];
        let inputs = vec![carried_codes, carried_values, codes, values, counts, means];
        BlockCaches::from_array(queue::<B, 4>(Kernel::Caches { fresh }, inputs, outputs))
    }

    fn vq_attention_forward(
        input: &AttentionKernelInput<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let [g, l, _] = input.v.shape().dims();
        let outputs = [
            (input.v.shape(), input.v.dtype()),
            (Shape::new([g, l]), input.q.dtype()),
        ];
        let kernel = Kernel::Forward(input.flags);
        let [out, lse] = queue::<B, 2>(kernel, attention_inputs(input.clone()), outputs);
        (out, lse)
    }

    fn vq_attention_backward(
        input: AttentionKernelInput<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> AttentionKernelGrads<Self> {
        let outputs = [
            like(&input.q),
            like(&input.k),
            like(&input.v),
            like(&input.bias),
            like(&input.means),
            like(&input.count_weight),
        ];
        let kernel = Kernel::Backward(input.flags);
        let mut inputs = attention_inputs(input);
        inputs.extend([out, lse, grad]);
        AttentionKernelGrads::from_array(queue::<B, 6>(kernel, inputs, outputs))
    }
}
