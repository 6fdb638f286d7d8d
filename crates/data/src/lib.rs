//! Corpora to token batches: enwik8, PG-19 and plain text. Not implemented
//! yet (issue 3); the crate exists so the workspace has its final shape.
