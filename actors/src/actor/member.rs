//! A node's membership as an actor, for clusters whose transport has none
//! of its own (the simulated fabric): the [`Membership`] machine's
//! heartbeats go to every other node's member as frames, so drops, delays
//! and partitions reach them as they reach any other traffic; a node found
//! silent is acted on through [`Ctx::node_down`], as a real node does when
//! its QUIC transport reports it.

use std::sync::Arc;

use ractor::{Actor, ActorProcessingErr, ActorRef};

use crate::cluster::ctx::Ctx;
use crate::net::transport::pump;
use crate::net::transport::Delivery;
use crate::proto::membership::{Member, MemberEvent, Membership};
use crate::wire::{Addr, Heartbeat, Message, Role};

pub struct MemberActor;

pub struct MemberArgs {
    pub node: u32,
    pub incarnation: u32,
    pub ctx: Arc<Ctx>,
}

pub enum MemberMsg {
    Net(Delivery),
    Tick,
}

pub struct MemberState {
    node: u32,
    machine: Membership,
    me: ActorRef<MemberMsg>,
    ctx: Arc<Ctx>,
}

impl MemberState {
    fn arm(&self) {
        let (clock, me) = (Arc::clone(&self.ctx.clock), self.me.clone());
        let wait = self.machine.next_tick().saturating_sub(clock.now());
        tokio::spawn(async move {
            clock.sleep(wait).await;
            let _ = me.send_message(MemberMsg::Tick);
        });
    }

    fn act(&self, event: MemberEvent) {
        self.ctx.events.record(format_args!("node{} membership: {event:?}", self.node));
        match event {
            MemberEvent::Down { node, .. } => self.ctx.node_down(self.node, node),
            MemberEvent::Up { node } => self.ctx.node_up(self.node, node),
        }
    }
}

impl Actor for MemberActor {
    type Msg = MemberMsg;
    type State = MemberState;
    type Arguments = MemberArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<MemberMsg>,
        args: MemberArgs,
    ) -> Result<MemberState, ActorProcessingErr> {
        let ctx = args.ctx;
        let config = ctx.membership.ok_or("membership actor without a membership configuration")?;
        let addr = Addr::node(args.node);
        ctx.events.record(format_args!("{addr} member up (incarnation {})", args.incarnation));
        pump(ctx.transport.bind(addr), myself.clone(), MemberMsg::Net);
        // A restarted member starts from scratch: peers are unknown until heard.
        let machine = Membership::new(ctx.clock.now(), Member::Node(args.node), ctx.topology.nodes(), config);
        let state = MemberState { node: args.node, machine, me: myself, ctx };
        state.arm();
        Ok(state)
    }

    async fn handle(
        &self,
        _me: ActorRef<MemberMsg>,
        msg: MemberMsg,
        state: &mut MemberState,
    ) -> Result<(), ActorProcessingErr> {
        let now = state.ctx.clock.now();
        match msg {
            MemberMsg::Tick => {
                let tick = state.machine.tick(now);
                state.ctx.set_suspects(state.node, state.machine.suspects(now));
                let from = Addr::node(state.node);
                for n in tick.heartbeats {
                    // Names the node's process, which outlives this actor's restarts.
                    let process = state.ctx.durable.process(state.node);
                    let beat = Heartbeat { incarnation: process, restarted: false, time_ns: now.as_nanos() as u64 };
                    state.ctx.send(from, Addr::node(n), Message::Heartbeat(beat), &[]);
                }
                for e in tick.events {
                    state.act(e);
                }
                state.arm();
            }
            MemberMsg::Net(d) => {
                let Some(m) = state.ctx.open(Addr::node(state.node), &d) else { return Ok(()) };
                match (m.envelope.from.role, m.envelope.msg) {
                    (Role::Node, Message::Heartbeat(h)) => {
                        let events = state.machine.heard_process(now, m.envelope.from.index, h.incarnation);
                        if !events.is_empty() {
                            state.ctx.set_suspects(state.node, state.machine.suspects(now));
                        }
                        for e in events {
                            state.act(e);
                        }
                    }
                    (_, other) => {
                        crate::sim::events::bump(&state.ctx.metrics.frames_rejected);
                        let from = m.envelope.from;
                        state.ctx.events.record(format_args!(
                            "node{} member ignores {:?} from {from}",
                            state.node,
                            other.kind()
                        ));
                    }
                }
            }
        }
        Ok(())
    }
}
