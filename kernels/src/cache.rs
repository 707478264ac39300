//! The data caches of this CPU, as its `cpuid` describes them.
//!
//! Blocking sizes follow the cache they must fit: a batch's panel of input
//! rows is sized to the core's L2, which is 1 MiB on a Zen 4 core and 2 MiB on
//! a Sapphire Rapids one. Sizes only choose how work is split, never which
//! sums are formed, so no result depends on them.

use std::sync::OnceLock;

/// Assumed where `cpuid` does not say (other architectures, odd hypervisors):
/// the smallest L2 of the cores the kernels are tuned on.
const L2_BYTES_DEFAULT: usize = 1 << 20;
/// Reported sizes are clamped to this range, so a hypervisor's odd answer
/// cannot make panels degenerate.
const L2_BYTES_MIN: usize = 256 << 10;
const L2_BYTES_MAX: usize = 4 << 20;

/// Bytes of the level-2 cache one core reads from (data or unified), clamped
/// to 256 KiB – 4 MiB.
pub fn l2_bytes() -> usize {
    static L2: OnceLock<usize> = OnceLock::new();
    *L2.get_or_init(|| detect_l2_bytes().unwrap_or(L2_BYTES_DEFAULT).clamp(L2_BYTES_MIN, L2_BYTES_MAX))
}

/// The L2 size from the deterministic cache parameters (`cpuid` leaf 4 on
/// Intel, 0x8000_001D on AMD; both describe one cache per sub-leaf).
#[cfg(target_arch = "x86_64")]
fn detect_l2_bytes() -> Option<usize> {
    use std::arch::x86_64::__cpuid_count;
    // Leaves past the maximum return zeros, which end the search below.
    let max_leaf = __cpuid_count(0, 0).eax;
    let max_extended = __cpuid_count(0x8000_0000, 0).eax;
    let leaf = if max_leaf >= 4 && __cpuid_count(4, 0).eax & 0x1f != 0 {
        4
    } else if max_extended >= 0x8000_001d {
        0x8000_001d
    } else {
        return None;
    };
    // A CPU lists a handful of caches; 16 sub-leaves bound the search.
    for sub in 0..16 {
        let r = __cpuid_count(leaf, sub);
        let kind = r.eax & 0x1f;
        if kind == 0 {
            break;
        }
        let level = (r.eax >> 5) & 0x7;
        // Kinds 1 (data) and 3 (unified) hold data.
        if level == 2 && (kind == 1 || kind == 3) {
            return Some(cache_bytes(r.ebx, r.ecx));
        }
    }
    None
}

#[cfg(not(target_arch = "x86_64"))]
fn detect_l2_bytes() -> Option<usize> {
    None
}

/// A cache's size from `ebx` (ways, partitions, line size, each minus one)
/// and `ecx` (sets minus one) of its `cpuid` sub-leaf.
#[cfg(target_arch = "x86_64")]
fn cache_bytes(ebx: u32, ecx: u32) -> usize {
    let ways = ((ebx >> 22) & 0x3ff) as usize + 1;
    let partitions = ((ebx >> 12) & 0x3ff) as usize + 1;
    let line = (ebx & 0xfff) as usize + 1;
    let sets = ecx as usize + 1;
    ways * partitions * line * sets
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn cache_bytes_decodes_the_cpuid_fields() {
        // A 2 MiB, 16-way L2 with 64-byte lines: 2048 sets.
        let ebx = (15 << 22) | 63;
        assert_eq!(cache_bytes(ebx, 2047), 2 << 20);
        // A 1 MiB, 8-way L2: 2048 sets.
        assert_eq!(cache_bytes((7 << 22) | 63, 2047), 1 << 20);
    }

    #[test]
    fn l2_size_is_within_the_clamp() {
        let l2 = l2_bytes();
        assert!((L2_BYTES_MIN..=L2_BYTES_MAX).contains(&l2), "{l2}");
        assert_eq!(l2, l2_bytes(), "detected once");
    }
}
