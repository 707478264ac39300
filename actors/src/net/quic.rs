// tidy: long file: the QUIC transport whole (endpoint, two lanes per peer, frame and sender checks, reconnects, membership ticks), each concern a section.
//! The QUIC transport: actors of different processes (or machines) talk over
//! one quinn endpoint per process, mutual TLS 1.3 against the cluster CA.
//!
//! ```text
//! node A                                                     node B
//! send(from, to) ─► lane queue (bounded) ─► writer task ─► uni stream "control"  ─► reader ─► decode ─► inbox of `to`
//!                                       └► writer task ─► uni stream "data"     ─► reader ─┘
//! ```
//!
//! - **Routing.** `node_of(to)` names the node of every address; addresses
//!   of this node go to local inboxes as in [`crate::net::transport::InProcess`].
//!   A client (not in the topology, it only dials) is answered on the
//!   connection it came from.
//! - **Two lanes.** Heartbeats, control, submits, cancels and acks travel on
//!   one stream, step requests, dispatches, results, outputs and cache values
//!   on another: QUIC flow-controls streams separately, so a large dispatch
//!   never holds a heartbeat back.
//! - **Limits.** Each lane of each peer queues at most a fixed number of
//!   frames; `send` never blocks and a full queue is `QueueFull`, which the
//!   protocol treats as a lost message. A frame's length is checked against
//!   the limit before its buffer is allocated; every frame is validated with
//!   [`crate::wire::decode`]; a malformed, truncated or oversized frame, a
//!   sender address the peer's certificate does not cover, or a frame for
//!   another node closes that connection (the endpoint stays up).
//! - **Identity.** The TLS handshake admits only certificates signed by the
//!   cluster CA. A node's certificate names the node; the first frame of an
//!   accepted connection claims a sender, and the certificate must name the
//!   node of that sender (or `client`); later frames must come from the same.
//! - **Reconnect.** A lane whose connection fails dials again with
//!   exponential backoff (50 ms to 1 s) while frames queue up to the limit.
//! - **Membership** (the [`Membership`] machine, ticked here). Every
//!   `heartbeat` each node sends a heartbeat frame to
//!   every other node (clients to every node, which answer them). A peer
//!   heard from is up; a peer that was up and is silent for longer than
//!   `failure_timeout` is down (reported once, with how long it was silent),
//!   and up again when heard from. A client also reports a node it has not
//!   heard from at all within `failure_timeout` of starting.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use quinn::{Connection, Endpoint, RecvStream, SendStream, VarInt};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::net::tls::{self, Identity, TlsError, CLIENT_NAME};
use crate::net::transport::{offer, Delivery, Inbox, Transport, TransportError, DEFAULT_QUEUE};
use crate::sim::clock::Clock;
use crate::sim::events::{bump, EventLog, Metrics};
use crate::sim::fabric::NodeOf;
use crate::wire::{self, Addr, Envelope, Heartbeat, Message, MsgKind, Role, MAX_FRAME_BYTES};

use crate::limits::{BACKOFF_MAX, BACKOFF_MIN};
pub use crate::limits::{CONTROL_QUEUE, DATA_QUEUE};
/// Application close codes.
const CLOSE_SHUTDOWN: u32 = 0;
const CLOSE_BAD_FRAME: u32 = 1;
const CLOSE_BAD_IDENTITY: u32 = 2;

/// Who this endpoint is: node `index` of the topology (hosts actors,
/// accepts connections) or a client with address `Addr::client(index)`
/// (dials nodes only). Membership itself is the sans-IO
/// [`Membership`] machine, run here on the endpoint's clock.
pub use crate::proto::membership::{Member, MemberEvent};
use crate::proto::membership::{Membership, MembershipConfig};

/// A node of the topology: the name its certificate carries, and its address.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeAddr {
    pub name: String,
    pub addr: SocketAddr,
}

pub struct QuicConfig {
    pub me: Member,
    /// Every node of the cluster, by index.
    pub nodes: Vec<NodeAddr>,
    /// The node of every actor address (roles `Client` excepted).
    pub node_of: NodeOf,
    pub identity: Identity,
    pub heartbeat: Duration,
    pub failure_timeout: Duration,
    /// How long a node waits for a peer it never heard from before declaring it down.
    pub startup_grace: Duration,
    /// Largest frame accepted (and sent).
    pub max_frame: u32,
    /// Where a node listens; `None`: its address in `nodes` (clients bind an ephemeral port).
    pub listen: Option<SocketAddr>,
}

impl QuicConfig {
    pub fn new(me: Member, nodes: Vec<NodeAddr>, node_of: NodeOf, identity: Identity) -> Self {
        Self {
            me,
            nodes,
            node_of,
            identity,
            heartbeat: Duration::from_millis(200),
            failure_timeout: Duration::from_secs(1),
            startup_grace: Duration::from_secs(60),
            max_frame: MAX_FRAME_BYTES,
            listen: None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum QuicError {
    #[error(transparent)]
    Tls(#[from] TlsError),
    #[error("QUIC endpoint on {addr}: {why}")]
    Endpoint { addr: SocketAddr, why: String },
    #[error("node {0} is not in the topology")]
    UnknownNode(u32),
}

/// Counters of what the endpoint refused.
#[derive(Default)]
pub struct QuicStats {
    /// Handshakes that failed (certificate not signed by the CA, wrong protocol, …).
    pub connections_refused: AtomicU64,
    /// Connections closed for a bad frame or a sender the certificate does not cover.
    pub connections_closed: AtomicU64,
    pub frames_received: AtomicU64,
}

struct Peer {
    control: mpsc::Sender<Vec<u8>>,
    data: mpsc::Sender<Vec<u8>>,
    conn: tokio::sync::Mutex<Option<Connection>>,
}

/// A client's connection, answered on.
struct ClientLink {
    stable_id: usize,
    control: mpsc::Sender<Vec<u8>>,
    data: mpsc::Sender<Vec<u8>>,
    tasks: [JoinHandle<()>; 2],
}

/// Who is at the other end of a connection, once known.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PeerId {
    Node(u32),
    Client(u32),
}

struct Inner {
    me: Member,
    /// This process's id in its heartbeats: drawn from the wall clock at
    /// start, so a restarted process names itself anew.
    process: u64,
    nodes: Vec<NodeAddr>,
    node_of: NodeOf,
    membership: Mutex<Membership>,
    max_frame: u32,
    endpoint: Endpoint,
    clock: Arc<dyn Clock>,
    events: Arc<EventLog>,
    metrics: Arc<Metrics>,
    stats: QuicStats,
    local: Mutex<Option<BTreeMap<Addr, mpsc::Sender<Delivery>>>>,
    peers: Vec<Peer>,
    clients: Mutex<BTreeMap<u32, ClientLink>>,
    subscribers: Mutex<Vec<mpsc::UnboundedSender<MemberEvent>>>,
    tasks: Mutex<Vec<JoinHandle<()>>>,
    closed: AtomicBool,
}

/// The QUIC implementation of [`Transport`].
pub struct QuicTransport {
    inner: Arc<Inner>,
    local_addr: SocketAddr,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Kinds that travel on the control lane.
fn is_control(kind: MsgKind) -> bool {
    matches!(kind, MsgKind::Heartbeat | MsgKind::Control | MsgKind::Submit | MsgKind::Cancel | MsgKind::Ack)
}

fn transport_config(heartbeat: Duration, failure_timeout: Duration) -> quinn::TransportConfig {
    let mut t = quinn::TransportConfig::default();
    // QUIC's own idle timer backs the heartbeats up: a silent peer's connection closes too.
    if let Ok(idle) = quinn::IdleTimeout::try_from(failure_timeout.max(Duration::from_millis(100))) {
        t.max_idle_timeout(Some(idle));
    }
    t.keep_alive_interval(Some(heartbeat));
    t.max_concurrent_bidi_streams(VarInt::from_u32(0));
    // Two lanes each way, with room for a reconnect's replacements.
    t.max_concurrent_uni_streams(VarInt::from_u32(8));
    t.stream_receive_window(VarInt::from_u32(16 << 20));
    t.receive_window(VarInt::from_u32(64 << 20));
    t.send_window(64 << 20);
    t
}

impl QuicTransport {
    /// Open the endpoint and start its tasks (call inside a tokio runtime).
    pub fn start(
        cfg: QuicConfig,
        clock: Arc<dyn Clock>,
        events: Arc<EventLog>,
        metrics: Arc<Metrics>,
    ) -> Result<Arc<Self>, QuicError> {
        let transport = Arc::new(transport_config(cfg.heartbeat, cfg.failure_timeout));
        let client_crypto = quinn::crypto::rustls::QuicClientConfig::try_from(tls::client_config(&cfg.identity)?)
            .map_err(|e| TlsError::Config(e.to_string()))?;
        let mut client = quinn::ClientConfig::new(Arc::new(client_crypto));
        client.transport_config(Arc::clone(&transport));
        let (mut endpoint, bind) = match cfg.me {
            Member::Node(n) => {
                let addr = match cfg.listen {
                    Some(a) => a,
                    None => cfg.nodes.get(n as usize).ok_or(QuicError::UnknownNode(n))?.addr,
                };
                let server_crypto =
                    quinn::crypto::rustls::QuicServerConfig::try_from(tls::server_config(&cfg.identity)?)
                        .map_err(|e| TlsError::Config(e.to_string()))?;
                let mut server = quinn::ServerConfig::with_crypto(Arc::new(server_crypto));
                server.transport_config(Arc::clone(&transport));
                let ep =
                    Endpoint::server(server, addr).map_err(|e| QuicError::Endpoint { addr, why: e.to_string() })?;
                (ep, addr)
            }
            Member::Client(_) => {
                let addr = cfg.listen.unwrap_or_else(|| SocketAddr::from(([0, 0, 0, 0], 0)));
                let ep = Endpoint::client(addr).map_err(|e| QuicError::Endpoint { addr, why: e.to_string() })?;
                (ep, addr)
            }
        };
        endpoint.set_default_client_config(client);
        let local_addr = endpoint.local_addr().map_err(|e| QuicError::Endpoint { addr: bind, why: e.to_string() })?;
        let mut receivers = Vec::new();
        let peers = cfg
            .nodes
            .iter()
            .map(|_| {
                let (control, crx) = mpsc::channel(CONTROL_QUEUE);
                let (data, drx) = mpsc::channel(DATA_QUEUE);
                receivers.push((crx, drx));
                Peer { control, data, conn: tokio::sync::Mutex::new(None) }
            })
            .collect();
        let members = Membership::new(
            clock.now(),
            cfg.me,
            cfg.nodes.len() as u32,
            MembershipConfig {
                heartbeat: cfg.heartbeat,
                failure_timeout: cfg.failure_timeout,
                startup_grace: cfg.startup_grace,
            },
        );
        let process = SystemTime::now().duration_since(UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64).max(1);
        let inner = Arc::new(Inner {
            me: cfg.me,
            process,
            nodes: cfg.nodes,
            node_of: cfg.node_of,
            membership: Mutex::new(members),
            max_frame: cfg.max_frame.min(MAX_FRAME_BYTES),
            endpoint,
            clock,
            events,
            metrics,
            stats: QuicStats::default(),
            local: Mutex::new(Some(BTreeMap::new())),
            peers,
            clients: Mutex::new(BTreeMap::new()),
            subscribers: Mutex::new(Vec::new()),
            tasks: Mutex::new(Vec::new()),
            closed: AtomicBool::new(false),
        });
        let mut tasks = Vec::new();
        for (node, (crx, drx)) in receivers.into_iter().enumerate() {
            if inner.me == Member::Node(node as u32) {
                continue;
            }
            for rx in [crx, drx] {
                tasks.push(tokio::spawn(dial_writer(Arc::clone(&inner), node as u32, rx)));
            }
        }
        if matches!(inner.me, Member::Node(_)) {
            tasks.push(tokio::spawn(accept_loop(Arc::clone(&inner))));
        }
        tasks.push(tokio::spawn(membership(Arc::clone(&inner))));
        lock(&inner.tasks).extend(tasks);
        Ok(Arc::new(Self { inner, local_addr }))
    }

    /// The UDP address the endpoint is bound to.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    pub fn stats(&self) -> &QuicStats {
        &self.inner.stats
    }

    /// Membership news from now on.
    pub fn subscribe(&self) -> mpsc::UnboundedReceiver<MemberEvent> {
        let (tx, rx) = mpsc::unbounded_channel();
        lock(&self.inner.subscribers).push(tx);
        rx
    }

    /// Nodes heard from and not since declared down.
    pub fn nodes_up(&self) -> Vec<u32> {
        lock(&self.inner.membership).nodes_up()
    }

    /// Nodes about to be declared down (see `Membership::suspects`).
    pub fn suspects(&self) -> std::collections::BTreeSet<u32> {
        lock(&self.inner.membership).suspects(self.inner.clock.now())
    }

    /// How long ago `node` was last heard from, if ever.
    pub fn heard_ago(&self, node: u32) -> Option<std::time::Duration> {
        lock(&self.inner.membership).heard_ago(self.inner.clock.now(), node)
    }

    /// Send a raw byte string on a fresh stream to node `node` (tests of the
    /// receiving side's validation).
    #[doc(hidden)]
    pub async fn send_raw(&self, node: u32, bytes: &[u8]) -> Result<(), String> {
        let conn = connection(&self.inner, node).await.ok_or("shut down")?;
        let mut s = conn.open_uni().await.map_err(|e| e.to_string())?;
        s.write_all(bytes).await.map_err(|e| e.to_string())?;
        s.finish().map_err(|e| e.to_string())?;
        Ok(())
    }

    /// Wait until the dialed connection to `node` is closed, with why.
    #[doc(hidden)]
    pub async fn connection_closed(&self, node: u32) -> Option<String> {
        let conn = self.inner.peers.get(node as usize)?.conn.lock().await.clone()?;
        Some(conn.closed().await.to_string())
    }
}

impl Inner {
    fn now_ns(&self) -> u64 {
        self.clock.now().as_nanos() as u64 + 1
    }

    fn is_local(&self, to: Addr) -> bool {
        match self.me {
            Member::Node(n) => to.role != Role::Client && (self.node_of)(to) == n,
            Member::Client(k) => to == Addr::client(k),
        }
    }

    fn my_addr(&self) -> Addr {
        match self.me {
            Member::Node(n) => Addr::node(n),
            Member::Client(k) => Addr::client(k),
        }
    }

    fn deliver_local(&self, from: Addr, to: Addr, frame: Vec<u8>) -> Result<(), TransportError> {
        let tx = {
            let local = lock(&self.local);
            let local = local.as_ref().ok_or(TransportError::Shutdown)?;
            local.get(&to).cloned().ok_or(TransportError::Unbound(to))?
        };
        offer(&tx, Delivery::new(from, frame), to, &self.metrics)
    }

    fn publish(&self, e: MemberEvent) {
        self.events.record(format_args!("membership: {e:?}"));
        lock(&self.subscribers).retain(|s| s.send(e.clone()).is_ok());
    }

    fn heard_from(&self, node: u32) {
        let up = lock(&self.membership).heard(self.clock.now(), node);
        if let Some(e) = up {
            self.publish(e);
        }
    }

    /// A node's heartbeat naming its process: a new process under a node
    /// that was up is a restart nobody saw go down.
    fn heard_process(&self, node: u32, process: u64) {
        let events = lock(&self.membership).heard_process(self.clock.now(), node, process);
        for e in events {
            self.publish(e);
        }
    }

    /// Check and account one frame from an accepted or dialed connection;
    /// `Err` closes the connection.
    fn accept_frame(&self, conn: &Connection, who: &OnceLock<PeerId>, frame: Vec<u8>) -> Result<(), (u32, String)> {
        let bad = |why: String| (CLOSE_BAD_FRAME, why);
        let d = wire::decode_with_limit(&frame, self.max_frame).map_err(|e| bad(e.to_string()))?;
        let Envelope { from, to, msg } = d.envelope;
        let claim = if from.role == Role::Client {
            PeerId::Client(from.index)
        } else {
            let n = (self.node_of)(from);
            if n as usize >= self.nodes.len() {
                return Err((CLOSE_BAD_IDENTITY, format!("sender {from} is on no node of the topology")));
            }
            PeerId::Node(n)
        };
        let peer = match who.get() {
            Some(p) => *p,
            None => {
                let name = match claim {
                    PeerId::Client(_) => CLIENT_NAME,
                    PeerId::Node(n) => self.nodes[n as usize].name.as_str(),
                };
                if matches!((claim, self.me), (PeerId::Node(a), Member::Node(b)) if a == b) {
                    return Err((CLOSE_BAD_IDENTITY, format!("peer claims to be this node ({from})")));
                }
                if !peer_cert_names(conn, name) {
                    return Err((CLOSE_BAD_IDENTITY, format!("certificate does not name `{name}` (sender {from})")));
                }
                *who.get_or_init(|| claim)
            }
        };
        if peer != claim {
            return Err((CLOSE_BAD_IDENTITY, format!("sender {from} is not {peer:?}")));
        }
        bump(&self.stats.frames_received);
        match (peer, &msg) {
            (PeerId::Node(n), Message::Heartbeat(h)) if from.role == Role::Node => self.heard_process(n, h.incarnation),
            (PeerId::Node(n), _) => self.heard_from(n),
            (PeerId::Client(k), _) => self.client_link(k, conn),
        }
        if !self.is_local(to) && to != self.my_addr() {
            return Err(bad(format!("frame for {to}, which is not here")));
        }
        if to == self.my_addr() && !matches!(self.me, Member::Client(_)) {
            // Membership traffic: answer a client's heartbeat so it can watch us.
            if let (PeerId::Client(k), Message::Heartbeat(_)) = (peer, &msg) {
                self.send_heartbeat(Addr::client(k));
            }
            return Ok(());
        }
        // A node's heartbeat is membership's alone (taken above), never an actor's.
        if matches!(msg, Message::Heartbeat(_)) && from.role == Role::Node {
            return Ok(());
        }
        // An unbound address or a full inbox loses the frame, as a crash would; the peer is fine.
        let _ = self.deliver_local(from, to, frame);
        Ok(())
    }

    fn send_heartbeat(&self, to: Addr) {
        let hb = Heartbeat { incarnation: self.process, restarted: false, time_ns: self.now_ns() };
        let env = Envelope { from: self.my_addr(), to, msg: Message::Heartbeat(hb) };
        if let Ok(frame) = wire::encode(&env, &[]) {
            let _ = self.route(to, frame);
        }
    }

    /// Queue a frame for a remote address.
    fn route(&self, to: Addr, frame: Vec<u8>) -> Result<(), TransportError> {
        let control = wire::peek_kind(&frame).map(is_control)?;
        let tx = if to.role == Role::Client {
            let clients = lock(&self.clients);
            let link = clients.get(&to.index).ok_or(TransportError::Unbound(to))?;
            if control {
                link.control.clone()
            } else {
                link.data.clone()
            }
        } else {
            let p = self.peers.get((self.node_of)(to) as usize).ok_or(TransportError::Unbound(to))?;
            if control {
                p.control.clone()
            } else {
                p.data.clone()
            }
        };
        match tx.try_send(frame) {
            Ok(()) => Ok(()),
            Err(mpsc::error::TrySendError::Full(_)) => {
                bump(&self.metrics.frames_dropped);
                Err(TransportError::QueueFull(to))
            }
            Err(mpsc::error::TrySendError::Closed(_)) => {
                bump(&self.metrics.frames_dropped);
                Err(TransportError::Closed(to))
            }
        }
    }

    /// Answer client `k` on `conn` from now on (a reconnect replaces the link).
    fn client_link(&self, k: u32, conn: &Connection) {
        let mut clients = lock(&self.clients);
        if clients.get(&k).is_some_and(|l| l.stable_id == conn.stable_id()) {
            return;
        }
        let (control, crx) = mpsc::channel(CONTROL_QUEUE);
        let (data, drx) = mpsc::channel(DATA_QUEUE);
        let tasks = [tokio::spawn(fixed_writer(conn.clone(), crx)), tokio::spawn(fixed_writer(conn.clone(), drx))];
        if let Some(old) = clients.insert(k, ClientLink { stable_id: conn.stable_id(), control, data, tasks }) {
            old.tasks.iter().for_each(JoinHandle::abort);
        }
    }
}

fn peer_cert_names(conn: &Connection, name: &str) -> bool {
    let Some(id) = conn.peer_identity() else { return false };
    let Ok(certs) = id.downcast::<Vec<rustls::pki_types::CertificateDer<'static>>>() else { return false };
    certs.first().is_some_and(|c| tls::cert_names(c, name))
}

/// The connection to `node`, dialed (with backoff) if there is none; `None` once shut down.
async fn connection(inner: &Arc<Inner>, node: u32) -> Option<Connection> {
    let peer = inner.peers.get(node as usize)?;
    let mut slot = peer.conn.lock().await;
    if let Some(c) = slot.as_ref() {
        if c.close_reason().is_none() {
            return Some(c.clone());
        }
    }
    let target = &inner.nodes[node as usize];
    let mut delay = BACKOFF_MIN;
    loop {
        if inner.closed.load(Ordering::Relaxed) {
            return None;
        }
        let attempt = match inner.endpoint.connect(target.addr, &target.name) {
            Ok(connecting) => connecting.await.map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        match attempt {
            Ok(conn) => {
                // The peer is the node we dialed (the handshake checked its name); it may answer on this connection.
                let who = Arc::new(OnceLock::new());
                let _ = who.set(PeerId::Node(node));
                let task = tokio::spawn(read_connection(Arc::clone(inner), conn.clone(), who));
                lock(&inner.tasks).push(task);
                *slot = Some(conn.clone());
                return Some(conn);
            }
            Err(_) => {
                inner.clock.sleep(delay).await;
                delay = (delay * 2).min(BACKOFF_MAX);
            }
        }
    }
}

/// Drain one lane towards a node: each frame on the lane's stream of the
/// current connection; a broken stream or connection is opened again.
async fn dial_writer(inner: Arc<Inner>, node: u32, mut rx: mpsc::Receiver<Vec<u8>>) {
    let mut stream: Option<(usize, SendStream)> = None;
    while let Some(frame) = rx.recv().await {
        for _ in 0..2 {
            if stream.is_none() {
                let Some(conn) = connection(&inner, node).await else { return };
                match conn.open_uni().await {
                    Ok(s) => stream = Some((conn.stable_id(), s)),
                    Err(_) => continue,
                }
            }
            let (_, s) = stream.as_mut().expect("opened");
            if s.write_all(&frame).await.is_ok() {
                bump(&inner.metrics.frames_sent);
                inner.metrics.bytes_sent.fetch_add(frame.len() as u64, Ordering::Relaxed);
                break;
            }
            // The connection broke under this frame: once more on a new one, then it is lost.
            stream = None;
        }
    }
}

/// Drain one lane towards a client on the connection it opened.
async fn fixed_writer(conn: Connection, mut rx: mpsc::Receiver<Vec<u8>>) {
    let mut stream: Option<SendStream> = None;
    while let Some(frame) = rx.recv().await {
        if stream.is_none() {
            match conn.open_uni().await {
                Ok(s) => stream = Some(s),
                Err(_) => return,
            }
        }
        if stream.as_mut().expect("opened").write_all(&frame).await.is_err() {
            return;
        }
    }
}

async fn accept_loop(inner: Arc<Inner>) {
    while let Some(incoming) = inner.endpoint.accept().await {
        let inner = Arc::clone(&inner);
        tokio::spawn(async move {
            let remote = incoming.remote_address();
            match incoming.await {
                Ok(conn) => read_connection(inner, conn, Arc::new(OnceLock::new())).await,
                Err(e) => {
                    bump(&inner.stats.connections_refused);
                    inner.events.record(format_args!("refused a connection from {remote}: {e}"));
                }
            }
        });
    }
}

/// Read every stream the peer opens on `conn`.
async fn read_connection(inner: Arc<Inner>, conn: Connection, who: Arc<OnceLock<PeerId>>) {
    while let Ok(recv) = conn.accept_uni().await {
        tokio::spawn(read_stream(Arc::clone(&inner), conn.clone(), Arc::clone(&who), recv));
    }
}

/// Read frames off one stream until it ends; a bad one closes the connection.
async fn read_stream(inner: Arc<Inner>, conn: Connection, who: Arc<OnceLock<PeerId>>, mut recv: RecvStream) {
    use quinn::ReadExactError;
    let refuse = |code: u32, why: String| {
        bump(&inner.stats.connections_closed);
        bump(&inner.metrics.frames_rejected);
        inner.events.record(format_args!("closing the connection from {}: {why}", conn.remote_address()));
        conn.close(VarInt::from_u32(code), why.as_bytes());
    };
    loop {
        let mut prefix = [0u8; 4];
        match recv.read_exact(&mut prefix).await {
            Ok(()) => {}
            Err(ReadExactError::FinishedEarly(0)) => return,
            Err(ReadExactError::FinishedEarly(n)) => {
                return refuse(CLOSE_BAD_FRAME, format!("stream ended inside a length prefix ({n} of 4 bytes)"))
            }
            Err(ReadExactError::ReadError(_)) => return,
        }
        let len = u32::from_le_bytes(prefix);
        // Checked before the buffer exists: a peer cannot make us allocate more than the limit.
        if len > inner.max_frame {
            let e = wire::WireError::TooLarge { len: len as u64, max: inner.max_frame };
            return refuse(CLOSE_BAD_FRAME, e.to_string());
        }
        let mut frame = vec![0u8; 4 + len as usize];
        frame[..4].copy_from_slice(&prefix);
        match recv.read_exact(&mut frame[4..]).await {
            Ok(()) => {}
            Err(ReadExactError::FinishedEarly(n)) => {
                return refuse(CLOSE_BAD_FRAME, format!("frame truncated: {} of {len} bytes", n));
            }
            Err(ReadExactError::ReadError(_)) => return,
        }
        if let Err((code, why)) = inner.accept_frame(&conn, &who, frame) {
            return refuse(code, why);
        }
    }
}

/// Heartbeats out, failure detection in: the membership machine's ticks.
async fn membership(inner: Arc<Inner>) {
    loop {
        let wait = lock(&inner.membership).next_tick().saturating_sub(inner.clock.now());
        inner.clock.sleep(wait).await;
        if inner.closed.load(Ordering::Relaxed) {
            return;
        }
        let tick = lock(&inner.membership).tick(inner.clock.now());
        for n in tick.heartbeats {
            inner.send_heartbeat(Addr::node(n));
        }
        for e in tick.events {
            inner.publish(e);
        }
    }
}

impl Transport for QuicTransport {
    fn bind(&self, addr: Addr) -> Inbox {
        let (tx, rx) = mpsc::channel(DEFAULT_QUEUE);
        if let Some(routes) = lock(&self.inner.local).as_mut() {
            routes.insert(addr, tx);
        }
        Inbox::new(rx)
    }

    fn send(&self, from: Addr, to: Addr, frame: Vec<u8>) -> Result<(), TransportError> {
        if self.inner.closed.load(Ordering::Relaxed) {
            return Err(TransportError::Shutdown);
        }
        if frame.len() > 4 + self.inner.max_frame as usize {
            return Err(TransportError::Rejected(wire::WireError::TooLarge {
                len: frame.len() as u64,
                max: self.inner.max_frame,
            }));
        }
        if self.inner.is_local(to) {
            bump(&self.inner.metrics.frames_sent);
            return self.inner.deliver_local(from, to, frame);
        }
        self.inner.route(to, frame)
    }

    fn close(&self) {
        if self.inner.closed.swap(true, Ordering::Relaxed) {
            return;
        }
        *lock(&self.inner.local) = None;
        self.inner.endpoint.close(VarInt::from_u32(CLOSE_SHUTDOWN), b"shutdown");
        for t in lock(&self.inner.tasks).drain(..) {
            t.abort();
        }
        for (_, l) in std::mem::take(&mut *lock(&self.inner.clients)) {
            l.tasks.iter().for_each(JoinHandle::abort);
        }
    }

    fn name(&self) -> &'static str {
        "quic"
    }
}
