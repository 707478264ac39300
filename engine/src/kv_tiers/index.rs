//! A tier's index: blocks by key, each with a byte size and an expiry;
//! bounded in bytes, the least recently used evicted first, expired blocks
//! never served. Sans-IO and generic over what a block holds, so the host
//! tier (block values), the disk tier (file sizes) and the simulator's
//! modelled tiers (nothing) share one policy.

use std::collections::{BTreeMap, BTreeSet};

/// Why a block left a tier.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Departure {
    /// Room was needed (least recently used first).
    Evicted,
    /// Its TTL ran out.
    Expired,
    /// Taken by the caller (moved to another tier, or dropped).
    Taken,
}

/// A block that left a tier, with what it held.
#[derive(Debug)]
pub struct Removed<V> {
    pub key: u64,
    pub parent: u64,
    pub tokens: Box<[u32]>,
    pub bytes: usize,
    pub expires_at_ms: u64,
    pub value: V,
    pub why: Departure,
}

/// Counters of one tier.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TierStats {
    /// Blocks served from this tier (lookups that found a live block).
    pub hit_blocks: u64,
    /// Lookups that found nothing live.
    pub miss_blocks: u64,
    pub inserted_blocks: u64,
    pub evicted_blocks: u64,
    pub expired_blocks: u64,
    /// Offered blocks larger than the whole tier.
    pub refused_blocks: u64,
}

#[derive(Debug)]
struct Slot<V> {
    parent: u64,
    tokens: Box<[u32]>,
    bytes: usize,
    expires_at_ms: u64,
    stamp: u64,
    value: V,
}

/// Blocks of one tier. Every decision (what to evict, what has expired)
/// walks ordered maps, so it is the same on every run.
#[derive(Debug)]
pub struct TierIndex<V> {
    slots: BTreeMap<u64, Slot<V>>,
    /// Use order: the first is the least recently used.
    lru: BTreeMap<u64, u64>,
    /// (expiry, key): the first expires first.
    expiry: BTreeSet<(u64, u64)>,
    stamp: u64,
    used_bytes: usize,
    capacity_bytes: usize,
    pub stats: TierStats,
}

impl<V> TierIndex<V> {
    pub fn new(capacity_bytes: usize) -> Self {
        Self {
            slots: BTreeMap::new(),
            lru: BTreeMap::new(),
            expiry: BTreeSet::new(),
            stamp: 0,
            used_bytes: 0,
            capacity_bytes,
            stats: TierStats::default(),
        }
    }

    pub fn capacity_bytes(&self) -> usize {
        self.capacity_bytes
    }

    pub fn used_bytes(&self) -> usize {
        self.used_bytes
    }

    pub fn len(&self) -> usize {
        self.slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    pub fn contains(&self, key: u64) -> bool {
        self.slots.contains_key(&key)
    }

    /// A block's parent key, tokens and value, live or not, without touching it.
    pub fn get(&self, key: u64) -> Option<(u64, &[u32], &V)> {
        self.slots.get(&key).map(|s| (s.parent, &*s.tokens, &s.value))
    }

    /// A block's value, to update what it records (not its size).
    pub fn value_mut(&mut self, key: u64) -> Option<&mut V> {
        self.slots.get_mut(&key).map(|s| &mut s.value)
    }

    /// Every block's key and parent key, in key order.
    pub fn keys(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.slots.iter().map(|(k, s)| (*k, s.parent))
    }

    fn next_stamp(&mut self) -> u64 {
        self.stamp += 1;
        self.stamp
    }

    /// Whether `key` holds `tokens` after `parent` and is live at `now_ms`.
    fn live(&self, now_ms: u64, key: u64, parent: u64, tokens: &[u32]) -> bool {
        self.slots.get(&key).is_some_and(|s| s.parent == parent && *s.tokens == *tokens && s.expires_at_ms > now_ms)
    }

    /// Look a block up without counting or touching it.
    pub fn peek(&self, now_ms: u64, key: u64, parent: u64, tokens: &[u32]) -> Option<&V> {
        self.live(now_ms, key, parent, tokens).then(|| &self.slots[&key].value)
    }

    /// Look a block up as a use: counted, made the most recently used, and
    /// its expiry pushed to at least `keep_until_ms` (a hit refreshes the TTL).
    pub fn hit(&mut self, now_ms: u64, key: u64, parent: u64, tokens: &[u32], keep_until_ms: u64) -> Option<&V> {
        if !self.live(now_ms, key, parent, tokens) {
            self.stats.miss_blocks += 1;
            return None;
        }
        self.stats.hit_blocks += 1;
        let stamp = self.next_stamp();
        let slot = self.slots.get_mut(&key).expect("live");
        self.lru.remove(&slot.stamp);
        slot.stamp = stamp;
        self.lru.insert(stamp, key);
        if keep_until_ms > slot.expires_at_ms {
            self.expiry.remove(&(slot.expires_at_ms, key));
            slot.expires_at_ms = keep_until_ms;
            self.expiry.insert((keep_until_ms, key));
        }
        Some(&self.slots[&key].value)
    }

    /// Add a block as the most recently used, evicting the least recently
    /// used ones while the tier is over its bytes; expired blocks go first.
    /// A key already present keeps its value and has its expiry extended. A
    /// block larger than the tier is refused and handed back.
    #[allow(clippy::too_many_arguments)]
    pub fn insert(
        &mut self,
        now_ms: u64,
        key: u64,
        parent: u64,
        tokens: &[u32],
        bytes: usize,
        expires_at_ms: u64,
        value: V,
    ) -> Result<Vec<Removed<V>>, V> {
        let mut removed = self.expire(now_ms);
        if let Some(slot) = self.slots.get_mut(&key) {
            if expires_at_ms > slot.expires_at_ms && slot.parent == parent && *slot.tokens == *tokens {
                self.expiry.remove(&(slot.expires_at_ms, key));
                slot.expires_at_ms = expires_at_ms;
                self.expiry.insert((expires_at_ms, key));
            }
            return Ok(removed);
        }
        if bytes > self.capacity_bytes || expires_at_ms <= now_ms {
            self.stats.refused_blocks += 1;
            return Err(value);
        }
        while self.used_bytes + bytes > self.capacity_bytes {
            let (_, victim) = self.lru.first_key_value().map(|(s, k)| (*s, *k)).expect("over capacity means non-empty");
            removed.push(self.remove(victim, Departure::Evicted).expect("lru and slots agree"));
        }
        let stamp = self.next_stamp();
        self.lru.insert(stamp, key);
        self.expiry.insert((expires_at_ms, key));
        self.used_bytes += bytes;
        self.stats.inserted_blocks += 1;
        self.slots.insert(key, Slot { parent, tokens: tokens.into(), bytes, expires_at_ms, stamp, value });
        debug_assert!(self.used_bytes <= self.capacity_bytes);
        Ok(removed)
    }

    /// Remove every block whose expiry is at or before `now_ms`.
    pub fn expire(&mut self, now_ms: u64) -> Vec<Removed<V>> {
        let mut removed = Vec::new();
        while let Some(&(at, key)) = self.expiry.first() {
            if at > now_ms {
                break;
            }
            removed.push(self.remove(key, Departure::Expired).expect("expiry and slots agree"));
        }
        removed
    }

    /// Take a block out (to move it to another tier, or because its backing is gone).
    pub fn take(&mut self, key: u64) -> Option<Removed<V>> {
        self.remove(key, Departure::Taken)
    }

    fn remove(&mut self, key: u64, why: Departure) -> Option<Removed<V>> {
        let slot = self.slots.remove(&key)?;
        self.lru.remove(&slot.stamp);
        self.expiry.remove(&(slot.expires_at_ms, key));
        self.used_bytes -= slot.bytes;
        match why {
            Departure::Evicted => self.stats.evicted_blocks += 1,
            Departure::Expired => self.stats.expired_blocks += 1,
            Departure::Taken => {}
        }
        Some(Removed {
            key,
            parent: slot.parent,
            tokens: slot.tokens,
            bytes: slot.bytes,
            expires_at_ms: slot.expires_at_ms,
            value: slot.value,
            why,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys<V>(removed: &[Removed<V>]) -> Vec<(u64, Departure)> {
        removed.iter().map(|r| (r.key, r.why)).collect()
    }

    #[test]
    fn evicts_least_recently_used_within_bytes() {
        let mut t = TierIndex::new(30);
        for k in 1..=3 {
            assert!(t.insert(0, k, 0, &[k as u32], 10, 100, k).unwrap().is_empty());
        }
        assert_eq!(t.used_bytes(), 30);
        // Using 1 makes 2 the least recently used.
        assert_eq!(t.hit(0, 1, 0, &[1], 0), Some(&1));
        let out = t.insert(0, 4, 0, &[4], 10, 100, 4).unwrap();
        assert_eq!(keys(&out), vec![(2, Departure::Evicted)]);
        assert_eq!(t.insert(0, 5, 0, &[5], 31, 100, 5).unwrap_err(), 5, "larger than the tier");
        assert_eq!((t.stats.evicted_blocks, t.stats.refused_blocks), (1, 1));
    }

    #[test]
    fn content_is_checked_and_expired_blocks_are_never_served() {
        let mut t = TierIndex::new(100);
        t.insert(0, 7, 1, &[3, 4], 10, 50, ()).unwrap();
        assert!(t.peek(0, 7, 1, &[3, 5]).is_none(), "same key, other tokens");
        assert!(t.peek(0, 7, 2, &[3, 4]).is_none(), "same key, other parent");
        assert!(t.peek(49, 7, 1, &[3, 4]).is_some());
        assert!(t.peek(50, 7, 1, &[3, 4]).is_none(), "expired at its expiry");
        // A hit before expiry refreshes it.
        assert!(t.hit(40, 7, 1, &[3, 4], 140).is_some());
        assert!(t.peek(120, 7, 1, &[3, 4]).is_some());
        assert_eq!(keys(&t.expire(139)), vec![]);
        assert_eq!(keys(&t.expire(140)), vec![(7, Departure::Expired)]);
        assert_eq!((t.used_bytes(), t.stats.expired_blocks), (0, 1));
        assert!(t.hit(141, 7, 1, &[3, 4], 200).is_none());
        assert_eq!(t.stats.miss_blocks, 1);
    }

    #[test]
    fn expired_blocks_make_room_before_live_ones() {
        let mut t = TierIndex::new(20);
        t.insert(0, 1, 0, &[1], 10, 1000, ()).unwrap();
        t.insert(0, 2, 0, &[2], 10, 10, ()).unwrap();
        let out = t.insert(10, 3, 0, &[3], 10, 1000, ()).unwrap();
        assert_eq!(keys(&out), vec![(2, Departure::Expired)], "the live older block stays");
        assert!(t.contains(1) && t.contains(3));
        // Reinserting a key extends its expiry, never shortens it.
        t.insert(10, 1, 0, &[1], 10, 5000, ()).unwrap();
        t.insert(10, 1, 0, &[1], 10, 20, ()).unwrap();
        assert!(t.peek(4999, 1, 0, &[1]).is_some());
        assert_eq!(t.take(1).map(|r| r.why), Some(Departure::Taken));
        assert_eq!(t.used_bytes(), 10);
    }
}
