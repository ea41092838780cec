//! What became of each chunk of a load ([`ChunkStatus`]), and how misses and layer errors
//! map onto it: one place for the buffers, the load driver and every transport.

use crate::error::LayerError;

/// State of one chunk of a load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum ChunkStatus {
    /// Reads outstanding.
    Pending = 0,
    /// Every layer of this chunk arrived and verified.
    Ok = 1,
    /// The object does not exist.
    Missing = 2,
    /// A slice failed its checksum or the body was truncated.
    Corrupt = 3,
    /// The object was written for another geometry, model or format version.
    WrongGeometry = 4,
    /// Storage or transport error after bounded retries; also, on the RDMA path, a chunk
    /// whose slice shared a delivery unit (one RDMA write of several chunks' slices of a
    /// layer) with a slice that failed, so it never landed.
    Error = 5,
}

impl ChunkStatus {
    pub(crate) fn from_u8(v: u8) -> Self {
        match v {
            1 => ChunkStatus::Ok,
            2 => ChunkStatus::Missing,
            3 => ChunkStatus::Corrupt,
            4 => ChunkStatus::WrongGeometry,
            5 => ChunkStatus::Error,
            _ => ChunkStatus::Pending,
        }
    }
}

/// The status of a chunk the server named as a miss, by the reason it gave (gather over TCP
/// and over RDMA alike).
pub(crate) fn chunk_status_of_miss(reason: crate::protocol::MissReason) -> ChunkStatus {
    use crate::protocol::MissReason;
    match reason {
        MissReason::NotFound => ChunkStatus::Missing,
        MissReason::GeometryMismatch => ChunkStatus::WrongGeometry,
        MissReason::ChecksumMismatch => ChunkStatus::Corrupt,
        MissReason::Storage => ChunkStatus::Error,
    }
}

/// The chunk a layer error names, and the chunk status it implies (`None` for errors that
/// name no chunk: timeouts, cancellation).
pub(crate) fn chunk_status_of(e: &LayerError) -> Option<(usize, ChunkStatus)> {
    match e {
        LayerError::Missing { chunk, .. } => Some((*chunk, ChunkStatus::Missing)),
        LayerError::ChecksumMismatch { chunk, .. } => Some((*chunk, ChunkStatus::Corrupt)),
        LayerError::GeometryMismatch { chunk, .. } => Some((*chunk, ChunkStatus::WrongGeometry)),
        LayerError::Storage { chunk, .. } => Some((*chunk, ChunkStatus::Error)),
        _ => None,
    }
}
