//! Expert-parallel load balancing (EPLB): from per-layer expert loads, place
//! logical experts and their redundant replicas on GPUs so that GPU loads even
//! out. This is DeepSeek's published algorithm: the hierarchical policy packs
//! expert groups onto nodes, replicates the heaviest experts within each node,
//! then packs the replicas onto the node's GPUs; when groups do not divide
//! evenly by nodes, the global policy treats the cluster as one node with one
//! group. Ties are broken by lower index, so the result is a pure function of
//! the input.
//!
//! Unlike the published code, the physical slots need not divide evenly over
//! the GPUs (256 experts + 32 redundant on 64 GPUs): within each node the
//! first GPUs get one slot more, and packing fills each GPU to its own count.
//!
//! [`ExpertLoadTracker`] is the run-time side: it folds each step's routed
//! rows per (layer, expert) into an exponential moving average and says when
//! a new placement is due.

/// A placement for every layer.
#[derive(Clone, Debug, PartialEq)]
pub struct Placement {
    /// `[layer][physical slot]` → logical expert. Slot `s` lives on GPU `gpu_of_slot[s]`.
    pub phy_to_log: Vec<Vec<usize>>,
    /// `[layer][physical slot]` → which replica of its expert this slot is (0-based).
    pub replica_rank: Vec<Vec<usize>>,
    /// `[layer][logical expert]` → physical slots holding it, by replica rank.
    pub log_to_phy: Vec<Vec<Vec<usize>>>,
    /// `[layer][logical expert]` → number of replicas.
    pub replica_counts: Vec<Vec<usize>>,
    /// Physical slot → GPU (the same for every layer; contiguous per GPU).
    pub gpu_of_slot: Vec<usize>,
    pub num_gpus: usize,
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EplbError {
    #[error("the load matrix is empty or its rows differ in length")]
    Shape,
    #[error("{what} ({value}) must be a positive multiple of {of} ({divisor})")]
    NotDivisible { what: &'static str, value: usize, of: &'static str, divisor: usize },
    #[error("{physical} physical slots cannot hold {logical} logical experts")]
    TooFewSlots { physical: usize, logical: usize },
    #[error("loads must be finite and non-negative")]
    BadLoad,
    #[error("{physical} physical slots cannot give each of {gpus} GPUs one")]
    TooFewSlotsForGpus { physical: usize, gpus: usize },
    #[error("a step's loads have {got} values, expected {want} (layers × experts)")]
    LoadCount { got: usize, want: usize },
}

/// Compute a placement of `num_physical` slots (logical experts plus redundant
/// replicas) over `num_gpus` GPUs on `num_nodes` nodes, with experts in
/// `num_groups` contiguous groups. `load[layer][expert]` is any non-negative
/// measure of work (tokens routed, a moving average). The hierarchical
/// policy needs the slots to divide by nodes; the GPUs of a node may hold
/// slot counts that differ by one.
pub fn rebalance(
    load: &[Vec<f64>],
    num_physical: usize,
    num_groups: usize,
    num_nodes: usize,
    num_gpus: usize,
) -> Result<Placement, EplbError> {
    let logical = load.first().map(Vec::len).ok_or(EplbError::Shape)?;
    if logical == 0 || load.iter().any(|row| row.len() != logical) {
        return Err(EplbError::Shape);
    }
    if load.iter().flatten().any(|v| !v.is_finite() || *v < 0.0) {
        return Err(EplbError::BadLoad);
    }
    if num_physical < logical {
        return Err(EplbError::TooFewSlots { physical: num_physical, logical });
    }
    let (groups, nodes) = if num_groups > 0 && num_nodes > 0 && num_groups.is_multiple_of(num_nodes) {
        (num_groups, num_nodes)
    } else {
        (1, 1)
    };
    let check = |what, value: usize, of, divisor: usize| {
        if divisor == 0 || value == 0 || !value.is_multiple_of(divisor) {
            Err(EplbError::NotDivisible { what, value, of, divisor })
        } else {
            Ok(())
        }
    };
    check("logical experts", logical, "groups", groups)?;
    check("GPUs", num_gpus, "nodes", nodes)?;
    check("physical slots", num_physical, "nodes", nodes)?;
    if num_physical < num_gpus {
        return Err(EplbError::TooFewSlotsForGpus { physical: num_physical, gpus: num_gpus });
    }
    let caps = gpu_slots(num_physical / nodes, num_gpus / nodes);
    let per_node = caps.len();
    let mut gpu_of_slot = Vec::with_capacity(num_physical);
    for n in 0..nodes {
        for (g, &c) in caps.iter().enumerate() {
            gpu_of_slot.extend(std::iter::repeat_n(n * per_node + g, c));
        }
    }

    let mut placement = Placement {
        phy_to_log: Vec::new(),
        replica_rank: Vec::new(),
        log_to_phy: Vec::new(),
        replica_counts: Vec::new(),
        gpu_of_slot,
        num_gpus,
    };
    for row in load {
        let (phy_to_log, rank, counts) = hierarchical(row, num_physical, groups, nodes, &caps);
        let mut log_to_phy = vec![Vec::new(); logical];
        for (slot, (&e, &r)) in phy_to_log.iter().zip(&rank).enumerate() {
            let replicas: &mut Vec<usize> = &mut log_to_phy[e];
            if replicas.len() <= r {
                replicas.resize(r + 1, usize::MAX);
            }
            replicas[r] = slot;
        }
        placement.phy_to_log.push(phy_to_log);
        placement.replica_rank.push(rank);
        placement.log_to_phy.push(log_to_phy);
        placement.replica_counts.push(counts);
    }
    Ok(placement)
}

/// Slots of each GPU of a node: `per_node` slots over `gpus`, the first ones one more.
fn gpu_slots(per_node: usize, gpus: usize) -> Vec<usize> {
    (0..gpus).map(|g| per_node / gpus + usize::from(g < per_node % gpus)).collect()
}

impl Placement {
    /// The most slots any GPU holds.
    pub fn slots_per_gpu(&self) -> usize {
        let mut count = vec![0; self.num_gpus];
        for &g in &self.gpu_of_slot {
            count[g] += 1;
        }
        count.into_iter().max().unwrap_or(0)
    }

    /// Load each GPU carries in `layer` when an expert's load splits evenly over its replicas.
    pub fn gpu_loads(&self, layer: usize, load: &[f64]) -> Vec<f64> {
        let mut gpus = vec![0.0; self.num_gpus];
        for (slot, &e) in self.phy_to_log[layer].iter().enumerate() {
            gpus[self.gpu_of_slot[slot]] += load[e] / self.replica_counts[layer][e] as f64;
        }
        gpus
    }

    /// GPUs holding a copy of `expert` in `layer`, ascending, without repeats.
    pub fn gpus_of(&self, layer: usize, expert: usize) -> Vec<usize> {
        let mut g: Vec<usize> = self.log_to_phy[layer][expert].iter().map(|&s| self.gpu_of_slot[s]).collect();
        g.sort_unstable();
        g.dedup();
        g
    }
}

/// Max over mean of per-GPU loads (1.0 is perfect balance).
pub fn imbalance(gpu_loads: &[f64]) -> f64 {
    let mean = gpu_loads.iter().sum::<f64>() / gpu_loads.len() as f64;
    let max = gpu_loads.iter().cloned().fold(0.0, f64::max);
    if mean > 0.0 {
        max / mean
    } else {
        1.0
    }
}

/// Indices sorted by weight, heaviest first; ties by lower index.
fn by_weight_desc(weight: &[f64]) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..weight.len()).collect();
    idx.sort_by(|&a, &b| weight[b].total_cmp(&weight[a]).then(a.cmp(&b)));
    idx
}

/// Pack `weight.len()` items into packs of `caps[p]` items each (the caps
/// add up to the item count), heaviest first into the lightest pack that
/// still has room. Returns (pack, rank in pack).
fn balanced_packing(weight: &[f64], caps: &[usize]) -> (Vec<usize>, Vec<usize>) {
    let n = weight.len();
    let packs = caps.len();
    debug_assert_eq!(caps.iter().sum::<usize>(), n);
    if caps.iter().all(|&c| c == 1) {
        return ((0..n).collect(), vec![0; n]);
    }
    let mut pack_of = vec![0; n];
    let mut rank = vec![0; n];
    let mut pack_weight = vec![0.0f64; packs];
    let mut pack_items = vec![0usize; packs];
    for item in by_weight_desc(weight) {
        let pack = (0..packs)
            .filter(|&p| pack_items[p] < caps[p])
            .min_by(|&a, &b| pack_weight[a].total_cmp(&pack_weight[b]).then(a.cmp(&b)))
            .expect("a pack has room");
        pack_of[item] = pack;
        rank[item] = pack_items[pack];
        pack_weight[pack] += weight[item];
        pack_items[pack] += 1;
    }
    (pack_of, rank)
}

/// Give `physical − logical` extra replicas, one at a time, to the expert with
/// the highest load per replica. Returns (slot → expert, slot → replica rank, replica counts).
fn replicate(weight: &[f64], physical: usize) -> (Vec<usize>, Vec<usize>, Vec<usize>) {
    let logical = weight.len();
    let mut phy_to_log: Vec<usize> = (0..logical).collect();
    let mut rank = vec![0; logical];
    let mut counts = vec![1usize; logical];
    for _ in logical..physical {
        let mut best = 0;
        for e in 1..logical {
            if weight[e] / counts[e] as f64 > weight[best] / counts[best] as f64 {
                best = e;
            }
        }
        phy_to_log.push(best);
        rank.push(counts[best]);
        counts[best] += 1;
    }
    (phy_to_log, rank, counts)
}

/// One layer of the hierarchical policy; `caps` are the slots of each GPU of a node.
fn hierarchical(
    weight: &[f64],
    physical: usize,
    groups: usize,
    nodes: usize,
    caps: &[usize],
) -> (Vec<usize>, Vec<usize>, Vec<usize>) {
    let logical = weight.len();
    let group_size = logical / groups;
    let groups_per_node = groups / nodes;
    let gpu_start: Vec<usize> = caps.iter().scan(0, |at, &c| Some(std::mem::replace(at, *at + c))).collect();
    let per_node_logical = logical / nodes;
    let per_node_physical = physical / nodes;

    // 1. Pack expert groups onto nodes; "mlog" numbers experts node by node.
    let group_load: Vec<f64> = (0..groups).map(|g| weight[g * group_size..(g + 1) * group_size].iter().sum()).collect();
    let (group_pack, group_rank) = balanced_packing(&group_load, &vec![groups_per_node; nodes]);
    let mut log_to_mlog = vec![0; logical];
    for (e, m) in log_to_mlog.iter_mut().enumerate() {
        let g = e / group_size;
        *m = (group_pack[g] * groups_per_node + group_rank[g]) * group_size + e % group_size;
    }
    let mut mlog_to_log = vec![0; logical];
    for (e, &m) in log_to_mlog.iter().enumerate() {
        mlog_to_log[m] = e;
    }

    let mut phy_to_log = vec![0; physical];
    let mut phy_rank = vec![0; physical];
    let mut mlog_counts = vec![0; logical];
    for node in 0..nodes {
        // 2. Replicate the heaviest experts within the node.
        let node_weight: Vec<f64> =
            (0..per_node_logical).map(|i| weight[mlog_to_log[node * per_node_logical + i]]).collect();
        let (phy_to_local, rank, counts) = replicate(&node_weight, per_node_physical);
        // 3. Pack the node's replicas onto its GPUs by load per replica.
        let replica_load: Vec<f64> = phy_to_local.iter().map(|&i| node_weight[i] / counts[i] as f64).collect();
        let (gpu_of, rank_on_gpu) = balanced_packing(&replica_load, caps);
        for (p, &local) in phy_to_local.iter().enumerate() {
            let slot = node * per_node_physical + gpu_start[gpu_of[p]] + rank_on_gpu[p];
            phy_to_log[slot] = mlog_to_log[node * per_node_logical + local];
            phy_rank[slot] = rank[p];
        }
        for (i, &c) in counts.iter().enumerate() {
            mlog_counts[node * per_node_logical + i] = c;
        }
    }
    let counts = (0..logical).map(|e| mlog_counts[log_to_mlog[e]]).collect();
    (phy_to_log, phy_rank, counts)
}

/// Per-layer expert loads measured at run time: an exponential moving average
/// of the rows routed to each expert per step, and the cadence of rebalancing.
#[derive(Clone, Debug, PartialEq)]
pub struct ExpertLoadTracker {
    layers: usize,
    experts: usize,
    /// Weight of the newest step in the average (0 < decay ≤ 1).
    decay: f64,
    /// Steps between placements.
    every: u64,
    steps: u64,
    last: u64,
    ema: Vec<Vec<f64>>,
}

impl ExpertLoadTracker {
    /// `decay` is clamped into (0, 1]; `every` to at least one step.
    pub fn new(layers: usize, experts: usize, decay: f64, every: u64) -> Self {
        let decay = if decay.is_finite() { decay.clamp(1e-6, 1.0) } else { 1.0 };
        Self { layers, experts, decay, every: every.max(1), steps: 0, last: 0, ema: vec![vec![0.0; experts]; layers] }
    }

    /// Fold one step's rows per (layer, expert), `layers × experts` values row-major.
    /// The first step seeds the average.
    pub fn record_step(&mut self, rows: &[u32]) -> Result<(), EplbError> {
        let want = self.layers * self.experts;
        if rows.len() != want {
            return Err(EplbError::LoadCount { got: rows.len(), want });
        }
        let a = if self.steps == 0 { 1.0 } else { self.decay };
        for (l, layer) in self.ema.iter_mut().enumerate() {
            for (e, v) in layer.iter_mut().enumerate() {
                *v = a * rows[l * self.experts + e] as f64 + (1.0 - a) * *v;
            }
        }
        self.steps += 1;
        Ok(())
    }

    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// The averaged loads, `[layer][expert]`.
    pub fn loads(&self) -> &[Vec<f64>] {
        &self.ema
    }

    /// Loads summed over layers: for a placement shared by every layer.
    pub fn total_loads(&self) -> Vec<f64> {
        (0..self.experts).map(|e| self.ema.iter().map(|l| l[e]).sum()).collect()
    }

    /// `every` steps have been recorded since the last placement.
    pub fn should_rebalance(&self) -> bool {
        self.steps > 0 && self.steps - self.last >= self.every
    }

    /// A new placement from the averaged loads; the cadence restarts.
    pub fn rebalance(
        &mut self,
        num_physical: usize,
        num_groups: usize,
        num_nodes: usize,
        num_gpus: usize,
    ) -> Result<Placement, EplbError> {
        self.last = self.steps;
        rebalance(&self.ema, num_physical, num_groups, num_nodes, num_gpus)
    }

    /// One placement for every layer (a runtime whose table is shared by
    /// all layers) from the loads summed over layers; the cadence restarts.
    pub fn rebalance_summed(
        &mut self,
        num_physical: usize,
        num_groups: usize,
        num_nodes: usize,
        num_gpus: usize,
    ) -> Result<Placement, EplbError> {
        self.last = self.steps;
        rebalance(&[self.total_loads()], num_physical, num_groups, num_nodes, num_gpus)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The worked example published with DeepSeek's EPLB: 2 layers, 12 experts in
    /// 4 groups, 16 physical slots on 8 GPUs in 2 nodes.
    #[test]
    fn matches_the_published_example() {
        let load = vec![
            vec![90.0, 132.0, 40.0, 61.0, 104.0, 165.0, 39.0, 4.0, 73.0, 56.0, 183.0, 86.0],
            vec![20.0, 107.0, 104.0, 64.0, 19.0, 197.0, 187.0, 157.0, 172.0, 86.0, 16.0, 27.0],
        ];
        let p = rebalance(&load, 16, 4, 2, 8).unwrap();
        assert_eq!(p.phy_to_log[0], vec![5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1]);
        assert_eq!(p.phy_to_log[1], vec![7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]);
    }

    /// Worked by hand. 4 experts, loads [8, 4, 2, 2], 6 slots on 2 GPUs, global.
    /// Replicas (highest load per replica, ties to the lower index):
    ///   8,4,2,2 → expert 0 (8) → 4,4,2,2 → expert 0 again (tie 4 = 4, lower index)
    ///   counts [3,1,1,1]; slots 0..4 = experts 0..3, slots 4,5 = expert 0 ranks 1,2.
    /// Per-replica loads [8/3, 4, 2, 2, 8/3, 8/3]. Packing, heaviest first into the
    /// lightest GPU with room (3 each): r1(4)→G0; r0→G1 (2.67); r4→G1 (5.33);
    /// r5→G0 (6.67); r2→G1 (7.33, full); r3→G0 (8.67).
    /// G0 = [r1, r5, r3] = experts [1, 0, 3]; G1 = [r0, r4, r2] = experts [0, 0, 2].
    #[test]
    fn hand_worked_global_placement() {
        let p = rebalance(&[vec![8.0, 4.0, 2.0, 2.0]], 6, 1, 1, 2).unwrap();
        assert_eq!(p.phy_to_log[0], vec![1, 0, 3, 0, 0, 2]);
        assert_eq!(p.replica_rank[0], vec![0, 2, 0, 0, 1, 0]);
        assert_eq!(p.replica_counts[0], vec![3, 1, 1, 1]);
        assert_eq!(p.log_to_phy[0], vec![vec![3, 4, 1], vec![0], vec![5], vec![2]]);
        assert_eq!(p.gpu_of_slot, vec![0, 0, 0, 1, 1, 1]);
        let loads = p.gpu_loads(0, &[8.0, 4.0, 2.0, 2.0]);
        assert!((loads[0] - 26.0 / 3.0).abs() < 1e-12 && (loads[1] - 22.0 / 3.0).abs() < 1e-12);
        assert_eq!(p.gpus_of(0, 0), vec![0, 1]);
    }

    /// Worked by hand. Slots that do not divide over GPUs: 3 experts [6, 3, 3],
    /// 5 slots on 2 GPUs → GPU 0 holds 3 slots, GPU 1 holds 2.
    /// Replicas: 6 → expert 0; then 3,3,3 → expert 0 (lower index): counts [3,1,1],
    /// per-replica loads [2, 3, 3, 2, 2]. Packing: r1(3)→G0; r2(3)→G1; r0(2)→G0 (3 = 3,
    /// lower index) → 5; r3→G1 → 5, full; r4→G0 → 7.
    /// G0 = [r1, r0, r4] = experts [1, 0, 0]; G1 = [r2, r3] = experts [2, 0].
    #[test]
    fn hand_worked_uneven_slots() {
        let p = rebalance(&[vec![6.0, 3.0, 3.0]], 5, 1, 1, 2).unwrap();
        assert_eq!(p.gpu_of_slot, vec![0, 0, 0, 1, 1]);
        assert_eq!(p.phy_to_log[0], vec![1, 0, 0, 2, 0]);
        assert_eq!(p.replica_rank[0], vec![0, 0, 2, 0, 1]);
        assert_eq!(p.gpu_loads(0, &[6.0, 3.0, 3.0]), vec![7.0, 5.0]);
        assert_eq!(p.slots_per_gpu(), 3);
    }

    /// Worked by hand. Hierarchical: 4 experts in 2 groups {0,1} {2,3}, loads
    /// [1, 1, 5, 3], 2 nodes × 1 GPU, 6 slots (3 per node).
    /// Groups weigh 2 and 8: one group per node, so group 0 → node 0, group 1 → node 1.
    /// Node 0 replicates expert 0 (1 = 1, lower index): replicas [0, 1, 0] with
    /// per-replica loads [0.5, 1, 0.5]; its one GPU takes them heaviest first:
    /// slots [1, 0, 0]. Node 1 replicates expert 2 (5 > 3): replicas [2, 3, 2],
    /// loads [2.5, 3, 2.5] → slots [3, 2, 2].
    #[test]
    fn hand_worked_hierarchical_placement() {
        let p = rebalance(&[vec![1.0, 1.0, 5.0, 3.0]], 6, 2, 2, 2).unwrap();
        assert_eq!(p.phy_to_log[0], vec![1, 0, 0, 3, 2, 2]);
        assert_eq!(p.replica_rank[0], vec![0, 0, 1, 0, 0, 1]);
        assert_eq!(p.replica_counts[0], vec![2, 1, 2, 1]);
        assert_eq!(p.gpu_loads(0, &[1.0, 1.0, 5.0, 3.0]), vec![2.0, 8.0]);
    }

    #[test]
    fn tracker_averages_and_paces_rebalancing() {
        let mut t = ExpertLoadTracker::new(2, 2, 0.5, 3);
        assert!(!t.should_rebalance());
        assert!(matches!(t.record_step(&[1, 2, 3]), Err(EplbError::LoadCount { got: 3, want: 4 })));
        t.record_step(&[4, 0, 0, 8]).unwrap(); // seeds: [[4,0],[0,8]]
        t.record_step(&[0, 4, 2, 0]).unwrap(); // ½ new + ½ old: [[2,2],[1,4]]
        assert_eq!(t.loads(), &[vec![2.0, 2.0], vec![1.0, 4.0]]);
        assert_eq!(t.total_loads(), vec![3.0, 6.0]);
        assert!(!t.should_rebalance());
        t.record_step(&[2, 2, 1, 4]).unwrap(); // unchanged
        assert!(t.should_rebalance());
        let p = t.rebalance(3, 1, 1, 1).unwrap();
        // Layer 1: expert 1 (4) gets the spare slot.
        assert_eq!(p.replica_counts[1], vec![1, 2]);
        assert!(!t.should_rebalance());
        for _ in 0..3 {
            t.record_step(&[0; 4]).unwrap();
        }
        assert!(t.should_rebalance());
        assert_eq!(t.loads()[1][1], 0.5);
    }

    #[test]
    fn packing_fills_the_lightest_pack_with_room() {
        let (pack, rank) = balanced_packing(&[5.0, 4.0, 3.0, 2.0], &[2, 2]);
        assert_eq!(pack, vec![0, 1, 1, 0]);
        assert_eq!(rank, vec![0, 0, 1, 1]);
    }

    #[test]
    fn replicas_go_to_the_highest_load_per_replica() {
        let (phy, rank, counts) = replicate(&[10.0, 1.0, 4.0, 1.0], 7);
        // 10 → 5 → 4 (tie with expert 2: lower index wins) → then 2 (4 > 3.33).
        assert_eq!(phy, vec![0, 1, 2, 3, 0, 0, 2]);
        assert_eq!(rank, vec![0, 0, 0, 0, 1, 2, 1]);
        assert_eq!(counts, vec![3, 1, 2, 1]);
    }

    #[test]
    fn groups_that_do_not_divide_by_nodes_use_the_global_policy() {
        let load = vec![vec![9.0, 1.0, 7.0, 3.0, 5.0, 5.0]];
        let global = rebalance(&load, 8, 1, 1, 4).unwrap();
        assert_eq!(rebalance(&load, 8, 3, 2, 4).unwrap(), global);
    }

    #[test]
    fn every_expert_is_placed_and_the_maps_agree() {
        let load: Vec<Vec<f64>> =
            (0..3).map(|l| (0..16).map(|e| ((e * 7 + l * 5) % 11) as f64 + 0.5).collect()).collect();
        let p = rebalance(&load, 24, 4, 2, 8).unwrap();
        for (l, layer_load) in load.iter().enumerate() {
            assert_eq!(p.replica_counts[l].iter().sum::<usize>(), 24);
            for (e, slots) in p.log_to_phy[l].iter().enumerate() {
                assert_eq!(slots.len(), p.replica_counts[l][e]);
                for (r, &s) in slots.iter().enumerate() {
                    assert_eq!((p.phy_to_log[l][s], p.replica_rank[l][s]), (e, r));
                }
            }
            let loads = p.gpu_loads(l, layer_load);
            assert!((loads.iter().sum::<f64>() - layer_load.iter().sum::<f64>()).abs() < 1e-9);
        }
    }

    #[test]
    fn uniform_load_is_balanced_and_bad_input_is_refused() {
        let load = vec![vec![1.0; 8]];
        let p = rebalance(&load, 8, 2, 2, 4).unwrap();
        assert_eq!(imbalance(&p.gpu_loads(0, &load[0])), 1.0);
        assert_eq!(rebalance(&load, 7, 2, 2, 4), Err(EplbError::TooFewSlots { physical: 7, logical: 8 }));
        assert!(matches!(rebalance(&load, 9, 2, 2, 4), Err(EplbError::NotDivisible { .. })));
        assert_eq!(rebalance(&load, 8, 1, 1, 9), Err(EplbError::TooFewSlotsForGpus { physical: 8, gpus: 9 }));
        assert_eq!(rebalance(&[vec![1.0, f64::NAN]], 2, 1, 1, 1), Err(EplbError::BadLoad));
        assert_eq!(rebalance(&[], 2, 1, 1, 1), Err(EplbError::Shape));
    }
}
