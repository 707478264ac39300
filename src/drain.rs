//! `deepinfer drain NODE`: a graceful stop for rolling restarts. Every live
//! router stops routing to the instances with devices on the node (and
//! says so), what runs or waits there finishes (polled from the nodes that
//! schedule those instances), then the node's agent is told to stop. Started
//! again, the node rejoins and its instances take requests again.
//!
//! Routers send nothing new to an instance with a device on a draining node
//! until that node is back, so a drain that touches every instance able to
//! take new requests (of a needed role) is an outage: it is refused, before
//! anything is sent, unless `--force` says the outage is accepted.

use std::collections::BTreeSet;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure};
use deepinfer_actors::cluster::disagg::InstanceKind;
use deepinfer_actors::net::quic::{Member, QuicTransport};
use deepinfer_actors::net::tls::{self, CLIENT_NAME};
use deepinfer_actors::net::transport::Transport;
use deepinfer_actors::wire::{self, Addr, Control, Message};

use crate::cluster::{runtime, start_transport, wait_for_members, ClusterPlan};
use crate::node_agent::{query, send};

/// How often the drained instances are polled.
const POLL: Duration = Duration::from_millis(200);

pub fn drain(path: &Path, certs: Option<&Path>, node_name: &str, timeout: Duration, force: bool) -> anyhow::Result<()> {
    let plan = ClusterPlan::load(path)?;
    let node = plan.node_index(node_name)?;
    // The topology alone can show an outage: no need to reach the cluster to refuse.
    if !force {
        refuse_an_outage(&Leftover::of(&plan, node, &[]), false)?;
    }
    let identity = tls::load_identity(&plan.certs_dir(certs)?, CLIENT_NAME)?;
    let cfg = plan.base_config();
    let index = std::process::id();
    let rt = runtime()?;
    rt.block_on(async {
        let (transport, _) = start_transport(&plan, Member::Client(index), identity, &cfg)?;
        let outcome = run(&plan, &transport, index, node, (node_name, timeout, force)).await;
        Transport::close(&*transport);
        outcome
    })
}

async fn run(
    plan: &ClusterPlan,
    transport: &QuicTransport,
    index: u32,
    node: u32,
    (node_name, timeout, force): (&str, Duration, bool),
) -> anyhow::Result<()> {
    let cfg = plan.base_config();
    let topo = cfg.topology();
    let wait = 2 * plan.failure_timeout;
    let me = Addr::client(index);
    // Every node answers at once in a healthy cluster; one that has not
    // within two failure timeouts is down for the routers too.
    let total = plan.nodes.len();
    let up = wait_for_members(transport, wait, |up| up.len() == total).await;
    ensure!(up.contains(&node), "{node_name} is not up: nothing to drain");
    let down: Vec<u32> = (0..total as u32).filter(|n| !up.contains(n)).collect();
    let leftover = Leftover::of(plan, node, &down);
    refuse_an_outage(&leftover, force)?;
    eprintln!("drain {node_name}: {}", leftover.describe());
    let affected = leftover.affected.clone();
    let homes: Vec<u32> = affected.iter().map(|&i| topo.home_node(i)).collect::<BTreeSet<_>>().into_iter().collect();

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

/// What serves new requests while a node drains: the instances with a
/// device on it stop taking them, and so may those with a device on a node
/// that is down. Routers hold an instance down with its scheduler's node,
/// and draining until a drained node is back; one that merely lost another
/// node serves on, but a node that is down looks the same here whether it
/// crashed or was drained, so any down node counts against its instances.
struct Leftover {
    node: String,
    names: Vec<String>,
    kinds: Vec<InstanceKind>,
    /// Instances with a device on the drained node.
    affected: Vec<u32>,
    /// Instances untouched by the drain with devices on nodes that are down, with those nodes.
    down: Vec<(u32, Vec<String>)>,
    /// Instances that take new requests while the node drains and stays away.
    serving: Vec<u32>,
}

impl Leftover {
    fn of(plan: &ClusterPlan, node: u32, down_nodes: &[u32]) -> Self {
        let topo = plan.base_config().topology();
        let touches = |i: u32| topo.devices_of(i).any(|d| topo.node_of_device(d) == node);
        let affected: Vec<u32> = (0..topo.instances).filter(|&i| touches(i)).collect();
        let down: Vec<(u32, Vec<String>)> = (0..topo.instances)
            .filter(|&i| !touches(i))
            .filter_map(|i| {
                let nodes: BTreeSet<u32> = topo.devices_of(i).map(|d| topo.node_of_device(d)).collect();
                let names: Vec<String> = nodes
                    .into_iter()
                    .filter(|n| down_nodes.contains(n))
                    .map(|n| plan.nodes[n as usize].name.clone())
                    .collect();
                (!names.is_empty()).then_some((i, names))
            })
            .collect();
        let serving =
            (0..topo.instances).filter(|i| !affected.contains(i) && !down.iter().any(|(d, _)| d == i)).collect();
        Self {
            node: plan.nodes[node as usize].name.clone(),
            names: plan.topology.instances.iter().map(|i| i.name.get_ref().clone()).collect(),
            kinds: plan.kinds.clone(),
            affected,
            down,
            serving,
        }
    }

    fn list(&self, instances: impl IntoIterator<Item = u32>) -> String {
        let names: Vec<&str> = instances.into_iter().map(|i| self.names[i as usize].as_str()).collect();
        if names.is_empty() {
            "none".into()
        } else {
            names.join(", ")
        }
    }

    /// The roles a new request needs that no serving instance has: a request
    /// is prefilled by a prefill (or both) instance and decoded by a decode (or both) one.
    fn missing(&self) -> Vec<&'static str> {
        let has = |f: fn(InstanceKind) -> bool| self.serving.iter().any(|&i| f(self.kinds[i as usize]));
        let mut missing = Vec::new();
        if !has(InstanceKind::prefills) {
            missing.push("prefill");
        }
        if !has(InstanceKind::decodes) {
            missing.push("decode");
        }
        missing
    }

    /// One line: why new requests would find no instance, or `None`.
    fn outage(&self) -> Option<String> {
        let missing = self.missing();
        let role = match missing.as_slice() {
            [] => return None,
            ["prefill"] => "prefill instance",
            ["decode"] => "decode instance",
            _ => "instance",
        };
        let needed = |i: &u32| {
            let kind = self.kinds[*i as usize];
            missing.contains(&"prefill") && kind.prefills() || missing.contains(&"decode") && kind.decodes()
        };
        let touched = self.list(self.affected.iter().copied().filter(needed));
        let mut why = format!("every {role} has a device on {} ({touched})", self.node);
        if !self.down.is_empty() {
            let down: Vec<String> =
                self.down.iter().map(|(i, n)| format!("{} on {}", self.names[*i as usize], n.join(" and "))).collect();
            why += &format!(" or on a node that is down ({})", down.join(", "));
        }
        Some(why)
    }

    fn describe(&self) -> String {
        format!(
            "instances {} stop taking new requests and finish what they run, {} serve on; then {} stops",
            self.list(self.affected.iter().copied()),
            self.list(self.serving.iter().copied()),
            self.node
        )
    }
}

/// Refuse a drain that leaves no instance to take new requests, unless forced.
fn refuse_an_outage(leftover: &Leftover, force: bool) -> anyhow::Result<()> {
    let Some(why) = leftover.outage() else { return Ok(()) };
    let node = &leftover.node;
    if force {
        eprintln!("drain {node} (--force): {why}: new requests fail until {node} is back");
        return Ok(());
    }
    bail!(
        "refusing to drain {node}: {why}, so new requests would fail until {node} is back; add an instance on \
         other nodes to the topology, or pass --force to drain anyway and accept the outage"
    )
}
