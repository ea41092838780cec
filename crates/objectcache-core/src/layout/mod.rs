//! Layout: KV geometry, the chunk object format, key grammar and read planning.
//!
//! Pure code (level 0): no I/O, no clock, no `unsafe`. Everything that decides *where bytes
//! are* lives here, so the stores, the server and the transports agree by construction.
#![forbid(unsafe_code)]

pub mod crc;
mod demux;
mod engine;
mod format;
mod geometry;
mod key;
mod placement;
mod ranges;
mod segment;
mod spans;

pub use demux::{BodyPart, SliceDemux, Wanted};
pub use engine::{EngineLayout, GroupKind, LayoutFamily, LayoutGroup, ResolvedLayout};
pub use format::{
    decode_chunk, encode_chunk, encode_chunk_parts, encode_marker, object_len, slice_crc,
    slice_range, slices_range, verify_slice, ChunkHeader, FormatError, CHECKSUM_CRC32C,
    FORMAT_VERSION, HEADER_LEN, MAGIC, MARKER_MAGIC, SLICE_CRC_LEN,
};
pub use geometry::{
    Dtype, KvGeometry, KvLayout, DEFAULT_TOKENS_PER_CHUNK, MAX_LAYOUT_NAME, PRESET_NAMES,
};
pub use key::{validate_namespace, ChunkHash, HashAlgo, KeyBuilder};
pub use placement::{
    place, plan_segment_reads, segment_pieces, Placement, Run, SegmentRead, SegmentRun,
};
pub use ranges::{plan_layer_major, RangeRead};
pub use segment::{
    decode_marker, encode_segment_parts, segment_digest, Marker, SegmentHeader, SegmentLayout,
    SegmentMarker, MAX_SEGMENT_CHUNKS, SEGMENT_FIXED_LEN, SEGMENT_MAGIC, SEGMENT_MARKER_LEN,
    SEGMENT_MARKER_MAGIC, SEGMENT_VERSION,
};
pub use spans::Spans;

/// The object format specification (`docs/object-format.md`), rendered in rustdoc.
#[doc = include_str!("../../../../docs/object-format.md")]
pub mod spec {}
