//! Reads of chunk objects that are local files (the filesystem store, [`Store::open_local`]):
//! each layer slice is read with `pread(2)` straight into the caller's destination ranges and
//! its CRC32C checked there, with no read buffer between the page cache and the caller's
//! memory (the stream path copies every byte twice: into a body buffer, then into place).
//! A slice of a layer that another chunk already failed is not read at all.
//!
//! The outcome per slice is the stream path's (`ranged.rs`): a slice whose CRC does not
//! match fails its layer only; a read error fails this read's remaining layers; a later
//! layer's slice completes only once the chunk's header (read with layer 0) matched.
//!
//! [`Store::open_local`]: crate::store::Store::open_local

use super::Shared;
use crate::connector::buffers::LayerStatus;
use crate::connector::status::ChunkStatus;
use crate::error::LayerError;
use crate::layout::{slice_range, ChunkHeader, KvGeometry, HEADER_LEN};
use crate::transport::LayerSink;
use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::FileExt;

/// What a local read did, for the async side to finish (`ranged.rs`).
#[derive(Debug, Default)]
pub(super) struct LocalRead {
    /// Bytes read from the file (header, slices and their CRC trailers).
    pub(super) bytes: u64,
    /// Slices in place whose CRC32C matched (layer, CRC), not yet completed because the
    /// chunk's header was not known good yet: completed once it is, else the chunk fails.
    pub(super) awaiting_header: Vec<(u32, u32)>,
    /// Why the read stopped early, and the layers from which on it did not deliver.
    pub(super) failed: Option<(ChunkStatus, LayerError, Range<u32>)>,
}

/// Reads layers `layers` of chunk `chunk`'s object, open as `file` (its size already
/// checked against the geometry), into `sh`'s destination at the chunk's offset, checking
/// each slice's CRC32C; with `with_header`, the 64-byte header first (a header that does not
/// match `g` and `tokens` fails every layer of the chunk, as [`ChunkStatus::WrongGeometry`]).
/// Blocking: call it on the blocking pool.
#[allow(clippy::too_many_arguments)]
pub(super) fn read_slices(
    file: &File,
    sh: &Shared,
    chunk: usize,
    layers: Range<u32>,
    with_header: bool,
    g: &KvGeometry,
    tokens: u32,
    key: &str,
) -> LocalRead {
    let mut out = LocalRead::default();
    let storage = |what: &str, e: std::io::Error| LayerError::Storage {
        chunk,
        message: format!("{what} of {key}: {e}"),
    };
    if with_header {
        let mut h = [0u8; HEADER_LEN as usize];
        if let Err(e) = file.read_exact_at(&mut h, 0) {
            out.failed = Some((ChunkStatus::Error, storage("header read", e), layers));
            return out;
        }
        out.bytes += HEADER_LEN;
        let checked = ChunkHeader::decode(&h)
            .map_err(|e| e.to_string())
            .and_then(|h| h.check(g, tokens).map_err(|e| e.to_string()));
        if let Err(reason) = checked {
            let err = LayerError::GeometryMismatch { chunk, reason };
            out.failed = Some((ChunkStatus::WrongGeometry, err, 0..g.layers));
            return out;
        }
        sh.set_header(chunk, true);
    }
    let slice = g.slice_bytes();
    let dest_off = chunk as u64 * slice;
    for layer in layers.clone() {
        let rest = layer..layers.end;
        if sh.state.is_cancelled() {
            out.failed = Some((ChunkStatus::Error, LayerError::Cancelled, rest));
            return out;
        }
        let parts = match sh.state.dest_parts_impl(layer, dest_off, slice) {
            Ok(p) => p,
            Err(e)
                if e != LayerError::Cancelled
                    && matches!(sh.state.status(layer as usize), LayerStatus::Failed(_)) =>
            {
                // Another chunk's slice already failed this layer: this one is not needed.
                continue;
            }
            Err(e) => {
                out.failed = Some((ChunkStatus::Error, e, rest));
                return out;
            }
        };
        let mut at = slice_range(layer, slice).start;
        let mut crc = 0u32;
        for part in parts {
            if let Err(e) = file.read_exact_at(part, at) {
                // The range stays reserved and unfilled: the layer is failed below.
                out.failed = Some((ChunkStatus::Error, storage("read", e), rest));
                return out;
            }
            crc = crate::layout::crc::crc32c_append(crc, part);
            at += part.len() as u64;
            sh.progress.arrived(part.len() as u64);
        }
        sh.state.dest_filled(layer, slice);
        let mut trailer = [0u8; 4];
        if let Err(e) = file.read_exact_at(&mut trailer, at) {
            out.failed = Some((ChunkStatus::Error, storage("read", e), rest));
            return out;
        }
        out.bytes += slice + 4;
        let stored = u32::from_le_bytes(trailer);
        if stored != crc {
            // This slice is bad: its layer is a miss naming the chunk; the chunk's other
            // slices are still read.
            sh.slice_corrupt(chunk, layer, stored, crc);
        } else if with_header || sh.header_is_ok(chunk) {
            sh.record_slice_crc(chunk, layer as usize, stored);
            sh.state.complete_impl(layer, slice);
        } else {
            out.awaiting_header.push((layer, stored));
        }
    }
    out
}
