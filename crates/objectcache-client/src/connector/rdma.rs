//! The RDMA choice of a load (feature `rdma`): when the store's endpoint is an ObjectCache
//! server that announces the RDMA target and this host has an RDMA device, the load is one
//! gather request whose target is the load's own destination buffers (their memory areas
//! registered once each in the session's registration cache; a paged destination is a list
//! of segments of those areas); the server writes every unit into them.
//! Otherwise, or when the server refuses before writing, the load falls back to TCP gather
//! (and from there to ranged GETs).
//!
//! One RDMA session per engine (set up on the server's gather port), shared by concurrent
//! loads (each gets its own load slot and gather connection). A broken session (QP error,
//! server gone, a load's deadline) is dropped and set up again on the next load.
#![allow(unsafe_code)]

use super::config::Transport;
use super::gather::Outcome;
use super::load::{LoadRequest, LoadShared};
use super::status::ChunkStatus;
use crate::error::{LayerError, LayerResult};
use crate::layout::KeyBuilder;
use crate::store::GatherTarget;
use crate::transport::rdma::{
    ClientConfig, DeviceSelector, GatherConn, LayerDest, RdmaClient, RdmaGatherError,
};
use crate::transport::LayerSink;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

/// What the engine knows about RDMA to its store's server.
#[derive(Default)]
pub(crate) enum Probe {
    /// Not tried yet (or the last session broke).
    #[default]
    Unknown,
    /// No RDMA (no device here, the server does not offer it, or set-up failed).
    Off,
    /// A load is setting the session up; others wait for it (one session per engine) until
    /// this receiver's sender, held by that load, is dropped (set-up done, failed, or the
    /// load dropped).
    Connecting(tokio::sync::watch::Receiver<()>),
    /// A live session and idle gather connections for RDMA-target requests.
    On {
        client: Arc<RdmaClient>,
        pool: Vec<GatherConn>,
    },
}

/// The load's state as a [`LayerSink`] the RDMA session can hold.
struct SinkRef(Arc<LoadShared>);

impl LayerSink for SinkRef {
    fn write(&self, layer: u32, offset: u64, data: &[u8]) -> LayerResult<()> {
        self.0.state.write(layer, offset, data)
    }
    fn placed(&self, layer: u32, offset: u64, len: u64) -> LayerResult<()> {
        self.0.state.placed(layer, offset, len)
    }
    fn complete(&self, layer: u32, bytes: u64) {
        self.0.state.complete(layer, bytes)
    }
    fn landed(&self, layer: u32, offset: u64, len: u64) {
        // Every slice the range covers whole (units hold whole slices, or one piece of a
        // slice larger than a unit, which counts when the layer is ready).
        let slice = self.0.slice_bytes.max(1);
        let first = offset.div_ceil(slice);
        let end = (offset + len) / slice;
        for c in first..end {
            self.0.record_slice_landed(c as usize, layer as usize);
        }
    }
    fn fail(&self, layer: u32, err: LayerError) {
        self.0.state.fail(layer, err)
    }
    fn is_cancelled(&self) -> bool {
        self.0.state.is_cancelled()
    }
}

/// Sets up the RDMA session and one gather connection; `Err` says why RDMA is not used.
async fn connect(
    addr: &str,
    credentials: Option<(String, String)>,
) -> Result<(Arc<RdmaClient>, GatherConn), String> {
    let device = DeviceSelector::from_env().map_err(|e| e.to_string())?;
    let conn = GatherConn::connect(addr, credentials).await?;
    let a = addr.to_string();
    let client = tokio::task::spawn_blocking(move || {
        RdmaClient::connect_gather(
            a,
            ClientConfig {
                device,
                ..ClientConfig::default()
            },
        )
    })
    .await
    .map_err(|e| e.to_string())?
    .map_err(|e| e.to_string())?;
    Ok((Arc::new(client), conn))
}

/// Forgets the session's cached registration of memory `ptr..ptr+len` (see
/// `Engine::forget_memory`).
pub(crate) fn forget(probe: &Mutex<Probe>, ptr: *mut u8, len: usize) {
    if let Probe::On { client, .. } = &*probe.lock().expect("lock") {
        client.evict_raw(ptr, len);
    }
}

/// Runs `req` as a gather request with an RDMA target if the server and host offer RDMA;
/// chunks that `runs` place in segment objects (format version 2) only from a server that
/// reads them (else `Outcome::Fallback`).
#[allow(clippy::too_many_arguments)]
pub(crate) async fn try_rdma(
    probe: &Mutex<Probe>,
    transport: Transport,
    target: &GatherTarget,
    keys: &KeyBuilder,
    req: &LoadRequest,
    runs: &[crate::layout::Run],
    request_id: u64,
    sh: &Arc<LoadShared>,
) -> Outcome {
    if transport == Transport::Tcp {
        return Outcome::Fallback;
    }
    let taken = loop {
        let mut wait = {
            let mut p = probe.lock().expect("lock");
            match &mut *p {
                Probe::Off => return Outcome::Fallback,
                Probe::On { client, pool } if client.broken().is_none() => {
                    break Ok((client.clone(), pool.pop()))
                }
                Probe::Connecting(rx) => rx.clone(),
                Probe::On { .. } | Probe::Unknown => {
                    let (tx, rx) = tokio::sync::watch::channel(());
                    *p = Probe::Connecting(rx);
                    break Err(tx);
                }
            }
        };
        // Another load is setting the session up (bounded by its connect timeouts): wait
        // until it is done (its sender dropped), then look again.
        let _ = wait.changed().await;
    };
    let (client, conn) = match taken {
        Ok((c, Some(conn))) => (c, conn),
        Ok((c, None)) => {
            match GatherConn::connect(target.addr.as_str(), target.credentials.clone()).await {
                Ok(conn) => (c, conn),
                Err(why) => {
                    tracing::warn!(addr = %target.addr, %why, "gather connection for RDMA failed; using TCP");
                    return Outcome::Fallback;
                }
            }
        }
        Err(done) => {
            // Dropped at the end of this arm (waking the waiters), after the probe's new state
            // is set; or, still armed, when this load is dropped mid-way (the probe then goes
            // back to `Unknown` first).
            let mut guard = ConnectingGuard {
                probe,
                _done: done,
                armed: true,
            };
            let connected = connect(&target.addr, target.credentials.clone()).await;
            guard.armed = false;
            match connected {
                Ok((c, conn)) => {
                    tracing::info!(addr = %target.addr, session = format!("{:016x}", c.session()), "loads use RDMA");
                    *probe.lock().expect("lock") = Probe::On {
                        client: c.clone(),
                        pool: Vec::new(),
                    };
                    (c, conn)
                }
                Err(why) => {
                    if transport == Transport::Rdma {
                        tracing::warn!(addr = %target.addr, %why, "transport = rdma, but RDMA is not available; using TCP gather");
                    } else {
                        tracing::info!(addr = %target.addr, %why, "no RDMA; using TCP gather");
                    }
                    *probe.lock().expect("lock") = Probe::Off;
                    return Outcome::Fallback;
                }
            }
        }
    };
    let mut conn = conn;
    // Chunks in segment objects (format version 2) only from a server that reads them.
    let Ok(segments) = crate::protocol::SegmentPlacement::from_runs(runs, 0..req.hashes.len())
    else {
        return Outcome::Fallback;
    };
    if segments.is_some()
        && conn.server_info().features & crate::protocol::ServerInfo::FEATURE_SEGMENTS == 0
    {
        return Outcome::Fallback;
    }
    let mut greq = super::gather::gather_request(request_id, target, keys, req, segments);
    // The server verifies every slice's CRC32C before writing it (the client cannot check
    // bytes the NIC placed without reading them back).
    greq.verify = true;
    // A scattered (paged) destination: one slice per unit, so a unit spans only the engine
    // blocks of one chunk (one RDMA write per block it touches); 16 MiB units would span
    // more blocks than a session writes per unit.
    if (0..sh.state.bufs.layers()).any(|l| sh.state.bufs.ranges(l).len() > 1) {
        greq.max_unit_bytes = super::gather::unit_bytes_for(&req.geometry);
    }
    let bufs = &sh.state.bufs;
    // Addresses as integers: the future must be `Send`.
    let memory: Vec<(usize, usize)> = bufs
        .memory()
        .into_iter()
        .map(|(p, n)| (p as usize, n))
        .collect();
    let dests: Vec<LayerDest> = (0..bufs.layers())
        .map(|l| {
            let ranges = bufs.ranges(l);
            let mem: Vec<(*mut u8, usize)> =
                memory.iter().map(|&(p, n)| (p as *mut u8, n)).collect();
            // SAFETY: the ranges and memory areas belong to this load's `LayerBuffers`, which
            // live in `sh` for as long as the load runs and whose ranges are not read by anyone
            // until their layer is ready. An area's registration outlives the load only when
            // the buffers say the area is long-lived (the caller's memory given to
            // `from_raw_ranges`, the C ABI's registered regions: `Engine::forget_memory`
            // evicts it before that memory is freed); every other area is evicted below, when
            // the load ends, so no registration outlives its memory.
            unsafe { LayerDest::raw_ranges(l as u32, &ranges, &mem) }
        })
        .collect();
    let long_lived = bufs.memory_is_long_lived();
    sh.requests.fetch_add(1, Ordering::Relaxed);
    let r = conn
        .load(&client, greq, &dests, Arc::new(SinkRef(sh.clone())))
        .await;
    if !long_lived {
        for &(p, n) in &memory {
            client.evict_raw(p as *mut u8, n);
        }
    }
    match r {
        Ok(missed) => {
            for (c, reason) in missed {
                sh.set_chunk(c, super::status::chunk_status_of_miss(reason));
            }
            settle_chunks(sh);
            if let Probe::On { pool, .. } = &mut *probe.lock().expect("lock") {
                pool.push(conn);
            }
            Outcome::Done
        }
        Err(RdmaGatherError::Refused(why)) => {
            tracing::warn!(%why, "gather over RDMA refused; using TCP gather");
            sh.requests.fetch_sub(1, Ordering::Relaxed);
            Outcome::Fallback
        }
        Err(e) => {
            tracing::warn!(error = %e, "gather over RDMA failed mid-load; the session will be set up again");
            sh.state.fail_pending(LayerError::Storage {
                chunk: 0,
                message: e.to_string(),
            });
            settle_chunks(sh);
            let mut p = probe.lock().expect("lock");
            if matches!(&*p, Probe::On { client: c, .. } if Arc::ptr_eq(c, &client)) {
                *p = Probe::Unknown;
            }
            Outcome::Done
        }
    }
}

/// Gives every chunk its final status once an RDMA load has ended (no chunk stays
/// `Pending`). A failed layer's error names its chunk, which gets the status it implies. Each
/// other chunk is `Ok` when every one of its slices landed (the server writes the good slices
/// of a unit that a bad slice cut one by one), else `Error` (not delivered), never `Ok`.
/// (Chunks are left alone when every layer is ready: `LoadHandle::chunk_status` reads them
/// as `Ok`.)
fn settle_chunks(sh: &LoadShared) {
    let mut all_ready = true;
    for l in 0..sh.state.layers() {
        match sh.state.status(l) {
            super::buffers::LayerStatus::Ready => {}
            super::buffers::LayerStatus::Failed(e) => {
                all_ready = false;
                if let Some((c, s)) = super::status::chunk_status_of(&e) {
                    sh.set_chunk(c, s);
                }
            }
            _ => all_ready = false,
        }
    }
    if !all_ready {
        for c in 0..sh.chunk_status.len() {
            if sh.chunk(c) == ChunkStatus::Pending {
                let whole = (0..sh.state.layers()).all(|l| sh.slice_in_place(c, l));
                sh.set_chunk(
                    c,
                    if whole {
                        ChunkStatus::Ok
                    } else {
                        ChunkStatus::Error
                    },
                );
            }
        }
    }
}

/// Held by the load that sets the RDMA session up. Dropping it wakes the loads waiting in
/// [`Probe::Connecting`] (its sender goes); while `armed` (the load was dropped mid-way, its
/// deadline) it first resets [`Probe::Connecting`] to [`Probe::Unknown`], so that the next
/// load tries again.
struct ConnectingGuard<'a> {
    probe: &'a Mutex<Probe>,
    _done: tokio::sync::watch::Sender<()>,
    armed: bool,
}

impl Drop for ConnectingGuard<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let mut p = self.probe.lock().unwrap_or_else(|e| e.into_inner());
        if matches!(*p, Probe::Connecting(_)) {
            *p = Probe::Unknown;
        }
    }
}
