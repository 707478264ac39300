//! The deepinfer program: CLI, files users write, launcher.
pub mod tokenizer;
