//! Time, handed in. Logic asks a [`Clock`] and never the operating system, so
//! the same actors run on wall time in production and on tokio's paused,
//! auto-advancing clock in simulation.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

pub type Sleep = Pin<Box<dyn Future<Output = ()> + Send + 'static>>;

/// Monotonic time since the clock was made, and sleeping on it.
pub trait Clock: Send + Sync + 'static {
    fn now(&self) -> Duration;
    fn sleep(&self, d: Duration) -> Sleep;
    /// True when time is virtual (simulation): the event log's times are then reproducible.
    fn is_virtual(&self) -> bool;
}

/// Wall time: the only place the crate reads the operating system's clock.
pub struct RealClock {
    start: std::time::Instant,
}

impl RealClock {
    pub fn new() -> Self {
        Self { start: std::time::Instant::now() }
    }
}

impl Default for RealClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for RealClock {
    fn now(&self) -> Duration {
        self.start.elapsed()
    }
    fn sleep(&self, d: Duration) -> Sleep {
        Box::pin(tokio::time::sleep(d))
    }
    fn is_virtual(&self) -> bool {
        false
    }
}

/// Virtual time with nanosecond resolution for simulation.
///
/// Tokio's paused clock advances only when every task is idle, but to the
/// millisecond. This clock keeps its own timer queue and uses tokio's paused
/// clock as an idle detector: a driver task sleeps one tokio millisecond,
/// which completes only once nothing else can run; it then moves virtual time
/// to the earliest pending deadline and wakes those sleepers, in (deadline,
/// creation) order. Computation therefore costs no virtual time, and a
/// timeout fires only when the system is really waiting for it.
pub struct SimClock {
    inner: Arc<SimInner>,
}

struct SimInner {
    state: Mutex<SimState>,
}

struct SimState {
    now: Duration,
    next: u64,
    timers: BTreeMap<(Duration, u64), Option<Waker>>,
}

impl SimInner {
    fn lock(&self) -> std::sync::MutexGuard<'_, SimState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl SimClock {
    /// Start the clock's driver on the current runtime, which must be a
    /// current-thread runtime with tokio's clock paused (`start_paused(true)`).
    pub fn start() -> Arc<Self> {
        let inner = Arc::new(SimInner {
            state: Mutex::new(SimState { now: Duration::ZERO, next: 0, timers: BTreeMap::new() }),
        });
        tokio::spawn(drive(Arc::downgrade(&inner)));
        Arc::new(Self { inner })
    }
}

async fn drive(clock: Weak<SimInner>) {
    loop {
        tokio::time::sleep(Duration::from_millis(1)).await;
        let Some(inner) = clock.upgrade() else { return };
        let wakers: Vec<Waker> = {
            let mut st = inner.lock();
            let Some((&(at, _), _)) = st.timers.first_key_value() else { continue };
            st.now = st.now.max(at);
            let now = st.now;
            let mut due = Vec::new();
            while let Some(entry) = st.timers.first_entry() {
                if entry.key().0 > now {
                    break;
                }
                if let Some(w) = entry.remove() {
                    due.push(w);
                }
            }
            due
        };
        for w in wakers {
            w.wake();
        }
    }
}

struct SimSleep {
    inner: Arc<SimInner>,
    key: (Duration, u64),
}

impl Future for SimSleep {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let mut st = self.inner.lock();
        if st.now >= self.key.0 {
            st.timers.remove(&self.key);
            return Poll::Ready(());
        }
        st.timers.insert(self.key, Some(cx.waker().clone()));
        Poll::Pending
    }
}

impl Drop for SimSleep {
    fn drop(&mut self) {
        self.inner.lock().timers.remove(&self.key);
    }
}

impl Clock for SimClock {
    fn now(&self) -> Duration {
        self.inner.lock().now
    }
    fn sleep(&self, d: Duration) -> Sleep {
        let mut st = self.inner.lock();
        let key = (st.now + d, st.next);
        st.next += 1;
        st.timers.insert(key, None);
        drop(st);
        Box::pin(SimSleep { inner: Arc::clone(&self.inner), key })
    }
    fn is_virtual(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn sim_clock_is_exact_and_ordered() {
        let clock = SimClock::start();
        assert_eq!(clock.now(), Duration::ZERO);
        clock.sleep(Duration::from_nanos(1500)).await;
        assert_eq!(clock.now(), Duration::from_nanos(1500));
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for (i, ns) in [(0u32, 900u64), (1, 300), (2, 300), (3, 50)] {
            let (c, o) = (Arc::clone(&clock), Arc::clone(&order));
            tasks.push(tokio::spawn(async move {
                c.sleep(Duration::from_nanos(ns)).await;
                o.lock().unwrap().push((i, c.now().as_nanos()));
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(*order.lock().unwrap(), vec![(3, 1550), (1, 1800), (2, 1800), (0, 2400)]);
        clock.sleep(Duration::from_secs(3600)).await;
        assert_eq!(clock.now(), Duration::from_secs(3600) + Duration::from_nanos(2400));
    }
}
