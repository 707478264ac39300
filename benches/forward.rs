//! Model throughput on CPU: prefill tokens/s, and decode tokens/s at batch 1
//! and 32, for the built-in presets (V4 and V4.1). `cargo bench --bench forward`
//! (or `-- v41` for the V4.1 presets only).

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use deepinfer_engine::model::{Chunk, LogitsWanted, Model, SequenceState};
use deepinfer_engine::presets::{build, Preset};

const PROMPT_TOKENS: usize = 128;

fn prompt(len: usize, salt: usize) -> Vec<u32> {
    (0..len).map(|i| 2 + ((i * 7919 + salt * 104729) % 1000) as u32).collect()
}

fn prefilled(model: &Model, batch: usize) -> Vec<SequenceState> {
    (0..batch)
        .map(|b| {
            let mut state = model.new_state();
            model.forward(&mut [Chunk::new(&prompt(PROMPT_TOKENS, b), &mut state)], LogitsWanted::None, false);
            state
        })
        .collect()
}

fn bench_preset(c: &mut Criterion, preset: Preset) {
    deepinfer::allocator::keep_freed_pages();
    let model = build(preset, 1).expect("preset builds");
    let mut group = c.benchmark_group(preset.name());
    group.sample_size(10);
    let small = matches!(preset, Preset::SmallV4 | Preset::SmallV41);
    group.measurement_time(std::time::Duration::from_secs(if small { 10 } else { 3 }));

    let tokens = prompt(PROMPT_TOKENS, 0);
    group.throughput(Throughput::Elements(PROMPT_TOKENS as u64));
    group.bench_function(format!("prefill {PROMPT_TOKENS} tokens"), |b| {
        b.iter(|| {
            let mut state = model.new_state();
            model.forward(&mut [Chunk::new(&tokens, &mut state)], LogitsWanted::Last, false)
        })
    });

    for batch in [1usize, 32] {
        let states = prefilled(&model, batch);
        let next: Vec<[u32; 1]> = (0..batch).map(|b| [2 + b as u32]).collect();
        group.throughput(Throughput::Elements(batch as u64));
        group.bench_function(format!("decode step, batch {batch}"), |b| {
            b.iter_batched(
                || states.clone(),
                |mut states| {
                    let mut chunks: Vec<Chunk> =
                        states.iter_mut().zip(&next).map(|(s, t)| Chunk::new(&t[..], s)).collect();
                    model.forward(&mut chunks, LogitsWanted::Last, false)
                },
                BatchSize::LargeInput,
            )
        });
    }
    group.finish();
}

fn tiny(c: &mut Criterion) {
    bench_preset(c, Preset::TinyV4);
}

fn small(c: &mut Criterion) {
    bench_preset(c, Preset::SmallV4);
}

fn tiny_v41(c: &mut Criterion) {
    bench_preset(c, Preset::TinyV41);
}

fn small_v41(c: &mut Criterion) {
    bench_preset(c, Preset::SmallV41);
}

criterion_group!(benches, tiny, small, tiny_v41, small_v41);
criterion_main!(benches);
