//! Transformer-VQ: linear-time attention through vector-quantized keys.
//!
//! The crate holds the network and nothing about files or training: build a
//! [`TransformerVq`] from a [`TransformerVqConfig`], run segments through
//! [`TransformerVq::forward`] (block-parallel, linear in the segment length;
//! a [`Pass`] says what the pass is for) or decode tokens one at a time
//! through [`TransformerVq::decode`] (recurrent, constant work per token),
//! carrying a [`ModelState`] between calls.
//!
//! Modules are generic over `B: Backend`; the binaries use `burn::Dispatch`
//! with a device chosen at run time (by the training crate); [`device`]
//! moves tensors between devices.

pub mod attention;
pub mod compute;
pub mod config;
pub mod device;
pub mod dropout;
pub mod error;
pub mod gau;
pub mod kernel;
pub mod layout;
pub mod loss;
pub mod model;
pub mod norm;
pub mod official;
pub mod ops;
pub mod pass;
pub mod position;
pub mod precision;
pub mod quantizer;

pub use attention::AttentionState;
pub use compute::Compute;
pub use config::{
    AttentionForm, CacheGrad, CountWeight, MatrixProduct, RelativeBias, TransformerVqConfig,
    WindowKeys,
};
pub use dropout::DropoutMasks;
pub use error::{ConfigError, ModelError};
pub use gau::GauOutput;
pub use kernel::{Kernels, VqBackend};
pub use loss::{Loss, PAD, token_nll};
pub use model::{ModelOutput, ModelState, TransformerVq};
pub use pass::{Graph, Logits, Pass, PassInput, Recomputable};
pub use precision::Precision;
pub use quantizer::{CodebookMetrics, CodebookStats};
