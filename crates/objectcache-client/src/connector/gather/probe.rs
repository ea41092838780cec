//! What the engine knows of its endpoints' gather offer: one capabilities probe per endpoint
//! ([`Probe`], [`Probes`]), the status it reports ([`GatherStatus`]), whether a load should
//! try gather ([`offered`]), and the pool of idle connections ([`connection`]).

use crate::store::GatherTarget;
use crate::transport::discovery::{probe_capabilities, Capabilities};
use crate::transport::tcp::{GatherClient, GatherError};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// What the engine knows about its store's endpoint.
#[derive(Debug, Default)]
pub(crate) enum Probe {
    /// Not probed yet.
    #[default]
    Unknown,
    /// A capabilities probe is running; the sender half is dropped when it ends.
    Probing(watch::Receiver<()>),
    /// Gather is offered; idle connections kept for reuse; `warming` while the engine opens
    /// the first one in the background.
    Offered {
        /// Idle connections.
        pool: Vec<GatherClient>,
        /// The pool is being warmed.
        warming: bool,
    },
    /// The endpoint does not speak gather (a stock S3 server): use ranged GETs. Final.
    NotOffered,
    /// The probe could not reach the endpoint at this time; the first load after
    /// [`PROBE_RETRY`] probes again (in the background).
    Unreachable(Instant),
}

/// Longest a load waits for a capabilities probe in flight before it goes on with ranged
/// GETs. The probe starts with the engine and any reachable S3 server answers it in about a
/// millisecond (it is one HTTP request), so loads normally find the answer waiting; only the
/// loads that arrive while an endpoint is silent wait, and never longer than this.
const PROBE_WAIT: Duration = Duration::from_millis(500);
/// Longest the probe itself may take (it runs in the background).
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);
/// How soon an unreachable endpoint is probed again.
const PROBE_RETRY: Duration = Duration::from_secs(5);

/// Starts the one capabilities probe of this engine's endpoint (a plain HTTP request every
/// S3 server answers at once, [`crate::transport::discovery`]) unless one ran or runs, and
/// returns a receiver that closes when it ends. Once gather is known to be offered, one
/// connection is opened and pooled (the engine's pool is warm before its first load).
pub(crate) fn start_probe(
    probe: &Arc<Mutex<Probe>>,
    target: &GatherTarget,
) -> Option<watch::Receiver<()>> {
    let mut p = probe.lock().expect("lock");
    match &*p {
        Probe::Probing(rx) => return Some(rx.clone()),
        Probe::Offered { .. } | Probe::NotOffered => return None,
        Probe::Unreachable(at) if at.elapsed() < PROBE_RETRY => return None,
        Probe::Unknown | Probe::Unreachable(_) => {}
    }
    let (tx, rx) = watch::channel(());
    *p = Probe::Probing(rx.clone());
    drop(p);
    let (probe, target) = (probe.clone(), target.clone());
    tokio::spawn(async move {
        let offered = match probe_capabilities(&target.addr, PROBE_TIMEOUT).await {
            Ok(Capabilities::Gather { .. }) => {
                tracing::info!(addr = %target.addr, "the endpoint offers gather");
                Probe::Offered {
                    pool: Vec::new(),
                    warming: true,
                }
            }
            Ok(Capabilities::NotOffered { status, why }) => {
                tracing::info!(addr = %target.addr, status, %why, "gather not offered; using ranged GETs");
                Probe::NotOffered
            }
            Err(e) => {
                tracing::warn!(addr = %target.addr, error = %e, "gather probe failed; ranged GETs until it succeeds");
                Probe::Unreachable(Instant::now())
            }
        };
        let warm = matches!(offered, Probe::Offered { .. });
        *probe.lock().expect("lock") = offered;
        // The verdict is out: loads no longer wait for this task.
        drop(tx);
        if warm {
            // Warm the pool with one connection; a failure here only leaves it cold.
            let c =
                GatherClient::connect_with(target.addr.as_str(), target.credentials.clone()).await;
            let mut p = probe.lock().expect("lock");
            match (c, &mut *p) {
                (Ok(c), Probe::Offered { pool, warming }) => {
                    pool.push(c);
                    *warming = false;
                }
                (Err(GatherError::NotOffered(why)), _) => {
                    tracing::info!(addr = %target.addr, %why, "gather not offered; using ranged GETs");
                    *p = Probe::NotOffered;
                }
                (Err(e), Probe::Offered { warming, .. }) => {
                    tracing::debug!(addr = %target.addr, error = %e, "warming the gather pool failed");
                    *warming = false;
                }
                _ => {}
            }
        }
    });
    Some(rx)
}

/// What the engine knows of its endpoint's gather offer, for [`super::Engine::gather_status`].
///
/// [`super::Engine::gather_status`]: crate::connector::Engine::gather_status
pub(crate) fn status(probe: &Mutex<Probe>) -> GatherStatus {
    match &*probe.lock().expect("lock") {
        Probe::Unknown => GatherStatus::Unknown,
        Probe::Probing(_) => GatherStatus::Probing,
        Probe::Offered { pool, warming } => GatherStatus::Offered {
            idle_connections: pool.len(),
            warming: *warming,
        },
        Probe::NotOffered => GatherStatus::NotOffered,
        Probe::Unreachable(_) => GatherStatus::Unreachable,
    }
}

/// Whether an engine's loads use gather ([`super::Engine::gather_status`]).
///
/// [`super::Engine::gather_status`]: crate::connector::Engine::gather_status
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GatherStatus {
    /// Gather is switched off, or the store has no endpoint that could offer it (a local
    /// store, AWS S3, an `https://` endpoint).
    Off,
    /// Not asked yet.
    Unknown,
    /// The one capabilities request is in flight.
    Probing,
    /// The endpoint is an ObjectCache server: loads use gather.
    Offered {
        /// Idle gather connections kept for the next loads.
        idle_connections: usize,
        /// The engine is opening its first connection in the background.
        warming: bool,
    },
    /// A stock S3 server: loads use ranged GETs (final for this engine).
    NotOffered,
    /// The endpoint could not be reached when asked; loads use ranged GETs and a later load
    /// asks again.
    Unreachable,
}

/// Whether loads should try gather at `target`: starts the engine's probe if none ran yet and
/// waits for a probe in flight at most [`PROBE_WAIT`]. `false` (ranged GETs) while the answer
/// is unknown, so a slow or silent endpoint never holds a load up for longer.
pub(crate) async fn offered(probe: &Arc<Mutex<Probe>>, target: &GatherTarget) -> bool {
    if let Some(mut rx) = start_probe(probe, target) {
        let _ = tokio::time::timeout(PROBE_WAIT, rx.changed()).await;
    }
    matches!(*probe.lock().expect("lock"), Probe::Offered { .. })
}

/// Puts an idle connection back into the endpoint's pool for the next load; dropped (closed)
/// when the endpoint is no longer known to offer gather.
pub(super) fn give_back(probe: &Mutex<Probe>, client: GatherClient) {
    if let Probe::Offered { pool, .. } = &mut *probe.lock().expect("lock") {
        pool.push(client);
    }
}

/// Why [`connection`] gave no connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum NoConnection {
    /// The endpoint does not offer gather (or is not known to): use ranged GETs.
    NotOffered,
    /// It offers gather but could not be reached now (refused, reset, silent).
    Unreachable,
}

/// Takes an idle pooled connection to the gather server, or opens one. Call after
/// [`offered`].
pub(super) async fn connection(
    probe: &Mutex<Probe>,
    target: &GatherTarget,
) -> Result<GatherClient, NoConnection> {
    let pooled = {
        let mut p = probe.lock().expect("lock");
        match &mut *p {
            // Skip connections the server closed while they sat idle (e.g. it restarted).
            Probe::Offered { pool, .. } => {
                std::iter::from_fn(|| pool.pop()).find(|c| !c.is_stale())
            }
            _ => return Err(NoConnection::NotOffered),
        }
    };
    if let Some(c) = pooled {
        return Ok(c);
    }
    match GatherClient::connect_with(target.addr.as_str(), target.credentials.clone()).await {
        Ok(c) => Ok(c),
        Err(GatherError::NotOffered(why)) => {
            tracing::info!(addr = %target.addr, %why, "gather not offered; using ranged GETs");
            *probe.lock().expect("lock") = Probe::NotOffered;
            Err(NoConnection::NotOffered)
        }
        Err(e) => {
            tracing::warn!(addr = %target.addr, error = %e, "gather connection failed");
            Err(NoConnection::Unreachable)
        }
    }
}

/// The engine's gather probes, one per endpoint (`GatherTarget::addr`): a store over several
/// gateways has one per gateway.
#[derive(Debug, Default)]
pub(crate) struct Probes(Mutex<HashMap<String, Arc<Mutex<Probe>>>>);

impl Probes {
    /// The probe of the endpoint at `addr` (created unknown on first use).
    pub(crate) fn get(&self, addr: &str) -> Arc<Mutex<Probe>> {
        self.0
            .lock()
            .expect("lock")
            .entry(addr.to_string())
            .or_default()
            .clone()
    }
}
