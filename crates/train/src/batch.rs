//! Token batches of the data crate as the tensors the model takes.

use std::ops::Range;

use burn::prelude::*;
use tvq_data::Batch;

/// Rows of a [`Batch`] as tensors, `[R, T]` each.
pub struct BatchTensors<B: Backend> {
    /// Token ids the model reads.
    pub inputs: Tensor<B, 2, Int>,
    /// The next token of each input.
    pub targets: Tensor<B, 2, Int>,
    /// Which positions hold real tokens (not padding).
    pub valid: Tensor<B, 2, Bool>,
}

impl<B: Backend> BatchTensors<B> {
    /// Rows `rows` of `batch` on `device`.
    pub fn rows(batch: &Batch, rows: Range<usize>, device: &B::Device) -> Self {
        let t = batch.len;
        let span = rows.start * t..rows.end * t;
        let shape = [rows.len(), t];
        let ints = |v: &[u32]| {
            let data: Vec<i64> = v[span.clone()].iter().map(|&x| x as i64).collect();
            Tensor::<B, 2, Int>::from_data(TensorData::new(data, shape), device)
        };
        Self {
            inputs: ints(&batch.inputs),
            targets: ints(&batch.targets),
            valid: Tensor::from_data(
                TensorData::new(batch.valid[span.clone()].to_vec(), shape),
                device,
            ),
        }
    }
}
