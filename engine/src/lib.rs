//! The sans-IO DeepSeek-V4 engine: model configuration, checkpoint loading,
//! the forward pass and the state it carries between steps.
//!
//! Nothing here reads a clock, opens a socket or spawns a task.

// The preset configs are large `json!` literals.
#![recursion_limit = "256"]

pub mod checkpoint;
pub mod config;
pub mod model;
pub mod presets;
pub mod sampling;
