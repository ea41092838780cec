//! Gather over RDMA, server end (feature `rdma`): RDMA session set-up on the gather port and
//! per-unit delivery by `RDMA_WRITE_WITH_IMM` for requests whose target is RDMA.
//!
//! - Set-up: a connection on the server's port that opens with
//!   [`objectcache_client::transport::rdma::control::PREFACE`] (`OCRDMA01`) is an RDMA set-up channel;
//!   [`SessionRegistry::serve_control`] brings up the client's QPs and hands it a session
//!   token, and keeps the session until the channel closes.
//! - Delivery: the gather driver ([`super`]) plans, reads and verifies units exactly as
//!   for TCP, in the same (scheduler's) order; for an RDMA target it hands each unit to
//!   [`RdmaDelivery::unit`] instead of writing it to the stream. The unit is staged in the session's
//!   registered arena and written to its place in the layer's destination (the segment pieces
//!   of [`RdmaSegments::pieces`]: one `RDMA_WRITE` per piece but the last, then
//!   `RDMA_WRITE_WITH_IMM` of the last, on one queue pair) with the immediate
//!   `slot | layer | unit index`. A unit cut by a bad slice is not written whole: each of its
//!   good slices is written alone with a slice immediate (`slot | layer | chunk index`,
//!   [`Imm::slice`]), so only the bad chunk's slice is missing. Before `End`, [`RdmaDelivery::finish`] waits for every
//!   write's completion: a failed write (QP error, remote gone, timeout) becomes a `Miss` of its
//!   layer, and `End` reports only the writes that completed, which the client counts.
//!
//! The server opens the first RDMA device (or `OBJECTCACHE_RDMA_DEVICE`, `_PORT`,
//! `_GID_INDEX`) at start; `OBJECTCACHE_RDMA=off` disables it. Without a device the server
//! does not announce [`objectcache_client::protocol::ServerInfo::FEATURE_RDMA`] and refuses RDMA targets.

use crate::ServerState;
use bytes::Bytes;
use futures::future::BoxFuture;
use futures::stream::FuturesUnordered;
use futures::{FutureExt, StreamExt};
use objectcache_client::protocol::{
    unit_indices, GatherRequest, RdmaSegments, TransportTarget, UnitPlan, MAX_UNIT_BYTES,
};
use objectcache_client::transport::rdma::session::WriteResult;
use objectcache_client::transport::rdma::{
    DeviceSelector, GatherSession, Imm, ServerConfig as RdmaServerConfig, SessionRegistry,
};
use std::collections::HashMap;
use std::sync::Arc;
use tokio::net::TcpStream;

/// Opens the RDMA device for gather sessions, or says why not (logged; the server then serves
/// gather over TCP only).
pub(crate) fn open() -> Option<Arc<SessionRegistry>> {
    if std::env::var("OBJECTCACHE_RDMA").is_ok_and(|v| v.eq_ignore_ascii_case("off")) {
        tracing::info!("RDMA disabled by OBJECTCACHE_RDMA=off");
        return None;
    }
    let device = match DeviceSelector::from_env() {
        Ok(d) => d,
        Err(e) => {
            tracing::warn!(error = %e, "RDMA device selection; serving gather over TCP only");
            return None;
        }
    };
    let cfg = RdmaServerConfig {
        device,
        ..RdmaServerConfig::default()
    };
    match SessionRegistry::open(cfg, MAX_UNIT_BYTES as usize) {
        Ok(r) => {
            tracing::info!(
                device = r.device(),
                "RDMA target offered on the gather port"
            );
            Some(r)
        }
        Err(e) => {
            tracing::info!(error = %e, "no RDMA target; serving gather over TCP only");
            None
        }
    }
}

/// Serves one RDMA set-up channel (its preface already read by the server's preface sniffer)
/// on a blocking thread until it closes.
pub(crate) async fn serve_control(stream: TcpStream, reg: Arc<SessionRegistry>) {
    let peer = stream.peer_addr().ok();
    let r = async {
        let s = stream.into_std()?;
        s.set_nonblocking(false)?;
        tokio::task::spawn_blocking(move || -> objectcache_client::transport::rdma::Result<()> {
            reg.serve_control(s)
        })
        .await
        .map_err(std::io::Error::other)?
        .map_err(std::io::Error::other)
    };
    if let Err(e) = r.await {
        tracing::info!(?peer, error = %e, "RDMA set-up channel ended");
    }
}

/// RDMA delivery of one gather request (see the module doc).
pub(crate) struct RdmaDelivery {
    session: Arc<GatherSession>,
    slot: u32,
    /// Each requested layer's destination segments, indexed for cutting units.
    layers: Vec<RdmaSegments>,
    layer0: u32,
    /// `(layer, offset)` -> unit index within the layer (the immediate's `unit`).
    index: HashMap<(u32, u64), u32>,
    inflight: FuturesUnordered<BoxFuture<'static, (u32, WriteResult)>>,
    failed: HashMap<u32, String>,
    ok_writes: u64,
}

impl RdmaDelivery {
    /// Prepares delivery of `req` (an RDMA target) along `plan`.
    ///
    /// # Errors
    /// A message when the target is not RDMA, the server has no RDMA device, or the session
    /// is unknown or broken (the request is then refused before any read).
    pub(crate) fn start(
        sh: &ServerState,
        req: &GatherRequest,
        plan: &[UnitPlan],
    ) -> Result<Self, String> {
        let TransportTarget::Rdma(t) = &req.target else {
            return Err("not an RDMA target".into());
        };
        let reg = sh.rdma.as_ref().ok_or(super::objects::NO_RDMA)?;
        let session = reg
            .get(t.session)
            .ok_or_else(|| format!("no RDMA session {:016x} on this server", t.session))?;
        if let Some(why) = session.broken() {
            return Err(format!("RDMA session {:016x} is broken: {why}", t.session));
        }
        if plan.iter().any(|u| u.len as usize > session.slot_bytes()) {
            return Err(format!(
                "a unit exceeds the staging slot of {} bytes",
                session.slot_bytes()
            ));
        }
        // A unit that spans several destination segments takes one write per piece; refuse
        // (before any read) a target that would need more than the session's send queues
        // hold, or whose segments do not cover a unit.
        let most = session.max_pieces();
        let layers = t
            .layers
            .iter()
            .map(|l| RdmaSegments::new(l.clone()))
            .collect::<Option<Vec<_>>>()
            .ok_or("RDMA segment lengths overflow")?;
        for u in plan {
            let pieces = layers
                .get(u.layer.wrapping_sub(req.layers.start) as usize)
                .and_then(|l| l.pieces(u.offset, u.len))
                .ok_or_else(|| {
                    format!(
                        "unit at {}+{} of layer {} is past its destination",
                        u.offset, u.len, u.layer
                    )
                })?;
            if pieces.len() > most {
                return Err(format!(
                    "a unit of layer {} spans {} destination segments; this session writes at most \
                     {most} per unit",
                    u.layer,
                    pieces.len()
                ));
            }
        }
        let idx = unit_indices(plan);
        let index = plan
            .iter()
            .zip(idx)
            .map(|(u, i)| ((u.layer, u.offset), i))
            .collect();
        Ok(RdmaDelivery {
            session,
            slot: u32::from(t.slot),
            layers,
            layer0: req.layers.start,
            index,
            inflight: FuturesUnordered::new(),
            failed: HashMap::new(),
            ok_writes: 0,
        })
    }

    fn reap_ready(&mut self) {
        while let Some(Some((layer, r))) = self.inflight.next().now_or_never() {
            self.record(layer, r);
        }
    }

    fn record(&mut self, layer: u32, r: WriteResult) {
        match r {
            Ok(()) => self.ok_writes += 1,
            Err(why) => {
                self.failed.entry(layer).or_insert(why);
            }
        }
    }

    /// Stages and posts unit `u` (its bytes in `parts`). Returns once the write is posted (it
    /// waits for a free staging slot, bounded by the session's op timeout).
    ///
    /// # Errors
    /// A message when the write could not be posted; the caller makes the layer a miss.
    pub(crate) async fn unit(&mut self, u: &UnitPlan, parts: Vec<Bytes>) -> Result<(), String> {
        let unit = *self
            .index
            .get(&(u.layer, u.offset))
            .ok_or("unit not in the plan")?;
        let imm = Imm::new(self.slot, u.layer, unit).ok_or("immediate out of range")?;
        self.write(imm, u.offset, u.len, parts).await
    }

    /// Stages and posts chunk `chunk`'s whole slice of `layer` alone, `len` bytes at `offset`
    /// of the layer's destination (its bytes in `parts`), with a slice immediate
    /// ([`Imm::slice`]): the good slices of a unit that a bad slice cut. Returns once the
    /// write is posted.
    ///
    /// # Errors
    /// A message when the chunk index does not fit the immediate or the write could not be
    /// posted; the caller makes the layer a miss.
    pub(crate) async fn slice(
        &mut self,
        layer: u32,
        chunk: u32,
        offset: u64,
        len: u64,
        parts: Vec<Bytes>,
    ) -> Result<(), String> {
        let imm = Imm::slice(self.slot, layer, chunk)
            .ok_or_else(|| format!("chunk {chunk} does not fit a slice immediate"))?;
        self.write(imm, offset, len, parts).await
    }

    async fn write(
        &mut self,
        imm: Imm,
        offset: u64,
        len: u64,
        parts: Vec<Bytes>,
    ) -> Result<(), String> {
        self.reap_ready();
        let layer = u32::from(imm.layer);
        let i = layer
            .checked_sub(self.layer0)
            .ok_or("unit of a layer outside the request")? as usize;
        // One piece for a contiguous destination; one per segment the range spans otherwise.
        let pieces = self
            .layers
            .get(i)
            .and_then(|l| l.pieces(offset, len))
            .ok_or_else(|| format!("unit at {offset}+{len} is past layer {layer}'s destination"))?;
        let remote: Vec<(u64, u32, u64)> = pieces.iter().map(|p| (p.addr, p.rkey, p.len)).collect();
        let rx = self
            .session
            .write_pieces(imm.encode(), &parts, &remote)
            .await?;
        let timeout = self.session.op_timeout();
        let session = self.session.clone();
        self.inflight.push(
            async move {
                let r = match tokio::time::timeout(timeout, rx).await {
                    Ok(Ok(r)) => r,
                    Ok(Err(_)) => Err("RDMA session closed".to_string()),
                    Err(_) => {
                        let why = format!("no write completion within {timeout:?}");
                        session.break_session(&why);
                        Err(why)
                    }
                };
                (layer, r)
            }
            .boxed(),
        );
        Ok(())
    }

    /// Waits for every posted write; returns the layers whose writes failed (with why) and the
    /// number of writes that completed, which `End` reports.
    pub(crate) async fn finish(mut self) -> (Vec<(u32, String)>, u64) {
        while let Some((layer, r)) = self.inflight.next().await {
            self.record(layer, r);
        }
        let mut failed: Vec<(u32, String)> = self.failed.into_iter().collect();
        failed.sort_unstable_by_key(|f| f.0);
        (failed, self.ok_writes)
    }
}
