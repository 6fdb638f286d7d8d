//! `tvq bench products`: the rate of each matrix product of the model's
//! forward pass at its own shapes ([`TransformerVqConfig::matrix_products`]),
//! by sequence length and precision, and of the two products of its
//! backward pass (the [`Pass`]es), so that a step's speed can be read
//! against what the device's products reach at those shapes (and against
//! PyTorch's: `scripts/torch_reference.py products` times the same shapes
//! from this benchmark's JSON lines).
//!
//! With `--strategies` (wgpu, CUDA) each product is timed once for each of
//! cubek's strategies that burn's autotuning chooses among (the
//! [`strategies`] below), beside burn's untuned choice (`auto`, what the
//! unfused build runs): the best of them is the most a tuned build of
//! burn 0.21 can reach at that shape, and each strategy's result is
//! checked against `auto`'s, so that a fast row is never a wrong one.

use std::collections::HashSet;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use burn::Dispatch;
use burn::DispatchDevice;
use burn::backend::wgpu::WgpuRuntime;
use burn::prelude::*;
use burn::tensor::{Distribution, TensorPrimitive};
use burn_cubecl::cubecl::cuda::CudaRuntime;
use burn_cubecl::kernel::matmul::{MatmulStrategy, init_matmul_output, matmul};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{CubeBackend, CubeRuntime};
use cubek::matmul::components::tile::TileMatmulKind;
use cubek::matmul::definition::{MatmulElems, MatmulGlobalElems};
use cubek::matmul::launch::{Strategy, launch_ref};
use cubek::matmul::routines::BlueprintStrategy::Inferred;
use cubek::matmul::routines::TileSizeSelection;
use cubek::matmul::routines::double_buffering::DoubleBufferingArgs;
use cubek::matmul::routines::double_unit::DoubleUnitSelectionArgs;
use cubek::matmul::routines::ordered_double_buffering::OrderedSelectionArgs;
use cubek::matmul::routines::simple::SimpleArgs;
use cubek::matmul::routines::simple_unit::SimpleUnitSelectionArgs;
use cubek::std::InputBinding;
use serde_json::json;
use tvq_model::{MatrixProduct, Precision, TransformerVqConfig};

use super::{BenchArgs, parse_form};

/// How long each product is repeated for: long enough that launch and
/// synchronisation costs do not dominate a small product on a GPU.
const TIMED_SECONDS: f64 = 0.1;

/// Times every matrix product of `model`'s forward pass (each --form, each
/// --seq-len with --batch rows, each precision) on `device` in each
/// [`Pass`]; a product is listed once where several forms share it, and
/// one whose operands or output would exceed --max-score-gib is skipped
/// with a row that says so. With --strategies, each product once for each
/// strategy.
pub(super) fn run(
    args: &BenchArgs,
    model: &TransformerVqConfig,
    precisions: &[Precision],
    (device, info): (&DispatchDevice, &str),
) -> Result<()> {
    if args.strategies && !matches!(device, DispatchDevice::Wgpu(_) | DispatchDevice::Cuda(_)) {
        bail!("--strategies times cubek's kernels: use --device wgpu or cuda");
    }
    // Every form and length checked before the header, so that a bad flag
    // gives its error alone.
    let forms = args
        .form
        .iter()
        .map(|form| {
            let cfg = model
                .clone()
                .with_vocab_size(args.vocab_size as usize)
                .with_attention(parse_form(form)?);
            let uneven = args
                .seq_len
                .iter()
                .find(|t| !t.is_multiple_of(cfg.block_len));
            if cfg.attention == tvq_model::AttentionForm::Vq
                && let Some(t) = uneven
            {
                anyhow::bail!(
                    "--seq-len {t} is not a multiple of the block length {}",
                    cfg.block_len
                );
            }
            Ok((form.as_str(), cfg))
        })
        .collect::<Result<Vec<_>>>()?;
    if !args.json {
        println!("device: {info}; batch {}", args.batch);
        println!(
            "{:<10} {:>8} {:>9} {:<32} {:<10} {:>26} {:>12}{}",
            "form",
            "seq_len",
            "precision",
            "product",
            "pass",
            "batch x [m, k] x [k, n]",
            "GFLOP/s",
            if args.strategies {
                "  rel. diff  strategy"
            } else {
                ""
            }
        );
    }
    // Each pass's products in turn, the forward pass's first: what a run
    // cut short (the bundle's time limits) keeps.
    for &t in &args.seq_len {
        for &precision in precisions {
            for pass in Pass::ALL {
                let mut measured = HashSet::new();
                for (form, cfg) in &forms {
                    for product in cfg.matrix_products(args.batch, t) {
                        if !measured.insert(product) {
                            continue;
                        }
                        let print = |strategy: Option<&str>, rate| {
                            let row = Row {
                                form,
                                t,
                                precision,
                                product: &product,
                                pass,
                                strategy,
                                rate,
                                info,
                            };
                            row.print(args)
                        };
                        let context = || format!("{} ({}) at T = {t}", product.name, pass.name());
                        let on = (&product, pass, precision, args.max_score_gib);
                        if args.strategies {
                            let each = |name: &str, rate| print(Some(name), rate);
                            match device {
                                DispatchDevice::Wgpu(d) => {
                                    time_strategies::<WgpuRuntime>(on, d, each)
                                }
                                DispatchDevice::Cuda(d) => {
                                    time_strategies::<CudaRuntime>(on, d, each)
                                }
                                _ => unreachable!("checked above"),
                            }
                            .with_context(context)?;
                        } else {
                            let rate = time_product(on, device).with_context(context)?;
                            print(None, rate.map_or(Rate::Skipped, Rate::Timed));
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

/// One of the three products a [`MatrixProduct`] costs a training step:
/// the forward pass's `C = A B` and the backward pass's two gradients,
/// which burn's autodiff computes on a transposed view of an operand
/// (`dA = dC B^T`, `dB = A^T dC`): layouts of their own to a kernel, and
/// so to the tuner.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Pass {
    /// `A [m, k] x B [k, n]`.
    Forward,
    /// `dC [m, n] x B^T [n, k]`, `B` read through the transposed view.
    GradLeft,
    /// `A^T [k, m] x dC [m, n]`, `A` read through the transposed view.
    GradRight,
}

impl Pass {
    /// Every pass, in the order they are timed.
    const ALL: [Self; 3] = [Self::Forward, Self::GradLeft, Self::GradRight];

    /// Its name in the JSON lines and the table.
    fn name(self) -> &'static str {
        match self {
            Self::Forward => "forward",
            Self::GradLeft => "grad_left",
            Self::GradRight => "grad_right",
        }
    }

    /// The pass's two operands as they are stored, `[batch, rows,
    /// columns]`, each with whether the product reads it transposed (its
    /// last two axes swapped, a view), as burn's autodiff hands them over.
    fn operands(self, p: &MatrixProduct) -> [([usize; 3], bool); 2] {
        let (b, m, k, n) = (p.batch, p.m, p.k, p.n);
        match self {
            Self::Forward => [([b, m, k], false), ([b, k, n], false)],
            Self::GradLeft => [([b, m, n], false), ([b, k, n], true)],
            Self::GradRight => [([b, m, k], true), ([b, m, n], false)],
        }
    }

    /// Random operands of the pass in `precision` on `device`, laid out
    /// as [`Self::operands`] says (a transposed one a view).
    fn random<B: Backend>(
        self,
        p: &MatrixProduct,
        precision: Precision,
        device: &B::Device,
    ) -> [Tensor<B, 3>; 2] {
        self.operands(p).map(|(shape, transposed)| {
            let t = Tensor::<B, 3>::random(shape, Distribution::Default, device)
                .cast(precision.dtype());
            if transposed { t.swap_dims(1, 2) } else { t }
        })
    }

    /// The shape of its result: `C`'s, `dA`'s or `dB`'s.
    fn output(self, p: &MatrixProduct) -> [usize; 3] {
        let (b, m, k, n) = (p.batch, p.m, p.k, p.n);
        match self {
            Self::Forward => [b, m, n],
            Self::GradLeft => [b, m, k],
            Self::GradRight => [b, k, n],
        }
    }
}

/// Whether the product's operands and output all fit within `max_gib` (the
/// same three matrices in every [`Pass`]).
fn fits(p: &MatrixProduct, max_gib: f64) -> bool {
    let largest = [p.m * p.k, p.k * p.n, p.m * p.n]
        .into_iter()
        .max()
        .unwrap_or(0);
    (p.batch * largest * 4) as f64 <= max_gib * (1u64 << 30) as f64
}

/// `launch` once untimed (compilation, tuning), then in rounds of doubling
/// length until a round lasts [`TIMED_SECONDS`], `sync` at the end of
/// each: FLOP/s of products of `flops` each.
fn timed(flops: f64, mut launch: impl FnMut(), sync: impl Fn() -> Result<()>) -> Result<f64> {
    launch();
    sync()?;
    let mut rounds = 1usize;
    loop {
        let start = Instant::now();
        for _ in 0..rounds {
            launch();
        }
        sync()?;
        let seconds = start.elapsed().as_secs_f64();
        if seconds >= TIMED_SECONDS {
            return Ok(rounds as f64 * flops / seconds);
        }
        rounds *= 2;
    }
}

/// The product's rate in FLOP/s in `pass` through burn's `matmul` (the
/// build's own choice of kernel), or `None` where it does not [`fits`]:
/// random operands of its shape in `precision`.
fn time_product(
    (p, pass, precision, max_gib): (&MatrixProduct, Pass, Precision, f64),
    device: &DispatchDevice,
) -> Result<Option<f64>> {
    if !fits(p, max_gib) {
        return Ok(None);
    }
    let [a, b] = pass.random::<Dispatch>(p, precision, device);
    let sync = || Dispatch::sync(device).context("synchronising the device");
    timed(p.flops_once(), || drop(a.clone().matmul(b.clone())), sync).map(Some)
}

/// The strategies burn's matrix-product autotuning chooses among for a
/// general product (burn-cubecl 0.21's `matmul_autotune`, without its
/// naive fallback and its matrix-vector kernels): units' tiles, and the
/// accelerated ones on `cmma` (cubecl's warp matrices) or `mma` (PTX's),
/// cyclic, double-buffered, ordered, specialized and TMA loading.
fn strategies() -> Vec<Strategy> {
    let mut list = Vec::new();
    for tile_size in [
        TileSizeSelection::MaxTileSize,
        TileSizeSelection::MinTileSize,
    ] {
        list.push(Strategy::SimpleUnit(Inferred(SimpleUnitSelectionArgs {
            tile_size,
        })));
        list.push(Strategy::DoubleUnit(Inferred(DoubleUnitSelectionArgs {
            tile_size,
        })));
    }
    for tile_matmul in [TileMatmulKind::Cmma, TileMatmulKind::Mma] {
        let cmma = tile_matmul == TileMatmulKind::Cmma;
        for multi_rows in [false, true] {
            let simple = SimpleArgs {
                multi_rows,
                tile_matmul,
            };
            list.push(if cmma {
                Strategy::SimpleCyclicCmma(Inferred(simple.clone()))
            } else {
                Strategy::SimpleCyclicMma(Inferred(simple.clone()))
            });
            list.push(if cmma {
                Strategy::SimpleTmaCmma(Inferred(simple))
            } else {
                Strategy::SimpleTmaMma(Inferred(simple))
            });
        }
        for row_count in [4, 8] {
            let ordered = Inferred(OrderedSelectionArgs {
                partition_k: Some(2),
                row_count: Some(row_count),
                rows_per_plane: Some(2),
                tile_matmul,
            });
            list.push(if cmma {
                Strategy::OrderedDoubleCmma(ordered)
            } else {
                Strategy::OrderedDoubleMma(ordered)
            });
        }
        for specialized in [false, true] {
            let double = Inferred(DoubleBufferingArgs {
                specialized,
                tile_matmul,
            });
            list.push(if cmma {
                Strategy::DoubleCyclicCmma(double)
            } else {
                Strategy::DoubleCyclicMma(double)
            });
        }
        list.extend(if cmma {
            [
                Strategy::SpecializedCyclicCmma(Inferred(().into())),
                Strategy::SpecializedTmaCmma(Inferred(().into())),
            ]
        } else {
            [
                Strategy::SpecializedCyclicMma(Inferred(().into())),
                Strategy::SpecializedTmaMma(Inferred(().into())),
            ]
        });
    }
    list
}

/// Times the product `p` in `pass` and `precision` with burn's untuned
/// choice (`auto`) and then each of [`strategies`], handing each one's
/// name and [`Rate`] to `each` as it is measured; a strategy that cannot
/// run the product on this device (cubek refuses its setup) is
/// unavailable, and every other one's result is compared with `auto`'s.
fn time_strategies<R: CubeRuntime>(
    (p, pass, precision, max_gib): (&MatrixProduct, Pass, Precision, f64),
    device: &R::Device,
    mut each: impl FnMut(&str, Rate),
) -> Result<()> {
    type B<R> = CubeBackend<R, f32, i32, u32>;
    if !fits(p, max_gib) {
        each("auto", Rate::Skipped);
        return Ok(());
    }
    let dtype: burn::tensor::DType = precision.dtype().into();
    let [lhs, rhs] = pass
        .random::<B<R>>(p, precision, device)
        .map(|t| t.into_primitive().tensor());
    let host = |out: CubeTensor<R>| -> Vec<f32> {
        let t = Tensor::<B<R>, 3>::from_primitive(TensorPrimitive::Float(out));
        t.into_data()
            .convert::<f32>()
            .into_vec()
            .unwrap_or_default()
    };
    let sync = || B::<R>::sync(device).context("synchronising the device");
    let auto = || {
        let out = matmul(lhs.clone(), rhs.clone(), None, MatmulStrategy::Cube, dtype);
        out.map_err(|e| anyhow::anyhow!("burn's matmul: {e:?}"))
    };
    let expected = host(auto()?);
    let scale = expected
        .iter()
        .fold(0.0f32, |m, x| m.max(x.abs()))
        .max(f32::MIN_POSITIVE);
    let rate = timed(p.flops_once(), || drop(auto()), sync)?;
    each("auto", Rate::Timed(rate));
    // An output that a strategy which wrote nothing would leave as it was:
    // NaN (a fresh buffer may hold the last product, its memory reused).
    let unwritten = || -> CubeTensor<R> {
        let t = Tensor::<B<R>, 3>::full(pass.output(p), f32::NAN, device).cast(precision.dtype());
        t.into_primitive().tensor()
    };
    for strategy in strategies() {
        let launch = |out: CubeTensor<R>| {
            let globals = MatmulGlobalElems {
                lhs: dtype.into(),
                rhs: dtype.into(),
                out: dtype.into(),
            };
            let bind = |t: &CubeTensor<R>| InputBinding::new(t.clone().binding(), dtype.into());
            let client = out.client.clone();
            launch_ref(
                &strategy,
                &client,
                bind(&lhs),
                bind(&rhs),
                out.clone().binding(),
                &mut MatmulElems::from_globals(&globals),
            )
            .map(|()| out)
        };
        let name = strategy.to_string();
        match launch(unwritten()) {
            Err(refused) => each(
                &name,
                Rate::Unavailable(format!("{refused:?}").trim().into()),
            ),
            Ok(out) => {
                let diff = host(out).iter().zip(&expected).fold(0.0f64, |m, (a, b)| {
                    let d = f64::from((a - b).abs());
                    if d.is_nan() {
                        f64::from(f32::MAX)
                    } else {
                        m.max(d)
                    }
                });
                let fresh = || init_matmul_output(&lhs, &rhs, dtype);
                let rate = timed(p.flops_once(), || drop(launch(fresh())), sync)?;
                each(&name, Rate::Checked(rate, diff / f64::from(scale)));
            }
        }
    }
    Ok(())
}

/// What one row reports.
enum Rate {
    /// FLOP/s.
    Timed(f64),
    /// FLOP/s, and the largest difference from `auto`'s result relative
    /// to its largest entry.
    Checked(f64, f64),
    /// Over --max-score-gib.
    Skipped,
    /// The strategy cannot run the product on this device: cubek's reason.
    Unavailable(String),
}

/// One product's line.
struct Row<'a> {
    form: &'a str,
    t: usize,
    precision: Precision,
    product: &'a MatrixProduct,
    pass: Pass,
    strategy: Option<&'a str>,
    rate: Rate,
    info: &'a str,
}

impl Row<'_> {
    fn print(&self, args: &BenchArgs) {
        let Self {
            form,
            t,
            precision,
            product: p,
            pass,
            ..
        } = *self;
        if args.json {
            let mut row = json!({
                "form": "products", "attention": form, "seq_len": t, "rows": args.batch,
                "precision": precision, "name": p.name, "pass": pass.name(), "count": p.count,
                "batch": p.batch,
                "m": p.m, "k": p.k, "n": p.n, "flops": p.flops_once(), "device": self.info,
            });
            if let Some(strategy) = self.strategy {
                row["strategy"] = json!(strategy);
            }
            match &self.rate {
                Rate::Timed(rate) => row["flops_per_s"] = json!(rate),
                Rate::Checked(rate, diff) => {
                    row["flops_per_s"] = json!(rate);
                    row["max_rel_diff"] = json!(diff);
                }
                Rate::Skipped => {
                    row["skipped"] = json!(format!("over --max-score-gib {}", args.max_score_gib))
                }
                Rate::Unavailable(why) => row["unavailable"] = json!(why),
            }
            println!("{row}");
        } else {
            let shape = format!("{} x [{}, {}] x [{}, {}]", p.batch, p.m, p.k, p.k, p.n);
            let (shown, diff) = match &self.rate {
                Rate::Timed(r) => (format!("{:.1}", r / 1e9), String::new()),
                Rate::Checked(r, d) => (format!("{:.1}", r / 1e9), format!("{d:.1e}")),
                Rate::Skipped => ("skipped".into(), String::new()),
                Rate::Unavailable(_) => ("unavailable".into(), String::new()),
            };
            let strategy = self
                .strategy
                .map_or(String::new(), |s| format!("  {diff:>9}  {s}"));
            println!(
                "{form:<10} {t:>8} {precision:>9} {:<32} {:<10} {shape:>26} {shown:>12}{strategy}",
                p.name,
                pass.name()
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use burn::backend::flex::Flex;

    use super::*;

    /// Each pass multiplies the operands a step's backward pass does: with
    /// `C = A B` and a gradient `dC`, `grad_left` is `dA = dC B^T` and
    /// `grad_right` is `dB = A^T dC`, so `<dA, A> = <dB, B> = <dC, C>`;
    /// and its result has the shape [`Pass::output`] says.
    #[test]
    fn each_pass_is_a_gradient_of_the_forward_product() {
        let device = Default::default();
        let p = MatrixProduct {
            name: "test",
            count: 1,
            batch: 2,
            m: 5,
            k: 3,
            n: 4,
        };
        let random =
            |shape: [usize; 3]| Tensor::<Flex, 3>::random(shape, Distribution::Default, &device);
        let [a, b, dc] = [[2, 5, 3], [2, 3, 4], [2, 5, 4]].map(random);
        let inner =
            |x: &Tensor<Flex, 3>, y: &Tensor<Flex, 3>| (x.clone() * y.clone()).sum().into_scalar();
        let c = a.clone().matmul(b.clone());
        let expected = inner(&dc, &c);
        for pass in Pass::ALL {
            // The stored operands, told apart by shape (all three differ).
            let [lhs, rhs] = pass.operands(&p).map(|(shape, transposed)| {
                let stored = [&a, &b, &dc]
                    .into_iter()
                    .find(|t| t.dims() == shape)
                    .expect("a stored operand of the product")
                    .clone();
                if transposed {
                    stored.swap_dims(1, 2)
                } else {
                    stored
                }
            });
            let out = lhs.matmul(rhs);
            assert_eq!(out.dims(), pass.output(&p), "{pass:?}");
            let got = match pass {
                Pass::Forward => inner(&dc, &out),
                Pass::GradLeft => inner(&a, &out),
                Pass::GradRight => inner(&b, &out),
            };
            assert!(
                (got - expected).abs() < 1e-4 * expected.abs().max(1.0),
                "{pass:?}: {got} against {expected}"
            );
        }
    }
}
