//! Tests of the model crate (one binary, so burn's generics compile once;
//! a test that needs the random generator alone is in `tests/seeded.rs`).

mod attention;
mod common;
mod kernel;
mod network;
mod parity;
mod precision;
mod tiny;
