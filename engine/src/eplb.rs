//! Expert-parallel load balancing (EPLB): from per-layer expert loads, place
//! logical experts and their redundant replicas on GPUs so that GPU loads even
//! out. This is DeepSeek's published algorithm: the hierarchical policy packs
//! expert groups onto nodes, replicates the heaviest experts within each node,
//! then packs the replicas onto the node's GPUs; when groups do not divide
//! evenly by nodes, the global policy treats the cluster as one node with one
//! group. Ties are broken by lower index, so the result is a pure function of
//! the input.

/// A placement for every layer.
#[derive(Clone, Debug, PartialEq)]
pub struct Placement {
    /// `[layer][physical slot]` → logical expert. Slot `s` lives on GPU `s / slots_per_gpu`.
    pub phy_to_log: Vec<Vec<usize>>,
    /// `[layer][physical slot]` → which replica of its expert this slot is (0-based).
    pub replica_rank: Vec<Vec<usize>>,
    /// `[layer][logical expert]` → physical slots holding it, by replica rank.
    pub log_to_phy: Vec<Vec<Vec<usize>>>,
    /// `[layer][logical expert]` → number of replicas.
    pub replica_counts: Vec<Vec<usize>>,
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
}

/// Compute a placement of `num_physical` slots (logical experts plus redundant
/// replicas) over `num_gpus` GPUs on `num_nodes` nodes, with experts in
/// `num_groups` contiguous groups. `load[layer][expert]` is any non-negative
/// measure of work (tokens routed, a moving average).
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
    check("physical slots", num_physical, "GPUs", num_gpus)?;

    let mut placement = Placement {
        phy_to_log: Vec::new(),
        replica_rank: Vec::new(),
        log_to_phy: Vec::new(),
        replica_counts: Vec::new(),
        num_gpus,
    };
    for row in load {
        let (phy_to_log, rank, counts) = hierarchical(row, num_physical, groups, nodes, num_gpus);
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

impl Placement {
    pub fn slots_per_gpu(&self) -> usize {
        self.phy_to_log.first().map_or(0, |l| l.len() / self.num_gpus)
    }

    /// Load each GPU carries in `layer` when an expert's load splits evenly over its replicas.
    pub fn gpu_loads(&self, layer: usize, load: &[f64]) -> Vec<f64> {
        let per_gpu = self.slots_per_gpu();
        let mut gpus = vec![0.0; self.num_gpus];
        for (slot, &e) in self.phy_to_log[layer].iter().enumerate() {
            gpus[slot / per_gpu] += load[e] / self.replica_counts[layer][e] as f64;
        }
        gpus
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

/// Pack `weight.len()` items into `packs` packs of equal item count, heaviest
/// first into the lightest pack that still has room. Returns (pack, rank in pack).
fn balanced_packing(weight: &[f64], packs: usize) -> (Vec<usize>, Vec<usize>) {
    let n = weight.len();
    let per_pack = n / packs;
    if per_pack == 1 {
        return ((0..n).collect(), vec![0; n]);
    }
    let mut pack_of = vec![0; n];
    let mut rank = vec![0; n];
    let mut pack_weight = vec![0.0f64; packs];
    let mut pack_items = vec![0usize; packs];
    for item in by_weight_desc(weight) {
        let pack = (0..packs)
            .filter(|&p| pack_items[p] < per_pack)
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

/// One layer of the hierarchical policy.
fn hierarchical(
    weight: &[f64],
    physical: usize,
    groups: usize,
    nodes: usize,
    gpus: usize,
) -> (Vec<usize>, Vec<usize>, Vec<usize>) {
    let logical = weight.len();
    let group_size = logical / groups;
    let groups_per_node = groups / nodes;
    let slots_per_gpu = physical / gpus;
    let per_node_logical = logical / nodes;
    let per_node_physical = physical / nodes;

    // 1. Pack expert groups onto nodes; "mlog" numbers experts node by node.
    let group_load: Vec<f64> = (0..groups).map(|g| weight[g * group_size..(g + 1) * group_size].iter().sum()).collect();
    let (group_pack, group_rank) = balanced_packing(&group_load, nodes);
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
        let (gpu_of, rank_on_gpu) = balanced_packing(&replica_load, gpus / nodes);
        for (p, &local) in phy_to_local.iter().enumerate() {
            let slot = node * per_node_physical + gpu_of[p] * slots_per_gpu + rank_on_gpu[p];
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

    #[test]
    fn packing_fills_the_lightest_pack_with_room() {
        let (pack, rank) = balanced_packing(&[5.0, 4.0, 3.0, 2.0], 2);
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
        assert!(matches!(rebalance(&load, 10, 2, 2, 4), Err(EplbError::NotDivisible { .. })));
        assert_eq!(rebalance(&[vec![1.0, f64::NAN]], 2, 1, 1, 1), Err(EplbError::BadLoad));
        assert_eq!(rebalance(&[], 2, 1, 1, 1), Err(EplbError::Shape));
    }
}
