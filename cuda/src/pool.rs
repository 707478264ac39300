//! Freed device buffers kept for reuse. A forward pass allocates its
//! intermediates afresh every step, and a GPU allocation (`cuMemAlloc`)
//! synchronises the device and costs tens of microseconds; so a freed buffer
//! below [`POOLED_MAX_BYTES`] goes back to a free list by size class (a power
//! of two) and the next request of that class takes it. The pool holds at
//! most [`POOL_CAP_BYTES`]; what does not fit is freed. This is the logic
//! alone: the device allocates and frees the memory it names.

use std::collections::BTreeMap;

/// Largest allocation that is pooled; larger ones (weights, mostly made once)
/// are allocated at their exact size and freed at once.
pub const POOLED_MAX_BYTES: usize = 256 << 20;
/// Most bytes the free lists hold.
pub const POOL_CAP_BYTES: usize = 4 << 30;
/// The smallest size class (and a GPU allocation's alignment).
const MIN_CLASS_BYTES: usize = 256;

/// The bytes an allocation of `bytes` takes: its size class when pooled,
/// else `bytes` itself.
pub fn size_class(bytes: usize) -> usize {
    if bytes > POOLED_MAX_BYTES {
        bytes
    } else {
        bytes.max(MIN_CLASS_BYTES).next_power_of_two()
    }
}

/// Free lists by size class.
#[derive(Debug, Default)]
pub struct FreeLists {
    lists: BTreeMap<usize, Vec<u64>>,
    held: usize,
}

impl FreeLists {
    /// A freed buffer of class `class` to reuse, if one is held.
    pub fn take(&mut self, class: usize) -> Option<u64> {
        let list = self.lists.get_mut(&class)?;
        let addr = list.pop()?;
        self.held -= class;
        Some(addr)
    }

    /// Keep a freed buffer of class `class`; `false` when it must be freed
    /// instead (unpooled size, or the pool is full).
    pub fn give(&mut self, class: usize, addr: u64) -> bool {
        if class > POOLED_MAX_BYTES || self.held + class > POOL_CAP_BYTES {
            return false;
        }
        self.lists.entry(class).or_default().push(addr);
        self.held += class;
        true
    }

    /// Every held buffer with its class, the lists emptied (to free them
    /// when an allocation fails for want of memory).
    pub fn drain(&mut self) -> Vec<(u64, usize)> {
        self.held = 0;
        std::mem::take(&mut self.lists)
            .into_iter()
            .flat_map(|(class, addrs)| addrs.into_iter().map(move |a| (a, class)))
            .collect()
    }

    /// Bytes held for reuse.
    pub fn held_bytes(&self) -> usize {
        self.held
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_round_up_to_a_power_of_two_below_the_pooled_limit() {
        assert_eq!(size_class(0), 256);
        assert_eq!(size_class(1), 256);
        assert_eq!(size_class(257), 512);
        assert_eq!(size_class(4096), 4096);
        assert_eq!(size_class(POOLED_MAX_BYTES), POOLED_MAX_BYTES);
        assert_eq!(size_class(POOLED_MAX_BYTES + 1), POOLED_MAX_BYTES + 1);
    }

    #[test]
    fn a_freed_buffer_is_taken_again_by_its_class_only() {
        let mut f = FreeLists::default();
        assert!(f.give(512, 0x1000));
        assert_eq!(f.take(256), None);
        assert_eq!(f.held_bytes(), 512);
        assert_eq!(f.take(512), Some(0x1000));
        assert_eq!(f.take(512), None);
        assert_eq!(f.held_bytes(), 0);
    }

    #[test]
    fn the_pool_keeps_no_more_than_its_cap_and_no_unpooled_size() {
        let mut f = FreeLists::default();
        assert!(!f.give(POOLED_MAX_BYTES + 1, 1), "an unpooled size is freed");
        let class = POOLED_MAX_BYTES;
        let fit = POOL_CAP_BYTES / class;
        for i in 0..fit {
            assert!(f.give(class, i as u64));
        }
        assert!(!f.give(class, 999), "past the cap the buffer is freed");
        assert_eq!(f.held_bytes(), POOL_CAP_BYTES);
        let drained = f.drain();
        assert_eq!(drained.len(), fit);
        assert_eq!(f.held_bytes(), 0);
        assert_eq!(f.take(class), None);
    }
}
