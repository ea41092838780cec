//! Running a gather load ([`try_gather`]): on the first gateway of the load's route that
//! offers gather, striped over several connections, one task per stripe, each stripe failing
//! over to the next gateway of the route when its own fails mid-load ([`run_stripe`]); then
//! the per-chunk status from what the servers reported.

use super::probe::{connection, give_back, NoConnection, Probes};
use super::stripe::{Lockstep, Stripe};
use super::{gather_request, offered, unit_bytes_for, Outcome};
use crate::connector::load::{LoadRequest, LoadShared};
use crate::connector::status::ChunkStatus;
use crate::error::LayerError;
use crate::layout::{KeyBuilder, Run};
use crate::protocol::{LoadGroup, SegmentPlacement, ServerInfo};
use crate::store::{EndpointEvent, Gateways, GatherTarget};
use crate::transport::tcp::{GatherClient, GatherError};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// A load id for the stripes of one load: unique within this process (a counter) and, with
/// a random base drawn once per process, across the clients of one server.
fn next_load_id() -> u64 {
    static BASE: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let base = *BASE.get_or_init(|| {
        let mut b = [0u8; 8];
        // Without OS randomness the ids are still unique within this process.
        let _ = getrandom::fill(&mut b);
        u64::from_le_bytes(b)
    });
    base.wrapping_add(NEXT.fetch_add(1, Ordering::Relaxed))
}

/// What a load's stripes share for failing over: where to find other gateways.
struct Failover {
    probes: Arc<Probes>,
    gateways: Gateways,
    /// The load's route key (placement).
    route: u64,
}

impl Failover {
    /// The first gateway of the load's route, not in `tried`, that offers gather (and, with
    /// `segments`, reads segment objects: in a fleet mid-upgrade an older gateway is passed
    /// over, not sent a request it would refuse) and gives a connection; a gateway that
    /// cannot be reached is reported to the gateways (which mark it down until a health check
    /// finds it up again).
    async fn pick(&self, tried: &[String], segments: bool) -> Option<(GatherTarget, GatherClient)> {
        for t in self.gateways.route(self.route) {
            if tried.contains(&t.addr) {
                continue;
            }
            let probe = self.probes.get(&t.addr);
            if !offered(&probe, &t).await {
                continue;
            }
            match connection(&probe, &t).await {
                Ok(c)
                    if segments && c.server_info().features & ServerInfo::FEATURE_SEGMENTS == 0 =>
                {
                    give_back(&probe, c)
                }
                Ok(c) => return Some((t, c)),
                Err(NoConnection::Unreachable) => {
                    self.gateways.event(&t.addr, EndpointEvent::Unreachable)
                }
                Err(NoConnection::NotOffered) => {}
            }
        }
        None
    }
}

/// Aborts a task when dropped.
struct AbortOnDrop(tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// How a stripe ended ([`run_stripe`]).
struct StripeEnd {
    /// The stripe's sink, with what it still holds back.
    sink: Stripe,
    /// The last gateway's answer.
    result: Result<crate::transport::tcp::LoadReport, GatherError>,
    /// The connection, to pool with its gateway's probe, when it ended cleanly.
    client: Option<(String, GatherClient)>,
}

/// Runs one stripe (`part` = the load's chunks `a..b`) on `client` to `target`, and when
/// that gateway fails before the stripe is complete (the connection breaks, the server stops
/// or refuses the request), asks the next gateway of the load's route for the layers not
/// delivered yet, until one serves them or none is left. Byte-exact: a unit cut short is
/// given back ([`Stripe::rewind`]) and units already delivered are not written again.
#[allow(clippy::too_many_arguments)]
async fn run_stripe(
    fo: Arc<Failover>,
    mut target: GatherTarget,
    mut client: GatherClient,
    mut sink: Stripe,
    keys: KeyBuilder,
    part: LoadRequest,
    segments: Option<SegmentPlacement>,
    request_id: u64,
    group: Option<LoadGroup>,
    bytes: std::ops::Range<u64>,
) -> StripeEnd {
    let layers = part.geometry.layers;
    let mut from = 0u32;
    let mut tried = vec![target.addr.clone()];
    loop {
        let mut greq = gather_request(request_id, &target, &keys, &part, segments.clone());
        greq.layers = from..layers;
        // One unit per slice, checked by this client against the slice's stored CRC32C (end
        // to end: storage, server and network): the server reads no payload byte itself (from
        // local files it sends them with sendfile), a bad unit names exactly one (chunk,
        // layer), and the first layer's slices are sent as each is read.
        greq.verify = false;
        greq.max_unit_bytes = unit_bytes_for(&part.geometry);
        // A server that holds the load on purpose (admission, its bandwidth cap) says so, so
        // the load's stall watchdog does not take the pause for a stall.
        greq.held = client.server_info().features & ServerInfo::FEATURE_HELD != 0;
        // The first gateway schedules the stripes as one load; a stripe that failed over is
        // a load of its own on its new gateway (which never sees the others).
        if tried.len() == 1 {
            greq.group = group;
        }
        sink.sh.requests.fetch_add(1, Ordering::Relaxed);
        let r = client.load(&greq, &sink).await;
        let e = match r {
            Ok(report) => {
                return StripeEnd {
                    sink,
                    result: Ok(report),
                    client: Some((target.addr, client)),
                }
            }
            Err(GatherError::Cancelled) => {
                return StripeEnd {
                    sink,
                    result: Err(GatherError::Cancelled),
                    client: Some((target.addr, client)),
                }
            }
            Err(e) => e,
        };
        if matches!(e, GatherError::Io(_)) {
            fo.gateways.event(&target.addr, EndpointEvent::Unreachable);
        }
        if sink.sh.state.is_cancelled() {
            return StripeEnd {
                sink,
                result: Err(e),
                client: None,
            };
        }
        // Where the rest starts: the first layer this stripe has not delivered in full.
        let held = std::mem::take(&mut sink.track.get_mut().expect("lock").held);
        let Some(next) = sink.resume_from(from..layers, bytes.start, bytes.end) else {
            // Everything arrived before the gateway failed.
            return StripeEnd {
                sink,
                result: Ok(empty_report()),
                client: None,
            };
        };
        let Some((t, c)) = fo.pick(&tried, segments.is_some()).await else {
            sink.track.get_mut().expect("lock").held = held;
            return StripeEnd {
                sink,
                result: Err(e),
                client: None,
            };
        };
        tracing::warn!(from = %target.addr, to = %t.addr, layer = next, error = %e,
            "gather stripe failed over to another gateway");
        sink.rewind();
        sink.sh.failovers.fetch_add(1, Ordering::Relaxed);
        from = next;
        tried.push(t.addr.clone());
        (target, client) = (t, c);
    }
}

/// The report of a stripe whose every layer had arrived when its gateway failed.
fn empty_report() -> crate::transport::tcp::LoadReport {
    crate::transport::tcp::LoadReport {
        units: 0,
        bytes: 0,
        failed_layers: Vec::new(),
        missed_chunks: Vec::new(),
        ttfl: None,
        elapsed: Duration::ZERO,
    }
}

/// Runs `req` over gather on the gateways of `route` (the engine's gather targets in
/// placement order, [`Gateways::route`]): on the first that offers gather and accepts a
/// connection, striped over up to `streams` connections (contiguous runs of chunks, one
/// request and one task each; see `EngineConfig::gather_streams`). A stripe whose gateway
/// fails mid-load continues on the next gateway of the route ([`run_stripe`]).
///
/// `Outcome::Fallback` (nothing delivered) when no gateway offers gather, no connection
/// could be opened, or every stripe was refused before any byte arrived (busy, limits).
/// Otherwise `Outcome::Done`: layers are ready or failed; a stripe that no gateway could
/// finish fails the layers still pending (misses, never bytes), and the per-chunk status
/// names the chunks each stripe's server reported.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn try_gather(
    probes: &Arc<Probes>,
    gateways: &Gateways,
    route: u64,
    keys: &KeyBuilder,
    req: &LoadRequest,
    runs: &[Run],
    request_id: u64,
    sh: &Arc<LoadShared>,
    streams: usize,
) -> Outcome {
    let fo = Arc::new(Failover {
        probes: probes.clone(),
        gateways: gateways.clone(),
        route,
    });
    // Chunks in segment objects (format version 2) are read by a gateway that reads them;
    // where the route has none, the load takes ranged GETs.
    let Some((target, first)) = fo.pick(&[], !runs.is_empty()).await else {
        return Outcome::Fallback;
    };
    let probe = probes.get(&target.addr);
    let chunks = req.hashes.len();
    let want = streams.clamp(1, chunks.max(1));
    // Each stripe's placement, were the load cut into `n` stripes (a load in more segments
    // than a request may name cannot gather).
    let placements = |n: usize| -> Result<Vec<Option<SegmentPlacement>>, _> {
        (0..n)
            .map(|i| SegmentPlacement::from_runs(runs, i * chunks / n..(i + 1) * chunks / n))
            .collect()
    };
    if !runs.is_empty()
        && (first.server_info().features & ServerInfo::FEATURE_SEGMENTS == 0
            || placements(1).is_err())
    {
        give_back(&probe, first);
        return Outcome::Fallback;
    }
    let mut clients = vec![first];
    while clients.len() < want {
        match connection(&probe, &target).await {
            Ok(c) => clients.push(c),
            // Fewer streams: the load still runs on the connections it has.
            Err(_) => break,
        }
    }
    // Counted against the gateway for load-aware placement while the load runs.
    gateways.event(&target.addr, EndpointEvent::LoadStarted);
    struct Ended<'a>(&'a Gateways, &'a str);
    impl Drop for Ended<'_> {
        fn drop(&mut self) {
            self.0.event(self.1, EndpointEvent::LoadEnded);
        }
    }
    let _ended = Ended(gateways, &target.addr);
    let n = clients.len();
    let slice = req.geometry.slice_bytes();
    // No stripe names more segments than the whole load (checked above).
    let Ok(mut placed) = placements(n) else {
        return Outcome::Fallback;
    };
    let step = Arc::new(Lockstep::new(n, 0));
    // A server that schedules loads (not connections) is told which requests are stripes of
    // this load, so it admits and paces them as one and sends them in the load's layer-major
    // order (`docs/protocol.md`, "Striped loads"). Without it each stripe is a load of its own.
    let group = (n > 1
        && clients
            .iter()
            .all(|c| c.server_info().features & ServerInfo::FEATURE_LOAD_GROUPS != 0))
    .then(|| (next_load_id(), chunks as u64 * slice));
    // The stripe tasks stop when this future is dropped (the load's deadline passed), as
    // well as when the load is cancelled or its handle dropped (`Shared::tasks`).
    let mut guards = Vec::with_capacity(n);
    let mut stripes = Vec::with_capacity(n);
    for (i, client) in clients.into_iter().enumerate() {
        let (a, b) = (i * chunks / n, (i + 1) * chunks / n);
        let part = LoadRequest {
            geometry: req.geometry.clone(),
            hashes: req.hashes[a..b].to_vec(),
            hints: req.hints.clone(),
        };
        let sink = Stripe::new(sh.clone(), a, a as u64 * slice, slice, step.clone(), i);
        let group = group.map(|(load_id, load_layer_bytes)| LoadGroup {
            load_id,
            stripe: i as u16,
            stripes: n as u16,
            load_layer_bytes,
        });
        let (tx, rx) = tokio::sync::oneshot::channel();
        // Its own task, so the stripes' receiving (socket copy, CRC) runs on several threads.
        // Registered with the load, whose end aborts and awaits it before the buffers go.
        let stripe = run_stripe(
            fo.clone(),
            target.clone(),
            client,
            sink,
            keys.clone(),
            part,
            placed[i].take(),
            request_id,
            group,
            a as u64 * slice..b as u64 * slice,
        );
        let task = tokio::spawn(async move {
            let _ = tx.send(stripe.await);
        });
        guards.push(AbortOnDrop(task.abort_handle()));
        sh.tasks.lock().expect("lock").push(task);
        stripes.push((a..b, rx));
    }
    let (mut delivered, mut refused, mut broken) = (Vec::new(), None, None);
    let mut ended = Vec::new();
    for (range, rx) in stripes {
        match rx.await {
            Ok(StripeEnd {
                sink,
                result,
                client,
            }) => {
                match result {
                    Ok(report) => {
                        // The server names each bad chunk once and delivers the others.
                        for &(c, reason) in &report.missed_chunks {
                            sh.set_chunk(
                                range.start + c as usize,
                                crate::connector::status::chunk_status_of_miss(reason),
                            );
                        }
                        delivered.push(range);
                    }
                    // Refused before any byte (busy, limits) by every gateway tried.
                    Err(GatherError::Remote { code, message }) => {
                        refused = Some((range.start, format!("{code:?}: {message}")))
                    }
                    Err(e) => broken = Some((range.start, e.to_string())),
                }
                if let Some((addr, client)) = client {
                    give_back(&probes.get(&addr), client);
                }
                ended.push(sink);
            }
            // The task was aborted: the load was cancelled or dropped.
            Err(_) => broken = Some((range.start, "gather stream stopped".to_string())),
        }
    }
    if delivered.is_empty() && broken.is_none() {
        if let Some((_, why)) = refused {
            // Nothing was delivered: the ranged-GET path can still serve the whole load.
            tracing::warn!(%why, "gather request refused; using ranged GETs");
            return Outcome::Fallback;
        }
    }
    // Layers no gateway could finish are misses.
    for mut sink in ended {
        sink.fail_held();
    }
    // Per-chunk status from the layers' miss reasons (the server names the chunk).
    for l in 0..sh.state.layers() {
        if let crate::connector::buffers::LayerStatus::Failed(e) = sh.state.status(l) {
            if let Some((c, s)) = crate::connector::status::chunk_status_of(&e) {
                sh.set_chunk(c, s);
            }
        }
    }
    if let Some((chunk, why)) = broken.or(refused) {
        // Mid-stream failures already failed the incomplete layers they knew of; a stripe
        // that never ran leaves its layers incomplete: misses, never bytes.
        sh.state.fail_pending(LayerError::Storage {
            chunk,
            message: format!("gather: {why}"),
        });
    }
    // Every chunk of a stripe that finished and was not named is whole (its slices arrived
    // verified), as on the ranged-GET path.
    for c in delivered.into_iter().flatten() {
        sh.set_chunk(c, ChunkStatus::Ok);
    }
    Outcome::Done
}
