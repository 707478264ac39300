//! Running a step's work on the thread pool's own workers.
//!
//! A parallel loop started from a thread outside rayon's pool injects its jobs,
//! wakes sleeping workers and blocks its caller until they finish: two
//! wake-ups per loop, and the caller's serial work between loops runs while
//! the workers have gone back to sleep. Started on a worker, the same loop
//! pushes its halves onto that worker's queue, where a worker still spinning
//! from the previous loop takes them at once. Results do not depend on where
//! a kernel runs: every kernel's bits are the same on any number of threads.

use std::sync::atomic::{AtomicBool, Ordering};

/// Runs `work` on a worker of the global pool, or here when this thread is
/// already one of its workers or the pool has a single thread.
pub fn on_workers<R: Send>(work: impl FnOnce() -> R + Send) -> R {
    if rayon::current_thread_index().is_some() || rayon::current_num_threads() == 1 {
        return work();
    }
    let done = AtomicBool::new(false);
    // `scope` runs its body on a worker of the global pool and waits for it.
    rayon::scope(|scope| {
        let body = rayon::current_thread_index();
        for _ in 1..rayon::current_num_threads() {
            let done = &done;
            scope.spawn(move |_| stand_by(done, body));
        }
        let result = work();
        done.store(true, Ordering::Release);
        result
    })
}

/// Rounds a standing-by worker looks for a job in vain before it leaves the
/// pool's sleep to rayon again (a round is a fraction of a microsecond: the
/// worker's queue, the pool's, a steal from each other worker). Counted, not
/// timed: the kernels read no clock.
const STAND_BY_IDLE_ROUNDS_MAX: u32 = 20_000;

/// Keeps a worker taking the body's jobs the moment they appear, until the
/// body is done: between two parallel loops a rayon worker would fall asleep
/// and the next loop would wait for a wake-up (61 context switches a
/// `small-v4` decode step on two cores). A stand-by that finds itself on the
/// body's own thread returns at once (it would hold the body below it); one
/// picked up inside another job's wait holds that job back only while it
/// finds other jobs to run, then for `STAND_BY_IDLE_ROUNDS_MAX` rounds.
fn stand_by(done: &AtomicBool, body: Option<usize>) {
    if rayon::current_thread_index() == body {
        return;
    }
    let mut idle_rounds = 0;
    while !done.load(Ordering::Acquire) && idle_rounds < STAND_BY_IDLE_ROUNDS_MAX {
        match rayon::yield_now() {
            Some(rayon::Yield::Executed) => idle_rounds = 0,
            _ => {
                idle_rounds += 1;
                std::hint::spin_loop();
            }
        }
    }
}
