//! Reads of chunk objects that are local files (the filesystem store, [`Store::open_local`]):
//! each layer slice is read with `pread(2)` straight into the caller's destination ranges and
//! its CRC32C checked there, with no read buffer between the page cache and the caller's
//! memory (the stream path copies every byte twice: into a body buffer, then into place).
//! A slice of a layer that another chunk already failed is not read at all. Segment objects
//! (format version 2) read their slices through [`read_slice`] too (`segment.rs`).
//!
//! The outcome per slice is the stream path's (`ranged.rs`): a slice whose CRC does not
//! match fails its layer only; a read error fails this read's remaining layers; a later
//! layer's slice completes only once the chunk's header (read with layer 0) matched.
//!
//! [`Store::open_local`]: crate::store::Store::open_local

use super::LoadShared;
use crate::connector::buffers::LayerStatus;
use crate::connector::status::ChunkStatus;
use crate::error::{LayerError, LayerResult};
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
    sh: &LoadShared,
    chunk: usize,
    layers: Range<u32>,
    with_header: bool,
    g: &KvGeometry,
    tokens: u32,
    key: &str,
) -> LocalRead {
    let mut out = LocalRead::default();
    if with_header {
        let mut h = [0u8; HEADER_LEN as usize];
        if let Err(e) = file.read_exact_at(&mut h, 0) {
            let message = format!("header read of {key}: {e}");
            let err = LayerError::Storage { chunk, message };
            out.failed = Some((ChunkStatus::Error, err, layers));
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
    for layer in layers.clone() {
        let rest = layer..layers.end;
        if sh.state.is_cancelled() {
            out.failed = Some((ChunkStatus::Error, LayerError::Cancelled, rest));
            return out;
        }
        let at = slice_range(layer, slice).start;
        let (stored, computed) = match read_slice(file, sh, chunk, layer, slice, at, key) {
            // Another chunk's slice already failed this layer: this one is not needed.
            Ok(None) => continue,
            Ok(Some(crcs)) => crcs,
            Err(e) => {
                out.failed = Some((ChunkStatus::Error, e, rest));
                return out;
            }
        };
        out.bytes += slice + 4;
        if stored != computed {
            // This slice is bad: its layer is a miss naming the chunk; the chunk's other
            // slices are still read.
            sh.slice_corrupt(chunk, layer, stored, computed);
        } else if with_header || sh.header_is_ok(chunk) {
            sh.record_slice_crc(chunk, layer as usize, stored);
            sh.state.complete_impl(layer, slice);
        } else {
            out.awaiting_header.push((layer, stored));
        }
    }
    out
}

/// Reads chunk `chunk`'s slice of `layer` (`slice` bytes at byte `at` of `file`, then its
/// 4-byte CRC32C trailer) straight into `sh`'s destination, and returns the stored CRC32C
/// and the one computed over the bytes read (the caller decides what a mismatch fails);
/// `None` when the layer already failed (another chunk's slice failed it), so the slice is
/// not read. Blocking.
///
/// # Errors
/// The destination's error ([`LayerError::Cancelled`] once the load is cancelled), or
/// [`LayerError::Storage`] naming the chunk and `key` for a read that fails; the slice's
/// range then stays reserved and unfilled, and the caller fails the layer.
pub(super) fn read_slice(
    file: &File,
    sh: &LoadShared,
    chunk: usize,
    layer: u32,
    slice: u64,
    at: u64,
    key: &str,
) -> LayerResult<Option<(u32, u32)>> {
    let parts = match sh.state.dest_parts_impl(layer, chunk as u64 * slice, slice) {
        Ok(p) => p,
        Err(e)
            if e != LayerError::Cancelled
                && matches!(sh.state.status(layer as usize), LayerStatus::Failed(_)) =>
        {
            return Ok(None);
        }
        Err(e) => return Err(e),
    };
    let storage = |e: std::io::Error| LayerError::Storage {
        chunk,
        message: format!("read of {key}: {e}"),
    };
    let mut at = at;
    let mut crc = 0u32;
    for part in parts {
        file.read_exact_at(part, at).map_err(storage)?;
        crc = crate::layout::crc::crc32c_append(crc, part);
        at += part.len() as u64;
        sh.progress.arrived(part.len() as u64);
    }
    sh.state.dest_filled(layer, slice);
    let mut trailer = [0u8; 4];
    file.read_exact_at(&mut trailer, at).map_err(storage)?;
    Ok(Some((u32::from_le_bytes(trailer), crc)))
}
