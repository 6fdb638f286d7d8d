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
    /// Which positions hold real tokens (not padding); `None` where all
    /// do, so that the passes weigh nothing (no launches for a mask of
    /// ones on the GPU backends).
    pub valid: Option<Tensor<B, 2, Bool>>,
}

impl<B: Backend> BatchTensors<B> {
    /// Rows `rows` of `batch` on `device`.
    pub fn rows(batch: &Batch, rows: Range<usize>, device: &B::Device) -> Self {
        let t = batch.len;
        let span = rows.start * t..rows.end * t;
        let valid = &batch.valid[span.clone()];
        let shape = [rows.len(), t];
        let ints = |v: &[u32]| {
            let data: Vec<i64> = v[span.clone()].iter().map(|&x| x as i64).collect();
            Tensor::<B, 2, Int>::from_data(TensorData::new(data, shape), device)
        };
        Self {
            inputs: ints(&batch.inputs),
            targets: ints(&batch.targets),
            valid: (!valid.iter().all(|&v| v))
                .then(|| Tensor::from_data(TensorData::new(valid.to_vec(), shape), device)),
        }
    }
}

#[cfg(test)]
mod tests {
    use burn::backend::flex::{Flex, FlexDevice};

    use super::*;

    /// Rows with padding keep their mask; rows without any take none (the
    /// passes then weigh every token, as a mask of ones would).
    #[test]
    fn rows_without_padding_have_no_mask() {
        let batch = Batch {
            batch: 3,
            len: 2,
            inputs: vec![1, 2, 3, 4, 5, 0],
            targets: vec![2, 3, 4, 5, 6, 0],
            valid: vec![true, true, true, true, true, false],
            reset: false,
        };
        let rows = |r| BatchTensors::<Flex>::rows(&batch, r, &FlexDevice);
        assert!(rows(0..2).valid.is_none());
        let valid = rows(1..3).valid.expect("a padded row");
        let valid: Vec<bool> = valid.into_data().to_vec().unwrap();
        assert_eq!(valid, vec![true, true, true, false]);
        let inputs = rows(1..3).inputs.into_data().convert::<i64>();
        let inputs: Vec<i64> = inputs.to_vec().unwrap();
        assert_eq!(inputs, vec![3, 4, 5, 0]);
    }
}
