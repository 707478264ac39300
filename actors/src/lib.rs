//! The distributed runtime of deepinfer: routers, schedulers, cache
//! managers, GPU workers and expert shards as supervised ractor actors that
//! talk in versioned rkyv frames over a
//! [`transport::Transport`], on a [`clock::Clock`] that is wall time in
//! production and tokio's paused clock in simulation.
//!
//! Determinism rules kept here: time only from the handed-in clock;
//! randomness only from [`rng::Seed`] streams; ordered maps in every decision;
//! no ractor named registry; in simulation one current-thread runtime.

pub mod actor;
pub mod cache;
pub mod clock;
pub mod cluster;
pub mod cost;
pub mod ctx;
pub mod disagg;
pub mod drafting;
pub mod events;
pub mod faults;
pub mod modelled;
pub mod placement;
pub mod proto;
pub mod quic;
pub mod rng;
pub mod router;
pub mod shard;
pub mod sim;
pub mod supervisor;
pub mod tiers;
pub mod tls;
pub mod transport;
pub mod wire;
pub mod worker;

pub use cluster::{
    run, run_in_process, run_simulated, run_with, simulate, Cluster, ClusterConfig, ClusterError, Env, GenRequest,
    Generated, LocalCluster, NodeRuntime, RequestFailed, RunReport, Update,
};
pub use cost::DeviceCostModel;
