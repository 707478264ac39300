//! The ractor actors and their supervision. `scheduler`, `router`, `cache`,
//! `shard` and `member` are thin shells around protocol machines of
//! [`crate::proto`]; the worker still holds its logic and I/O in one type,
//! to become a machine and a shell the same way.

pub mod cache;
pub mod member;
pub mod router;
pub mod scheduler;
pub mod shard;
pub mod supervisor;
pub mod worker;
