//! Modelled devices for simulation at cluster scale: the device cost model
//! (`cost.rs`), a full-size model's shape and KV budget on each device
//! (`devices.rs`), each instance's limits and scale-up domain
//! (`deployment.rs`), image encoders before prefill (`encoder.rs`), expert balance over time (`balance.rs`), drafting
//! outcomes (`drafting.rs`) and the prompt-cache tiers below the device pool
//! (`tiers.rs`). Only used on a virtual clock.

pub mod balance;
pub mod cost;
pub mod deployment;
pub mod devices;
pub mod drafting;
pub mod encoder;
pub mod tiers;
