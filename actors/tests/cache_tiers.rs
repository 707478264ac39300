//! The prompt cache below a cluster instance's KV pool, on computing devices
//! in deterministic simulation: blocks the pool evicts wait in the node's
//! host memory and come back up for a request that shares the prefix, which
//! gets the single-device engine's tokens.

mod common;

use common::{model, prompt, reference, request};
use deepinfer_actors::cluster::NodeCacheTiers;
use deepinfer_actors::{simulate, Cluster, ClusterConfig, GenRequest, Update};
use deepinfer_engine::engine::EngineConfig;
use deepinfer_engine::kv_pool::KvLayout;
use deepinfer_engine::sampling::SamplingParams;

/// Run each request alone, in order: its tokens and the prompt tokens the cache served.
async fn one_by_one(c: &mut Cluster, requests: &[GenRequest]) -> Vec<(Vec<u32>, usize)> {
    let mut out = Vec::new();
    for r in requests {
        let id = c.submit(r.clone());
        let (mut tokens, mut cached) = (Vec::new(), 0);
        while let Some(u) = c.next_update().await {
            match u {
                Update::Tokens { id: i, tokens: t, cached_tokens } if i == id => {
                    tokens.extend(t.iter().map(|t| t.token));
                    cached = cached.max(cached_tokens);
                }
                Update::Refused { reason, .. } => panic!("refused: {reason}"),
                _ => {}
            }
        }
        out.push((tokens, cached));
    }
    out
}

/// A one-device instance whose pool holds about two of these prompts.
fn config(host_bytes: usize) -> ClusterConfig {
    let m = model();
    let engine = EngineConfig::default();
    let bt = KvLayout::default_block_tokens(&m.config);
    let layout = KvLayout::new(&m.config, bt, engine.window_block_tokens).unwrap();
    let mut cfg = ClusterConfig::new(1, 1);
    cfg.devices_per_node = 1;
    cfg.engine = EngineConfig { kv_budget_bytes: layout.sequence_bytes(600), ..engine };
    cfg.cache_tiers = NodeCacheTiers { host_bytes, ..Default::default() };
    cfg
}

#[test]
fn blocks_the_pool_evicts_come_back_up_from_host_memory() {
    let m = model();
    let shared = prompt(260, 8);
    let greedy = SamplingParams::default();
    let mut requests = vec![request([shared.clone(), prompt(3, 1)].concat(), 3, greedy.clone())];
    // Other long prompts push the first one's blocks out of the pool.
    requests.extend((0..4).map(|i| request(prompt(260, 20 + i), 3, greedy.clone())));
    let again = request([shared.clone(), prompt(5, 2)].concat(), 3, greedy.clone());
    requests.push(again.clone());
    let want = reference(&m, std::slice::from_ref(&again)).remove(0);

    let (got, report) = simulate(m.clone(), config(64 << 20), async |c: &mut Cluster| one_by_one(c, &requests).await)
        .expect("the cluster runs");
    let (tokens, cached) = got.last().unwrap().clone();
    assert_eq!(tokens, want.tokens, "the single device's tokens");
    assert!(cached >= 4 * 64, "the shared prefix came back up: {cached} cached tokens");
    assert!(report.metrics.host_blocks_in > 0 && report.metrics.host_hit_blocks >= 4, "{:?}", report.metrics);

    // Without host memory the same run recomputes the prefix: the pool did evict it.
    let (got, report) = simulate(m.clone(), config(0), async |c: &mut Cluster| one_by_one(c, &requests).await)
        .expect("the cluster runs");
    assert_eq!(got.last().unwrap().0, want.tokens);
    assert_eq!(got.last().unwrap().1, 0, "nothing cached without a host tier");
    assert_eq!(report.metrics.host_hit_blocks, 0);
}
