//! The accept loop: connections admitted under the connection cap, the preface sniffer's
//! verdict (gather, RDMA set-up or HTTP), each connection on its own tracked task, and the
//! graceful stop on shutdown.

use super::http::serve_http;
use super::{client_floor, conn, gather, tenant, tls, ServerState};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio_util::task::TaskTracker;

pub(super) async fn accept_loop(
    listener: TcpListener,
    sh: Arc<ServerState>,
    s3: s3s::service::S3Service,
    tls: Option<tokio_rustls::TlsAcceptor>,
) {
    let tracker = TaskTracker::new();
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    loop {
        let (stream, peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(x) => x,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = sh.shutdown.cancelled() => break,
        };
        // Past a cap the connection is closed before anything is read from it.
        let guard = match sh.conns.admit(peer.ip()) {
            Ok(g) => g,
            Err(cap) => {
                tracing::debug!(%peer, cap, "connection refused: too many open");
                drop(stream);
                continue;
            }
        };
        let sh2 = sh.clone();
        let s3 = s3.clone();
        let watcher = graceful.watcher();
        let tls = tls.clone();
        // Sniffing happens in the connection's own task: an idle connection (a client's
        // pooled spare) never holds up the accept loop.
        tracker.spawn(async move {
            let _guard = guard;
            let deadline =
                tokio::time::Instant::now() + Duration::from_secs(sh2.cfg.handshake_timeout_secs);
            if let Some(acc) = tls {
                // TLS: the S3 API only (gather is not offered over TLS yet, see tls.rs).
                let stream = tokio::select! {
                    s = tls::accept(&acc, stream) => s,
                    _ = sh2.shutdown.cancelled() => None,
                };
                if let Some(stream) = stream {
                    let _ = stream.get_ref().0.set_nodelay(true);
                    let io = conn::Prefixed::new(&[], stream, client_floor(&sh2.cfg));
                    serve_http(io, sh2, s3, watcher, peer).await;
                }
                return;
            }
            let mut stream = stream;
            let sniffed = tokio::select! {
                s = conn::sniff(&mut stream, deadline, rdma_offered(&sh2)) => s,
                _ = sh2.shutdown.cancelled() => None,
            };
            let Some(first) = sniffed else {
                // Closed, or no protocol told in time: nothing was held but 8 bytes.
                sh2.metrics.error("handshake");
                return;
            };
            match first.protocol {
                // Gather loads are not confined to a tenant's namespace: with tenants it
                // is refused (connectors fall back to ranged GETs).
                conn::Protocol::Gather if !sh2.cfg.tenants.is_empty() => {
                    tenant::refuse_gather(stream).await
                }
                conn::Protocol::Gather => gather::serve(stream, sh2, first.head(), deadline).await,
                #[cfg(feature = "rdma")]
                conn::Protocol::Rdma if sh2.rdma.is_some() => {
                    let reg = sh2.rdma.clone().expect("checked");
                    super::gather::rdma::serve_control(stream, reg).await;
                }
                conn::Protocol::Rdma | conn::Protocol::Http => {
                    let _ = stream.set_nodelay(true);
                    let io = conn::Prefixed::new(first.head(), stream, client_floor(&sh2.cfg));
                    serve_http(io, sh2, s3, watcher, peer).await;
                }
            }
        });
    }
    drop(listener);
    #[cfg(feature = "rdma")]
    if let Some(r) = &sh.rdma {
        r.shutdown();
    }
    tracker.close();
    let grace = Duration::from_secs(sh.cfg.shutdown_grace_secs + 1);
    let _ = tokio::time::timeout(grace, graceful.shutdown()).await;
    let _ = tokio::time::timeout(grace, tracker.wait()).await;
    tracing::info!("objectcache server stopped");
}

/// Whether RDMA set-up channels are offered on this server's port.
fn rdma_offered(_sh: &ServerState) -> bool {
    #[cfg(feature = "rdma")]
    if _sh.rdma.is_some() {
        return true;
    }
    false
}
