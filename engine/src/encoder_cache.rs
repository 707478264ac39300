//! The image-encoder output cache: the aligner rows of images already
//! encoded, kept by an encoder instance so a repeated image (the same
//! screenshot resent with every turn of an agent's conversation, a logo in
//! every page of a document) is not encoded again.
//!
//! An LRU bounded by bytes and keyed by the image's content hash (the hash of
//! the decoded, resized pixels and the plan, as the prefix cache uses). It is
//! deterministic: recency is a logical counter, entries live in `BTreeMap`s,
//! and eviction order depends only on the sequence of calls, so the simulator
//! and a real encoder evict the same entries for the same traffic.

use std::collections::BTreeMap;

struct Entry<V> {
    value: V,
    bytes: u64,
    /// The logical time of the last touch; a key into `by_recency`.
    stamp: u64,
}

/// An LRU of encoder outputs bounded by `capacity_bytes`.
pub struct EncoderCache<V> {
    capacity: u64,
    bytes: u64,
    clock: u64,
    entries: BTreeMap<u64, Entry<V>>,
    /// Last-touch stamp → key; the first entry is the least recently used.
    by_recency: BTreeMap<u64, u64>,
    hits: u64,
    misses: u64,
    evictions: u64,
}

impl<V> EncoderCache<V> {
    pub fn new(capacity_bytes: u64) -> Self {
        Self {
            capacity: capacity_bytes,
            bytes: 0,
            clock: 0,
            entries: BTreeMap::new(),
            by_recency: BTreeMap::new(),
            hits: 0,
            misses: 0,
            evictions: 0,
        }
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// The encoding of `key`, touched (now the most recently used), counting
    /// a hit; `None` counts a miss.
    pub fn get(&mut self, key: u64) -> Option<&V> {
        if !self.entries.contains_key(&key) {
            self.misses += 1;
            return None;
        }
        let stamp = self.tick();
        let entry = self.entries.get_mut(&key).expect("checked above");
        self.by_recency.remove(&entry.stamp);
        entry.stamp = stamp;
        self.by_recency.insert(stamp, key);
        self.hits += 1;
        Some(&entry.value)
    }

    /// Keeps `value` (of `bytes`) under `key`, evicting the least recently
    /// used entries until it fits. A value larger than the whole capacity is
    /// not kept (and evicts nothing): keeping it would flush every other
    /// entry for one that cannot stay. Re-inserting a key replaces it.
    pub fn insert(&mut self, key: u64, value: V, bytes: u64) {
        if let Some(old) = self.entries.remove(&key) {
            self.by_recency.remove(&old.stamp);
            self.bytes -= old.bytes;
        }
        if bytes > self.capacity {
            return;
        }
        while self.bytes + bytes > self.capacity {
            let (_, victim) = self.by_recency.pop_first().expect("bytes in use imply an entry");
            let evicted = self.entries.remove(&victim).expect("recency and entries agree");
            self.bytes -= evicted.bytes;
            self.evictions += 1;
        }
        let stamp = self.tick();
        self.entries.insert(key, Entry { value, bytes, stamp });
        self.by_recency.insert(stamp, key);
        self.bytes += bytes;
        assert!(self.bytes <= self.capacity, "encoder cache over its bound: {} > {}", self.bytes, self.capacity);
        assert_eq!(self.entries.len(), self.by_recency.len(), "encoder cache recency out of step");
    }

    /// Whether `key` is cached; no touch, no count.
    pub fn contains(&self, key: u64) -> bool {
        self.entries.contains_key(&key)
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn hits(&self) -> u64 {
        self.hits
    }

    pub fn misses(&self) -> u64 {
        self.misses
    }

    pub fn evictions(&self) -> u64 {
        self.evictions
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hits_and_misses_are_counted() {
        let mut c = EncoderCache::new(100);
        assert_eq!(c.get(1), None);
        c.insert(1, "a", 10);
        assert_eq!(c.get(1), Some(&"a"));
        assert_eq!(c.get(2), None);
        assert_eq!((c.hits(), c.misses(), c.evictions()), (1, 2, 0));
        assert!(c.contains(1) && !c.contains(2));
        assert_eq!((c.len(), c.bytes()), (1, 10));
    }

    #[test]
    fn evicts_the_least_recently_used_until_it_fits() {
        let mut c = EncoderCache::new(30);
        c.insert(1, 1, 10);
        c.insert(2, 2, 10);
        c.insert(3, 3, 10);
        // Touch 1: now 2 is the least recently used.
        assert!(c.get(1).is_some());
        c.insert(4, 4, 10);
        assert!(!c.contains(2) && c.contains(1) && c.contains(3) && c.contains(4));
        assert_eq!(c.evictions(), 1);
        // Recency now 3, 1, 4: a 25-byte value needs all three out, oldest first.
        c.insert(5, 5, 25);
        assert!(c.contains(5) && !c.contains(1) && !c.contains(3) && !c.contains(4));
        assert_eq!((c.bytes(), c.len(), c.evictions()), (25, 1, 4));
    }

    #[test]
    fn a_value_larger_than_the_capacity_is_not_kept_and_evicts_nothing() {
        let mut c = EncoderCache::new(30);
        c.insert(1, 1, 20);
        c.insert(2, 2, 31);
        assert!(c.contains(1) && !c.contains(2));
        assert_eq!((c.bytes(), c.evictions()), (20, 0));
        let mut empty = EncoderCache::<u8>::new(0);
        empty.insert(1, 1, 1);
        assert!(empty.is_empty());
        empty.insert(2, 2, 0);
        assert_eq!(empty.len(), 1);
    }

    #[test]
    fn reinserting_a_key_replaces_its_bytes() {
        let mut c = EncoderCache::new(30);
        c.insert(1, 1, 20);
        c.insert(1, 2, 5);
        assert_eq!((c.bytes(), c.len(), c.get(1).copied()), (5, 1, Some(2)));
    }

    #[test]
    fn the_same_calls_evict_the_same_entries() {
        let run = || {
            let mut c = EncoderCache::new(1000);
            let mut x = 7u64;
            for _ in 0..500 {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                let key = (x >> 33) % 40;
                if c.get(key).is_none() {
                    c.insert(key, key, 50 + key);
                }
                assert!(c.bytes() <= 1000);
            }
            let mut keys: Vec<u64> = (0..40).filter(|k| c.contains(*k)).collect();
            keys.push(c.hits());
            keys.push(c.evictions());
            keys
        };
        assert_eq!(run(), run());
    }
}
