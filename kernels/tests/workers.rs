//! `on_workers` moves work onto the global pool's workers and leaves it
//! where it is when it is already there; the linears give the same bits
//! wherever they run.

use deepinfer_kernels::workers::on_workers;
use deepinfer_kernels::Linear;

fn two_worker_pool() {
    // One global pool per test process; every test here wants two workers.
    let _ = rayon::ThreadPoolBuilder::new().num_threads(2).build_global();
    assert_eq!(rayon::current_num_threads(), 2, "the global pool has two workers");
}

#[test]
fn work_from_outside_runs_on_a_worker_and_nested_work_stays_inline() {
    two_worker_pool();
    assert!(rayon::current_thread_index().is_none(), "the test thread is outside the pool");
    let (outer, inner) = on_workers(|| {
        let outer = rayon::current_thread_index();
        let inner = on_workers(rayon::current_thread_index);
        (outer, inner)
    });
    assert!(outer.is_some(), "the work ran on a worker");
    assert_eq!(outer, inner, "nested work stays on the same worker");
}

#[test]
fn a_panic_in_the_work_reaches_the_caller() {
    two_worker_pool();
    let caught = std::panic::catch_unwind(|| on_workers(|| panic!("inside the work")));
    assert!(caught.is_err(), "the caller sees the panic");
    assert_eq!(on_workers(|| 7), 7, "the pool still runs work after a panic");
}

#[test]
fn a_split_linear_gives_the_same_bits_on_workers_and_outside() {
    two_worker_pool();
    // 1024 × 512 at batch 1 is above the split threshold, so on the workers
    // the rows are spread over both.
    let (rows, cols) = (1024, 512);
    let values: Vec<f32> = (0..rows * cols).map(|i| ((i * 7919 % 1013) as f32 - 506.0) / 317.0).collect();
    let linear = Linear::from_f32(rows, cols, values);
    let x: Vec<f32> = (0..cols).map(|i| ((i * 104_729 % 997) as f32 - 498.0) / 211.0).collect();
    let mut outside = vec![0.0f32; rows];
    linear.forward(&x, 1, &mut outside);
    let on_pool = on_workers(|| {
        let mut out = vec![0.0f32; rows];
        linear.forward(&x, 1, &mut out);
        out
    });
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<u32>>();
    assert_eq!(bits(&outside), bits(&on_pool), "the same bits wherever the linear runs");
}

#[test]
fn concurrent_callers_with_nested_loops_all_finish() {
    two_worker_pool();
    // Stand-by workers of one caller may be picked up inside another
    // caller's jobs; every call must still finish, with its own answer.
    use rayon::prelude::*;
    let (sender, receiver) = std::sync::mpsc::channel();
    for caller in 0..4u64 {
        let sender = sender.clone();
        std::thread::spawn(move || {
            for round in 0..50u64 {
                let sum = on_workers(|| {
                    (0..64u64)
                        .into_par_iter()
                        .map(|i| (0..32u64).into_par_iter().map(|j| i * j + caller + round).sum::<u64>())
                        .sum::<u64>()
                });
                let expected: u64 = (0..64u64).map(|i| (0..32u64).map(|j| i * j + caller + round).sum::<u64>()).sum();
                sender.send((caller, round, sum == expected)).expect("the test is listening");
            }
        });
    }
    drop(sender);
    let deadline = std::time::Duration::from_secs(120);
    for _ in 0..4 * 50 {
        let (caller, round, right) = receiver.recv_timeout(deadline).expect("every call finishes");
        assert!(right, "caller {caller}, round {round}: the sum of its own loops");
    }
}
