//! Gather and save request descriptors, their codecs, and the pure delivery-unit planner.
//!
//! By concern: the wire geometry (`geometry.rs`), the gather request (`gather.rs`) and its
//! RDMA destinations (`rdma.rs`), the batched save request (`save.rs`), and the unit planner
//! (`plan.rs`). Bucket and key limits, shared by both requests, are here.

mod gather;
mod geometry;
mod plan;
mod rdma;
mod save;
mod segments;

pub use gather::{
    ChunkKeys, DeliveryOrder, GatherRequest, LoadGroup, SchedHints, TransportTarget, MAX_STRIPES,
};
pub use geometry::{HeaderMismatch, WireGeometry};
pub use plan::{plan_units, unit_indices, SlicePiece, UnitPlan};
pub use rdma::{
    rdma_pieces, RdmaRegion, RdmaSegments, RdmaTarget, RDMA_MAX_LAYERS, RDMA_MAX_SEGMENTS,
    RDMA_MAX_UNITS_PER_LAYER, RDMA_SLOTS,
};
pub use save::{SaveChunk, SaveRequest};
pub use segments::{
    SegmentPlacement, SegmentRef, MAX_SEGMENTS_PER_REQUEST, MAX_SEGMENT_HEADER_BYTES_PER_REQUEST,
};

use crate::protocol::ProtocolError;

/// Longest bucket name (S3's limit).
const MAX_BUCKET_LEN: usize = 63;
/// Longest object key (S3's limit).
const MAX_KEY_LEN: usize = 1024;

/// A bucket name that S3's rules for new buckets refuse ([`check_bucket_name`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{name:?} is not an S3 bucket name (3..=63 of a-z 0-9 . -, starting with a letter or digit)"
)]
pub struct BadBucketName {
    /// The name as given.
    pub name: String,
}

/// Checks a bucket name against S3's rules for new buckets, which the gather protocol and
/// the ObjectCache server take: 3 to 63 characters of `a-z`, `0-9`, `.` and `-`, starting
/// with a letter or digit.
///
/// # Errors
/// [`BadBucketName`], whose message names the bucket and the rule.
pub fn check_bucket_name(b: &str) -> Result<(), BadBucketName> {
    let ok = (3..=MAX_BUCKET_LEN).contains(&b.len())
        && b.bytes()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'.' || c == b'-')
        && b.as_bytes()[0].is_ascii_alphanumeric();
    match ok {
        true => Ok(()),
        false => Err(BadBucketName {
            name: b.to_string(),
        }),
    }
}

fn validate_bucket(b: &str) -> Result<(), ProtocolError> {
    check_bucket_name(b).map_err(|e| ProtocolError::invalid("bucket", e.to_string()))
}
