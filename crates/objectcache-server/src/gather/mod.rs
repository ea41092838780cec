//! The gather endpoint: a tokio driver over [`ServerConnection`] that serves loads (parallel
//! bounded reads, units streamed in layer order) and batched saves.
//!
//! - `mod.rs`: the connection loop ([`serve`]) and a load's life: checks, admission, pacing,
//!   and the send loop, which does what the pure [`ServerLoad`] decides.
//! - `io.rs`: the socket under the memory budget and the client's progress floor.
//! - `fetch.rs`: the load's reads (header checks, unit pieces, mapped local files).
//! - `save.rs`: batched saves.

mod fetch;
mod io;
mod objects;
mod save;

use fetch::{check_headers, start_reads, AbortOnDrop, LocalFiles};
use io::{Io, ReadWait, CONN_BUF_BYTES};
use objects::LoadObjects;
use save::run_save;

use super::{Abort, Shared};
use crate::protocol::{
    plan_units, ErrorCode, GatherRequest, MissFrame, PieceMiss, ServerConnection, ServerEvent,
    ServerLoad, TransportTarget, UnitPlan,
};
use bytes::BytesMut;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::time::Instant;

/// Bytes per permit of the memory budget semaphore.
pub(crate) const PERMIT_BYTES: u64 = 4096;

/// Permits of the memory budget semaphore that cover `bytes` (rounded up; at most `u32::MAX`).
pub(crate) fn permits_for(bytes: u64) -> u32 {
    bytes.div_ceil(PERMIT_BYTES).min(u32::MAX as u64) as u32
}

/// A connection's protocol state: with access keys configured, the client must answer an
/// HMAC challenge over a fresh random nonce with one of them (protocol version 2,
/// [`crate::protocol::auth`]) before any request, as S3 requests must carry SigV4.
fn new_connection(sh: &Shared) -> ServerConnection {
    if sh.cfg.access_keys.is_empty() {
        return ServerConnection::new(sh.limits());
    }
    let mut nonce = [0u8; crate::protocol::auth::NONCE_LEN];
    if let Err(e) = getrandom::fill(&mut nonce) {
        // No OS randomness: refuse the connection rather than use a guessable nonce.
        tracing::error!(error = %e, "no random nonce for gather authentication");
        let mut c = ServerConnection::new(sh.limits());
        c.close_with(
            ErrorCode::Internal,
            "server has no randomness for authentication",
        );
        return c;
    }
    ServerConnection::with_auth(sh.limits(), nonce)
}

/// Serves one gather connection until the client closes it, fails, or the server stops.
/// `head`: the bytes the preface sniffer already read. The hello and authentication must be
/// done by `handshake_deadline`; an established connection with no request for
/// `idle_timeout_secs` is closed.
pub(crate) async fn serve(
    stream: TcpStream,
    sh: Arc<Shared>,
    head: &[u8],
    handshake_deadline: Instant,
) {
    let _ = stream.set_nodelay(true);
    let peer = stream.peer_addr().ok();
    let (rd, wr) = stream.into_split();
    let mut buf = BytesMut::with_capacity(CONN_BUF_BYTES);
    buf.extend_from_slice(head);
    let mut io = Io {
        rd,
        wr,
        buf,
        conn: new_connection(&sh),
        frame_hold: None,
        save_holds: std::collections::VecDeque::new(),
        write_floor: super::client_floor(&sh.cfg),
    };
    let _ = io.conn.handle_bytes(&mut io.buf);
    let mut floor = super::client_floor(&sh.cfg);
    tracing::debug!(?peer, "gather connection");
    loop {
        while let Some(ev) = io.conn.poll_event() {
            let r = match ev {
                ServerEvent::Gather(req) => run_gather(&mut io, *req, &sh).await,
                ServerEvent::SaveBegin(req) => run_save(&mut io, *req, &sh).await,
                ServerEvent::Authenticate { access_key, mac } => {
                    let secret = sh
                        .cfg
                        .access_keys
                        .iter()
                        .find(|k| k.access_key == access_key)
                        .map(|k| k.secret_key.as_str());
                    if io.conn.authenticate(&access_key, &mac, secret) {
                        tracing::debug!(?peer, %access_key, "gather connection authenticated");
                    } else {
                        sh.metrics.error("unauthorized");
                        tracing::warn!(?peer, %access_key, "gather authentication refused");
                    }
                    Ok(())
                }
                ServerEvent::Failed(e) => {
                    sh.metrics.error("protocol");
                    tracing::warn!(?peer, error = %e, "gather protocol error");
                    Ok(())
                }
                _ => Ok(()),
            };
            if let Err(a) = r {
                if a == Abort::Gone {
                    sh.metrics.error("client_gone");
                    tracing::info!(
                        ?peer,
                        "client went away mid-request; its resources are freed"
                    );
                }
                return;
            }
        }
        if io.flush(&sh).await.is_err() || io.conn.is_closed() {
            let _ = io.wr.shutdown().await;
            return;
        }
        // Before authentication, the handshake deadline; between requests, the idle timeout;
        // once a request's frame has begun, the client owes progress.
        let wait = if !io.conn.is_established() {
            ReadWait::Until(handshake_deadline)
        } else if io.buf.is_empty() {
            ReadWait::Idle(Duration::from_secs(sh.cfg.idle_timeout_secs))
        } else {
            ReadWait::Floor(&mut floor)
        };
        tokio::select! {
            r = io.read_more(&sh, wait) => if r.is_err() {
                tracing::debug!(?peer, "gather connection closed (client gone, idle or past its handshake deadline)");
                return;
            },
            _ = sh.shutdown.cancelled() => return,
        }
    }
}

/// Ticks every [`crate::protocol::HELD_EVERY_MS`] ms, the first a period from now: while a
/// request is held on purpose, each tick sends a `Held` frame to a client that asked for them.
fn held_ticker() -> tokio::time::Interval {
    let every = Duration::from_millis(crate::protocol::HELD_EVERY_MS);
    let mut t = tokio::time::interval_at(Instant::now() + every, every);
    t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    t
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

/// A refused gather request: the error code and the message the client gets.
type Refusal = (ErrorCode, String);

/// Refuses a request for a bucket that does not exist (or that the backend cannot look up).
async fn bucket_exists(sh: &Shared, bucket: &str) -> Result<(), Refusal> {
    match sh.buckets.exists(bucket).await {
        Ok(true) => Ok(()),
        Ok(false) => Err((
            ErrorCode::NoSuchBucket,
            format!("bucket {bucket} does not exist"),
        )),
        Err(e) => Err((ErrorCode::Storage, e.to_string())),
    }
}

/// Checks a gather request before the load starts: a transport target this build offers, no
/// object larger than `max_object_bytes` (refused before any I/O), the bucket, every object
/// key. Returns the objects the load reads.
async fn check_request(req: &GatherRequest, sh: &Shared) -> Result<Arc<LoadObjects>, Refusal> {
    #[cfg(not(feature = "rdma"))]
    if matches!(req.target, TransportTarget::Rdma(_)) {
        return Err((
            ErrorCode::Unsupported,
            "this server offers no RDMA target; use the inline TCP target".into(),
        ));
    }
    // An object larger than any this server stores cannot exist.
    let segments = req.segments.iter().flat_map(|p| &p.segments);
    let largest = req
        .chunk_tokens
        .iter()
        .map(|&t| crate::layout::object_len(req.geometry.layers, req.geometry.slice_len(t)))
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
    bucket_exists(sh, &req.bucket).await?;
    LoadObjects::of(req)
        .map(Arc::new)
        .map_err(|m| (ErrorCode::Malformed, m))
}

/// Waits for the load's admission under the scheduler (`load_total` bytes), watching the
/// client meanwhile and sending `Held` frames to a client that asked for them. `Ok(Err(msg))`:
/// the scheduler refused it (busy); `Err(Abort::Cancelled)`: the client cancelled it while it
/// waited; `Err(Abort::Shutdown)` after closing the connection.
async fn admission(
    io: &mut Io,
    sh: &Arc<Shared>,
    req: &GatherRequest,
    member: &super::group::Member,
    load_total: u64,
) -> Result<Result<(), String>, Abort> {
    let first_deadline_us = match &req.hints {
        crate::protocol::SchedHints::LayerDeadlinesUs(v) => v.first().map(|&d| d as u64),
        crate::protocol::SchedHints::LayerComputeUs(v) => v.first().map(|&d| d as u64),
        crate::protocol::SchedHints::None => None,
    };
    let admitted = member.admit(sh, req.priority, first_deadline_us, load_total);
    tokio::pin!(admitted);
    let mut held = held_ticker();
    loop {
        tokio::select! {
            s = &mut admitted => return Ok(s),
            _ = held.tick(), if req.held => { io.conn.send_held(req.request_id); io.flush(sh).await?; }
            a = io.next_signal() => return Err(a),
            _ = sh.shutdown.cancelled() => {
                io.conn.close_with(ErrorCode::ShuttingDown, "server is shutting down");
                let _ = io.flush(sh).await;
                return Err(Abort::Shutdown);
            }
        }
    }
}

/// Serves one load: checks, admission, then its units in plan order as their reads and
/// header checks complete, paced under a bandwidth cap. What goes out around misses is
/// [`ServerLoad`]'s decision; this function reads, waits and writes.
async fn run_gather(io: &mut Io, req: GatherRequest, sh: &Arc<Shared>) -> Result<(), Abort> {
    let t0 = Instant::now();
    sh.metrics.request("gather");
    let id = req.request_id;
    let refuse = |io: &mut Io, (code, msg): Refusal| {
        sh.metrics.error(code.label());
        tracing::info!(request = id, code = code.label(), "gather refused: {msg}");
        io.conn.fail(code, &msg);
    };
    let objects = match check_request(&req, sh).await {
        Ok(o) => o,
        Err(r) => {
            refuse(io, r);
            return io.flush(sh).await;
        }
    };
    let plan = plan_units(&req);
    // RDMA target: units are written into the client's memory (gather_rdma), not the stream.
    #[cfg(feature = "rdma")]
    let mut rdma = match &req.target {
        TransportTarget::Rdma(_) => match super::gather_rdma::Delivery::start(sh, &req, &plan) {
            Ok(d) => Some(d),
            Err(msg) => {
                refuse(io, (ErrorCode::Unsupported, msg));
                return io.flush(sh).await;
            }
        },
        TransportTarget::InlineTcp => None,
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
    let _lease = sh.leases.acquire(held_keys);

    // The load this request belongs to (its stripes share admission and pacing; see group.rs).
    let member = super::group::Member::join(&sh.loads, &req);
    let nl = req.layers.len() as u64;
    let load_total = req
        .group
        .map_or(total, |g| g.load_layer_bytes.saturating_mul(nl));
    match admission(io, sh, &req, &member, load_total).await {
        Ok(Ok(())) => {}
        Ok(Err(msg)) => {
            refuse(io, (ErrorCode::Busy, msg));
            return io.flush(sh).await;
        }
        Err(Abort::Cancelled) => {
            io.conn.finish(id, 0, 0);
            return io.flush(sh).await;
        }
        Err(a) => return Err(a),
    }

    io.conn.accept(id, plan.len() as u64, total);
    io.flush(sh).await?;
    // Under a bandwidth cap the link scheduler paces the load's units (`crate::link`), once
    // per load whatever its stripes; the load's departure is when its last stripe ends.
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
    // Reads run in their own task, ahead of the socket: while unit u is being written, units
    // u+1.. are read (bounded by `depth` units and the server's memory budget). The header
    // checks run alongside; nothing is sent before they are known.
    let depth = ((sh.cfg.max_request_bytes / max_unit.max(1)) as usize).clamp(1, 64);
    let verify = req.verify || sh.cfg.always_verify;
    // Unverified slices bound for the TCP stream are lent from mappings of local files when
    // the backend keeps them (the client checks each unit's stored CRC32C end to end).
    let files: Option<LocalFiles> = (!verify && matches!(req.target, TransportTarget::InlineTcp))
        .then(|| {
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
    // What the load sends, around its misses, is the pure state machine's decision
    // (`protocol::ServerLoad`); this function reads, paces and writes.
    let mut load = ServerLoad::new(req.layers.clone(), req.chunks.len(), &plan);
    // Header checks stream their results in chunk order; a unit goes out once the headers of
    // every chunk it carries are known (not all of them: the first layer's first slices leave
    // while later headers are still being read).
    let (htx, mut hrx) = tokio::sync::mpsc::unbounded_channel();
    let _headers = AbortOnDrop(tokio::spawn(check_headers(
        sh.clone(),
        req.chunk_tokens.clone(),
        req.geometry,
        objects.clone(),
        files.clone(),
        htx,
    )));
    let (mut rx, _reader) = start_reads(sh, plan, objects, verify, files, depth);
    // Per-chunk misses: a bad chunk's Miss goes out before any unit that would carry its
    // slices, which are left out of every unit; the other chunks' slices are still delivered
    // (the client keeps their bytes and names the bad chunk).
    let send_miss = |io: &mut Io, m: MissFrame| {
        sh.metrics.error("miss");
        io.conn.send_miss(m);
    };
    let on_header = |io: &mut Io, load: &mut ServerLoad, r: Option<Result<(), PieceMiss>>| match r {
        Some(r) => {
            if let Some(m) = load.on_header(r) {
                send_miss(io, m);
            }
        }
        // The checker ended early (it never does before sending every result).
        None => load.headers_ended(),
    };
    let grace = async {
        sh.shutdown.cancelled().await;
        tokio::time::sleep(Duration::from_secs(sh.cfg.shutdown_grace_secs)).await;
    };
    tokio::pin!(grace);
    let shut_down = |io: &mut Io| {
        sh.metrics.error("shutdown_abort");
        io.conn.close_with(
            ErrorCode::ShuttingDown,
            "server shut down before the load finished",
        );
    };
    let mut all_sent = false;
    'send: loop {
        tokio::select! {
            biased;
            _ = &mut grace => {
                shut_down(io);
                let _ = io.flush(sh).await;
                return Err(Abort::Shutdown);
            }
            a = io.next_signal() => match a {
                Abort::Cancelled => break,
                a => return Err(a),
            },
            f = rx.recv() => {
                let Some(f) = f else {
                    all_sent = true;
                    break;
                };
                while load.awaits_headers(&f.plan) {
                    tokio::select! {
                        r = hrx.recv() => on_header(io, &mut load, r),
                        a = io.next_signal() => match a { Abort::Cancelled => break 'send, a => return Err(a) },
                        _ = &mut grace => {
                            shut_down(io);
                            let _ = io.flush(sh).await;
                            return Err(Abort::Shutdown);
                        }
                    }
                }
                if load.nothing_to_send() {
                    // Every chunk misses: nothing to send.
                    break;
                }
                if member.is_paced() {
                    // Held on purpose (its bandwidth share, or its stripes' order): a client
                    // that asked for them gets `Held` frames meanwhile.
                    let paced = member.pace(f.plan.layer, f.plan.len);
                    tokio::pin!(paced);
                    let mut held = held_ticker();
                    loop {
                        tokio::select! {
                            _ = &mut paced => break,
                            _ = held.tick(), if req.held => { io.conn.send_held(id); io.flush(sh).await?; }
                            a = io.next_signal() => match a { Abort::Cancelled => break 'send, a => return Err(a) },
                            _ = &mut grace => {
                                shut_down(io);
                                let _ = io.flush(sh).await;
                                return Err(Abort::Shutdown);
                            }
                        }
                    }
                }
                let layer = f.plan.layer;
                let mut cut = load.cut(&f.plan, f.pieces);
                for m in std::mem::take(&mut cut.misses) {
                    send_miss(io, m);
                }
                // RDMA target: written into the client's memory (gather_rdma), by the unit
                // rule of `CutUnit::into_rdma_writes`: a bad chunk's Miss fails the layer, and
                // the other chunks' slices are in place.
                #[cfg(feature = "rdma")]
                let cut = match rdma.as_mut() {
                    Some(d) => {
                        let plan = &f.plan;
                        for w in cut.into_rdma_writes() {
                            if load.rdma_layer_failed(layer) {
                                break;
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
                                    let c = w.slice_of.or(plan.pieces.first().map(|p| p.chunk)).unwrap_or(0);
                                    if let Some(m) = load.rdma_failed(layer, c, &msg) {
                                        io.conn.send_miss(m);
                                    }
                                }
                            }
                        }
                        None
                    }
                    None => Some(cut),
                };
                #[cfg(not(feature = "rdma"))]
                let cut = Some(cut);
                for (h, parts) in cut.map(|c| c.into_units()).unwrap_or_default() {
                    let len = h.len as u64;
                    io.conn.send_unit(h, parts);
                    load.sent(len);
                    sh.metrics.bytes("gather_out", len);
                }
                io.flush(sh).await?;
                member.sent(f.plan.len);
                drop(f._hold);
                if load.first_out() {
                    sh.metrics.observe_ttfl(t0.elapsed().as_secs_f64());
                }
                if load.unit_done(layer) {
                    sh.metrics.observe_layer(t0.elapsed().as_secs_f64());
                }
            }
        }
    }
    // Every unit is out: the header results not needed yet still name their misses before End.
    while all_sent && load.headers_pending() {
        let r = hrx.recv().await;
        on_header(io, &mut load, r);
    }
    #[cfg(feature = "rdma")]
    if let Some(d) = rdma.take() {
        // Every posted write completes (or fails) before End; End counts completed writes.
        let (bad, ok) = d.finish().await;
        for (layer, msg) in bad {
            if let Some(m) = load.rdma_failed(layer, 0, &msg) {
                sh.metrics.error("rdma");
                io.conn.send_miss(m);
            }
        }
        load.rdma_completed(ok);
    }
    let (units, bytes) = load.totals();
    io.conn.finish(id, units, bytes);
    tracing::debug!(
        request = id,
        units,
        bytes,
        secs = t0.elapsed().as_secs_f64(),
        "gather done"
    );
    io.flush(sh).await
}
