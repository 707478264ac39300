//! Shells: the ractor actors that feed the protocol machines of
//! [`crate::proto`] and carry out their effects.

pub mod member;
pub mod scheduler;
