//! TLS for the server's listener (rustls on ring): the S3 API is served over TLS when
//! `tls_cert` and `tls_key` are set. A client that speaks plaintext to a TLS listener gets a
//! plain HTTP 400 whose S3 error says to use `https://`, not a silent hang-up.
//!
//! Gather is not offered over TLS yet (its connection handler takes a plain TCP stream): a
//! gather preface inside TLS is answered by the HTTP side, which the connector reads as
//! "gather not offered" and uses ranged GETs; the connector does not probe `https://`
//! endpoints for gather at all.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::TlsAcceptor;

/// Longest a TLS handshake may take before the connection is dropped.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// First byte of every TLS record carrying a handshake (RFC 8446 section 5.1,
/// `ContentType.handshake` = 22).
const TLS_HANDSHAKE: u8 = 0x16;

/// Builds the acceptor from a PEM certificate chain and a PEM private key (PKCS#8, PKCS#1 or
/// SEC1).
///
/// # Errors
/// [`objectcache_client::Error::Config`] naming the file that cannot be read or parsed, or the key that
/// does not match the certificate.
pub fn acceptor(cert: &Path, key: &Path) -> objectcache_client::Result<TlsAcceptor> {
    let bad = |what: &str, p: &Path, e: String| {
        objectcache_client::Error::Config(format!("tls_{what} {}: {e}", p.display()))
    };
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
        .map_err(|e| bad("cert", cert, e.to_string()))?
        .collect::<Result<_, _>>()
        .map_err(|e| bad("cert", cert, e.to_string()))?;
    if certs.is_empty() {
        return Err(bad("cert", cert, "no PEM certificate in the file".into()));
    }
    let key_der = PrivateKeyDer::from_pem_file(key).map_err(|e| bad("key", key, e.to_string()))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| objectcache_client::Error::Config(format!("tls: {e}")))?
        .with_no_client_auth()
        .with_single_cert(certs, key_der)
        .map_err(|e| bad("key", key, format!("does not fit tls_cert: {e}")))?;
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(cfg)))
}

/// Accepts TLS on `stream`. A client that starts with anything but a TLS handshake (plain
/// HTTP, a plaintext gather preface) gets an HTTP 400 with an S3 `InvalidRequest` error
/// saying the endpoint needs `https://`, and the connection is closed; `None` then, and on a
/// failed or slow handshake.
pub async fn accept(
    acceptor: &TlsAcceptor,
    stream: TcpStream,
) -> Option<tokio_rustls::server::TlsStream<TcpStream>> {
    let mut first = [0u8; 1];
    match tokio::time::timeout(HANDSHAKE_TIMEOUT, stream.peek(&mut first)).await {
        Ok(Ok(1)) => {}
        _ => return None,
    }
    if first[0] != TLS_HANDSHAKE {
        refuse_plaintext(stream).await;
        return None;
    }
    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
        Ok(Ok(s)) => Some(s),
        Ok(Err(e)) => {
            tracing::debug!(error = %e, "TLS handshake failed");
            None
        }
        Err(_) => None,
    }
}

async fn refuse_plaintext(mut stream: TcpStream) {
    use tokio::io::AsyncReadExt;
    // Read the request first (closing with unread bytes would reset the connection before
    // the client reads the answer).
    let mut buf = vec![0u8; 16 << 10];
    let mut seen = Vec::new();
    while !seen.windows(4).any(|w| w == b"\r\n\r\n") && seen.len() < (64 << 10) {
        match tokio::time::timeout(Duration::from_millis(500), stream.read(&mut buf)).await {
            Ok(Ok(n)) if n > 0 => seen.extend_from_slice(&buf[..n]),
            _ => break,
        }
    }
    let body = "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>InvalidRequest</Code>\
<Message>this endpoint requires TLS: use https://</Message></Error>";
    let resp = format!(
        "HTTP/1.1 400 Bad Request\r\nContent-Type: application/xml\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = stream.write_all(resp.as_bytes()).await;
    let _ = stream.shutdown().await;
    // Drain what else comes (a request body) until the client closes, briefly.
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        while matches!(stream.read(&mut buf).await, Ok(n) if n > 0) {}
    })
    .await;
}
