//! What one optimizer step computes: the forward and backward passes of
//! the step's shards ([`gradients`]; [`shard`] for one shard's plan and
//! result, [`recompute`] for the passes of full activation checkpointing)
//! and AdamW with its schedule ([`optim`]). [`crate::trainer::Trainer`]
//! runs them.

pub mod gradients;
pub mod optim;
pub mod recompute;
pub mod shard;
