//! What every actor of a cluster is handed: the model, the transport, the
//! clock, the log, the counters, the fault plan and the timeouts.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use deepinfer_engine::model::Model;

use crate::clock::Clock;
use crate::events::{bump, EventLog, Metrics};
use crate::faults::Faults;
use crate::placement::Placement;
use crate::transport::{Delivery, Inbox, Transport};
use crate::wire::{self, Addr, Decoded, Envelope, Message};

/// How long to wait for an answer, and how often to ask again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timeouts {
    /// A worker re-sends a layer's unanswered dispatches after this long.
    pub dispatch: Duration,
    /// Dispatch rounds per layer before the worker fails the step.
    pub dispatch_attempts: u32,
    /// The scheduler re-sends an unanswered step request after this long.
    pub step: Duration,
    /// Requests per step (timeouts, rebuilds, failures) before its sequences fail.
    pub step_attempts: u32,
    /// Placement changes: wait for each shard's acknowledgement this long, this often.
    pub control: Duration,
    pub control_attempts: u32,
}

impl Timeouts {
    /// For the virtual clock, where computation takes no time: a timeout only
    /// fires when a message or an actor was really lost.
    pub fn simulated() -> Self {
        Self {
            dispatch: Duration::from_millis(20),
            dispatch_attempts: 8,
            step: Duration::from_millis(400),
            step_attempts: 12,
            control: Duration::from_millis(20),
            control_attempts: 8,
        }
    }

    /// For wall time: generous, since a slow machine must not look like a dead actor.
    pub fn real() -> Self {
        Self {
            dispatch: Duration::from_secs(2),
            dispatch_attempts: 5,
            step: Duration::from_secs(30),
            step_attempts: 6,
            control: Duration::from_secs(2),
            control_attempts: 5,
        }
    }
}

/// Shared by the actors of a cluster. The placement cell is the node's view
/// of the current table, read by a shard when it (re)starts.
pub struct Ctx {
    pub model: Arc<Model>,
    pub transport: Arc<dyn Transport>,
    pub clock: Arc<dyn Clock>,
    pub events: Arc<EventLog>,
    pub metrics: Arc<Metrics>,
    pub faults: Arc<Faults>,
    pub timeouts: Timeouts,
    pub placement: Arc<RwLock<Placement>>,
    /// Numbers actor instances, so that ids derived from them never repeat across restarts.
    pub instances: AtomicU64,
    /// Set once the whole tree has started: any later start is a restart.
    pub up: AtomicBool,
}

impl Ctx {
    /// Encode and send; a failure is logged and treated as a lost message.
    pub fn send(&self, from: Addr, to: Addr, msg: Message, body: &[f32]) -> Option<Vec<u8>> {
        let env = Envelope { from, to, msg };
        match wire::encode(&env, body) {
            Ok(frame) => {
                self.send_frame(from, to, frame.clone());
                Some(frame)
            }
            Err(e) => {
                self.events.record(format_args!("{from} cannot encode for {to}: {e}"));
                None
            }
        }
    }

    pub fn send_frame(&self, from: Addr, to: Addr, frame: Vec<u8>) {
        if let Err(e) = self.transport.send(from, to, frame) {
            self.events.record(format_args!("{from}->{to} not sent: {e}"));
        }
    }

    /// Decode a received frame; a bad one is counted, logged and dropped.
    pub fn open(&self, at: Addr, d: &Delivery) -> Option<Decoded> {
        match wire::decode(&d.frame) {
            Ok(m) if m.envelope.to == at => Some(m),
            Ok(m) => {
                bump(&self.metrics.frames_rejected);
                self.events.record(format_args!("{at} got a frame for {}", m.envelope.to));
                None
            }
            Err(e) => {
                bump(&self.metrics.frames_rejected);
                self.events.record(format_args!("{at} rejects a frame from {}: {e}", d.from));
                None
            }
        }
    }

    /// A cluster-unique instance number (from 1).
    pub fn new_instance(&self) -> u64 {
        self.instances.fetch_add(1, Ordering::Relaxed) + 1
    }

    pub fn is_up(&self) -> bool {
        self.up.load(Ordering::Relaxed)
    }

    pub fn placement(&self) -> Placement {
        self.placement.read().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// Forward an inbox into an actor's mailbox until either side goes away.
pub(crate) fn pump<M, F>(mut inbox: Inbox, to: ractor::ActorRef<M>, wrap: F)
where
    M: ractor::Message,
    F: Fn(Delivery) -> M + Send + 'static,
{
    tokio::spawn(async move {
        while let Some(d) = inbox.recv().await {
            if to.send_message(wrap(d)).is_err() {
                break;
            }
        }
    });
}
