use deepinfer_engine::model::{Chunk, LogitsWanted};
use deepinfer_engine::presets::{build, Preset};
use std::time::Instant;
#[test]
#[ignore]
fn scratch() {
    let model = build(Preset::SmallV4, 1).unwrap();
    let toks: Vec<u32> = (0..1024u32).map(|i| 2 + (i * 7919) % 1000).collect();
    for sub in [1024usize, 256, 128, 64] {
        let mut st = model.new_state();
        let t = Instant::now();
        for c in toks.chunks(sub) {
            model.forward(&mut [Chunk::new(c, &mut st)], LogitsWanted::None, false);
        }
        println!("small sub {sub}: {:?}", t.elapsed());
    }
    let model = build(Preset::TinyV4, 1).unwrap();
    for sub in [1024usize, 64, 16] {
        let mut st = model.new_state();
        let t = Instant::now();
        for c in toks.chunks(sub) {
            model.forward(&mut [Chunk::new(c, &mut st)], LogitsWanted::None, false);
        }
        println!("tiny sub {sub}: {:?}", t.elapsed());
    }
}
