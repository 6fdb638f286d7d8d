//! Tests of the model crate (one binary, so burn's generics compile once).

mod attention;
mod common;
mod network;
mod parity;
mod precision;
mod tiny;
