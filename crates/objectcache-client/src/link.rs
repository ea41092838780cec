//! The link scheduler: the tokio shell around the pure [`crate::sched::Scheduler`], shared by
//! the two sides that move KV bytes over one NIC under a bandwidth cap:
//! - the server (one per server, one NIC): it paces the gather units it writes to the socket
//!   (`server/gather/`);
//! - the client (one per [`crate::connector::Engine`], the host NIC share of its GPUs): it
//!   paces the ranged GETs of the stock-S3 path (`connector/load/ranged.rs`).
//!
//! Every load that is sending registers with its per-layer bytes and its scheduling
//! hints ([`Link::register`]) and leaves when it ends or is cancelled (dropping its
//! [`LinkLoad`]). The policy assigns each load a rate (bytes/s) at every arrival, departure,
//! layer completion and layer deadline ([`crate::sched::Scheduler::poll_timeout`]); the rates
//! of all loads sum to at most the cap. A load's send path paces its units with its rate: each
//! load accrues **credit** (bytes) at its current rate, and a unit of `n` bytes is released
//! once the load holds `n` bytes of credit ([`LinkLoad::pace`]). A unit therefore leaves at
//! the moment a fluid transfer at the allocated rates would have finished it, which is what
//! the simulator (`crate::sim`) models. Credit left unused while a load waits (for its backend
//! reads, its stripes' lockstep, or a full socket) is kept up to [`PACE_CATCH_UP_S`] of its
//! rate (or one unit, if more), so the load catches up on a hiccup instead of losing it, and
//! never bursts more than that above its rate.
//!
//! The time source stays here: `now` is seconds since the link was created (a monotonic
//! tokio clock), passed into the pure scheduler.
//!
//! Without a cap (`bandwidth_cap_bytes_per_s = 0`) no link is built and units go out as fast
//! as the socket takes them (the policies need a capacity to split).

use crate::protocol::SchedHints;
use crate::sched::{LoadId, LoadSpec, PolicyKind, Scheduler};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;

struct State {
    sched: Scheduler,
    /// Current rate of each load (bytes/s), from the last plan.
    rate: HashMap<LoadId, f64>,
    /// Credit of each load (bytes it may still send).
    credit: HashMap<LoadId, f64>,
    /// Time credits were last accrued (s since `epoch`).
    at: f64,
}

impl State {
    /// Accrues credit up to `now`, then re-plans if an event happened since the last plan
    /// (or a layer deadline passed). Returns true if the rates changed.
    fn advance(&mut self, now: f64) -> bool {
        let dt = (now - self.at).max(0.0);
        if dt > 0.0 {
            for (id, r) in &self.rate {
                if let Some(c) = self.credit.get_mut(id) {
                    *c += r * dt;
                }
            }
            self.at = now;
        }
        if self.sched.poll_timeout(now).is_some_and(|t| t <= now) {
            self.sched.handle_timeout(now);
        }
        let before = self.sched.replans();
        self.sched.poll_allocation(now);
        self.sched.replans() != before
    }
}

/// One link scheduler (module docs): one server's NIC or one engine's NIC share. Cheap to
/// share behind an [`Arc`].
pub struct Link {
    epoch: Instant,
    st: Mutex<State>,
    changed: watch::Sender<u64>,
    policy: PolicyKind,
    cap: f64,
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Link")
            .field("policy", &self.policy.name())
            .field("cap", &self.cap)
            .finish()
    }
}

impl Link {
    /// A link of `cap` bytes/s shared under `policy`.
    ///
    /// # Errors
    /// [`crate::Error::InvalidArgument`] unless `cap` is finite and > 0.
    pub fn new(policy: PolicyKind, cap: f64) -> crate::Result<Arc<Self>> {
        // The scheduler's own token bucket is unused here (units are paced by credit), but it
        // needs a burst > 0: one second of the cap.
        let sched = Scheduler::new(policy.build(), cap, cap, 0.0)?;
        Ok(Arc::new(Link {
            epoch: Instant::now(),
            st: Mutex::new(State {
                sched,
                rate: HashMap::new(),
                credit: HashMap::new(),
                at: 0.0,
            }),
            changed: watch::channel(0).0,
            policy,
            cap,
        }))
    }

    fn now(&self) -> f64 {
        self.epoch.elapsed().as_secs_f64()
    }

    fn replanned(&self, st: &mut State, now: f64) {
        if st.advance(now) {
            refresh_rates(st, now);
            self.changed.send_modify(|g| *g += 1);
        }
    }

    /// Registers a load that starts sending now: `layer_bytes` per layer in delivery order,
    /// and the descriptor's hints (per-layer compute time, or per-layer deadlines relative to
    /// now; none means every layer is needed at once).
    ///
    /// # Errors
    /// [`crate::Error::InvalidArgument`] if there are no layers.
    pub fn register(
        self: &Arc<Self>,
        layer_bytes: Vec<u64>,
        hints: &SchedHints,
    ) -> crate::Result<LinkLoad> {
        let now = self.now();
        let spec = spec_of(now, layer_bytes, hints);
        let mut st = self.st.lock().expect("link lock");
        self.replanned(&mut st, now);
        let id = st.sched.handle_arrival(now, spec)?;
        st.credit.insert(id, 0.0);
        self.replanned(&mut st, now);
        Ok(LinkLoad {
            link: self.clone(),
            id,
        })
    }
}

impl Link {
    /// Loads registered now (what the server's tests check of load groups).
    pub fn loads(&self) -> usize {
        self.st.lock().expect("link lock").sched.loads().len()
    }
}

fn refresh_rates(st: &mut State, now: f64) {
    let alloc = st.sched.poll_allocation(now);
    st.rate = alloc.iter().map(|a| (a.id, a.rate)).collect();
}

/// The pure load description from the descriptor's hints (times relative to `now`, seconds).
pub(crate) fn spec_of(now: f64, layer_bytes: Vec<u64>, hints: &SchedHints) -> LoadSpec {
    let n = layer_bytes.len();
    let us = |v: u32| v as f64 * 1e-6;
    let (ready, compute) = match hints {
        SchedHints::LayerComputeUs(v) => (
            now,
            (0..n).map(|l| v.get(l).map_or(0.0, |&c| us(c))).collect(),
        ),
        SchedHints::LayerDeadlinesUs(d) if !d.is_empty() => {
            // Layer l's compute spans d[l]..d[l+1]; the last layer's length is unknown (0).
            let c = (0..n)
                .map(|l| match (d.get(l), d.get(l + 1)) {
                    (Some(&a), Some(&b)) => us(b.saturating_sub(a)),
                    _ => 0.0,
                })
                .collect();
            (now + us(d[0]), c)
        }
        _ => (now, vec![0.0; n]),
    };
    LoadSpec {
        layer_bytes,
        layer_compute_s: compute,
        compute_ready_s: ready,
        max_rate: f64::INFINITY,
    }
}

/// Seconds of its rate that a load may keep as unused credit: after a hiccup (a backend read,
/// the stripes' lockstep, a socket that was full) the load catches up by up to this much,
/// so it runs at its allocated rate on average instead of losing every hiccup for good. At
/// most one unit is kept when that is more.
///
/// Source: measured with `objectcache-bench traffic --workloads burst --policies fifo
/// --requests 1 --prefix-chunks 16 --cap C` (one 16-chunk SmolLM2-135M load alone, 2-core
/// machine). Keeping one unit, the load took 4.4-10% longer than bytes/cap at 200 MB/s and
/// 28-51% at 400 MB/s; keeping 20 ms, 0.2-0.7% at both (50 ms and 200 ms gave the same).
pub const PACE_CATCH_UP_S: f64 = 0.020;

/// A registered load; dropping it is the load's departure (end or cancel).
pub struct LinkLoad {
    link: Arc<Link>,
    id: LoadId,
}

impl LinkLoad {
    /// Waits until this load may send a unit of `bytes` bytes (its credit covers it), then
    /// spends the credit. Cancel-safe: dropping the future spends nothing.
    pub async fn pace(&self, bytes: u64) {
        let need = bytes as f64;
        let mut rx = self.link.changed.subscribe();
        let mut first = true;
        loop {
            let wait = {
                let now = self.link.now();
                let mut st = self.link.st.lock().expect("link lock");
                self.link.replanned(&mut st, now);
                let rate = st.rate.get(&self.id).copied().unwrap_or(0.0);
                let timeout = st.sched.poll_timeout(now);
                let c = st.credit.entry(self.id).or_insert(0.0);
                if first {
                    // Credit unused while the load had nothing to send is capped (module docs).
                    *c = c.min(need.max(rate * PACE_CATCH_UP_S));
                    first = false;
                }
                if *c + 1e-6 >= need {
                    *c -= need;
                    return;
                }
                let mut w = if rate > 0.0 {
                    (need - *c) / rate
                } else {
                    f64::INFINITY
                };
                if let Some(t) = timeout {
                    w = w.min((t - now).max(0.0));
                }
                w
            };
            rx.borrow_and_update();
            let sleep = if wait.is_finite() {
                Duration::from_secs_f64(wait.max(0.0))
            } else {
                Duration::from_secs(3600)
            };
            tokio::select! {
                _ = tokio::time::sleep(sleep) => {}
                r = rx.changed() => { if r.is_err() { return; } }
            }
        }
    }

    /// `bytes` of this load were written to the socket (the scheduler's progress; completing
    /// a layer re-plans).
    pub fn sent(&self, bytes: u64) {
        let now = self.link.now();
        let mut st = self.link.st.lock().expect("link lock");
        self.link.replanned(&mut st, now);
        let left = st.sched.load(self.id).map_or(0, |l| l.remaining_bytes());
        let _ = st.sched.handle_progress(now, self.id, bytes.min(left));
        self.link.replanned(&mut st, now);
    }
}

impl Drop for LinkLoad {
    fn drop(&mut self) {
        let now = self.link.now();
        let mut st = self
            .link
            .st
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        self.link.replanned(&mut st, now);
        let _ = st.sched.handle_departure(now, self.id);
        st.credit.remove(&self.id);
        st.rate.remove(&self.id);
        self.link.replanned(&mut st, now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hints_become_specs() {
        let s = spec_of(
            1.0,
            vec![10, 20],
            &SchedHints::LayerComputeUs(vec![1000, 2000]),
        );
        assert_eq!(s.layer_compute_s, vec![1e-3, 2e-3]);
        assert_eq!(s.compute_ready_s, 1.0);
        let s = spec_of(
            1.0,
            vec![10, 20, 30],
            &SchedHints::LayerDeadlinesUs(vec![500, 1500, 4500]),
        );
        assert_eq!(s.compute_ready_s, 1.0005);
        assert!((s.layer_compute_s[0] - 1e-3).abs() < 1e-12);
        assert!((s.layer_compute_s[1] - 3e-3).abs() < 1e-12);
        assert_eq!(s.layer_compute_s[2], 0.0);
        let s = spec_of(0.0, vec![1], &SchedHints::None);
        assert_eq!(s.layer_compute_s, vec![0.0]);
    }

    /// Waits `wait_ms` milliseconds, then paces and sends `units` units of 1,000 bytes of `a`;
    /// returns how long the units took.
    async fn units_after_wait(a: &LinkLoad, wait_ms: u64, units: usize) -> Duration {
        tokio::time::sleep(Duration::from_millis(wait_ms)).await;
        let t = Instant::now();
        for _ in 0..units {
            a.pace(1_000).await;
            a.sent(1_000);
        }
        t.elapsed()
    }

    // Paused, auto-advancing time: the pacing is exact and the test deterministic.
    #[tokio::test(start_paused = true)]
    async fn a_load_that_waited_catches_up_by_at_most_the_catch_up_time() {
        // Alone at 200 kB/s: 20 ms of credit is 4,000 bytes, four 1,000-byte units.
        let link = Link::new(PolicyKind::Fifo, 200_000.0).unwrap();
        let a = link.register(vec![100_000], &SchedHints::None).unwrap();
        // Waits 10 ms (for its backend reads, say): both units it could have sent go at once.
        let took = units_after_wait(&a, 10, 2).await;
        assert_eq!(took, Duration::ZERO, "the 10 ms of credit is kept");
        // Waits 100 ms: only 20 ms of it is kept (four units), the fifth unit waits 5 ms.
        let took = units_after_wait(&a, 100, 4).await;
        assert_eq!(took, Duration::ZERO, "20 ms of credit is kept");
        let t = Instant::now();
        a.pace(1_000).await;
        let d = t.elapsed().as_secs_f64();
        // 5 ms for its bytes (the timer may round up to its next millisecond).
        assert!((0.0049..0.007).contains(&d), "{d}");
        a.sent(1_000);
        // A unit larger than 20 ms of credit goes at once after a long wait: one unit is kept.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let t = Instant::now();
        a.pace(10_000).await;
        assert_eq!(t.elapsed(), Duration::ZERO, "one unit of credit is kept");
    }

    // Paused, auto-advancing time: the pacing is exact and the test deterministic.
    #[tokio::test(start_paused = true)]
    async fn units_never_leave_faster_than_the_allocated_rates() {
        // Equal share of 200 kB/s between two loads: 10 kB each takes at least 0.1 s; alone,
        // the next 10 kB of `a` takes at least 0.05 s.
        let link = Link::new(PolicyKind::EqualShare, 200_000.0).unwrap();
        let a = link
            .register(vec![10_000, 10_000], &SchedHints::None)
            .unwrap();
        let b = link
            .register(vec![10_000, 10_000], &SchedHints::None)
            .unwrap();
        let t0 = Instant::now();
        let (ra, rb) = tokio::join!(
            async {
                a.pace(10_000).await;
                a.sent(10_000);
                t0.elapsed().as_secs_f64()
            },
            async {
                b.pace(10_000).await;
                b.sent(10_000);
                t0.elapsed().as_secs_f64()
            }
        );
        assert!(ra >= 0.099 && rb >= 0.099, "{ra} {rb}");
        drop(b);
        let t1 = Instant::now();
        a.pace(10_000).await;
        a.sent(10_000);
        let d = t1.elapsed().as_secs_f64();
        assert!(d >= 0.049, "{d}");
        assert!(link.st.lock().unwrap().sched.loads().len() == 1);
        drop(a);
        assert!(link.st.lock().unwrap().sched.loads().is_empty());
    }
}
