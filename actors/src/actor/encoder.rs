//! The image encoder's shell: feeds [`EncoderMachine`] its frames and the
//! `Work` it asks for, sends what it leaves, and publishes its counters
//! (queue length, images encoded, cache hits, tower time) for status
//! reports. The tower runs off the async workers where the runtime allows,
//! and its wall time is measured only off a virtual clock, so a simulation
//! stays a function of its seed.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use ractor::{Actor, ActorProcessingErr, ActorRef};

use crate::cluster::ctx::Ctx;
use crate::net::transport::pump;
use crate::proto::encoder::{Effect, EncoderMachine, Input};
use crate::sim::events::bump;

/// The actor of one image encoder instance.
pub struct ImageEncoder;

pub struct EncoderArgs {
    pub index: u32,
    pub incarnation: u32,
    pub ctx: Arc<Ctx>,
}

pub struct EncoderShell {
    machine: EncoderMachine,
    index: u32,
    ctx: Arc<Ctx>,
}

impl EncoderShell {
    fn publish(&self) {
        let Some(g) = self.ctx.durable.encoder_gauges().get(self.index as usize) else { return };
        let c = self.machine.counters();
        g.images_encoded.store(c.images_encoded, Ordering::Relaxed);
        g.cache_hits.store(c.cache_hits, Ordering::Relaxed);
        g.cache_misses.store(c.cache_misses, Ordering::Relaxed);
        g.queue_images.store(self.machine.queued() as u64, Ordering::Relaxed);
    }
}

impl Actor for ImageEncoder {
    type Msg = Input;
    type State = EncoderShell;
    type Arguments = EncoderArgs;

    async fn pre_start(&self, myself: ActorRef<Input>, args: EncoderArgs) -> Result<EncoderShell, ActorProcessingErr> {
        let ctx = args.ctx;
        let machine = EncoderMachine::start(ctx.clock.now(), args.index, args.incarnation, Arc::clone(&ctx));
        pump(ctx.transport.bind(machine.addr()), myself, Input::Net);
        let shell = EncoderShell { machine, index: args.index, ctx };
        // A restarted encoder starts with an empty queue and cache.
        shell.publish();
        Ok(shell)
    }

    async fn handle(
        &self,
        me: ActorRef<Input>,
        input: Input,
        shell: &mut EncoderShell,
    ) -> Result<(), ActorProcessingErr> {
        let work = matches!(input, Input::Work);
        let hits = shell.machine.counters().cache_hits;
        let timed = work && !shell.ctx.clock.is_virtual();
        let started = timed.then(std::time::Instant::now);
        let now = shell.ctx.clock.now();
        let multi = tokio::runtime::Handle::current().runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread;
        let result = if timed && multi {
            tokio::task::block_in_place(|| shell.machine.handle(now, input))
        } else {
            shell.machine.handle(now, input)
        };
        if let (Some(t), Some(g)) = (started, shell.ctx.durable.encoder_gauges().get(shell.index as usize)) {
            g.encode_us.fetch_add(t.elapsed().as_micros() as u64, Ordering::Relaxed);
        }
        for _ in hits..shell.machine.counters().cache_hits {
            bump(&shell.ctx.metrics.encoder_cache_hits);
        }
        let from = shell.machine.addr();
        for effect in shell.machine.take_effects() {
            match effect {
                Effect::Busy(t) => shell.ctx.clock.sleep(t).await,
                Effect::Send(o) => shell.ctx.send_frame(from, o.to, o.frame),
                Effect::Work => {
                    let _ = me.send_message(Input::Work);
                }
            }
        }
        shell.publish();
        result.map_err(|crash| crash.0.into())
    }
}
