//! Gather over RDMA, client end: a gather connection (the `OCGATHER` protocol on the server's
//! gather port) whose requests carry an RDMA target, so the stream carries only control frames
//! (accept, misses, end) while the server writes every unit into the client's registered
//! memory over the session's queue pairs.
//!
//! A load: plan the units exactly as the server will ([`plan_units`], layer-major, units of at
//! most `max_unit_bytes` that never span layers), register each layer's destination (through
//! the session's registration cache; a paged destination becomes a list of segments of its
//! registered memory areas, see [`RdmaTarget`]), announce the load to the session
//! ([`RdmaClient::expect_gather`]), send the descriptor, then turn `Miss` frames into layer
//! misses and wait, after `End`, for as many write completions as the server reports. A broken
//! stream breaks the RDMA session too, so no late write can land after the call returns.

use std::sync::Arc;

use tokio::net::ToSocketAddrs;

use crate::error::LayerError;
use crate::protocol::{
    plan_units, unit_indices, ClientEvent, GatherRequest, LoadTracker, MissReason, ProtocolError,
    RdmaTarget, ServerInfo, TransportTarget,
};
use crate::transport::tcp::GatherClient;
use crate::transport::LayerSink;

use super::client::{LayerDest, LayerPlan, RdmaClient};

/// Why a gather-over-RDMA load did not run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RdmaGatherError {
    /// Refused before any byte was written (server without RDMA, busy, bad request, no slot,
    /// registration failed): the caller may run the load over TCP instead. No layer was touched.
    #[error("gather over RDMA refused: {0}")]
    Refused(String),
    /// Failed mid-load: every layer not delivered is already a miss, and the RDMA session is
    /// broken (reconnect it).
    #[error("gather over RDMA failed: {0}")]
    Failed(String),
}

/// A gather connection used for RDMA-target requests: a [`GatherClient`] (its hello,
/// authentication, stream and protocol state) whose loads name an RDMA target.
#[derive(Debug)]
pub struct GatherConn {
    c: GatherClient,
}

impl GatherConn {
    /// Connects to a server's gather port and exchanges hellos, authenticating with
    /// `credentials` (access key id, secret) when the server asks (gather protocol v2).
    ///
    /// # Errors
    /// A message when the connection fails, the server does not speak gather, refuses the
    /// credentials, or does not announce the RDMA target ([`ServerInfo::FEATURE_RDMA`]).
    pub async fn connect(
        addr: impl ToSocketAddrs,
        credentials: Option<(String, String)>,
    ) -> Result<Self, String> {
        let c = GatherClient::connect_with(addr, credentials)
            .await
            .map_err(|e| e.to_string())?;
        if c.server_info().features & ServerInfo::FEATURE_RDMA == 0 {
            return Err("the server does not offer the RDMA target".into());
        }
        Ok(GatherConn { c })
    }

    /// The server's hello.
    pub fn server_info(&self) -> ServerInfo {
        self.c.server_info()
    }

    /// Runs `req` (its target is replaced by an RDMA target on `rdma`'s session) into `dests`,
    /// one per requested layer in order (each at least `req.layer_bytes()` long), reporting
    /// progress to `sink`: `placed` + `complete` per unit as its write completes, `fail` for
    /// layers the server reports missing or that are cut off by a failure. Returns once every
    /// layer is resolved and no further write of this load can land, with the chunks the
    /// server named as misses (chunk index in the request, and why; each once).
    ///
    /// # Errors
    /// [`RdmaGatherError::Refused`] before anything was written (fall back to TCP);
    /// [`RdmaGatherError::Failed`] after (layers already failed; the session is broken).
    pub async fn load(
        &mut self,
        rdma: &RdmaClient,
        mut req: GatherRequest,
        dests: &[LayerDest],
        sink: Arc<dyn LayerSink>,
    ) -> Result<Vec<(usize, MissReason)>, RdmaGatherError> {
        let refused = RdmaGatherError::Refused;
        if let Some(why) = rdma.broken() {
            return Err(refused(format!("RDMA session broken: {why}")));
        }
        let nl = (req.layers.end - req.layers.start) as usize;
        if dests.len() != nl
            || dests
                .iter()
                .zip(req.layers.clone())
                .any(|(d, l)| d.layer() != l)
        {
            return Err(refused(format!(
                "{} destinations for layers {:?}",
                dests.len(),
                req.layers
            )));
        }
        let plan = plan_units(&req);
        let idx = unit_indices(&plan);
        let mut tables: Vec<Vec<(u64, u64)>> = vec![Vec::new(); nl];
        for (u, &i) in plan.iter().zip(&idx) {
            let t = &mut tables[(u.layer - req.layers.start) as usize];
            debug_assert_eq!(t.len(), i as usize);
            t.push((u.offset, u.len));
        }
        // The slices of units that hold several: written alone when another slice of their
        // unit is bad (in such a unit every piece is a whole slice).
        let mut slices: Vec<Vec<(u32, u64, u64)>> = vec![Vec::new(); nl];
        for u in plan.iter().filter(|u| u.pieces.len() > 1) {
            let mut at = u.offset;
            for p in &u.pieces {
                let len = p.range.end - p.range.start;
                slices[(u.layer - req.layers.start) as usize].push((p.chunk, at, len));
                at += len;
            }
        }
        let layers: Vec<LayerPlan> = dests
            .iter()
            .cloned()
            .zip(tables)
            .zip(slices)
            .map(|((dest, units), slices)| LayerPlan {
                dest,
                units,
                slices,
            })
            .collect();
        let (handle, slot, segments) = rdma
            .expect_gather(&layers, sink.clone())
            .map_err(|e| refused(e.to_string()))?;
        let handle = AbortOnDrop(Some(handle));
        // One segment per layer for contiguous destinations; a scattered (paged) one needs a
        // server that accepts several (start_gather refuses it otherwise, and the caller falls
        // back to TCP).
        req.target = TransportTarget::Rdma(RdmaTarget {
            session: rdma.session(),
            slot: slot as u8,
            layers: segments,
        });
        if let Err(e) = self.c.conn.start_gather(&req) {
            handle.forget();
            return Err(refused(e.to_string()));
        }
        let mut accepted = false;
        let mut cancelled = false;
        // Which layers the server's `Miss` frames fail, and with what error (the units
        // themselves are counted by the session's completion bookkeeping).
        let mut track = LoadTracker::new(&req);
        let result: Result<(), String> = loop {
            if let Err(e) = self.c.flush().await {
                break Err(format!("gather stream: {e}"));
            }
            let mut end = None;
            while let Some(ev) = self.c.conn.poll_event() {
                match ev {
                    ClientEvent::Accepted(_) => accepted = true,
                    ClientEvent::Miss(m) => {
                        let key = req.chunks.key(m.chunk as usize).unwrap_or_default();
                        handle.fail_layers(&track.miss(&m, &key));
                    }
                    ClientEvent::End(t) => {
                        end = Some(Ok(t.units));
                        break;
                    }
                    ClientEvent::Error { code, message } => {
                        end = Some(Err(format!("server error {code:?}: {message}")));
                        break;
                    }
                    other => {
                        end = Some(Err(format!("unexpected {other:?} during an RDMA load")));
                        break;
                    }
                }
            }
            match end {
                Some(Ok(units)) => {
                    if cancelled {
                        // The server stopped at the cancel and names no miss for the layers it
                        // left: they are `Cancelled` now, so the load ends as soon as the
                        // writes it did make have completed (none comes after its End).
                        let left: Vec<(u32, LayerError)> = req
                            .layers
                            .clone()
                            .map(|l| (l, LayerError::Cancelled))
                            .collect();
                        handle.fail_layers(&left);
                    }
                    handle.server_end(units);
                    break Ok(());
                }
                Some(Err(why)) if !accepted => {
                    // Refused before any write was posted: nothing can land; fall back.
                    handle.forget();
                    return Err(refused(why));
                }
                Some(Err(why)) => break Err(why),
                None => {}
            }
            if !cancelled && sink.is_cancelled() {
                cancelled = true;
                self.c.conn.cancel(req.request_id);
                continue;
            }
            // Units arrive as RDMA writes, not frames: the stream may stay silent for the whole
            // load, so it is read in slices of CANCEL_POLL to notice a cancel meanwhile.
            let Ok(read) = tokio::time::timeout(CANCEL_POLL, self.c.read_more()).await else {
                continue;
            };
            match read {
                Ok(0) => break Err("the server closed the gather stream mid-load".into()),
                Ok(_) => {
                    if let Err(e) = self.c.conn.handle_bytes(&mut self.c.buf) {
                        break Err(ProtocolError::to_string(&e));
                    }
                }
                Err(e) => break Err(format!("gather stream: {e}")),
            }
        };
        if let Err(why) = &result {
            // The stream is gone mid-load: writes may still be in flight. Breaking the session
            // moves the QPs to the error state first, so none lands after this returns.
            handle.abort(&format!("gather stream failed: {why}"));
        }
        // Wait (bounded by the session's load deadline, enforced by its poller) for every write.
        handle.finished().await;
        handle.finish();
        let result = match (result, rdma.broken()) {
            // Layers cut off by a broken session are already misses; say so to the caller.
            (Ok(()), Some(why)) => Err(format!("RDMA session broke during the load: {why}")),
            (r, _) => r,
        };
        if cancelled {
            for l in req.layers.clone() {
                sink.fail(l, LayerError::Cancelled);
            }
        }
        let missed = track.outcome().missed_chunks;
        result
            .map(|()| missed.into_iter().map(|(c, r)| (c as usize, r)).collect())
            .map_err(RdmaGatherError::Failed)
    }
}

/// How soon a load notices that its sink was cancelled while the gather stream is silent
/// (the read is a cancel-safe `read_buf`, so a timed-out read loses nothing).
const CANCEL_POLL: std::time::Duration = std::time::Duration::from_millis(20);

/// Holds a gather load's handle; if the load future is dropped (a caller's deadline) before the
/// load finished, the session is broken at once so that no write lands in memory the caller
/// takes back.
struct AbortOnDrop(Option<super::client::LoadHandle>);

impl std::ops::Deref for AbortOnDrop {
    type Target = super::client::LoadHandle;
    fn deref(&self) -> &Self::Target {
        self.0.as_ref().expect("present until consumed")
    }
}

impl AbortOnDrop {
    fn forget(mut self) {
        if let Some(h) = self.0.take() {
            h.forget();
        }
    }
    fn finish(mut self) {
        if let Some(h) = self.0.take() {
            let _ = h.wait();
        }
    }
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if let Some(h) = self.0.take() {
            if h.is_finished() {
                let _ = h.wait();
            } else if h.all_units_in() {
                // Every write of this load has landed (the caller stopped waiting for `End`
                // once its layers were ready): nothing more can be written; free the slot.
                h.forget();
            } else {
                h.abort("the load was dropped before it finished");
                let _ = h.wait();
            }
        }
    }
}
