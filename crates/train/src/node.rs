//! The protocol between the nodes of a run over several processes, on
//! the collective sum: joining (every rank taken once; the same config,
//! step and weights everywhere) and gathering the carried states on node 0
//! for its checkpoint. Integers and bytes travel as `f32` pieces that a sum
//! with zeros carries exactly. It sits beside the trainer, which calls it,
//! not under `parallel/`, which it uses.

use std::path::Path;

use burn::prelude::*;
use tvq_model::{ModelState, TransformerVq};

use crate::checkpoint;
use crate::error::TrainError;
use crate::parallel::collective::Collective;

/// Checks that every node of `collective` joined once and agrees with this
/// one on `words`: `[config fingerprint, step, weights hash]`. The first
/// disagreement is an error naming the node.
pub(crate) fn agree(collective: &Collective, words: [u64; 3]) -> Result<(), TrainError> {
    let (rank, nodes) = (collective.rank(), collective.nodes());
    // Per node: [present, fingerprint, step, weights] with each u64 as
    // four 16-bit pieces, which f32 sums carry exactly.
    const WIDTH: usize = 13;
    let mut mine = vec![0f32; WIDTH * nodes];
    mine[rank * WIDTH] = 1.0;
    for (w, word) in words.iter().enumerate() {
        for piece in 0..4 {
            mine[rank * WIDTH + 1 + 4 * w + piece] = ((word >> (16 * piece)) & 0xFFFF) as f32;
        }
    }
    let all = collective.all_reduce_sum(mine, "checking that the nodes agree")?;
    for r in 0..nodes {
        let slot = &all[r * WIDTH..(r + 1) * WIDTH];
        if slot[0] != 1.0 {
            return Err(TrainError::Peer(format!(
                "{} nodes joined as rank {r}: give every node its own --node-rank in 0..{nodes}",
                slot[0]
            )));
        }
        let word = |w: usize| {
            (0..4).fold(0u64, |acc, p| {
                acc | ((slot[1 + 4 * w + p] as u64) << (16 * p))
            })
        };
        let differs =
            |what: &str| TrainError::Peer(format!("node {r} and node {rank} differ in {what}"));
        if word(0) != words[0] {
            return Err(differs(
                "their config (model, train and batch layout must be the same on every node)",
            ));
        }
        if word(1) != words[1] {
            return Err(TrainError::Peer(format!(
                "node {r} starts at step {}, node {rank} at step {}: every node must resume from the same checkpoint",
                word(1),
                words[1]
            )));
        }
        if word(2) != words[2] {
            return Err(differs(
                "their initial weights (the same seed gives the same weights on every backend)",
            ));
        }
    }
    Ok(())
}

/// A hash of every weight's bits, in module order.
pub(crate) fn weights_hash<B: Backend>(model: &TransformerVq<B>) -> u64 {
    use burn::module::{ModuleVisitor, Param};
    struct Hash(Vec<u8>);
    impl<B: Backend> ModuleVisitor<B> for Hash {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<B, D>>) {
            let values = crate::placement::host_values(&p.val());
            let h = tvq_data::hash::fnv1a(
                &values
                    .iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect::<Vec<_>>(),
            );
            self.0.extend(h.to_le_bytes());
        }
    }
    let mut h = Hash(vec![]);
    model.visit(&mut h);
    tvq_data::hash::fnv1a(&h.0)
}

/// Sends this node's carried `states` to node 0, which gets every node's,
/// in shard order (`None` on the other nodes). The states travel as their
/// checkpoint bytes, two bytes to an `f32` (exact in a sum with zeros).
pub(crate) fn gather_states<B: Backend>(
    c: &Collective,
    states: &[ModelState<B>],
    device: &B::Device,
) -> Result<Option<Vec<ModelState<B>>>, TrainError> {
    let (rank, nodes) = (c.rank(), c.nodes());
    let here = Path::new("(carried states)");
    let bytes = checkpoint::states_to_bytes(here, states)?;
    let mut lens = vec![0f32; nodes * 2];
    lens[rank * 2] = (bytes.len() >> 24) as f32;
    lens[rank * 2 + 1] = (bytes.len() & 0xFF_FFFF) as f32;
    let lens = c.all_reduce_sum(lens, "gathering the carried states")?;
    let lens: Vec<usize> = lens
        .chunks(2)
        .map(|l| ((l[0] as usize) << 24) | l[1] as usize)
        .collect();
    let width = lens.iter().max().copied().unwrap_or(0).div_ceil(2);
    let mut mine = vec![0f32; nodes * width];
    for (i, pair) in bytes.chunks(2).enumerate() {
        let lo = pair[0] as u32;
        let hi = pair.get(1).copied().unwrap_or(0) as u32;
        mine[rank * width + i] = (lo | (hi << 8)) as f32;
    }
    let all = c.all_reduce_sum(mine, "gathering the carried states")?;
    if rank != 0 {
        return Ok(None);
    }
    let mut gathered = vec![];
    for (r, len) in lens.iter().enumerate() {
        let node_bytes: Vec<u8> = all[r * width..(r + 1) * width]
            .iter()
            .flat_map(|&v| (v as u32 as u16).to_le_bytes())
            .take(*len)
            .collect();
        gathered.extend(checkpoint::states_from_bytes(here, &node_bytes, device)?);
    }
    Ok(Some(gathered))
}
