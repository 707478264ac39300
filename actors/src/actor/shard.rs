//! The ExpertShard's shell: feeds [`ShardMachine`] every frame and carries
//! out what it leaves in order, sleeping on the cluster's clock while the
//! device is busy. Experts staged for a coming table are read on a blocking
//! thread while the actor goes on serving (inline on a virtual clock, so a
//! simulation stays a function of its seed).

use std::sync::Arc;

use ractor::{Actor, ActorProcessingErr, ActorRef};

use crate::cluster::ctx::Ctx;
use crate::net::transport::{pump, Delivery};
use crate::proto::shard::{read_experts, ShardEffect, ShardMachine, Staged};

pub struct ExpertShard;

pub struct ShardArgs {
    pub device: u32,
    pub incarnation: u32,
    pub ctx: Arc<Ctx>,
}

pub enum ShardMsg {
    Net(Delivery),
    Staged(Staged),
}

pub struct ShardShell {
    machine: ShardMachine,
    ctx: Arc<Ctx>,
}

impl Actor for ExpertShard {
    type Msg = ShardMsg;
    type State = ShardShell;
    type Arguments = ShardArgs;

    async fn pre_start(&self, myself: ActorRef<ShardMsg>, args: ShardArgs) -> Result<ShardShell, ActorProcessingErr> {
        let ctx = args.ctx;
        let machine = ShardMachine::start(args.device, args.incarnation, Arc::clone(&ctx));
        pump(ctx.transport.bind(machine.addr()), myself, ShardMsg::Net);
        Ok(ShardShell { machine, ctx })
    }

    async fn handle(
        &self,
        me: ActorRef<ShardMsg>,
        msg: ShardMsg,
        shell: &mut ShardShell,
    ) -> Result<(), ActorProcessingErr> {
        let result = match msg {
            // Expert compute and reads block: off the async workers where the runtime allows.
            ShardMsg::Net(d)
                if !shell.ctx.clock.is_virtual()
                    && tokio::runtime::Handle::current().runtime_flavor()
                        == tokio::runtime::RuntimeFlavor::MultiThread =>
            {
                tokio::task::block_in_place(|| shell.machine.handle(d))
            }
            ShardMsg::Net(d) => shell.machine.handle(d),
            ShardMsg::Staged(s) => {
                shell.machine.on_staged(s);
                Ok(())
            }
        };
        let from = shell.machine.addr();
        let mut effects = shell.machine.take_effects();
        while !effects.is_empty() {
            for effect in effects {
                match effect {
                    ShardEffect::Busy(t) => shell.ctx.clock.sleep(t).await,
                    ShardEffect::Send(o) => shell.ctx.send_frame(from, o.to, o.frame),
                    ShardEffect::Read { epoch, experts, reply_to } => {
                        let model = Arc::clone(&shell.ctx.model);
                        // Wall time only off a virtual clock: a simulation's frames stay a function of its seed.
                        let timed = !shell.ctx.clock.is_virtual();
                        let read = move || {
                            let started = std::time::Instant::now();
                            let (experts, errors) = read_experts(&model, &experts);
                            let load_us = if timed { started.elapsed().as_micros() as u64 } else { 0 };
                            Staged { epoch, experts, errors, load_us, reply_to }
                        };
                        if shell.ctx.clock.is_virtual() {
                            shell.machine.on_staged(read());
                        } else {
                            let me = me.clone();
                            tokio::task::spawn_blocking(move || {
                                let _ = me.send_message(ShardMsg::Staged(read()));
                            });
                        }
                    }
                }
            }
            effects = shell.machine.take_effects();
        }
        result.map_err(|crash| crash.0.into())
    }
}
