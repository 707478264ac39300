//! The ExpertShard's shell: feeds [`ShardMachine`] every frame and carries
//! out what it leaves in order, sleeping on the cluster's clock while the
//! device is busy.

use std::sync::Arc;

use ractor::{Actor, ActorProcessingErr, ActorRef};

use crate::cluster::ctx::Ctx;
use crate::net::transport::{pump, Delivery};
use crate::proto::shard::{ShardEffect, ShardMachine};

pub struct ExpertShard;

pub struct ShardArgs {
    pub device: u32,
    pub incarnation: u32,
    pub ctx: Arc<Ctx>,
}

pub enum ShardMsg {
    Net(Delivery),
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
        _me: ActorRef<ShardMsg>,
        msg: ShardMsg,
        shell: &mut ShardShell,
    ) -> Result<(), ActorProcessingErr> {
        let ShardMsg::Net(d) = msg;
        let result = shell.machine.handle(d);
        let from = shell.machine.addr();
        for effect in shell.machine.take_effects() {
            match effect {
                ShardEffect::Busy(t) => shell.ctx.clock.sleep(t).await,
                ShardEffect::Send(o) => shell.ctx.send_frame(from, o.to, o.frame),
            }
        }
        result.map_err(|crash| crash.0.into())
    }
}
