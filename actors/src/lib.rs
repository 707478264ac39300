//! The distributed runtime of deepinfer: routers, schedulers, cache
//! managers, GPU workers and expert shards as supervised ractor actors that
//! talk in versioned rkyv frames over a
//! [`net::transport::Transport`], on a [`sim::clock::Clock`] that is wall time in
//! production and tokio's paused clock in simulation.
//!
//! Determinism rules kept here: time only from the handed-in clock;
//! randomness only from [`sim::rng::Seed`] streams; ordered maps in every decision;
//! no ractor named registry; in simulation one current-thread runtime.

pub mod actor;
pub mod cluster;
pub mod kv_disk;
pub mod limits;
pub mod modelled;
pub mod net;
pub mod proto;
pub mod sim;
pub mod wire;

pub use cluster::{
    run, run_in_process, run_simulated, run_with, simulate, Cluster, ClusterConfig, ClusterError, Env, GenRequest,
    Generated, LocalCluster, NodeRuntime, RequestFailed, RunReport, Update,
};
pub use modelled::cost::DeviceCostModel;
