//! One gather load on the server, from its checks to `End`: [`Load::start`] checks and admits
//! the request and starts its reads; the driver ([`super::run_gather`]) then hands each read
//! unit to [`Load::deliver`] and ends with [`Load::finish`]. What goes out is the pure
//! [`ServerLoad`]'s decision; this module reads, counts and writes.

use super::delivery::Delivery;
use super::fetch::{check_headers, start_reads, AbortOnDrop, Fetched, LocalFiles};
use super::io::Io;
use super::objects::{LoadObjects, Refusal};
use super::watch::Watch;
use crate::group::Member;
use crate::{Abort, ServerState};
use objectcache_client::lifecycle::Lease;
use objectcache_client::protocol::{
    plan_units, ErrorCode, GatherRequest, PieceMiss, SchedHints, ServerLoad, TransportTarget,
    UnitPlan,
};
use std::sync::Arc;
use tokio::sync::mpsc;
use tokio::time::Instant;

/// An admitted load (see the module doc). Fields drop in order: its reads and header checks
/// stop, it leaves its load group, then its entries' lease ends.
pub(super) struct Load {
    /// Its units read ahead, in plan order.
    pub(super) reads: mpsc::Receiver<Fetched>,
    _reader: AbortOnDrop<()>,
    /// Its chunks' header check results, in chunk order.
    pub(super) headers: mpsc::UnboundedReceiver<Result<(), PieceMiss>>,
    _checker: AbortOnDrop<()>,
    /// What it sends (the pure state machine).
    pub(super) state: ServerLoad,
    delivery: Delivery,
    /// Its place in its load group (the stripes of one load share admission and pacing).
    pub(super) member: Member,
    /// Its waits: the client, the server's shutdown grace, `Held` frames.
    pub(super) watch: Watch,
    id: u64,
    /// When the request arrived (time to first layer, layer times).
    t0: Instant,
    /// Collection never deletes its chunks' entries while it runs.
    _lease: Lease,
}

impl Load {
    /// Checks `req`, plans it, waits for its admission and starts its reads. `Ok(None)`: the
    /// request was refused, or cancelled while it waited, and its answer is queued on `io`
    /// (the caller flushes); `Err`: the client went away or the server shut down.
    pub(super) async fn start(
        io: &mut Io,
        req: GatherRequest,
        sh: &Arc<ServerState>,
        t0: Instant,
    ) -> Result<Option<Load>, Abort> {
        let id = req.request_id;
        let refuse = |io: &mut Io, (code, msg): Refusal| {
            sh.metrics.error(code.label());
            tracing::info!(request = id, code = code.label(), "gather refused: {msg}");
            io.conn.fail(code, &msg);
            Ok(None)
        };
        let objects = match check_request(&req, sh).await {
            Ok(o) => o,
            Err(r) => return refuse(io, r),
        };
        let plan = plan_units(&req);
        let delivery = match Delivery::start(sh, &req, &plan) {
            Ok(d) => d,
            Err(r) => return refuse(io, r),
        };
        let max_unit = plan.iter().map(|u| u.len).max().unwrap_or(0);
        let total: u64 = plan.iter().map(|u| u.len).sum();
        // The load holds its chunks' entries from when it arrives (also while it waits for
        // admission) until it ends: collection never deletes them under it (released on
        // completion, cancel, failure, and with the process).
        let held_keys = objects.distinct_keys();
        let now = std::time::SystemTime::now();
        for k in &held_keys {
            sh.access.record(k, now);
        }
        let lease = sh.leases.acquire(held_keys);

        // The load this request belongs to (its stripes share admission and pacing; see
        // group.rs).
        let member = Member::join(&sh.loads, &req);
        let nl = req.layers.len() as u64;
        let load_total = req
            .group
            .map_or(total, |g| g.load_layer_bytes.saturating_mul(nl));
        let first_deadline_us = match &req.hints {
            SchedHints::LayerDeadlinesUs(v) => v.first().map(|&d| d as u64),
            SchedHints::LayerComputeUs(v) => v.first().map(|&d| d as u64),
            SchedHints::None => None,
        };
        let admitted = member.admit(sh, req.priority, first_deadline_us, load_total);
        match Watch::admission(sh.clone(), id, req.held)
            .wait(io, admitted, true)
            .await?
        {
            Some(Ok(())) => {}
            Some(Err(msg)) => return refuse(io, (ErrorCode::Busy, msg)),
            None => {
                // Cancelled while it waited.
                io.conn.finish(id, 0, 0);
                return Ok(None);
            }
        }

        io.conn.accept(id, plan.len() as u64, total);
        io.flush(sh).await?;
        // Under a bandwidth cap the link scheduler paces the load's units (`objectcache_client::link`),
        // once per load whatever its stripes; the load's departure is when its last stripe
        // ends.
        if let Some(link) = &sh.link {
            member.start_pacing(
                link,
                || match req.group {
                    Some(g) => vec![g.load_layer_bytes; req.layers.len()],
                    None => layer_bytes_of(&plan),
                },
                &req.hints,
            );
        }
        // Reads run in their own task, ahead of the socket: while unit u is being written,
        // units u+1.. are read (bounded by `depth` units and the server's memory budget). The
        // header checks run alongside; nothing is sent before they are known.
        let depth = ((sh.cfg.max_request_bytes / max_unit.max(1)) as usize).clamp(1, 64);
        let verify = req.verify || sh.cfg.always_verify;
        // Unverified slices bound for the TCP stream are lent from mappings of local files
        // when the backend keeps them (the client checks each unit's stored CRC32C end to
        // end).
        let files: Option<LocalFiles> =
            (!verify && matches!(req.target, TransportTarget::InlineTcp)).then(|| {
                LocalFiles::open(
                    sh.store.clone(),
                    objects.clone(),
                    req.layers.clone(),
                    req.chunk_tokens
                        .iter()
                        .map(|&t| req.geometry.slice_len(t))
                        .collect(),
                )
            });
        let state = ServerLoad::new(req.layers.clone(), req.chunks.len(), &plan);
        // Header checks stream their results in chunk order; a unit goes out once the headers
        // of every chunk it carries are known (not all of them: the first layer's first
        // slices leave while later headers are still being read).
        let (htx, headers) = mpsc::unbounded_channel();
        let checker = AbortOnDrop(tokio::spawn(check_headers(
            sh.clone(),
            req.chunk_tokens.clone(),
            req.geometry,
            objects.clone(),
            files.clone(),
            htx,
        )));
        let (reads, reader) = start_reads(sh, plan, objects, verify, files, depth);
        Ok(Some(Load {
            reads,
            _reader: reader,
            headers,
            _checker: checker,
            state,
            delivery,
            member,
            watch: Watch::load(sh.clone(), id, req.held),
            id,
            t0,
            _lease: lease,
        }))
    }

    /// The next header result (`None`: the checker ended early, which it never does before
    /// sending every result). A bad chunk's `Miss` is queued before any unit that would carry
    /// its slices, which are left out of every unit.
    pub(super) fn on_header(
        &mut self,
        io: &mut Io,
        sh: &ServerState,
        r: Option<Result<(), PieceMiss>>,
    ) {
        match r {
            Some(r) => {
                if let Some(m) = self.state.on_header(r) {
                    sh.metrics.error("miss");
                    io.conn.send_miss(m);
                }
            }
            None => self.state.headers_ended(),
        }
    }

    /// Delivers read unit `f`: its `Miss` frames, then its unit frames or RDMA writes (a
    /// failed slice misses its (chunk, layer) only; the other chunks' slices are delivered),
    /// and counts it.
    pub(super) async fn deliver(
        &mut self,
        io: &mut Io,
        sh: &ServerState,
        f: Fetched,
    ) -> Result<(), Abort> {
        let rdma = self.delivery.is_rdma();
        for a in self.state.unit_actions(&f.plan, f.pieces, rdma) {
            self.delivery
                .carry(io, sh, &mut self.state, &f.plan, a)
                .await;
        }
        io.flush(sh).await?;
        self.member.sent(f.plan.len);
        drop(f._hold);
        if self.state.first_out() {
            sh.metrics.observe_ttfl(self.t0.elapsed().as_secs_f64());
        }
        if self.state.unit_done(f.plan.layer) {
            sh.metrics.observe_layer(self.t0.elapsed().as_secs_f64());
        }
        Ok(())
    }

    /// Ends the load with `End`. When `all_sent` (not cancelled, not every chunk missing), the
    /// header results not needed yet still name their misses first; on RDMA, every posted
    /// write completes or fails before `End`, which counts the completed ones.
    pub(super) async fn finish(
        mut self,
        io: &mut Io,
        sh: &ServerState,
        all_sent: bool,
    ) -> Result<(), Abort> {
        while all_sent && self.state.headers_pending() {
            let r = self.headers.recv().await;
            self.on_header(io, sh, r);
        }
        let delivery = std::mem::replace(&mut self.delivery, Delivery::Stream);
        delivery.finish(io, sh, &mut self.state).await;
        let (units, bytes) = self.state.totals();
        io.conn.finish(self.id, units, bytes);
        tracing::debug!(
            request = self.id,
            units,
            bytes,
            secs = self.t0.elapsed().as_secs_f64(),
            "gather done"
        );
        io.flush(sh).await
    }
}

/// Payload bytes per layer of `plan`, in delivery order (the link scheduler's layer sizes).
fn layer_bytes_of(plan: &[UnitPlan]) -> Vec<u64> {
    let mut v: Vec<(u32, u64)> = Vec::new();
    for u in plan {
        match v.last_mut() {
            Some((l, b)) if *l == u.layer => *b += u.len,
            _ => v.push((u.layer, u.len)),
        }
    }
    v.into_iter().map(|(_, b)| b).collect()
}

/// Checks a gather request before the load starts: a transport target this build offers, no
/// object larger than `max_object_bytes` (refused before any I/O), the bucket, every object
/// key. Returns the objects the load reads.
async fn check_request(req: &GatherRequest, sh: &ServerState) -> Result<Arc<LoadObjects>, Refusal> {
    #[cfg(not(feature = "rdma"))]
    if matches!(req.target, TransportTarget::Rdma(_)) {
        return Err((ErrorCode::Unsupported, super::objects::NO_RDMA.into()));
    }
    // An object larger than any this server stores cannot exist.
    let segments = req.segments.iter().flat_map(|p| &p.segments);
    let largest = req
        .chunk_tokens
        .iter()
        .map(|&t| {
            objectcache_client::layout::object_len(req.geometry.layers, req.geometry.slice_len(t))
        })
        .chain(segments.map(|s| s.object_len))
        .max()
        .unwrap_or(0);
    if largest > sh.cfg.max_object_bytes {
        return Err((
            ErrorCode::MemoryLimit,
            format!(
                "the request's objects would be up to {largest} bytes, above this server's \
                 max_object_bytes {}",
                sh.cfg.max_object_bytes
            ),
        ));
    }
    super::objects::bucket_exists(sh, &req.bucket).await?;
    LoadObjects::of(req)
        .map(Arc::new)
        .map_err(|m| (ErrorCode::Malformed, m))
}
