//! The disk tier's own thread: the engine thread hands it blocks to write
//! and prefixes to fetch and never waits on a disk. Fetches for waiting
//! requests go before writes; both queues are bounded, and writes past the
//! bound are dropped and counted (the blocks stay in memory).

use std::collections::VecDeque;
use std::sync::{mpsc, Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use deepinfer_engine::engine::{FetchedBlock, PersistBlock, WantedBlock};
use deepinfer_engine::model::Model;
use deepinfer_engine::request::RequestId;

use super::{DiskConfig, DiskStats, DiskTier};

/// Most blocks queued for writing.
pub const MAX_QUEUED_WRITES: usize = 8192;
/// Most prefixes queued for fetching.
pub const MAX_QUEUED_FETCHES: usize = 1024;

/// A clock in milliseconds since the Unix epoch (injected, so tests can move it).
pub type Clock = Arc<dyn Fn() -> u64 + Send + Sync>;
/// Called on the disk thread after each completed fetch, so an owner that
/// does not poll (an actor) can be told to collect it.
pub type Wake = Box<dyn Fn() + Send>;

/// What a fetch found for one waiting request.
#[derive(Debug)]
pub struct Fetched {
    pub id: RequestId,
    pub blocks: Vec<FetchedBlock>,
    /// Time from the request's fetch being queued to its blocks being read.
    pub latency: Duration,
}

#[derive(Default)]
struct Queues {
    fetches: VecDeque<(RequestId, Vec<WantedBlock>, Instant)>,
    writes: VecDeque<PersistBlock>,
    closed: bool,
}

/// Handle to the disk tier's thread; dropping it finishes queued writes first.
pub struct DiskWorker {
    queues: Arc<(Mutex<Queues>, Condvar)>,
    fetched: mpsc::Receiver<Fetched>,
    thread: Option<JoinHandle<()>>,
    pub stats: Arc<DiskStats>,
    /// Key and parent key of the blocks found when the index was rebuilt.
    indexed: Vec<(u64, u64)>,
}

impl DiskWorker {
    /// Open the tier, rebuilding its index before it returns, and start its thread.
    pub fn start(model: Arc<Model>, block_tokens: usize, config: &DiskConfig, clock: Clock) -> std::io::Result<Self> {
        Self::start_waking(model, block_tokens, config, clock, Box::new(|| ()))
    }

    /// [`start`](Self::start), calling `wake` after each fetch completes.
    pub fn start_waking(
        model: Arc<Model>,
        block_tokens: usize,
        config: &DiskConfig,
        clock: Clock,
        wake: Wake,
    ) -> std::io::Result<Self> {
        let stats = Arc::new(DiskStats::default());
        let queues: Arc<(Mutex<Queues>, Condvar)> = Arc::default();
        let (tx, fetched) = mpsc::channel();
        let mut tier = DiskTier::open(model, block_tokens, config, stats.clone(), clock());
        let indexed = tier.keys();
        let thread_queues = queues.clone();
        let thread = std::thread::Builder::new().name("kv-disk".into()).spawn(move || {
            serve(&mut tier, &thread_queues, &tx, &clock, &wake);
        })?;
        Ok(Self { queues, fetched, thread: Some(thread), stats, indexed })
    }

    /// Queue blocks for writing; those past the bound are dropped.
    pub fn write(&self, blocks: Vec<PersistBlock>) {
        let (lock, wake) = &*self.queues;
        let mut q = lock.lock().expect("disk queues");
        for b in blocks {
            if q.writes.len() >= MAX_QUEUED_WRITES {
                self.stats.dropped_writes.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            } else {
                q.writes.push_back(b);
            }
        }
        wake.notify_one();
    }

    /// Queue a fetch; false if the queue is full (the request goes on without it).
    pub fn fetch(&self, id: RequestId, wanted: Vec<WantedBlock>) -> bool {
        let (lock, wake) = &*self.queues;
        let mut q = lock.lock().expect("disk queues");
        if q.fetches.len() >= MAX_QUEUED_FETCHES {
            return false;
        }
        q.fetches.push_back((id, wanted, Instant::now()));
        wake.notify_one();
        true
    }

    /// The blocks found on disk at start (once; empty afterwards).
    pub fn take_indexed(&mut self) -> Vec<(u64, u64)> {
        std::mem::take(&mut self.indexed)
    }

    pub fn try_fetched(&self) -> Option<Fetched> {
        self.fetched.try_recv().ok()
    }

    /// Wait up to `timeout` for a fetch to complete.
    pub fn wait_fetched(&self, timeout: Duration) -> Option<Fetched> {
        self.fetched.recv_timeout(timeout).ok()
    }
}

impl Drop for DiskWorker {
    fn drop(&mut self) {
        let (lock, wake) = &*self.queues;
        lock.lock().expect("disk queues").closed = true;
        wake.notify_one();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

enum Work {
    Fetch(RequestId, Vec<WantedBlock>, Instant),
    Write(PersistBlock),
}

fn serve(
    tier: &mut DiskTier,
    queues: &(Mutex<Queues>, Condvar),
    fetched: &mpsc::Sender<Fetched>,
    clock: &Clock,
    wake: &Wake,
) {
    let (lock, signal) = queues;
    loop {
        let work = {
            let mut q = lock.lock().expect("disk queues");
            loop {
                if let Some((id, wanted, at)) = q.fetches.pop_front() {
                    break Work::Fetch(id, wanted, at);
                }
                if let Some(b) = q.writes.pop_front() {
                    break Work::Write(b);
                }
                if q.closed {
                    return;
                }
                q = signal.wait(q).expect("disk queues");
            }
        };
        match work {
            Work::Fetch(id, wanted, at) => {
                let blocks = tier.fetch(&wanted, clock());
                // The engine thread may be gone at shutdown; nothing to tell then.
                if fetched.send(Fetched { id, blocks, latency: at.elapsed() }).is_ok() {
                    wake();
                }
            }
            Work::Write(b) => tier.write(&b, clock()),
        }
    }
}
