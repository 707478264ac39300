//! Where devices, instances and nodes are: the numbering every actor and
//! the modelled devices share. It depends on nothing else in the crate.

use std::ops::Range;
use std::sync::Arc;

/// Where everything lives. Devices are numbered globally and cut into
/// serving instances (each one expert-parallel group with its own scheduler)
/// of consecutive devices, and into nodes of `per_node` devices. Instances
/// may differ in size (a prefill instance of 32 devices, a decode one of 144).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Topology {
    pub devices: u32,
    pub per_node: u32,
    pub instances: u32,
    /// First device of each instance, then `devices`.
    starts: Arc<[u32]>,
    /// Nodes after the serving ones, with no serving device: image encoders' nodes.
    pub extra_nodes: u32,
}

impl Topology {
    /// `instances` instances of equal size.
    pub fn uniform(devices: u32, per_node: u32, instances: u32) -> Self {
        let instances = instances.max(1);
        let size = devices / instances;
        Self::with_sizes(per_node, &vec![size; instances as usize])
    }

    /// Instances of the given sizes, in order.
    pub fn with_sizes(per_node: u32, sizes: &[u32]) -> Self {
        let mut starts = Vec::with_capacity(sizes.len() + 1);
        let mut at = 0u32;
        for &n in sizes {
            starts.push(at);
            at += n;
        }
        starts.push(at);
        Self {
            devices: at,
            per_node: per_node.max(1),
            instances: sizes.len() as u32,
            starts: starts.into(),
            extra_nodes: 0,
        }
    }

    /// With `extra` nodes after the serving ones (they hold no serving device).
    pub fn with_extra_nodes(mut self, extra: u32) -> Self {
        self.extra_nodes = extra;
        self
    }

    /// Every node: the serving ones, then the extra ones.
    pub fn nodes(&self) -> u32 {
        self.serving_nodes() + self.extra_nodes
    }

    /// Nodes with serving devices (the first ones).
    pub fn serving_nodes(&self) -> u32 {
        self.devices.div_ceil(self.per_node.max(1))
    }

    /// Devices of `instance`.
    pub fn size_of(&self, instance: u32) -> u32 {
        let r = self.devices_of(instance);
        r.end - r.start
    }

    pub fn instance_of(&self, device: u32) -> u32 {
        let i = self.starts.partition_point(|&s| s <= device);
        (i.saturating_sub(1) as u32).min(self.instances.saturating_sub(1))
    }

    /// The instance's devices (global numbers).
    pub fn devices_of(&self, instance: u32) -> Range<u32> {
        let i = (instance as usize).min(self.starts.len().saturating_sub(2));
        self.starts[i]..self.starts[i + 1]
    }

    pub fn node_of_device(&self, device: u32) -> u32 {
        device / self.per_node.max(1)
    }

    /// The node of an instance's first device: its scheduler and cache manager live there.
    pub fn home_node(&self, instance: u32) -> u32 {
        self.node_of_device(self.devices_of(instance).start)
    }

    /// Instances whose scheduler lives on `node`.
    pub fn instances_on(&self, node: u32) -> Vec<u32> {
        (0..self.instances).filter(|&i| self.home_node(i) == node).collect()
    }
}
