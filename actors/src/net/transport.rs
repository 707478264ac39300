//! Moving frames between actors. One trait; in-process (tokio channels, real
//! threads) and simulated ([`crate::sim::fabric::SimFabric`]) implementations now, QUIC
//! later. A transport carries encoded frames only: the receiver decodes and
//! validates every frame it is handed, as it would from a socket.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};

use crate::sim::events::{bump, Metrics};
use crate::wire::{Addr, WireError};

/// A frame as received, with the sender's address as the fabric saw it.
/// Between [`pump`] and the end of the actor's handling it holds one of
/// its mailbox's credits.
pub struct Delivery {
    pub from: Addr,
    pub frame: Vec<u8>,
    credit: Option<OwnedSemaphorePermit>,
}

impl Delivery {
    pub fn new(from: Addr, frame: Vec<u8>) -> Self {
        Self { from, frame, credit: None }
    }
}

/// A copy holds no credit.
impl Clone for Delivery {
    fn clone(&self) -> Self {
        Self::new(self.from, self.frame.clone())
    }
}

impl PartialEq for Delivery {
    fn eq(&self, other: &Self) -> bool {
        (self.from, &self.frame) == (other.from, &other.frame)
    }
}

impl Eq for Delivery {}

impl std::fmt::Debug for Delivery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Delivery").field("from", &self.from).field("frame_bytes", &self.frame.len()).finish()
    }
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

    /// A frame that is already there, without waiting.
    pub fn try_recv(&mut self) -> Option<Delivery> {
        self.rx.try_recv().ok()
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

pub use crate::limits::{DEFAULT_QUEUE, MAILBOX_FRAMES};

/// Forward an inbox into an actor's mailbox until either side goes away,
/// never more than `MAILBOX_FRAMES` at a time that the actor has not
/// finished handling: each carries a credit that returns when the actor
/// drops the delivery.
pub(crate) fn pump<M, F>(inbox: Inbox, to: ractor::ActorRef<M>, wrap: F)
where
    M: ractor::Message,
    F: Fn(Delivery) -> M + Send + 'static,
{
    pump_with_credits(inbox, to, wrap, MAILBOX_FRAMES);
}

fn pump_with_credits<M, F>(mut inbox: Inbox, to: ractor::ActorRef<M>, wrap: F, credits: usize)
where
    M: ractor::Message,
    F: Fn(Delivery) -> M + Send + 'static,
{
    assert!(credits > 0, "an actor must be able to receive");
    let credits = Arc::new(Semaphore::new(credits));
    tokio::spawn(async move {
        loop {
            // The credit first: while the actor is behind, frames stay in
            // the bounded inbox, where the transport sees it is full.
            let Ok(credit) = Arc::clone(&credits).acquire_owned().await else { break };
            let Some(mut d) = inbox.recv().await else { break };
            d.credit = Some(credit);
            if to.send_message(wrap(d)).is_err() {
                break;
            }
        }
    });
}

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
        offer(&tx, Delivery::new(from, frame), to, &self.metrics)
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

    /// Holds every delivery it gets until told to let go.
    struct Stuck;

    enum StuckMsg {
        Net(Delivery),
        Release,
    }

    impl ractor::Actor for Stuck {
        type Msg = StuckMsg;
        type State = (Vec<Delivery>, Arc<std::sync::atomic::AtomicUsize>);
        type Arguments = Arc<std::sync::atomic::AtomicUsize>;

        async fn pre_start(
            &self,
            _me: ractor::ActorRef<StuckMsg>,
            seen: Self::Arguments,
        ) -> Result<Self::State, ractor::ActorProcessingErr> {
            Ok((Vec::new(), seen))
        }

        async fn handle(
            &self,
            _me: ractor::ActorRef<StuckMsg>,
            msg: StuckMsg,
            (held, seen): &mut Self::State,
        ) -> Result<(), ractor::ActorProcessingErr> {
            match msg {
                StuckMsg::Net(d) => {
                    seen.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    held.push(d);
                }
                StuckMsg::Release => held.clear(),
            }
            Ok(())
        }
    }

    #[tokio::test]
    async fn a_slow_actor_bounds_its_mailbox_and_the_transport_refuses_the_rest() {
        let (queue, credits) = (8, 4);
        let metrics = Arc::new(Metrics::default());
        let t = InProcess::new(queue, Arc::clone(&metrics));
        let a = Addr::worker(0);
        let seen = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (actor, handle) = ractor::Actor::spawn(None, Stuck, Arc::clone(&seen)).await.unwrap();
        pump_with_credits(t.bind(a), actor.clone(), StuckMsg::Net, credits);
        let mut accepted = 0;
        for i in 0..100u8 {
            if t.send(Addr::scheduler(0), a, vec![i]).is_ok() {
                accepted += 1;
            }
            tokio::task::yield_now().await;
        }
        let settle = || async {
            for _ in 0..100 {
                tokio::task::yield_now().await;
            }
        };
        settle().await;
        assert_eq!(seen.load(std::sync::atomic::Ordering::Relaxed), credits, "the actor holds its credits");
        assert_eq!(accepted, queue + credits, "the inbox filled behind them");
        assert_eq!(metrics.snapshot().frames_dropped, 100 - accepted as u64, "every refusal counted");
        // Handled deliveries return their credits; the queued frames flow again.
        actor.send_message(StuckMsg::Release).unwrap();
        settle().await;
        assert_eq!(seen.load(std::sync::atomic::Ordering::Relaxed), 2 * credits);
        actor.stop(None);
        handle.await.unwrap();
    }
}
