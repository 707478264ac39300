//! rkyv frames over QUIC (the cluster's transport) and over plain TCP
//! (tokio), on loopback: one-way throughput and round-trip latency for a
//! control-sized frame and a dispatch-sized one (1 MiB body, the size of 128
//! tokens × 4096 × bf16). Both sides validate every frame with
//! `wire::decode` on receipt, as the QUIC transport does.
//!
//! `cargo bench -p deepinfer-actors --bench transport`

use std::net::{SocketAddr, UdpSocket};
use std::sync::Arc;
use std::time::{Duration, Instant};

use deepinfer_actors::net::quic::{Member, NodeAddr, QuicConfig, QuicTransport};
use deepinfer_actors::net::tls::Ca;
use deepinfer_actors::net::transport::{Inbox, Transport};
use deepinfer_actors::sim::clock::{Clock, RealClock};
use deepinfer_actors::sim::events::{EventLog, Metrics};
use deepinfer_actors::wire::{self, Addr, Control, DispatchHeader, Envelope, ExpertRows, Message, Role};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const DISPATCH_FLOATS: usize = 1 << 18; // 1 MiB of f32

fn control_frame(from: Addr, to: Addr) -> Vec<u8> {
    wire::encode(&Envelope { from, to, msg: Message::Control(Control::Ping { nonce: 1 }) }, &[]).unwrap()
}

fn dispatch_frame(from: Addr, to: Addr) -> Vec<u8> {
    let body = vec![0.5f32; DISPATCH_FLOATS];
    let msg = Message::Dispatch(DispatchHeader {
        pass: 1,
        step: 1,
        layer: 0,
        part: 0,
        worker: from.index,
        epoch: 0,
        experts: vec![ExpertRows { expert: 0, rows: 128 }],
    });
    wire::encode(&Envelope { from, to, msg }, &body).unwrap()
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn report(what: &str, mut rtts: Vec<Duration>) {
    rtts.sort();
    println!(
        "{what:<34} round trip p50 {:>8.1} µs  p99 {:>8.1} µs  ({} samples)",
        percentile(&rtts, 0.5).as_secs_f64() * 1e6,
        percentile(&rtts, 0.99).as_secs_f64() * 1e6,
        rtts.len()
    );
}

fn throughput(what: &str, frames: usize, frame: usize, took: Duration) {
    let secs = took.as_secs_f64();
    println!(
        "{what:<34} {:>7.3} GB/s  {:>9.0} frames/s  ({frames} frames in {secs:.2} s)",
        (frames * frame) as f64 / secs / 1e9,
        frames as f64 / secs
    );
}

// ---- QUIC ----

struct QuicPair {
    a: Arc<QuicTransport>,
    b: Arc<QuicTransport>,
    a_in: Inbox,
    b_in: Inbox,
}

fn quic_pair() -> QuicPair {
    let ports: Vec<SocketAddr> =
        (0..2).map(|_| UdpSocket::bind("127.0.0.1:0").unwrap().local_addr().unwrap()).collect();
    let nodes: Vec<NodeAddr> =
        ports.iter().enumerate().map(|(i, &addr)| NodeAddr { name: format!("node{i}"), addr }).collect();
    let ca = Ca::generate("bench").unwrap();
    let node_of: deepinfer_actors::sim::fabric::NodeOf =
        Arc::new(|a: Addr| if a.role == Role::Client { 0 } else { a.index });
    let start = |i: u32| {
        let cfg = QuicConfig::new(
            Member::Node(i),
            nodes.clone(),
            Arc::clone(&node_of),
            ca.issue(&format!("node{i}")).unwrap(),
        );
        let clock: Arc<dyn Clock> = Arc::new(RealClock::new());
        QuicTransport::start(cfg, Arc::clone(&clock), Arc::new(EventLog::new(clock, 0)), Arc::new(Metrics::default()))
            .unwrap()
    };
    let (a, b) = (start(0), start(1));
    let (a_in, b_in) = (a.bind(Addr::worker(0)), b.bind(Addr::worker(1)));
    QuicPair { a, b, a_in, b_in }
}

async fn quic_round_trips(p: &mut QuicPair, frame: &[u8], back: &[u8], n: usize) -> Vec<Duration> {
    let mut rtts = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        while p.a.send(Addr::worker(0), Addr::worker(1), frame.to_vec()).is_err() {
            tokio::task::yield_now().await;
        }
        p.b_in.recv().await.unwrap();
        p.b.send(Addr::worker(1), Addr::worker(0), back.to_vec()).unwrap();
        p.a_in.recv().await.unwrap();
        rtts.push(t.elapsed());
    }
    rtts
}

/// At most `WINDOW` frames sent and not yet received: the receiving inbox
/// (4096 frames) drops what overflows, as a crashed actor would, so an
/// unpaced sender would lose frames instead of measuring them.
const WINDOW: usize = 1024;

async fn quic_stream(p: &mut QuicPair, frame: &[u8], n: usize) -> Duration {
    let t = Instant::now();
    let received = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let sender = {
        let a = Arc::clone(&p.a);
        let frame = frame.to_vec();
        let received = Arc::clone(&received);
        tokio::spawn(async move {
            for i in 0..n {
                while i >= received.load(std::sync::atomic::Ordering::Acquire) + WINDOW {
                    tokio::task::yield_now().await;
                }
                // Back-pressure: a full lane queue is retried, as a protocol would after a timeout.
                while a.send(Addr::worker(0), Addr::worker(1), frame.clone()).is_err() {
                    tokio::time::sleep(Duration::from_micros(50)).await;
                }
            }
        })
    };
    for i in 0..n {
        p.b_in.recv().await.unwrap();
        received.store(i + 1, std::sync::atomic::Ordering::Release);
    }
    sender.await.unwrap();
    t.elapsed()
}

// ---- TCP ----

async fn read_frame(s: &mut TcpStream) -> Vec<u8> {
    let mut prefix = [0u8; 4];
    s.read_exact(&mut prefix).await.unwrap();
    let len = u32::from_le_bytes(prefix);
    assert!(len <= wire::MAX_FRAME_BYTES);
    let mut frame = vec![0u8; 4 + len as usize];
    frame[..4].copy_from_slice(&prefix);
    s.read_exact(&mut frame[4..]).await.unwrap();
    wire::decode(&frame).expect("valid frame");
    frame
}

async fn tcp_pair() -> (TcpStream, TcpStream) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let (a, b) = tokio::join!(TcpStream::connect(addr), l.accept());
    let (a, b) = (a.unwrap(), b.unwrap().0);
    a.set_nodelay(true).unwrap();
    b.set_nodelay(true).unwrap();
    (a, b)
}

async fn tcp_round_trips(frame: &[u8], back: &[u8], n: usize) -> Vec<Duration> {
    let (mut a, mut b) = tcp_pair().await;
    let back = back.to_vec();
    let echo = tokio::spawn(async move {
        for _ in 0..n {
            read_frame(&mut b).await;
            b.write_all(&back).await.unwrap();
        }
    });
    let mut rtts = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        a.write_all(frame).await.unwrap();
        read_frame(&mut a).await;
        rtts.push(t.elapsed());
    }
    echo.await.unwrap();
    rtts
}

async fn tcp_stream(frame: &[u8], n: usize) -> Duration {
    let (mut a, mut b) = tcp_pair().await;
    let frame = frame.to_vec();
    let t = Instant::now();
    let sender = tokio::spawn(async move {
        for _ in 0..n {
            a.write_all(&frame).await.unwrap();
        }
    });
    for _ in 0..n {
        read_frame(&mut b).await;
    }
    sender.await.unwrap();
    t.elapsed()
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(async {
        let (w0, w1) = (Addr::worker(0), Addr::worker(1));
        let (ctl, ctl_back) = (control_frame(w0, w1), control_frame(w1, w0));
        let (big, big_back) = (dispatch_frame(w0, w1), dispatch_frame(w1, w0));
        println!(
            "frames: control {} bytes, dispatch {} bytes; {} CPUs",
            ctl.len(),
            big.len(),
            std::thread::available_parallelism().map_or(1, |n| n.get())
        );
        let mut q = quic_pair();
        quic_round_trips(&mut q, &ctl, &ctl_back, 200).await; // connect and warm up
        report("QUIC control frame", quic_round_trips(&mut q, &ctl, &ctl_back, 5000).await);
        report("TCP  control frame", tcp_round_trips(&ctl, &ctl_back, 5000).await);
        report("QUIC 1 MiB dispatch, control back", quic_round_trips(&mut q, &big, &ctl_back, 300).await);
        report("TCP  1 MiB dispatch, control back", tcp_round_trips(&big, &ctl_back, 300).await);
        report("QUIC 1 MiB each way", quic_round_trips(&mut q, &big, &big_back, 200).await);
        report("TCP  1 MiB each way", tcp_round_trips(&big, &big_back, 200).await);
        let n = 1000;
        throughput("QUIC 1 MiB dispatches one way", n, big.len(), quic_stream(&mut q, &big, n).await);
        throughput("TCP  1 MiB dispatches one way", n, big.len(), tcp_stream(&big, n).await);
        let n = 100_000;
        throughput("QUIC control frames one way", n, ctl.len(), quic_stream(&mut q, &ctl, n).await);
        throughput("TCP  control frames one way", n, ctl.len(), tcp_stream(&ctl, n).await);
        q.a.close();
        q.b.close();
    });
}
