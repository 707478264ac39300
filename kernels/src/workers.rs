//! Running a step's work on the thread pool's own workers.
//!
//! A parallel loop started from a thread outside rayon's pool injects its jobs,
//! wakes sleeping workers and blocks its caller until they finish: two
//! wake-ups per loop, and the caller's serial work between loops runs while
//! the workers have gone back to sleep. Started on a worker, the same loop
//! pushes its halves onto that worker's queue, where a worker still spinning
//! from the previous loop takes them at once. Results do not depend on where
//! a kernel runs: every kernel's bits are the same on any number of threads.

/// Runs `work` on a worker of the global pool, or here when this thread is
/// already one of its workers or the pool has a single thread.
pub fn on_workers<R: Send>(work: impl FnOnce() -> R + Send) -> R {
    if rayon::current_thread_index().is_some() || rayon::current_num_threads() == 1 {
        return work();
    }
    // `scope` runs its body on a worker of the global pool and waits for it.
    rayon::scope(|_| work())
}
