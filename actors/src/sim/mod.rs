//! What makes a run reproducible and testable: the injected clock
//! (`clock.rs`), seeded random streams (`rng.rs`), the simulated fabric
//! (`fabric.rs`), fault plans (`faults.rs`), and the event log and counters
//! every run keeps (`events.rs`). Time comes only from a `Clock`; randomness
//! only from a `Seed`.

pub mod clock;
pub mod events;
pub mod fabric;
pub mod faults;
pub mod rng;
