//! The fused kernels on the CPU (burn's `Flex` backend): the VQ attention
//! and quantizer, the computation of the cubecl kernels, block row by block
//! row; the projections' products, SiLU, the gradient norm's sum of squares
//! and AdamW. A row's `[L, 2L + S]` scores live in one scratch buffer that stays
//! in the core's cache, where the composed ops allocate and pass over
//! `[B, H, R, L, L]` and `[B, H, R, L, S]` tensors op by op; the products
//! are `gemm`'s, as `Flex`'s own matmul. The backward pass recomputes the
//! probabilities from each query's log-sum-exp.
//!
//! Keys of a row number `N = 2L + S`: present `0..L`, previous `L..2L`,
//! codes `2L..`. Masked scores (a present key after the query, the
//! previous block of a fresh stream's block 0, an empty code) get
//! probability 0 and no gradient.

use burn::backend::flex::{Flex, FlexTensor};
use burn::tensor::{DType, TensorData, TensorMetadata};

use rayon::prelude::*;
use rayon::slice::ChunksMut;
use std::mem::MaybeUninit;

mod simd;

use super::{
    AttentionFlags, AttentionKernelGrads, AttentionKernelInput, BlockCaches, CodeTotals, Nearest,
    ROW, VqKernels, composed_silu, composed_silu_backward,
};

/// A matrix view of a slice: element `(i, j)` at `i rs + j cs`.
#[derive(Clone, Copy)]
struct Mat<'a> {
    data: &'a [f32],
    rows: usize,
    cols: usize,
    rs: usize,
    cs: usize,
}

impl<'a> Mat<'a> {
    /// Rows `0..rows` of a row-major `[rows, cols]` matrix at the start of `data`.
    fn dense(data: &'a [f32], rows: usize, cols: usize) -> Self {
        Self {
            data,
            rows,
            cols,
            rs: cols,
            cs: 1,
        }
    }

    /// The transpose (a view).
    fn t(self) -> Self {
        Self {
            rows: self.cols,
            cols: self.rows,
            rs: self.cs,
            cs: self.rs,
            ..self
        }
    }

    /// Whether every element lies inside `data`.
    fn fits(&self, len: usize) -> bool {
        self.rows == 0
            || self.cols == 0
            || (self.rows - 1) * self.rs + (self.cols - 1) * self.cs < len
    }
}

/// `dst = a b` (or `dst += a b` when `acc`), `dst` a `[a.rows, b.cols]`
/// view of `dst` with row stride `dst_rs` and unit column stride, on the
/// calling thread (the attention's products, one block row per task).
fn matmul(dst: &mut [f32], dst_rs: usize, acc: bool, a: Mat<'_>, b: Mat<'_>) {
    product(dst, dst_rs, acc, a, b, gemm::Parallelism::None);
}

/// Below this many multiply-adds a product stays on one thread (burn's
/// `Flex` matmul's threshold).
const PARALLEL_WORK: usize = 192 * 192 * 192;

/// [`matmul`] on the worker threads where it is large enough: the
/// projections' products, one at a time.
fn parallel_matmul(dst: &mut [f32], dst_rs: usize, acc: bool, a: Mat<'_>, b: Mat<'_>) {
    product(dst, dst_rs, acc, a, b, parallelism(a, b));
}

/// gemm's own threads for a product of `PARALLEL_WORK` or more
/// multiply-adds, none below.
fn parallelism(a: Mat<'_>, b: Mat<'_>) -> gemm::Parallelism {
    if a.rows * a.cols * b.cols >= PARALLEL_WORK {
        gemm::Parallelism::Rayon(0)
    } else {
        gemm::Parallelism::None
    }
}

/// [`matmul`] with `par` for gemm's own threads.
fn product(
    dst: &mut [f32],
    dst_rs: usize,
    acc: bool,
    a: Mat<'_>,
    b: Mat<'_>,
    par: gemm::Parallelism,
) {
    // SAFETY: a slice is valid for writes of its length, and initialised.
    unsafe { product_to(dst.as_mut_ptr(), dst.len(), dst_rs, acc, a, b, par) }
}

/// `a b` as a new row-major `[a.rows, b.cols]` matrix, every element
/// written by the product (no zeroing pass first).
fn fresh_product(a: Mat<'_>, b: Mat<'_>, par: gemm::Parallelism) -> Vec<f32> {
    let len = a.rows * b.cols;
    let mut out = Vec::with_capacity(len);
    // SAFETY: `out` has room for `len` elements; with `acc` false the
    // product writes each of them (a dense view: row stride = columns),
    // so they are initialised when the length is set.
    unsafe {
        product_to(out.as_mut_ptr(), len, b.cols, false, a, b, par);
        out.set_len(len);
    }
    out
}

/// `a b` into `dst`, room for exactly `[a.rows, b.cols]` (row-major), on
/// the calling thread: `dst` with every element written, as values.
fn init_product<'a>(dst: &'a mut [MaybeUninit<f32>], a: Mat<'_>, b: Mat<'_>) -> &'a mut [f32] {
    assert_eq!(dst.len(), a.rows * b.cols, "the product fills its room");
    let (ptr, len, par) = (dst.as_mut_ptr().cast(), dst.len(), gemm::Parallelism::None);
    // SAFETY: `dst` is valid for writes of its length and aliases neither
    // operand (it is borrowed mutably); with `acc` false nothing is read,
    // and a dense view over the whole room writes each element.
    unsafe {
        product_to(ptr, len, b.cols, false, a, b, par);
        written(dst)
    }
}

/// `dst` with each element set to 0.
fn zeroed(dst: &mut [MaybeUninit<f32>]) -> &mut [f32] {
    dst.iter_mut().for_each(|x| {
        x.write(0.0);
    });
    // SAFETY: every element was just written.
    unsafe { written(dst) }
}

/// `dst`'s elements as the values written to them.
///
/// # Safety
///
/// Every element of `dst` is initialised.
unsafe fn written(dst: &mut [MaybeUninit<f32>]) -> &mut [f32] {
    // SAFETY: `MaybeUninit<f32>` has `f32`'s layout, and the caller
    // vouches that each element holds a value.
    unsafe { &mut *(dst as *mut [MaybeUninit<f32>] as *mut [f32]) }
}

/// `rows` chunks of `width` elements of the empty `buf`'s spare capacity
/// (reserved here), one per task, for a pass that writes each element
/// before the length is set.
fn room(buf: &mut Vec<f32>, rows: usize, width: usize) -> ChunksMut<'_, MaybeUninit<f32>> {
    assert!(buf.is_empty(), "room follows the elements already there");
    buf.reserve_exact(rows * width);
    buf.spare_capacity_mut()[..rows * width].par_chunks_mut(width)
}

/// [`product`] into `dst_len` elements at `dst`.
///
/// # Safety
///
/// `dst` is valid for writes of `dst_len` elements, aliases neither
/// operand, and is initialised where read: everywhere in the view when
/// `acc`, nowhere otherwise (the product then only writes).
unsafe fn product_to(
    dst: *mut f32,
    dst_len: usize,
    dst_rs: usize,
    acc: bool,
    a: Mat<'_>,
    b: Mat<'_>,
    par: gemm::Parallelism,
) {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    assert_eq!(k, b.rows, "inner sizes differ");
    let out = (m, n, dst_rs);
    let fits = m == 0 || n == 0 || (m - 1) * dst_rs + n <= dst_len;
    assert!(
        a.fits(a.data.len()) && b.fits(b.data.len()) && fits,
        "a matrix view runs past its slice: {out:?}"
    );
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !acc {
            for i in 0..m {
                // SAFETY: row i's n elements lie inside `dst` (checked above).
                unsafe { std::ptr::write_bytes(dst.add(i * dst_rs), 0, n) };
            }
        }
        return;
    }
    // SAFETY: every element of the three views lies inside its buffer
    // (checked above), `dst` aliases neither operand and is read only
    // when `acc` (the caller's contract), and the strides are those the
    // views were checked with.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
            1,
            dst_rs as isize,
            acc,
            a.data.as_ptr(),
            a.cs as isize,
            a.rs as isize,
            b.data.as_ptr(),
            b.cs as isize,
            b.rs as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            par,
        );
    }
}

/// Columns `start..start + width` of a row-major `[rows, n]` matrix.
fn columns(m: &[f32], rows: usize, n: usize, start: usize, width: usize) -> Mat<'_> {
    Mat {
        data: &m[start..],
        rows,
        cols: width,
        rs: n,
        cs: 1,
    }
}

/// Sizes of one call: `G` block rows of `R` blocks (so block `g % R` of
/// its stream), `L`, `K`, `V`, `S` codes, `H` heads (row `g` is head
/// `(g / R) % H`).
#[derive(Clone, Copy, Debug)]
struct Dims {
    g: usize,
    r: usize,
    l: usize,
    k: usize,
    v: usize,
    s: usize,
    h: usize,
}

impl Dims {
    /// Keys per row: present, previous, codes.
    fn n(&self) -> usize {
        2 * self.l + self.s
    }
}

/// [`AttentionKernelInput`] as contiguous host slices.
struct Rows<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    k_carried: &'a [f32],
    v_carried: &'a [f32],
    bias: &'a [f32],
    codebook: &'a [f32],
    log_counts: &'a [f32],
    /// `None` unless [`AttentionFlags::shifted`].
    shift: Option<&'a [f32]>,
    /// `None` unless [`AttentionFlags::weighted`].
    count_weight: Option<&'a [f32]>,
    means: &'a [f32],
    flags: AttentionFlags,
    /// `L max(K, V)` zeros: a fresh stream's previous block.
    zeros: Vec<f32>,
}

/// Row `g`'s slice of a `[G, n, width]` tensor.
fn row(x: &[f32], g: usize, n: usize, width: usize) -> &[f32] {
    &x[g * n * width..][..n * width]
}

impl Rows<'_> {
    /// Row `g`'s previous block in `x` (the segment's keys or values,
    /// `[G, L, width]`) or `carried` (`[G / R, L, width]`); zeros in a
    /// fresh stream's block 0, where `carried` is not read (its scores are
    /// masked, and an empty tensor's values would make NaNs of their zero
    /// weights).
    fn previous<'a>(
        &'a self,
        d: Dims,
        g: usize,
        x: &'a [f32],
        carried: &'a [f32],
        width: usize,
    ) -> &'a [f32] {
        match g % d.r {
            0 if self.flags.mask_first => &self.zeros[..d.l * width],
            0 => row(carried, g / d.r, d.l, width),
            _ => row(x, g - 1, d.l, width),
        }
    }

    /// Row `g`'s three groups of keys (present `[L, K]`, previous
    /// `[L, K]`, its head's codewords `[S, K]`), each with the column of
    /// the row's scores where the group starts.
    fn keys(&self, d: Dims, g: usize) -> [(usize, Mat<'_>); 3] {
        let (l, k, s) = (d.l, d.k, d.s);
        let head = (g / d.r) % d.h;
        [
            (0, Mat::dense(row(self.k, g, l, k), l, k)),
            (
                l,
                Mat::dense(self.previous(d, g, self.k, self.k_carried, k), l, k),
            ),
            (2 * l, Mat::dense(row(self.codebook, head, s, k), s, k)),
        ]
    }

    /// Row `g`'s three groups of values (present `[L, V]`, previous
    /// `[L, V]`, cache means `[S, V]`), as [`Self::keys`].
    fn values(&self, d: Dims, g: usize) -> [(usize, Mat<'_>); 3] {
        let (l, v, s) = (d.l, d.v, d.s);
        [
            (0, Mat::dense(row(self.v, g, l, v), l, v)),
            (
                l,
                Mat::dense(self.previous(d, g, self.v, self.v_carried, v), l, v),
            ),
            (2 * l, Mat::dense(row(self.means, g, s, v), s, v)),
        ]
    }

    /// Row `g`'s scores `[L, N]` into `p`, then (given each query's
    /// log-sum-exp `lse` `[L]`, or computing it there) its probabilities.
    fn probabilities(&self, d: Dims, g: usize, p: &mut [f32], lse: &mut [f32], known_lse: bool) {
        let (l, k, s, n) = (d.l, d.k, d.s, d.n());
        let q = Mat::dense(row(self.q, g, l, k), l, k);
        for (start, keys) in self.keys(d, g) {
            matmul(&mut p[start..], n, false, q, keys.t());
        }
        let no_prev = self.flags.mask_first && g.is_multiple_of(d.r);
        let log_counts = row(self.log_counts, g, 1, s);
        let shift = self.shift.map_or(0.0, |shift| shift[g]);
        for i in 0..l {
            let bias = &self.bias[(g * l + i) * (l + 1)..][..l + 1];
            let scores = &mut p[i * n..][..n];
            let weight = self.count_weight.map_or(1.0, |w| w[g * l + i]);
            // Masked scores are -inf until the exponent makes them 0.
            for (j, x) in scores[..l].iter_mut().enumerate() {
                *x = if j <= i {
                    *x + bias[i - j]
                } else {
                    f32::NEG_INFINITY
                };
            }
            for (j, x) in scores[l..2 * l].iter_mut().enumerate() {
                *x = if no_prev {
                    f32::NEG_INFINITY
                } else if j >= i {
                    *x + bias[l + i - j]
                } else {
                    *x
                };
            }
            for (x, &c) in scores[2 * l..].iter_mut().zip(log_counts) {
                *x = if c == f32::NEG_INFINITY {
                    f32::NEG_INFINITY
                } else {
                    *x + weight * c + shift
                };
            }
            if known_lse {
                simd::exp_shifted(scores, lse[i]);
            } else {
                // The present key j = 0 is never masked: the maximum is finite.
                let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                simd::exp_shifted(scores, max);
                let sum: f32 = scores.iter().sum();
                scores.iter_mut().for_each(|x| *x /= sum);
                lse[i] = max + sum.ln();
            }
        }
    }

    /// Row `g`'s output `[L, V]`, every element written, from its
    /// probabilities `p` `[L, N]`.
    fn weigh(&self, d: Dims, g: usize, p: &[f32], out: &mut [MaybeUninit<f32>]) {
        let (l, v, n) = (d.l, d.v, d.n());
        let [(_, present), rest @ ..] = self.values(d, g);
        let out = init_product(out, columns(p, l, n, 0, l), present);
        for (start, values) in rest {
            matmul(out, v, true, columns(p, l, n, start, values.rows), values);
        }
    }
}

/// The forward pass: output `[G, L, V]` and each query's log-sum-exp
/// `[G, L]`, block rows on the worker threads.
fn forward(x: &Rows<'_>, d: Dims) -> (Vec<f32>, Vec<f32>) {
    let mut out = Vec::new();
    let mut lse = vec![0.0; d.g * d.l];
    (room(&mut out, d.g, d.l * d.v), lse.par_chunks_mut(d.l))
        .into_par_iter()
        .enumerate()
        .for_each_init(
            || vec![0.0; d.l * d.n()],
            |p, (g, (out, lse))| {
                x.probabilities(d, g, p, lse, false);
                x.weigh(d, g, p, out);
            },
        );
    // SAFETY: `weigh` wrote each of the `G` rows' outputs.
    unsafe { out.set_len(d.g * d.l * d.v) };
    (out, lse)
}

/// The gradients of the differentiable inputs, as host vectors, and those
/// of each row's previous block (`k_prev`, `v_prev`, folded into `k` and
/// `v` by [`backward`]).
struct Grads {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    k_prev: Vec<f32>,
    v_prev: Vec<f32>,
    bias: Vec<f32>,
    means: Vec<f32>,
    count_weight: Vec<f32>,
}

/// The backward pass from the output's gradient `grad` `[G, L, V]`,
/// block rows on the worker threads.
fn backward(x: &Rows<'_>, d: Dims, out: &[f32], lse: &[f32], grad: &[f32]) -> Grads {
    let (gs, l, k, v, s) = (d.g, d.l, d.k, d.v, d.s);
    // Each row's elements of q, k, v, k_prev, v_prev, bias, means and
    // count_weight.
    let widths = [l * k, l * k, l * v, l * k, l * v, l * (l + 1), s * v, l];
    let mut bufs: [Vec<f32>; 8] = Default::default();
    let [dq, dk, dv, dk_prev, dv_prev, dbias, dmeans, dcount_weight] = &mut bufs;
    (
        room(dq, gs, widths[0]),
        room(dk, gs, widths[1]),
        room(dv, gs, widths[2]),
        room(dk_prev, gs, widths[3]),
        room(dv_prev, gs, widths[4]),
        room(dbias, gs, widths[5]),
        room(dmeans, gs, widths[6]),
        room(dcount_weight, gs, widths[7]),
    )
        .into_par_iter()
        .enumerate()
        .for_each_init(
            || Scratch {
                p: vec![0.0; l * d.n()],
                ds: vec![0.0; l * d.n()],
                lse: vec![0.0; l],
            },
            |scratch, (g, parts)| {
                scratch.lse.copy_from_slice(row(lse, g, l, 1));
                let io = [row(out, g, l, v), row(grad, g, l, v)];
                let (q, k, v, k_prev, v_prev, bias, means, count_weight) = parts;
                let grads = RowGrads {
                    q,
                    k,
                    v,
                    k_prev,
                    v_prev,
                    bias,
                    means,
                    count_weight,
                };
                backward_row(x, d, g, io, scratch, grads);
            },
        );
    for (buf, width) in bufs.iter_mut().zip(widths) {
        // SAFETY: `backward_row` wrote every element of each of the `G`
        // rows' chunks.
        unsafe { buf.set_len(gs * width) };
    }
    let [q, dk, dv, k_prev, v_prev, bias, means, count_weight] = bufs;
    let mut grads = Grads {
        q,
        k: dk,
        v: dv,
        k_prev,
        v_prev,
        bias,
        means,
        count_weight,
    };
    // Row g's previous block is row g - 1 of the same stream (its block 0's
    // is the carried block, which takes no gradient).
    if x.flags.prev_grad {
        for (ours, prev, width) in [
            (&mut grads.k, &grads.k_prev, k),
            (&mut grads.v, &grads.v_prev, v),
        ] {
            for g in (0..gs).filter(|g| (g + 1) % d.r != 0) {
                let (ours, prev) = (
                    &mut ours[g * l * width..][..l * width],
                    row(prev, g + 1, l, width),
                );
                ours.iter_mut().zip(prev).for_each(|(a, b)| *a += b);
            }
        }
    }
    grads
}

/// One thread's buffers for [`backward_row`]: probabilities and score
/// gradients `[L, N]`, the row's log-sum-exp `[L]`.
struct Scratch {
    p: Vec<f32>,
    ds: Vec<f32>,
    lse: Vec<f32>,
}

/// One block row's slices of [`Grads`], before they are written.
struct RowGrads<'a> {
    q: &'a mut [MaybeUninit<f32>],
    k: &'a mut [MaybeUninit<f32>],
    v: &'a mut [MaybeUninit<f32>],
    k_prev: &'a mut [MaybeUninit<f32>],
    v_prev: &'a mut [MaybeUninit<f32>],
    bias: &'a mut [MaybeUninit<f32>],
    means: &'a mut [MaybeUninit<f32>],
    count_weight: &'a mut [MaybeUninit<f32>],
}

/// Row `g`'s gradients, every element of each written, from its output
/// and the output's gradient `[out, grad]`, each `[L, V]`.
fn backward_row(
    x: &Rows<'_>,
    d: Dims,
    g: usize,
    [out, grad]: [&[f32]; 2],
    Scratch { p, ds, lse }: &mut Scratch,
    RowGrads {
        q: dq,
        k: dk,
        v: dv,
        k_prev: dk_prev,
        v_prev: dv_prev,
        bias: dbias,
        means: dmeans,
        count_weight: dcount_weight,
    }: RowGrads<'_>,
) {
    let (l, k, v, s, n) = (d.l, d.k, d.v, d.s, d.n());
    x.probabilities(d, g, p, lse, true);
    let d_out = Mat::dense(grad, l, v);
    // dP = dO values^T, [L, N].
    for (start, values) in x.values(d, g) {
        matmul(&mut ds[start..], n, false, d_out, values.t());
    }
    // dS = P (dP - dO . O).
    let log_counts = row(x.log_counts, g, 1, s);
    for i in 0..l {
        let delta: f32 = out[i * v..][..v]
            .iter()
            .zip(&grad[i * v..][..v])
            .map(|(a, b)| a * b)
            .sum();
        let (pi, dsi) = (&p[i * n..][..n], &mut ds[i * n..][..n]);
        for (dsij, &pij) in dsi.iter_mut().zip(pi) {
            *dsij = pij * (*dsij - delta);
        }
        // Each distance 0..=L is one key's: present i - d, previous L + i - d.
        for (dist, b) in dbias[i * (l + 1)..][..l + 1].iter_mut().enumerate() {
            b.write(if dist <= i {
                dsi[i - dist]
            } else {
                dsi[l + l + i - dist]
            });
        }
        dcount_weight[i].write(
            dsi[2 * l..]
                .iter()
                .zip(log_counts)
                .filter(|&(_, &c)| c != f32::NEG_INFINITY)
                .map(|(a, c)| a * c)
                .sum(),
        );
    }
    let part = |m, start, width| columns(m, l, n, start, width);
    let q = Mat::dense(row(x.q, g, l, k), l, k);
    // dq = dS keys.
    let [(_, present), rest @ ..] = x.keys(d, g);
    let dq = init_product(dq, part(ds, 0, l), present);
    for (start, keys) in rest {
        matmul(dq, k, true, part(ds, start, keys.rows), keys);
    }
    // dk = dS^T q (codewords take no gradient), dv = P^T dO; the previous
    // block's and the means' only where they pass on (else zero).
    init_product(dk, part(ds, 0, l).t(), q);
    init_product(dv, part(p, 0, l).t(), d_out);
    if x.flags.prev_grad {
        init_product(dk_prev, part(ds, l, l).t(), q);
        init_product(dv_prev, part(p, l, l).t(), d_out);
    } else {
        zeroed(dk_prev);
        zeroed(dv_prev);
    }
    if x.flags.means_grad {
        init_product(dmeans, part(p, 2 * l, s).t(), d_out);
    } else {
        zeroed(dmeans);
    }
}

/// `t` as a contiguous `f32` tensor (a view shares its buffer; other
/// types are converted).
fn f32s(t: &FlexTensor) -> FlexTensor {
    if t.dtype() == DType::F32 {
        t.to_contiguous()
    } else {
        FlexTensor::from_data(t.clone().into_data().convert::<f32>())
    }
}

/// The `f32` tensor `t` with its elements as the whole of its buffer, for
/// a pass that overwrites them: `t` itself where they already are (a
/// buffer held elsewhere too is copied by the first write, `storage_mut`),
/// else a copy.
fn whole_f32s(t: FlexTensor) -> FlexTensor {
    match t.layout().contiguous_offsets() {
        Some((0, end)) if end == t.storage::<f32>().len() => t,
        Some((start, end)) => {
            let values = t.storage::<f32>()[start..end].to_vec();
            tensor(values, t.shape().to_vec(), DType::F32)
        }
        None => whole_f32s(t.to_contiguous()),
    }
}

/// A tensor of `shape` holding `values`, in `dtype`.
fn tensor(values: Vec<f32>, shape: Vec<usize>, dtype: DType) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(values, shape).convert_dtype(dtype))
}

/// Runs `f` over the input's contiguous `f32` slices and its sizes.
fn with_rows<R>(input: &AttentionKernelInput<Flex>, f: impl FnOnce(&Rows<'_>, Dims) -> R) -> R {
    let [g, l, k] = dims3(&input.q);
    let [h, s, _] = dims3(&input.codebook);
    let v = dims3(&input.v)[2];
    let t = input.bias.shape()[2];
    let parts = [
        &input.q,
        &input.k,
        &input.v,
        &input.k_carried,
        &input.v_carried,
        &input.bias,
        &input.codebook,
        &input.log_counts,
        &input.shift,
        &input.count_weight,
        &input.means,
    ]
    .map(f32s);
    let slice = |i: usize| parts[i].storage::<f32>();
    let rows = Rows {
        q: slice(0),
        k: slice(1),
        v: slice(2),
        k_carried: slice(3),
        v_carried: slice(4),
        bias: slice(5),
        codebook: slice(6),
        log_counts: slice(7),
        shift: input.flags.shifted.then(|| slice(8)),
        count_weight: input.flags.weighted.then(|| slice(9)),
        means: slice(10),
        flags: input.flags,
        zeros: vec![
            0.0;
            if input.flags.mask_first {
                l * k.max(v)
            } else {
                0
            }
        ],
    };
    f(
        &rows,
        Dims {
            g,
            r: t / l,
            l,
            k,
            v,
            s,
            h,
        },
    )
}

/// The elements of an elementwise pass's chunk, each chunk a task for the
/// worker threads: a pass over fewer is not worth a second thread.
const MIN_ELEMENTS: usize = 1 << 15;

/// The int tensor `codes` as host values.
fn codes_of(codes: FlexTensor) -> Vec<i64> {
    codes
        .into_data()
        .convert::<i64>()
        .to_vec()
        .expect("int codes")
}

/// `x`'s shape `[B, T, D]` and the product's sizes `[B T, D, N]` for `w`
/// `[D, N]`, or `None` unless both are `f32`.
fn projection_sizes(x: &FlexTensor, w: &FlexTensor) -> Option<(Vec<usize>, [usize; 3])> {
    if x.dtype() != DType::F32 || w.dtype() != DType::F32 {
        return None;
    }
    let [b, t, d] = dims3(x);
    let n = w.shape()[1];
    assert_eq!(w.shape()[0], d, "the weight's rows are the input's width");
    Some((vec![b, t, d], [b * t, d, n]))
}

fn dims3(t: &FlexTensor) -> [usize; 3] {
    let shape = t.shape();
    [shape[0], shape[1], shape[2]]
}

impl VqKernels for Flex {
    fn vq_block_caches(
        carried_codes: FlexTensor,
        carried_values: FlexTensor,
        codes: FlexTensor,
        values: FlexTensor,
        counts: FlexTensor,
        means: FlexTensor,
        fresh: bool,
    ) -> BlockCaches<Self> {
        let dtype = values.dtype();
        let [g, n, w] = dims3(&values);
        let (s, l) = (counts.shape()[1], carried_codes.shape()[1]);
        let blocks = n / l;
        let (carried_codes, codes) = (codes_of(carried_codes), codes_of(codes));
        let (carried_values, values) = (f32s(&carried_values), f32s(&values));
        let (counts, means) = (f32s(&counts), f32s(&means));
        let (carried_values, values, carried, carried_means) = (
            carried_values.storage::<f32>(),
            values.storage::<f32>(),
            counts.storage::<f32>(),
            means.storage::<f32>(),
        );
        let mut out = [
            Vec::with_capacity(g * blocks * s),
            Vec::with_capacity(g * blocks * s * w),
            Vec::with_capacity(g * s),
            Vec::with_capacity(g * s * w),
        ];
        let [out_counts, out_means, after_counts, after_means] =
            out.each_mut().map(|o| o.spare_capacity_mut());
        // The running totals of one group's previous blocks so far.
        let (mut total, mut sums) = (vec![0.0f32; s], vec![0.0f32; s * w]);
        // Writes each of the `S` counts and `S W` means of the carried
        // cache (empty when fresh, and not read) with the running totals
        // merged in.
        let merge = |gi: usize,
                     total: &[f32],
                     sums: &[f32],
                     n_out: &mut [MaybeUninit<f32>],
                     m_out: &mut [MaybeUninit<f32>]| {
            for z in 0..s {
                let n_c = if fresh { 0.0 } else { carried[gi * s + z] };
                let n = n_c + total[z];
                let d = n.max(1.0);
                n_out[z].write(n);
                for (c, (m, &sum)) in m_out[z * w..][..w]
                    .iter_mut()
                    .zip(&sums[z * w..][..w])
                    .enumerate()
                {
                    let mu = if fresh {
                        0.0
                    } else {
                        carried_means[(gi * s + z) * w + c]
                    };
                    m.write(mu * (n_c / d) + sum / d);
                }
            }
        };
        for gi in 0..g {
            total.fill(0.0);
            sums.fill(0.0);
            for r in 0..blocks {
                let at = gi * blocks + r;
                merge(
                    gi,
                    &total,
                    &sums,
                    &mut out_counts[at * s..][..s],
                    &mut out_means[at * s * w..][..s * w],
                );
                // Block r's previous block: the carried one (none when
                // fresh), or block r - 1.
                let (codes, values) = match r {
                    0 if fresh => continue,
                    0 => (&carried_codes[gi * l..][..l], row(carried_values, gi, l, w)),
                    _ => (
                        &codes[gi * n + (r - 1) * l..][..l],
                        &values[(gi * n + (r - 1) * l) * w..][..l * w],
                    ),
                };
                for (t, &z) in codes.iter().enumerate() {
                    let z = z as usize;
                    if z < s {
                        total[z] += 1.0;
                        for (sum, v) in sums[z * w..][..w].iter_mut().zip(row(values, t, 1, w)) {
                            *sum += v;
                        }
                    }
                }
            }
            merge(
                gi,
                &total,
                &sums,
                &mut after_counts[gi * s..][..s],
                &mut after_means[gi * s * w..][..s * w],
            );
        }
        let lens = [g * blocks * s, g * blocks * s * w, g * s, g * s * w];
        for (o, len) in out.iter_mut().zip(lens) {
            // SAFETY: `merge` wrote the caches of each group's `blocks`
            // blocks and the one after them, every element.
            unsafe { o.set_len(len) };
        }
        let [out_counts, out_means, after_counts, after_means] = out;
        BlockCaches {
            counts: tensor(out_counts, vec![g, blocks, s], dtype),
            means: tensor(out_means, vec![g, blocks, s, w], dtype),
            counts_after: tensor(after_counts, vec![g, s], dtype),
            means_after: tensor(after_means, vec![g, s, w], dtype),
        }
    }

    fn vq_code_totals(
        codes: FlexTensor,
        weight: Option<FlexTensor>,
        values: FlexTensor,
        n_code: usize,
        rows: usize,
    ) -> CodeTotals<Self> {
        let dtype = values.dtype();
        let [g, n, w] = dims3(&values);
        let codes = codes_of(codes);
        let weight = weight.map(|t| f32s(&t));
        let weight = weight.as_ref().map(|t| t.storage::<f32>());
        let values = f32s(&values);
        let values = values.storage::<f32>();
        let mut counts = vec![0.0f32; rows * n_code];
        let mut sums = vec![0.0f32; rows * n_code * w];
        for gi in 0..g {
            let o = gi % rows;
            for t in 0..n {
                let z = codes[gi * n + t] as usize;
                if z >= n_code {
                    continue; // an empty slot
                }
                let wt = weight.map_or(1.0, |wt| wt[gi * n + t]);
                counts[o * n_code + z] += wt;
                let sum = &mut sums[(o * n_code + z) * w..][..w];
                for (s, v) in sum.iter_mut().zip(row(values, gi * n + t, 1, w)) {
                    *s += wt * v;
                }
            }
        }
        CodeTotals {
            counts: tensor(counts, vec![rows, n_code], dtype),
            sums: tensor(sums, vec![rows, n_code, w], dtype),
        }
    }

    fn vq_quantize(keys: FlexTensor, codebook: FlexTensor) -> Nearest<Self> {
        let dtype = keys.dtype();
        let [g, t, k] = dims3(&keys);
        let [h, s, _] = dims3(&codebook);
        let (keys, words) = (f32s(&keys), f32s(&codebook));
        let (keys, words) = (keys.storage::<f32>(), words.storage::<f32>());
        // Each head's codebook transposed, `[H, K, S]`.
        let words_t: Vec<f32> = (0..h * k * s)
            .map(|i| {
                let (head, j, code) = (i / (k * s), i / s % k, i % s);
                words[(head * s + code) * k + j]
            })
            .collect();
        let mut codes = Vec::<i32>::with_capacity(g * t);
        let mut chosen = Vec::<f32>::with_capacity(g * t * k);
        let mut error = Vec::<f32>::with_capacity(g * t);
        let mut norm = Vec::<f32>::with_capacity(g * t);
        // Tokens `n = gi T + ti` in chunks on the worker threads.
        const TOKENS: usize = 64;
        (
            codes.spare_capacity_mut()[..g * t].par_chunks_mut(TOKENS),
            chosen.spare_capacity_mut()[..g * t * k].par_chunks_mut(TOKENS * k),
            error.spare_capacity_mut()[..g * t].par_chunks_mut(TOKENS),
            norm.spare_capacity_mut()[..g * t].par_chunks_mut(TOKENS),
        )
            .into_par_iter()
            .enumerate()
            .for_each(|(chunk, (codes, chosen, error, norm))| {
                let mut dist = vec![0.0; s];
                for (i, code) in codes.iter_mut().enumerate() {
                    let n = chunk * TOKENS + i;
                    let head = (n / t) % h;
                    let key = &keys[n * k..][..k];
                    simd::distances(key, row(&words_t, head, k, s), &mut dist);
                    // `sum (k - C)^2` itself, ties to the lowest index, as
                    // the cubecl kernel's.
                    let (mut best, mut best_d) = (0, f32::INFINITY);
                    for (c, &d) in dist.iter().enumerate() {
                        if d < best_d {
                            (best, best_d) = (c, d);
                        }
                    }
                    code.write(best as i32);
                    let word = &row(words, head, s, k)[best * k..][..k];
                    chosen[i * k..][..k]
                        .iter_mut()
                        .zip(word)
                        .for_each(|(c, &x)| {
                            c.write(x);
                        });
                    error[i].write(best_d);
                    norm[i].write(key.iter().map(|a| a * a).sum());
                }
            });
        // SAFETY: each chunk's tokens wrote their code, codeword, error and
        // norm, every element.
        unsafe {
            codes.set_len(g * t);
            chosen.set_len(g * t * k);
            error.set_len(g * t);
            norm.set_len(g * t);
        }
        Nearest {
            codes: FlexTensor::from_data(TensorData::new(codes, [g, t])),
            words: tensor(chosen, vec![g, t, k], dtype),
            error: tensor(error, vec![g, t], dtype),
            norm: tensor(norm, vec![g, t], dtype),
        }
    }

    const SILU: bool = true;

    /// One vectorised pass (`simd`) on the worker threads, within a
    /// few ulp of burn's ops (its own exponential, not libm's); other float
    /// types than `f32` compose.
    fn vq_silu(x: FlexTensor) -> FlexTensor {
        if x.dtype() != DType::F32 {
            return composed_silu::<Self>(x);
        }
        let shape = x.shape().to_vec();
        let x = x.to_contiguous();
        let x = x.storage::<f32>();
        let mut y = Vec::with_capacity(x.len());
        (
            y.spare_capacity_mut()[..x.len()].par_chunks_mut(MIN_ELEMENTS),
            x.par_chunks(MIN_ELEMENTS),
        )
            .into_par_iter()
            .for_each(|(y, x)| simd::silu(x, y));
        // SAFETY: `simd::silu` wrote every element of every chunk.
        unsafe { y.set_len(x.len()) };
        tensor(y, shape, DType::F32)
    }

    /// One pass, as [`Self::vq_silu`]: `g s + g x s (1 - s)`, each product
    /// in the composed backward's order.
    fn vq_silu_backward(x: FlexTensor, grad: FlexTensor) -> FlexTensor {
        if x.dtype() != DType::F32 || grad.dtype() != DType::F32 {
            return composed_silu_backward::<Self>(x, grad);
        }
        let x = x.to_contiguous();
        let x = x.storage::<f32>();
        // The gradient's own buffer takes `dx` where nothing else holds it.
        let mut dx = whole_f32s(grad);
        let g = dx.storage_mut::<f32>();
        assert_eq!(g.len(), x.len(), "the gradient has the input's shape");
        (g.par_chunks_mut(MIN_ELEMENTS), x.par_chunks(MIN_ELEMENTS))
            .into_par_iter()
            .for_each(|(g, x)| simd::silu_backward(x, g));
        dx
    }

    const SUMS_SQUARES: bool = true;

    /// Each tensor's squares summed in `f64`, chunk by chunk on the worker
    /// threads.
    fn vq_sum_squares(tensors: Vec<FlexTensor>) -> Option<FlexTensor> {
        if tensors.iter().any(|t| t.dtype() != DType::F32) {
            return None;
        }
        let square = |x: &f32| f64::from(*x) * f64::from(*x);
        let total: f64 = tensors
            .iter()
            .map(|t| {
                let t = t.to_contiguous();
                let chunks = t.storage::<f32>().par_chunks(MIN_ELEMENTS);
                chunks
                    .map(|c| c.iter().map(square).sum::<f64>())
                    .sum::<f64>()
            })
            .sum();
        Some(tensor(vec![total as f32], vec![1], DType::F32))
    }

    const STEPS_ADAMW: bool = true;

    /// Parameters on the worker threads, each in three passes (the two
    /// moments, then the parameter from them): the operations of the
    /// cubecl kernel, in its order, so the same bits.
    fn vq_adamw(tensors: Vec<FlexTensor>, table: FlexTensor) -> Option<Vec<FlexTensor>> {
        if table.dtype() != DType::F32 || tensors.iter().any(|t| t.dtype() != DType::F32) {
            return None;
        }
        let table = table.to_contiguous();
        let table = table.storage::<f32>();
        let stepped: Vec<[FlexTensor; 3]> = tensors
            .par_chunks(4)
            .zip(table.par_chunks(ROW))
            .map(|(four, row)| {
                let [lr, keep, c1, c2, beta1, rest1, beta2, rest2, epsilon, scale] =
                    row.try_into().expect("a row of the table");
                let shape = four[0].shape().to_vec();
                let [p, g, m1, m2] = [0, 1, 2, 3].map(|i| four[i].to_contiguous());
                let [p, g, m1, m2] = [&p, &g, &m1, &m2].map(|t| t.storage::<f32>());
                let a: Vec<f32> = (m1.iter().zip(g))
                    .map(|(&m, &g)| m * beta1 + g * scale * rest1)
                    .collect();
                let b: Vec<f32> = (m2.iter().zip(g))
                    .map(|(&m, &g)| {
                        let g = g * scale;
                        m * beta2 + g * g * rest2
                    })
                    .collect();
                let new: Vec<f32> = (p.iter().zip(&a).zip(&b))
                    .map(|((&p, &a), &b)| p * keep - (a / c1) / ((b / c2).sqrt() + epsilon) * lr)
                    .collect();
                [new, a, b].map(|v| tensor(v, shape.clone(), DType::F32))
            })
            .collect();
        Some(stepped.into_iter().flatten().collect())
    }

    const PROJECTS: bool = true;

    /// One gemm per block over all `B T` rows, its columns of `w` read in
    /// place.
    fn vq_column_products(
        x: FlexTensor,
        w: FlexTensor,
        widths: &[usize],
    ) -> Option<Vec<FlexTensor>> {
        let (shape, [m, d, n]) = projection_sizes(&x, &w)?;
        let (x, w) = (x.to_contiguous(), w.to_contiguous());
        let (x, w) = (x.storage::<f32>(), w.storage::<f32>());
        let mut start = 0;
        let products = widths.iter().map(|&width| {
            let (x, w) = (Mat::dense(x, m, d), columns(w, d, n, start, width));
            let y = fresh_product(x, w, parallelism(x, w)); // [B T, width]
            start += width;
            let mut shape = shape.clone();
            shape[2] = width;
            tensor(y, shape, DType::F32)
        });
        Some(products.collect())
    }

    /// `dx` accumulated block by block in one buffer, each block's `dw`
    /// written into its columns of one `[D, N]` buffer.
    fn vq_column_backward(
        x: FlexTensor,
        w: FlexTensor,
        dys: Vec<FlexTensor>,
    ) -> Option<[FlexTensor; 2]> {
        let (shape, [m, d, n]) = projection_sizes(&x, &w)?;
        if dys.is_empty() || dys.iter().any(|dy| dy.dtype() != DType::F32) {
            return None;
        }
        let widths: usize = dys.iter().map(|dy| dy.shape()[2]).sum();
        assert_eq!(widths, n, "the blocks' widths cover the weight's columns");
        let (x, w) = (x.to_contiguous(), w.to_contiguous());
        let (x, w) = (x.storage::<f32>(), w.storage::<f32>());
        let mut dx = Vec::new(); // [B T, D]
        let mut dw = Vec::<f32>::with_capacity(d * n); // [D, N]
        let mut start = 0;
        for dy in &dys {
            let width = dy.shape()[2];
            let dy = dy.to_contiguous();
            let dy = Mat::dense(dy.storage::<f32>(), m, width); // [B T, width]
            let w_t = columns(w, d, n, start, width).t(); // [width, D]
            if start == 0 {
                dx = fresh_product(dy, w_t, parallelism(dy, w_t));
            } else {
                parallel_matmul(&mut dx, d, true, dy, w_t);
            }
            let x_t = Mat::dense(x, m, d).t();
            // SAFETY: `dw` has room for `D N` elements; this block writes
            // (`acc` false) its columns `start..start + width` of every row.
            unsafe {
                let at = dw.as_mut_ptr().add(start);
                product_to(
                    at,
                    (d * n).saturating_sub(start),
                    n,
                    false,
                    x_t,
                    dy,
                    parallelism(x_t, dy),
                );
            }
            start += width;
        }
        // SAFETY: the blocks' columns cover all `N` (asserted above), so
        // every element of `dw` was written.
        unsafe { dw.set_len(d * n) };
        Some([
            tensor(dx, shape, DType::F32),
            tensor(dw, vec![d, n], DType::F32),
        ])
    }

    fn vq_attention_forward(input: &AttentionKernelInput<Self>) -> (FlexTensor, FlexTensor) {
        let dtype = input.q.dtype();
        let (out, lse, [g, l, v]) = with_rows(input, |x, d| {
            let (out, lse) = forward(x, d);
            (out, lse, [d.g, d.l, d.v])
        });
        (
            tensor(out, vec![g, l, v], dtype),
            tensor(lse, vec![g, l], DType::F32),
        )
    }

    fn vq_attention_backward(
        input: AttentionKernelInput<Self>,
        out: FlexTensor,
        lse: FlexTensor,
        grad: FlexTensor,
    ) -> AttentionKernelGrads<Self> {
        let dtype = input.q.dtype();
        let bias_shape = input.bias.shape().to_vec();
        let (out, lse, grad) = (f32s(&out), f32s(&lse), f32s(&grad));
        let (grads, d) = with_rows(&input, |x, d| {
            (
                backward(x, d, out.storage(), lse.storage(), grad.storage()),
                d,
            )
        });
        let (gs, l, k, v, s) = (d.g, d.l, d.k, d.v, d.s);
        AttentionKernelGrads {
            q: tensor(grads.q, vec![gs, l, k], dtype),
            k: tensor(grads.k, vec![gs, l, k], dtype),
            v: tensor(grads.v, vec![gs, l, v], dtype),
            bias: tensor(grads.bias, bias_shape, dtype),
            means: tensor(grads.means, vec![gs, s, v], dtype),
            count_weight: tensor(grads.count_weight, vec![gs, l], dtype),
        }
    }
}
