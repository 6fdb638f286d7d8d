//! The CPU kernels' passes over `f32` slices, written so that the compiler
//! vectorises them: the exponential is a polynomial with bit-level scaling
//! instead of libm's scalar `expf` call, a key's distances run along the
//! codes, and each pass is compiled for AVX-512 and AVX2 beside the
//! baseline and picked at run time. The three versions do the same IEEE
//! operations in the same order (no fused multiply-add), so they give the
//! same bits on every x86 CPU.

use std::mem::MaybeUninit;

/// Defines `pub(super) fn $name(..)` from a body compiled three times on
/// x86-64 (AVX-512, AVX2, baseline), the widest the CPU has chosen at run
/// time; other targets compile the body once.
macro_rules! vectorised {
    ($(#[$doc:meta])* fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $body:block) => {
        $(#[$doc])*
        pub(super) fn $name($($arg: $ty),*) {
            #[inline(always)]
            fn body($($arg: $ty),*) $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f")]
                fn avx512($($arg: $ty),*) {
                    body($($arg),*)
                }
                #[target_feature(enable = "avx2")]
                fn avx2($($arg: $ty),*) {
                    body($($arg),*)
                }
                if std::arch::is_x86_feature_detected!("avx512f") {
                    // SAFETY: the CPU has the feature, checked just above.
                    return unsafe { avx512($($arg),*) };
                }
                if std::arch::is_x86_feature_detected!("avx2") {
                    // SAFETY: as above.
                    return unsafe { avx2($($arg),*) };
                }
            }
            body($($arg),*)
        }
    };
}

/// `e^x` within 2 ulp for normal results: `0` below `ln` of the smallest
/// normal `f32` (so a masked score's `-inf` gives exactly 0), `+inf` above
/// 88.37 (just under `127.5 ln 2`, so that `n <= 127`), NaN for NaN.
/// `e^x = 2^n e^r` with `n = round(x / ln 2)`, `|r| <= ln 2 / 2`, `e^r` by
/// Cephes' minimax polynomial for `expf`, and `2^n` written straight into
/// the exponent bits.
#[inline(always)]
pub(super) fn exp(x: f32) -> f32 {
    const LO: f32 = -87.336_54;
    const HI: f32 = 88.37;
    // 1.5 * 2^23: adding it rounds to an integer, held in the low mantissa bits.
    const ROUND: f32 = 12_582_912.0;
    // ln 2 in two parts: `n * LN2_HI` is exact for the `n` that occur.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let c = x.clamp(LO, HI);
    let t = c * std::f32::consts::LOG2_E + ROUND;
    let n = t - ROUND;
    let r = c - n * LN2_HI - n * LN2_LO;
    let p = ((((1.987_569_2e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r
        + 0.166_666_65)
        * r
        + 0.5;
    let e_r = p * r * r + r + 1.0;
    // n in -126..=127: a normal power of two.
    let n_bits = t.to_bits().wrapping_sub(ROUND.to_bits());
    let two_n = f32::from_bits(n_bits.wrapping_add(127) << 23);
    if x < LO {
        0.0
    } else if x > HI {
        f32::INFINITY
    } else {
        e_r * two_n
    }
}

/// `1 / (1 + e^-x)`: 0 below -88.37.
#[inline(always)]
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

vectorised!(
    /// `xs[i] = e^(xs[i] - shift)`.
    fn exp_shifted(xs: &mut [f32], shift: f32) {
        for x in xs {
            *x = exp(*x - shift);
        }
    }
);

vectorised!(
    /// `y = x sigmoid(x)`, every element of `y` written; the slices have
    /// one length.
    fn silu(x: &[f32], y: &mut [MaybeUninit<f32>]) {
        assert_eq!(x.len(), y.len(), "one length");
        for (y, &x) in y.iter_mut().zip(x) {
            y.write(x * sigmoid(x));
        }
    }
);

vectorised!(
    /// SiLU's backward step, in place on the upstream gradient: `g` becomes
    /// `g s + g x s (1 - s)`, `s = sigmoid(x)`, in the composed backward's
    /// order.
    fn silu_backward(x: &[f32], g: &mut [f32]) {
        for (g, &x) in g.iter_mut().zip(x) {
            let s = sigmoid(x);
            *g = *g * s + *g * x * s * (1.0 - s);
        }
    }
);

vectorised!(
    /// A key's squared distances to every code, `dist[c] = sum_j (key[j] -
    /// words_t[j][c])^2`, from the codebook transposed, `words_t` `[K, S]`
    /// with `S = dist.len()`: each sum in the order of `j`, as the cubecl
    /// quantizer's, while the vector lanes run along the codes.
    fn distances(key: &[f32], words_t: &[f32], dist: &mut [f32]) {
        dist.fill(0.0);
        if dist.is_empty() {
            return;
        }
        for (&a, column) in key.iter().zip(words_t.chunks_exact(dist.len())) {
            for (d, &c) in dist.iter_mut().zip(column) {
                *d += (a - c) * (a - c);
            }
        }
    }
);

#[cfg(test)]
mod tests {
    use super::*;

    /// Distance in units in the last place between two finite `f32`s of one sign.
    fn ulps(a: f32, b: f32) -> u32 {
        a.to_bits().abs_diff(b.to_bits())
    }

    #[test]
    fn exp_is_within_two_ulp_over_its_range() {
        let mut worst = 0;
        let mut x = -87.3f32;
        while x < 88.3 {
            let want = f64::from(x).exp() as f32;
            worst = worst.max(ulps(exp(x), want));
            x += 1.3e-4;
        }
        assert!(worst <= 2, "{worst} ulp");
        assert_eq!(exp(0.0), 1.0);
    }

    #[test]
    fn exp_ends_and_specials() {
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(-100.0), 0.0);
        assert_eq!(exp(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp(89.0), f32::INFINITY);
        assert!(exp(f32::NAN).is_nan());
        // 2^n at the ends of the scaled range.
        assert!(ulps(exp(-87.0), (-87.0f64).exp() as f32) <= 2);
        assert!(ulps(exp(88.3), f64::from(88.3f32).exp() as f32) <= 2);
    }

    /// The dispatched passes (the widest version this CPU has) give the
    /// bits of the scalar functions and sums, including in a vector loop's
    /// tail.
    #[test]
    fn passes_match_the_scalar_function() {
        let x: Vec<f32> = (0..1003).map(|i| (i as f32 * 0.731).sin() * 40.0).collect();
        let g: Vec<f32> = (0..1003).map(|i| (i as f32 * 0.277).cos()).collect();
        let mut y = vec![MaybeUninit::new(f32::NAN); x.len()];
        silu(&x, &mut y);
        let mut dx = g.clone();
        silu_backward(&x, &mut dx);
        let mut e = x.clone();
        exp_shifted(&mut e, 3.0);
        let (k, s) = (7, 45);
        let (key, words_t) = (&x[..k], &x[k..k + k * s]);
        let mut dist = vec![f32::NAN; s];
        distances(key, words_t, &mut dist);
        for (c, &d) in dist.iter().enumerate() {
            let want: f32 = (0..k).map(|j| (key[j] - words_t[j * s + c]).powi(2)).sum();
            assert_eq!(d.to_bits(), want.to_bits(), "code {c}");
        }
        for i in 0..x.len() {
            let s = sigmoid(x[i]);
            // SAFETY: initialised (to NaN) before the pass.
            let y = unsafe { y[i].assume_init() };
            assert_eq!(y.to_bits(), (x[i] * s).to_bits());
            let d = g[i] * s + g[i] * x[i] * s * (1.0 - s);
            assert_eq!(dx[i].to_bits(), d.to_bits());
            assert_eq!(e[i].to_bits(), exp(x[i] - 3.0).to_bits());
        }
    }
}
