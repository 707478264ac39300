//! f32 buffers whose first element starts a cache line. A 64-byte vector load
//! from a buffer that does not crosses two cache lines every time, which
//! Intel cores pay for on every load (large allocations start 16 bytes into
//! a page).

use std::cell::RefCell;
use std::ops::{Deref, DerefMut};

const LINE_FLOATS: usize = 16;
/// Largest buffer a thread keeps for reuse (64 MiB): a larger batch's
/// buffer is freed rather than held for the life of the thread.
const SPARE_FLOATS_MAX: usize = 16 << 20;
/// Most buffers a thread keeps: a linear layer has three out at once (packed
/// rows, decoded weight tile, accumulators).
const SPARES_MAX: usize = 4;

thread_local! {
    /// This thread's buffers from its last [`AlignedF32::recycle`]s. A fresh
    /// large allocation is either mapped afresh by the system (every page
    /// faults in when first written: packing a prefill's input rows into new
    /// memory spent twice as long in page faults as in copying) or zeroed by
    /// the allocator; a kept one is neither.
    static SPARES: RefCell<Vec<AlignedF32>> = const { RefCell::new(Vec::new()) };
}

/// Floats starting on a 64-byte boundary: `buf[start..]`, holding at most
/// `capacity` floats, which `buf` was made with room for (so it never moves).
pub struct AlignedF32 {
    buf: Vec<f32>,
    start: usize,
    capacity: usize,
}

/// Floats from `first` to the next cache line boundary.
fn lead(first: *const f32) -> usize {
    (LINE_FLOATS - (first as usize / 4) % LINE_FLOATS) % LINE_FLOATS
}

impl AlignedF32 {
    /// `len` zeros.
    pub fn zeroed(len: usize) -> Self {
        // Zeroed by the allocator, which for large buffers costs no writes.
        let mut buf = vec![0.0f32; len + LINE_FLOATS];
        let start = lead(buf.as_ptr());
        buf.truncate(start + len);
        Self::checked(buf, start, len)
    }

    /// `len` floats whose values are unspecified (whatever a recycled buffer
    /// held, or zeros): for scratch that is written before it is read, which
    /// then costs no zeroing when a recycled buffer has the room.
    pub fn scratch(len: usize) -> Self {
        match Self::take_spare(len) {
            Some(mut spare) => {
                // Only floats past what the buffer ever held are written.
                spare.buf.resize(spare.start + len, 0.0);
                spare.capacity = len;
                spare
            }
            None => Self::zeroed(len),
        }
    }

    /// The smallest kept buffer with room for `capacity` floats.
    fn take_spare(capacity: usize) -> Option<Self> {
        SPARES.with_borrow_mut(|spares| {
            let (index, _) =
                spares.iter().enumerate().filter(|(_, s)| s.room() >= capacity).min_by_key(|(_, s)| s.room())?;
            Some(spares.swap_remove(index))
        })
    }

    /// Keep this buffer for the thread's next [`Self::scratch`]: at most [`SPARES_MAX`] buffers of up to 64 MiB each
    /// are kept, the largest.
    pub fn recycle(self) {
        if self.room() > SPARE_FLOATS_MAX {
            return;
        }
        SPARES.with_borrow_mut(|spares| {
            spares.push(self);
            if spares.len() > SPARES_MAX {
                let (smallest, _) = spares.iter().enumerate().min_by_key(|(_, s)| s.room()).expect("kept buffers");
                spares.swap_remove(smallest);
            }
        });
    }

    /// Floats the buffer holds without moving.
    fn room(&self) -> usize {
        self.buf.capacity() - self.start
    }

    fn checked(buf: Vec<f32>, start: usize, capacity: usize) -> Self {
        assert_eq!((buf.as_ptr() as usize + 4 * start) % 64, 0, "f32 buffers are 4-byte aligned");
        assert!(buf.capacity() >= start + capacity, "room to append without moving");
        Self { buf, start, capacity }
    }
}

impl Deref for AlignedF32 {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        &self.buf[self.start..]
    }
}

impl DerefMut for AlignedF32 {
    fn deref_mut(&mut self) -> &mut [f32] {
        &mut self.buf[self.start..]
    }
}

#[cfg(test)]
mod tests {
    use super::AlignedF32;

    #[test]
    fn starts_on_a_cache_line_with_the_asked_length_zeroed() {
        for len in [0, 1, 15, 16, 17, 1000, 40_000] {
            let mut buf = AlignedF32::zeroed(len);
            assert_eq!(buf.as_ptr() as usize % 64, 0, "len {len}");
            assert_eq!(buf.len(), len);
            assert!(buf.iter().all(|&v| v == 0.0));
            buf.iter_mut().for_each(|v| *v = 1.0);
            assert_eq!(buf.iter().sum::<f32>(), len as f32);
        }
    }

    #[test]
    fn scratch_reuses_kept_buffers_at_the_asked_length_and_keeps_at_most_four() {
        let mut first = AlignedF32::scratch(64);
        first.iter_mut().for_each(|v| *v = 7.0);
        let at = first.as_ptr();
        first.recycle();
        // Reused as it was left, shortened or lengthened to the asked length.
        let shorter = AlignedF32::scratch(10);
        assert_eq!((shorter.as_ptr(), shorter.len(), shorter[9]), (at, 10, 7.0));
        shorter.recycle();
        let none_with_room = AlignedF32::scratch(100_000);
        assert_ne!(none_with_room.as_ptr(), at);
        assert_eq!(none_with_room.as_ptr() as usize % 64, 0);
        // Six kept in turn: the four largest stay, the smallest are dropped.
        let kept: Vec<AlignedF32> = (1..=6).map(|k| AlignedF32::scratch(k * 1000)).collect();
        none_with_room.recycle();
        kept.into_iter().for_each(AlignedF32::recycle);
        let held = super::SPARES.with_borrow(|s| {
            let mut rooms: Vec<usize> = s.iter().map(|b| b.room()).collect();
            rooms.sort();
            rooms
        });
        assert_eq!(held.len(), 4);
        assert!(held[0] >= 4000 && held[3] >= 100_000, "{held:?}");
    }
}
