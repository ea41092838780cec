//! One fetch for many requests: concurrent loads of the same chunk slices in one engine, or in
//! the engines of a process opened on one store URL (`shared.rs`), share one fetch
//! (single-flight).
//!
//! A load whose chunks are the leading chunks of a load already in flight (same
//! key prefix: namespace, geometry, TP rank; the same chunk hashes) does not fetch: it
//! **follows** that load, the leader. As each of the leader's layers lands verified, the
//! follower copies its own chunks' part of it into its own destination and checks every copied
//! slice against the CRC32C the leader verified it with (so bytes the leader's caller might
//! change after reading them can never become the follower's KV); the follower's layer is then
//! ready. So
//! - a follower's layer `l` is ready as soon as the leader has landed layer `l` and the copy
//!   is done; layers the leader already has are copied at once;
//! - a follower that needs fewer chunks waits for nothing more than the leader's layers (it
//!   copies only its chunks);
//! - a leader that is cancelled, dropped, times out or stalls does not fail its followers:
//!   a follower whose leader ends that way fetches the rest itself (a private fetch of its
//!   chunks, copied from the layer it had reached). Only a miss of one of the follower's own
//!   chunks (missing, corrupt, wrong geometry, storage error naming it) fails the follower's
//!   layer, as its own fetch would have.
//!
//! A load follows only where it pays: when the leader's bytes still to come are at most twice
//! the follower's own bytes (following a much longer load would make a short one wait for
//! the long one's whole layer-major stream). Fetches are matched in the process only: loads in
//! different processes share through the server (its node tier or page cache, see
//! `docs/protocol.md`).
//!
//! [`Fetcher`] starts the real fetch of a load (gather where offered, else ranged GETs), with
//! its deadline and its stall watchdog; a leader and a follower's private fetch use it alike.

use super::buffers::{LayerBuffers, LayerStatus};
use super::load::{LoadRequest, LoadShared};
use super::EngineConfig;
use crate::error::{LayerError, LayerResult};
use crate::layout::{ChunkHash, KeyBuilder};
use crate::link::Link;
use crate::store::Store;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

/// Everything needed to start fetching a load: the engine's store, its gather endpoint and
/// connections, its link, its runtime and settings.
pub(crate) struct Fetcher {
    pub(crate) store: Arc<dyn Store>,
    /// The gather servers (gateways) in front of the store.
    pub(crate) gateways: crate::store::Gateways,
    /// What each gateway was found to offer, and its idle connections.
    pub(crate) probes: Arc<super::gather::Probes>,
    pub(crate) link: Option<Arc<Link>>,
    pub(crate) handle: tokio::runtime::Handle,
    pub(crate) cfg: EngineConfig,
    #[cfg(feature = "rdma")]
    pub(crate) rdma: Arc<Mutex<super::rdma::Probe>>,
    /// Bytes received from storage by this engine's fetches (not by followers' copies).
    pub(crate) fetched: Arc<AtomicU64>,
    /// The publish markers of the load's chunks that its lookup read, by prefix position
    /// (`Engine::markers_known`): where the ranged-GET path finds segment objects.
    pub(crate) markers: std::collections::BTreeMap<usize, crate::layout::Marker>,
}

impl Fetcher {
    /// Where loads read from, for a stall's error message.
    fn source(&self) -> String {
        match self.gateways.route(0).first() {
            Some(t) => format!(
                "{} store at {} (bucket {})",
                self.store.name(),
                t.addr,
                t.bucket
            ),
            None => format!("{} store", self.store.name()),
        }
    }

    /// Starts fetching `req` into `sh` ([`super::fetch::Fetch`]: RDMA or gather where offered,
    /// else ranged GETs) under the load's deadline, with its stall watchdog; both are tasks of
    /// `sh`.
    ///
    /// `lease` (the load's hold on its entries, see `Engine::gc`) is kept until the fetch ends:
    /// completed, failed, timed out or cancelled.
    pub(crate) fn start(
        self: &Arc<Self>,
        req: LoadRequest,
        keys: KeyBuilder,
        sh: Arc<LoadShared>,
        request_id: u64,
        lease: Option<crate::lifecycle::Lease>,
    ) {
        let g = &req.geometry;
        let need = sh.state.expected();
        let total_bytes = need * g.layers as u64;
        // The stall watchdog's "next unit": the largest single read of the ranged-GET path (a
        // coalesced read) or gather unit (a slice).
        let unit = g.slice_bytes().max(
            self.cfg
                .coalesce_bytes
                .min(g.slice_bytes() * g.layers as u64),
        );
        // The data paths are the fetch's choice (`path.rs`); this only shares the result.
        let run = super::fetch::Fetch {
            store: self.store.clone(),
            gateways: self.gateways.clone(),
            probes: self.probes.clone(),
            link: self.link.clone(),
            cfg: self.cfg.clone(),
            #[cfg(feature = "rdma")]
            rdma: self.rdma.clone(),
            markers: self.markers.clone(),
            req,
            keys,
            sh: sh.clone(),
            request_id,
        }
        .run();
        // The overall deadline: fixed, or from the load's size (`load_min_rate_bytes_per_s`).
        let timeout = self.cfg.load_deadline(total_bytes);
        let sh2 = sh.clone();
        let fetched = self.fetched.clone();
        let driver = self.handle.spawn(async move {
            let _lease = lease;
            sh2.run_with_deadline(timeout, run).await;
            fetched.fetch_add(sh2.progress.bytes(), Ordering::Relaxed);
        });
        sh.tasks.lock().expect("lock").push(driver);
        let dog = self.handle.spawn(super::load::watchdog(
            sh.clone(),
            self.cfg.stall_timeout,
            unit,
            self.source(),
        ));
        sh.tasks.lock().expect("lock").push(dog);
    }
}

/// Bytes a follower copies and checksums at a time (well inside a core's L2 cache).
const COPY_PIECE: usize = 64 << 10;

/// A load in flight that others may follow.
struct Flight {
    prefix: String,
    hashes: Vec<ChunkHash>,
    sh: Weak<LoadShared>,
    /// The engine whose runtime fetches it.
    owner: u64,
}

/// Loads in flight, by key prefix and chunk hashes: one engine's, or those of the engines of
/// a process on one store (`shared.rs`).
#[derive(Default)]
pub(crate) struct Flights(Mutex<Vec<Flight>>);

impl Flights {
    /// A load in flight whose leading chunks are `hashes` under `prefix`, worth following for
    /// a load of `bytes` bytes (its bytes still to come at most twice those), if any.
    pub(crate) fn leader_for(
        &self,
        prefix: &str,
        hashes: &[ChunkHash],
        bytes: u64,
    ) -> Option<Arc<LoadShared>> {
        let mut v = self.0.lock().expect("lock");
        // Forget loads that ended (dropped) or settled (every layer ready or failed).
        v.retain(|f| f.sh.upgrade().is_some_and(|sh| !settled(&sh)));
        v.iter()
            .filter(|f| {
                f.prefix == prefix
                    && f.hashes.len() >= hashes.len()
                    && f.hashes[..hashes.len()] == *hashes
            })
            .filter_map(|f| f.sh.upgrade())
            .filter(|sh| !sh.state.is_cancelled())
            .filter(|sh| {
                let total = sh.state.expected() * sh.state.layers() as u64;
                total.saturating_sub(sh.state.verified_bytes()) <= bytes.saturating_mul(2)
            })
            .min_by_key(|sh| sh.state.expected())
    }

    /// Registers a load that engine `owner` fetches, of `hashes` under `prefix`, for later
    /// loads to follow.
    pub(crate) fn register(
        &self,
        prefix: &str,
        hashes: &[ChunkHash],
        sh: &Arc<LoadShared>,
        owner: u64,
    ) {
        self.0.lock().expect("lock").push(Flight {
            prefix: prefix.to_string(),
            hashes: hashes.to_vec(),
            sh: Arc::downgrade(sh),
            owner,
        });
    }

    /// Cancels and forgets the loads engine `owner` fetches (it is being dropped: its runtime,
    /// which drives them, stops). Their layers still pending fail as cancelled, so a follower
    /// in another engine fetches the rest itself instead of waiting for its deadline.
    pub(crate) fn cancel_owned(&self, owner: u64) {
        let mut v = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        v.retain(|f| {
            if f.owner != owner {
                return true;
            }
            if let Some(sh) = f.sh.upgrade() {
                sh.state.cancel();
            }
            false
        });
    }
}

/// Whether every layer of `sh` is ready or failed.
fn settled(sh: &LoadShared) -> bool {
    (0..sh.state.layers()).all(|l| sh.state.status(l) != LayerStatus::Pending)
}

/// A follower's private fetch: cancelled, and its tasks stopped, when the follower ends.
struct Private(Arc<LoadShared>);

impl Drop for Private {
    fn drop(&mut self) {
        self.0.state.cancel();
        for t in self
            .0
            .tasks
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
        {
            t.abort();
        }
    }
}

/// Whether a failed layer of the source means the follower's own layer cannot arrive either:
/// a miss of one of the follower's own chunks (`chunks` leading chunks). Any other failure
/// (cancelled, deadline, stall, a chunk past the follower's, a device copy) is the source's
/// own: the follower fetches the rest itself.
fn own_miss(e: &LayerError, chunks: usize) -> bool {
    super::status::chunk_status_of(e).is_some_and(|(c, _)| c < chunks)
}

/// Runs a follower: copies each layer of its `chunks` leading chunks from `leader` as it lands
/// (verified against the CRC32C the leader verified each slice with) into `me`; once the
/// leader ends without a layer the follower could still get, fetches the rest privately
/// through `fetcher`. Registered as one of `me`'s tasks (the load's deadline and cancellation
/// apply to it).
pub(crate) async fn follow(
    leader: Arc<LoadShared>,
    me: Arc<LoadShared>,
    fetcher: Arc<Fetcher>,
    req: LoadRequest,
    keys: KeyBuilder,
    request_id: u64,
) {
    let g = req.geometry.clone();
    let chunks = req.hashes.len();
    let slice = g.slice_bytes() as usize;
    let layers = g.layers as usize;
    // The source has its own watchdog; this load's own progress is its copies.
    let held = me.progress.hold();
    let mut src = leader;
    let mut private: Option<Private> = None;
    let mut l = 0;
    while l < layers {
        if me.state.is_cancelled() {
            return;
        }
        let status = src.state.wait(l).await;
        if let Some(p) = &private {
            // The requests of the private fetch are this load's (counted before its layer
            // can be ready).
            me.requests
                .store(p.0.requests.load(Ordering::Relaxed), Ordering::Relaxed);
        }
        let copied = match status {
            // The leader's bytes are checked against the CRC32C it verified them with (its
            // caller may change them once ready); the private fetch's buffer is this load's
            // own, verified by its transport, so its bytes are copied as they are.
            LayerStatus::Ready => copy_layer(&src, &me, l, chunks, slice, private.is_none()),
            LayerStatus::Failed(e) if own_miss(&e, chunks) => {
                me.state.fail_impl(l as u32, e);
                Ok(())
            }
            LayerStatus::Failed(e) => Err(e),
            LayerStatus::Pending => unreachable!("wait returns a final status"),
        };
        match copied {
            Ok(()) => l += 1,
            Err(why) if private.is_none() => {
                // The leader will not bring this layer: fetch the rest of this load privately,
                // into a buffer of its own, and copy from there.
                tracing::debug!(layer = l, error = %why, "leader ended; the follower fetches the rest itself");
                let n = chunks as u64 * g.slice_bytes();
                let sh = Arc::new(LoadShared::new(
                    LayerBuffers::allocate(layers, n as usize),
                    n,
                    chunks,
                ));
                fetcher.start(req.clone(), keys.clone(), sh.clone(), request_id, None);
                private = Some(Private(sh.clone()));
                src = sh;
            }
            Err(why) => {
                // The private fetch failed this layer: the follower's layer is a miss.
                me.state.fail_impl(l as u32, why);
                l += 1;
            }
        }
    }
    drop(held);
}

/// Copies layer `l` of the leading `chunks` chunks from `src` (ready) into `me`, slice by
/// slice straight into `me`'s destination, then completes the layer. With `check` (a leader
/// whose caller may change its bytes once ready), each copy is checked against the CRC32C
/// `src` verified the slice with; `Err` (nothing written) when the source cannot serve the
/// layer: its buffers are gone, or a slice's CRC is not known (a unit that carried several
/// slices, slices under 4 KiB; an RDMA load). A copy whose bytes do not match their CRC (the
/// source's caller changed them after they were verified) fails the layer, a miss naming the
/// chunk: never wrong bytes. Without `check` (the follower's private fetch, which only it
/// reads) the bytes are copied as they were verified by their transport.
fn copy_layer(
    src: &LoadShared,
    me: &LoadShared,
    l: usize,
    chunks: usize,
    slice: usize,
    check: bool,
) -> LayerResult<()> {
    use crate::transport::LayerSink;
    let Some(parts) = src.state.ready_parts(l) else {
        return Err(LayerError::Cancelled);
    };
    let crcs: Vec<Option<u32>> = (0..chunks).map(|c| src.slice_crc(c, l)).collect();
    if check && crcs.iter().any(|c| c.is_none()) {
        return Err(LayerError::Cancelled);
    }
    for (c, &want) in crcs.iter().enumerate() {
        let off = (c * slice) as u64;
        let dest = match me.state.dest_parts_impl(l as u32, off, slice as u64) {
            Ok(d) => d,
            Err(e) => {
                // Cancelled meanwhile, or already failed: nothing more for this layer.
                me.state.fail_impl(l as u32, e);
                return Ok(());
            }
        };
        let mut src_pieces = super::save::sub_parts(&parts, c * slice, slice).into_iter();
        let mut cur: &[u8] = src_pieces.next().unwrap_or_default();
        let mut crc = 0u32;
        for d in dest {
            let mut at = 0;
            while at < d.len() {
                if cur.is_empty() {
                    cur = src_pieces.next().expect("the source holds the slice");
                }
                // Copy a cache-sized piece, then checksum it as it now is in this load's own
                // destination while it is still in cache: one pass over memory, not two.
                let n = cur.len().min(d.len() - at).min(COPY_PIECE);
                d[at..at + n].copy_from_slice(&cur[..n]);
                if want.is_some() {
                    crc = crate::layout::crc::crc32c_append(crc, &d[at..at + n]);
                }
                cur = &cur[n..];
                at += n;
            }
        }
        me.state.dest_filled(l as u32, slice as u64);
        let Some(want) = want else {
            // Unchecked copy from this load's own private fetch (see above).
            continue;
        };
        if crc != want {
            me.state.fail_impl(
                l as u32,
                LayerError::ChecksumMismatch {
                    chunk: c,
                    layer: l,
                    stored: want,
                    computed: crc,
                },
            );
            return Ok(());
        }
        me.record_slice_crc(c, l, want);
    }
    me.state.complete_impl(l as u32, (chunks * slice) as u64);
    Ok(())
}
