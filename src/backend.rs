//! What runs requests: the local engine or an actor cluster (in-process or
//! over QUIC), behind one trait so that `generate` and batch mode drive
//! either with the same loop.

use std::ops::Deref;

use deepinfer_actors::{LocalCluster, Update};
use deepinfer_engine::engine::{Engine, EngineConfig};
use deepinfer_engine::model::Model;
use deepinfer_engine::request::{Request, RequestId, RequestUpdate};
use deepinfer_engine::speculative::SpeculativeStats;

/// Runs requests and reports on them as [`Update`]s. Refusals and the end
/// of a cancelled request arrive as updates too, on both backends, so a
/// caller handles each in one place.
pub trait Backend {
    /// Queue `request`; its id names its updates. A request that can never
    /// run gets an [`Update::Refused`].
    fn submit(&mut self, request: Request) -> u64;

    /// Stop `id`; its [`Update::Finished`] follows. Unknown or already
    /// finished ids are ignored: a cancel can cross the request's end.
    fn cancel(&mut self, id: u64);

    /// Whether another request should be submitted now: enough queued to
    /// refill freed batch slots, not so many that the scheduler refuses them.
    fn has_room(&self) -> bool;

    /// The next updates, waiting for some; `None` once no request is left.
    fn next_updates(&mut self) -> Option<Vec<Update>>;

    /// Totals so far; what the backend cannot see is `None`.
    fn stats(&self) -> RunStats;

    /// Stop whatever the backend runs besides this thread.
    fn shutdown(self: Box<Self>);
}

/// Totals of a run, each `None` where the backend cannot know it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RunStats {
    /// Share of looked-up prompt tokens the prefix cache served. A cluster's
    /// caches sit in its scheduler actors, whose lookups it does not report.
    pub prefix_hit_rate: Option<f64>,
    /// Requests preempted and recomputed. A cluster reports them only per
    /// request, in each [`Update::Finished`].
    pub preemptions: Option<u64>,
    /// Drafts proposed, verified and accepted (an in-process cluster's
    /// workers count them; a running cluster's are in its own processes).
    pub speculative: Option<SpeculativeStats>,
}

/// The engine of this process, stepped when updates are wanted.
pub struct EngineBackend<M: Deref<Target = Model>> {
    engine: Engine<M>,
    /// Refusals and cancellations, which the engine answers at once, kept
    /// for the next [`Backend::next_updates`].
    answered: Vec<Update>,
    /// Ids of refused requests, counting down from the top of the range the
    /// engine's ids count up from zero in.
    next_refused_id: u64,
}

impl<M: Deref<Target = Model>> EngineBackend<M> {
    pub fn new(engine: Engine<M>) -> Self {
        Self { engine, answered: Vec::new(), next_refused_id: u64::MAX }
    }
}

/// An engine step's update as the cluster's: tokens first, then the end.
fn updates_of(update: RequestUpdate, cached_tokens: usize) -> impl Iterator<Item = Update> {
    let id = update.id.0;
    let tokens = (!update.tokens.is_empty()).then_some(Update::Tokens { id, tokens: update.tokens, cached_tokens });
    let finished = update.finished.map(|finished| Update::Finished { id, finished });
    tokens.into_iter().chain(finished)
}

impl<M: Deref<Target = Model>> Backend for EngineBackend<M> {
    fn submit(&mut self, request: Request) -> u64 {
        match self.engine.add_request(request) {
            Ok(id) => id.0,
            Err(e) => {
                let id = self.next_refused_id;
                self.next_refused_id -= 1;
                self.answered.push(Update::Refused { id, reason: e.to_string() });
                id
            }
        }
    }

    fn cancel(&mut self, id: u64) {
        if let Ok(finished) = self.engine.cancel(RequestId(id)) {
            self.answered.push(Update::Finished { id, finished });
        }
    }

    /// The queue is kept about one batch deep.
    fn has_room(&self) -> bool {
        let scheduler = self.engine.scheduler();
        scheduler.num_waiting() < scheduler.config().max_batch_size
    }

    fn next_updates(&mut self) -> Option<Vec<Update>> {
        let mut updates = std::mem::take(&mut self.answered);
        if self.engine.has_work() {
            for update in self.engine.step() {
                let cached = update.finished.as_ref().map(|f| f.cached_tokens);
                let cached = cached.or_else(|| self.engine.scheduler().cached_tokens(update.id)).unwrap_or(0);
                updates.extend(updates_of(update, cached));
            }
        } else if updates.is_empty() {
            return None;
        }
        Some(updates)
    }

    fn stats(&self) -> RunStats {
        let scheduler = self.engine.scheduler();
        RunStats {
            prefix_hit_rate: Some(scheduler.prefix_stats().hit_rate()),
            preemptions: Some(scheduler.stats().preemptions),
            speculative: Some(self.engine.speculative_stats().clone()),
        }
    }

    fn shutdown(self: Box<Self>) {}
}

/// A cluster driven from this thread: in-process, or a client of a running one.
pub struct ClusterBackend {
    cluster: LocalCluster,
    /// Most requests kept submitted and unfinished.
    depth: usize,
    /// The workers draft in this process (their counters are here).
    drafting: bool,
}

impl ClusterBackend {
    /// `config` is the schedulers' policy; running plus waiting requests
    /// stay below what one scheduler queues without refusing.
    pub fn new(cluster: LocalCluster, config: &EngineConfig) -> Self {
        let depth = config.max_batch_size + config.max_batch_size.min(config.max_waiting.saturating_sub(1));
        Self { cluster, depth, drafting: config.speculative.max_drafts() > 0 }
    }
}

impl Backend for ClusterBackend {
    fn submit(&mut self, request: Request) -> u64 {
        self.cluster.submit(request)
    }

    fn cancel(&mut self, id: u64) {
        self.cluster.cancel(id);
    }

    fn has_room(&self) -> bool {
        self.cluster.outstanding() < self.depth
    }

    fn next_updates(&mut self) -> Option<Vec<Update>> {
        self.cluster.next_update().map(|update| vec![update])
    }

    fn stats(&self) -> RunStats {
        let m = self.cluster.metrics();
        let speculative = self.drafting.then(|| SpeculativeStats {
            proposed: m.drafts_proposed,
            verified: m.drafts_verified,
            accepted: m.drafts_accepted,
            all_accepted: m.verifications_all_accepted,
            verifications: m.verifications,
            // Each verification yields the accepted drafts and the target's own token.
            verification_tokens: m.verifications + m.drafts_accepted,
        });
        RunStats { speculative, ..RunStats::default() }
    }

    fn shutdown(self: Box<Self>) {
        self.cluster.shutdown();
    }
}
