//! The gather path of a load: one request to an ObjectCache server, which streams every
//! layer's slices layer-major into the load's destination. Used when the store's endpoint
//! offers gather ([`crate::store::Store::gather_target`] plus a hello probe); otherwise, or
//! when the server cannot be reached, the load falls back to ranged GETs.

use super::load::{LoadRequest, Shared};
use crate::layout::KeyBuilder;
use crate::protocol::{ChunkKeys, GatherRequest, MissReason};
use crate::store::GatherTarget;
use crate::transport::tcp::{GatherClient, GatherError};
use std::sync::atomic::Ordering;
use std::sync::Mutex;

/// What the engine knows about its store's endpoint.
#[derive(Debug, Default)]
pub(crate) enum Probe {
    /// Not probed yet.
    #[default]
    Unknown,
    /// Gather is offered; idle connections kept for reuse.
    Offered(Vec<GatherClient>),
    /// The endpoint does not speak gather (a stock S3 server): use ranged GETs.
    NotOffered,
}

/// Result of trying gather for one load.
pub(crate) enum Outcome {
    /// The load ran over gather (its layers are ready or failed).
    Done,
    /// Gather is not available: run the ranged-GET path instead. No byte was delivered.
    Fallback,
}

/// Runs `req` over gather if the endpoint offers it.
/// The gather descriptor of `req`: its chunks' keys under the store's bucket and key prefix,
/// every chunk full (`tokens_per_chunk` tokens). Used by the TCP and RDMA gather paths alike.
pub(crate) fn gather_request(
    request_id: u64,
    target: &GatherTarget,
    keys: &KeyBuilder,
    req: &LoadRequest,
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
fn unit_bytes_for(g: &crate::layout::KvGeometry) -> u32 {
    g.slice_bytes()
        .clamp(crate::protocol::MIN_UNIT_BYTES as u64, crate::protocol::MAX_UNIT_BYTES as u64) as u32
}

pub(crate) async fn try_gather(
    probe: &Mutex<Probe>,
    target: &GatherTarget,
    keys: &KeyBuilder,
    req: &LoadRequest,
    request_id: u64,
    sh: &Shared,
) -> Outcome {
    let pooled = {
        let mut p = probe.lock().expect("lock");
        match &mut *p {
            Probe::NotOffered => return Outcome::Fallback,
            // Skip connections the server closed while they sat idle (e.g. it restarted).
            Probe::Offered(pool) => std::iter::from_fn(|| pool.pop()).find(|c| !c.is_stale()),
            Probe::Unknown => None,
        }
    };
    let mut client = match pooled {
        Some(c) => c,
        None => match GatherClient::connect_with(target.addr.as_str(), target.credentials.clone()).await {
            Ok(c) => {
                let mut p = probe.lock().expect("lock");
                if matches!(*p, Probe::Unknown) {
                    *p = Probe::Offered(Vec::new());
                }
                c
            }
            Err(GatherError::NotOffered(why)) => {
                tracing::info!(addr = %target.addr, %why, "gather not offered; using ranged GETs");
                *probe.lock().expect("lock") = Probe::NotOffered;
                return Outcome::Fallback;
            }
            Err(e) => {
                tracing::warn!(addr = %target.addr, error = %e, "gather connection failed; using ranged GETs");
                return Outcome::Fallback;
            }
        },
    };
    let mut greq = gather_request(request_id, target, keys, req);
    // One unit per slice, checked by this client against the slice's stored CRC32C (end to
    // end: storage, server and network): the server reads no payload byte itself (from local
    // files it sends them with sendfile), a bad unit names exactly one (chunk, layer), and the
    // first layer's slices are sent as each is read.
    greq.verify = false;
    greq.max_unit_bytes = unit_bytes_for(&req.geometry);
    sh.requests.fetch_add(1, Ordering::Relaxed);
    match client.load(&greq, &sh.state).await {
        Ok(report) => {
            // Per-chunk status from the layers' miss reasons (the server names the chunk).
            for l in 0..sh.state.layers() {
                if let super::buffers::LayerStatus::Failed(e) = sh.state.status(l) {
                    if let Some((c, s)) = super::load::chunk_status_of(&e) {
                        sh.set_chunk(c, s);
                    }
                }
            }
            // The server names each bad chunk once and delivers the others: like the
            // ranged-GET path, every chunk not named is whole (its slices arrived verified).
            use super::load::ChunkStatus;
            for &(c, reason) in &report.missed_chunks {
                sh.set_chunk(
                    c as usize,
                    match reason {
                        MissReason::NotFound => ChunkStatus::Missing,
                        MissReason::GeometryMismatch => ChunkStatus::WrongGeometry,
                        MissReason::ChecksumMismatch => ChunkStatus::Corrupt,
                        MissReason::Storage => ChunkStatus::Error,
                    },
                );
            }
            for c in 0..req.hashes.len() {
                sh.set_chunk(c, ChunkStatus::Ok);
            }
            if let Probe::Offered(pool) = &mut *probe.lock().expect("lock") {
                pool.push(client);
            }
            Outcome::Done
        }
        Err(GatherError::Remote { code, message }) => {
            // Refused before any byte (busy, limits): the ranged-GET path can still serve it.
            tracing::warn!(?code, %message, "gather request refused; using ranged GETs");
            Outcome::Fallback
        }
        Err(e) => {
            // Mid-stream failures already failed the incomplete layers (misses, never bytes).
            let err = crate::error::LayerError::Storage {
                chunk: 0,
                message: format!("gather: {e}"),
            };
            sh.state.fail_pending(err);
            Outcome::Done
        }
    }
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
        let r = gather_request(1, &target, &keys, &plain);
        assert_eq!((r.priority, r.hints), (128, SchedHints::None));
        let hinted = plain
            .with_layer_compute_s(vec![0.002; g.layers as usize])
            .with_priority(200);
        let r = gather_request(2, &target, &keys, &hinted);
        assert_eq!(r.priority, 200);
        assert_eq!(
            r.hints,
            SchedHints::LayerComputeUs(vec![2000; g.layers as usize])
        );
        assert_eq!(r.layers, 0..g.layers);
    }
}
