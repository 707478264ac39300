//! Speculative decoding: how many drafts to verify, and how to verify them.

pub mod policy;
pub mod rejection;
