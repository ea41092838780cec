//! Gather connections that hold the server without using it (issue 16), against a real
//! in-process server on loopback with short limits: a handshake never finished, an idle
//! connection, a save that stalls or drips, a load whose client stops reading. Each is
//! closed within its limit and gives back every byte of the memory budget; a save that was
//! cut writes nothing; save data is held under the budget as it arrives, never reserved by
//! its declared size.

use crate::gather_util;
use crate::hostile_util;

use bytes::BytesMut;
use gather_util::*;
use hostile_util::closed_within;
use objectcache::layout::KvGeometry;
use objectcache::protocol::{
    ClientConnection, ClientEvent, SaveChunk, SaveRequest, WireGeometry, PREFACE,
};
use objectcache::server::ServerConfig;
use objectcache::store::{FsStore, FsyncPolicy, MemoryStore, Store};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const LIMIT: u64 = 1; // handshake, client timeout
const IDLE: u64 = 2;

fn cfg() -> ServerConfig {
    ServerConfig {
        handshake_timeout_secs: LIMIT,
        client_timeout_secs: LIMIT,
        idle_timeout_secs: IDLE,
        min_client_bytes_per_s: 1 << 20,
        max_request_bytes: 64 << 20,
        memory_budget_bytes: 64 << 20,
        ..config()
    }
}

/// Writes on `s` every frame that `c` has to send.
async fn transmit(s: &mut TcpStream, c: &mut ClientConnection) {
    while let Some(b) = c.poll_transmit() {
        s.write_all(&b).await.unwrap();
    }
}

/// An authenticated raw gather connection: the stream and its protocol state.
async fn authenticated(addr: SocketAddr) -> (TcpStream, ClientConnection) {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let mut c = ClientConnection::with_credentials(creds());
    let mut buf = BytesMut::new();
    loop {
        transmit(&mut s, &mut c).await;
        if let Some(ev) = c.poll_event() {
            assert!(matches!(ev, ClientEvent::Connected(_)), "{ev:?}");
            return (s, c);
        }
        assert!(
            s.read_buf(&mut buf).await.unwrap() > 0,
            "server closed during the handshake"
        );
        c.handle_bytes(&mut buf).unwrap();
    }
}

async fn inflight(server: &objectcache::server::ServerHandle) -> f64 {
    metric(
        &server.metrics().encode(),
        "objectcache_server_inflight_bytes",
    )
    .unwrap_or(-1.0)
}

/// Waits until the server holds no memory under its budget.
async fn budget_back(server: &objectcache::server::ServerHandle) {
    let t0 = Instant::now();
    while inflight(server).await != 0.0 {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "budget still held: {}",
            inflight(server).await
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handshakes_must_finish_and_idle_connections_close() {
    let _alone = crate::alone();
    let server = start(Arc::new(MemoryStore::new()), cfg()).await;
    let addr = server.local_addr();
    let bound = Duration::from_secs(LIMIT + 3);
    // Part of the preface, held: closed at the handshake deadline.
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(&PREFACE[..5]).await.unwrap();
    let t = closed_within(&mut s, bound)
        .await
        .expect("partial preface held open");
    assert!(
        t >= Duration::from_millis(LIMIT * 1000 - 100),
        "closed early: {t:?}"
    );
    // Part of the preface, then FIN: closed at once.
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(&PREFACE[..5]).await.unwrap();
    s.shutdown().await.unwrap();
    let t = closed_within(&mut s, bound)
        .await
        .expect("half-closed connection kept");
    assert!(t < Duration::from_millis(500), "{t:?}");
    // Preface and hello, then no answer to the authentication challenge.
    let mut s = TcpStream::connect(addr).await.unwrap();
    let mut c = ClientConnection::with_credentials(creds());
    transmit(&mut s, &mut c).await;
    let t = closed_within(&mut s, bound)
        .await
        .expect("unanswered challenge held open");
    assert!(
        t >= Duration::from_millis(LIMIT * 1000 - 100),
        "closed early: {t:?}"
    );
    // Authenticated and idle: closed after the idle timeout, not before.
    let (mut s, _) = authenticated(addr).await;
    let t0 = Instant::now();
    let t = closed_within(&mut s, Duration::from_secs(IDLE + 3))
        .await
        .expect("idle connection kept");
    assert!(
        t0.elapsed() >= Duration::from_millis(IDLE * 1000 - 100),
        "idle connection closed after {t:?}"
    );
    let m = server.metrics().encode();
    assert!(
        metric(&m, "objectcache_server_errors_total{kind=\"handshake\"}").unwrap_or(0.0) >= 2.0,
        "{m}"
    );
    println!("GATHERFRONT|partial preface held; partial preface then FIN; challenge unanswered; authenticated idle|closed at the {LIMIT} s handshake deadline; at once; at the deadline; after the {IDLE} s idle timeout");
    server.shutdown().await;
}

fn save_request(g: &KvGeometry, seed: u64, n: usize) -> SaveRequest {
    SaveRequest {
        request_id: seed,
        bucket: BUCKET.into(),
        prefix: key_builder(g).prefix().to_string(),
        geometry: WireGeometry::from_geometry(g),
        chunks: hashes(seed, n)
            .into_iter()
            .map(|hash| SaveChunk { hash, tokens: 256 })
            .collect(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_save_that_stalls_or_drips_is_dropped_and_writes_nothing() {
    let _alone = crate::alone();
    let dir = tempfile::tempdir().unwrap();
    let store: Arc<dyn Store> = Arc::new(FsStore::new(dir.path(), FsyncPolicy::Never).unwrap());
    let server = start(store.clone(), cfg()).await;
    let addr = server.local_addr();
    // Llama-3.1-8B: a 32 MiB object per chunk.
    let g = KvGeometry::llama31_8b();
    for drip in [false, true] {
        let (mut s, mut c) = authenticated(addr).await;
        let req = save_request(&g, 40 + drip as u64, 1);
        let obj = object(&g, 40 + drip as u64, 0, 256);
        c.start_save(&req).unwrap();
        // The first 8 MiB at once (held under the budget as it arrives, then written).
        c.save_data(0, 0, obj.slice(..8 << 20)).unwrap();
        transmit(&mut s, &mut c).await;
        let t0 = Instant::now();
        let closed = if drip {
            // Then 1 KiB every 100 ms (10 KiB/s, the floor is 1 MiB/s).
            let (mut rd, mut wr) = s.into_split();
            let mut off = 8 << 20;
            let w = tokio::spawn(async move {
                loop {
                    let mut b = BytesMut::new();
                    let data = obj.slice(off as usize..off as usize + 1024);
                    objectcache::protocol::Frame::SaveData(objectcache::protocol::SaveData {
                        chunk: 0,
                        offset: off,
                        data,
                    })
                    .encode(&mut b);
                    if wr.write_all(&b).await.is_err() || t0.elapsed() > Duration::from_secs(10) {
                        break;
                    }
                    off += 1024;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            });
            let mut b = vec![0u8; 1 << 16];
            let t = loop {
                match tokio::time::timeout(Duration::from_secs(LIMIT * 2 + 4), rd.read(&mut b))
                    .await
                {
                    Ok(Ok(0)) | Ok(Err(_)) => break Some(t0.elapsed()),
                    Ok(Ok(_)) => {}
                    Err(_) => break None,
                }
            };
            w.abort();
            t
        } else {
            closed_within(&mut s, Duration::from_secs(LIMIT * 2 + 4)).await
        };
        let t = closed.unwrap_or_else(|| {
            panic!(
                "a {} save held its connection",
                if drip { "dripping" } else { "stalled" }
            )
        });
        println!(
            "GATHERFRONT|save {}|closed {:.1} s after the client slowed; nothing written; budget given back",
            if drip { "dripping 10 KiB/s after 8 MiB" } else { "stalled after 8 MiB" },
            t.as_secs_f64()
        );
        budget_back(&server).await;
        let kb = key_builder(&g);
        let h = &req.chunks[0].hash;
        assert!(!objectcache::store::StoreExt::exists(
            store.as_ref(),
            &format!("{BUCKET}/{}", kb.data(h))
        )
        .await
        .unwrap());
        assert!(
            store.list_partial("").await.unwrap().is_empty(),
            "a cut save left a temporary file"
        );
    }
    // A whole save still works, and held at most what was in flight, never the whole object.
    let mut c = gather_client(addr).await;
    let tokens = [256u32; 4];
    save_prefix(&mut c, &g, 77, &tokens).await;
    let sink = VerifySink::new(&g, 77, &tokens);
    c.load(&request(&g, 77, &tokens), &sink).await.unwrap();
    assert_eq!(
        sink.mismatches.load(std::sync::atomic::Ordering::Relaxed),
        0
    );
    budget_back(&server).await;
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_whose_client_stops_reading_is_dropped_and_its_read_ahead_freed() {
    let _alone = crate::alone();
    let server = start(Arc::new(MemoryStore::new()), cfg()).await;
    let addr = server.local_addr();
    let g = KvGeometry::llama31_8b();
    let tokens = [256u32; 4]; // 128 MiB per load
    let mut c = gather_client(addr).await;
    save_prefix(&mut c, &g, 9, &tokens).await;
    drop(c);
    let (mut s, mut c) = authenticated(addr).await;
    c.start_gather(&request(&g, 9, &tokens)).unwrap();
    transmit(&mut s, &mut c).await;
    // Never read: the server fills the socket, then waits on a client that takes nothing.
    let t0 = Instant::now();
    let t0s = loop {
        let m = server.metrics().encode();
        if metric(
            &m,
            "objectcache_server_errors_total{kind=\"client_timeout\"}",
        )
        .unwrap_or(0.0)
            >= 1.0
        {
            break t0.elapsed();
        }
        assert!(
            t0.elapsed() < Duration::from_secs(LIMIT * 3 + 10),
            "the load was never dropped"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    budget_back(&server).await;
    assert!(closed_within(&mut s, Duration::from_secs(10))
        .await
        .is_some());
    println!("GATHERFRONT|load of 128 MiB whose client never reads|dropped {:.1} s after the request; read-ahead memory given back", t0s.as_secs_f64());
    // The connection slot went back too: a new load runs.
    let mut c = gather_client(addr).await;
    let sink = VerifySink::new(&g, 9, &tokens);
    c.load(&request(&g, 9, &tokens), &sink).await.unwrap();
    assert_eq!(sink.complete_layers(), 32);
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn save_requests_past_the_limits_are_refused_before_any_data() {
    let _alone = crate::alone();
    let server = start(Arc::new(MemoryStore::new()), cfg()).await;
    let addr = server.local_addr();
    let g = KvGeometry::llama31_8b();
    let huge = {
        let mut r = save_request(&g, 1, 1);
        r.geometry.layers = 4096;
        r.geometry.bytes_per_token_per_layer = objectcache::protocol::MAX_BYTES_PER_TOKEN_PER_LAYER;
        r.geometry.tokens_per_chunk = objectcache::protocol::MAX_TOKENS_PER_CHUNK;
        r.chunks[0].tokens = objectcache::protocol::MAX_TOKENS_PER_CHUNK;
        r
    };
    let climbing = {
        let mut r = save_request(&g, 2, 1);
        r.prefix = "../../etc/".into();
        r
    };
    for (req, want, says) in [
        (
            huge,
            objectcache::protocol::ErrorCode::MemoryLimit,
            "above max_request_bytes",
        ),
        (
            climbing,
            objectcache::protocol::ErrorCode::Malformed,
            "makes invalid object keys",
        ),
    ] {
        let (mut s, mut c) = authenticated(addr).await;
        c.start_save(&req).unwrap();
        transmit(&mut s, &mut c).await;
        let mut buf = BytesMut::new();
        let (code, message) = loop {
            assert!(
                s.read_buf(&mut buf).await.unwrap() > 0,
                "closed without an error frame"
            );
            let _ = c.handle_bytes(&mut buf);
            if let Some(ClientEvent::Error { code, message }) = c.poll_event() {
                break (code, message);
            }
        };
        assert_eq!(code, want, "{message}");
        assert!(message.contains(says), "{message}");
        assert!(inflight(&server).await == 0.0);
    }
    server.shutdown().await;
}
