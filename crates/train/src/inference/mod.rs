//! Using a trained model: bits per byte over a split ([`evaluate`]),
//! where its attention went ([`attention`]),
//! accuracy on a recall task ([`recall`]) and how its pairs share codes
//! in the compressed cache ([`code_sharing`]), reading a prompt
//! ([`prefill`]), generation ([`sample`]), and weights in and out of safetensors
//! ([`export`]), and as a Hugging Face folder ([`hf`]); [`load`] finds the
//! model a path names.

pub mod attention;
pub mod code_sharing;
pub mod evaluate;
pub mod export;
pub mod hf;
pub mod load;
pub mod prefill;
pub mod recall;
pub mod sample;
