//! The engine thread: the only owner of the [`Engine`]. HTTP handlers submit
//! requests over a bounded channel and read per-request events; a request
//! whose event receiver is gone (the client left) is cancelled at the next
//! step, which frees its KV blocks.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use deepinfer_engine::engine::{Engine, EngineConfig, TierConfig};
use deepinfer_engine::model::Model;
use deepinfer_engine::request::{FinishReason, Finished, Request, RequestError, RequestId, RequestStatus, TokenOutput};
use tokio::sync::mpsc;

use super::cache_metrics;
use super::constraint::RequestConstraint;
use super::failure::{Evidence, Failure, Origin};
use super::metrics as m;
use crate::kv_disk::worker::{Clock, DiskWorker, Fetched};
use crate::kv_disk::{CacheSetup, DiskStats};

/// A request for the engine thread.
pub struct Submission {
    pub request: Request,
    pub constraint: Option<RequestConstraint>,
    pub events: mpsc::UnboundedSender<Event>,
    /// When the HTTP request arrived, for time to first token.
    pub arrived: Instant,
}

/// What the engine thread tells a handler about its request, in this order:
/// `Queued` or `Rejected`; then `Tokens` (zero or more) and `Finished`,
/// `Failed` or (a cluster's late refusal) `Rejected`.
#[derive(Debug)]
pub enum Event {
    Queued,
    Rejected(RequestError),
    /// Tokens generated; `cached_tokens` is the prompt's prefix-cache hit,
    /// known once the request is admitted.
    Tokens {
        tokens: Vec<TokenOutput>,
        cached_tokens: usize,
    },
    /// The request ended with an answer (stop or length). A final EOS is
    /// not among the tokens sent.
    Finished(Finished),
    /// The request ended without one: an error, or cancelled by the server.
    Failed(Failure),
}

impl Event {
    /// The event that ends a request run by `origin`.
    pub fn end(finished: Finished, origin: Origin) -> Self {
        match Failure::of_finish(&finished.reason, origin) {
            Some(f) => Event::Failed(f),
            None => Event::Finished(finished),
        }
    }

    /// The failure an ending event tells of.
    pub fn failure(&self) -> Option<&Failure> {
        match self {
            Event::Failed(f) => Some(f),
            _ => None,
        }
    }
}

/// Why a submission did not reach the engine.
#[derive(Debug, PartialEq, Eq)]
pub enum SubmitError {
    /// The submission queue is full.
    Busy,
    /// The engine thread has stopped.
    Stopped,
}

/// Handle to the engine thread; dropping every clone stops it.
#[derive(Clone)]
pub struct EngineHandle {
    tx: mpsc::Sender<Submission>,
    /// The disk tier's counters, for `/metrics`.
    pub disk_stats: Option<Arc<DiskStats>>,
    /// Why what runs the requests cannot now (a cluster none of whose
    /// routers is reachable), for `/health`; `None` while it can.
    pub unavailable: Arc<std::sync::Mutex<Option<String>>>,
    /// How the last requests ended, for `/health`.
    pub evidence: Arc<Evidence>,
}

impl EngineHandle {
    /// A handle over `tx`, whichever thread takes its submissions; retryable
    /// failures count against readiness for `failure_timeout`.
    pub fn new(tx: mpsc::Sender<Submission>, disk_stats: Option<Arc<DiskStats>>, failure_timeout: Duration) -> Self {
        Self { tx, disk_stats, unavailable: Arc::default(), evidence: Arc::new(Evidence::new(failure_timeout)) }
    }

    /// Why requests cannot run now, if they cannot.
    pub fn unavailable(&self) -> Option<String> {
        self.unavailable.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// False once the engine thread has ended (it never does while serving,
    /// unless it panicked).
    pub fn is_alive(&self) -> bool {
        !self.tx.is_closed()
    }

    pub fn submit(&self, submission: Submission) -> Result<(), SubmitError> {
        self.tx.try_send(submission).map_err(|e| match e {
            mpsc::error::TrySendError::Full(_) => SubmitError::Busy,
            mpsc::error::TrySendError::Closed(_) => SubmitError::Stopped,
        })
    }
}

/// Start the engine thread (and the disk tier's, if there is one). `queue`
/// bounds the submissions not yet taken by the engine (and the engine's own
/// waiting queue).
pub fn spawn(
    model: Arc<Model>,
    config: EngineConfig,
    cache: CacheSetup,
) -> anyhow::Result<(EngineHandle, JoinHandle<()>)> {
    // Validate the configuration here, where the error can still be reported.
    let block_tokens = Engine::new(model.clone(), config.clone())?.scheduler().layout().block_tokens;
    let (tx, rx) = mpsc::channel(config.max_waiting);
    // The disk tier's index is rebuilt before serving starts.
    let disk = cache.disk.as_ref().and_then(|d| {
        match DiskWorker::start(model.clone(), block_tokens, d, cache.clock.clone()) {
            Ok(w) => Some(w),
            Err(e) => {
                eprintln!("deepinfer: warning: prompt cache disk tier not started: {e}");
                None
            }
        }
    });
    let tiers = TierConfig { disk: disk.is_some(), ..cache.tiers };
    let disk_stats = disk.as_ref().map(|d| d.stats.clone());
    // One process has no failure timeout; the evidence's own minimum applies.
    let handle = EngineHandle::new(tx, disk_stats, Duration::ZERO);
    let evidence = Arc::clone(&handle.evidence);
    let thread = std::thread::Builder::new().name("engine".into()).spawn(move || {
        let mut engine = crate::generation::new_engine(model, config).expect("validated above");
        engine.configure_tiers(tiers);
        run(engine, rx, disk, cache.clock, &evidence);
    })?;
    Ok((handle, thread))
}

/// Waiting requests whose prefixes are looked for on disk per step.
const FETCH_SCAN: usize = 16;
/// Longest a request is held for its disk fetch; then it runs without it.
const FETCH_WAIT_MAX: Duration = Duration::from_secs(10);

/// Requests held while the disk tier reads their prefixes.
#[derive(Default)]
struct DiskSide {
    pending: BTreeMap<RequestId, Instant>,
}

impl DiskSide {
    /// Offer what the disk tier found; release the requests it was for.
    fn absorb(&mut self, engine: &mut Engine, fetched: Fetched) {
        cache_metrics::disk_load(fetched.latency, fetched.blocks.len());
        engine.offer_blocks(fetched.id, fetched.blocks);
        engine.hold(fetched.id, false);
        self.pending.remove(&fetched.id);
    }

    /// Before a step: take finished fetches, start new ones for waiting requests.
    fn before_step(&mut self, engine: &mut Engine, disk: &DiskWorker) {
        while let Some(f) = disk.try_fetched() {
            self.absorb(engine, f);
        }
        // A fetch that never answers must not hold its request forever.
        let late: Vec<RequestId> =
            self.pending.iter().filter(|(_, at)| at.elapsed() > FETCH_WAIT_MAX).map(|(&id, _)| id).collect();
        for id in late {
            engine.hold(id, false);
            self.pending.remove(&id);
        }
        for (id, wanted) in engine.wanted_blocks(FETCH_SCAN) {
            if disk.fetch(id, wanted) {
                engine.hold(id, true);
                self.pending.insert(id, Instant::now());
            }
        }
    }

    /// After a step: hand persisted blocks over; if only held requests are
    /// left, wait a little for their fetches instead of spinning.
    fn after_step(&mut self, engine: &mut Engine, disk: &DiskWorker) {
        disk.write(engine.take_persist());
        if !self.pending.is_empty() && engine.scheduler().num_running() == 0 {
            if let Some(f) = disk.wait_fetched(Duration::from_millis(20)) {
                self.absorb(engine, f);
            }
        }
    }
}

/// A request in the engine.
struct Live {
    events: mpsc::UnboundedSender<Event>,
    arrived: Instant,
    /// Whether its first step has been scheduled (queue time recorded).
    scheduled: bool,
    last_token: Option<Instant>,
    /// Tokens sent to the handler, as its response counts them.
    sent: usize,
    eos: u32,
}

fn run(
    mut engine: Engine,
    mut rx: mpsc::Receiver<Submission>,
    disk: Option<DiskWorker>,
    clock: Clock,
    evidence: &Evidence,
) {
    let eos = engine.model().config.eos_token_id;
    let mut live: BTreeMap<RequestId, Live> = BTreeMap::new();
    let mut disk_side = DiskSide::default();
    cache_metrics::update(&engine, disk.as_ref());
    loop {
        // Block only when there is nothing to step.
        if !engine.has_work() {
            match rx.blocking_recv() {
                Some(s) => admit(&mut engine, &mut live, s, eos),
                None => return,
            }
        }
        while let Ok(s) = rx.try_recv() {
            admit(&mut engine, &mut live, s, eos);
        }
        let gone: Vec<RequestId> = live.iter().filter(|(_, l)| l.events.is_closed()).map(|(&id, _)| id).collect();
        for id in gone {
            let l = live.remove(&id).expect("listed above");
            if let Ok(f) = engine.cancel(id) {
                m::finished(&f, l.arrived.elapsed(), l.sent);
            }
        }
        engine.set_now_ms(clock());
        if let Some(d) = &disk {
            disk_side.before_step(&mut engine, d);
        }
        if engine.has_work() {
            let updates = engine.step();
            let now = Instant::now();
            for (&id, l) in live.iter_mut().filter(|(_, l)| !l.scheduled) {
                let status = engine.scheduler().status(id);
                if !matches!(status, Some(RequestStatus::Waiting) | None) || updates.iter().any(|u| u.id == id) {
                    l.scheduled = true;
                    m::queue_time(now - l.arrived);
                }
            }
            for u in updates {
                let Some(l) = live.get_mut(&u.id) else { continue };
                let mut tokens = u.tokens;
                if !tokens.is_empty() {
                    // Latency counts every sampled token, a final EOS included.
                    match l.last_token {
                        None => m::ttft(now - l.arrived),
                        Some(prev) => m::inter_token(now - prev),
                    }
                    l.last_token = Some(now);
                }
                if let Some(f) = &u.finished {
                    // The stream processor must not see the EOS that ended a stop.
                    if f.reason == FinishReason::Stop && tokens.last().is_some_and(|t| t.token == l.eos) {
                        tokens.pop();
                    }
                }
                // Counted as the response counts them: after that EOS is dropped.
                m::generated(tokens.len());
                l.sent += tokens.len();
                if !tokens.is_empty() {
                    let cached_tokens = engine
                        .scheduler()
                        .cached_tokens(u.id)
                        .unwrap_or_else(|| u.finished.as_ref().map_or(0, |f| f.cached_tokens));
                    let _ = l.events.send(Event::Tokens { tokens, cached_tokens });
                }
                if let Some(f) = u.finished {
                    let l = live.remove(&u.id).expect("live request");
                    m::finished(&f, now - l.arrived, l.sent);
                    let event = Event::end(f, Origin::Engine);
                    evidence.record(event.failure());
                    let _ = l.events.send(event);
                }
            }
        }
        if let Some(d) = &disk {
            disk_side.after_step(&mut engine, d);
        }
        m::engine_gauges(engine.scheduler());
        cache_metrics::update(&engine, disk.as_ref());
        if engine.scheduler().config().speculative.max_drafts() > 0 {
            m::speculative(engine.speculative_stats());
        }
    }
}

fn admit(engine: &mut Engine, live: &mut BTreeMap<RequestId, Live>, s: Submission, eos: u32) {
    if s.events.is_closed() {
        return;
    }
    let prompt_tokens = s.request.prompt.len();
    let added = match s.constraint {
        Some(c) => engine.add_constrained_request(s.request, Box::new(c.guided)),
        None => engine.add_request(s.request),
    };
    match added {
        Ok(id) => {
            m::prompt(prompt_tokens);
            let _ = s.events.send(Event::Queued);
            live.insert(
                id,
                Live { events: s.events, arrived: s.arrived, scheduled: false, last_token: None, sent: 0, eos },
            );
        }
        Err(e) => {
            m::rejected(&e);
            let _ = s.events.send(Event::Rejected(e));
        }
    }
}
