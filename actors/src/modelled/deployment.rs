//! How a modelled deployment differs per instance and where its devices
//! sit: each instance's own batch limits and weight offload, and the share
//! of its expert-parallel group inside one scale-up domain (NVLink / HCCS),
//! which decides how much of its all-to-all crosses the slower scale-out
//! network.

use std::ops::Range;

/// One instance's settings where they differ from the deployment's.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct InstanceLimits {
    /// Sequences per device in one step, instead of the deployment's.
    pub batch_per_device: Option<usize>,
    /// Tokens per device in one step, instead of the deployment's.
    pub batch_tokens_per_device: Option<usize>,
    /// Bytes of each device's routed-expert weights held in host memory and
    /// streamed over the host link when a step reads them (0: none).
    pub offload_bytes: f64,
}

/// Devices of the group `devices` that a dispatch reaches without leaving a
/// scale-up domain of `domain` devices (domains start at device 0): the
/// whole group when it sits inside one domain, else the smallest share any
/// domain holds of it (the all-to-all waits for its slowest links).
pub fn group_domain(devices: Range<u32>, domain: u32) -> usize {
    let domain = domain.max(1);
    let (first, last) = (devices.start / domain, devices.end.saturating_sub(1) / domain);
    if devices.is_empty() {
        return 1;
    }
    (first..=last)
        .map(|d| {
            let (lo, hi) = (d * domain, (d + 1) * domain);
            devices.end.min(hi) - devices.start.max(lo)
        })
        .min()
        .unwrap_or(1)
        .max(1) as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_group_inside_one_domain_keeps_its_dispatch_there() {
        // NVL72: a 48-GPU decode group after 8 prefill GPUs fits rack 0.
        assert_eq!(group_domain(8..56, 72), 48);
        // A second one straddles racks 0 and 1: 16 + 32, paced by the smaller part.
        assert_eq!(group_domain(56..104, 72), 16);
        // HGX nodes of 8: a 32-GPU group spans 4 whole nodes.
        assert_eq!(group_domain(0..32, 8), 8);
        assert_eq!(group_domain(0..4, 8), 4);
    }
}
