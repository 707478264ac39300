//! A node process's operations endpoint (`agent<node>` on the cluster's
//! transport): it answers status queries from what the node's actors share
//! (placements, occupancy gauges, counters, the node's membership view);
//! and the client side of `deepinfer status`, which asks every node and
//! prints one line per node.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::sync::Notify;

use deepinfer_actors::cluster::ctx::Ctx;
use deepinfer_actors::net::transport::Transport;
use deepinfer_actors::wire::{
    self, Addr, Control, DeviceStatus, EncoderStatus, Envelope, InstanceStatus, Message, NodeCacheStatus, NodeStatus,
    Role,
};

/// What a node reports now.
pub fn node_status(ctx: &Ctx, node: u32, started: SystemTime) -> NodeStatus {
    let topo = &ctx.topology;
    let devices = (0..topo.devices)
        .filter(|&d| topo.node_of_device(d) == node)
        .map(|device| {
            let instance = (0..topo.instances).find(|&i| topo.devices_of(i).contains(&device)).unwrap_or(0);
            DeviceStatus {
                device,
                instance,
                experts: ctx.durable.experts_held(device),
                expert_bytes: ctx.durable.expert_bytes_held(device),
            }
        })
        .collect();
    let gauges = ctx.durable.gauges();
    let load = |g: &std::sync::atomic::AtomicU64| g.load(std::sync::atomic::Ordering::Relaxed);
    let instances = topo
        .instances_on(node)
        .into_iter()
        .map(|instance| {
            let g = &gauges[instance as usize];
            InstanceStatus {
                instance,
                running: load(&g.running),
                waiting: load(&g.waiting),
                kv_used_bytes: load(&g.kv_used_bytes),
                kv_budget_bytes: load(&g.kv_budget_bytes),
                placement_epoch: ctx.durable.placement(node, instance).epoch(),
            }
        })
        .collect();
    let m = ctx.metrics.snapshot();
    let nodes_down = (0..topo.nodes()).filter(|&n| ctx.durable.is_node_down(node, n)).collect();
    let started_unix_ms = started.duration_since(UNIX_EPOCH).unwrap_or_default().as_millis() as u64;
    let uptime_ms = started.elapsed().unwrap_or_default().as_millis() as u64;
    NodeStatus {
        node,
        started_unix_ms,
        uptime_ms,
        nodes_down,
        devices,
        instances,
        passes: m.passes,
        dispatches_answered: m.dispatches_answered,
        rss_bytes: resident_bytes(),
        expert_bytes_read: m.expert_bytes_read,
        expert_bytes_freed: m.expert_bytes_freed,
        cache: NodeCacheStatus {
            pool_hits: m.cache_hits,
            host_blocks_in: m.host_blocks_in,
            host_hit_blocks: m.host_hit_blocks,
            disk_hit_blocks: m.disk_hit_blocks,
            blocks_persisted: m.blocks_persisted,
        },
        drafts_verified: m.drafts_verified,
        drafts_accepted: m.drafts_accepted,
        encoders: encoder_status(ctx, node),
    }
}

/// The image encoders of `node`, from the gauges their shells publish.
pub fn encoder_status(ctx: &Ctx, node: u32) -> Vec<EncoderStatus> {
    let load = |g: &std::sync::atomic::AtomicU64| g.load(std::sync::atomic::Ordering::Relaxed);
    ctx.encoders_on(node)
        .into_iter()
        .filter_map(|e| {
            let g = ctx.durable.encoder_gauges().get(e as usize)?;
            Some(EncoderStatus {
                encoder: e,
                images_encoded: load(&g.images_encoded),
                cache_hits: load(&g.cache_hits),
                cache_misses: load(&g.cache_misses),
                queue_images: load(&g.queue_images),
                encode_us: load(&g.encode_us),
            })
        })
        .collect()
}

/// Resident memory of this process (`VmRSS`); 0 where the system does not say.
pub fn resident_bytes() -> u64 {
    let Ok(text) = std::fs::read_to_string("/proc/self/status") else { return 0 };
    text.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kib| kib * 1024)
}

/// Answer status queries sent to `agent<node>` until the transport closes;
/// a client's `Shutdown` (the end of a drain) notifies `stop`.
pub fn spawn(ctx: Arc<Ctx>, node: u32, started: SystemTime, stop: Arc<Notify>) {
    let me = Addr::agent(node);
    let mut inbox = ctx.transport.bind(me);
    tokio::spawn(async move {
        while let Some(d) = inbox.recv().await {
            let Some(m) = ctx.open(me, &d) else { continue };
            match (m.envelope.from.role, m.envelope.msg) {
                (Role::Client, Message::Control(Control::StatusQuery { nonce })) => {
                    let status = Box::new(node_status(&ctx, node, started));
                    ctx.send(me, m.envelope.from, Message::Control(Control::StatusReport { nonce, status }), &[]);
                }
                (Role::Client, Message::Control(Control::Shutdown)) => stop.notify_one(),
                _ => {}
            }
        }
    });
}

/// Send `msg` from client address `me` to `to`; false if it could not be sent.
pub fn send(transport: &dyn Transport, me: Addr, to: Addr, msg: Message) -> bool {
    let env = Envelope { from: me, to, msg };
    wire::encode(&env, &[]).is_ok_and(|frame| transport.send(me, to, frame).is_ok())
}

/// Ask the agents of `nodes` from client address `me`; the reports that
/// arrive within `wait`, by node.
pub async fn query(transport: &dyn Transport, me: Addr, nodes: &[u32], wait: Duration) -> BTreeMap<u32, NodeStatus> {
    let mut inbox = transport.bind(me);
    let nonce = u64::from(std::process::id());
    for &n in nodes {
        let env = Envelope { from: me, to: Addr::agent(n), msg: Message::Control(Control::StatusQuery { nonce }) };
        if let Ok(frame) = wire::encode(&env, &[]) {
            let _ = transport.send(me, Addr::agent(n), frame);
        }
    }
    let mut reports = BTreeMap::new();
    let _ = tokio::time::timeout(wait, async {
        while reports.len() < nodes.len() {
            let Some(d) = inbox.recv().await else { break };
            let Ok(m) = wire::decode(&d.frame) else { continue };
            if let Message::Control(Control::StatusReport { nonce: n, status }) = m.envelope.msg {
                if n == nonce && m.envelope.from == Addr::agent(status.node) {
                    reports.insert(status.node, *status);
                }
            }
        }
    })
    .await;
    reports
}

/// `bytes` in B, KiB, MiB or GiB, whichever reads best.
pub fn bytes_text(bytes: u64) -> String {
    const UNITS: [&str; 4] = ["B", "KiB", "MiB", "GiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

/// One line per node: what a user checks first.
pub fn status_line(name: &str, status: &NodeStatus, heard_ago: Option<Duration>) -> String {
    let experts: u32 = status.devices.iter().map(|d| d.experts).sum();
    let mib = |bytes: u64| bytes as f64 / (1 << 20) as f64;
    let expert_bytes = bytes_text(status.devices.iter().map(|d| d.expert_bytes).sum());
    let (running, waiting): (u64, u64) =
        status.instances.iter().fold((0, 0), |(r, w), i| (r + i.running, w + i.waiting));
    let (used, budget): (u64, u64) =
        status.instances.iter().fold((0, 0), |(u, b), i| (u + i.kv_used_bytes, b + i.kv_budget_bytes));
    let kv = if budget == 0 { "-".to_string() } else { format!("{:.1}%", 100.0 * used as f64 / budget as f64) };
    let heard = heard_ago.map_or("-".to_string(), |d| format!("{} ms ago", d.as_millis()));
    let down =
        if status.nodes_down.is_empty() { String::new() } else { format!("  sees down: {:?}", status.nodes_down) };
    let epochs: Vec<String> = status.instances.iter().map(|i| format!("{}", i.placement_epoch)).collect();
    let epochs = if epochs.is_empty() { String::new() } else { format!("  table epoch {}", epochs.join("/")) };
    let moved = format!(
        "  expert weights read {}, freed {}",
        bytes_text(status.expert_bytes_read),
        bytes_text(status.expert_bytes_freed)
    );
    let c = &status.cache;
    let cache = format!(
        "  cache: {} pool hits, blocks up from host {} / disk {}, to host {}, persisted {}",
        c.pool_hits, c.host_hit_blocks, c.disk_hit_blocks, c.host_blocks_in, c.blocks_persisted
    );
    let drafts = if status.drafts_verified == 0 {
        String::new()
    } else {
        format!("  drafts accepted {} of {}", status.drafts_accepted, status.drafts_verified)
    };
    let encoders: String = status
        .encoders
        .iter()
        .map(|e| {
            format!(
                "  encoder{}: images encoded {}, cache hits {}, misses {}, queue {}, encode time {:.3} s",
                e.encoder,
                e.images_encoded,
                e.cache_hits,
                e.cache_misses,
                e.queue_images,
                e.encode_us as f64 / 1e6
            )
        })
        .collect();
    format!(
        "{name:<10} up {:>6} s (incarnation {})  devices {:?}  experts {experts:>4} ({expert_bytes})  \
         RSS {:.0} MiB  running {running:>3}  waiting {waiting:>3}  KV {kv:>6}{epochs}{moved}{cache}{drafts}{encoders}  heard {heard}{down}",
        status.uptime_ms / 1000,
        status.started_unix_ms,
        status.devices.iter().map(|d| d.device).collect::<Vec<_>>(),
        mib(status.rss_bytes),
    )
}

#[cfg(test)]
mod tests {
    use super::bytes_text;

    #[test]
    fn byte_counts_read_in_the_unit_that_fits() {
        assert_eq!(bytes_text(0), "0 B");
        assert_eq!(bytes_text(1023), "1023 B");
        assert_eq!(bytes_text(1536), "1.5 KiB");
        assert_eq!(bytes_text(120 << 20), "120.0 MiB");
        assert_eq!(bytes_text(3 << 30), "3.0 GiB");
        assert_eq!(bytes_text(u64::MAX), "17179869184.0 GiB");
    }
}
