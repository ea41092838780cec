//! The HTTP side of the port: one connection served with hyper ([`serve_http`]), and the
//! routing of each request ([`http_route`]): `/_objectcache/health`, `metrics`,
//! `capabilities`, `tier` (the node tier's counters, JSON) and `lookup` (POST,
//! [`crate::lookup`]) answered here, presigned URLs of too long validity refused, everything else
//! to the S3 API.

use super::{client_floor, s3, ServerState};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use objectcache_client::protocol::{ServerInfo, PROTOCOL_VERSION};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

/// Bytes of a connection's HTTP read buffer at most (request heads, body pieces): part of
/// the fixed per-connection memory outside the budget.
const HTTP_BUF_BYTES: usize = 64 << 10;

/// Serves HTTP/1.1 on one connection: request heads must arrive within
/// `client_timeout_secs` (idle keep-alive connections close after it too), responses the
/// client does not read fast enough end the connection ([`conn::Prefixed`]), request bodies
/// are metered ([`s3::MeteredBody`]).
///
/// [`conn::Prefixed`]: super::conn::Prefixed
pub(super) async fn serve_http<I>(
    io: I,
    sh: Arc<ServerState>,
    s3: s3s::service::S3Service,
    watcher: hyper_util::server::graceful::Watcher,
    peer: SocketAddr,
) where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let sh3 = sh.clone();
    let svc = service_fn(move |req| http_route(req, sh3.clone(), s3.clone()));
    let mut b = hyper::server::conn::http1::Builder::new();
    b.keep_alive(true)
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(Duration::from_secs(sh.cfg.client_timeout_secs))
        .max_buf_size(HTTP_BUF_BYTES);
    let conn = b.serve_connection(TokioIo::new(io), svc);
    if let Err(e) = watcher.watch(conn).await {
        tracing::debug!(%peer, error = %e, "http connection ended");
    }
}

type HttpResp = hyper::Response<s3s::Body>;

/// A response of `status` with content type `ct` and `body`.
fn text(status: u16, ct: &str, body: String) -> HttpResp {
    hyper::Response::builder()
        .status(status)
        .header("content-type", ct)
        .body(s3s::Body::from(body))
        .expect("valid response")
}

async fn http_route(
    req: hyper::Request<hyper::body::Incoming>,
    sh: Arc<ServerState>,
    s3: s3s::service::S3Service,
) -> Result<HttpResp, std::convert::Infallible> {
    let path = req.uri().path();
    // HEAD is answered as GET without the body (hyper leaves it out): `objectcache doctor`'s
    // idle-connection probe sends `HEAD /_objectcache/health`, which then never reaches the
    // S3 API (where it would be an unknown operation, logged as an error).
    let get_or_head = req.method() == hyper::Method::GET || req.method() == hyper::Method::HEAD;
    if get_or_head && path.starts_with("/_objectcache/") {
        return Ok(match path {
            "/_objectcache/health" => {
                if sh.shutdown.is_cancelled() {
                    text(503, "text/plain", "shutting down\n".into())
                } else {
                    text(200, "text/plain", "ok\n".into())
                }
            }
            "/_objectcache/metrics" => text(
                200,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
                {
                    let mut m = sh.metrics.encode();
                    if let Some(t) = &sh.tier {
                        m = crate::metrics::with_tier(m, &t.stats());
                    }
                    if let Some(b) = &sh.backend {
                        m = crate::metrics::with_backend(m, &b.stats());
                    }
                    m
                },
            ),
            "/_objectcache/tier" => match &sh.tier {
                Some(t) => text(
                    200,
                    "application/json",
                    serde_json::to_string(&t.stats()).expect("json"),
                ),
                None => text(404, "text/plain", "this server has no node tier\n".into()),
            },
            "/_objectcache/capabilities" => {
                let l = sh.limits();
                let body = serde_json::json!({
                    "service": "objectcache",
                    "version": env!("CARGO_PKG_VERSION"),
                    "gather": {
                        "protocol_versions": [PROTOCOL_VERSION],
                        "transports": if l.features & ServerInfo::FEATURE_RDMA != 0 { vec!["tcp", "rdma"] } else { vec!["tcp"] },
                        "same_port": true,
                        "batched_save": true,
                        // Striped loads are admitted and paced as one (descriptor flag bit 2).
                        "load_groups": true,
                        // Held frames while a load waits on purpose (descriptor flag bit 3).
                        "held_frames": true,
                        // Chunks in segment objects, format version 2 (descriptor flag bit 4).
                        "segment_objects": true,
                        "max_descriptor_bytes": l.max_descriptor_bytes,
                        "max_chunks": l.max_chunks,
                        "max_request_bytes": l.max_request_bytes,
                        "max_unit_bytes": objectcache_client::protocol::MAX_UNIT_BYTES,
                        // Access keys configured: connections answer an HMAC-SHA256 challenge.
                        "authentication": if sh.cfg.access_keys.is_empty() { "none" } else { "hmac-sha256" },
                    }
                });
                text(200, "application/json", body.to_string())
            }
            _ => text(404, "text/plain", "unknown objectcache endpoint\n".into()),
        });
    }
    if req.method() == hyper::Method::POST && path == "/_objectcache/lookup" {
        return Ok(lookup_route(req, &sh).await);
    }
    if let Some(r) = presigned_expiry_refusal(req.uri()) {
        return Ok(r);
    }
    // Request bodies are metered (memory budget, progress, per-request bound); why one was
    // cut off travels in the request's extensions to the handler.
    let (mut parts, body) = req.into_parts();
    let (body, fault) = s3::MeteredBody::new(
        body,
        s3::BodyLimits {
            budget: sh.budget.clone(),
            wait: Duration::from_secs(sh.cfg.client_timeout_secs),
            floor: client_floor(&sh.cfg),
            max_request_bytes: sh.cfg.max_request_bytes,
        },
    );
    parts.extensions.insert(fault);
    let req = hyper::Request::from_parts(parts, s3s::Body::http_body_unsync(body));
    match s3.call(req).await {
        Ok(r) => Ok(r),
        Err(e) => {
            sh.metrics.error("http");
            tracing::warn!(error = ?e, "S3 request failed inside the HTTP layer");
            Ok(s3_error_response(
                500,
                "InternalError",
                "internal error (logged by the server)",
            ))
        }
    }
}

/// Longest validity of a presigned URL, seconds: 7 days, as AWS S3 allows.
pub const MAX_PRESIGNED_EXPIRES_SECS: u64 = 7 * 24 * 3600;

/// AWS S3's answer to a presigned URL whose `X-Amz-Expires` is above 7 days (or not a
/// number): `400 AuthorizationQueryParametersError`, before the signature is looked at.
fn presigned_expiry_refusal(uri: &hyper::Uri) -> Option<HttpResp> {
    let q = uri.query()?;
    let v = q.split('&').find_map(|kv| {
        let (k, v) = kv.split_once('=')?;
        k.eq_ignore_ascii_case("X-Amz-Expires").then_some(v)
    })?;
    match v.parse::<u64>() {
        Ok(s) if s <= MAX_PRESIGNED_EXPIRES_SECS => None,
        _ => Some(s3_error_response(
            400,
            "AuthorizationQueryParametersError",
            "X-Amz-Expires must be less than a week (in seconds) that is 604800",
        )),
    }
}

/// An S3 error document (`<Error><Code>..</Code><Message>..</Message></Error>`).
fn s3_error_response(status: u16, code: &str, message: &str) -> HttpResp {
    let body = format!(
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>{code}</Code><Message>{message}</Message></Error>"
    );
    hyper::Response::builder()
        .status(status)
        .header("content-type", "application/xml")
        .body(s3s::Body::from(body))
        .expect("valid response")
}

/// `POST /_objectcache/lookup` ([`crate::lookup`]): 404 unless `lookup_http` is on; 413 for a
/// body over [`crate::lookup::MAX_BODY_BYTES`]; 400 for a malformed request; 503 when the
/// store cannot be asked.
async fn lookup_route(req: hyper::Request<hyper::body::Incoming>, sh: &ServerState) -> HttpResp {
    use crate::lookup::{lookup, LookupError, LookupRequest, MAX_BODY_BYTES};
    use http_body_util::BodyExt;
    let resp = |status: u16, body: String| {
        let ct = if status == 200 {
            "application/json"
        } else {
            "text/plain"
        };
        text(status, ct, body)
    };
    if !sh.cfg.lookup_http {
        return resp(
            404,
            "the lookup endpoint is off (server setting lookup_http)\n".into(),
        );
    }
    sh.metrics.request("lookup");
    let body = match http_body_util::Limited::new(req.into_body(), MAX_BODY_BYTES)
        .collect()
        .await
    {
        Ok(b) => b.to_bytes(),
        Err(e) => {
            return resp(
                413,
                format!("lookup request body: {e} (at most {MAX_BODY_BYTES} bytes)\n"),
            )
        }
    };
    let answer = match LookupRequest::parse(&body) {
        Ok(r) => lookup(&sh.store, sh.tier.as_deref(), &r).await,
        Err(e) => Err(e),
    };
    match answer {
        Ok(a) => resp(200, serde_json::to_string(&a).expect("json")),
        Err(LookupError::BadRequest(m)) => resp(400, format!("{m}\n")),
        Err(LookupError::Store(m)) => resp(503, format!("the store could not be asked: {m}\n")),
    }
}
