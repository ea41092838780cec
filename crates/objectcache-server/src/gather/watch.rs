//! The one wait of a load: any future the driver waits on (admission, the next read, a header
//! result, its pacing) raced against the client (cancel, gone) and the server's shutdown, with
//! `Held` frames meanwhile for a client that asked for them.

use super::io::Io;
use crate::{Abort, ServerState};
use objectcache_client::protocol::ErrorCode;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

/// Ticks every [`objectcache_client::protocol::HELD_EVERY_MS`] ms, the first a period from now: while a
/// request is held on purpose, each tick sends a `Held` frame to a client that asked for them.
fn held_ticker() -> tokio::time::Interval {
    let every = Duration::from_millis(objectcache_client::protocol::HELD_EVERY_MS);
    let mut t = tokio::time::interval_at(Instant::now() + every, every);
    t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    t
}

/// Watches one load's waits (see the module doc). Two phases, two ways to stop for the
/// server's shutdown:
/// - [`Watch::admission`]: nothing was accepted yet; shutdown closes the connection at once;
/// - [`Watch::load`]: the load was accepted; it may finish for `shutdown_grace_secs` after
///   shutdown, then the connection is closed with `ShuttingDown`.
pub(super) struct Watch {
    sh: Arc<ServerState>,
    request_id: u64,
    /// The client asked for `Held` frames.
    held: bool,
    /// Resolves when the load must stop for the server's shutdown.
    stop: Pin<Box<dyn Future<Output = ()> + Send>>,
    /// What the client is told then (and counted), before the connection closes.
    on_stop: fn(&ServerState, &mut Io),
}

impl Watch {
    /// Waits before admission: shutdown stops them at once.
    pub(super) fn admission(sh: Arc<ServerState>, request_id: u64, held: bool) -> Self {
        let shutdown = sh.shutdown.clone();
        Watch {
            sh,
            request_id,
            held,
            stop: Box::pin(async move { shutdown.cancelled().await }),
            on_stop: |_, io| {
                io.conn
                    .close_with(ErrorCode::ShuttingDown, "server is shutting down")
            },
        }
    }

    /// Waits of an accepted load: it may finish for `shutdown_grace_secs` after shutdown.
    pub(super) fn load(sh: Arc<ServerState>, request_id: u64, held: bool) -> Self {
        let grace = Duration::from_secs(sh.cfg.shutdown_grace_secs);
        let shutdown = sh.shutdown.clone();
        Watch {
            sh,
            request_id,
            held,
            stop: Box::pin(async move {
                shutdown.cancelled().await;
                tokio::time::sleep(grace).await;
            }),
            on_stop: |sh, io| {
                sh.metrics.error("shutdown_abort");
                io.conn.close_with(
                    ErrorCode::ShuttingDown,
                    "server shut down before the load finished",
                );
            },
        }
    }

    /// Waits for `fut`. `Ok(Some(v))`: it resolved; `Ok(None)`: the client cancelled the
    /// request meanwhile; `Err(Abort::Gone)`: the client went away;
    /// `Err(Abort::Shutdown)`: the server stopped the load (the client was told, see
    /// [`Watch`]). With `held` (a wait on purpose: admission, pacing) and a client that asked
    /// for them, a `Held` frame goes out every [`objectcache_client::protocol::HELD_EVERY_MS`] ms.
    pub(super) async fn wait<F: Future>(
        &mut self,
        io: &mut Io,
        fut: F,
        held: bool,
    ) -> Result<Option<F::Output>, Abort> {
        tokio::pin!(fut);
        let mut ticks = held_ticker();
        let held = held && self.held;
        loop {
            tokio::select! {
                biased;
                _ = &mut self.stop => {
                    (self.on_stop)(&self.sh, io);
                    let _ = io.flush(&self.sh).await;
                    return Err(Abort::Shutdown);
                }
                a = io.next_signal() => return match a {
                    Abort::Cancelled => Ok(None),
                    a => Err(a),
                },
                _ = ticks.tick(), if held => {
                    io.conn.send_held(self.request_id);
                    io.flush(&self.sh).await?;
                }
                v = &mut fut => return Ok(Some(v)),
            }
        }
    }
}
