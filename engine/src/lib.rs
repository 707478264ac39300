//! The sans-IO DeepSeek-V4 engine: model configuration, checkpoint loading,
//! the forward pass and the state it carries between steps, and the serving
//! core that drives it: requests, scheduler, KV block pool, prefix cache.
//!
//! Nothing here reads a clock, opens a socket or spawns a task.

// The preset configs are large `json!` literals.
#![recursion_limit = "256"]

pub mod balance;
pub mod block_values;
pub mod checkpoint;
pub mod config;
pub mod constraint;
pub mod cost;
pub mod device;
pub mod encoder_cache;
pub mod engine;
pub mod engine_tiers;
pub mod eplb;
pub mod images;
pub mod kv_pool;
pub mod kv_tiers;
pub mod model;
pub mod prefix_cache;
pub mod presets;
pub mod presets_v41;
pub mod request;
pub mod sampling;
pub mod scheduler;
pub mod speculative;
pub mod traffic;
pub mod transfer;
pub mod v41;
