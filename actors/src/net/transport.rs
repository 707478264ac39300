//! Moving frames between actors. One trait; in-process (tokio channels, real
//! threads) and simulated ([`crate::sim::fabric::SimFabric`]) implementations now, QUIC
//! later. A transport carries encoded frames only: the receiver decodes and
//! validates every frame it is handed, as it would from a socket.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use tokio::sync::mpsc;

use crate::sim::events::{bump, Metrics};
use crate::wire::{Addr, WireError};

/// A frame as received, with the sender's address as the fabric saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Delivery {
    pub from: Addr,
    pub frame: Vec<u8>,
}

/// The receiving end of an address.
pub struct Inbox {
    rx: mpsc::Receiver<Delivery>,
}

impl Inbox {
    pub fn new(rx: mpsc::Receiver<Delivery>) -> Self {
        Self { rx }
    }

    /// The next frame; `None` once the address was re-bound or the transport closed.
    pub async fn recv(&mut self) -> Option<Delivery> {
        self.rx.recv().await
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransportError {
    #[error("no actor is bound at {0}")]
    Unbound(Addr),
    #[error("the queue of {0} is full")]
    QueueFull(Addr),
    #[error("{0} is gone")]
    Closed(Addr),
    #[error("frame rejected: {0}")]
    Rejected(#[from] WireError),
    #[error("the transport is closed")]
    Shutdown,
}

/// Frames to addresses. `send` never blocks: queues are bounded and a full
/// queue is an error the sender treats like a lost message (the protocol
/// resends on timeout).
pub trait Transport: Send + Sync + 'static {
    /// Open `addr`'s inbox, replacing an earlier binding (a restarted actor
    /// takes over its address; frames queued for the old one are lost, as on a crash).
    fn bind(&self, addr: Addr) -> Inbox;
    fn send(&self, from: Addr, to: Addr, frame: Vec<u8>) -> Result<(), TransportError>;
    /// Drop every binding: pending `recv`s end.
    fn close(&self);
    /// Implementation name, for logs.
    fn name(&self) -> &'static str;
}

/// Queue a frame on `to`'s inbox without waiting; a full or closed inbox
/// drops it (the protocol resends on timeout).
pub(crate) fn offer(
    tx: &mpsc::Sender<Delivery>,
    d: Delivery,
    to: Addr,
    metrics: &Metrics,
) -> Result<(), TransportError> {
    match tx.try_send(d) {
        Ok(()) => {
            bump(&metrics.frames_delivered);
            Ok(())
        }
        Err(mpsc::error::TrySendError::Full(_)) => {
            bump(&metrics.frames_dropped);
            Err(TransportError::QueueFull(to))
        }
        Err(mpsc::error::TrySendError::Closed(_)) => {
            bump(&metrics.frames_dropped);
            Err(TransportError::Closed(to))
        }
    }
}

/// Per-address queue capacity of both transports.
pub const DEFAULT_QUEUE: usize = 4096;

/// Actors of one process on real tokio channels.
pub struct InProcess {
    capacity: usize,
    routes: Mutex<Option<BTreeMap<Addr, mpsc::Sender<Delivery>>>>,
    metrics: Arc<Metrics>,
}

impl InProcess {
    pub fn new(capacity: usize, metrics: Arc<Metrics>) -> Self {
        Self { capacity, routes: Mutex::new(Some(BTreeMap::new())), metrics }
    }
}

impl Transport for InProcess {
    fn bind(&self, addr: Addr) -> Inbox {
        let (tx, rx) = mpsc::channel(self.capacity);
        if let Some(routes) = self.routes.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
            routes.insert(addr, tx);
        }
        Inbox::new(rx)
    }

    fn send(&self, from: Addr, to: Addr, frame: Vec<u8>) -> Result<(), TransportError> {
        let tx = {
            let routes = self.routes.lock().unwrap_or_else(|e| e.into_inner());
            let routes = routes.as_ref().ok_or(TransportError::Shutdown)?;
            routes.get(&to).cloned().ok_or(TransportError::Unbound(to))?
        };
        bump(&self.metrics.frames_sent);
        self.metrics.bytes_sent.fetch_add(frame.len() as u64, std::sync::atomic::Ordering::Relaxed);
        offer(&tx, Delivery { from, frame }, to, &self.metrics)
    }

    fn close(&self) {
        *self.routes.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }

    fn name(&self) -> &'static str {
        "in-process"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn rebinding_takes_over_an_address() {
        let t = InProcess::new(2, Arc::default());
        let a = Addr::worker(0);
        let mut old = t.bind(a);
        t.send(Addr::scheduler(0), a, vec![1]).unwrap();
        let mut new = t.bind(a);
        t.send(Addr::scheduler(0), a, vec![2]).unwrap();
        assert_eq!(old.recv().await.unwrap().frame, vec![1]);
        assert!(old.recv().await.is_none());
        assert_eq!(new.recv().await.unwrap().frame, vec![2]);
        t.send(Addr::scheduler(0), a, vec![3]).unwrap();
        t.send(Addr::scheduler(0), a, vec![4]).unwrap();
        assert_eq!(t.send(Addr::scheduler(0), a, vec![5]), Err(TransportError::QueueFull(a)));
        assert_eq!(t.send(Addr::scheduler(0), Addr::shard(9), vec![]), Err(TransportError::Unbound(Addr::shard(9))));
        t.close();
        assert_eq!(t.send(Addr::scheduler(0), a, vec![]), Err(TransportError::Shutdown));
    }
}
