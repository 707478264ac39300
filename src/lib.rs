//! The deepinfer program: CLI, files users write, launcher.

pub mod allocator;
pub mod api;
pub mod backend;
pub mod cli;
pub mod cluster;
pub mod commands;
pub mod config_file;
pub mod drain;
pub mod engram_vocab;
pub mod generation;
pub use deepinfer_actors::kv_disk;
pub mod node_agent;
pub mod scenario;
pub mod simulate;
pub mod step_cost;
pub mod tokenizer;
pub mod topology;
pub mod trained;

#[cfg(test)]
mod tidy;
