//! Parity with the official JAX implementation: every fixture directory
//! under `TVQ_FIXTURES` (default: this crate's `tests/fixtures`) is imported
//! through `tvq_model::official` and must reproduce the official log-probs,
//! codes, losses, gradients, carried state and EMA codebook update.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use burn::module::Param;
use burn::optim::GradientsParams;
use burn::prelude::*;
use safetensors::SafeTensors;
use tvq_model::official::{self, OfficialConfig, OfficialTensor, OfficialVisitor};
use tvq_model::{Loss, ModelState, Pass, TransformerVq};

use crate::common::*;

fn fixture_root() -> PathBuf {
    std::env::var_os("TVQ_FIXTURES")
        .map(PathBuf::from)
        // At run time, not build time: another checkout sharing the target
        // directory may have built this binary.
        .or_else(|| {
            std::env::var_os("CARGO_MANIFEST_DIR").map(|d| Path::new(&d).join("tests/fixtures"))
        })
        .expect("tests run by cargo")
}

fn fixture_dirs() -> Vec<PathBuf> {
    let root = fixture_root();
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&root)
        .unwrap_or_else(|e| panic!("cannot read fixture root {}: {e}", root.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("config.json").is_file())
        .collect();
    dirs.sort();
    assert!(
        !dirs.is_empty(),
        "no fixture directories under {}",
        root.display()
    );
    dirs
}

/// All tensors of a safetensors file as f32 (ints converted).
fn read_tensors(path: &Path) -> BTreeMap<String, OfficialTensor> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let st = SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(name, view)| {
            let data: Vec<f32> = match view.dtype() {
                safetensors::Dtype::F32 => view
                    .data()
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                    .collect(),
                safetensors::Dtype::I32 => view
                    .data()
                    .chunks_exact(4)
                    .map(|c| i32::from_le_bytes(c.try_into().unwrap()) as f32)
                    .collect(),
                other => panic!("unexpected dtype {other:?} for {name}"),
            };
            (
                name,
                OfficialTensor {
                    shape: view.shape().to_vec(),
                    data,
                },
            )
        })
        .collect()
}

fn tokens(t: &OfficialTensor, device: &burn::DispatchDevice) -> Tensor<B, 2, Int> {
    let data: Vec<i64> = t.data.iter().map(|&x| x as i64).collect();
    Tensor::from_data(TensorData::new(data, t.shape.clone()), device)
}

fn close_slices(got: &[f32], want: &[f32], atol: f32, rtol_of_max: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let max = want.iter().fold(0f32, |m, x| m.max(x.abs()));
    let tol = atol + rtol_of_max * max;
    let worst = tvq_testkit::max_abs_diff(got, want);
    assert!(
        worst <= tol,
        "{what}: max |diff| {worst:e} > {tol:e} (max |want| {max:e})"
    );
}

struct Fixture {
    name: String,
    config: OfficialConfig,
    eval: BTreeMap<String, OfficialTensor>,
    train: BTreeMap<String, OfficialTensor>,
}

fn load(dir: &Path) -> Fixture {
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
    Fixture {
        name: dir.file_name().unwrap().to_string_lossy().into_owned(),
        config: serde_json::from_value(json["config"].clone()).unwrap(),
        eval: read_tensors(&dir.join("eval.safetensors")),
        train: read_tensors(&dir.join("train.safetensors")),
    }
}

#[test]
fn official_fixtures_forward_losses_state_and_codes() {
    let device = cpu();
    for dir in fixture_dirs() {
        let fx = load(&dir);
        let (_, model) = official::import::<B>(&fx.config, &fx.eval, &device).unwrap();
        let out = model
            .forward(
                tokens(&fx.eval["inputs"], &device),
                model.empty_state(),
                Pass::new(),
            )
            .unwrap();
        let name = &fx.name;

        let logprobs = burn::tensor::activation::log_softmax(out.logits.clone().unwrap(), 2);
        close_slices(
            &to_vec(logprobs),
            &fx.eval["logprobs"].data,
            1e-4,
            0.0,
            &format!("{name}: log-probs"),
        );

        for (i, codes) in out.codes.iter().enumerate() {
            let key = format!("dbg/layer{}/attn{}/z", i / 2, i % 2 + 1);
            let got: Vec<f32> = codes.clone().into_data().convert::<f32>().to_vec().unwrap();
            assert_eq!(got, fx.eval[&key].data, "{name}: codes of {key}");
        }

        let targets = tokens(&fx.eval["targets"], &device);
        let loss = Loss::new(&out, targets, None);
        let l_lm: f32 = loss.ce.into_scalar().elem();
        let l_commit: f32 = loss.commitment.into_scalar().elem();
        close_slices(
            &[l_lm],
            &fx.train["l_lm"].data,
            1e-5,
            0.0,
            &format!("{name}: l_lm"),
        );
        close_slices(
            &[l_commit],
            &fx.train["l_commit"].data,
            0.0,
            1e-5,
            &format!("{name}: l_commit"),
        );

        // The carried state after the segment is the official final cache.
        for (i, st) in out.state.sublayers.iter().enumerate() {
            let p = format!("final_state/layer{}/attn{}", i / 2, i % 2 + 1);
            let cache = st
                .cache
                .as_ref()
                .expect("a compressed cache after 8 blocks");
            let prev = st.prev.as_ref().expect("a previous block");
            assert_eq!(
                to_vec(cache.counts.clone()),
                fx.eval[&format!("{p}/aggcache/lower")].data,
                "{name}: {p} counts"
            );
            close_slices(
                &to_vec(cache.means.clone()),
                &fx.eval[&format!("{p}/aggcache/upper_div_lower")].data,
                1e-5,
                0.0,
                &format!("{name}: {p} means"),
            );
            close_slices(
                &to_vec(prev.k_window.clone()),
                &fx.eval[&format!("{p}/xlcache/k_hat")].data,
                1e-5,
                0.0,
                &format!("{name}: {p} k_hat"),
            );
            close_slices(
                &to_vec(prev.v.clone()),
                &fx.eval[&format!("{p}/xlcache/v")].data,
                1e-5,
                0.0,
                &format!("{name}: {p} v"),
            );
            let z: Vec<f32> = prev
                .codes
                .clone()
                .into_data()
                .convert::<f32>()
                .to_vec()
                .unwrap();
            assert_eq!(
                z,
                fx.eval[&format!("{p}/xlcache/z")].data,
                "{name}: {p} codes"
            );
            assert_eq!(st.pos, fx.config_len());
        }
    }
}

impl Fixture {
    fn config_len(&self) -> usize {
        self.eval["inputs"].shape[1]
    }
}

/// Collects each parameter's gradient under its official name.
struct GradReader<'a> {
    grads: &'a GradientsParams,
    out: BTreeMap<String, Vec<f32>>,
}

impl OfficialVisitor<B> for GradReader<'_> {
    fn visit<const D: usize>(
        &mut self,
        name: &str,
        param: &mut Param<Tensor<B, D>>,
        _: &[usize],
        _: bool,
    ) {
        if let Some(g) = self.grads.get::<B, D>(param.id) {
            self.out.insert(name.to_string(), to_vec(g));
        }
    }
}

#[test]
fn official_fixtures_gradients_and_ema_update() {
    let device = cpu_ad();
    for dir in fixture_dirs() {
        let fx = load(&dir);
        let name = &fx.name;
        let c_beta = fx.train["c_beta"].data[0] as f64;
        let c_gamma = fx.train["c_gamma"].data[0] as f64;
        let (_, model) = official::import::<B>(&fx.config, &fx.train, &device).unwrap();
        let out = model
            .forward(
                tokens(&fx.train["inputs"], &device),
                ModelState::new(model.sublayers.len()),
                Pass::new(),
            )
            .unwrap();
        let targets = tokens(&fx.train["targets"], &device);
        let loss = Loss::new(&out, targets, None).total(c_beta);
        let composite: f32 = loss.clone().into_scalar().elem();
        close_slices(
            &[composite],
            &fx.train["composite_loss"].data,
            1e-5,
            0.0,
            &format!("{name}: composite loss"),
        );

        let grads = GradientsParams::from_grads(loss.backward(), &model);
        let mut reader = GradReader {
            grads: &grads,
            out: BTreeMap::new(),
        };
        official::visit_official(&mut model.clone(), &mut reader);
        let mut compared = 0;
        for (key, want) in fx
            .train
            .iter()
            .filter_map(|(k, v)| k.strip_prefix("grad/").map(|n| (n, v)))
        {
            if key.contains("/quantizer/") {
                // The official codebook "gradient" is its EMA surrogate; checked below.
                assert!(
                    !reader.out.contains_key(key),
                    "{name}: tvq's codebook must get no gradient"
                );
                continue;
            }
            match reader.out.get(key) {
                Some(got) => {
                    close_slices(got, &want.data, 1e-6, 1e-4, &format!("{name}: grad {key}"));
                    compared += 1;
                }
                // Only the official parameter unused in an untied model is absent in tvq.
                None => {
                    assert_eq!(
                        key, "token_embedder/bias_out",
                        "{name}: no tvq gradient for {key}"
                    );
                    assert!(want.data.iter().all(|&g| g == 0.0));
                }
            }
        }
        assert_eq!(
            compared,
            4 * 8 + 3,
            "{name}: every trained parameter compared"
        );

        // EMA: the official SGD(lr 1) step on the surrogate is c - grad_l_codebook.
        let updated = model.update_codebooks(&out.stats, c_gamma);
        let exported = official::export(&updated);
        for (key, t) in exported.iter().filter(|(k, _)| k.contains("/quantizer/")) {
            let want: Vec<f32> = fx.train[key.as_str()]
                .data
                .iter()
                .zip(&fx.train[&format!("grad_l_codebook/{key}")].data)
                .map(|(c, g)| c - g)
                .collect();
            close_slices(&t.data, &want, 1e-6, 1e-4, &format!("{name}: EMA {key}"));
        }
    }
}

#[test]
fn import_rejects_unsupported_official_settings() {
    let dir = &fixture_dirs()[0];
    let fx = load(dir);
    let mut c = fx.config.clone();
    c.mem_len = 2 * c.block_len;
    assert!(matches!(
        official::config_from_official(&c),
        Err(official::ImportError::Unsupported { key: "mem_len", .. })
    ));
    let mut tensors = fx.eval.clone();
    tensors.remove("transformer_layers_1/scanned_attn2/u");
    let err = official::import::<B>(&fx.config, &tensors, &cpu())
        .err()
        .unwrap();
    assert_eq!(
        err,
        official::ImportError::Missing("transformer_layers_1/scanned_attn2/u".into())
    );
    // Round trip: export gives back exactly what was imported.
    let (_, model) = official::import::<B>(&fx.config, &fx.eval, &cpu()).unwrap();
    for (k, t) in official::export(&model) {
        assert_eq!(t, fx.eval[&k], "export of {k}");
    }
    let _: &TransformerVq<B> = &model;
}
