//! Training of Transformer-VQ models: the loop, optimizer, checkpoints and
//! metrics. Not implemented yet (issue 4); the crate exists so the
//! workspace has its final shape.
