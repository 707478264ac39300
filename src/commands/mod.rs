//! One module per CLI command.

pub mod generate;
pub mod model_init;
