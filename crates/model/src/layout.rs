//! Moving between per-token and per-head layouts without leaving strided views.
//!
//! On the CPU backend a transposed or sliced tensor is a strided view, and an
//! elementwise op on a view walks it index by index, roughly ten times slower
//! than on a contiguous tensor. The network's elementwise work (norms, silu,
//! gates, masks) therefore runs on contiguous tensors: these helpers copy a
//! view once, at the layout change, instead of paying on every op after it.

use burn::prelude::*;

/// The same tensor, materialised contiguously where the backend keeps strided
/// views (a reshape to its own shape copies a view; on a contiguous tensor it
/// is free).
pub fn contiguous<B: Backend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    let dims = x.dims();
    x.reshape(dims)
}

/// `[B, T, H W] -> [B, H, T, W]`, contiguous.
pub fn split_heads<B: Backend>(x: Tensor<B, 3>, n_head: usize) -> Tensor<B, 4> {
    let [b, t, hw] = x.dims();
    let w = hw / n_head;
    if n_head == 1 {
        return x.reshape([b, 1, t, w]);
    }
    contiguous(x.reshape([b, t, n_head, w]).swap_dims(1, 2))
}

/// `[B, H, T, W] -> [B, T, H W]`, contiguous.
pub fn merge_heads<B: Backend>(x: Tensor<B, 4>) -> Tensor<B, 3> {
    let [b, h, t, w] = x.dims();
    if h == 1 {
        return x.reshape([b, t, w]);
    }
    x.swap_dims(1, 2).reshape([b, t, h * w])
}
