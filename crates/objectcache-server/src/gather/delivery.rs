//! Where a load's units go, and how each [`LoadAction`] is carried out: frames on the gather
//! stream, or (feature `rdma`) RDMA writes into the client's memory ([`super::rdma`]).

use super::io::Io;
use crate::ServerState;
use bytes::Bytes;
use objectcache_client::protocol::{
    ErrorCode, GatherRequest, LoadAction, ServerLoad, TransportTarget, UnitPlan,
};

/// A load's delivery, chosen from its request's transport target.
pub(super) enum Delivery {
    /// Unit frames on the gather connection.
    Stream,
    /// `RDMA_WRITE_WITH_IMM` into the client's registered layer buffers.
    #[cfg(feature = "rdma")]
    Rdma(super::rdma::RdmaDelivery),
}

impl Delivery {
    /// The delivery of `req` along `plan`.
    ///
    /// # Errors
    /// `Unsupported` with a message when the RDMA target cannot be served (no RDMA in this
    /// server, an unknown or broken session, a unit past its destination or wider than the
    /// session's staging slot): the request is refused before any read.
    #[cfg_attr(not(feature = "rdma"), allow(unused_variables))]
    pub(super) fn start(
        sh: &ServerState,
        req: &GatherRequest,
        plan: &[UnitPlan],
    ) -> Result<Self, (ErrorCode, String)> {
        match &req.target {
            TransportTarget::InlineTcp => Ok(Delivery::Stream),
            #[cfg(feature = "rdma")]
            TransportTarget::Rdma(_) => super::rdma::RdmaDelivery::start(sh, req, plan)
                .map(Delivery::Rdma)
                .map_err(|m| (ErrorCode::Unsupported, m)),
            #[cfg(not(feature = "rdma"))]
            TransportTarget::Rdma(_) => {
                Err((ErrorCode::Unsupported, super::objects::NO_RDMA.into()))
            }
        }
    }

    /// True for an RDMA target (the load's units become RDMA writes).
    pub(super) fn is_rdma(&self) -> bool {
        !matches!(self, Delivery::Stream)
    }

    /// Carries out `action` for unit `plan` of `load`: a `Miss` and a unit frame are queued on
    /// the connection (the caller flushes); an RDMA write is posted, unless a write of its
    /// layer already failed, and a write that cannot be posted misses its layer (named once).
    pub(super) async fn carry(
        &mut self,
        io: &mut Io,
        sh: &ServerState,
        load: &mut ServerLoad,
        plan: &UnitPlan,
        action: LoadAction<Bytes>,
    ) {
        match action {
            LoadAction::SendMiss(m) => {
                sh.metrics.error("miss");
                io.conn.send_miss(m);
            }
            LoadAction::SendUnit(h, parts) => {
                let len = h.len as u64;
                io.conn.send_unit(h, parts);
                load.sent(len);
                sh.metrics.bytes("gather_out", len);
            }
            LoadAction::WriteRdma(w) => {
                #[cfg(feature = "rdma")]
                if let Delivery::Rdma(d) = self {
                    let layer = plan.layer;
                    if load.rdma_layer_failed(layer) {
                        return;
                    }
                    let posted = match w.slice_of {
                        None => d.unit(plan, w.parts).await,
                        Some(c) => d.slice(layer, c, w.offset, w.len, w.parts).await,
                    };
                    match posted {
                        Ok(()) => {
                            load.sent(w.len);
                            sh.metrics.bytes("gather_out", w.len);
                        }
                        Err(msg) => {
                            sh.metrics.error("rdma");
                            let first = plan.pieces.first().map(|p| p.chunk);
                            let c = w.slice_of.or(first).unwrap_or(0);
                            if let Some(m) = load.rdma_failed(layer, c, &msg) {
                                io.conn.send_miss(m);
                            }
                        }
                    }
                    return;
                }
                // The load cuts RDMA writes only for an RDMA delivery (`is_rdma`); were one
                // to reach a stream, its layer stays incomplete and the client misses it.
                tracing::error!(
                    layer = plan.layer,
                    len = w.len,
                    "RDMA write on a stream load left out"
                );
            }
        }
    }

    /// Ends the delivery before `End`: every posted RDMA write completes (or fails) first; a
    /// failed one misses its layer, and `End` counts the writes that completed.
    #[cfg_attr(not(feature = "rdma"), allow(unused_variables))]
    pub(super) async fn finish(self, io: &mut Io, sh: &ServerState, load: &mut ServerLoad) {
        #[cfg(feature = "rdma")]
        if let Delivery::Rdma(d) = self {
            let (bad, ok) = d.finish().await;
            for (layer, msg) in bad {
                if let Some(m) = load.rdma_failed(layer, 0, &msg) {
                    sh.metrics.error("rdma");
                    io.conn.send_miss(m);
                }
            }
            load.rdma_completed(ok);
        }
    }
}
