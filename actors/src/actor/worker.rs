//! The GPU worker's shell: feeds [`WorkerMachine`] its frames and timer
//! expiries with the clock's time and carries out what it leaves, in
//! order: sleeping while the device is busy, sending frames, and keeping
//! the dispatch timer and a modelled step's delayed answer.

use std::sync::Arc;
use std::time::Duration;

use ractor::{Actor, ActorProcessingErr, ActorRef};
use tokio::task::JoinHandle;

use crate::cluster::ctx::Ctx;
use crate::net::transport::pump;
use crate::proto::worker::{Effect, Input, WorkerMachine};
use crate::proto::Outgoing;

pub struct GpuWorker;

pub struct WorkerArgs {
    pub device: u32,
    pub incarnation: u32,
    pub ctx: Arc<Ctx>,
}

pub struct WorkerShell {
    machine: WorkerMachine,
    me: ActorRef<Input>,
    ctx: Arc<Ctx>,
    dispatch_timer: Option<JoinHandle<()>>,
    /// A modelled step's answer, waiting out the step's device time.
    later: Option<JoinHandle<()>>,
}

impl WorkerShell {
    async fn carry_out(&mut self) {
        let from = self.machine.addr();
        for effect in self.machine.take_effects() {
            match effect {
                Effect::Busy(t) => self.ctx.clock.sleep(t).await,
                Effect::Send(o) => self.ctx.send_frame(from, o.to, o.frame),
                Effect::ArmDispatch { pass, layer, round, after } => {
                    let timer = self.feed_after(after, Input::Timeout { pass, layer, round });
                    replace(&mut self.dispatch_timer, Some(timer));
                }
                Effect::Disarm => replace(&mut self.dispatch_timer, None),
                Effect::SendLater { after, out } => {
                    let answer = self.send_after(after, out);
                    replace(&mut self.later, Some(answer));
                }
                Effect::CancelLater => replace(&mut self.later, None),
                Effect::Record(line) => self.ctx.events.record(format_args!("{line}")),
            }
        }
    }

    fn feed_after(&self, after: Duration, input: Input) -> JoinHandle<()> {
        let (clock, me) = (Arc::clone(&self.ctx.clock), self.me.clone());
        tokio::spawn(async move {
            clock.sleep(after).await;
            let _ = me.send_message(input);
        })
    }

    fn send_after(&self, after: Duration, out: Outgoing) -> JoinHandle<()> {
        let (ctx, from) = (Arc::clone(&self.ctx), self.machine.addr());
        tokio::spawn(async move {
            ctx.clock.sleep(after).await;
            ctx.send_frame(from, out.to, out.frame);
        })
    }
}

/// Put `new` in `slot`, stopping the task it held.
fn replace(slot: &mut Option<JoinHandle<()>>, new: Option<JoinHandle<()>>) {
    if let Some(old) = std::mem::replace(slot, new) {
        old.abort();
    }
}

impl Actor for GpuWorker {
    type Msg = Input;
    type State = WorkerShell;
    type Arguments = WorkerArgs;

    async fn pre_start(&self, myself: ActorRef<Input>, args: WorkerArgs) -> Result<WorkerShell, ActorProcessingErr> {
        let ctx = args.ctx;
        let machine = WorkerMachine::start(ctx.clock.now(), args.device, args.incarnation, Arc::clone(&ctx));
        pump(ctx.transport.bind(machine.addr()), myself.clone(), Input::Net);
        let mut shell = WorkerShell { machine, me: myself, ctx, dispatch_timer: None, later: None };
        shell.carry_out().await;
        Ok(shell)
    }

    async fn post_stop(&self, _me: ActorRef<Input>, shell: &mut WorkerShell) -> Result<(), ActorProcessingErr> {
        // A crashed device answers nothing: its pending answer dies with it.
        replace(&mut shell.dispatch_timer, None);
        replace(&mut shell.later, None);
        Ok(())
    }

    async fn handle(
        &self,
        _me: ActorRef<Input>,
        input: Input,
        shell: &mut WorkerShell,
    ) -> Result<(), ActorProcessingErr> {
        let result = shell.machine.handle(shell.ctx.clock.now(), input);
        shell.carry_out().await;
        result.map_err(|crash| crash.0.into())
    }
}
