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

/// Send the frames a machine at `from` left, in order.
pub(crate) fn send_outgoing(
    ctx: &crate::cluster::ctx::Ctx,
    from: crate::wire::Addr,
    outgoing: Vec<crate::proto::Outgoing>,
) {
    for o in outgoing {
        ctx.send_frame(from, o.to, o.frame);
    }
}
