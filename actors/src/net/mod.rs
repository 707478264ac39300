//! Transports: the `Transport` trait and in-process channels
//! (`transport.rs`), QUIC between machines (`quic.rs`), the cluster's TLS
//! (`tls.rs`). Every frame a transport hands over is bounded and validated
//! before an actor sees it.

pub mod quic;
pub mod tls;
pub mod transport;
