//! Where the routed experts live: logical expert → devices holding a copy.
//! The table is versioned (epoch) and may change between steps; which copy
//! serves a token is a pure function of the token's identity, so it does not
//! depend on batching, timing or which worker asks.

use crate::sim::rng::mix64;
use crate::wire::PlacementWire;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlacementError {
    #[error("expert parallel degree {ep} must be between 1 and {devices} and divide the {devices} devices")]
    Degree { ep: u32, devices: u32 },
    #[error("expert parallel degree {ep} exceeds the {experts} routed experts")]
    TooFewExperts { ep: u32, experts: u32 },
    #[error("the table has {got} experts, the model {want}")]
    ExpertCount { got: usize, want: usize },
    #[error("expert {0} has no replica")]
    NoReplica(u32),
    #[error("expert {expert} placed on device {device}, but there are {devices} devices")]
    Device { expert: u32, device: u32, devices: u32 },
    #[error("a placement needs at least one device")]
    NoDevices,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    epoch: u64,
    devices: u32,
    replicas: Vec<Vec<u32>>,
}

/// Identity of one token row for replica choice: (sequence, position).
pub fn row_key(seq: u64, position: u64) -> u64 {
    mix64(seq.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ position)
}

impl Placement {
    /// A table from explicit replica lists (sorted and de-duplicated here).
    pub fn new(devices: u32, mut replicas: Vec<Vec<u32>>) -> Result<Self, PlacementError> {
        if devices == 0 {
            return Err(PlacementError::NoDevices);
        }
        for (e, r) in replicas.iter_mut().enumerate() {
            r.sort_unstable();
            r.dedup();
            if r.is_empty() {
                return Err(PlacementError::NoReplica(e as u32));
            }
            if let Some(&device) = r.iter().find(|&&d| d >= devices) {
                return Err(PlacementError::Device { expert: e as u32, device, devices });
            }
        }
        Ok(Self { epoch: 0, devices, replicas })
    }

    /// Expert parallelism of degree `ep` over `devices`: the experts are cut
    /// into `ep` contiguous groups; group `g` lives on every device `d` with
    /// `d % ep == g` (so `devices / ep` copies of each expert).
    pub fn expert_parallel(experts: u32, devices: u32, ep: u32) -> Result<Self, PlacementError> {
        if ep == 0 || ep > devices || (devices / ep) * ep != devices {
            return Err(PlacementError::Degree { ep, devices });
        }
        if ep > experts {
            return Err(PlacementError::TooFewExperts { ep, experts });
        }
        let replicas = (0..experts as u64)
            .map(|e| {
                let g = (e * ep as u64 / experts as u64) as u32;
                (0..devices).filter(|d| d % ep == g).collect()
            })
            .collect();
        Self::new(devices, replicas)
    }

    /// Add a redundant copy of `expert` on `device`.
    pub fn with_replica(mut self, expert: u32, device: u32) -> Result<Self, PlacementError> {
        if device >= self.devices {
            return Err(PlacementError::Device { expert, device, devices: self.devices });
        }
        let want = self.replicas.len();
        let r = self
            .replicas
            .get_mut(expert as usize)
            .ok_or(PlacementError::ExpertCount { got: expert as usize + 1, want })?;
        if let Err(at) = r.binary_search(&device) {
            r.insert(at, device);
        }
        Ok(self)
    }

    /// The table after `lost` devices died: their copies are dropped; an
    /// expert left with none is loaded on the surviving device holding the
    /// fewest experts (lowest number on ties). Redundant copies thus take
    /// over first. The epoch is kept (the caller bumps it).
    pub fn without_devices(&self, lost: &std::collections::BTreeSet<u32>) -> Result<Self, PlacementError> {
        let survivors: Vec<u32> = (0..self.devices).filter(|d| !lost.contains(d)).collect();
        if survivors.is_empty() {
            return Err(PlacementError::NoDevices);
        }
        let mut replicas: Vec<Vec<u32>> =
            self.replicas.iter().map(|r| r.iter().copied().filter(|d| !lost.contains(d)).collect()).collect();
        let mut held: std::collections::BTreeMap<u32, usize> = survivors.iter().map(|&d| (d, 0)).collect();
        for r in &replicas {
            for d in r {
                *held.get_mut(d).expect("survivor") += 1;
            }
        }
        for r in replicas.iter_mut().filter(|r| r.is_empty()) {
            let (&d, n) = held.iter_mut().min_by_key(|(d, n)| (**n, **d)).expect("survivors exist");
            *n += 1;
            r.push(d);
        }
        Ok(Self::new(self.devices, replicas)?.with_epoch(self.epoch))
    }

    /// The same table with its devices renumbered so that as many expert
    /// copies as possible stay where `current` has them (a balancer's bins
    /// are interchangeable; the weights on a device are not): greedily, the
    /// (new bin, device) pair sharing the most experts first, lowest numbers
    /// on ties. Loads per device are unchanged.
    pub fn keeping(&self, current: &Placement) -> Placement {
        assert_eq!(self.devices, current.devices, "tables of one instance");
        let n = self.devices as usize;
        let held: Vec<Vec<u32>> = (0..self.devices).map(|d| self.experts_on(d)).collect();
        let had: Vec<std::collections::BTreeSet<u32>> =
            (0..current.devices).map(|d| current.experts_on(d).into_iter().collect()).collect();
        let mut pairs: Vec<(usize, usize, usize)> = Vec::with_capacity(n * n);
        for (bin, experts) in held.iter().enumerate() {
            for (device, old) in had.iter().enumerate() {
                pairs.push((experts.iter().filter(|e| old.contains(e)).count(), bin, device));
            }
        }
        pairs.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
        let mut to = vec![u32::MAX; n];
        let mut taken = vec![false; n];
        for (_, bin, device) in pairs {
            if to[bin] == u32::MAX && !taken[device] {
                to[bin] = device as u32;
                taken[device] = true;
            }
        }
        let replicas = self.replicas.iter().map(|r| r.iter().map(|&d| to[d as usize]).collect()).collect();
        Placement::new(self.devices, replicas).expect("a renumbering of a valid table").with_epoch(self.epoch)
    }

    /// Heaviest device's share of `loads` (per expert, each split evenly over
    /// its copies) over the mean device's: 1 is perfect balance.
    pub fn imbalance(&self, loads: &[f64]) -> f64 {
        assert_eq!(loads.len(), self.replicas.len(), "one load per expert");
        let mut per_device = vec![0.0f64; self.devices as usize];
        for (r, &load) in self.replicas.iter().zip(loads) {
            for &d in r {
                per_device[d as usize] += load / r.len() as f64;
            }
        }
        let total: f64 = per_device.iter().sum();
        if total <= 0.0 {
            return 1.0;
        }
        per_device.iter().copied().fold(0.0, f64::max) * self.devices as f64 / total
    }

    /// This table improved by moving at most `moves` expert copies, one at a
    /// time from the heaviest device to the lightest, each the copy that
    /// best evens the two; stops when no move lowers the heaviest device.
    /// Devices in `excluded` (lost ones) receive nothing.
    pub fn refined(&self, loads: &[f64], moves: usize, excluded: &std::collections::BTreeSet<u32>) -> Placement {
        let mut replicas = self.replicas.clone();
        for _ in 0..moves {
            let mut per_device = vec![0.0f64; self.devices as usize];
            for (r, &load) in replicas.iter().zip(loads) {
                for &d in r {
                    per_device[d as usize] += load / r.len() as f64;
                }
            }
            let by_load = |a: &(usize, &f64), b: &(usize, &f64)| a.1.total_cmp(b.1).then(b.0.cmp(&a.0));
            let (heavy, &h) = per_device.iter().enumerate().max_by(by_load).expect("a device");
            let Some((light, &l)) =
                per_device.iter().enumerate().filter(|(d, _)| !excluded.contains(&(*d as u32))).min_by(by_load)
            else {
                break;
            };
            let (heavy, light) = (heavy as u32, light as u32);
            // The copy on `heavy` (not already on `light`) whose share brings the two closest.
            let best = replicas
                .iter()
                .enumerate()
                .filter(|(_, r)| r.contains(&heavy) && !r.contains(&light))
                .map(|(e, r)| (e, loads[e] / r.len() as f64))
                .filter(|&(_, share)| share > 0.0 && (l + share).max(h - share) < h)
                .min_by(|a, b| {
                    ((h - a.1) - (l + a.1)).abs().total_cmp(&((h - b.1) - (l + b.1)).abs()).then(a.0.cmp(&b.0))
                });
            let Some((e, _)) = best else { break };
            let r = &mut replicas[e];
            r.retain(|&d| d != heavy);
            r.push(light);
            r.sort_unstable();
        }
        Placement::new(self.devices, replicas).expect("moves keep every expert placed").with_epoch(self.epoch)
    }

    /// Expert copies of `self` that `current` does not have on the same device.
    pub fn copies_moved_from(&self, current: &Placement) -> usize {
        (0..self.devices)
            .map(|d| {
                let old = current.experts_on(d);
                self.experts_on(d).iter().filter(|e| old.binary_search(e).is_err()).count()
            })
            .sum()
    }

    pub fn with_epoch(mut self, epoch: u64) -> Self {
        self.epoch = epoch;
        self
    }

    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    pub fn devices(&self) -> u32 {
        self.devices
    }

    pub fn num_experts(&self) -> usize {
        self.replicas.len()
    }

    pub fn replicas(&self, expert: u32) -> &[u32] {
        &self.replicas[expert as usize]
    }

    /// Experts with a copy on `device`, ascending.
    pub fn experts_on(&self, device: u32) -> Vec<u32> {
        (0..self.replicas.len() as u32).filter(|&e| self.replicas[e as usize].binary_search(&device).is_ok()).collect()
    }

    /// The device that computes `expert` for the row identified by `row`.
    pub fn choose(&self, expert: u32, row: u64) -> u32 {
        let r = &self.replicas[expert as usize];
        if r.len() == 1 {
            return r[0];
        }
        r[(mix64(row ^ (expert as u64).wrapping_mul(0xd6e8_feb8_6659_fd93)) % r.len() as u64) as usize]
    }

    /// The table must cover exactly the model's `experts`.
    pub fn check_experts(&self, experts: usize) -> Result<(), PlacementError> {
        if self.replicas.len() != experts {
            return Err(PlacementError::ExpertCount { got: self.replicas.len(), want: experts });
        }
        Ok(())
    }

    pub fn to_wire(&self) -> PlacementWire {
        PlacementWire { epoch: self.epoch, devices: self.devices, replicas: self.replicas.clone() }
    }

    /// A table received from a peer, validated.
    pub fn from_wire(w: &PlacementWire, experts: usize) -> Result<Self, PlacementError> {
        let p = Self::new(w.devices, w.replicas.clone())?.with_epoch(w.epoch);
        p.check_experts(experts)?;
        Ok(p)
    }
}

#[cfg(test)]
mod keeping_tests {
    use super::*;

    #[test]
    fn a_renumbered_table_moves_nothing_and_a_changed_one_moves_only_the_change() {
        let current = Placement::expert_parallel(8, 4, 4).unwrap();
        // The same bins under other device numbers.
        let shuffled: Vec<Vec<u32>> = (0..8u32).map(|e| vec![(current.replicas(e)[0] + 1) % 4]).collect();
        let shuffled = Placement::new(4, shuffled).unwrap();
        assert_eq!(shuffled.copies_moved_from(&current), 8);
        let kept = shuffled.keeping(&current);
        assert_eq!(kept.copies_moved_from(&current), 0);
        assert_eq!(kept, current);
        // One extra copy of expert 0: only that copy moves.
        let more = shuffled.with_replica(0, 0).unwrap();
        let kept = more.keeping(&current);
        assert_eq!(kept.copies_moved_from(&current), 1);
        let per_device = |p: &Placement| {
            let mut v: Vec<usize> = (0..4).map(|d| p.experts_on(d).len()).collect();
            v.sort();
            v
        };
        assert_eq!(per_device(&kept), per_device(&more), "the loads per device are the same");
    }

    #[test]
    fn refining_moves_few_copies_and_never_worsens_the_heaviest_device() {
        let current = Placement::expert_parallel(8, 4, 4).unwrap();
        // Experts 0 and 1 (both on device 0) are hot.
        let loads = [10.0, 9.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0];
        let none = std::collections::BTreeSet::new();
        let refined = current.refined(&loads, 2, &none);
        assert!(refined.copies_moved_from(&current) <= 2);
        assert!(refined.imbalance(&loads) < current.imbalance(&loads));
        assert!((0..8).all(|e| !refined.replicas(e).is_empty()));
        // Balanced already: nothing moves.
        let even = [1.0; 8];
        assert_eq!(current.refined(&even, 4, &none).copies_moved_from(&current), 0);
        // A lost device (holding nothing, so the lightest) is never given a copy.
        let lost: std::collections::BTreeSet<u32> = [3].into();
        let without = current.without_devices(&lost).unwrap();
        let refined = without.refined(&loads, 4, &lost);
        assert!(refined.experts_on(3).is_empty());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expert_parallel_groups_and_copies() {
        let p = Placement::expert_parallel(8, 4, 2).unwrap();
        assert_eq!(p.replicas(0), &[0, 2]);
        assert_eq!(p.replicas(7), &[1, 3]);
        assert_eq!(p.experts_on(2), vec![0, 1, 2, 3]);
        let p8 = Placement::expert_parallel(8, 8, 8).unwrap();
        assert_eq!((0..8).map(|e| p8.replicas(e)[0]).collect::<Vec<_>>(), (0..8).collect::<Vec<_>>());
        assert_eq!(Placement::expert_parallel(8, 6, 4), Err(PlacementError::Degree { ep: 4, devices: 6 }));
        assert_eq!(Placement::expert_parallel(2, 4, 4), Err(PlacementError::TooFewExperts { ep: 4, experts: 2 }));
    }

    #[test]
    fn replica_choice_spreads_and_is_stable() {
        let p = Placement::expert_parallel(8, 4, 2).unwrap().with_replica(0, 1).unwrap();
        assert_eq!(p.replicas(0), &[0, 1, 2]);
        let picks: Vec<u32> = (0..300).map(|t| p.choose(0, row_key(1, t))).collect();
        for d in [0, 1, 2] {
            assert!(picks.contains(&d), "device {d} never chosen");
        }
        assert_eq!(picks, (0..300).map(|t| p.choose(0, row_key(1, t))).collect::<Vec<_>>());
        let w = p.to_wire();
        assert_eq!(Placement::from_wire(&w, 8).unwrap(), p);
        assert!(Placement::from_wire(&w, 16).is_err());
    }

    #[test]
    fn lost_devices_fall_back_to_copies_then_to_survivors() {
        let p = Placement::expert_parallel(8, 4, 4).unwrap().with_replica(0, 2).unwrap().with_epoch(3);
        let q = p.without_devices(&[0].into_iter().collect()).unwrap();
        assert_eq!(q.epoch(), 3);
        // Expert 0 had a copy on device 2; expert 1 had none left and goes to the least loaded survivor.
        assert_eq!(q.replicas(0), &[2]);
        assert_eq!(q.replicas(1), &[1]);
        assert!((0..8).all(|e| !q.replicas(e).contains(&0)));
        assert!(p.without_devices(&(0..4).collect()).is_err());
    }
}
