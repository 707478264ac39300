//! The CacheManager's shell: binds the node's cache address and feeds
//! [`CacheMachine`] every frame, sending what it leaves; runs the node's
//! disk tier on its own thread ([`DiskWorker`]) and hands its reads back.

use std::collections::BTreeMap;
use std::sync::Arc;

use deepinfer_engine::request::RequestId;
use ractor::{Actor, ActorProcessingErr, ActorRef};

use crate::cluster::ctx::Ctx;
use crate::kv_disk::system_clock;
use crate::kv_disk::worker::{Clock, DiskWorker};
use crate::net::transport::{pump, Delivery};
use crate::proto::cache::{CacheMachine, DiskOp, LoadedBlock};

pub struct CacheManager;

pub struct CacheArgs {
    pub node: u32,
    pub incarnation: u32,
    pub ctx: Arc<Ctx>,
}

pub enum CacheActorMsg {
    Net(Delivery),
    /// The disk thread finished a read.
    DiskReady,
}

/// The node's disk tier and the reads it has queued (their keys, in order).
struct Disk {
    worker: DiskWorker,
    clock: Clock,
    reads: BTreeMap<u64, Vec<u64>>,
}

pub struct CacheShell {
    machine: CacheMachine,
    disk: Option<Disk>,
    ctx: Arc<Ctx>,
}

impl CacheShell {
    /// Do the disk I/O the machine asked for, then send its frames.
    fn flush(&mut self) {
        loop {
            let ops = self.machine.take_disk_ops();
            if ops.is_empty() {
                break;
            }
            for op in ops {
                self.run(op);
            }
        }
        super::send_outgoing(&self.ctx, self.machine.addr(), self.machine.take_outgoing());
    }

    fn run(&mut self, op: DiskOp) {
        let Some(disk) = self.disk.as_mut() else {
            // No disk after all (it could not start): every read finds nothing.
            if let DiskOp::Read { id, .. } = op {
                self.machine.disk_read(self.ctx.clock.now(), id, Vec::new(), None);
            }
            return;
        };
        match op {
            DiskOp::Write(blocks) => disk.worker.write(blocks),
            DiskOp::Read { id, wanted } => {
                let keys = wanted.iter().map(|w| w.key).collect();
                if disk.worker.fetch(RequestId(id), wanted) {
                    disk.reads.insert(id, keys);
                } else {
                    self.machine.disk_read(self.ctx.clock.now(), id, Vec::new(), None);
                }
            }
        }
    }

    /// Hand every completed read back to the machine.
    fn collect_reads(&mut self) {
        let Some(disk) = self.disk.as_mut() else { return };
        let mut done = Vec::new();
        while let Some(f) = disk.worker.try_fetched() {
            let keys = disk.reads.remove(&f.id.0).unwrap_or_default();
            let now_ms = (disk.clock)();
            let missing = keys.get(f.blocks.len()).copied();
            let blocks: Vec<LoadedBlock> = f
                .blocks
                .into_iter()
                .map(|b| {
                    let (lens, values) = b.values.to_parts();
                    let ttl_ms = b.expires_at_ms.saturating_sub(now_ms);
                    LoadedBlock { key: b.key, parent: b.parent, tokens: b.tokens, lens, values, ttl_ms }
                })
                .collect();
            done.push((f.id.0, blocks, missing));
        }
        for (id, blocks, missing) in done {
            self.machine.disk_read(self.ctx.clock.now(), id, blocks, missing);
        }
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
        let mut machine = CacheMachine::start(ctx.clock.now(), args.node, args.incarnation, Arc::clone(&ctx));
        let mut disk = None;
        if let (true, Some(config)) = (machine.has_disk(), ctx.cache_tiers.disk_of(args.node)) {
            let clock = system_clock();
            let me = myself.clone();
            let wake = Box::new(move || {
                let _ = me.cast(CacheActorMsg::DiskReady);
            });
            // Opening rebuilds the index from the files: blocking I/O, off the runtime's threads.
            let (model, bt, c) = (Arc::clone(&ctx.model), ctx.block_tokens, clock.clone());
            let started =
                tokio::task::spawn_blocking(move || DiskWorker::start_waking(model, bt, &config, c, wake)).await?;
            match started {
                Ok(mut worker) => {
                    let indexed = worker.take_indexed();
                    ctx.events.record(format_args!("{} disk tier: {} blocks indexed", machine.addr(), indexed.len()));
                    machine.disk_indexed(indexed);
                    disk = Some(Disk { worker, clock, reads: BTreeMap::new() });
                }
                Err(e) => ctx.events.record(format_args!("{} runs without its disk tier: {e}", machine.addr())),
            }
        }
        pump(ctx.transport.bind(machine.addr()), myself, CacheActorMsg::Net);
        let mut shell = CacheShell { machine, disk, ctx };
        shell.flush();
        Ok(shell)
    }

    async fn handle(
        &self,
        _me: ActorRef<CacheActorMsg>,
        msg: CacheActorMsg,
        shell: &mut CacheShell,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            CacheActorMsg::Net(d) => shell.machine.handle(shell.ctx.clock.now(), d),
            CacheActorMsg::DiskReady => shell.collect_reads(),
        }
        shell.flush();
        Ok(())
    }
}
