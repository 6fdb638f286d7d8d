//! Tests of the model crate (one binary, so burn's generics compile once;
//! a test that needs the random generator alone is in `tests/seeded.rs`).

mod attention;
mod common;
mod kernel;
mod network;
mod parity;
mod precision;
mod tiny;

/// Every allocation starts as NaNs, so that an output element a CPU kernel
/// leaves unwritten (they write outputs without zeroing them) fails the
/// tests that compare it.
#[global_allocator]
static ALLOCATOR: tvq_testkit::PoisonedAllocator = tvq_testkit::PoisonedAllocator;
