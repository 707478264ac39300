//! One module per CLI command.

pub mod batch;
pub mod cluster;
pub mod generate;
pub mod model_init;
pub mod plan;
pub mod serve;
pub mod simulate;
