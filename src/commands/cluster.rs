//! `deepinfer cluster init-certs`, `deepinfer launch`, `deepinfer node`,
//! `deepinfer status`: certificates, processes and membership of a cluster
//! described by a topology file.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;
use deepinfer_actors::net::tls::{write_cluster_certs, CLIENT_NAME};

use crate::cluster::{run_node, ClusterPlan, NodeOptions};
use crate::topology::Topology;

#[derive(Args, Debug)]
pub struct InitCertsArgs {
    /// Directory to write `ca.pem` and `<name>.pem` / `<name>.key` into.
    #[arg(long)]
    pub out: PathBuf,
    /// Issue a certificate for every node of this topology (and `client`).
    #[arg(long)]
    pub topology: Option<PathBuf>,
    /// More names to issue certificates for (repeatable).
    #[arg(long = "name")]
    pub names: Vec<String>,
}

#[derive(Args, Debug)]
pub struct NodeArgs {
    /// The topology file.
    #[arg(long)]
    pub topology: PathBuf,
    /// Which of its nodes this process is.
    #[arg(long)]
    pub node: String,
    /// Certificate directory (default: `certs_dir` of the topology).
    #[arg(long)]
    pub certs: Option<PathBuf>,
    /// Stop when standard input closes (how `launch` stops its children, and
    /// why they never outlive it).
    #[arg(long)]
    pub exit_with_stdin: bool,
}

#[derive(Args, Debug)]
pub struct LaunchArgs {
    /// The topology file.
    pub topology: PathBuf,
    /// Certificate directory (default: `certs_dir` of the topology).
    #[arg(long)]
    pub certs: Option<PathBuf>,
    /// Give up if the cluster is not ready after this many seconds.
    #[arg(long, default_value_t = 120)]
    pub ready_timeout: u64,
    /// Start no API front end (by default one serves at the topology's
    /// `api_listen` when that address is on this machine).
    #[arg(long)]
    pub no_api: bool,
}

#[derive(Args, Debug)]
pub struct StatusArgs {
    /// The topology file.
    #[arg(long)]
    pub topology: PathBuf,
    /// Certificate directory (default: `certs_dir` of the topology).
    #[arg(long)]
    pub certs: Option<PathBuf>,
    /// How long to wait for nodes to answer, in milliseconds (default: twice the failure timeout).
    #[arg(long)]
    pub wait_ms: Option<u64>,
}

pub fn init_certs(args: &InitCertsArgs) -> anyhow::Result<()> {
    let mut names = Vec::new();
    let mut cluster = "deepinfer".to_string();
    if let Some(path) = &args.topology {
        let t = Topology::from_file(path)?;
        cluster = t.cluster.name.clone();
        names.extend(t.nodes.iter().map(|n| n.name.get_ref().clone()));
        names.push(CLIENT_NAME.to_string());
    }
    names.extend(args.names.iter().cloned());
    names.sort();
    names.dedup();
    if names.is_empty() {
        bail!("nothing to issue: pass --topology FILE and/or --name NAME");
    }
    let written = write_cluster_certs(&args.out, &cluster, &names)?;
    println!("cluster CA and {} certificates for {}:", names.len(), names.join(", "));
    for p in written {
        println!("  {}", p.display());
    }
    Ok(())
}

pub fn node(args: &NodeArgs) -> anyhow::Result<()> {
    run_node(&NodeOptions {
        topology: args.topology.clone(),
        node: args.node.clone(),
        certs: args.certs.clone(),
        exit_with_stdin: args.exit_with_stdin,
    })
}

#[derive(Args, Debug)]
pub struct DrainArgs {
    /// The node to drain, as the topology names it.
    pub node: String,
    /// The topology file.
    #[arg(long)]
    pub topology: PathBuf,
    /// Certificate directory (default: `certs_dir` of the topology).
    #[arg(long)]
    pub certs: Option<PathBuf>,
    /// Give up if requests still run on the node's instances after this many seconds.
    #[arg(long, default_value_t = 300)]
    pub timeout_s: u64,
    /// Drain even when no other instance would take new requests (they fail until the node is back).
    #[arg(long)]
    pub force: bool,
}

pub fn drain(args: &DrainArgs) -> anyhow::Result<()> {
    let timeout = Duration::from_secs(args.timeout_s);
    crate::drain::drain(&args.topology, args.certs.as_deref(), &args.node, timeout, args.force)
}

pub fn status(args: &StatusArgs) -> anyhow::Result<()> {
    let plan = ClusterPlan::load(&args.topology)?;
    let wait = Duration::from_millis(args.wait_ms.unwrap_or(2 * plan.failure_timeout.as_millis() as u64));
    if !crate::cluster::status(&args.topology, args.certs.as_deref(), wait)? {
        bail!("some nodes are unreachable");
    }
    Ok(())
}

/// One node process started by the launcher.
struct NodeChild {
    name: String,
    child: Child,
    /// Closing it asks the node to stop.
    stdin: Option<ChildStdin>,
    ready: bool,
    exited: bool,
}

/// The launcher's children; dropping it stops them (never leaves orphans behind).
struct Children(Vec<NodeChild>);

impl Children {
    /// Close every node's stdin, wait up to `grace` for them, then kill the rest.
    fn stop(&mut self, grace: Duration) {
        for c in &mut self.0 {
            c.stdin = None;
        }
        let deadline = Instant::now() + grace;
        for c in &mut self.0 {
            loop {
                match c.child.try_wait() {
                    Ok(Some(status)) => {
                        if !c.exited {
                            eprintln!("launch: node {} stopped ({status})", c.name);
                            c.exited = true;
                        }
                        break;
                    }
                    Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
                    _ => {
                        eprintln!("launch: node {} did not stop in time: killing it", c.name);
                        let _ = c.child.kill();
                        let _ = c.child.wait();
                        c.exited = true;
                        break;
                    }
                }
            }
        }
    }
}

impl Children {
    /// Start `command` as child `name`, its stderr lines echoed with the name
    /// and sent on `lines` with its slot; returns the slot.
    fn start(
        &mut self,
        mut command: Command,
        name: String,
        lines: &mpsc::Sender<(usize, Option<String>)>,
    ) -> anyhow::Result<usize> {
        let mut child =
            command.stdin(Stdio::piped()).stderr(Stdio::piped()).spawn().with_context(|| format!("starting {name}"))?;
        let stderr = child.stderr.take().expect("piped");
        let stdin = child.stdin.take();
        let (tx, prefix, slot) = (lines.clone(), name.clone(), self.0.len());
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                eprintln!("[{prefix}] {line}");
                let _ = tx.send((slot, Some(line)));
            }
            let _ = tx.send((slot, None));
        });
        self.0.push(NodeChild { name, child, stdin, ready: false, exited: false });
        Ok(slot)
    }
}

impl Drop for Children {
    fn drop(&mut self) {
        self.stop(Duration::from_secs(5));
    }
}

pub fn launch(args: &LaunchArgs) -> anyhow::Result<()> {
    let plan = ClusterPlan::load(&args.topology)?;
    let certs = plan.certs_dir(args.certs.as_deref())?;
    if !certs.join("ca.pem").exists() {
        bail!(
            "no cluster CA in {}: run `deepinfer cluster init-certs --topology {} --out {}` first",
            certs.display(),
            args.topology.display(),
            certs.display()
        );
    }
    let here = plan.local_nodes();
    if here.is_empty() {
        bail!("{}: no node of this topology has an address on this machine", args.topology.display());
    }
    let exe = std::env::current_exe().context("locating the deepinfer binary")?;
    let (tx, rx) = mpsc::channel::<(usize, Option<String>)>();
    let mut children = Children(Vec::new());
    for &i in &here {
        let name = plan.nodes[i as usize].name.clone();
        let mut command = Command::new(&exe);
        command.arg("node").arg("--topology").arg(&args.topology).args(["--node", &name, "--exit-with-stdin"]);
        command.arg("--certs").arg(&certs);
        children.start(command, name, &tx)?;
    }
    let deadline = Instant::now() + Duration::from_secs(args.ready_timeout);
    while !children.0.iter().all(|c| c.ready) {
        // Only nodes are started yet; each says when it sees the whole cluster.
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok((slot, Some(line))) => {
                if line.contains("cluster ready") {
                    children.0[slot].ready = true;
                }
            }
            Ok((slot, None)) => bail!("node {} exited before the cluster was ready", children.0[slot].name),
            Err(_) => bail!("the cluster was not ready after {} s", args.ready_timeout),
        }
    }
    // The API front end, once the nodes it submits to are up.
    let api = plan.api_listen();
    let api_here = !args.no_api && std::net::UdpSocket::bind(SocketAddr::new(api.ip(), 0)).is_ok();
    let mut api_url = format!("http://{api}");
    if api_here {
        let mut command = Command::new(&exe);
        command.arg("serve").arg("--topology").arg(&args.topology).arg("--certs").arg(&certs);
        command.arg("--listen").arg(api.to_string()).arg("--exit-with-stdin");
        let slot = children.start(command, "api".into(), &tx)?;
        loop {
            match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok((s, Some(line))) if s == slot && line.contains("on http://") => {
                    // The address it bound (the topology may ask for port 0).
                    api_url = line.split("on ").last().unwrap_or_default().trim().to_string();
                    break;
                }
                Ok((s, None)) if s == slot => bail!("the API front end exited before it listened"),
                Ok(_) => {}
                Err(_) => bail!("the API front end did not listen within {} s", args.ready_timeout),
            }
        }
    }
    drop(tx);
    println!(
        "cluster {} ready: {} nodes ({} started here), {} devices, {} instance(s), expert parallel {}",
        plan.name(),
        plan.nodes.len(),
        here.len(),
        plan.devices(),
        plan.instances,
        plan.expert_parallel
    );
    for c in &children.0 {
        let addr = plan.nodes.iter().find(|n| n.name == c.name).map(|n| n.addr.to_string());
        let addr = addr.unwrap_or_else(|| api_url.clone());
        println!("  {:<12} {:<22} pid {}", c.name, addr, c.child.id());
    }
    println!("stop with Ctrl-C");

    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let why = rt.block_on(async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        let mut tick = tokio::time::interval(Duration::from_millis(200));
        loop {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => return anyhow::Ok("interrupted"),
                _ = term.recv() => return Ok("terminated"),
                _ = tick.tick() => {
                    // The children's lines are echoed already; keep the channel from growing.
                    while rx.try_recv().is_ok() {}
                    for c in &mut children.0 {
                        if !c.exited {
                            if let Ok(Some(status)) = c.child.try_wait() {
                                eprintln!("launch: node {} exited ({status})", c.name);
                                c.exited = true;
                            }
                        }
                    }
                    if children.0.iter().all(|c| c.exited) {
                        return Ok("every node exited");
                    }
                }
            }
        }
    })?;
    eprintln!("launch: stopping the cluster ({why})");
    children.stop(Duration::from_secs(10));
    eprintln!("launch: stopped");
    Ok(())
}
