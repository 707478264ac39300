//! The ractor actors and their supervision. `scheduler`, `router`, `cache`,
//! `shard`, `worker`, `encoder` and `member` are thin shells around protocol machines
//! of [`crate::proto`]: they feed a machine its inputs with the clock's time
//! and carry out the effects it leaves.

pub mod cache;
pub mod encoder;
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
