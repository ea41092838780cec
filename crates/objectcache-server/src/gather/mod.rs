//! The gather endpoint: a tokio driver over [`ServerConnection`] that serves loads (parallel
//! bounded reads, units delivered in layer order) and batched saves.
//!
//! - `mod.rs`: the connection loop ([`serve`]) and the load driver (`run_gather`): next
//!   event, ask the load, deliver.
//! - `load.rs`: one load's life around the pure [`ServerLoad`](objectcache_client::protocol::ServerLoad):
//!   checks, admission, its reads started, each unit delivered, `End`.
//! - `watch.rs`: the one wait, raced against the client, shutdown and `Held` ticks.
//! - `delivery.rs`: where units go, the stream or `rdma.rs` (RDMA writes, feature `rdma`).
//! - `io.rs`: the socket under the memory budget and the client's progress floor.
//! - `fetch.rs`, `objects.rs`: the load's reads (header checks, unit pieces, mapped local
//!   files) and its objects.
//! - `save.rs`: batched saves.

mod delivery;
mod fetch;
mod io;
mod load;
mod objects;
#[cfg(feature = "rdma")]
pub(crate) mod rdma;
mod save;
mod watch;

use io::{Io, ReadWait, CONN_BUF_BYTES};
use load::Load;
use save::run_save;

use crate::{Abort, ServerState};
use bytes::BytesMut;
use objectcache_client::protocol::{
    ErrorCode, GatherRequest, ServerConnection, ServerEvent, UnitReady,
};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::time::Instant;

/// A connection's protocol state: with access keys configured, the client must answer an
/// HMAC challenge over a fresh random nonce with one of them (protocol version 2,
/// [`objectcache_client::protocol::auth`]) before any request, as S3 requests must carry SigV4.
fn new_connection(sh: &ServerState) -> ServerConnection {
    if sh.cfg.access_keys.is_empty() {
        return ServerConnection::new(sh.limits());
    }
    let mut nonce = [0u8; objectcache_client::protocol::auth::NONCE_LEN];
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
    sh: Arc<ServerState>,
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

/// Serves one load: [`Load::start`] checks and admits it, then each unit, as its reads and
/// header checks complete and its pacing allows, goes out as the pure [`ServerLoad`]
/// decides ([`Load::deliver`]), until `End` ([`Load::finish`]). Every wait is raced against
/// the client and the server's shutdown ([`watch::Watch`]).
async fn run_gather(io: &mut Io, req: GatherRequest, sh: &Arc<ServerState>) -> Result<(), Abort> {
    sh.metrics.request("gather");
    let Some(mut l) = Load::start(io, req, sh, Instant::now()).await? else {
        return io.flush(sh).await; // refused, or cancelled while it waited
    };
    let mut all_sent = false;
    'units: loop {
        // `None`: the client cancelled; the load ends with what it sent.
        let Some(next) = l.watch.wait(io, l.reads.recv(), false).await? else {
            break;
        };
        let Some(f) = next else {
            all_sent = true;
            break;
        };
        loop {
            match l.state.readiness(&f.plan) {
                UnitReady::AwaitHeader => {
                    let Some(r) = l.watch.wait(io, l.headers.recv(), false).await? else {
                        break 'units;
                    };
                    l.on_header(io, sh, r);
                }
                UnitReady::NothingToSend => break 'units,
                UnitReady::Deliver => break,
            }
        }
        // Held on purpose (its bandwidth share, or its stripes' order): a client that asked
        // for them gets `Held` frames meanwhile.
        if l.member.is_paced() {
            let paced = l.member.pace(f.plan.layer, f.plan.len);
            if l.watch.wait(io, paced, true).await?.is_none() {
                break;
            }
        }
        l.deliver(io, sh, f).await?;
    }
    l.finish(io, sh, all_sent).await
}
