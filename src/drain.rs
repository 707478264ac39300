//! `deepinfer drain NODE`: a graceful stop for rolling restarts. Every live
//! router stops routing to the instances with devices on the node (and
//! says so), what runs or waits there finishes (polled from the nodes that
//! schedule those instances), then the node's agent is told to stop. Started
//! again, the node rejoins and its instances take requests again.

use std::collections::BTreeSet;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::ensure;
use deepinfer_actors::net::quic::{Member, QuicTransport};
use deepinfer_actors::net::tls::{self, CLIENT_NAME};
use deepinfer_actors::net::transport::Transport;
use deepinfer_actors::wire::{self, Addr, Control, Message};

use crate::cluster::{runtime, start_transport, wait_for_members, ClusterPlan};
use crate::node_agent::{query, send};

/// How often the drained instances are polled.
const POLL: Duration = Duration::from_millis(200);

pub fn drain(path: &Path, certs: Option<&Path>, node_name: &str, timeout: Duration) -> anyhow::Result<()> {
    let plan = ClusterPlan::load(path)?;
    let node = plan.node_index(node_name)?;
    let identity = tls::load_identity(&plan.certs_dir(certs)?, CLIENT_NAME)?;
    let cfg = plan.base_config();
    let index = std::process::id();
    let rt = runtime()?;
    rt.block_on(async {
        let (transport, _) = start_transport(&plan, Member::Client(index), identity, &cfg)?;
        let outcome = run(&plan, &transport, index, node, node_name, timeout).await;
        Transport::close(&*transport);
        outcome
    })
}

async fn run(
    plan: &ClusterPlan,
    transport: &QuicTransport,
    index: u32,
    node: u32,
    node_name: &str,
    timeout: Duration,
) -> anyhow::Result<()> {
    let cfg = plan.base_config();
    let topo = cfg.topology();
    let affected: Vec<u32> =
        (0..topo.instances).filter(|&i| topo.devices_of(i).any(|d| topo.node_of_device(d) == node)).collect();
    let homes: Vec<u32> = affected.iter().map(|&i| topo.home_node(i)).collect::<BTreeSet<_>>().into_iter().collect();
    let wait = 2 * plan.failure_timeout;
    let me = Addr::client(index);
    let up = wait_for_members(transport, wait, |up| up.contains(&node)).await;
    ensure!(up.contains(&node), "{node_name} is not up: nothing to drain");

    // 1. No new requests: every live router acknowledges.
    let routers: Vec<u32> = (0..cfg.router_nodes()).filter(|r| up.contains(r)).collect();
    let nonce = u64::from(index);
    let mut inbox = transport.bind(me);
    for &r in &routers {
        send(transport, me, Addr::router(r), Message::Control(Control::Drain { node, nonce }));
    }
    let mut acked = BTreeSet::new();
    let _ = tokio::time::timeout(wait, async {
        while acked.len() < routers.len() {
            let Some(d) = inbox.recv().await else { break };
            let Ok(m) = wire::decode(&d.frame) else { continue };
            if let Message::Control(Control::DrainAck { node: n, nonce: k }) = m.envelope.msg {
                if (n, k) == (node, nonce) {
                    acked.insert(m.envelope.from.index);
                }
            }
        }
    })
    .await;
    let silent: Vec<&u32> = routers.iter().filter(|r| !acked.contains(r)).collect();
    ensure!(silent.is_empty(), "routers {silent:?} did not acknowledge the drain of {node_name}");
    eprintln!("drain {node_name}: routers {routers:?} send no new request to instances {affected:?}");
    drop(inbox);

    // 2. What runs there finishes: twice in a row nothing running or waiting.
    let start = Instant::now();
    let mut quiet = 0;
    while quiet < 2 {
        ensure!(start.elapsed() < timeout, "requests still run on instances {affected:?} after {timeout:?}");
        tokio::time::sleep(POLL).await;
        let reports = query(transport, me, &homes, wait).await;
        let busy: u64 = reports
            .values()
            .flat_map(|s| &s.instances)
            .filter(|i| affected.contains(&i.instance))
            .map(|i| i.running + i.waiting)
            .sum();
        let heard_all = homes.iter().all(|h| reports.contains_key(h));
        quiet = if busy == 0 && heard_all { quiet + 1 } else { 0 };
    }
    eprintln!("drain {node_name}: its instances are idle after {:.1} s", start.elapsed().as_secs_f64());

    // 3. The node stops; membership sees it go.
    send(transport, me, Addr::agent(node), Message::Control(Control::Shutdown));
    let up = wait_for_members(transport, timeout, |up| !up.contains(&node)).await;
    ensure!(!up.contains(&node), "{node_name} did not stop within {timeout:?}");
    println!("drained {node_name}: stopped; start it again to rejoin");
    Ok(())
}
