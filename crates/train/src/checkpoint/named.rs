//! Parameters and optimizer moments under their module paths.
//!
//! A parameter's name is its module path as `tvq export` writes it
//! (`sublayers.3.q_proj.weight`, `embedding.weight`, ...). The optimizer
//! state of a group names each moment after its parameter: AdamW's
//! `decay/sublayers.3.q_proj.weight.m1` and `.m2`, with the parameter's
//! AdamW step count in the file's metadata under `decay/...weight.step`;
//! Muon's `muon/sublayers.3.q_proj.weight.momentum`. Names, not burn's
//! random `ParamId`s, tie a moment to its parameter, so the same run writes
//! the same bytes and any reader can match them up.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::momentum::MomentumState;
use burn::optim::record::{AdaptorRecord, AdaptorRecordV1};
use burn::optim::{AdamW, AdamWState, AdaptiveMomentumState, Muon, MuonState, Optimizer};
use burn::prelude::*;
use burn::record::{FullPrecisionSettings, Record};
use burn::tensor::backend::AutodiffBackend;
use safetensors::SafeTensors;

use super::tensor_file::{F32Tensor, f32_values};
use super::{bad, untrusted};
use crate::error::TrainError;
use crate::placement::TrainBackend;
use crate::step::optim::{Group, Optimizers};
use tvq_model::TransformerVq;

/// A Muon record of one parameter.
type MuonRecord<B> = AdaptorRecord<Muon<<B as AutodiffBackend>::InnerBackend>, B>;
/// The device of optimizer moments.
type InnerDevice<B> = burn::tensor::Device<<B as AutodiffBackend>::InnerBackend>;

/// Walks the model's float parameters with their dotted module paths.
struct Paths<F> {
    stack: Vec<String>,
    each: F,
}

impl<B: TrainBackend, F: FnMut(String, &dyn FloatParam<B>)> ModuleVisitor<B> for Paths<F> {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.stack.push(name.to_string());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.stack.pop();
    }

    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        (self.each)(self.stack.join("."), param);
    }
}

/// What the writers and readers need of a parameter, whatever its rank.
trait FloatParam<B: TrainBackend> {
    fn id(&self) -> ParamId;
    fn shape(&self) -> Vec<usize>;
    /// The parameter's values as a tensor to write.
    fn values(&self, name: String) -> F32Tensor;
    /// The moments of `record` (this parameter's) as tensors to write, and
    /// the step count.
    fn moments(&self, name: &str, record: AdaptorRecord<AdamW, B>) -> (usize, [F32Tensor; 2]);
    /// A record holding `time` and the moments `m1`, `m2` (this
    /// parameter's shape) on `device`.
    fn record(
        &self,
        time: usize,
        m1: Vec<f32>,
        m2: Vec<f32>,
        device: &InnerDevice<B>,
    ) -> AdaptorRecord<AdamW, B>;
    /// Muon's momentum in `record` (this parameter's) as a tensor to write.
    fn momentum(&self, name: &str, record: MuonRecord<B>) -> F32Tensor;
    /// A Muon record holding the momentum `v` on `device`.
    fn muon_record(&self, v: Vec<f32>, device: &InnerDevice<B>) -> MuonRecord<B>;
}

fn f32_tensor<B: Backend, const D: usize>(name: String, t: Tensor<B, D>) -> F32Tensor {
    F32Tensor {
        name,
        shape: t.dims().to_vec(),
        values: Box::new(move || {
            t.into_data()
                .convert::<f32>()
                .into_vec::<f32>()
                .expect("converted to f32")
        }),
    }
}

impl<B: TrainBackend, const D: usize> FloatParam<B> for Param<Tensor<B, D>> {
    fn id(&self) -> ParamId {
        self.id
    }

    fn shape(&self) -> Vec<usize> {
        self.val().dims().to_vec()
    }

    fn values(&self, name: String) -> F32Tensor {
        f32_tensor(name, self.val())
    }

    fn moments(&self, name: &str, record: AdaptorRecord<AdamW, B>) -> (usize, [F32Tensor; 2]) {
        let m: AdamWState<B::InnerBackend, D> = record.into_state::<D>();
        let m = m.momentum;
        (
            m.time,
            [
                f32_tensor(format!("{name}.m1"), m.moment_1),
                f32_tensor(format!("{name}.m2"), m.moment_2),
            ],
        )
    }

    fn record(
        &self,
        time: usize,
        m1: Vec<f32>,
        m2: Vec<f32>,
        device: &InnerDevice<B>,
    ) -> AdaptorRecord<AdamW, B> {
        let shape = self.shape();
        let tensor = |v: Vec<f32>| {
            Tensor::<B::InnerBackend, D>::from_data(TensorData::new(v, shape.clone()), device)
        };
        let momentum = AdaptiveMomentumState::new(time, tensor(m1), tensor(m2));
        AdaptorRecord::V1(AdaptorRecordV1::from_state::<D>(AdamWState { momentum }))
    }

    fn momentum(&self, name: &str, record: MuonRecord<B>) -> F32Tensor {
        let state: MuonState<_, D> = record.into_state::<D>();
        // burn keeps the velocity private; its record item is public.
        let item = state.momentum.into_item::<FullPrecisionSettings>();
        let device = B::inner_device(&self.val().device());
        let velocity = Tensor::<B::InnerBackend, D>::from_item(item.velocity, &device);
        f32_tensor(format!("{name}.momentum"), velocity)
    }

    fn muon_record(&self, v: Vec<f32>, device: &InnerDevice<B>) -> MuonRecord<B> {
        let v = Tensor::<B::InnerBackend, D>::from_data(TensorData::new(v, self.shape()), device);
        let state = MuonState::new(MomentumState::new(v));
        AdaptorRecord::V1(AdaptorRecordV1::from_state::<D>(state))
    }
}

/// Calls `each` with every float parameter of `model` and its path.
fn for_each_param<B: TrainBackend>(
    model: &TransformerVq<B>,
    each: impl FnMut(String, &dyn FloatParam<B>),
) {
    model.visit(&mut Paths {
        stack: vec![],
        each,
    });
}

/// Every parameter of `model` (the EMA codebook statistics included), to
/// write under its path.
pub(crate) fn model_tensors<B: TrainBackend>(model: &TransformerVq<B>) -> Vec<F32Tensor> {
    let mut out = vec![];
    for_each_param(model, |path, p| out.push(p.values(path)));
    out
}

/// The metadata of a group: its learning-rate scale and its optimizer's
/// settings (a record: on resume the run's config rules).
fn group_settings<B: TrainBackend>(
    optim: &Optimizers<B>,
    group: Group,
) -> Vec<(&'static str, String)> {
    let (a, m) = (&optim.settings.adamw, &optim.settings.muon);
    let mut settings = vec![("lr_scale", optim.lr_scale(group).to_string())];
    settings.extend(match group {
        Group::Muon => [
            ("momentum", m.momentum.to_string()),
            ("nesterov", m.nesterov.to_string()),
            ("ns_steps", m.ns_steps.to_string()),
        ],
        _ => [
            ("beta1", a.beta1.to_string()),
            ("beta2", a.beta2.to_string()),
            ("epsilon", a.epsilon.to_string()),
        ],
    });
    let weight_decay = group.weight_decay(&optim.settings);
    settings.push(("weight_decay", weight_decay.to_string()));
    settings
}

/// Metadata key of the optimizer that steps the projection matrices.
const OPTIMIZER_KEY: &str = "optimizer";

/// The moments of every group as tensors, with the metadata: the optimizer
/// (`adamw` or `muon`), each group's step count (AdamW: the most steps any
/// of its parameters took) and settings ([`group_settings`]), and each
/// AdamW parameter's own step count (burn's AdamW counts per parameter; a
/// parameter with no gradient in a step would lag). Only the moments of the
/// parameters each group holds under the run's optimizer are written.
pub(crate) fn optimizer_tensors<B: TrainBackend>(
    model: &TransformerVq<B>,
    optim: &Optimizers<B>,
) -> (BTreeMap<String, String>, Vec<F32Tensor>) {
    let mut meta = BTreeMap::new();
    let mut tensors = vec![];
    let groups = optim.groups(model);
    meta.insert(
        OPTIMIZER_KEY.to_string(),
        optim.settings.name.name().to_string(),
    );
    for group in Group::ALL {
        let mine = |id: &ParamId| groups.get(id) == Some(&group);
        let name = group.name();
        match (optim.adam(group), &optim.muon) {
            (Some(adam), _) => {
                let mut records = adam.to_record();
                let mut step = 0;
                for_each_param(model, |path, p| {
                    if let Some(record) = records.remove(&p.id()).filter(|_| mine(&p.id())) {
                        let name = format!("{name}/{path}");
                        let (time, moments) = p.moments(&name, record);
                        meta.insert(format!("{name}.step"), time.to_string());
                        step = step.max(time);
                        tensors.extend(moments);
                    }
                });
                meta.insert(format!("{name}/step"), step.to_string());
            }
            (None, Some(muon)) => {
                let mut records = muon.to_record();
                for_each_param(model, |path, p| {
                    if let Some(record) = records.remove(&p.id()).filter(|_| mine(&p.id())) {
                        tensors.push(p.momentum(&format!("{name}/{path}"), record));
                    }
                });
            }
            (None, None) => continue,
        }
        for (key, value) in group_settings(optim, group) {
            meta.insert(format!("{name}/{key}"), value);
        }
    }
    (meta, tensors)
}

/// `optim` with the moments of the file `path` (an `optimizer.safetensors`),
/// keyed by the ids of `model`'s parameters; the tensors go on `device`
/// (the optimizer's, not autodiff). A parameter without moments starts
/// fresh (as before its first step), and so do all that change groups when
/// a run resumes under another optimizer.
pub(crate) fn read_optimizer<B: TrainBackend>(
    path: &Path,
    model: &TransformerVq<B>,
    optim: Optimizers<B>,
    device: &InnerDevice<B>,
) -> Result<Optimizers<B>, TrainError> {
    let bytes = untrusted::read_at_most(path, u64::MAX).map_err(|e| TrainError::io(path, e))?;
    let (_, header) = SafeTensors::read_metadata(&bytes).map_err(|e| bad(path, e.to_string()))?;
    let file = SafeTensors::deserialize(&bytes).map_err(|e| bad(path, e.to_string()))?;
    let meta = header.metadata().clone().unwrap_or_default();
    let saved = meta.get(OPTIMIZER_KEY).map_or("adamw", String::as_str);
    let now = optim.settings.name.name();
    if saved != now {
        tracing::warn!(
            "the checkpoint was trained with {saved} and the config says {now}: the projection \
             matrices' moments start afresh"
        );
    }
    with_moments(&file, &meta, model, optim, device).map_err(|e| bad(path, e))
}

/// The f32 tensor `name` of `file` with `shape`: `None` if it is absent, an
/// error if it has another type or shape.
fn moment(file: &SafeTensors<'_>, name: &str, shape: &[usize]) -> Result<Option<Vec<f32>>, String> {
    let Ok(t) = file.tensor(name) else {
        return Ok(None);
    };
    if t.dtype() != safetensors::Dtype::F32 {
        return Err(format!("{name} is {:?}, not F32", t.dtype()));
    }
    if t.shape() != shape {
        return Err(format!(
            "{name} has shape {:?}, the parameter {shape:?}",
            t.shape()
        ));
    }
    Ok(Some(f32_values(&t)))
}

fn with_moments<B: TrainBackend>(
    file: &SafeTensors<'_>,
    meta: &HashMap<String, String>,
    model: &TransformerVq<B>,
    mut optim: Optimizers<B>,
    device: &InnerDevice<B>,
) -> Result<Optimizers<B>, String> {
    let groups = optim.groups(model);
    let mut error = None;
    // burn's own map types (hashbrown's), one per AdamW group.
    type Records<O, B> = <O as Optimizer<TransformerVq<B>, B>>::Record;
    let mut adam: HashMap<Group, Records<crate::step::optim::Adam<B>, B>> = HashMap::new();
    let mut muon = Records::<crate::step::optim::MuonOptimizer<B>, B>::default();
    for_each_param(model, |path, p| {
        let Some(&group) = groups.get(&p.id()) else {
            return;
        };
        let name = format!("{}/{path}", group.name());
        let shape = p.shape();
        let read = |suffix: &str| moment(file, &format!("{name}.{suffix}"), &shape);
        let loaded = match group {
            Group::Muon => read("momentum").map(|v| {
                v.map(|v| {
                    muon.insert(p.id(), p.muon_record(v, device));
                })
            }),
            _ => match (read("m1"), read("m2")) {
                (Ok(Some(m1)), Ok(Some(m2))) => {
                    match meta
                        .get(&format!("{name}.step"))
                        .and_then(|s| s.parse().ok())
                    {
                        Some(time) => {
                            let record = p.record(time, m1, m2, device);
                            adam.entry(group).or_default().insert(p.id(), record);
                            Ok(Some(()))
                        }
                        None => Err(format!("no step count for {name}")),
                    }
                }
                (Err(e), _) | (_, Err(e)) => Err(e),
                _ => Ok(None),
            },
        };
        if let Err(e) = loaded {
            error.get_or_insert(e);
        }
    });
    if let Some(e) = error {
        return Err(e);
    }
    let mut take = |group| adam.remove(&group).unwrap_or_default();
    optim.decay = optim.decay.load_record(take(Group::Decay));
    optim.no_decay = optim.no_decay.load_record(take(Group::NoDecay));
    optim.toeplitz = optim.toeplitz.load_record(take(Group::Toeplitz));
    optim.muon = optim.muon.map(|m| m.load_record(muon));
    Ok(optim)
}

/// Every tensor name a checkpoint of `model` holds, for tests and readers:
/// the parameter paths.
#[cfg(test)]
pub(crate) fn param_paths<B: TrainBackend>(model: &TransformerVq<B>) -> Vec<(String, Vec<usize>)> {
    let mut out = vec![];
    for_each_param(model, |path, p| out.push((path, p.shape())));
    out
}
