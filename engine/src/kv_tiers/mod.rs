//! The prompt cache's tiers below the device pool: host memory with its own
//! byte budget, and the block file format of the disk tier. The device tier
//! is the [`PrefixCache`](crate::prefix_cache::PrefixCache) over the KV pool;
//! all tiers share its content-addressed keys, so a block is the same block
//! wherever it lives.
//!
//! Blocks move down on eviction (device → host), up on a hit (host → device,
//! before the request is admitted), and are written to disk at the points
//! [`PersistRule`] names; what reaches disk and back is exactly
//! [`BlockValues`](crate::block_values::BlockValues).

pub mod block_file;
pub mod index;

pub use index::{Departure, Removed, TierIndex, TierStats};

/// Where a cached block was found.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Tier {
    Device,
    Host,
    Disk,
}

impl Tier {
    pub const ALL: [Tier; 3] = [Tier::Device, Tier::Host, Tier::Disk];

    pub fn name(self) -> &'static str {
        match self {
            Tier::Device => "device",
            Tier::Host => "host",
            Tier::Disk => "disk",
        }
    }

    pub fn index(self) -> usize {
        self as usize
    }
}

/// Prompt tokens served from each tier, by [`Tier::index`].
pub type TierTokens = [usize; 3];

/// Which computed blocks are written to the disk tier: the end of each
/// prompt (a user turn) and of each finished output (a model turn), every
/// `interval_blocks` blocks of a long prompt, and prefixes another request
/// hit. Each point persists the whole chain before it, since a hit needs
/// every block from position 0.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PersistRule {
    pub interval_blocks: usize,
}

impl Default for PersistRule {
    fn default() -> Self {
        Self { interval_blocks: 16 }
    }
}

impl PersistRule {
    /// Blocks of a sequence to persist once block `k` (0-based) is computed:
    /// `Some(k + 1)` at a persist point, `None` otherwise. `prompt_blocks` is
    /// the number of full blocks before the prompt's last token.
    pub fn point(&self, k: usize, prompt_blocks: usize) -> Option<usize> {
        let done = k + 1;
        let prompt_end = done == prompt_blocks;
        let interval = done < prompt_blocks && self.interval_blocks > 0 && done.is_multiple_of(self.interval_blocks);
        (prompt_end || interval).then_some(done)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn persist_points_are_prompt_ends_and_intervals() {
        let rule = PersistRule { interval_blocks: 4 };
        let points: Vec<usize> = (0..12).filter_map(|k| rule.point(k, 10)).collect();
        assert_eq!(points, vec![4, 8, 10], "every 4th block and the prompt's end; output blocks wait for the finish");
        assert_eq!((0..3).filter_map(|k| PersistRule { interval_blocks: 0 }.point(k, 3)).collect::<Vec<_>>(), vec![3]);
    }
}
