//! The cluster driver: what the engine thread is for one process, for a
//! cluster. It takes the same [`Submission`]s and answers with the same
//! [`Event`]s, so every handler runs unchanged; the requests go to the
//! cluster's router as a client over the cluster's transport (QUIC between
//! processes), their structured-output constraints as descriptions that
//! the schedulers build again. A request whose client left is cancelled.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use deepinfer_actors::{Cluster, Update};
use deepinfer_engine::model::Model;
use deepinfer_engine::request::{RequestError, TokenOutput};
use deepinfer_engine::scheduler::{EngineConfig, Scheduler};
use tokio::sync::mpsc;

use super::engine_thread::{EngineHandle, Event, Submission};
use super::failure::{Evidence, Origin};
use super::metrics as m;

/// How often requests whose client left are looked for.
const CANCEL_SCAN: Duration = Duration::from_millis(20);
/// Scans between two status queries to the image encoders' nodes (about a second).
const ENCODER_STATUS_SCANS: u32 = 50;

/// The image encoders' counters, as their nodes report them (each labelled `encoder`).
pub const IMAGES_ENCODED: &str = "deepinfer_images_encoded_total";
pub const ENCODER_CACHE_HITS: &str = "deepinfer_encoder_cache_hits_total";
pub const ENCODER_QUEUE: &str = "deepinfer_encoder_queue_images";
pub const ENCODER_SECONDS: &str = "deepinfer_encoder_seconds";

/// A request sent to the cluster.
struct Live {
    events: mpsc::UnboundedSender<Event>,
    arrived: Instant,
    last_token: Option<Instant>,
    /// Tokens sent to the handler, as its response counts them.
    sent: usize,
    /// The EOS that ends the request, which is not sent; `None` when EOS is ignored.
    eos: Option<u32>,
    cancelled: bool,
}

/// What one turn of the driver's loop got.
enum Turn {
    Submission(Option<Box<Submission>>),
    Update(Option<Update>),
    Scan,
}

/// Start the driver thread of `cluster` (connected on `rt`). `config` is the
/// policy of the cluster's schedulers: requests they would refuse are
/// refused here, at once, with the engine's own error. At most
/// `max_outstanding` requests are in the cluster; past it submissions wait
/// in a queue of `max_queue`, and past that get 429. A request the cluster
/// fails counts against `/health` for `failure_timeout`.
pub fn spawn(
    rt: tokio::runtime::Runtime,
    cluster: Cluster,
    model: &Model,
    config: EngineConfig,
    (max_outstanding, failure_timeout): (usize, Duration),
) -> anyhow::Result<(EngineHandle, JoinHandle<()>)> {
    assert!(max_outstanding > 0, "room for at least one request");
    metrics::describe_counter!(IMAGES_ENCODED, "Images the image encoder instances ran their tower on");
    metrics::describe_counter!(ENCODER_CACHE_HITS, "Images the encoder instances answered from their cache");
    metrics::describe_gauge!(ENCODER_QUEUE, "Images waiting for an encoder instance's tower");
    metrics::describe_gauge!(ENCODER_SECONDS, "Seconds the encoder instances' towers ran");
    let checker = Scheduler::new(&model.config, config.clone())?;
    let (tx, rx) = mpsc::channel(config.max_waiting.max(1));
    let eos = model.config.eos_token_id;
    let handle = EngineHandle::new(tx, None, failure_timeout);
    let (unavailable, evidence) = (Arc::clone(&handle.unavailable), Arc::clone(&handle.evidence));
    let thread = std::thread::Builder::new().name("cluster-driver".into()).spawn(move || {
        let cluster = rt.block_on(drive(cluster, rx, (&checker, eos, max_outstanding), (unavailable, &evidence)));
        rt.block_on(cluster.shutdown());
    })?;
    Ok((handle, thread))
}

async fn drive(
    mut cluster: Cluster,
    mut rx: mpsc::Receiver<Submission>,
    (checker, eos, max_outstanding): (&Scheduler, u32, usize),
    (unavailable, evidence): (Arc<Mutex<Option<String>>>, &Evidence),
) -> Cluster {
    let mut live: BTreeMap<u64, Live> = BTreeMap::new();
    let mut scan = tokio::time::interval(CANCEL_SCAN);
    scan.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut open = true;
    let mut scans = 0u32;
    while open || cluster.has_updates() {
        let room = open && cluster.outstanding() < max_outstanding;
        let busy = cluster.has_updates();
        // The select ends (dropping its borrows of the cluster) before the turn is handled.
        let turn = tokio::select! {
            s = rx.recv(), if room => Turn::Submission(s.map(Box::new)),
            u = cluster.next_update(), if busy => Turn::Update(u),
            _ = scan.tick() => Turn::Scan,
        };
        match turn {
            Turn::Submission(None) => open = false,
            Turn::Submission(Some(s)) => admit(&mut cluster, &mut live, *s, checker, eos),
            Turn::Update(Some(u)) => deliver(&mut live, u, evidence),
            Turn::Update(None) => {}
            Turn::Scan => {
                for (&id, l) in live.iter_mut().filter(|(_, l)| !l.cancelled && l.events.is_closed()) {
                    l.cancelled = true;
                    cluster.cancel(id);
                }
                // Follow the routers while idle too, and tell `/health`.
                cluster.poll_news();
                scans += 1;
                if scans % ENCODER_STATUS_SCANS == 1 && !cluster.encoder_nodes().is_empty() {
                    publish_encoders(&cluster);
                    cluster.ask_status(cluster.encoder_nodes());
                }
                let now = cluster.down_reason().map(str::to_string);
                let mut was = unavailable.lock().unwrap_or_else(|e| e.into_inner());
                if was.is_some() && now.is_none() {
                    // The cluster is back: failures from while it was down say nothing now.
                    evidence.clear();
                }
                *was = now;
            }
        }
    }
    cluster
}

/// The encoders' counters from their nodes' last reports, as `/metrics` series.
fn publish_encoders(cluster: &Cluster) {
    for status in cluster.statuses().values() {
        for e in &status.encoders {
            let label = e.encoder.to_string();
            metrics::counter!(IMAGES_ENCODED, "encoder" => label.clone()).absolute(e.images_encoded);
            metrics::counter!(ENCODER_CACHE_HITS, "encoder" => label.clone()).absolute(e.cache_hits);
            metrics::gauge!(ENCODER_QUEUE, "encoder" => label.clone()).set(e.queue_images as f64);
            metrics::gauge!(ENCODER_SECONDS, "encoder" => label).set(e.encode_us as f64 / 1e6);
        }
    }
}

fn admit(cluster: &mut Cluster, live: &mut BTreeMap<u64, Live>, s: Submission, checker: &Scheduler, eos: u32) {
    if s.events.is_closed() {
        return;
    }
    if let Err(e) = checker.validate(&s.request) {
        m::rejected(&e);
        let _ = s.events.send(Event::Rejected(e));
        return;
    }
    let prompt_tokens = s.request.prompt.len();
    let eos = (!s.request.ignore_eos).then_some(eos);
    let id = cluster.submit_constrained(s.request, s.constraint.map(|c| c.description));
    m::prompt(prompt_tokens);
    let _ = s.events.send(Event::Queued);
    let l = Live { events: s.events, arrived: s.arrived, last_token: None, sent: 0, eos, cancelled: false };
    live.insert(id, l);
}

fn deliver(live: &mut BTreeMap<u64, Live>, update: Update, evidence: &Evidence) {
    let now = Instant::now();
    match update {
        Update::Refused { id, reason } => {
            if let Some(l) = live.remove(&id) {
                let e = RequestError::Refused(reason);
                m::rejected(&e);
                // The handler already has `Queued`: the refusal ends the request.
                let _ = l.events.send(Event::Rejected(e));
            }
        }
        Update::Tokens { id, tokens, cached_tokens } => {
            let Some(l) = live.get_mut(&id) else { return };
            if !tokens.is_empty() {
                match l.last_token {
                    None => m::ttft(now - l.arrived),
                    Some(prev) => m::inter_token(now - prev),
                }
                l.last_token = Some(now);
            }
            // Nothing follows an EOS that ends the request, so dropping every one drops only it.
            let tokens: Vec<TokenOutput> = tokens.into_iter().filter(|t| Some(t.token) != l.eos).collect();
            m::generated(tokens.len());
            l.sent += tokens.len();
            if !tokens.is_empty() {
                let _ = l.events.send(Event::Tokens { tokens, cached_tokens });
            }
        }
        Update::Finished { id, finished } => {
            if let Some(l) = live.remove(&id) {
                m::finished(&finished, now - l.arrived, l.sent);
                let event = Event::end(finished, Origin::Cluster);
                // A request cancelled because its client left says nothing about serving.
                if !l.cancelled {
                    evidence.record(event.failure());
                }
                let _ = l.events.send(event);
            }
        }
    }
}
