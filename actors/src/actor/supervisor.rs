//! OTP-style supervision on top of ractor's links: one-for-one restarts with
//! an intensity limit (at most `max_restarts` in `window` of the injected
//! clock). Past the limit the supervisor stops its children, in order, and
//! fails, so its own parent decides; the root reports that it gave up.
//!
//! Children are stopped in declaration order before a supervisor fails or
//! stops (ractor would otherwise terminate them in hash-map order), which
//! keeps a simulated run reproducible.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use ractor::{Actor, ActorCell, ActorProcessingErr, ActorRef, SpawnErr, SupervisionEvent};
use tokio::sync::mpsc;

use crate::sim::clock::Clock;
use crate::sim::events::{bump, EventLog, Metrics};

/// At most `max_restarts` restarts within any `window`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Intensity {
    pub max_restarts: u32,
    pub window: Duration,
}

impl Intensity {
    pub const fn new(max_restarts: u32, window: Duration) -> Self {
        Self { max_restarts, window }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChildKind {
    Worker,
    Shard,
    Scheduler,
    CacheManager,
    Router,
    /// A node's membership actor (simulated clusters).
    Member,
    /// An image encoder instance.
    Encoder,
    Supervisor,
}

pub type StartFuture = Pin<Box<dyn Future<Output = Result<ActorCell, SpawnErr>> + Send>>;
/// Start (or restart) a child linked to `parent`; the `u32` is its incarnation (0 first).
pub type StartFn = Arc<dyn Fn(ActorCell, u32) -> StartFuture + Send + Sync>;

#[derive(Clone)]
pub struct ChildSpec {
    pub name: String,
    pub kind: ChildKind,
    pub start: StartFn,
}

/// What a supervisor needs from its surroundings.
#[derive(Clone)]
pub struct SupervisorEnv {
    pub clock: Arc<dyn Clock>,
    pub events: Arc<EventLog>,
    pub metrics: Arc<Metrics>,
}

pub struct SupervisorArgs {
    pub name: String,
    pub children: Vec<ChildSpec>,
    pub intensity: Intensity,
    pub env: SupervisorEnv,
    /// Told why, when this supervisor gives up (set on the root).
    pub on_give_up: Option<mpsc::UnboundedSender<String>>,
}

pub enum SupervisorMsg {
    /// Crash the named child, as a fault would (restart policy applies); a
    /// path (`node0/cache0`) is passed down to the named child supervisor.
    KillChild(String),
    /// Crash this supervisor and its subtree.
    Crash(String),
    /// Stop every child in order, then stop.
    Shutdown,
}

struct Child {
    spec: ChildSpec,
    cell: Option<ActorCell>,
    incarnation: u32,
}

pub struct SupervisorState {
    name: String,
    children: Vec<Child>,
    intensity: Intensity,
    restarts: VecDeque<Duration>,
    env: SupervisorEnv,
    on_give_up: Option<mpsc::UnboundedSender<String>>,
}

pub struct Supervisor;

impl SupervisorState {
    /// Stop the children in declaration order, each before the next: a child
    /// supervisor shuts its own subtree down in order, a leaf is killed.
    async fn stop_children(&mut self) {
        for c in &mut self.children {
            if let Some(cell) = c.cell.take() {
                if c.spec.kind == ChildKind::Supervisor && cell.send_message(SupervisorMsg::Shutdown).is_ok() {
                    let _ = cell.wait(None).await;
                } else {
                    let _ = cell.kill_and_wait(None).await;
                }
            }
        }
    }

    async fn give_up(&mut self, why: String) -> ActorProcessingErr {
        bump(&self.env.metrics.escalations);
        self.env.events.record(format_args!("{} gives up: {why}", self.name));
        self.stop_children().await;
        if let Some(tx) = &self.on_give_up {
            let _ = tx.send(format!("{}: {why}", self.name));
        }
        format!("{}: {why}", self.name).into()
    }
}

impl Actor for Supervisor {
    type Msg = SupervisorMsg;
    type State = SupervisorState;
    type Arguments = SupervisorArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<Self::Msg>,
        args: SupervisorArgs,
    ) -> Result<Self::State, ActorProcessingErr> {
        let mut state = SupervisorState {
            name: args.name,
            children: Vec::new(),
            intensity: args.intensity,
            restarts: VecDeque::new(),
            env: args.env,
            on_give_up: args.on_give_up,
        };
        for spec in args.children {
            match (spec.start)(myself.get_cell(), 0).await {
                Ok(cell) => state.children.push(Child { spec, cell: Some(cell), incarnation: 0 }),
                Err(e) => {
                    state.stop_children().await;
                    return Err(format!("{}: child {} failed to start: {e}", state.name, spec.name).into());
                }
            }
        }
        state.env.events.record(format_args!("{} started {} children", state.name, state.children.len()));
        Ok(state)
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        msg: SupervisorMsg,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            SupervisorMsg::KillChild(path) => {
                let (name, rest) = match path.split_once('/') {
                    Some((name, rest)) => (name.to_string(), Some(rest.to_string())),
                    None => (path, None),
                };
                if let Some(rest) = rest {
                    let child =
                        state.children.iter().find(|c| c.spec.name == name && c.spec.kind == ChildKind::Supervisor);
                    if let Some(cell) = child.and_then(|c| c.cell.as_ref()) {
                        let _ = cell.send_message(SupervisorMsg::KillChild(rest));
                    }
                    return Ok(());
                }
                if let Some(c) = state.children.iter().find(|c| c.spec.name == name) {
                    if let Some(cell) = &c.cell {
                        state.env.events.record(format_args!("{} kills {name}", state.name));
                        if c.spec.kind == ChildKind::Supervisor {
                            let _ = cell.send_message(SupervisorMsg::Crash("killed by fault plan".into()));
                        } else {
                            cell.kill();
                        }
                    }
                }
                Ok(())
            }
            SupervisorMsg::Crash(why) => {
                state.env.events.record(format_args!("{} crashes: {why}", state.name));
                state.stop_children().await;
                Err(format!("{}: {why}", state.name).into())
            }
            SupervisorMsg::Shutdown => {
                state.stop_children().await;
                _myself.stop(None);
                Ok(())
            }
        }
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<Self::Msg>,
        evt: SupervisionEvent,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        let (cell, why) = match evt {
            SupervisionEvent::ActorTerminated(cell, _, reason) => (cell, reason.unwrap_or_else(|| "stopped".into())),
            SupervisionEvent::ActorFailed(cell, err) => (cell, err.to_string()),
            _ => return Ok(()),
        };
        let id = cell.get_id();
        let Some(i) = state.children.iter().position(|c| c.cell.as_ref().is_some_and(|c| c.get_id() == id)) else {
            return Ok(());
        };
        state.children[i].cell = None;
        let name = state.children[i].spec.name.clone();
        state.env.events.record(format_args!("{} child {name} exited: {why}", state.name));

        let now = state.env.clock.now();
        state.restarts.push_back(now);
        while state.restarts.front().is_some_and(|&t| now.saturating_sub(t) > state.intensity.window) {
            state.restarts.pop_front();
        }
        if state.restarts.len() > state.intensity.max_restarts as usize {
            let why = format!(
                "{} restarts within {:?} exceed the limit of {} (last: {})",
                state.restarts.len(),
                state.intensity.window,
                state.intensity.max_restarts,
                if why.starts_with(&name) { why.clone() } else { format!("{name}: {why}") }
            );
            return Err(state.give_up(why).await);
        }

        let child = &mut state.children[i];
        child.incarnation += 1;
        let counter = match child.spec.kind {
            ChildKind::Worker => &state.env.metrics.worker_restarts,
            ChildKind::Shard => &state.env.metrics.shard_restarts,
            ChildKind::Scheduler => &state.env.metrics.scheduler_restarts,
            ChildKind::CacheManager => &state.env.metrics.cache_restarts,
            ChildKind::Router => &state.env.metrics.router_restarts,
            ChildKind::Member => &state.env.metrics.member_restarts,
            ChildKind::Encoder => &state.env.metrics.encoder_restarts,
            ChildKind::Supervisor => &state.env.metrics.supervisor_restarts,
        };
        bump(counter);
        match (child.spec.start)(myself.get_cell(), child.incarnation).await {
            Ok(cell) => {
                child.cell = Some(cell);
                let inc = child.incarnation;
                state.env.events.record(format_args!("{} restarted {name} (incarnation {inc})", state.name));
                Ok(())
            }
            Err(e) => {
                let why = format!("restart of {name} failed: {e}");
                Err(state.give_up(why).await)
            }
        }
    }
}
