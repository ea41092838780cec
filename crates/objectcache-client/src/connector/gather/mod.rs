//! The gather path of a load: one request to an ObjectCache server, which streams every
//! layer's slices layer-major into the load's destination. Used when the store's endpoint
//! offers gather ([`crate::store::Gateways::route`] plus one capabilities probe per
//! engine, [`offered`]); otherwise, or
//! when the server cannot be reached, the load falls back to ranged GETs.
//!
//! By concern: the endpoints' probes and connection pools (`probe.rs`), one stripe's sink
//! and the stripes' lockstep (`stripe.rs`), and the striped, failing-over run of a load
//! (`run.rs`). The descriptor of a load, shared with the RDMA path, is here.

mod probe;
mod run;
mod stripe;

pub use probe::GatherStatus;
pub(crate) use probe::{offered, start_probe, status, Probes};
pub(crate) use run::try_gather;

use crate::connector::load::LoadRequest;
use crate::layout::KeyBuilder;
use crate::protocol::{ChunkKeys, GatherRequest, SegmentPlacement};
use crate::store::GatherTarget;

/// Result of trying gather for one load.
pub(crate) enum Outcome {
    /// The load ran over gather (its layers are ready or failed).
    Done,
    /// Gather is not available: run the ranged-GET path instead. No byte was delivered.
    Fallback,
}

/// The gather descriptor of `req`: its chunks' keys under the store's bucket and key prefix,
/// every chunk full (`tokens_per_chunk` tokens), and where chunks lie in segment objects
/// (`segments`, format version 2; for a server announcing
/// [`crate::protocol::ServerInfo::FEATURE_SEGMENTS`]). Used by the TCP and RDMA gather paths
/// alike.
pub(crate) fn gather_request(
    request_id: u64,
    target: &GatherTarget,
    keys: &KeyBuilder,
    req: &LoadRequest,
    segments: Option<SegmentPlacement>,
) -> GatherRequest {
    let g = &req.geometry;
    let mut greq = GatherRequest::for_prefix(
        request_id,
        &target.bucket,
        keys,
        g,
        req.hashes.clone(),
        vec![g.tokens_per_chunk; req.hashes.len()],
    );
    greq.priority = req.hints.priority;
    greq.hints = req.hints.sched_hints();
    greq.segments = segments;
    if !target.key_prefix.is_empty() {
        greq.chunks = ChunkKeys::Hashed {
            prefix: format!("{}/{}", target.key_prefix, keys.prefix()),
            hashes: req.hashes.clone(),
        };
    }
    greq
}

/// Unit size of the connector's TCP gather loads: one full chunk's slice, within the
/// protocol's `MIN_UNIT_BYTES..=MAX_UNIT_BYTES`.
pub(crate) fn unit_bytes_for(g: &crate::layout::KvGeometry) -> u32 {
    g.slice_bytes().clamp(
        crate::protocol::MIN_UNIT_BYTES as u64,
        crate::protocol::MAX_UNIT_BYTES as u64,
    ) as u32
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{HashAlgo, KvGeometry};
    use crate::protocol::SchedHints;

    #[test]
    fn gather_requests_carry_the_load_hints() {
        let g = KvGeometry::smollm2_135m();
        let keys = KeyBuilder::new("ns", &g, HashAlgo::Sha256Cbor).unwrap();
        let target = GatherTarget {
            addr: "127.0.0.1:1".into(),
            bucket: "b".into(),
            key_prefix: String::new(),
            credentials: None,
        };
        let hashes = vec![crate::ChunkHash::from_digest([7; 32])];
        let plain = LoadRequest::new(g.clone(), hashes.clone());
        let r = gather_request(1, &target, &keys, &plain, None);
        assert_eq!((r.priority, r.hints), (128, SchedHints::None));
        let hinted = plain
            .with_layer_compute_s(vec![0.002; g.layers as usize])
            .with_priority(200);
        let r = gather_request(2, &target, &keys, &hinted, None);
        assert_eq!(r.priority, 200);
        assert_eq!(
            r.hints,
            SchedHints::LayerComputeUs(vec![2000; g.layers as usize])
        );
        assert_eq!(r.layers, 0..g.layers);
    }
}
