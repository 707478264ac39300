//! One step's answers by sequence, found in constant time. A step of a large
//! decode instance carries tens of thousands of sequences, each looked up
//! once per decode step of its event; ordered maps made those lookups the
//! scheduler's largest cost. The hash map here is never iterated: values
//! leave in the order the step's plan asks for them, so nothing that
//! decides depends on its order.

use std::collections::{HashMap, VecDeque};

/// Sequence ids to dense slots, in the order they were first seen.
#[derive(Debug, Default)]
pub(super) struct SeqSlots {
    slot: HashMap<u64, usize>,
}

impl SeqSlots {
    pub fn with_capacity(n: usize) -> Self {
        Self { slot: HashMap::with_capacity(n) }
    }

    pub fn get(&self, seq: u64) -> Option<usize> {
        self.slot.get(&seq).copied()
    }

    /// `seq`'s slot, given the next one (`len`) when it has none yet; and whether it is new.
    pub fn get_or_insert(&mut self, seq: u64, len: usize) -> (usize, bool) {
        let next = self.slot.len();
        assert_eq!(next, len, "slots are dense");
        let i = *self.slot.entry(seq).or_insert(next);
        (i, i == next)
    }
}

/// A queue of values per sequence.
#[derive(Debug)]
pub(super) struct BySeq<T> {
    slots: SeqSlots,
    queues: Vec<VecDeque<T>>,
}

impl<T> Default for BySeq<T> {
    fn default() -> Self {
        Self { slots: SeqSlots::default(), queues: Vec::new() }
    }
}

impl<T> BySeq<T> {
    pub fn push(&mut self, seq: u64, value: T) {
        let (i, new) = self.slots.get_or_insert(seq, self.queues.len());
        if new {
            self.queues.push(VecDeque::new());
        }
        self.queues[i].push_back(value);
    }

    pub fn pop(&mut self, seq: u64) -> Option<T> {
        self.queue(seq).and_then(VecDeque::pop_front)
    }

    pub fn queue(&mut self, seq: u64) -> Option<&mut VecDeque<T>> {
        let i = self.slots.get(seq)?;
        self.queues.get_mut(i)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_sequence_keeps_its_own_order() {
        let mut q = BySeq::default();
        for (seq, v) in [(7u64, 1), (3, 10), (7, 2), (3, 20), (7, 3)] {
            q.push(seq, v);
        }
        assert_eq!(q.pop(7), Some(1));
        assert_eq!(q.pop(3), Some(10));
        assert_eq!(q.queue(7).map(|q| q.len()), Some(2));
        assert_eq!(q.pop(9), None);
        let mut slots = SeqSlots::default();
        assert_eq!(slots.get_or_insert(5, 0), (0, true));
        assert_eq!(slots.get_or_insert(6, 1), (1, true));
        assert_eq!(slots.get_or_insert(5, 2), (0, false));
    }
}
