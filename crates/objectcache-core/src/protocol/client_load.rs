//! The client's bookkeeping of one gather load, sans-IO.
//!
//! The driver (`objectcache_client::transport::tcp`) reads the stream and writes units into the
//! load's destination; this tracker decides which layers are misses and with what error, from
//! what the driver saw: units delivered, units whose CRC32C did not match, units the sink
//! refused, the server's `Miss` frames, and the end of the load. A layer fails once (its first
//! error is the one reported); a layer that did not get all its bytes by the end fails then.
//! The server's side of the same load is [`super::ServerLoad`].

use super::{GatherRequest, MissFrame, MissReason};
use crate::error::LayerError;
use std::collections::HashMap;
use std::ops::Range;

/// What became of one load, for its report.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LoadOutcome {
    /// Units delivered and verified.
    pub units: u64,
    /// Payload bytes delivered.
    pub bytes: u64,
    /// Layers that are misses, ascending.
    pub failed_layers: Vec<u32>,
    /// Chunks the server named as missing, with the first reason given, by chunk index.
    pub missed_chunks: Vec<(u32, MissReason)>,
}

/// The client's state of one gather load (see the module docs).
#[derive(Debug, Clone)]
pub struct LoadTracker {
    layers: Range<u32>,
    /// Payload bytes of one layer of the request.
    layer_bytes: u64,
    /// Bytes of a full chunk's slice: a unit's chunk is its offset over this.
    slice_full: u64,
    got: HashMap<u32, u64>,
    failed: Vec<u32>,
    out: LoadOutcome,
}

impl LoadTracker {
    /// The tracker of a load of `req`.
    pub fn new(req: &GatherRequest) -> Self {
        Self {
            layers: req.layers.clone(),
            layer_bytes: req.layer_bytes(),
            slice_full: req.geometry.slice_len(req.geometry.tokens_per_chunk).max(1),
            got: HashMap::new(),
            failed: Vec::new(),
            out: LoadOutcome::default(),
        }
    }

    /// True once `layer` failed.
    pub fn has_failed(&self, layer: u32) -> bool {
        self.failed.contains(&layer)
    }

    fn fail(&mut self, layer: u32, err: LayerError) -> Option<LayerError> {
        if self.has_failed(layer) {
            return None;
        }
        self.failed.push(layer);
        Some(err)
    }

    /// A unit of `len` bytes of `layer` is in place and verified.
    pub fn delivered(&mut self, layer: u32, len: u64) {
        *self.got.entry(layer).or_default() += len;
        self.out.units += 1;
        self.out.bytes += len;
    }

    /// A unit of `layer` at `offset` failed its CRC32C (`expected` in the frame, `computed`
    /// over the bytes): the error to fail `layer` with, unless it has failed already.
    pub fn corrupt(
        &mut self,
        layer: u32,
        offset: u64,
        expected: u32,
        computed: u32,
    ) -> Option<LayerError> {
        let chunk = (offset / self.slice_full) as usize;
        self.fail(
            layer,
            LayerError::ChecksumMismatch {
                chunk,
                layer: layer as usize,
                stored: expected,
                computed,
            },
        )
    }

    /// The sink refused a unit of `layer` with `err`: the error to fail `layer` with, unless
    /// the load is cancelled (`err` is [`LayerError::Cancelled`]) or the layer has failed
    /// already (a sink may refuse writes to a failed layer).
    pub fn refused(&mut self, layer: u32, err: LayerError) -> Option<LayerError> {
        if err == LayerError::Cancelled {
            return None;
        }
        self.fail(layer, err)
    }

    /// The server's `Miss`: chunk `m.chunk` (object key `key`) will not arrive for
    /// `m.layers`. Returns the layers to fail, each with its error (layers that failed already
    /// are left out).
    pub fn miss(&mut self, m: &MissFrame, key: &str) -> Vec<(u32, LayerError)> {
        if !self.out.missed_chunks.iter().any(|c| c.0 == m.chunk) {
            self.out.missed_chunks.push((m.chunk, m.reason));
        }
        let c = m.chunk as usize;
        m.layers
            .clone()
            .filter_map(|l| {
                self.fail(l, m.reason.layer_error(c, key.to_string(), &m.message))
                    .map(|e| (l, e))
            })
            .collect()
    }

    /// The load ended (`End`, an error, or a cancel): the layers that have neither failed nor
    /// got all their bytes, now marked failed. The driver fails each with the end's error.
    pub fn unfinished(&mut self) -> Vec<u32> {
        let rest: Vec<u32> = self
            .layers
            .clone()
            .filter(|l| {
                !self.failed.contains(l) && self.got.get(l).copied().unwrap_or(0) < self.layer_bytes
            })
            .collect();
        self.failed.extend(&rest);
        rest
    }

    /// Units and bytes delivered so far.
    pub fn delivered_totals(&self) -> (u64, u64) {
        (self.out.units, self.out.bytes)
    }

    /// The load's outcome: failed layers ascending, missed chunks by index.
    pub fn outcome(mut self) -> LoadOutcome {
        self.failed.sort_unstable();
        self.out.failed_layers = self.failed;
        self.out.missed_chunks.sort_unstable_by_key(|m| m.0);
        self.out
    }
}
