//! The CacheManager's shell: binds the node's cache address and feeds
//! [`CacheMachine`] every frame, sending what it leaves.

use std::sync::Arc;

use ractor::{Actor, ActorProcessingErr, ActorRef};

use crate::cluster::ctx::Ctx;
use crate::net::transport::{pump, Delivery};
use crate::proto::cache::CacheMachine;

pub struct CacheManager;

pub struct CacheArgs {
    pub node: u32,
    pub incarnation: u32,
    pub ctx: Arc<Ctx>,
}

pub enum CacheActorMsg {
    Net(Delivery),
}

pub struct CacheShell {
    machine: CacheMachine,
    ctx: Arc<Ctx>,
}

impl CacheShell {
    fn flush(&mut self) {
        super::send_outgoing(&self.ctx, self.machine.addr(), self.machine.take_outgoing());
    }
}

impl Actor for CacheManager {
    type Msg = CacheActorMsg;
    type State = CacheShell;
    type Arguments = CacheArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<CacheActorMsg>,
        args: CacheArgs,
    ) -> Result<CacheShell, ActorProcessingErr> {
        let ctx = args.ctx;
        let machine = CacheMachine::start(ctx.clock.now(), args.node, args.incarnation, Arc::clone(&ctx));
        pump(ctx.transport.bind(machine.addr()), myself, CacheActorMsg::Net);
        let mut shell = CacheShell { machine, ctx };
        shell.flush();
        Ok(shell)
    }

    async fn handle(
        &self,
        _me: ActorRef<CacheActorMsg>,
        msg: CacheActorMsg,
        shell: &mut CacheShell,
    ) -> Result<(), ActorProcessingErr> {
        let CacheActorMsg::Net(d) = msg;
        shell.machine.handle(d);
        shell.flush();
        Ok(())
    }
}
