//! Learning whether an S3 endpoint offers gather, once per engine and in milliseconds.
//!
//! The probe is one plain-HTTP request, `GET /_objectcache/capabilities`, which every S3
//! server answers at once: an ObjectCache server with `200` and its capabilities as JSON
//! (`docs/protocol.md`), any other server with an S3 error (`403`, `404`, `400`, ...).
//! Sending the gather preface instead would wait on servers that stay silent until a full
//! HTTP request line arrives (moto, MinIO), which once cost every load 10 s.

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::rt::TokioIo;
use std::time::Duration;

/// The path an ObjectCache server answers with its capabilities (JSON).
pub const CAPABILITIES_PATH: &str = "/_objectcache/capabilities";

/// Largest capabilities document read, bytes (a real one is about 400 bytes).
const MAX_BODY_BYTES: usize = 64 << 10;

/// What the endpoint said.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Capabilities {
    /// An ObjectCache server offering gather over TCP; its protocol versions.
    Gather {
        /// Gather protocol versions the server speaks.
        protocol_versions: Vec<u16>,
    },
    /// An HTTP server that does not offer gather (a stock S3 server): its status code and
    /// why the answer was not a gather offer. Final for the endpoint.
    NotOffered {
        /// HTTP status of the answer.
        status: u16,
        /// What was wrong with it, for the log.
        why: String,
    },
}

/// Asks `addr` (`host:port`, plain HTTP) for its capabilities, within `timeout`.
///
/// # Errors
/// An I/O error when the endpoint cannot be reached, resets the connection or does not
/// answer within `timeout` (transient faults: the caller may ask again later).
pub async fn probe_capabilities(addr: &str, timeout: Duration) -> std::io::Result<Capabilities> {
    tokio::time::timeout(timeout, probe(addr))
        .await
        .map_err(|_| {
            std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("no answer to GET {CAPABILITIES_PATH} within {timeout:?}"),
            )
        })?
}

async fn probe(addr: &str) -> std::io::Result<Capabilities> {
    match http_get(addr, CAPABILITIES_PATH, MAX_BODY_BYTES).await? {
        (status, Ok(body)) => Ok(classify(status, &body)),
        // An answer too large for a capabilities document is not one.
        (status, Err(e)) if status != 200 => Ok(Capabilities::NotOffered {
            status,
            why: e.to_string(),
        }),
        (_, Err(e)) => Err(e),
    }
}

/// `GET path` from `addr` (`host:port`, plain HTTP/1.1, one connection): the status and the
/// body, or the error that cut the body off (longer than `max_body` bytes, a reset).
///
/// # Errors
/// An I/O error when the endpoint cannot be reached or gives no HTTP answer.
pub async fn http_get(
    addr: &str,
    path: &str,
    max_body: usize,
) -> std::io::Result<(u16, std::io::Result<Bytes>)> {
    let io_err = |e: hyper::Error| std::io::Error::other(e.to_string());
    let stream = tokio::net::TcpStream::connect(addr).await?;
    stream.set_nodelay(true)?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(io_err)?;
    let driver = tokio::spawn(conn);
    let req = hyper::Request::get(path)
        .header(hyper::header::HOST, addr)
        .header(hyper::header::CONNECTION, "close")
        .body(Empty::<Bytes>::new())
        .map_err(std::io::Error::other)?;
    let out = match sender.send_request(req).await.map_err(io_err) {
        Ok(resp) => {
            let status = resp.status().as_u16();
            let body = Limited::new(resp.into_body(), max_body)
                .collect()
                .await
                .map(|b| b.to_bytes())
                .map_err(|e| std::io::Error::other(e.to_string()));
            Ok((status, body))
        }
        Err(e) => Err(e),
    };
    driver.abort();
    out
}

/// Reads an HTTP answer to the capabilities request.
fn classify(status: u16, body: &[u8]) -> Capabilities {
    let not = |why: String| Capabilities::NotOffered { status, why };
    if status != 200 {
        return not(format!("HTTP {status} to GET {CAPABILITIES_PATH}"));
    }
    let v: serde_json::Value = match serde_json::from_slice(body) {
        Ok(v) => v,
        Err(e) => return not(format!("the answer is not JSON ({e})")),
    };
    if v.get("service").and_then(|s| s.as_str()) != Some("objectcache") {
        return not("the answer does not name the objectcache service".into());
    }
    let gather = &v["gather"];
    let tcp = gather["transports"]
        .as_array()
        .is_some_and(|t| t.iter().any(|x| x.as_str() == Some("tcp")));
    let versions: Vec<u16> = gather["protocol_versions"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|x| x.as_u64())
                .filter_map(|x| u16::try_from(x).ok())
                .collect()
        })
        .unwrap_or_default();
    if !tcp || !versions.contains(&crate::protocol::PROTOCOL_VERSION) {
        return not(format!(
            "gather over TCP at protocol version {} is not offered (versions {versions:?})",
            crate::protocol::PROTOCOL_VERSION
        ));
    }
    Capabilities::Gather {
        protocol_versions: versions,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_are_classified() {
        let ours =
            br#"{"service":"objectcache","gather":{"protocol_versions":[2],"transports":["tcp"]}}"#;
        assert_eq!(
            classify(200, ours),
            Capabilities::Gather {
                protocol_versions: vec![2]
            }
        );
        for (status, body) in [
            (404u16, &b"<Error><Code>NoSuchBucket</Code></Error>"[..]),
            (403, b""),
            (200, b"<ListBucketResult/>"),
            (200, br#"{"service":"other"}"#),
            (
                200,
                br#"{"service":"objectcache","gather":{"protocol_versions":[1],"transports":["tcp"]}}"#,
            ),
        ] {
            assert!(
                matches!(classify(status, body), Capabilities::NotOffered { .. }),
                "{status} {body:?}"
            );
        }
    }
}
