//! The scheduler's tables checked after every input: what must hold
//! between the request table, the workers and the handoffs.

use super::*;

impl SchedulerMachine {
    /// The request table's invariants, after every input: `live` and
    /// `by_rid` are one bijection, every live request is on a worker of
    /// this instance, and a handed-off request is no longer live.
    /// (The walk over every request is for builds with debug assertions;
    /// the count stays checked everywhere.)
    pub(super) fn check_tables(&self) {
        assert_eq!(self.live.len(), self.by_rid.len(), "{}: request table out of step", self.addr);
        if !cfg!(debug_assertions) {
            return;
        }
        let devices = self.ctx.topology.devices_of(self.instance);
        for (id, l) in &self.live {
            assert_eq!(self.by_rid.get(&l.rid), Some(id), "{}: request {id} not indexed", self.addr);
            assert!(
                devices.contains(&l.worker),
                "{}: request {id} on worker{} of another instance",
                self.addr,
                l.worker
            );
            assert!(!self.handoffs.contains_key(id), "{}: request {id} both live and handed off", self.addr);
        }
        let queued: usize = self.queued.values().map(|q| q.len()).sum();
        let sent: usize = self.in_flight.values().map(|f| f.0).sum();
        assert_eq!(queued + sent, self.handoffs.len(), "{}: handoffs neither queued nor sent", self.addr);
        assert!(self.in_flight.values().all(|f| f.0 <= TRANSFER_WINDOW), "{}: a transfer window overflows", self.addr);
    }
}
