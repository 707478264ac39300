//! The simulated fabric: per-link latency and bandwidth, seeded jitter, drop,
//! duplicate, delay and partitions, on the virtual clock. It still decodes and
//! validates every frame it is handed, so a simulation exercises the same
//! wire path as a deployment.
//!
//! Deliveries sit in one queue ordered by (delivery time, send order) and a
//! single task hands them out, so the order of arrival is a function of the
//! seed alone, never of timer or task scheduling details.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{mpsc, Notify};

use crate::net::transport::{Delivery, Inbox, Transport, TransportError, DEFAULT_QUEUE};
use crate::sim::clock::Clock;
use crate::sim::events::{bump, EventLog, Metrics};
use crate::sim::faults::{Faults, MessageAction};
use crate::sim::rng::{Rng, Seed};
use crate::wire::{self, Addr};

/// One direction of a link between two nodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Link {
    pub latency: Duration,
    /// Bytes per second; 0 means unlimited.
    pub bandwidth: u64,
    /// Uniform extra latency in `[0, jitter)`, drawn from the seed.
    pub jitter: Duration,
}

/// Nodes in `a` cannot reach nodes in `b` (nor back) during `[from, until)`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Partition {
    pub a: Vec<u32>,
    pub b: Vec<u32>,
    pub from: Duration,
    pub until: Duration,
}

#[derive(Clone, Debug, PartialEq)]
pub struct FabricConfig {
    /// Between actors of one node (NVLink-class).
    pub local: Link,
    /// Between nodes (RDMA/Ethernet-class).
    pub remote: Link,
    /// Per (from node, to node) overrides.
    pub links: BTreeMap<(u32, u32), Link>,
    pub drop: f64,
    pub duplicate: f64,
    pub partitions: Vec<Partition>,
    /// Capacity of each inbox; a delivery to a full inbox is dropped.
    pub queue: usize,
    /// Most frames in flight on the whole fabric; beyond it sends fail.
    pub max_in_flight: usize,
}

impl Default for FabricConfig {
    fn default() -> Self {
        Self {
            local: Link {
                latency: Duration::from_micros(2),
                bandwidth: 200_000_000_000,
                jitter: Duration::from_micros(2),
            },
            remote: Link {
                latency: Duration::from_micros(10),
                bandwidth: 25_000_000_000,
                jitter: Duration::from_micros(10),
            },
            links: BTreeMap::new(),
            drop: 0.0,
            duplicate: 0.0,
            partitions: Vec::new(),
            queue: DEFAULT_QUEUE,
            max_in_flight: 1 << 16,
        }
    }
}

/// Which node an address lives on.
pub type NodeOf = Arc<dyn Fn(Addr) -> u32 + Send + Sync>;

struct Inner {
    queue: BTreeMap<(Duration, u64), (Addr, Delivery)>,
    seq: u64,
    link_free: BTreeMap<(u32, u32), Duration>,
    inboxes: BTreeMap<Addr, mpsc::Sender<Delivery>>,
    rng: Rng,
    closed: bool,
}

pub struct SimFabric {
    cfg: FabricConfig,
    node_of: NodeOf,
    clock: Arc<dyn Clock>,
    events: Arc<EventLog>,
    metrics: Arc<Metrics>,
    faults: Arc<Faults>,
    inner: Mutex<Inner>,
    wake: Notify,
}

impl SimFabric {
    /// Start the fabric's delivery task on the current runtime.
    pub fn start(
        cfg: FabricConfig,
        seed: Seed,
        node_of: NodeOf,
        clock: Arc<dyn Clock>,
        events: Arc<EventLog>,
        metrics: Arc<Metrics>,
        faults: Arc<Faults>,
    ) -> Arc<Self> {
        let inner = Inner {
            queue: BTreeMap::new(),
            seq: 0,
            link_free: BTreeMap::new(),
            inboxes: BTreeMap::new(),
            rng: seed.stream("fabric"),
            closed: false,
        };
        let fabric = Arc::new(Self {
            cfg,
            node_of,
            clock,
            events,
            metrics,
            faults,
            inner: Mutex::new(inner),
            wake: Notify::new(),
        });
        tokio::spawn(Arc::clone(&fabric).deliver_loop());
        fabric
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn link(&self, a: u32, b: u32) -> Link {
        match self.cfg.links.get(&(a, b)) {
            Some(l) => *l,
            None if a == b => self.cfg.local,
            None => self.cfg.remote,
        }
    }

    fn partitioned(&self, a: u32, b: u32, now: Duration) -> bool {
        self.cfg.partitions.iter().any(|p| {
            now >= p.from
                && now < p.until
                && ((p.a.contains(&a) && p.b.contains(&b)) || (p.a.contains(&b) && p.b.contains(&a)))
        })
    }

    async fn deliver_loop(self: Arc<Self>) {
        loop {
            let wake = self.wake.notified();
            let next = {
                let mut inner = self.lock();
                if inner.closed {
                    return;
                }
                let now = self.clock.now();
                match inner.queue.first_key_value() {
                    Some((&(at, _), _)) if at <= now => {
                        let ((_, _), (to, d)) = inner.queue.pop_first().expect("non-empty");
                        Some(Ok((to, d)))
                    }
                    Some((&(at, _), _)) => Some(Err(at - now)),
                    None => None,
                }
            };
            match next {
                Some(Ok((to, d))) => self.hand_over(to, d),
                Some(Err(wait)) => {
                    tokio::select! {
                        biased;
                        _ = wake => {}
                        _ = self.clock.sleep(wait) => {}
                    }
                }
                None => wake.await,
            }
        }
    }

    fn hand_over(&self, to: Addr, d: Delivery) {
        let from = d.from;
        let bytes = d.frame.len();
        let tx = self.lock().inboxes.get(&to).cloned();
        let outcome = match tx {
            None => "unbound",
            Some(tx) => match tx.try_send(d) {
                Ok(()) => "ok",
                Err(mpsc::error::TrySendError::Full(_)) => "inbox-full",
                Err(mpsc::error::TrySendError::Closed(_)) => "closed",
            },
        };
        if outcome == "ok" {
            bump(&self.metrics.frames_delivered);
        } else {
            bump(&self.metrics.frames_dropped);
        }
        self.events.record(format_args!("deliver {from}->{to} {bytes}B {outcome}"));
    }

    fn enqueue(&self, inner: &mut Inner, at: Duration, to: Addr, d: Delivery) {
        let seq = inner.seq;
        inner.seq += 1;
        inner.queue.insert((at, seq), (to, d));
    }
}

impl Transport for SimFabric {
    fn bind(&self, addr: Addr) -> Inbox {
        let (tx, rx) = mpsc::channel(self.cfg.queue);
        let mut inner = self.lock();
        if !inner.closed {
            inner.inboxes.insert(addr, tx);
        }
        drop(inner);
        self.events.record(format_args!("bind {addr}"));
        Inbox::new(rx)
    }

    fn send(&self, from: Addr, to: Addr, frame: Vec<u8>) -> Result<(), TransportError> {
        let kind = match wire::decode(&frame) {
            Ok(d) => d.kind(),
            Err(e) => {
                bump(&self.metrics.frames_rejected);
                self.events.record(format_args!("reject {from}->{to}: {e}"));
                return Err(TransportError::Rejected(e));
            }
        };
        let now = self.clock.now();
        let (a, b) = ((self.node_of)(from), (self.node_of)(to));
        let bytes = frame.len() as u64;
        bump(&self.metrics.frames_sent);
        self.metrics.bytes_sent.fetch_add(bytes, std::sync::atomic::Ordering::Relaxed);
        let mut inner = self.lock();
        if inner.closed {
            return Err(TransportError::Shutdown);
        }
        let drop_it = |why: &str| {
            bump(&self.metrics.frames_dropped);
            self.events.record(format_args!("drop {from}->{to} {} {bytes}B: {why}", kind.name()));
        };
        if self.partitioned(a, b, now) {
            drop_it("partition");
            return Ok(());
        }
        let injected = self.faults.message_action(kind);
        if injected == Some(MessageAction::Drop) || inner.rng.chance(self.cfg.drop) {
            drop_it("lost");
            return Ok(());
        }
        if inner.queue.len() >= self.cfg.max_in_flight {
            drop_it("fabric full");
            return Err(TransportError::QueueFull(to));
        }
        let link = self.link(a, b);
        let free = inner.link_free.get(&(a, b)).copied().unwrap_or(Duration::ZERO).max(now);
        let wire_time = if link.bandwidth == 0 {
            Duration::ZERO
        } else {
            Duration::from_nanos((bytes as u128 * 1_000_000_000 / link.bandwidth as u128) as u64)
        };
        inner.link_free.insert((a, b), free + wire_time);
        let jitter = |rng: &mut Rng| {
            if link.jitter.is_zero() {
                Duration::ZERO
            } else {
                Duration::from_nanos(rng.below(link.jitter.as_nanos() as u64))
            }
        };
        let extra = match injected {
            Some(MessageAction::Delay(d)) => d,
            _ => Duration::ZERO,
        };
        let at = free + wire_time + link.latency + jitter(&mut inner.rng) + extra;
        let duplicate = injected == Some(MessageAction::Duplicate) || inner.rng.chance(self.cfg.duplicate);
        let copy = duplicate.then(|| Delivery::new(from, frame.clone()));
        self.enqueue(&mut inner, at, to, Delivery::new(from, frame));
        let mut dup_at = None;
        if let Some(copy) = copy {
            let at2 = at + link.latency + jitter(&mut inner.rng);
            self.enqueue(&mut inner, at2, to, copy);
            dup_at = Some(at2);
        }
        drop(inner);
        self.events.record(format_args!("send {from}->{to} {} {bytes}B due {}", kind.name(), at.as_nanos()));
        if let Some(at2) = dup_at {
            bump(&self.metrics.frames_duplicated);
            self.events.record(format_args!("duplicate {from}->{to} {} due {}", kind.name(), at2.as_nanos()));
        }
        self.wake.notify_one();
        Ok(())
    }

    fn close(&self) {
        let mut inner = self.lock();
        inner.closed = true;
        inner.inboxes.clear();
        inner.queue.clear();
        drop(inner);
        self.wake.notify_one();
    }

    fn name(&self) -> &'static str {
        "simulated"
    }
}
