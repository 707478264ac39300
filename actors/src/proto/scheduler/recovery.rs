//! Placement and recovery: expert tables sent to the shards, timeouts,
//! restarted workers and caches, lost nodes.

use super::*;

impl SchedulerMachine {
    /// A new table from the measured loads when one is due and differs from the current one.
    pub(super) fn eplb_change(&mut self) -> Option<crate::cluster::placement::Placement> {
        let cfg = self.ctx.eplb?;
        // Lost devices get nothing: a fresh table is cut down to the survivors.
        let gone = self.lost_devices();
        let tracker = self.eplb.as_mut().filter(|t| t.should_rebalance())?;
        let current = self.ctx.durable.placement(self.home, self.instance);
        let loads = tracker.total_loads();
        // A few copies moved from the current table when that balances about
        // as well as a new table; else the new table, renumbered to keep
        // weights where they are. Either way only the copies that change move.
        let moves = current.devices() as usize;
        let table = eplb_table(tracker, current.devices(), cfg.redundant)
            .map_err(|e| e.to_string())
            .and_then(|p| p.keeping(&current).without_devices(&gone).map_err(|e| e.to_string()))
            .map(|fresh| {
                let refined = current.refined(&loads, moves, &gone);
                if refined.imbalance(&loads) <= fresh.imbalance(&loads) + cfg.min_gain {
                    refined
                } else {
                    fresh
                }
            });
        match table {
            Ok(p) if p.clone().with_epoch(current.epoch()) != current => {
                // Moving weights costs reads and memory: only for a real gain in balance.
                let (was, would) = (current.imbalance(&loads), p.imbalance(&loads));
                if would >= was || was - would < cfg.min_gain {
                    return None;
                }
                let moved = p.copies_moved_from(&current);
                self.ctx.events.record(format_args!(
                    "{} eplb: new expert table ({moved} copies move; heaviest device {was:.3} -> {would:.3} of the mean)",
                    self.addr
                ));
                Some(p)
            }
            Ok(_) => None,
            Err(e) => {
                self.ctx.events.record(format_args!("{} eplb: {e}", self.addr));
                None
            }
        }
    }

    /// This instance's devices its node holds lost, numbered within the instance.
    fn lost_devices(&self) -> BTreeSet<u32> {
        let topo = &self.ctx.topology;
        let base = topo.devices_of(self.instance).start;
        topo.devices_of(self.instance).filter(|&d| self.ctx.durable.is_lost(self.home, d)).map(|d| d - base).collect()
    }

    /// Send `p` (the next epoch) to the live shards to read its experts while the current table serves.
    pub(super) fn prepare(&mut self, p: crate::cluster::placement::Placement, why: &'static str) {
        let current = self.ctx.durable.placement(self.home, self.instance).epoch();
        let placement = p.with_epoch(current + 1);
        let waiting: BTreeSet<u32> =
            self.ctx.topology.devices_of(self.instance).filter(|d| !self.ctx.durable.is_lost(self.home, *d)).collect();
        let deadline = self.now() + self.ctx.timeouts.control;
        self.ctx.events.record(format_args!("{} {why}: preparing epoch {}", self.addr, current + 1));
        self.preparing = Some(Preparing {
            placement,
            base_epoch: current,
            waiting,
            deadline,
            round: 0,
            bytes_read: 0,
            load_us_max: 0,
            why,
        });
        self.send_prepare();
    }

    fn send_prepare(&mut self) {
        let Some(p) = &self.preparing else { return };
        let base = self.ctx.topology.devices_of(self.instance).start;
        let msgs: Vec<(u32, Control)> = p
            .waiting
            .iter()
            .map(|&d| {
                (d, Control::PrepareExperts { epoch: p.placement.epoch(), experts: p.placement.experts_on(d - base) })
            })
            .collect();
        for (d, msg) in msgs {
            self.send(Addr::shard(d), Message::Control(msg), &[]);
        }
    }

    pub(super) fn on_prepared(&mut self, epoch: u64, device: u32, bytes_read: u64, load_us: u64) {
        let Some(p) = self.preparing.as_mut().filter(|p| p.placement.epoch() == epoch) else { return };
        if p.waiting.remove(&device) {
            p.bytes_read += bytes_read;
            p.load_us_max = p.load_us_max.max(load_us);
        }
        // Idle with work waiting: the switch need not wait for the next step's trigger.
        if p.waiting.is_empty() && matches!(self.phase, Phase::Idle) {
            self.tick();
        }
    }

    /// The prepared table when every shard has read its experts; a stale or
    /// unanswered one is dropped (the current table keeps serving).
    pub(super) fn prepared_change(&mut self) -> Option<crate::cluster::placement::Placement> {
        let current = self.ctx.durable.placement(self.home, self.instance).epoch();
        let now = self.now();
        let p = self.preparing.as_mut()?;
        if p.base_epoch != current {
            self.ctx.events.record(format_args!(
                "{} {}: epoch {} dropped: the table changed",
                self.addr,
                p.why,
                p.placement.epoch()
            ));
            // A dropped rejoin is tried again at the next step.
            self.rejoined |= p.why == "rejoin";
            self.preparing = None;
            return None;
        }
        if !p.waiting.is_empty() {
            if now >= p.deadline {
                p.round += 1;
                if p.round >= self.ctx.timeouts.control_attempts {
                    let why = format!(
                        "{} {}: epoch {} dropped: shards {:?} did not prepare",
                        self.addr,
                        p.why,
                        p.placement.epoch(),
                        p.waiting
                    );
                    self.ctx.events.record(format_args!("{why}"));
                    self.rejoined |= p.why == "rejoin";
                    self.preparing = None;
                    return None;
                }
                p.deadline = now + self.ctx.timeouts.control;
                self.send_prepare();
            }
            return None;
        }
        let p = self.preparing.take().expect("checked");
        self.ctx.metrics.placements_prepared.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.ctx.events.record(format_args!(
            "{} {}: epoch {} prepared ({} bytes read, slowest shard {} us)",
            self.addr,
            p.why,
            p.placement.epoch(),
            p.bytes_read,
            p.load_us_max
        ));
        Some(p.placement)
    }

    /// Send the instance's current table to its shards and wait for every acknowledgement.
    pub(super) fn load_placement(&mut self, step: Option<u64>) {
        let p = self.ctx.durable.placement(self.home, self.instance);
        let waiting: BTreeSet<u32> =
            self.ctx.topology.devices_of(self.instance).filter(|d| !self.ctx.durable.is_lost(self.home, *d)).collect();
        self.send_tables(&waiting);
        let deadline = self.now() + self.ctx.timeouts.control;
        self.phase = Phase::Loading { epoch: p.epoch(), waiting, round: 0, deadline, step };
        self.arm(deadline);
    }

    pub(super) fn send_tables(&mut self, to: &BTreeSet<u32>) {
        let p = self.ctx.durable.placement(self.home, self.instance);
        let base = self.ctx.topology.devices_of(self.instance).start;
        for &d in to {
            let msg = Control::LoadExperts { epoch: p.epoch(), experts: p.experts_on(d - base) };
            self.send(Addr::shard(d), Message::Control(msg), &[]);
        }
    }

    pub(super) fn on_timeout(&mut self, serial: u64) {
        if serial != self.serial {
            return;
        }
        let now = self.now();
        match std::mem::replace(&mut self.phase, Phase::Idle) {
            Phase::Idle => {}
            Phase::Loading { epoch, waiting, round, deadline, step } => {
                if deadline > now {
                    self.phase = Phase::Loading { epoch, waiting, round, deadline, step };
                    self.arm(deadline);
                } else if round + 1 >= self.ctx.timeouts.control_attempts {
                    let why = format!("placement epoch {epoch} not acknowledged by shards {waiting:?}");
                    self.ctx.events.record(format_args!("{}: {why}", self.addr));
                    let ids: Vec<u64> = self.live.keys().copied().collect();
                    let items = ids.into_iter().filter_map(|id| self.fail(id, &why)).collect();
                    self.send_outputs(items, &[]);
                } else {
                    self.send_tables(&waiting);
                    let deadline = now + self.ctx.timeouts.control;
                    self.phase = Phase::Loading { epoch, waiting, round: round + 1, deadline, step };
                    self.arm(deadline);
                }
            }
            Phase::Fetching { run, query, deadline } => {
                if deadline > now {
                    self.phase = Phase::Fetching { run, query, deadline };
                    self.arm(deadline);
                } else {
                    self.ctx.events.record(format_args!("{} fetch {query} unanswered", self.addr));
                    self.fetched(run, Vec::new(), Vec::new());
                }
            }
            Phase::Running(mut run) => {
                let late: Vec<u32> = run.pending.iter().filter(|(_, p)| p.deadline <= now).map(|(w, _)| *w).collect();
                for w in late {
                    self.retry(&mut run, w, "no answer");
                }
                if run.pending.is_empty() {
                    self.complete(run);
                } else {
                    self.phase = Phase::Running(run);
                    self.rearm_running();
                }
            }
        }
    }

    pub(super) fn on_loaded(&mut self, epoch: u64, device: u32) -> Result<(), Crash> {
        let Phase::Loading { epoch: want, waiting, .. } = &mut self.phase else { return Ok(()) };
        if epoch != *want {
            return Ok(());
        }
        waiting.remove(&device);
        if !waiting.is_empty() {
            return Ok(());
        }
        let Phase::Loading { step, .. } = std::mem::replace(&mut self.phase, Phase::Idle) else { unreachable!() };
        match step {
            Some(step) => self.plan(step),
            None => self.tick(),
        }
        Ok(())
    }

    /// A shard holds a table of epoch `held` while this scheduler offered
    /// `offered`: a table it never wrote (an earlier incarnation of this
    /// scheduler's process wrote it). Only a `held` past the current epoch
    /// matters (an older one answers a late frame): the current table is
    /// numbered past it and sent again, now if the shards are being loaded,
    /// else at the next step (a preparation under way is dropped and redone).
    pub(super) fn on_behind(&mut self, offered: u64, held: u64, device: u32) {
        let current = self.ctx.durable.placement(self.home, self.instance);
        if held <= current.epoch() {
            return;
        }
        self.ctx.events.record(format_args!(
            "{}: shard{device} holds epoch {held}, past this table's {} (offered {offered})",
            self.addr,
            current.epoch()
        ));
        if let Some(p) = self.preparing.take() {
            self.rejoined |= p.why == "rejoin";
        }
        // The same table under a new number: a step under way keeps its
        // replicas, so the shards may take it at once.
        self.ctx.durable.set_placement(self.home, self.instance, current.with_epoch(held + 1));
        self.ctx.events.record(format_args!("{} placement epoch {} (renumbered)", self.addr, held + 1));
        if let Phase::Loading { step, .. } = self.phase {
            self.load_placement(step);
        } else {
            let live: BTreeSet<u32> = self
                .ctx
                .topology
                .devices_of(self.instance)
                .filter(|d| !self.ctx.durable.is_lost(self.home, *d))
                .collect();
            self.send_tables(&live);
        }
    }

    /// Shard `device` started, or answered a step as if it held another
    /// table: send it the current one (a started shard read its own
    /// process's copy, which after a process restart is the configured one).
    pub(super) fn on_shard_started(&mut self, device: u32) {
        if !self.ctx.topology.devices_of(self.instance).contains(&device) || self.ctx.durable.is_lost(self.home, device)
        {
            return;
        }
        self.send_tables(&BTreeSet::from([device]));
    }

    pub(super) fn on_worker_restarted(&mut self, worker: u32, instance: u64) {
        let Phase::Running(mut run) = std::mem::replace(&mut self.phase, Phase::Idle) else {
            return;
        };
        if run.pending.contains_key(&worker) {
            self.retry(&mut run, worker, &format!("worker restarted (instance {instance})"));
        }
        if run.pending.is_empty() {
            self.complete(run);
        } else {
            self.phase = Phase::Running(run);
            self.rearm_running();
        }
    }

    /// Membership declared `node` dead. If it held devices of this instance,
    /// their copies of the experts move to survivors (a new placement epoch)
    /// and this scheduler fails on purpose: its supervisor restarts it, the
    /// router submits every request again, and they are recomputed on the
    /// surviving workers, as after any scheduler crash.
    pub(super) fn on_node_down(&mut self, node: u32) -> Result<(), Crash> {
        // Heard after the node was up again (a process restarted faster than
        // the failure timeout is reported down and up at once): nothing is
        // lost. Its shards ask for the table and its workers for histories.
        if !self.ctx.durable.is_node_down(self.home, node) {
            self.ctx.events.record(format_args!("{}: node{node} is down and back already", self.addr));
            return Ok(());
        }
        let topo = &self.ctx.topology;
        let lost: Vec<u32> = topo.devices_of(self.instance).filter(|&d| topo.node_of_device(d) == node).collect();
        self.ctx.durable.mark_lost(self.home, &lost);
        if self.ctx.durable.in_minority(self.home) {
            if !self.fenced {
                self.fenced = true;
                self.ctx.events.record(format_args!(
                    "{} fenced: node{} is in a minority partition; no table change, no step until it is not",
                    self.addr, self.home
                ));
            }
            return Ok(());
        }
        if std::mem::take(&mut self.fenced) {
            self.ctx.events.record(format_args!("{} unfenced: node{} is in the majority again", self.addr, self.home));
            self.rejoined = true;
        }
        if !lost.is_empty() {
            self.ctx.events.record(format_args!("{}: node{node} is down (devices {lost:?})", self.addr));
        }
        self.apply_lost()
    }

    /// Re-place the experts of this instance's lost devices and restart on the survivors.
    fn apply_lost(&mut self) -> Result<(), Crash> {
        let gone = self.lost_devices();
        let current = self.ctx.durable.placement(self.home, self.instance);
        match current.without_devices(&gone) {
            // Already running without them (a repeated report, or a restart after the change).
            Ok(p) if p == current => return Ok(()),
            Ok(p) => self.ctx.durable.set_placement(self.home, self.instance, p.with_epoch(current.epoch() + 1)),
            Err(e) => {
                let why = format!("no device of instance {} is left: {e}", self.instance);
                let ids: Vec<u64> = self.live.keys().copied().collect();
                let items = ids.into_iter().filter_map(|id| self.fail(id, &why)).collect();
                self.send_outputs(items, &[]);
                return Ok(());
            }
        }
        Err(format!("{}: devices {gone:?} of the instance are lost; restarting on the survivors", self.addr).into())
    }

    /// `node`, declared dead before, answers again: if it holds devices of
    /// this instance, the next step puts their experts back (the configured
    /// table without what is still lost), and its workers take new requests.
    pub(super) fn on_node_up(&mut self, node: u32) -> Result<(), Crash> {
        if self.fenced && !self.ctx.durable.in_minority(self.home) {
            self.fenced = false;
            self.ctx.events.record(format_args!("{} unfenced: node{} is in the majority again", self.addr, self.home));
            // Devices that stayed lost while fenced are re-placed now; the others' experts come back.
            self.rejoined = true;
            self.apply_lost()?;
            self.tick();
        }
        let topo = &self.ctx.topology;
        if topo.devices_of(self.instance).any(|d| topo.node_of_device(d) == node) {
            self.ctx.events.record(format_args!("{}: node{node} is back", self.addr));
            self.rejoined = true;
            self.tick();
        }
        Ok(())
    }

    /// The table after a node came back, if it differs from the current one.
    pub(super) fn rejoin_change(&mut self) -> Option<crate::cluster::placement::Placement> {
        if !std::mem::take(&mut self.rejoined) {
            return None;
        }
        let gone = self.lost_devices();
        let current = self.ctx.durable.placement(self.home, self.instance);
        match self.ctx.durable.initial_placement(self.instance).without_devices(&gone) {
            Ok(p) if p.clone().with_epoch(current.epoch()) != current => Some(p),
            _ => None,
        }
    }

    pub(super) fn on_cache_restarted(&mut self) {
        self.policy.clear_prefix_cache();
        self.cached.clear();
        self.recent.clear();
        self.tiers_cleared();
        self.promotions_lost();
        self.ctx.events.record(format_args!("{} cache restarted: prefix index cleared", self.addr));
        if let Phase::Fetching { .. } = self.phase {
            let Phase::Fetching { run, .. } = std::mem::replace(&mut self.phase, Phase::Idle) else { unreachable!() };
            self.fetched(run, Vec::new(), Vec::new());
        }
    }
}
