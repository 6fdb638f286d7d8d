//! Small tensor ops in the form that takes the fewest launches on the GPU
//! backends (burn's fusion), where burn's own spelling of the same op
//! takes more.

use burn::prelude::*;

/// The sum of every element of `x`, `[1]`: one reduction over `x`
/// flattened, where `sum` runs as a fill and a reduction, and a sum over
/// each axis in turn as one reduction per axis.
pub fn total<B: Backend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, 1> {
    let n = x.shape().num_elements();
    x.reshape([n]).sum_dim(0)
}

#[cfg(test)]
mod tests {
    use burn::backend::flex::{Flex, FlexDevice};

    use super::*;

    fn values<const D: usize>(t: Tensor<Flex, D>) -> Vec<f32> {
        t.into_data().to_vec().unwrap()
    }

    #[test]
    fn total_sums_every_element() {
        let xs: Vec<f32> = (0..24).map(|i| i as f32 * 0.5 - 3.0).collect();
        let want: f32 = xs.iter().sum();
        let x = Tensor::<Flex, 3>::from_data(TensorData::new(xs, [2, 3, 4]), &FlexDevice);
        assert_eq!(values(total(x)), vec![want]);
    }
}
