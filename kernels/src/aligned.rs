//! f32 buffers whose first element starts a cache line. A 64-byte vector load
//! from a buffer that does not crosses two cache lines every time, which
//! Intel cores pay for on every load (large allocations start 16 bytes into
//! a page).

use std::ops::{Deref, DerefMut};

const LINE_FLOATS: usize = 16;

/// `len` floats starting on a 64-byte boundary.
pub struct AlignedF32 {
    buf: Vec<f32>,
    start: usize,
    len: usize,
}

impl AlignedF32 {
    pub fn zeroed(len: usize) -> Self {
        let buf = vec![0.0f32; len + LINE_FLOATS];
        let misalignment = (buf.as_ptr() as usize / 4) % LINE_FLOATS;
        let start = (LINE_FLOATS - misalignment) % LINE_FLOATS;
        assert_eq!((buf[start..].as_ptr() as usize) % 64, 0, "f32 buffers are 4-byte aligned");
        Self { buf, start, len }
    }
}

impl Deref for AlignedF32 {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        &self.buf[self.start..self.start + self.len]
    }
}

impl DerefMut for AlignedF32 {
    fn deref_mut(&mut self) -> &mut [f32] {
        &mut self.buf[self.start..self.start + self.len]
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
}
