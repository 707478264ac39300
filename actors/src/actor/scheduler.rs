//! The scheduler's shell: a ractor actor that feeds
//! [`SchedulerMachine`] its inputs with the clock's time and carries out
//! the effects it leaves (frames onto the transport, timers on the clock,
//! kills through the root supervisor).

use std::collections::BTreeMap;
use std::sync::Arc;

use ractor::{Actor, ActorProcessingErr, ActorRef};
use tokio::task::JoinHandle;

use crate::cluster::ctx::Ctx;
use crate::net::transport::pump;
use crate::proto::scheduler::{Effect, Input, SchedulerMachine};

/// The actor that runs one serving instance's steps (the engine's
/// [`deepinfer_engine::scheduler::Scheduler`] plans them inside its machine).
pub struct InstanceScheduler;

pub struct SchedulerArgs {
    pub instance: u32,
    pub incarnation: u32,
    pub ctx: Arc<Ctx>,
}

pub struct SchedulerShell {
    machine: SchedulerMachine,
    me: ActorRef<Input>,
    ctx: Arc<Ctx>,
    step_timer: Option<JoinHandle<()>>,
    /// Each handed-off request's transfer timer, with the attempt it is for.
    transfer_timers: BTreeMap<u64, (u32, JoinHandle<()>)>,
}

impl SchedulerShell {
    fn run(&mut self, input: Input) -> Result<(), ActorProcessingErr> {
        let result = self.machine.handle(self.ctx.clock.now(), input);
        self.carry_out();
        result.map_err(|crash| crash.0.into())
    }

    fn carry_out(&mut self) {
        let from = self.machine.addr();
        for effect in self.machine.take_effects() {
            match effect {
                Effect::Send { to, frame } => self.ctx.send_frame(from, to, frame),
                Effect::Tick => {
                    let _ = self.me.send_message(Input::Tick);
                }
                Effect::TickAt(at) => {
                    self.wake_at(at, Input::Tick);
                }
                Effect::ArmStep { at, serial } => {
                    if let Some(t) = self.step_timer.replace(self.wake_at(at, Input::Timeout(serial))) {
                        t.abort();
                    }
                }
                Effect::ArmTransfer { id, attempt, at } => {
                    let timer = self.wake_at(at, Input::TransferTimeout { id, attempt });
                    if let Some((_, t)) = self.transfer_timers.insert(id, (attempt, timer)) {
                        t.abort();
                    }
                }
                Effect::DisarmTransfer(id) => {
                    if let Some((_, t)) = self.transfer_timers.remove(&id) {
                        t.abort();
                    }
                }
                Effect::Kill(path) => self.ctx.kill(&path),
            }
        }
    }

    /// Feed `input` back at `at` on the cluster's clock.
    fn wake_at(&self, at: std::time::Duration, input: Input) -> JoinHandle<()> {
        let (clock, me) = (Arc::clone(&self.ctx.clock), self.me.clone());
        let wait = at.saturating_sub(clock.now());
        tokio::spawn(async move {
            clock.sleep(wait).await;
            let _ = me.send_message(input);
        })
    }
}

impl Actor for InstanceScheduler {
    type Msg = Input;
    type State = SchedulerShell;
    type Arguments = SchedulerArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<Input>,
        args: SchedulerArgs,
    ) -> Result<SchedulerShell, ActorProcessingErr> {
        let ctx = args.ctx;
        let machine = SchedulerMachine::start(ctx.clock.now(), args.instance, args.incarnation, Arc::clone(&ctx))
            .map_err(|crash| crash.0)?;
        pump(ctx.transport.bind(machine.addr()), myself.clone(), Input::Net);
        let mut shell = SchedulerShell { machine, me: myself, ctx, step_timer: None, transfer_timers: BTreeMap::new() };
        shell.carry_out();
        Ok(shell)
    }

    async fn post_stop(&self, _me: ActorRef<Input>, shell: &mut SchedulerShell) -> Result<(), ActorProcessingErr> {
        if let Some(t) = shell.step_timer.take() {
            t.abort();
        }
        for (_, (_, t)) in std::mem::take(&mut shell.transfer_timers) {
            t.abort();
        }
        Ok(())
    }

    async fn handle(
        &self,
        _me: ActorRef<Input>,
        input: Input,
        shell: &mut SchedulerShell,
    ) -> Result<(), ActorProcessingErr> {
        if let Input::TransferTimeout { id, attempt } = &input {
            if shell.transfer_timers.get(id).is_some_and(|(a, _)| a == attempt) {
                shell.transfer_timers.remove(id);
            }
        }
        shell.run(input)
    }
}
