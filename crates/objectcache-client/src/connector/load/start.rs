//! Starting a load ([`Engine::load`]): the request and destination checked, the load's
//! entries leased, then either a load of the same chunks in flight followed or a fetch
//! started; and what the engine forgets of caller memory ([`Engine::forget_memory`]).

use super::{LoadHandle, LoadRequest, LoadShared};
use crate::connector::{flight, Engine, LayerBuffers};
use crate::error::Error;
use crate::layout::Marker;
use std::sync::atomic::Ordering;
use std::sync::Arc;

impl Engine {
    /// Forgets whatever this engine keeps about caller memory `ptr..ptr+len`: the RDMA
    /// registration of a memory area given to [`LayerBuffers::from_raw_ranges`] (kept for
    /// later loads until now). Call it before that memory is freed or remapped (the C ABI
    /// calls it when a region is deregistered). A load still writing into the memory keeps
    /// its registration until it ends. No-op for memory the engine never saw, and in builds
    /// without RDMA.
    pub fn forget_memory(&self, ptr: *mut u8, len: usize) {
        #[cfg(feature = "rdma")]
        crate::connector::rdma::forget(&self.rdma, ptr, len);
        #[cfg(not(feature = "rdma"))]
        let _ = (ptr, len);
    }

    /// Starts a layer-ordered load of `req.hashes` into `dest` and returns at once.
    ///
    /// `dest` must have `geometry.layers` buffers of at least `hashes.len() x slice_bytes`
    /// bytes; only that many bytes of each are written, never more. A layer's buffer may be
    /// a list of ranges (paged KV, [`LayerBuffers::paged`], [`LayerBuffers::from_raw_ranges`]):
    /// the bytes land straight in the ranges on every path, chunk `c`'s slice at logical
    /// offset `c x slice_bytes` of their concatenation. Reads are issued in layer
    /// order (layer 0 of every chunk first), at most `window_bytes` and `max_requests` in
    /// flight, each verified by its slice CRC32C before its layer can become ready.
    ///
    /// `req.hints` (per-layer compute times or deadlines, priority) go to the gather server
    /// with the request, and under `bandwidth_cap_bytes_per_s` to this engine's link, which
    /// paces the ranged GETs of all its loads under `scheduler`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an empty request, a hash of the wrong length for
    /// `hash_algo` (32 bytes under `sha256cbor`), a wrong number of layer buffers or a
    /// buffer too small (the message names the layer and the sizes), or hints that do not fit
    /// the geometry ([`LoadHints::validate`]).
    ///
    /// [`LoadHints::validate`]: super::LoadHints::validate
    pub fn load(&self, req: LoadRequest, dest: LayerBuffers) -> Result<LoadHandle, Error> {
        let g = &req.geometry;
        let keys = self.keys_for(g, &req.hashes)?;
        if req.hashes.is_empty() {
            return Err(Error::InvalidArgument("load: no chunks requested".into()));
        }
        req.hints.validate(g.layers)?;
        if let Some(p) = req
            .hints
            .segment_markers
            .keys()
            .find(|&&p| p >= req.hashes.len())
        {
            return Err(Error::InvalidArgument(format!(
                "load hints: a segment marker at prefix position {p}, the request has {} chunks",
                req.hashes.len()
            )));
        }
        crate::connector::check_layer_count("load", dest.layers(), "destination buffers", g)?;
        let need = req.hashes.len() as u64 * g.slice_bytes();
        for l in 0..dest.layers() {
            if (dest.layer_len(l) as u64) < need {
                return Err(Error::InvalidArgument(format!(
                    "load: layer {l} buffer has {} bytes, needs {} chunks x {} bytes = {need}",
                    dest.layer_len(l),
                    req.hashes.len(),
                    g.slice_bytes()
                )));
            }
        }
        let sh = Arc::new(LoadShared::new(dest, need, req.hashes.len()));
        // The load holds its entries until it ends (completed, failed, cancelled, dropped, or
        // with the process): this engine's collection never deletes them under it. A lookup
        // holds nothing.
        let data_keys: Vec<String> = req.hashes.iter().map(|h| keys.data(h)).collect();
        let now = std::time::SystemTime::now();
        for k in &data_keys {
            self.access.record(k, now);
        }
        let lease = self.leases.acquire(data_keys);
        let request_id = self.next_request_id.fetch_add(1, Ordering::Relaxed);
        let mut fetcher = self.fetcher();
        fetcher.markers = self.markers_known(&keys, &req.hashes);
        for (p, m) in &req.hints.segment_markers {
            fetcher
                .markers
                .entry(*p)
                .or_insert(Marker::Segment(m.clone()));
        }
        let fetcher = Arc::new(fetcher);
        let prefix = keys.prefix().to_string();
        let total_bytes = need * g.layers as u64;
        // One fetch for many requests: follow a load of the same chunks in flight (flight.rs).
        let leader = if self.cfg.single_flight {
            self.shared
                .flights
                .leader_for(&prefix, &req.hashes, total_bytes)
        } else {
            None
        };
        match leader {
            Some(leader) => {
                let timeout = self.cfg.load_deadline(total_bytes);
                let sh2 = sh.clone();
                let follow = flight::follow(leader, sh.clone(), fetcher, req, keys, request_id);
                let task = self.handle.spawn(async move {
                    let _lease = lease;
                    sh2.run_with_deadline(timeout, follow).await;
                });
                sh.tasks.lock().expect("lock").push(task);
                self.counters.loads_followed.fetch_add(1, Ordering::Relaxed);
            }
            None => {
                if self.cfg.single_flight {
                    self.shared
                        .flights
                        .register(&prefix, &req.hashes, &sh, self.id);
                }
                fetcher.start(req, keys, sh.clone(), request_id, Some(lease));
            }
        }
        self.counters.loads.fetch_add(1, Ordering::Relaxed);
        Ok(LoadHandle {
            sh,
            rt: self.handle.clone(),
        })
    }
}
