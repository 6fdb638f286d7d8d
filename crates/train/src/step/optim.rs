//! The optimizers (AdamW, and Muon for the sublayers' projection matrices),
//! global-norm clipping and the learning-rate schedule.
//!
//! burn 0.21 has no parameter groups, so the gradients are split by
//! parameter id and each group's optimizer steps its share ([`Group`]).
//! burn's own clipping works per tensor; the spec clips the norm of all
//! gradients together.

use std::collections::HashMap;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::decay::WeightDecayConfig;
use burn::optim::momentum::MomentumConfig;
use burn::optim::record::{AdaptorRecord, AdaptorRecordV1};
use burn::optim::{
    AdamW, AdamWConfig, AdamWState, AdaptiveMomentumState, AdjustLrFn, GradientsParams, Muon,
    MuonConfig, Optimizer,
};
use burn::prelude::*;
use burn::tensor::TensorPrimitive;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ops::FloatTensor;
use serde::{Deserialize, Serialize};
use tvq_model::position::PositionTerm;

use crate::config::{DecayShape, OptimizerName, OptimizerSection, Schedule, TrainSection};
use crate::placement::TrainBackend;
use burn::Dispatch;
use tvq_model::kernel::{AdamwParam, AdamwScalars};
use tvq_model::{TransformerVq, VqBackend};

/// One AdamW optimizer over the model.
pub type Adam<B = Dispatch> = OptimizerAdaptor<AdamW, TransformerVq<B>, B>;

/// One Muon optimizer over the model (burn's).
pub type MuonOptimizer<B = Dispatch> =
    OptimizerAdaptor<Muon<<B as AutodiffBackend>::InnerBackend>, TransformerVq<B>, B>;

/// Learning rate at optimizer step `step` (1-based): linear warm-up to `lr`,
/// then the [`Schedule`] down to `lr * lr_floor`: a cosine that reaches the
/// floor at `decay_steps`; the peak held until the last `decay_fraction` of
/// `steps` and a decay of `decay_shape` (`wsd`); or the peak (`constant`).
pub fn learning_rate(t: &TrainSection, step: u64) -> f64 {
    use std::f64::consts::PI;
    let peak = t.lr;
    let floor = t.lr * t.lr_floor;
    if step <= t.warmup_steps {
        return peak * step as f64 / t.warmup_steps.max(1) as f64;
    }
    // The decay runs from `start` (the peak) to `end` (the floor).
    let (start, end) = match t.schedule {
        Schedule::Constant => return peak,
        Schedule::Cosine => (t.warmup_steps, t.decay_steps.unwrap_or(t.steps)),
        Schedule::Wsd => {
            let decay = (t.decay_fraction * t.steps as f64).round() as u64;
            (t.steps.saturating_sub(decay).max(t.warmup_steps), t.steps)
        }
    };
    if step <= start {
        return peak;
    }
    if step >= end {
        return floor;
    }
    let p = (step - start) as f64 / (end - start) as f64;
    match (t.schedule, t.decay_shape) {
        (Schedule::Wsd, DecayShape::Linear) => floor + (peak - floor) * (1.0 - p),
        (Schedule::Wsd, DecayShape::Sqrt) => floor + (peak - floor) * (1.0 - p.sqrt()),
        // The cosine's expression as before schedules had names, to the bit.
        _ => floor + 0.5 * (peak - floor) * (1.0 + (PI * p).cos()),
    }
}

/// The first step up to `done` whose learning rate differs between the
/// settings `old` and `new`: where a run resumed under `new` stops being
/// the run `new` would have trained from the start.
pub fn schedule_differs(old: &TrainSection, new: &TrainSection, done: u64) -> Option<u64> {
    (1..=done).find(|&s| learning_rate(old, s) != learning_rate(new, s))
}

/// A share of the parameters stepped by one optimizer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Group {
    /// The sublayers' projection matrices under Muon (`muon` only).
    Muon,
    /// AdamW with weight decay: the other parameters of rank >= 2.
    Decay,
    /// AdamW without weight decay: gains, biases and other vectors.
    NoDecay,
    /// AdamW without weight decay for the Toeplitz bias tables, at
    /// `toeplitz_lr_scale` times the learning rate: AdamW moves each entry
    /// by about its learning rate per step, and at the common rate a table
    /// gains only about one nat of locality in a whole quick-start run
    /// (docs/learning.md).
    Toeplitz,
}

impl Group {
    /// Every group, in the order checkpoints list them.
    pub const ALL: [Group; 4] = [Group::Decay, Group::NoDecay, Group::Toeplitz, Group::Muon];

    /// The decoupled weight decay of the group under `o`: AdamW's for
    /// matrices, Muon's own when set, none for the rest.
    pub fn weight_decay(self, o: &OptimizerSection) -> f64 {
        match self {
            Group::Decay => o.adamw.weight_decay,
            Group::Muon => o.muon.weight_decay.unwrap_or(o.adamw.weight_decay),
            Group::NoDecay | Group::Toeplitz => 0.0,
        }
    }

    /// The group's name in checkpoints.
    pub fn name(self) -> &'static str {
        match self {
            Group::Muon => "muon",
            Group::Decay => "decay",
            Group::NoDecay => "no_decay",
            Group::Toeplitz => "toeplitz",
        }
    }
}

/// The optimizers of a run, one per parameter group.
pub struct Optimizers<B: TrainBackend = Dispatch> {
    /// AdamW for [`Group::Decay`].
    pub decay: Adam<B>,
    /// AdamW for [`Group::NoDecay`].
    pub no_decay: Adam<B>,
    /// AdamW for [`Group::Toeplitz`].
    pub toeplitz: Adam<B>,
    /// Muon for [`Group::Muon`]; `None` under AdamW, whose `decay` group
    /// holds those matrices.
    pub muon: Option<MuonOptimizer<B>>,
    /// Multiplier on the learning rate of the Toeplitz tables.
    pub toeplitz_lr_scale: f64,
    /// The settings the optimizers were built with (recorded in
    /// checkpoints).
    pub settings: OptimizerSection,
}

fn adam<B: TrainBackend>(o: &OptimizerSection, weight_decay: f64) -> Adam<B> {
    let a = &o.adamw;
    AdamWConfig::new()
        .with_beta_1(a.beta1 as f32)
        .with_beta_2(a.beta2 as f32)
        .with_epsilon(a.epsilon as f32)
        .with_weight_decay(weight_decay as f32)
        .with_grad_clipping(None)
        .init::<B, TransformerVq<B>>()
}

/// burn's Muon with the run's settings. Its update is scaled to AdamW's
/// size (`AdjustLrFn::MatchRmsAdamW`, symmetric in the matrix's two sides,
/// so burn's `[in, out]` layout of a linear layer's weight does not matter)
/// and its weight decay is decoupled like AdamW's.
fn muon<B: TrainBackend>(o: &OptimizerSection) -> MuonOptimizer<B> {
    let m = &o.muon;
    let weight_decay = Group::Muon.weight_decay(o);
    MuonConfig::new()
        .with_momentum(MomentumConfig {
            momentum: m.momentum,
            dampening: 0.0,
            nesterov: m.nesterov,
        })
        .with_ns_steps(m.ns_steps)
        .with_adjust_lr_fn(AdjustLrFn::MatchRmsAdamW)
        .with_weight_decay(
            (weight_decay > 0.0).then(|| WeightDecayConfig::new(weight_decay as f32)),
        )
        .init::<B, TransformerVq<B>>()
}

/// Moves the gradients of the parameters of `group` out of `grads`.
fn take_grads<B: TrainBackend>(
    model: &TransformerVq<B>,
    groups: &HashMap<ParamId, Group>,
    group: Group,
    grads: &mut GradientsParams,
) -> GradientsParams {
    struct Take<'a> {
        groups: &'a HashMap<ParamId, Group>,
        group: Group,
        from: &'a mut GradientsParams,
        to: GradientsParams,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Take<'_> {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<B, D>>) {
            if self.groups.get(&p.id) == Some(&self.group)
                && let Some(g) = self.from.remove::<B::InnerBackend, D>(p.id)
            {
                self.to.register::<B::InnerBackend, D>(p.id, g);
            }
        }
    }
    let mut take = Take {
        groups,
        group,
        from: grads,
        to: GradientsParams::new(),
    };
    model.visit(&mut take);
    take.to
}

/// The group of each parameter of `model` when the projection matrices go
/// to `name`'s optimizer.
pub fn groups<B: Backend>(
    model: &TransformerVq<B>,
    name: OptimizerName,
) -> HashMap<ParamId, Group> {
    struct Ranks(HashMap<ParamId, Group>);
    impl<B: Backend> ModuleVisitor<B> for Ranks {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<B, D>>) {
            let group = if D >= 2 { Group::Decay } else { Group::NoDecay };
            self.0.insert(p.id, group);
        }
    }
    let mut ranks = Ranks(HashMap::new());
    model.visit(&mut ranks);
    let mut groups = ranks.0;
    for g in &model.sublayers {
        if let PositionTerm::toeplitz(table) = &g.bias {
            groups.insert(table.id, Group::Toeplitz);
        }
        if name == OptimizerName::Muon {
            // The hidden matrices: what Muon is for. The embedding (also the
            // head) and the position terms stay with AdamW.
            for w in [&g.q_proj.weight, &g.kvg_proj.weight, &g.out_proj.weight] {
                groups.insert(w.id, Group::Muon);
            }
        }
    }
    groups
}

impl<B: TrainBackend> Optimizers<B> {
    /// Fresh optimizers.
    pub fn new(t: &TrainSection) -> Self {
        let o = &t.optimizer;
        Self {
            decay: adam(o, Group::Decay.weight_decay(o)),
            no_decay: adam(o, Group::NoDecay.weight_decay(o)),
            toeplitz: adam(o, Group::Toeplitz.weight_decay(o)),
            muon: (o.name == OptimizerName::Muon).then(|| muon(o)),
            toeplitz_lr_scale: t.toeplitz_lr_scale,
            settings: o.clone(),
        }
    }

    /// The AdamW optimizer of an AdamW group; `None` for [`Group::Muon`].
    pub fn adam(&self, group: Group) -> Option<&Adam<B>> {
        match group {
            Group::Decay => Some(&self.decay),
            Group::NoDecay => Some(&self.no_decay),
            Group::Toeplitz => Some(&self.toeplitz),
            Group::Muon => None,
        }
    }

    /// [`Self::adam`], to change.
    fn adam_mut(&mut self, group: Group) -> Option<&mut Adam<B>> {
        match group {
            Group::Decay => Some(&mut self.decay),
            Group::NoDecay => Some(&mut self.no_decay),
            Group::Toeplitz => Some(&mut self.toeplitz),
            Group::Muon => None,
        }
    }

    /// The multiplier on the learning rate of `group`.
    pub fn lr_scale(&self, group: Group) -> f64 {
        match group {
            Group::Toeplitz => self.toeplitz_lr_scale,
            _ => 1.0,
        }
    }

    /// The group of each parameter of `model` under these optimizers.
    pub fn groups(&self, model: &TransformerVq<B>) -> HashMap<ParamId, Group> {
        groups(model, self.settings.name)
    }

    /// One update at learning rate `lr` of gradients to be multiplied by
    /// `grad_factor` first ([`Clip::factor`]). The groups are taken from
    /// `model` itself, whose parameter ids are the ones the optimizer state
    /// is keyed by (a loaded checkpoint brings its own ids). The AdamW
    /// groups step in one kernel where the backend has one
    /// (`VqBackend::vq_adamw`, the scaling included), else parameter by
    /// parameter with burn's AdamW, as Muon's group always does.
    pub fn step(
        &mut self,
        lr: f64,
        model: TransformerVq<B>,
        mut grads: GradientsParams,
        grad_factor: f64,
    ) -> TransformerVq<B> {
        let groups = self.groups(&model);
        let model = self.adamw_by_kernel(lr, model, &groups, &mut grads, grad_factor);
        if grad_factor != 1.0 {
            scale_grads(&model, &mut grads, grad_factor);
        }
        let mut take = |group| take_grads(&model, &groups, group, &mut grads);
        let (tables, hidden, matrices) =
            (take(Group::Toeplitz), take(Group::Muon), take(Group::Decay));
        let model = self
            .toeplitz
            .step(lr * self.lr_scale(Group::Toeplitz), model, tables);
        let model = match &mut self.muon {
            Some(muon) => muon.step(lr, model, hidden),
            None => model,
        };
        let model = self.decay.step(lr, model, matrices);
        self.no_decay.step(lr, model, grads)
    }

    /// The AdamW groups' step by the backend's kernel, taking their
    /// gradients out of `grads`; `model` as it is, `grads` untouched, where
    /// there is no kernel or the parameters and gradients are not all on
    /// one device.
    fn adamw_by_kernel(
        &mut self,
        lr: f64,
        model: TransformerVq<B>,
        groups: &HashMap<ParamId, Group>,
        grads: &mut GradientsParams,
        grad_factor: f64,
    ) -> TransformerVq<B> {
        if !<B::InnerBackend as VqBackend>::STEPS_ADAMW {
            return model;
        }
        let mut gather = GatherAdamw::<B> {
            groups,
            grads,
            records: HashMap::new(),
            optim: self,
            lr,
            grad_factor,
            params: Vec::new(),
            ids: Vec::new(),
            devices: Vec::new(),
        };
        for group in [Group::Decay, Group::NoDecay, Group::Toeplitz] {
            if let Some(adam) = self.adam(group) {
                gather.records.insert(group, adam.to_record());
            }
        }
        model.visit(&mut gather);
        let GatherAdamw {
            params,
            ids,
            devices,
            mut records,
            ..
        } = gather;
        let one_device = devices.windows(2).all(|d| d[0] == d[1]);
        if params.is_empty() || !one_device {
            return model;
        }
        let Some(stepped) = <B::InnerBackend as VqBackend>::vq_adamw(params) else {
            return model;
        };
        let mut put = PutAdamw::<B> {
            stepped: ids
                .into_iter()
                .zip(stepped)
                .map(|((id, group, time), t)| (id, (group, time, t)))
                .collect(),
            grads,
            records: &mut records,
        };
        let model = model.map(&mut put);
        for (group, records) in records {
            if let Some(adam) = self.adam_mut(group) {
                *adam = adam.clone().load_record(records);
            }
        }
        model
    }
}

/// The records of one AdamW optimizer: its moments and step counts.
type AdamRecords<B> = <Adam<B> as Optimizer<TransformerVq<B>, B>>::Record;

/// Gathers the AdamW groups' parameters, gradients and moments for
/// [`Optimizers::adamw_by_kernel`].
struct GatherAdamw<'a, B: TrainBackend> {
    groups: &'a HashMap<ParamId, Group>,
    grads: &'a GradientsParams,
    records: HashMap<Group, AdamRecords<B>>,
    optim: &'a Optimizers<B>,
    lr: f64,
    grad_factor: f64,
    params: Vec<AdamwParam<B::InnerBackend>>,
    ids: Vec<(ParamId, Group, usize)>,
    devices: Vec<burn::tensor::Device<B::InnerBackend>>,
}

impl<B: TrainBackend> ModuleVisitor<B> for GatherAdamw<'_, B> {
    fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<B, D>>) {
        let Some(&group) = self.groups.get(&p.id) else {
            return;
        };
        let (Some(records), Some(grad)) = (
            self.records.get(&group),
            self.grads.get::<B::InnerBackend, D>(p.id),
        ) else {
            return;
        };
        let param = p.val().inner();
        self.devices.extend([param.device(), grad.device()]);
        let moments = records.get(&p.id).map(|record| {
            let state: AdamWState<B::InnerBackend, D> = record.clone().into_state::<D>();
            let m = state.momentum;
            (
                m.time,
                [m.moment_1, m.moment_2].map(|t| t.into_primitive().tensor()),
            )
        });
        let time = moments.as_ref().map_or(0, |m| m.0) + 1;
        let a = &self.optim.settings.adamw;
        let scalars = AdamwScalars {
            lr: self.lr * self.optim.lr_scale(group),
            // As burn's AdamW holds it: an f32.
            weight_decay: f64::from(group.weight_decay(&self.optim.settings) as f32),
            beta1: a.beta1 as f32,
            beta2: a.beta2 as f32,
            epsilon: a.epsilon as f32,
            time,
            grad_scale: self.grad_factor,
        };
        self.params.push(AdamwParam {
            param: param.into_primitive().tensor(),
            grad: grad.into_primitive().tensor(),
            moments: moments.map(|m| m.1),
            scalars,
        });
        self.ids.push((p.id, group, time));
    }
}

/// A parameter's new value and moments.
type Stepped<B> = [FloatTensor<<B as AutodiffBackend>::InnerBackend>; 3];

/// Puts [`Optimizers::adamw_by_kernel`]'s new parameters into the model
/// and its moments into the records, and takes the gradients it used out.
struct PutAdamw<'a, B: TrainBackend> {
    /// Each parameter's group, step count and new value and moments.
    stepped: HashMap<ParamId, (Group, usize, Stepped<B>)>,
    grads: &'a mut GradientsParams,
    records: &'a mut HashMap<Group, AdamRecords<B>>,
}

impl<B: TrainBackend> ModuleMapper<B> for PutAdamw<'_, B> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let Some((group, time, [value, m1, m2])) = self.stepped.remove(&param.id) else {
            return param;
        };
        let id = param.id;
        let inner = |t| Tensor::<B::InnerBackend, D>::from_primitive(TensorPrimitive::Float(t));
        self.grads.remove::<B::InnerBackend, D>(id);
        let momentum = AdaptiveMomentumState::new(time, inner(m1), inner(m2));
        let record = AdaptorRecord::V1(AdaptorRecordV1::from_state::<D>(AdamWState { momentum }));
        if let Some(records) = self.records.get_mut(&group) {
            records.insert(id, record);
        }
        let (id, tensor, mapper) = param.consume();
        let mut value = Tensor::from_inner(inner(value));
        if tensor.is_require_grad() {
            value = value.require_grad();
        }
        Param::from_mapped_value(id, value, mapper)
    }
}

/// Dynamic loss scaling for `f16` training, as PyTorch's `GradScaler`: the
/// objective is multiplied by `scale` before the backward pass so that small
/// gradients do not underflow `f16`'s range (below `6e-8`); the gradients
/// are divided by it before clipping. A step whose gradients overflow (a
/// non-finite norm) is skipped and halves the scale; every
/// [`Self::GROWTH_INTERVAL`] finite steps in a row double it.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct LossScale {
    /// The factor on the objective.
    pub scale: f64,
    /// Finite steps since the scale last changed.
    pub good_steps: u64,
}

impl LossScale {
    /// The first scale, `2^16` (PyTorch's).
    pub const INITIAL: f64 = 65536.0;
    /// Finite steps in a row before the scale doubles (PyTorch's).
    pub const GROWTH_INTERVAL: u64 = 2000;

    /// The scale a run starts with.
    pub fn new() -> Self {
        Self {
            scale: Self::INITIAL,
            good_steps: 0,
        }
    }

    /// Moves the scale after a step whose gradients were `finite` or not.
    pub fn update(&mut self, finite: bool) {
        if finite {
            self.good_steps += 1;
            if self.good_steps == Self::GROWTH_INTERVAL {
                self.scale *= 2.0;
                self.good_steps = 0;
            }
        } else {
            self.scale = (self.scale / 2.0).max(1.0);
            self.good_steps = 0;
        }
    }
}

impl Default for LossScale {
    fn default() -> Self {
        Self::new()
    }
}

/// What clipping found of a step's gradients.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Clip {
    /// The global L2 norm of the gradients of the objective itself (the
    /// loss scale divided out), before clipping; not finite where they
    /// overflowed (the step must be skipped).
    pub norm: f64,
    /// The factor the gradients take before the optimizer's step: the
    /// loss scale's inverse, times `max_norm / norm` where the norm is
    /// above `max_norm`.
    pub factor: f64,
}

/// The global L2 norm of `grads` (of an objective multiplied by
/// `loss_scale`), and the factor that divides the loss scale out and scales
/// them so that their norm is at most `max_norm` (no clipping for
/// `max_norm <= 0`); [`Optimizers::step`] applies it.
pub fn clip_global_norm<B: TrainBackend>(
    model: &TransformerVq<B>,
    grads: &GradientsParams,
    max_norm: f64,
    loss_scale: f64,
) -> Clip {
    let Some(total) = sum_squares(model, grads) else {
        return Clip {
            norm: 0.0,
            factor: 1.0,
        };
    };
    let norm = total.into_scalar().elem::<f64>().sqrt() / loss_scale;
    if !norm.is_finite() {
        return Clip { norm, factor: 1.0 };
    }
    let clip = if max_norm > 0.0 && norm > max_norm {
        max_norm / norm
    } else {
        1.0
    };
    Clip {
        norm,
        factor: clip / loss_scale,
    }
}

/// Multiplies each of `model`'s gradients in `grads` by `factor`.
fn scale_grads<B: TrainBackend>(
    model: &TransformerVq<B>,
    grads: &mut GradientsParams,
    factor: f64,
) {
    struct Scale<'a> {
        grads: &'a mut GradientsParams,
        factor: f64,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Scale<'_> {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<B, D>>) {
            if let Some(g) = self.grads.remove::<B::InnerBackend, D>(p.id) {
                self.grads
                    .register::<B::InnerBackend, D>(p.id, g * self.factor);
            }
        }
    }
    model.visit(&mut Scale { grads, factor });
}

/// The sum of the squares of `model`'s gradients in `grads` (`None` where
/// it has none): one kernel over them all where the backend has it
/// (`VqBackend::vq_sum_squares`), else a reduction per gradient.
fn sum_squares<B: TrainBackend>(
    model: &TransformerVq<B>,
    grads: &GradientsParams,
) -> Option<Tensor<B::InnerBackend, 1>> {
    struct Gather<'a, B: AutodiffBackend> {
        grads: &'a GradientsParams,
        all: Vec<FloatTensor<B::InnerBackend>>,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Gather<'_, B> {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<B, D>>) {
            if let Some(g) = self.grads.get::<B::InnerBackend, D>(p.id) {
                self.all.push(g.into_primitive().tensor());
            }
        }
    }
    let mut gather = Gather::<B> {
        grads,
        all: Vec::new(),
    };
    model.visit(&mut gather);
    if gather.all.is_empty() {
        return None;
    }
    if let Some(total) = <B::InnerBackend as VqBackend>::vq_sum_squares(gather.all) {
        return Some(Tensor::from_primitive(TensorPrimitive::Float(total)));
    }
    struct Composed<'a, B: AutodiffBackend> {
        grads: &'a GradientsParams,
        total: Option<Tensor<B::InnerBackend, 1>>,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Composed<'_, B> {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<B, D>>) {
            if let Some(g) = self.grads.get::<B::InnerBackend, D>(p.id) {
                let s = g.square().sum();
                self.total = Some(match self.total.take() {
                    Some(t) => t + s,
                    None => s,
                });
            }
        }
    }
    let mut sum = Composed::<B> { grads, total: None };
    model.visit(&mut sum);
    sum.total
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::TrainSection;
    use crate::placement::B;
    use crate::placement::device::DeviceSpec;
    use crate::trainer::Trainer;
    use crate::trainer::tests::{batch, trainer};
    use tvq_data::TrainCursor;
    use tvq_testkit::tiny_model;

    fn schedule() -> TrainSection {
        TrainSection {
            lr: 1e-3,
            warmup_steps: 100,
            steps: 1000,
            decay_steps: Some(600),
            lr_floor: 0.1,
            ..TrainSection::default()
        }
    }

    #[test]
    fn the_loss_scale_halves_on_overflow_and_doubles_after_a_run_of_finite_steps() {
        let mut s = LossScale::new();
        s.update(false);
        assert_eq!(s.scale, LossScale::INITIAL / 2.0);
        for _ in 0..LossScale::GROWTH_INTERVAL - 1 {
            s.update(true);
        }
        assert_eq!(s.scale, LossScale::INITIAL / 2.0, "not yet");
        s.update(true);
        assert_eq!((s.scale, s.good_steps), (LossScale::INITIAL, 0));
        // An overflow resets the run of finite steps.
        s.update(true);
        s.update(false);
        assert_eq!((s.scale, s.good_steps), (LossScale::INITIAL / 2.0, 0));
        // The scale never drops below 1.
        for _ in 0..40 {
            s.update(false);
        }
        assert_eq!(s.scale, 1.0);
    }

    /// `wsd` holds the peak until the last `decay_fraction` of the steps,
    /// then falls to the floor in its shape; `constant` holds the peak.
    #[test]
    fn wsd_holds_the_peak_then_decays_in_its_shape_and_constant_holds_it() {
        let close = |a: f64, b: f64| (a - b).abs() < 1e-12;
        let (peak, floor) = (1e-3, 1e-4);
        let wsd = |shape| TrainSection {
            schedule: Schedule::Wsd,
            decay_steps: None,
            decay_fraction: 0.2,
            decay_shape: shape,
            ..schedule()
        };
        for shape in [DecayShape::Linear, DecayShape::Sqrt, DecayShape::Cosine] {
            let t = wsd(shape);
            assert!(close(learning_rate(&t, 50), 5e-4), "the same warm-up");
            assert!((100..=800).all(|s| learning_rate(&t, s) == peak));
            assert!(close(learning_rate(&t, 1000), floor));
            let decay: Vec<f64> = (800..=1000).map(|s| learning_rate(&t, s)).collect();
            assert!(decay.windows(2).all(|w| w[1] < w[0]), "{shape:?}");
        }
        let mid = |shape| learning_rate(&wsd(shape), 900);
        assert!(close(mid(DecayShape::Linear), (peak + floor) / 2.0));
        assert!(close(mid(DecayShape::Cosine), (peak + floor) / 2.0));
        let sqrt = floor + (peak - floor) * (1.0 - 0.5f64.sqrt());
        assert!(close(mid(DecayShape::Sqrt), sqrt));
        // The linear decay's quarter point; the cosine is still higher.
        assert!(close(
            learning_rate(&wsd(DecayShape::Linear), 850),
            floor + 0.75 * (peak - floor)
        ));
        assert!(learning_rate(&wsd(DecayShape::Cosine), 850) > floor + 0.75 * (peak - floor));
        let constant = TrainSection {
            schedule: Schedule::Constant,
            decay_steps: None,
            ..schedule()
        };
        assert!(
            [101, 1000, 10_000]
                .iter()
                .all(|&s| learning_rate(&constant, s) == peak)
        );
    }

    /// Raising `steps` leaves a `wsd` run's past alone until its decay
    /// starts and a `constant` run's always; a cosine's changes right after
    /// the warm-up.
    #[test]
    fn only_the_cosine_changes_its_past_when_the_steps_grow() {
        let longer = |t: &TrainSection| TrainSection {
            steps: 2 * t.steps,
            ..t.clone()
        };
        let wsd = TrainSection {
            schedule: Schedule::Wsd,
            decay_steps: None,
            ..schedule()
        };
        assert_eq!(schedule_differs(&wsd, &longer(&wsd), 800), None);
        assert_eq!(schedule_differs(&wsd, &longer(&wsd), 1000), Some(801));
        let constant = TrainSection {
            schedule: Schedule::Constant,
            ..wsd.clone()
        };
        assert_eq!(schedule_differs(&constant, &longer(&constant), 1000), None);
        let cosine = TrainSection {
            decay_steps: None,
            ..schedule()
        };
        assert_eq!(schedule_differs(&cosine, &longer(&cosine), 1000), Some(101));
    }

    #[test]
    fn warm_up_is_linear_then_the_cosine_decays_to_the_floor() {
        let t = schedule();
        let close = |a: f64, b: f64| (a - b).abs() < 1e-12;
        assert!(close(learning_rate(&t, 1), 1e-5));
        assert!(close(learning_rate(&t, 50), 5e-4));
        assert!(close(learning_rate(&t, 100), 1e-3));
        // Half-way through the decay the cosine is at the mean of peak and floor.
        assert!(close(learning_rate(&t, 350), (1e-3 + 1e-4) / 2.0));
        assert!(close(learning_rate(&t, 600), 1e-4));
        assert!(close(learning_rate(&t, 1000), 1e-4));
        let decay: Vec<f64> = (100..=600).map(|s| learning_rate(&t, s)).collect();
        assert!(decay.windows(2).all(|w| w[1] < w[0]), "strictly decreasing");
        // Without decay_steps the cosine ends at train.steps.
        let t = TrainSection {
            decay_steps: None,
            ..schedule()
        };
        assert!(close(learning_rate(&t, 1000), 1e-4));
        assert!(learning_rate(&t, 999) > 1e-4);
    }

    #[test]
    fn clipping_scales_the_global_gradient_norm_down_to_the_limit() {
        let mut t = trainer(1, 1);
        let mut grads = t.gradients(&batch(2, 8, true)).unwrap().grads;
        let measured = clip_global_norm(t.model(), &grads, 0.0, 1.0); // 0: measure only
        let norm = measured.norm;
        assert!(norm > 1e-3);
        assert_eq!(measured.factor, 1.0);
        let clip = clip_global_norm(t.model(), &grads, 1e-3, 1.0);
        assert_eq!(clip.norm, norm);
        assert!((clip.factor - 1e-3 / norm).abs() < 1e-15, "{clip:?}");
        scale_grads(t.model(), &mut grads, clip.factor);
        let clipped = clip_global_norm(t.model(), &grads, 0.0, 1.0).norm;
        assert!((clipped - 1e-3).abs() < 1e-7, "{clipped}");
        // A limit above the norm leaves the gradients alone; a loss scale
        // is divided out of the norm and the factor.
        assert_eq!(clip_global_norm(t.model(), &grads, 1.0, 1.0).factor, 1.0);
        let scaled = clip_global_norm(t.model(), &grads, 1.0, 4.0);
        assert!((scaled.norm - clipped / 4.0).abs() < 1e-9, "{scaled:?}");
        assert_eq!(scaled.factor, 0.25);
    }

    /// Muon's update of a projection matrix, computed in f64 from the
    /// spec: the gradient over its Frobenius norm, five quintic
    /// Newton-Schulz iterations (on the wide side), times
    /// `lr * 0.2 * sqrt(max(rows, columns))`. A first step's momentum is
    /// the gradient times a constant, which the norm removes.
    fn muon_update(g: &[f32], rows: usize, cols: usize, lr: f64) -> Vec<f64> {
        let (a, b, c) = (3.4445, -4.775, 2.0315);
        let tall = rows > cols;
        let (n, m) = if tall { (cols, rows) } else { (rows, cols) };
        // x: n x m with n <= m.
        let at = |i: usize, j: usize| if tall { g[j * cols + i] } else { g[i * cols + j] } as f64;
        let mut x: Vec<f64> = (0..n * m).map(|k| at(k / m, k % m)).collect();
        let norm = x.iter().map(|v| v * v).sum::<f64>().sqrt();
        x.iter_mut().for_each(|v| *v /= norm);
        let matmul = |p: &[f64], q: &[f64], r: usize, k: usize, s: usize| -> Vec<f64> {
            (0..r * s)
                .map(|o| (0..k).map(|t| p[o / s * k + t] * q[t * s + o % s]).sum())
                .collect()
        };
        for _ in 0..5 {
            let xt: Vec<f64> = (0..m * n).map(|k| x[(k % n) * m + k / n]).collect();
            let gram = matmul(&x, &xt, n, m, n);
            let gram2 = matmul(&gram, &gram, n, n, n);
            let poly: Vec<f64> = gram
                .iter()
                .zip(&gram2)
                .map(|(p, q)| b * p + c * q)
                .collect();
            let px = matmul(&poly, &x, n, n, m);
            x = x.iter().zip(&px).map(|(v, w)| a * v + w).collect();
        }
        let scale = lr * 0.2 * (rows.max(cols) as f64).sqrt();
        (0..rows * cols)
            .map(|k| {
                let (i, j) = (k / cols, k % cols);
                scale * if tall { x[j * m + i] } else { x[i * m + j] }
            })
            .collect()
    }

    /// Under `muon` the projection matrices move by Muon's update (checked
    /// against [`muon_update`]); the other groups keep AdamW.
    #[test]
    fn muon_steps_the_projection_matrices_by_their_orthogonalized_gradient() {
        let mut t = trainer(1, 1);
        let grads = t.gradients(&batch(2, 8, true)).unwrap().grads;
        let before = t.model().clone();
        let mut settings = TrainSection::default();
        settings.optimizer.name = OptimizerName::Muon;
        settings.optimizer.adamw.weight_decay = 0.0;
        let mut optim = Optimizers::new(&settings);
        let lr = 1e-2;
        let values =
            |p: &Param<Tensor<B, 2>>| -> Vec<f32> { p.val().into_data().to_vec().unwrap() };
        let g = &before.sublayers[0];
        let mut checked = 0;
        let projections = |g: &tvq_model::gau::Gau<B>| {
            [
                g.q_proj.weight.clone(),
                g.kvg_proj.weight.clone(),
                g.out_proj.weight.clone(),
            ]
        };
        let wanted: Vec<Vec<f64>> = projections(g)
            .iter()
            .map(|w| {
                let grad: Vec<f32> = grads
                    .get::<B, 2>(w.id)
                    .unwrap()
                    .into_data()
                    .to_vec()
                    .unwrap();
                let [rows, cols] = w.val().dims();
                muon_update(&grad, rows, cols, lr)
            })
            .collect();
        let after = optim.step(lr, before.clone(), grads, 1.0);
        for ((w0, w1), want) in projections(g)
            .iter()
            .zip(projections(&after.sublayers[0]))
            .zip(&wanted)
        {
            let moved: Vec<f64> = values(w0)
                .iter()
                .zip(values(&w1))
                .map(|(a, b)| (a - b) as f64)
                .collect();
            assert!(moved.iter().all(|m| m.is_finite()), "{moved:?}");
            let worst = moved
                .iter()
                .zip(want)
                .map(|(a, b)| (a - b).abs())
                .fold(0f64, f64::max);
            let size = want.iter().map(|v| v.abs()).fold(0f64, f64::max);
            assert!(worst < 1e-3 * size, "off by {worst} of {size}");
            checked += 1;
        }
        assert_eq!(checked, 3);
        // The embedding is AdamW's: its first step moves entries by about lr.
        let e0 = values(&before.embedding.weight);
        let e1 = values(&after.embedding.weight);
        let most = e0
            .iter()
            .zip(&e1)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!((most as f64 - lr).abs() < 0.2 * lr, "{most}");
    }

    #[test]
    fn the_toeplitz_tables_step_at_their_own_learning_rate() {
        let table = |t: &Trainer| -> Vec<f32> {
            let PositionTerm::toeplitz(p) = &t.model().sublayers[0].bias else {
                panic!("the default position term is the Toeplitz table")
            };
            p.val().into_data().to_vec().unwrap()
        };
        let moved = |scale: f64| {
            let settings = TrainSection {
                toeplitz_lr_scale: scale,
                lr: 1e-3,
                warmup_steps: 0,
                optimizer: OptimizerSection {
                    adamw: crate::config::AdamWSection {
                        weight_decay: 0.1,
                        ..Default::default()
                    },
                    ..Default::default()
                },
                ..TrainSection::default()
            };
            let device = DeviceSpec::Cpu.init().unwrap().0;
            let mut t = Trainer::new(&tiny_model(11), &settings, &[device]).unwrap();
            let before = table(&t);
            t.step(&batch(2, 8, true), TrainCursor::default()).unwrap();
            let after = table(&t);
            tvq_testkit::max_abs_diff(&before, &after)
        };
        // Adam's first step moves every entry with a gradient by about lr.
        let (slow, fast) = (moved(1.0), moved(10.0));
        assert!((slow - 1e-3).abs() < 2e-4, "{slow}");
        assert!((fast - 1e-2).abs() < 2e-3, "{fast}");
    }
}
