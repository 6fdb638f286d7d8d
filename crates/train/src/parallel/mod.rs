//! Running a step's shards at once: worker threads on one or several
//! devices ([`workers`]) and nodes that sum their gradients through
//! burn's collective engine ([`collective`]).

pub mod collective;
pub mod workers;
