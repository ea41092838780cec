//! Loads, not connections: the server's unit of admission and bandwidth scheduling.
//!
//! A client may stripe one load over several gather requests on as many connections
//! (`docs/protocol.md`, "Striped loads"); each stripe's descriptor then names the load
//! ([`objectcache_client::protocol::LoadGroup`]: load id, stripe count, the whole load's bytes per layer).
//! Every gather request is a [`Member`] of a [`Load`]: the stripes of one load share it, and
//! a request without a group block is a load of its own. A load is
//! - **admitted once**: the first stripe to arrive waits in the admission queue for all of
//!   them, and the others wait on that same admission (`max_concurrent_loads` counts loads);
//! - **registered once** with the link scheduler, with the whole load's bytes per layer and
//!   its hints, so the bandwidth policy sees one load, whatever the number of stripes;
//! - under a bandwidth cap, **sent in the whole load's layer-major order**: a stripe sends a
//!   unit of layer `l` only when every other stripe present has sent all its units of the
//!   layers before `l`, paying each unit from the load's one credit.
//!
//! So the stripes share one allocation and advance together. The client's lockstep
//! (`connector/gather/stripe.rs`: no stripe starts layer 1 before all finished layer 0,
//! then at most one layer ahead of the slowest) never waits for a stripe the server holds
//! back: the stripe furthest behind is never held back by either side. (Scheduled per
//! connection, a `fifo` or `stall-aware` server gave one stripe the whole cap while the
//! client waited for the other stripe's layer 0: no progress until the client timeout.)
//!
//! A stripe that arrives late joins the load where it is and catches up first (the others
//! wait for it at the next layer); a stripe that never comes holds nobody back, since only
//! present stripes are waited for. Without a cap nothing is paced or ordered: each stripe
//! goes as fast as its socket, and the client's lockstep alone keeps them together.
//!
//! The load id is the client's; a client naming another client's load id, stripe count,
//! layer range and layer size only shares that load's scheduling (never its bytes: each
//! request reads and sends its own chunks).

use super::{ServerState, Slot};
use objectcache_client::link::{Link, LinkLoad};
use objectcache_client::protocol::{GatherRequest, SchedHints};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use tokio::sync::Notify;

/// What makes two requests stripes of one load: the same load id, stripe count, requested
/// layers, whole-load layer size and geometry.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Key {
    load_id: u64,
    stripes: u16,
    layers: (u32, u32),
    load_layer_bytes: u64,
    fingerprint: u64,
}

type Registry = Arc<Mutex<HashMap<Key, Weak<Load>>>>;

/// The loads being served, by key (only striped loads are registered).
#[derive(Default)]
pub(crate) struct Loads {
    map: Registry,
}

impl Loads {
    /// Loads with more than one stripe known now (tests).
    #[cfg(test)]
    pub(crate) fn striped(&self) -> usize {
        self.map.lock().expect("loads lock").len()
    }
}

/// One load: its admission slot, its link registration and its stripes' progress.
pub(crate) struct Load {
    key: Option<Key>,
    registry: Option<Registry>,
    slot: tokio::sync::OnceCell<Slot>,
    link: OnceLock<Option<LinkLoad>>,
    /// Per present stripe (by member id): the layer of the next unit it will send.
    at: Mutex<HashMap<u64, u32>>,
    moved: Notify,
    next_member: AtomicU64,
}

impl Drop for Load {
    fn drop(&mut self) {
        if let (Some(k), Some(reg)) = (&self.key, &self.registry) {
            let mut m = reg
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if m.get(k).is_some_and(|w| w.strong_count() == 0) {
                m.remove(k);
            }
        }
    }
}

/// One gather request's place in its load; dropping it is the stripe's end.
pub(crate) struct Member {
    load: Arc<Load>,
    id: u64,
}

impl Member {
    /// Joins `req` to its load: the striped load its group block names (created by the first
    /// stripe to arrive), or a load of its own.
    pub(crate) fn join(loads: &Loads, req: &GatherRequest) -> Member {
        let fresh = |key: Option<Key>, registry: Option<Registry>| {
            Arc::new(Load {
                key,
                registry,
                slot: tokio::sync::OnceCell::new(),
                link: OnceLock::new(),
                at: Mutex::new(HashMap::new()),
                moved: Notify::new(),
                next_member: AtomicU64::new(0),
            })
        };
        let load = match &req.group {
            Some(g) if g.stripes > 1 => {
                let key = Key {
                    load_id: g.load_id,
                    stripes: g.stripes,
                    layers: (req.layers.start, req.layers.end),
                    load_layer_bytes: g.load_layer_bytes,
                    fingerprint: req.geometry.fingerprint,
                };
                let mut m = loads.map.lock().expect("loads lock");
                match m.get(&key).and_then(Weak::upgrade) {
                    Some(l) => l,
                    None => {
                        let l = fresh(Some(key.clone()), Some(loads.map.clone()));
                        m.insert(key, Arc::downgrade(&l));
                        l
                    }
                }
            }
            _ => fresh(None, None),
        };
        let id = load.next_member.fetch_add(1, Ordering::Relaxed);
        load.at
            .lock()
            .expect("load lock")
            .insert(id, req.layers.start);
        load.moved.notify_waiters();
        Member { load, id }
    }

    /// Waits until the load is admitted (the first stripe to call this queues the load under
    /// the admission policy; the others wait on the same admission). Cancel-safe: if the
    /// stripe that queued it goes away, a waiting stripe queues it again.
    ///
    /// # Errors
    /// A message when the admission queue is full.
    pub(crate) async fn admit(
        &self,
        sh: &Arc<ServerState>,
        priority: u8,
        first_deadline_us: Option<u64>,
        bytes: u64,
    ) -> Result<(), String> {
        self.load
            .slot
            .get_or_try_init(|| super::admit(sh, priority, first_deadline_us, bytes))
            .await
            .map(|_| ())
    }

    /// Registers the load with `link` (once per load): `layer_bytes` gives the whole load's
    /// payload bytes per requested layer, `hints` its scheduling hints.
    pub(crate) fn start_pacing(
        &self,
        link: &Arc<Link>,
        layer_bytes: impl FnOnce() -> Vec<u64>,
        hints: &SchedHints,
    ) {
        self.load.link.get_or_init(|| {
            link.register(layer_bytes(), hints)
                .map_err(|e| tracing::warn!(error = %e, "gather load not paced"))
                .ok()
        });
    }

    /// Whether this load's units are paced by a link scheduler.
    pub(crate) fn is_paced(&self) -> bool {
        matches!(self.load.link.get(), Some(Some(_)))
    }

    /// Waits until this stripe may send a unit of `bytes` bytes of layer `layer`: every other
    /// stripe present has sent all its units of the layers before `layer`, and the load's
    /// credit covers the unit. Returns at once when the load is not paced. Cancel-safe.
    pub(crate) async fn pace(&self, layer: u32, bytes: u64) {
        let Some(Some(link)) = self.load.link.get() else {
            return;
        };
        loop {
            let moved = self.load.moved.notified();
            tokio::pin!(moved);
            moved.as_mut().enable();
            let go = {
                let mut at = self.load.at.lock().expect("load lock");
                let before = at.insert(self.id, layer);
                if before != Some(layer) {
                    self.load.moved.notify_waiters();
                }
                at.values().all(|&l| l >= layer)
            };
            if go {
                break;
            }
            moved.await;
        }
        link.pace(bytes).await;
    }

    /// `bytes` of this stripe were written to the socket (the load's progress on the link).
    pub(crate) fn sent(&self, bytes: u64) {
        if let Some(Some(link)) = self.load.link.get() {
            link.sent(bytes);
        }
    }
}

impl Drop for Member {
    fn drop(&mut self) {
        // Ended, failed or went away: hold no other stripe back.
        self.load
            .at
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&self.id);
        self.load.moved.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use objectcache_client::layout::{ChunkHash, HashAlgo, KeyBuilder, KvGeometry};
    use objectcache_client::protocol::LoadGroup;
    use objectcache_client::sched::PolicyKind;

    fn stripe(load_id: u64, i: u16, n: u16) -> GatherRequest {
        let g = KvGeometry::smollm2_135m();
        let kb = KeyBuilder::new("ns", &g, HashAlgo::Sha256Cbor).unwrap();
        let mut r = GatherRequest::for_prefix(
            i as u64,
            "kv-test",
            &kb,
            &g,
            vec![ChunkHash::from_digest([i as u8; 32])],
            vec![g.tokens_per_chunk],
        );
        r.group = Some(LoadGroup {
            load_id,
            stripe: i,
            stripes: n,
            load_layer_bytes: n as u64 * g.slice_bytes(),
        });
        r
    }

    // Paused, auto-advancing time: the order of the sends is exact.
    #[tokio::test(start_paused = true)]
    async fn stripes_of_a_load_share_one_link_load_and_go_layer_by_layer() {
        let loads = Loads::default();
        let link = Link::new(PolicyKind::Fifo, 1e6).unwrap();
        let a = Member::join(&loads, &stripe(9, 0, 2));
        let b = Member::join(&loads, &stripe(9, 1, 2));
        // Another load, and a request of its own: separate loads.
        let other = Member::join(&loads, &stripe(10, 0, 2));
        let single = Member::join(
            &loads,
            &GatherRequest {
                group: None,
                ..stripe(9, 0, 2)
            },
        );
        assert!(Arc::ptr_eq(&a.load, &b.load));
        assert!(!Arc::ptr_eq(&a.load, &other.load) && !Arc::ptr_eq(&a.load, &single.load));
        assert_eq!(loads.striped(), 2);
        for m in [&a, &b] {
            m.start_pacing(&link, || vec![1000; 30], &SchedHints::None);
        }
        assert_eq!(link.loads(), 1, "one load on the link for both stripes");
        // Stripe a sent layer 0; it may not send layer 1 before b sent its layer 0.
        a.pace(0, 500).await;
        a.sent(500);
        let mut a1 = Box::pin(a.pace(1, 500));
        assert!(futures::poll!(a1.as_mut()).is_pending());
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
        assert!(
            futures::poll!(a1.as_mut()).is_pending(),
            "held for stripe b's layer 0"
        );
        b.pace(0, 500).await;
        b.sent(500);
        let b1 = b.pace(1, 500);
        tokio::join!(a1, b1);
        // A stripe that ends holds nobody back; the load leaves the link with its last stripe.
        drop(b);
        a.pace(5, 500).await;
        drop(a);
        assert_eq!(link.loads(), 0);
        drop((other, single));
        assert_eq!(loads.striped(), 0);
    }
}
