//! Membership: which nodes are alive, from heartbeats alone, sans-IO. The
//! same machine runs inside the QUIC transport (`crate::net::quic`) and as the
//! `Member` actor of each node of a simulated cluster, where its heartbeats
//! cross the simulated fabric with its latencies, drops and partitions.
//!
//! Every `heartbeat` a member sends a heartbeat to every other node. A peer
//! heard from is up; a peer that was up and is silent for longer than
//! `failure_timeout` is down (reported once, with how long it was silent),
//! and up again when heard from. A client also reports a node it has not
//! heard from at all within `failure_timeout` of starting; a node waits
//! `startup_grace` for such a peer (nodes start in any order, and loading a
//! model takes a while), so that a node started while another is dead does
//! not hold the dead one up for ever. A heartbeat names its sender's process
//! (an id each start draws anew): a node up under another process id than
//! before restarted faster than the failure timeout, and is reported down
//! and up again, since everything its old process held is gone.

use std::time::Duration;

/// Who runs the machine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Member {
    Node(u32),
    Client(u32),
}

/// What membership reports about a node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MemberEvent {
    Up {
        node: u32,
    },
    /// Nothing heard for `silent` (more than the failure timeout).
    Down {
        node: u32,
        silent: Duration,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MembershipConfig {
    pub heartbeat: Duration,
    pub failure_timeout: Duration,
    /// How long a node waits for a peer it has never heard from before
    /// declaring it down (at least `failure_timeout`).
    pub startup_grace: Duration,
}

impl MembershipConfig {
    /// For wall time between machines.
    pub fn real() -> Self {
        Self {
            heartbeat: Duration::from_millis(200),
            failure_timeout: Duration::from_secs(3),
            startup_grace: Duration::from_secs(60),
        }
    }

    /// For the virtual clock: many heartbeats per failure timeout, and a
    /// timeout well above the simulated links' latency.
    pub fn simulated() -> Self {
        Self {
            heartbeat: Duration::from_millis(20),
            failure_timeout: Duration::from_millis(200),
            startup_grace: Duration::from_secs(2),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PeerState {
    Unknown,
    Up,
    Down,
}

#[derive(Clone, Copy, Debug)]
struct Peer {
    /// When a heartbeat (or any valid frame) last came from it.
    heard: Option<Duration>,
    state: PeerState,
    /// The process its heartbeats last named (0: none named yet).
    process: u64,
}

/// What one tick asks for.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Tick {
    /// Nodes to send a heartbeat to, ascending.
    pub heartbeats: Vec<u32>,
    pub events: Vec<MemberEvent>,
}

pub struct Membership {
    me: Member,
    config: MembershipConfig,
    started: Duration,
    peers: Vec<Peer>,
    last_tick: Duration,
}

impl Membership {
    /// A member of a cluster of `nodes` nodes, starting at `now`.
    pub fn new(now: Duration, me: Member, nodes: u32, config: MembershipConfig) -> Self {
        assert!(config.heartbeat > Duration::ZERO, "a heartbeat period");
        let peers = vec![Peer { heard: None, state: PeerState::Unknown, process: 0 }; nodes as usize];
        Self { me, config, started: now, peers, last_tick: now }
    }

    pub fn config(&self) -> MembershipConfig {
        self.config
    }

    /// When the next tick is due.
    pub fn next_tick(&self) -> Duration {
        self.last_tick + self.config.heartbeat
    }

    /// Something valid came from `node` at `now`: `Up` if it was not up.
    pub fn heard(&mut self, now: Duration, node: u32) -> Option<MemberEvent> {
        let peer = self.peers.get_mut(node as usize)?;
        peer.heard = Some(peer.heard.map_or(now, |h| h.max(now)));
        (std::mem::replace(&mut peer.state, PeerState::Up) != PeerState::Up).then_some(MemberEvent::Up { node })
    }

    /// A heartbeat of `node`'s process `process` (0: unnamed) at `now`: as
    /// [`Self::heard`], and a node that was up under another process is
    /// reported down first (it restarted faster than the failure timeout).
    pub fn heard_process(&mut self, now: Duration, node: u32, process: u64) -> Vec<MemberEvent> {
        let Some(peer) = self.peers.get_mut(node as usize) else { return Vec::new() };
        let mut events = Vec::new();
        // Ids grow with each start: a lower one is a late heartbeat of a process that is gone.
        if process != 0 && process >= peer.process {
            let before = std::mem::replace(&mut peer.process, process);
            if before != 0 && before != process && peer.state == PeerState::Up {
                peer.state = PeerState::Down;
                let silent = peer.heard.map_or(Duration::ZERO, |h| now.saturating_sub(h));
                events.push(MemberEvent::Down { node, silent });
            }
        }
        events.extend(self.heard(now, node));
        events
    }

    /// Heartbeats to send and nodes found silent at `now`.
    pub fn tick(&mut self, now: Duration) -> Tick {
        assert!(now >= self.last_tick, "time went backwards");
        self.last_tick = now;
        let mut out = Tick::default();
        let timeout = self.config.failure_timeout;
        let waited = now.saturating_sub(self.started);
        for (n, peer) in self.peers.iter_mut().enumerate() {
            let node = n as u32;
            if self.me == Member::Node(node) {
                continue;
            }
            out.heartbeats.push(node);
            match (peer.state, peer.heard) {
                (PeerState::Up, Some(heard)) if now.saturating_sub(heard) > timeout => {
                    peer.state = PeerState::Down;
                    // Whichever process speaks next is news already: its id is not a restart.
                    peer.process = 0;
                    out.events.push(MemberEvent::Down { node, silent: now - heard });
                }
                // A client needs the cluster now: a node never heard from is down
                // too; a node gives its peers the startup grace first.
                (PeerState::Unknown, None)
                    if waited
                        > match self.me {
                            Member::Client(_) => timeout,
                            Member::Node(_) => self.config.startup_grace.max(timeout),
                        } =>
                {
                    peer.state = PeerState::Down;
                    out.events.push(MemberEvent::Down { node, silent: waited });
                }
                _ => {}
            }
        }
        out
    }

    /// Nodes up but silent for more than half the failure timeout: about to
    /// be declared down. A node deciding whether it is in a minority counts
    /// them, so that peers declared one tick apart do not look like a majority.
    pub fn suspects(&self, now: Duration) -> std::collections::BTreeSet<u32> {
        let half = self.config.failure_timeout / 2;
        (0..self.peers.len() as u32)
            .filter(|&n| self.me != Member::Node(n))
            .filter(|&n| {
                let p = &self.peers[n as usize];
                p.state == PeerState::Up && p.heard.is_some_and(|h| now.saturating_sub(h) > half)
            })
            .collect()
    }

    /// How long ago `node` was last heard from, if ever.
    pub fn heard_ago(&self, now: Duration, node: u32) -> Option<Duration> {
        self.peers.get(node as usize)?.heard.map(|h| now.saturating_sub(h))
    }

    /// Nodes heard from and not since declared down (this member's own node included).
    pub fn nodes_up(&self) -> Vec<u32> {
        (0..self.peers.len() as u32)
            .filter(|&n| self.me == Member::Node(n) || self.peers[n as usize].state == PeerState::Up)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn config() -> MembershipConfig {
        MembershipConfig { heartbeat: ms(10), failure_timeout: ms(50), startup_grace: ms(500) }
    }

    #[test]
    fn a_peer_heard_from_a_new_process_is_down_and_up_again() {
        let mut m = Membership::new(ms(0), Member::Node(0), 3, config());
        assert_eq!(m.heard_process(ms(1), 1, 7), vec![MemberEvent::Up { node: 1 }]);
        assert_eq!(m.heard_process(ms(5), 1, 7), vec![], "the same process");
        assert_eq!(m.heard(ms(6), 1), None, "any frame");
        assert_eq!(
            m.heard_process(ms(9), 1, 8),
            vec![MemberEvent::Down { node: 1, silent: ms(3) }, MemberEvent::Up { node: 1 }],
            "restarted within the failure timeout"
        );
        assert_eq!(m.heard_process(ms(10), 1, 0), vec![], "an unnamed process changes nothing");
        assert_eq!(m.heard_process(ms(11), 1, 7), vec![], "a late heartbeat of the process that is gone");
        // Declared down, then back under a new process whose first frame
        // is not a heartbeat: up once, and its first heartbeat is no restart.
        let down = m.tick(ms(100));
        assert_eq!(down.events, vec![MemberEvent::Down { node: 1, silent: ms(89) }]);
        assert_eq!(m.heard(ms(101), 1), Some(MemberEvent::Up { node: 1 }));
        assert_eq!(m.heard_process(ms(102), 1, 9), vec![], "the new process was already news");
    }

    #[test]
    fn a_silent_peer_is_down_once_and_up_again_when_heard() {
        let mut m = Membership::new(ms(0), Member::Node(0), 3, config());
        assert_eq!(m.heard(ms(1), 1), Some(MemberEvent::Up { node: 1 }));
        assert_eq!(m.heard(ms(2), 1), None, "already up");
        assert_eq!(m.heard(ms(2), 2), Some(MemberEvent::Up { node: 2 }));
        let mut now = ms(0);
        let mut downs = Vec::new();
        while now < ms(200) {
            now += ms(10);
            // Node 2 keeps talking; node 1 went quiet at 1 ms.
            m.heard(now, 2);
            let t = m.tick(now);
            assert_eq!(t.heartbeats, vec![1, 2], "never to itself");
            downs.extend(t.events.into_iter().map(|e| (now, e)));
        }
        assert_eq!(downs, vec![(ms(60), MemberEvent::Down { node: 1, silent: ms(58) })], "last heard at 2 ms");
        assert_eq!(m.nodes_up(), vec![0, 2]);
        assert_eq!(m.heard(ms(201), 1), Some(MemberEvent::Up { node: 1 }));
        assert_eq!(m.nodes_up(), vec![0, 1, 2]);
    }

    #[test]
    fn nodes_wait_for_peers_that_never_spoke_and_clients_do_not() {
        let mut node = Membership::new(ms(0), Member::Node(0), 2, config());
        let mut client = Membership::new(ms(0), Member::Client(0), 2, config());
        let mut client_events = Vec::new();
        for k in 1..=20 {
            assert!(node.tick(ms(10 * k)).events.is_empty(), "a node starts in any order");
            client_events.extend(client.tick(ms(10 * k)).events);
        }
        assert_eq!(
            client_events,
            vec![MemberEvent::Down { node: 0, silent: ms(60) }, MemberEvent::Down { node: 1, silent: ms(60) }]
        );
        // Past the startup grace a node gives up on a peer it never heard (and hears it later).
        let mut events = Vec::new();
        for k in 21..=60 {
            events.extend(node.tick(ms(10 * k)).events.into_iter().map(|e| (ms(10 * k), e)));
        }
        assert_eq!(events, vec![(ms(510), MemberEvent::Down { node: 1, silent: ms(510) })]);
        assert_eq!(node.heard(ms(700), 1), Some(MemberEvent::Up { node: 1 }));
    }

    #[test]
    fn a_late_or_reordered_heartbeat_never_moves_time_back() {
        let mut m = Membership::new(ms(0), Member::Node(0), 2, config());
        m.heard(ms(40), 1);
        m.heard(ms(5), 1);
        assert!(m.tick(ms(80)).events.is_empty(), "silent for 40 ms, not 75");
        assert_eq!(m.tick(ms(100)).events, vec![MemberEvent::Down { node: 1, silent: ms(60) }]);
        assert_eq!(m.heard(ms(7), 9), None, "no such node");
    }
}
