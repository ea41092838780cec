//! The state one load shares between its handle, its tasks and the loads that follow it
//! ([`LoadShared`]): destination and per-layer readiness, per-chunk status and header checks,
//! the CRC32C each slice was verified with, counters and the load's tasks.

use super::body::SliceEnd;
use super::watchdog::Progress;
use crate::connector::buffers::{LayerBuffers, LayerStatus, LoadState};
use crate::connector::status::ChunkStatus;
use crate::error::{LayerError, LayerResult};
use std::future::Future;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::Mutex;
use std::time::Duration;

pub(crate) struct LoadShared {
    pub(crate) state: LoadState,
    pub(crate) chunk_status: Vec<AtomicU8>,
    pub(crate) requests: AtomicU64,
    /// Gather streams that failed over to another gateway.
    pub(crate) failovers: AtomicU64,
    pub(crate) tasks: Mutex<Vec<tokio::task::JoinHandle<()>>>,
    /// Peaks of the ranged-GET path's requests and bytes in flight.
    pub(crate) peak_requests: AtomicU64,
    pub(crate) peak_bytes: AtomicU64,
    /// Ranged-GET path: per chunk, whether its header was checked (`HEADER_UNKNOWN`,
    /// `HEADER_OK`, `HEADER_BAD`); a read of later layers completes none of them before the
    /// chunk's header is known good.
    headers: Vec<AtomicU8>,
    header_known: tokio::sync::Notify,
    /// What arrived when, for the stall watchdog.
    pub(crate) progress: Progress,
    /// Per (chunk, layer), `chunk * layers + layer`: the CRC32C the slice was verified with
    /// (`1 << 32 | crc`), `2 << 32` when the slice is in place and was checked by the server
    /// but no CRC is known here (an RDMA write), or 0 while not in place. Followers of this
    /// load check their copies against the CRC (`flight.rs`).
    slice_crcs: Vec<AtomicU64>,
    layers: usize,
    /// Bytes of one chunk's slice of one layer (a layer's destination is `chunks x
    /// slice_bytes`).
    #[cfg(feature = "rdma")]
    pub(crate) slice_bytes: u64,
    /// Set by [`LoadHandle::into_buffers`]: where the last reference's drop hands the
    /// buffers back.
    ///
    /// [`LoadHandle::into_buffers`]: super::LoadHandle::into_buffers
    pub(super) give_back: Mutex<Option<std::sync::mpsc::SyncSender<LayerBuffers>>>,
}

impl Drop for LoadShared {
    fn drop(&mut self) {
        if let Some(tx) = self.give_back.get_mut().expect("lock").take() {
            let bufs = std::mem::replace(&mut self.state.bufs, LayerBuffers::from_vecs(Vec::new()));
            // The receiver waits in `into_buffers` until this send.
            let _ = tx.send(bufs);
        }
    }
}

const HEADER_UNKNOWN: u8 = 0;
const HEADER_OK: u8 = 1;
const HEADER_BAD: u8 = 2;

impl LoadShared {
    pub(crate) fn new(bufs: LayerBuffers, expected: u64, chunks: usize) -> Self {
        let layers = bufs.layers();
        LoadShared {
            slice_crcs: (0..chunks * layers).map(|_| AtomicU64::new(0)).collect(),
            layers,
            #[cfg(feature = "rdma")]
            slice_bytes: expected / chunks.max(1) as u64,
            state: LoadState::new(bufs, expected),
            chunk_status: (0..chunks).map(|_| AtomicU8::new(0)).collect(),
            requests: AtomicU64::new(0),
            failovers: AtomicU64::new(0),
            tasks: Mutex::new(Vec::new()),
            peak_requests: AtomicU64::new(0),
            peak_bytes: AtomicU64::new(0),
            headers: (0..chunks).map(|_| AtomicU8::new(HEADER_UNKNOWN)).collect(),
            header_known: tokio::sync::Notify::new(),
            progress: Progress::new(),
            give_back: Mutex::new(None),
        }
    }

    /// Runs `work` (the load's fetch, or its following of another load) to its end, or until
    /// `deadline` (from when this starts; `None`: no deadline) passes: then every layer not
    /// ready yet is a miss ([`LayerError::Timeout`]) and the load is cancelled, so its reads
    /// stop.
    pub(crate) async fn run_with_deadline(
        &self,
        deadline: Option<Duration>,
        work: impl Future<Output = ()>,
    ) {
        match deadline {
            None => work.await,
            Some(t) => {
                if tokio::time::timeout(t, work).await.is_err() {
                    for l in 0..self.state.layers() {
                        self.state
                            .fail_impl(l as u32, LayerError::Timeout { layer: l });
                    }
                    self.state.cancel();
                }
            }
        }
    }

    /// Records that chunk `c`'s slice of layer `l` was verified with CRC32C `crc`.
    pub(crate) fn record_slice_crc(&self, c: usize, l: usize, crc: u32) {
        if let Some(a) = self.slice_crcs.get(c * self.layers + l) {
            a.store(1 << 32 | crc as u64, Ordering::Release);
        }
    }

    /// Records that chunk `c`'s slice of layer `l` is in place and was checked before it was
    /// sent, with no CRC known here (an RDMA write); a recorded CRC is kept.
    #[cfg(feature = "rdma")]
    pub(crate) fn record_slice_landed(&self, c: usize, l: usize) {
        if let Some(a) = self.slice_crcs.get(c * self.layers + l) {
            let _ = a.compare_exchange(0, 2 << 32, Ordering::AcqRel, Ordering::Acquire);
        }
    }

    /// Whether chunk `c`'s slice of layer `l` is in place and verified (its CRC known or not).
    pub(crate) fn slice_in_place(&self, c: usize, l: usize) -> bool {
        self.slice_crcs
            .get(c * self.layers + l)
            .is_some_and(|a| a.load(Ordering::Acquire) != 0)
    }

    /// The CRC32C chunk `c`'s slice of layer `l` was verified with, if known.
    pub(crate) fn slice_crc(&self, c: usize, l: usize) -> Option<u32> {
        let v = self
            .slice_crcs
            .get(c * self.layers + l)?
            .load(Ordering::Acquire);
        (v >> 32 == 1).then_some(v as u32)
    }

    /// Records whether chunk `c`'s header was read and matched (once; later calls are ignored).
    pub(super) fn set_header(&self, c: usize, ok: bool) {
        let v = if ok { HEADER_OK } else { HEADER_BAD };
        let _ = self.headers[c].compare_exchange(
            HEADER_UNKNOWN,
            v,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
        self.header_known.notify_waiters();
    }

    /// A guard for the read that carries chunk `c`'s header: when dropped (the read ended in
    /// any way, its task cancelled too) it records the header as bad unless it was recorded
    /// already, so that reads waiting on it ([`LoadShared::header_ok`]) never wait for nothing.
    pub(super) fn header_bad_unless_set(&self, c: usize) -> HeaderGuard<'_> {
        HeaderGuard { sh: self, c }
    }

    /// Whether chunk `c`'s header is known to match the request already (no wait).
    pub(super) fn header_is_ok(&self, c: usize) -> bool {
        self.headers[c].load(Ordering::Acquire) == HEADER_OK
    }

    /// Waits until chunk `c`'s header is known; `true` if it matched the request.
    pub(super) async fn header_ok(&self, c: usize) -> bool {
        loop {
            let known = self.header_known.notified();
            tokio::pin!(known);
            known.as_mut().enable();
            match self.headers[c].load(Ordering::Acquire) {
                HEADER_OK => return true,
                HEADER_BAD => return false,
                _ => known.await,
            }
        }
    }

    /// Chunk `c`'s slice of `layer` failed its CRC32C (`stored` in the object, `computed` over
    /// the bytes): the chunk is `Corrupt` and the layer a miss naming it; the chunk's other
    /// slices are still used.
    pub(super) fn slice_corrupt(&self, c: usize, layer: u32, stored: u32, computed: u32) {
        self.set_chunk(c, ChunkStatus::Corrupt);
        self.state.fail_impl(
            layer,
            LayerError::ChecksumMismatch {
                chunk: c,
                layer: layer as usize,
                stored,
                computed,
            },
        );
    }

    /// Settles chunk `c`'s slice of `layer` (`len` bytes) once its trailer arrived: nothing
    /// when its bytes were dropped (its layer had failed through another chunk); the layer a
    /// miss naming the chunk when the CRC32C does not match (the chunk's next slices are
    /// framed alike and still used); else the slice's CRC is recorded and its bytes counted
    /// toward the layer, once the chunk's header is known to match the request
    /// (`header_checked`: the body carried the header and it was checked already).
    /// `false` when the header did not match or could not be read: the caller fails the
    /// chunk with its reason.
    pub(super) async fn settle_slice(
        &self,
        c: usize,
        layer: u32,
        len: u64,
        end: &SliceEnd,
        header_checked: bool,
    ) -> bool {
        if end.dropped {
            return true;
        }
        if end.stored != end.computed {
            self.slice_corrupt(c, layer, end.stored, end.computed);
            return true;
        }
        if !(header_checked || self.header_ok(c).await) {
            return false;
        }
        self.record_slice_crc(c, layer as usize, end.stored);
        self.state.complete_impl(layer, len);
        true
    }

    /// Writes `bytes` of a slice at `offset` of layer `layer`'s destination. `Ok(false)` when
    /// the layer already failed (another chunk's slice failed it): this chunk's slice of it
    /// is then not needed, and not this chunk's failure; the caller drops the rest of it.
    ///
    /// # Errors
    /// [`LayerError::Cancelled`] once the load is cancelled; the destination's error for a
    /// write that fails otherwise.
    pub(super) fn write_slice_part(
        &self,
        layer: u32,
        offset: u64,
        bytes: &[u8],
    ) -> LayerResult<bool> {
        match self.state.write_impl(layer, offset, bytes) {
            Ok(()) => Ok(true),
            Err(e)
                if e != LayerError::Cancelled
                    && matches!(self.state.status(layer as usize), LayerStatus::Failed(_)) =>
            {
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }

    /// Sets a chunk's status unless it already holds a failure.
    pub(crate) fn set_chunk(&self, c: usize, s: ChunkStatus) {
        if let Some(a) = self.chunk_status.get(c) {
            let _ = a.fetch_update(Ordering::AcqRel, Ordering::Acquire, |old| {
                (old == ChunkStatus::Pending as u8
                    || (old == ChunkStatus::Ok as u8 && s != ChunkStatus::Ok))
                    .then_some(s as u8)
            });
        }
    }

    pub(crate) fn chunk(&self, c: usize) -> ChunkStatus {
        ChunkStatus::from_u8(self.chunk_status[c].load(Ordering::Acquire))
    }
}

/// Records a chunk's header as bad when dropped unless it was recorded already
/// ([`LoadShared::header_bad_unless_set`]).
pub(super) struct HeaderGuard<'a> {
    sh: &'a LoadShared,
    c: usize,
}

impl Drop for HeaderGuard<'_> {
    fn drop(&mut self) {
        self.sh.set_header(self.c, false);
    }
}
