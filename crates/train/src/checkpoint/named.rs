//! Parameters and optimizer moments under their module paths.
//!
//! A parameter's name is its module path as `tvq export` writes it
//! (`sublayers.3.q_proj.weight`, `embedding.weight`, ...). The optimizer
//! state of a group names each moment after its parameter:
//! `decay/sublayers.3.q_proj.weight.m1` and `.m2`, with the parameter's
//! AdamW step count in the file's metadata under `decay/...weight.step`.
//! Names, not burn's random `ParamId`s, tie a moment to its parameter, so
//! the same run writes the same bytes and any reader can match them up.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::record::{AdaptorRecord, AdaptorRecordV1};
use burn::optim::{AdamW, AdamWState, AdaptiveMomentumState, Optimizer};
use burn::prelude::*;
use safetensors::SafeTensors;

use super::tensor_file::{F32Tensor, f32_values};
use super::{bad, untrusted};
use crate::error::TrainError;
use crate::placement::{B, Model};
use crate::step::optim::{Adam, Optimizers};

/// Walks the model's float parameters with their dotted module paths.
struct Paths<F> {
    stack: Vec<String>,
    each: F,
}

impl<F: FnMut(String, &dyn FloatParam)> ModuleVisitor<B> for Paths<F> {
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
trait FloatParam {
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
        device: &burn::DispatchDevice,
    ) -> AdaptorRecord<AdamW, B>;
}

fn f32_tensor<const D: usize>(name: String, t: Tensor<B, D>) -> F32Tensor {
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

impl<const D: usize> FloatParam for Param<Tensor<B, D>> {
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
        let m: AdamWState<B, D> = record.into_state::<D>();
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
        device: &burn::DispatchDevice,
    ) -> AdaptorRecord<AdamW, B> {
        let shape = self.shape();
        let tensor =
            |v: Vec<f32>| Tensor::<B, D>::from_data(TensorData::new(v, shape.clone()), device);
        let momentum = AdaptiveMomentumState::new(time, tensor(m1), tensor(m2));
        AdaptorRecord::V1(AdaptorRecordV1::from_state::<D>(AdamWState { momentum }))
    }
}

/// Calls `each` with every float parameter of `model` and its path.
fn for_each_param(model: &Model, each: impl FnMut(String, &dyn FloatParam)) {
    model.visit(&mut Paths {
        stack: vec![],
        each,
    });
}

/// Every parameter of `model` (the EMA codebook statistics included), to
/// write under its path.
pub(crate) fn model_tensors(model: &Model) -> Vec<F32Tensor> {
    let mut out = vec![];
    for_each_param(model, |path, p| out.push(p.values(path)));
    out
}

/// A group of the optimizer state: its name in the file, its optimizer,
/// its learning-rate scale and weight decay.
type Group<'a> = (&'static str, &'a Adam, f64, f64);

/// The optimizer groups, in a fixed order.
fn groups(optim: &Optimizers) -> [Group<'_>; 3] {
    let decay = optim.settings.weight_decay;
    [
        ("decay", &optim.decay, 1.0, decay),
        ("no_decay", &optim.no_decay, 1.0, 0.0),
        ("toeplitz", &optim.toeplitz, optim.toeplitz_lr_scale, 0.0),
    ]
}

/// The moments of every group as tensors, with the metadata: each group's
/// step count (the most steps any of its parameters took) and settings
/// (learning-rate scale, betas, epsilon, weight decay: a record, the run's
/// config rules), and each parameter's own step count (burn's AdamW counts
/// per parameter; a parameter with no gradient in a step would lag).
pub(crate) fn optimizer_tensors(
    model: &Model,
    optim: &Optimizers,
) -> (BTreeMap<String, String>, Vec<F32Tensor>) {
    let mut meta = BTreeMap::new();
    let mut tensors = vec![];
    let s = optim.settings;
    for (group, adam, lr_scale, weight_decay) in groups(optim) {
        let mut records = adam.to_record();
        let mut step = 0;
        for_each_param(model, |path, p| {
            if let Some(record) = records.remove(&p.id()) {
                let name = format!("{group}/{path}");
                let (time, moments) = p.moments(&name, record);
                meta.insert(format!("{name}.step"), time.to_string());
                step = step.max(time);
                tensors.extend(moments);
            }
        });
        debug_assert!(records.is_empty(), "moments of parameters the model lacks");
        for (key, value) in [
            ("step", step.to_string()),
            ("lr_scale", lr_scale.to_string()),
            ("beta1", s.beta1.to_string()),
            ("beta2", s.beta2.to_string()),
            ("epsilon", s.epsilon.to_string()),
            ("weight_decay", weight_decay.to_string()),
        ] {
            meta.insert(format!("{group}/{key}"), value);
        }
    }
    (meta, tensors)
}

/// `optim` with the moments of the file `path` (an `optimizer.safetensors`),
/// keyed by the ids of `model`'s parameters; the tensors go on `device`
/// (the optimizer's, not autodiff). A parameter without moments starts
/// fresh (as before its first step).
pub(crate) fn read_optimizer(
    path: &Path,
    model: &Model,
    optim: Optimizers,
    device: &burn::DispatchDevice,
) -> Result<Optimizers, TrainError> {
    let bytes = untrusted::read_at_most(path, u64::MAX).map_err(|e| TrainError::io(path, e))?;
    let (_, header) = SafeTensors::read_metadata(&bytes).map_err(|e| bad(path, e.to_string()))?;
    let file = SafeTensors::deserialize(&bytes).map_err(|e| bad(path, e.to_string()))?;
    let meta = header.metadata().clone().unwrap_or_default();
    with_moments(&file, &meta, model, optim, device).map_err(|e| bad(path, e))
}

fn with_moments(
    file: &SafeTensors<'_>,
    meta: &HashMap<String, String>,
    model: &Model,
    mut optim: Optimizers,
    device: &burn::DispatchDevice,
) -> Result<Optimizers, String> {
    let mut error = None;
    // burn's own map type (hashbrown's).
    let mut records: [<Adam as Optimizer<Model, B>>::Record; 3] = Default::default();
    let names: Vec<&str> = groups(&optim).iter().map(|g| g.0).collect();
    for (group, records) in names.iter().zip(&mut records) {
        for_each_param(model, |path, p| {
            let name = format!("{group}/{path}");
            let (Ok(m1), Ok(m2)) = (
                file.tensor(&format!("{name}.m1")),
                file.tensor(&format!("{name}.m2")),
            ) else {
                return;
            };
            let shape = p.shape();
            let time = meta
                .get(&format!("{name}.step"))
                .and_then(|s| s.parse().ok());
            match time {
                _ if [m1.dtype(), m2.dtype()] != [safetensors::Dtype::F32; 2] => {
                    error.get_or_insert(format!(
                        "the moments of {path} are {:?}, not F32",
                        m1.dtype()
                    ));
                }
                _ if m1.shape() != shape || m2.shape() != shape => {
                    error.get_or_insert(format!(
                        "the moments of {path} have shape {:?}, the parameter {shape:?}",
                        m1.shape()
                    ));
                }
                None => {
                    error.get_or_insert(format!("no step count for {name}"));
                }
                Some(time) => {
                    let record = p.record(time, f32_values(&m1), f32_values(&m2), device);
                    records.insert(p.id(), record);
                }
            }
        });
    }
    if let Some(e) = error {
        return Err(e);
    }
    let [decay, no_decay, toeplitz] = records;
    optim.decay = optim.decay.load_record(decay);
    optim.no_decay = optim.no_decay.load_record(no_decay);
    optim.toeplitz = optim.toeplitz.load_record(toeplitz);
    Ok(optim)
}

/// Every tensor name a checkpoint of `model` holds, for tests and readers:
/// the parameter paths.
#[cfg(test)]
pub(crate) fn param_paths(model: &Model) -> Vec<(String, Vec<usize>)> {
    let mut out = vec![];
    for_each_param(model, |path, p| out.push((path, p.shape())));
    out
}
