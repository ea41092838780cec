//! Transports: thin drivers that move gather-protocol bytes (TCP; RDMA with feature `rdma`), and
//! [`delay::DelayProxy`], a loopback proxy adding one-way delay for tests and benchmarks.
//!
//! A transport delivers a load's bytes into a [`LayerSink`], which the connector implements
//! over the caller's per-layer destination buffers.

pub mod delay;
pub mod discovery;
pub mod tcp;

use crate::error::{LayerError, LayerResult};

#[cfg(feature = "rdma")]
pub mod rdma;

/// Where a load's bytes land. Implemented by the connector over the caller's destination
/// buffers; called by transports (gather over TCP or RDMA) and by the stock-S3 path.
///
/// Layer `l`'s destination is `chunks x slice_len` bytes: chunk `c`'s K+V slice (CRC
/// excluded) at offset `c x slice_len`. Offsets are logical: the memory behind them may be
/// one buffer or a list of ranges (paged KV), which the sink maps. Methods may be called from any thread; calls for
/// different byte ranges may run concurrently; a range is written at most once per load.
pub trait LayerSink: Send + Sync {
    /// Copies `data` into layer `layer`'s destination at byte `offset`.
    ///
    /// # Errors
    /// [`LayerError::Cancelled`] if the load was cancelled; writes past the destination's end
    /// are refused with [`LayerError::GeometryMismatch`] (no byte is written past the buffer).
    fn write(&self, layer: u32, offset: u64, data: &[u8]) -> LayerResult<()>;
    /// Records that the transport itself placed `len` bytes at `offset` of layer `layer`'s
    /// destination (RDMA writes by the NIC, no CPU copy). Counted like [`LayerSink::write`].
    ///
    /// # Errors
    /// As [`LayerSink::write`].
    fn placed(&self, layer: u32, offset: u64, len: u64) -> LayerResult<()>;
    /// Lends the destination bytes `offset..offset+len` of layer `layer` for a transport to
    /// fill in place (a socket read straight into the caller's buffer: one copy, the
    /// kernel's). The range is reserved like a [`LayerSink::write`] (disjoint from every other
    /// write, inside the buffer); the transport fills all of it, then calls
    /// [`LayerSink::dest_filled`], then [`LayerSink::complete`] once its checksum matched.
    /// `Ok(None)` when the destination cannot be lent (device memory, locked buffers): use
    /// [`LayerSink::write`] then. The default lends nothing.
    ///
    /// # Errors
    /// As [`LayerSink::write`].
    #[allow(clippy::mut_from_ref)]
    fn dest_mut(&self, layer: u32, offset: u64, len: u64) -> LayerResult<Option<&mut [u8]>> {
        let _ = (layer, offset, len);
        Ok(None)
    }
    /// As [`LayerSink::dest_mut`], for destinations that are not one contiguous range (paged
    /// KV: a layer's destination is a list of ranges, one per engine block): lends the
    /// destination bytes `offset..offset+len` as one slice per range they span, in order.
    /// The transport fills all of them, then calls [`LayerSink::dest_filled`] with `len`.
    /// `Ok(None)` when the destination cannot be lent. The default lends what
    /// [`LayerSink::dest_mut`] lends, as one slice.
    ///
    /// # Errors
    /// As [`LayerSink::write`].
    #[allow(clippy::mut_from_ref)]
    fn dest_parts(&self, layer: u32, offset: u64, len: u64) -> LayerResult<Option<Vec<&mut [u8]>>> {
        Ok(self.dest_mut(layer, offset, len)?.map(|d| vec![d]))
    }
    /// Records that the `len` bytes lent by [`LayerSink::dest_mut`] or
    /// [`LayerSink::dest_parts`] for layer `layer` were all written. Counted like [`LayerSink::write`]; the default does nothing (it lends
    /// nothing).
    fn dest_filled(&self, layer: u32, len: u64) {
        let _ = (layer, len);
    }
    /// Called by a transport before it receives the first unit of layer `layer` (units arrive
    /// in layer order). A sink may return a future that holds the transport back until the
    /// other transports filling the same load have caught up: the connector's striped loads
    /// keep every stripe at most one layer ahead of the slowest, and let none start layer 1
    /// before all have finished layer 0, so the stripes share the receiving cores on the
    /// layers needed first. While it waits the transport reads nothing (TCP flow control
    /// holds the server back). Default: `None`, go on at once.
    fn begin_layer(&self, layer: u32) -> Option<futures::future::BoxFuture<'_, ()>> {
        let _ = layer;
        None
    }
    /// Marks `bytes` bytes of layer `layer` as verified (checksum matched). A layer becomes
    /// ready when every byte of its destination was written or placed exactly once **and**
    /// verified; overlapping or out-of-bounds writes are refused, so a layer can never be
    /// ready with bytes missing.
    fn complete(&self, layer: u32, bytes: u64);
    /// Marks layer `layer` failed: it will never be reported ready (a miss).
    fn fail(&self, layer: u32, err: LayerError);
    /// Called instead of [`LayerSink::fail`] for each layer a transport had not finished
    /// when its connection to the server broke or the server stopped the request (an I/O
    /// error, an error frame, a protocol violation; not a cancelled load, not a per-chunk
    /// miss). A sink that can have the rest fetched elsewhere (the connector's failover to
    /// another gateway) keeps the layer pending; the default fails it.
    fn broken(&self, layer: u32, err: LayerError) {
        self.fail(layer, err)
    }
    /// The unit of `len` bytes at `offset` of layer `layer` was delivered and matched CRC32C
    /// `crc` (called before [`LayerSink::complete`], which may make the layer ready). Lets the connector keep each slice's CRC
    /// for loads that copy from this one. Default: nothing.
    fn verified(&self, layer: u32, offset: u64, len: u64, crc: u32) {
        let _ = (layer, offset, len, crc);
    }
    /// The `len` bytes at `offset` of layer `layer` were placed by the transport and checked
    /// before they were sent, with no CRC known here (RDMA: the server checked each slice's
    /// CRC32C before its write; called after [`LayerSink::placed`] succeeded, before
    /// [`LayerSink::complete`]). Lets the connector count the chunks whose every slice is in
    /// place when a layer is a miss for another chunk. Default: nothing.
    fn landed(&self, layer: u32, offset: u64, len: u64) {
        let _ = (layer, offset, len);
    }
    /// The transport is alive: `bytes` bytes arrived from the server, or 0 for a sign of
    /// life without data (a `Held` frame: the server holds the load on purpose). Feeds the
    /// connector's per-load stall watchdog; called from any thread, as often as the
    /// transport reads. Default: nothing.
    fn progress(&self, bytes: u64) {
        let _ = bytes;
    }
    /// `true` once the load is cancelled: transports stop sending and return.
    fn is_cancelled(&self) -> bool;
}
