//! A router's shell: binds `router<node>`, feeds [`RouterMachine`] every frame
//! and a periodic tick on the cluster's clock, and sends what it leaves.

use std::sync::Arc;

use ractor::{Actor, ActorProcessingErr, ActorRef};
use tokio::task::JoinHandle;

use crate::cluster::ctx::Ctx;
use crate::net::transport::{pump, Delivery};
use crate::proto::router::{RouterInput, RouterMachine};

pub struct Router;

pub struct RouterArgs {
    /// The node it runs on (and whose membership view it follows).
    pub node: u32,
    pub incarnation: u32,
    pub ctx: Arc<Ctx>,
}

pub enum RouterMsg {
    Net(Delivery),
    Tick,
}

pub struct RouterShell {
    machine: RouterMachine,
    ticker: Option<JoinHandle<()>>,
    ctx: Arc<Ctx>,
}

impl RouterShell {
    fn run(&mut self, input: RouterInput) {
        self.machine.handle(self.ctx.clock.now(), input);
        self.flush();
    }

    fn flush(&mut self) {
        super::send_outgoing(&self.ctx, self.machine.addr(), self.machine.take_outgoing());
    }
}

impl Actor for Router {
    type Msg = RouterMsg;
    type State = RouterShell;
    type Arguments = RouterArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<RouterMsg>,
        args: RouterArgs,
    ) -> Result<RouterShell, ActorProcessingErr> {
        let ctx = args.ctx;
        let machine = RouterMachine::start(ctx.clock.now(), args.node, args.incarnation, Arc::clone(&ctx));
        pump(ctx.transport.bind(machine.addr()), myself.clone(), RouterMsg::Net);
        let (clock, every) = (Arc::clone(&ctx.clock), machine.tick_every());
        let ticker = tokio::spawn(async move {
            loop {
                clock.sleep(every).await;
                if myself.send_message(RouterMsg::Tick).is_err() {
                    break;
                }
            }
        });
        let mut shell = RouterShell { machine, ticker: Some(ticker), ctx };
        shell.flush();
        Ok(shell)
    }

    async fn post_stop(&self, _me: ActorRef<RouterMsg>, shell: &mut RouterShell) -> Result<(), ActorProcessingErr> {
        if let Some(t) = shell.ticker.take() {
            t.abort();
        }
        Ok(())
    }

    async fn handle(
        &self,
        _me: ActorRef<RouterMsg>,
        msg: RouterMsg,
        shell: &mut RouterShell,
    ) -> Result<(), ActorProcessingErr> {
        shell.run(match msg {
            RouterMsg::Net(d) => RouterInput::Net(d),
            RouterMsg::Tick => RouterInput::Tick,
        });
        Ok(())
    }
}
