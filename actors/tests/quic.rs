//! The QUIC transport on 127.0.0.1 with real connections: frames cross both
//! lanes, membership sees peers come and go, a certificate from another CA
//! is refused, and malformed, truncated or oversized frames close only the
//! connection that sent them.

use std::net::{SocketAddr, UdpSocket};
use std::sync::Arc;
use std::time::Duration;

use deepinfer_actors::net::quic::{Member, MemberEvent, NodeAddr, QuicConfig, QuicTransport};
use deepinfer_actors::net::tls::{Ca, Identity};
use deepinfer_actors::net::transport::Transport;
use deepinfer_actors::sim::clock::{Clock, RealClock};
use deepinfer_actors::sim::events::{EventLog, Metrics};
use deepinfer_actors::wire::{self, Addr, Control, DispatchHeader, Envelope, ExpertRows, Message, Role};
use tokio::time::timeout;

/// A UDP port that was free a moment ago.
fn free_port() -> SocketAddr {
    UdpSocket::bind("127.0.0.1:0").unwrap().local_addr().unwrap()
}

/// Workers and node addresses: index = node.
fn node_of() -> deepinfer_actors::sim::fabric::NodeOf {
    Arc::new(|a: Addr| if a.role == Role::Client { 0 } else { a.index })
}

struct Net {
    ca: Ca,
    nodes: Vec<NodeAddr>,
    events: Arc<EventLog>,
}

impl Net {
    fn new(n: usize) -> Self {
        let nodes = (0..n).map(|i| NodeAddr { name: format!("node{i}"), addr: free_port() }).collect();
        let clock: Arc<dyn Clock> = Arc::new(RealClock::new());
        Self { ca: Ca::generate("test").unwrap(), nodes, events: Arc::new(EventLog::new(clock, 1000)) }
    }

    fn start(&self, me: Member, identity: Identity) -> Arc<QuicTransport> {
        self.start_at(me, identity, None)
    }

    fn start_at(&self, me: Member, identity: Identity, listen: Option<SocketAddr>) -> Arc<QuicTransport> {
        let mut cfg = QuicConfig::new(me, self.nodes.clone(), node_of(), identity);
        cfg.listen = listen;
        cfg.heartbeat = Duration::from_millis(50);
        cfg.failure_timeout = Duration::from_millis(400);
        let clock: Arc<dyn Clock> = Arc::new(RealClock::new());
        QuicTransport::start(cfg, clock, Arc::clone(&self.events), Arc::new(Metrics::default())).unwrap()
    }

    fn node(&self, i: u32) -> Arc<QuicTransport> {
        self.start(Member::Node(i), self.ca.issue(&format!("node{i}")).unwrap())
    }
}

fn dispatch(from: Addr, to: Addr, rows: u32) -> (Vec<u8>, Vec<f32>) {
    let body: Vec<f32> = (0..rows * 64).map(|i| i as f32 * 0.25).collect();
    let msg = Message::Dispatch(DispatchHeader {
        pass: 1,
        step: 2,
        layer: 3,
        part: 0,
        worker: from.index,
        epoch: 0,
        experts: vec![ExpertRows { expert: 7, rows }],
    });
    (wire::encode(&Envelope { from, to, msg }, &body).unwrap(), body)
}

async fn wait_for(rx: &mut tokio::sync::mpsc::UnboundedReceiver<MemberEvent>, want: impl Fn(&MemberEvent) -> bool) {
    timeout(Duration::from_secs(10), async {
        loop {
            let e = rx.recv().await.expect("membership events");
            if want(&e) {
                return;
            }
        }
    })
    .await
    .expect("membership event in time");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frames_cross_both_lanes_and_membership_tracks_peers() {
    let net = Net::new(2);
    let a = net.node(0);
    let b = net.node(1);
    let mut a_events = a.subscribe();
    let mut inbox = b.bind(Addr::worker(1));
    // A 1 MiB dispatch on the data lane and a control frame behind it.
    let (big, body) = dispatch(Addr::worker(0), Addr::worker(1), 4096);
    a.send(Addr::worker(0), Addr::worker(1), big).unwrap();
    let ctl =
        Envelope { from: Addr::worker(0), to: Addr::worker(1), msg: Message::Control(Control::Ping { nonce: 9 }) };
    a.send(Addr::worker(0), Addr::worker(1), wire::encode(&ctl, &[]).unwrap()).unwrap();
    let mut got = Vec::new();
    for _ in 0..2 {
        let d = timeout(Duration::from_secs(10), inbox.recv()).await.unwrap().unwrap();
        assert_eq!(d.from, Addr::worker(0));
        got.push(wire::decode(&d.frame).unwrap());
    }
    got.sort_by_key(|d| d.kind() as u8);
    assert!(matches!(got[0].envelope.msg, Message::Dispatch(_)));
    assert_eq!(got[0].body, body);
    assert_eq!(got[1].envelope, ctl);

    wait_for(&mut a_events, |e| *e == MemberEvent::Up { node: 1 }).await;
    assert_eq!(a.nodes_up(), vec![0, 1]);
    b.close();
    wait_for(
        &mut a_events,
        |e| matches!(e, MemberEvent::Down { node: 1, silent } if *silent > Duration::from_millis(400)),
    )
    .await;
    assert_eq!(a.nodes_up(), vec![0]);

    // Node 1 comes back on the same address: node 0 dials it again (with
    // backoff), hears it, and frames flow again.
    drop((b, inbox));
    let b = loop {
        let mut cfg = QuicConfig::new(Member::Node(1), net.nodes.clone(), node_of(), net.ca.issue("node1").unwrap());
        cfg.heartbeat = Duration::from_millis(50);
        let clock: Arc<dyn Clock> = Arc::new(RealClock::new());
        match QuicTransport::start(cfg, clock, Arc::clone(&net.events), Arc::new(Metrics::default())) {
            Ok(t) => break t,
            // The closed endpoint's socket is released when its last task ends.
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    };
    let mut inbox = b.bind(Addr::worker(1));
    wait_for(&mut a_events, |e| *e == MemberEvent::Up { node: 1 }).await;
    a.send(Addr::worker(0), Addr::worker(1), wire::encode(&ctl, &[]).unwrap()).unwrap();
    let d = timeout(Duration::from_secs(10), inbox.recv()).await.unwrap().unwrap();
    assert_eq!(wire::decode(&d.frame).unwrap().envelope, ctl);
    a.close();
    b.close();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_from_another_ca_is_refused() {
    let net = Net::new(2);
    let a = net.node(0);
    let mut inbox = a.bind(Addr::worker(0));
    // Node 1's name, signed by a CA the cluster does not know.
    let rogue_ca = Ca::generate("rogue").unwrap();
    let mut rogue_id = rogue_ca.issue("node1").unwrap();
    rogue_id.ca = net.ca.issue("node1").unwrap().ca; // it trusts the cluster CA, but is not trusted by it
    let rogue = net.start_at(Member::Node(1), rogue_id, Some(free_port()));
    let (frame, _) = dispatch(Addr::worker(1), Addr::worker(0), 1);
    rogue.send(Addr::worker(1), Addr::worker(0), frame).unwrap();
    timeout(Duration::from_secs(10), async {
        while a.stats().connections_refused.load(std::sync::atomic::Ordering::Relaxed) == 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the handshake is refused");
    assert!(timeout(Duration::from_millis(300), inbox.recv()).await.is_err(), "nothing from the rogue node arrives");
    rogue.close();

    // The node is still up: the real node 1 gets through.
    let b = net.node(1);
    let (frame, _) = dispatch(Addr::worker(1), Addr::worker(0), 1);
    b.send(Addr::worker(1), Addr::worker(0), frame).unwrap();
    let d = timeout(Duration::from_secs(10), inbox.recv()).await.unwrap().unwrap();
    assert_eq!(d.from, Addr::worker(1));
    let log = net.events.lines().join("\n");
    assert!(log.contains("refused a connection"), "{log}");
    a.close();
    b.close();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_frames_close_only_their_connection() {
    let net = Net::new(2);
    let a = net.node(0);
    let mut inbox = a.bind(Addr::worker(0));
    let b = net.node(1);
    let (good, _) = dispatch(Addr::worker(1), Addr::worker(0), 2);
    let mut garbage = good.clone();
    garbage[4] ^= 0xff; // bad magic
    let truncated = good[..good.len() - 5].to_vec();
    let oversized = [u32::MAX.to_le_bytes().to_vec(), vec![0; 64]].concat();
    let (spoofed, _) = dispatch(Addr::worker(0), Addr::worker(0), 1); // node 1 claiming to be node 0's worker
    let (elsewhere, _) = dispatch(Addr::worker(1), Addr::worker(1), 1); // for an address not on node 0
    let cases = [
        ("malformed", garbage, "bad magic"),
        ("truncated", truncated, "truncated"),
        ("oversized", oversized, "exceeds"),
        ("spoofed sender", spoofed, "worker0"),
        ("misrouted", elsewhere, "not here"),
    ];
    for (i, (what, bytes, reason)) in cases.into_iter().enumerate() {
        b.send_raw(0, &bytes).await.unwrap();
        let closed = timeout(Duration::from_secs(10), b.connection_closed(0)).await.unwrap().unwrap();
        assert!(closed.contains(reason), "{what}: {closed}");
        let n = a.stats().connections_closed.load(std::sync::atomic::Ordering::Relaxed);
        assert_eq!(n, i as u64 + 1, "{what}");
        // The node stays up and the sender reconnects: a good frame arrives.
        b.send(Addr::worker(1), Addr::worker(0), good.clone()).unwrap();
        let d = timeout(Duration::from_secs(10), inbox.recv()).await.unwrap().unwrap();
        assert_eq!(d.frame, good, "{what}");
    }
    a.close();
    b.close();
}
