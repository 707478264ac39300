//! The router's requests in flight, with the per-instance sums its
//! balancers read kept up to date as flights change, so that routing a
//! request does not walk every request in flight.
//!
//! Every change goes through [`FlightTable::get_mut`] (or insert and
//! remove); the guard compares the flight's share of the sums before and
//! after and moves it if it changed. Counts and KV bytes are integers. The
//! queued prefill cost of an instance is the floating-point sum, in id
//! order, of its unstarted flights' costs, exactly as a walk would add them:
//! a flight appended after the highest id extends the sum; any other change
//! has it added up again, once, when next read.

use std::collections::BTreeMap;

use deepinfer_engine::balance::prefill_cost;
use deepinfer_engine::kv_pool::KvLayout;

use super::Flight;

/// Requests and KV bytes a decode balancer sees on one instance.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct DecodeLoad {
    pub requests: u64,
    pub kv_bytes: u64,
}

/// What one flight adds to the sums.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Share {
    instance: u32,
    decodes_on: u32,
    kv_bytes: u64,
    /// Its prefill cost while it has no token yet.
    queued: Option<f64>,
}

/// An instance's unstarted flights and their cost, summed in id order.
#[derive(Default)]
struct Queue {
    costs: BTreeMap<u64, f64>,
    sum: f64,
    /// `sum` must be added up again.
    stale: bool,
}

pub(super) struct FlightTable {
    flights: BTreeMap<u64, Flight>,
    /// Flights per instance they are routed to (`Flight::instance`).
    routed: BTreeMap<u32, u64>,
    queues: BTreeMap<u32, Queue>,
    /// Per instance that decodes them (`decode`, else `instance`).
    decoding: BTreeMap<u32, DecodeLoad>,
    layout: Option<KvLayout>,
    attention_tokens: f64,
}

impl FlightTable {
    /// `attention_tokens`: the prefill balancer's (`PrefillPolicy::attention_tokens`).
    pub fn new(layout: Option<KvLayout>, attention_tokens: f64) -> Self {
        Self {
            flights: BTreeMap::new(),
            routed: BTreeMap::new(),
            queues: BTreeMap::new(),
            decoding: BTreeMap::new(),
            layout,
            attention_tokens,
        }
    }

    fn share(&self, f: &Flight) -> Share {
        let tokens = f.spec.prompt.len() + f.tokens.len();
        let queued = f.tokens.is_empty().then(|| {
            let prompt = f.spec.prompt.len();
            let cached = f.cached_tokens.min(prompt.saturating_sub(1));
            prefill_cost(prompt - cached, cached, self.attention_tokens)
        });
        Share {
            instance: f.instance,
            decodes_on: f.decode.unwrap_or(f.instance),
            kv_bytes: self.layout.as_ref().map_or(0, |l| l.sequence_bytes(tokens)) as u64,
            queued,
        }
    }

    fn add(&mut self, id: u64, s: Share) {
        *self.routed.entry(s.instance).or_default() += 1;
        let load = self.decoding.entry(s.decodes_on).or_default();
        load.requests += 1;
        load.kv_bytes += s.kv_bytes;
        if let Some(cost) = s.queued {
            let q = self.queues.entry(s.instance).or_default();
            let appended = q.costs.last_key_value().is_none_or(|(&last, _)| last < id);
            if appended && !q.stale {
                q.sum += cost;
            } else {
                q.stale = true;
            }
            q.costs.insert(id, cost);
        }
    }

    fn take(&mut self, id: u64, s: Share) {
        *self.routed.get_mut(&s.instance).expect("counted") -= 1;
        let load = self.decoding.get_mut(&s.decodes_on).expect("counted");
        load.requests -= 1;
        load.kv_bytes -= s.kv_bytes;
        if s.queued.is_some() {
            let q = self.queues.get_mut(&s.instance).expect("queued");
            q.costs.remove(&id);
            q.stale = true;
        }
    }

    pub fn insert(&mut self, id: u64, f: Flight) {
        self.remove(id);
        let s = self.share(&f);
        self.add(id, s);
        self.flights.insert(id, f);
    }

    pub fn remove(&mut self, id: u64) -> Option<Flight> {
        let f = self.flights.remove(&id)?;
        let s = self.share(&f);
        self.take(id, s);
        Some(f)
    }

    /// Flight `id` to change; its share of the sums follows when the guard drops.
    pub fn get_mut(&mut self, id: &u64) -> Option<FlightMut<'_>> {
        let f = self.flights.remove(id)?;
        let before = self.share(&f);
        Some(FlightMut { table: self, id: *id, before, flight: Some(f) })
    }

    pub fn get(&self, id: &u64) -> Option<&Flight> {
        self.flights.get(id)
    }

    pub fn contains_key(&self, id: &u64) -> bool {
        self.flights.contains_key(id)
    }

    pub fn len(&self) -> usize {
        self.flights.len()
    }

    pub fn iter(&self) -> impl Iterator<Item = (&u64, &Flight)> {
        self.flights.iter()
    }

    /// Flights routed to `instance`.
    pub fn routed_to(&self, instance: u32) -> u64 {
        self.routed.get(&instance).copied().unwrap_or(0)
    }

    /// The prefill cost of `instance`'s flights with no token yet, added in id order.
    pub fn queued_cost(&mut self, instance: u32) -> f64 {
        let Some(q) = self.queues.get_mut(&instance) else { return 0.0 };
        if q.stale {
            q.sum = q.costs.values().fold(0.0, |sum, c| sum + c);
            q.stale = false;
        }
        q.sum
    }

    pub fn decode_load(&self, instance: u32) -> DecodeLoad {
        self.decoding.get(&instance).copied().unwrap_or_default()
    }

    /// The sums against a recount from the flights themselves.
    pub fn check(&mut self) {
        let mut recount = FlightTable::new(self.layout.clone(), self.attention_tokens);
        for (&id, f) in &self.flights {
            let s = recount.share(f);
            recount.add(id, s);
        }
        let counts = |m: &BTreeMap<u32, u64>| m.iter().filter(|e| *e.1 > 0).map(|(k, v)| (*k, *v)).collect::<Vec<_>>();
        assert_eq!(counts(&self.routed), counts(&recount.routed), "flights per instance out of step");
        let loads = |m: &BTreeMap<u32, DecodeLoad>| {
            m.iter().filter(|e| e.1.requests > 0).map(|(k, v)| (*k, *v)).collect::<Vec<_>>()
        };
        assert_eq!(loads(&self.decoding), loads(&recount.decoding), "decode loads out of step");
        let instances: Vec<u32> = self.queues.keys().chain(recount.queues.keys()).copied().collect();
        for i in instances {
            let (mine, theirs) = (self.queued_cost(i), recount.queued_cost(i));
            assert_eq!(mine.to_bits(), theirs.to_bits(), "queued prefill cost of instance {i} out of step");
        }
    }
}

/// A flight being changed (see [`FlightTable::get_mut`]).
pub(super) struct FlightMut<'a> {
    table: &'a mut FlightTable,
    id: u64,
    before: Share,
    flight: Option<Flight>,
}

impl std::ops::Deref for FlightMut<'_> {
    type Target = Flight;
    fn deref(&self) -> &Flight {
        self.flight.as_ref().expect("held until dropped")
    }
}

impl std::ops::DerefMut for FlightMut<'_> {
    fn deref_mut(&mut self) -> &mut Flight {
        self.flight.as_mut().expect("held until dropped")
    }
}

impl Drop for FlightMut<'_> {
    fn drop(&mut self) {
        let f = self.flight.take().expect("dropped once");
        let after = self.table.share(&f);
        if after != self.before {
            self.table.take(self.id, self.before);
            self.table.add(self.id, after);
        }
        self.table.flights.insert(self.id, f);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::proto::test_spec;
    use crate::wire::Addr;

    fn flight(prompt: usize, instance: u32) -> Flight {
        Flight {
            spec: test_spec(0, vec![3; prompt], 8),
            instance,
            cached_tokens: prompt / 3,
            decode: None,
            encoder: None,
            prefilled_on: None,
            tokens: Vec::new(),
            client: Addr::client(0),
            cancelled: false,
            attempts: 0,
            deadline: Duration::ZERO,
        }
    }

    /// Inserts (in and out of id order), tokens, moves to another instance,
    /// handoffs and removals in a seeded order: after each, every sum equals
    /// a recount, the queued cost to the bit.
    #[test]
    fn the_sums_follow_every_change_exactly() {
        let mut t = FlightTable::new(None, 8192.0);
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move |n: u64| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state % n
        };
        let mut ids: Vec<u64> = Vec::new();
        for step in 0..2000u64 {
            match next(6) {
                0 | 1 => {
                    // Mostly increasing ids (appended), sometimes an old one again.
                    let id = if next(4) == 0 { next(step + 1) } else { step * 2 };
                    t.insert(id, flight(1 + next(5000) as usize, next(3) as u32));
                    ids.push(id);
                }
                2 if !ids.is_empty() => {
                    let id = ids[next(ids.len() as u64) as usize];
                    if let Some(mut f) = t.get_mut(&id) {
                        f.tokens.push(7);
                    }
                }
                3 if !ids.is_empty() => {
                    let id = ids[next(ids.len() as u64) as usize];
                    if let Some(mut f) = t.get_mut(&id) {
                        f.instance = next(3) as u32;
                        f.decode = (next(2) == 0).then_some(2);
                    }
                }
                4 if !ids.is_empty() => {
                    let id = ids.swap_remove(next(ids.len() as u64) as usize);
                    t.remove(id);
                }
                _ => {
                    for i in 0..3 {
                        let _ = t.queued_cost(i);
                    }
                }
            }
            t.check();
        }
        assert!(t.len() > 100, "the table was exercised: {} flights", t.len());
    }
}
