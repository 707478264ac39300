//! Protocol machines: each actor's logic, sans-IO. A machine is handed the
//! time and one input and leaves effects for its shell in
//! [`crate::actor`]; no ractor, tokio, clock or socket appears below this
//! folder (a tidy test checks it), so a machine is tested with scripted
//! inputs alone.

pub mod membership;
pub mod scheduler;
