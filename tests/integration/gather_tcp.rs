//! Gather over TCP against a real in-process server on loopback: round trips byte-exact at
//! Llama-3.1-8B geometry, batched save layout, misses, corruption, concurrency, malformed and
//! oversized descriptors, disconnects, fallback detection.

use crate::common::temp_fs_store;
use crate::gather_util;

use bytes::{BufMut, BytesMut};
use gather_util::*;
use objectcache::layout::{slice_range, KvGeometry};
use objectcache::protocol::{
    encode_frame_header, ErrorCode, Frame, FrameType, GatherRequest, MAX_UNIT_BYTES, PREFACE,
};
use objectcache::store::{MemoryStore, Store, StoreExt};
use objectcache::transport::tcp::{GatherClient, GatherError};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

async fn roundtrip(store: Arc<dyn Store>, chunks: usize) {
    let g = KvGeometry::llama31_8b();
    let server = start(store.clone(), config()).await;
    let mut c = gather_client(server.local_addr()).await;
    let tokens = vec![256u32; chunks];
    let saved = save_prefix(&mut c, &g, 1, &tokens).await;
    assert_eq!(saved.written as usize, chunks);
    let req = request(&g, 1, &tokens);
    let sink = VerifySink::new(&g, 1, &tokens);
    let r = c.load(&req, &sink).await.unwrap();
    let per_layer = chunks as u64 * g.slice_bytes();
    assert_eq!(r.bytes, per_layer * 32);
    assert_eq!(
        sink.mismatches.load(Ordering::Relaxed),
        0,
        "every byte matches"
    );
    assert_eq!(sink.complete_layers(), 32);
    assert!(sink.failed_layers().is_empty());
    assert!(r.failed_layers.is_empty());
    // One gather request for the whole load, units of at most 16 MiB.
    let m = server.metrics().encode();
    assert_eq!(
        metric(&m, "objectcache_server_requests_total{op=\"gather\"}"),
        Some(1.0)
    );
    assert_eq!(r.units, 32 * per_layer.div_ceil(MAX_UNIT_BYTES as u64));
    println!(
        "gather {} tokens: {} bytes in {} units, ttfl {:?}, total {:?}",
        chunks * 256,
        r.bytes,
        r.units,
        r.ttfl.unwrap(),
        r.elapsed
    );
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gather_roundtrip_4k_tokens_8b_byte_exact() {
    roundtrip(Arc::new(MemoryStore::new()), 16).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gather_roundtrip_32k_tokens_8b_byte_exact() {
    let (_dir, store) = temp_fs_store();
    roundtrip(store, 128).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batched_save_layout_matches_the_connector() {
    // The batched save writes data at KeyBuilder::data and markers at KeyBuilder::marker,
    // with the same marker bytes as the connector's own save, so both paths interoperate.
    let g = KvGeometry::smollm2_135m();
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let server = start(store.clone(), config()).await;
    let mut c = gather_client(server.local_addr()).await;
    let tokens = [256u32, 256, 256];
    save_prefix(&mut c, &g, 9, &tokens).await;
    let kb = key_builder(&g);
    let other: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let engine = objectcache::connector::Engine::with_store(other.clone(), {
        let mut cfg = objectcache::connector::EngineConfig::default();
        cfg.set("namespace", "test").unwrap();
        cfg
    })
    .unwrap();
    for (i, h) in hashes(9, 3).iter().enumerate() {
        let data = store
            .get_bytes(&format!("{BUCKET}/{}", kb.data(h)))
            .await
            .unwrap();
        assert_eq!(
            data,
            object(&g, 9, i, 256),
            "data object {i} at KeyBuilder::data"
        );
        let marker = store
            .get_bytes(&format!("{BUCKET}/{}", kb.marker(h)))
            .await
            .unwrap();
        assert_eq!(&marker[..8], &objectcache::connector::MARKER_MAGIC);
        assert_eq!(
            u64::from_le_bytes(marker[8..16].try_into().unwrap()),
            data.len() as u64
        );
        other.put(&kb.data(h), data).await.unwrap();
        other.put(&kb.marker(h), marker).await.unwrap();
    }
    // The connector's lookup sees the batched save's markers as hits.
    assert_eq!(engine.lookup(&g, &hashes(9, 3)).await.unwrap(), 3);
    // A second save of the same prefix writes nothing new (first writer wins).
    let again = save_prefix(&mut c, &g, 9, &tokens).await;
    assert_eq!((again.written, again.already_present), (0, 3));
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partial_last_chunk_and_layer_subrange() {
    let g = KvGeometry::smollm2_135m();
    let server = start(Arc::new(MemoryStore::new()), config()).await;
    let mut c = gather_client(server.local_addr()).await;
    let tokens = [256u32, 256, 100];
    save_prefix(&mut c, &g, 3, &tokens).await;
    let mut req = request(&g, 3, &tokens);
    req.layers = 4..20;
    req.max_unit_bytes = 4096; // smaller than a slice: slices split into pieces
    let sink = VerifySink::new(&g, 3, &tokens);
    let r = c.load(&req, &sink).await.unwrap();
    assert_eq!(sink.mismatches.load(Ordering::Relaxed), 0);
    assert_eq!(sink.complete_layers(), 16);
    assert!(
        sink.done[3].load(Ordering::Relaxed) == 0 && sink.done[20].load(Ordering::Relaxed) == 0
    );
    assert!(r.units > 16 * 3);
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_chunk_and_corrupt_slice_are_misses_never_data() {
    misses_never_data(Arc::new(MemoryStore::new())).await;
}

/// The same on a directory backend: the server checks headers from its own open of each
/// chunk file and sends unverified slices straight from the files (`sendfile`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_chunk_and_corrupt_slice_are_misses_never_data_on_files() {
    let (_dir, store) = temp_fs_store();
    misses_never_data(store).await;
}

async fn misses_never_data(store: Arc<dyn Store>) {
    let g = KvGeometry::smollm2_135m();
    let server = start(store.clone(), config()).await;
    let mut c = gather_client(server.local_addr()).await;
    let tokens = [256u32; 4];
    save_prefix(&mut c, &g, 5, &tokens).await;
    let kb = key_builder(&g);
    // Corrupt one byte of chunk 2, layer 7.
    let key = format!("{BUCKET}/{}", kb.data(&hashes(5, 4)[2]));
    let mut obj = store.get_bytes(&key).await.unwrap().to_vec();
    obj[slice_range(7, g.slice_bytes()).start as usize + 10] ^= 0xff;
    store.put(&key, obj.into()).await.unwrap();
    for verify in [true, false] {
        let mut req = request(&g, 5, &tokens);
        req.verify = verify;
        let sink = VerifySink::new(&g, 5, &tokens);
        let r = c.load(&req, &sink).await.unwrap();
        assert_eq!(sink.failed_layers(), vec![7], "verify={verify}");
        assert_eq!(r.failed_layers, vec![7]);
        assert_eq!(sink.complete_layers(), g.layers as usize - 1);
        // With server-side verification the corrupt slice never reaches the client (a
        // miss); without, its unit lands in the destination (payloads are read straight into
        // it) but fails the client's CRC check, so layer 7 is failed, never completed (above).
        let bad_writes = sink.mismatches.load(Ordering::Relaxed);
        if verify {
            assert_eq!(bad_writes, 0, "verify={verify}");
        }
    }
    // A missing chunk is a per-chunk miss: every layer misses (it lacks chunk 1's slice),
    // the server names chunk 1 once, and the other chunks' slices are still delivered, byte
    // for byte, into every layer.
    store
        .delete(&format!("{BUCKET}/{}", kb.data(&hashes(5, 4)[1])))
        .await
        .unwrap();
    let sink = VerifySink::new(&g, 5, &tokens);
    let r = c.load(&request(&g, 5, &tokens), &sink).await.unwrap();
    // (Chunk 2's corrupt layer-7 slice is still there: with server-side verification it is
    // a (chunk 2, layer 7) miss of its own.)
    assert_eq!(
        r.missed_chunks[0],
        (1, objectcache::protocol::MissReason::NotFound)
    );
    assert!(r.missed_chunks[1..]
        .iter()
        .all(|m| *m == (2, objectcache::protocol::MissReason::ChecksumMismatch)));
    assert_eq!(sink.failed_layers().len(), g.layers as usize);
    assert!(sink
        .failed
        .lock()
        .unwrap()
        .iter()
        .all(|(_, e)| matches!(e, objectcache::LayerError::Missing { chunk: 1, .. })));
    let slice = g.slice_bytes();
    // Every layer but 7 got chunks 0, 2 and 3 whole.
    for l in 0..g.layers as usize {
        let want = if l == 7 { 0 } else { 3 * slice };
        assert!(
            sink.done[l].load(Ordering::Relaxed) >= want,
            "layer {l}: {} bytes",
            sink.done[l].load(Ordering::Relaxed)
        );
        assert!(
            sink.done[l].load(Ordering::Relaxed) <= 3 * slice,
            "layer {l}"
        );
    }
    assert_eq!(
        r.bytes,
        sink.done
            .iter()
            .map(|d| d.load(Ordering::Relaxed))
            .sum::<u64>()
    );
    assert_eq!(sink.mismatches.load(Ordering::Relaxed), 0);
    // Wrong geometry under the right key (case C3's kind): a geometry miss.
    let g2 = g.with_dtype(objectcache::Dtype::Fp32);
    store
        .put(
            &format!("{BUCKET}/{}", kb.data(&hashes(5, 4)[1])),
            object(&g2, 5, 1, 256),
        )
        .await
        .unwrap();
    let sink = VerifySink::new(&g, 5, &tokens);
    c.load(&request(&g, 5, &tokens), &sink).await.unwrap();
    assert!(matches!(
        sink.failed.lock().unwrap()[0].1,
        objectcache::LayerError::GeometryMismatch { chunk: 1, .. }
    ));
    // A truncated object (its header intact, its size short of what the header says): a
    // geometry miss of that chunk too, never its bytes.
    let whole = object(&g, 5, 1, 256);
    store
        .put(
            &format!("{BUCKET}/{}", kb.data(&hashes(5, 4)[1])),
            whole.slice(..whole.len() / 2),
        )
        .await
        .unwrap();
    let sink = VerifySink::new(&g, 5, &tokens);
    c.load(&request(&g, 5, &tokens), &sink).await.unwrap();
    {
        let failed = sink.failed.lock().unwrap();
        assert_eq!(failed.len(), g.layers as usize);
        assert!(failed.iter().all(|(_, e)| matches!(
            e,
            objectcache::LayerError::GeometryMismatch { chunk: 1, .. }
        )));
    }
    assert_eq!(sink.mismatches.load(Ordering::Relaxed), 0);
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_loads_with_admission_queue() {
    let g = KvGeometry::llama31_8b();
    let mut cfg = config();
    cfg.max_concurrent_loads = 2;
    let server = start(Arc::new(MemoryStore::new()), cfg).await;
    let tokens = vec![256u32; 4];
    let mut c = gather_client(server.local_addr()).await;
    for s in 0..3 {
        save_prefix(&mut c, &g, 100 + s, &tokens).await;
    }
    let addr = server.local_addr();
    for t in spawn_verified_loads(addr, &g, &tokens, &[100, 101, 102], 8) {
        let (mismatches, complete, _) = t.await.unwrap();
        assert_eq!((mismatches, complete), (0, 32));
    }
    server.shutdown().await;
}

/// A raw connection past the hello and the authentication challenge.
async fn raw_conn(addr: std::net::SocketAddr) -> tokio::net::TcpStream {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut b = BytesMut::new();
    b.put_slice(&PREFACE);
    Frame::Hello {
        version_min: objectcache::protocol::PROTOCOL_VERSION,
        version_max: objectcache::protocol::PROTOCOL_VERSION,
    }
    .encode(&mut b);
    s.write_all(&b).await.unwrap();
    let mut buf = BytesMut::new();
    loop {
        while let Some(f) =
            objectcache::protocol::decode_frame(&mut buf, 1 << 24, u32::MAX).unwrap()
        {
            match f {
                Frame::AuthChallenge { nonce } => {
                    let mut b = BytesMut::new();
                    Frame::Auth {
                        access_key: ACCESS.into(),
                        mac: objectcache::protocol::auth::auth_mac(ACCESS, SECRET, &nonce),
                    }
                    .encode(&mut b);
                    s.write_all(&b).await.unwrap();
                }
                Frame::HelloAck(_) => return s,
                other => panic!("unexpected {other:?} during the handshake"),
            }
        }
        assert!(
            s.read_buf(&mut buf).await.unwrap() > 0,
            "closed during the handshake"
        );
    }
}

/// Reads frames until an Error frame; returns its code and message.
async fn read_error(s: &mut tokio::net::TcpStream) -> (ErrorCode, String) {
    let mut buf = BytesMut::new();
    loop {
        while let Some(f) =
            objectcache::protocol::decode_frame(&mut buf, 1 << 24, u32::MAX).unwrap()
        {
            if let Frame::Error { code, message } = f {
                return (code, message);
            }
        }
        assert!(
            s.read_buf(&mut buf).await.unwrap() > 0,
            "connection closed without an error frame"
        );
    }
}

/// Sends `bytes` on a new authenticated connection to `addr`; the code and message of the
/// error frame the server answers with.
async fn error_for(addr: std::net::SocketAddr, bytes: &[u8]) -> (ErrorCode, String) {
    let mut s = raw_conn(addr).await;
    s.write_all(bytes).await.unwrap();
    read_error(&mut s).await
}

/// `r` as a gather frame.
fn gather_frame(r: GatherRequest) -> BytesMut {
    let mut b = BytesMut::new();
    Frame::Gather(Box::new(r)).encode(&mut b);
    b
}

/// Makes `r` one chunk of 2^16 tokens at 1 MiB per token per layer (64 GiB slices) over
/// `layers` layers: within every per-field limit.
fn huge_chunk(r: &mut GatherRequest, layers: u32) {
    r.geometry.bytes_per_token_per_layer = 1 << 20;
    r.geometry.tokens_per_chunk = 1 << 16;
    r.geometry.layers = layers;
    r.layers = 0..layers;
    r.chunk_tokens = vec![1 << 16];
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_and_oversized_descriptors_get_clear_errors_and_the_server_stays_up() {
    let g = KvGeometry::smollm2_135m();
    let mut cfg = config();
    cfg.max_chunks = 8;
    cfg.max_descriptor_bytes = 4096;
    let server = start(Arc::new(MemoryStore::new()), cfg).await;
    let addr = server.local_addr();

    // Garbage body.
    let mut b = BytesMut::new();
    encode_frame_header(FrameType::Gather, 5, &mut b);
    b.put_slice(b"hello");
    let (code, msg) = error_for(addr, &b).await;
    assert_eq!(code, ErrorCode::Malformed);
    assert!(msg.contains("truncated gather descriptor"), "{msg}");

    // Descriptor larger than the limit: refused from its header, before the body.
    let mut b = BytesMut::new();
    encode_frame_header(FrameType::Gather, 1 << 20, &mut b);
    let (code, msg) = error_for(addr, &b).await;
    assert_eq!(code, ErrorCode::DescriptorTooLarge);
    assert!(
        msg.contains("descriptor size is 1048576, above the limit of 4096"),
        "{msg}"
    );

    // Too many chunks (the client library refuses this itself; send it raw).
    let tokens = vec![256u32; 9];
    let (code, msg) = error_for(addr, &gather_frame(request(&g, 1, &tokens))).await;
    assert_eq!(code, ErrorCode::TooManyChunks);
    assert!(
        msg.contains("chunks per request is 9, above the limit of 8"),
        "{msg}"
    );

    // The client library refuses it locally with the same words.
    let mut c = gather_client(addr).await;
    let e = c
        .load(&request(&g, 1, &tokens), &VerifySink::new(&g, 1, &tokens))
        .await
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("chunks per request is 9, above the limit of 8"),
        "{e}"
    );

    // Hostile sizes (issue 16): each field is refused by name before anything is allocated
    // or planned. 2^24 bytes per token, tokens per chunk and tokens once made the server
    // allocate about 24 GB for its unit plan.
    let hostile = |f: &dyn Fn(&mut GatherRequest)| {
        let mut r = request(&g, 1, &[256]);
        f(&mut r);
        gather_frame(r)
    };
    let cases: Vec<(BytesMut, ErrorCode, &str)> = vec![
        (
            hostile(&|r| {
                r.geometry.bytes_per_token_per_layer = 1 << 24;
                r.geometry.tokens_per_chunk = 1 << 24;
                r.chunk_tokens = vec![1 << 24];
            }),
            ErrorCode::Malformed,
            "geometry.bytes_per_token_per_layer: 16777216 (allowed 1..=1048576)",
        ),
        (
            hostile(&|r| {
                r.geometry.tokens_per_chunk = 1 << 24;
                r.chunk_tokens = vec![1 << 24];
            }),
            ErrorCode::Malformed,
            "geometry.tokens_per_chunk: 16777216 (allowed 1..=65536)",
        ),
        (
            // Within every per-field limit, but 4,096 layers of 64 GiB slices in 4 KiB units.
            hostile(&|r| {
                huge_chunk(r, 4096);
                r.max_unit_bytes = 4096;
            }),
            ErrorCode::Malformed,
            "delivery units per request is 68719480832, above the limit of 2097152",
        ),
        (
            // A plannable request whose objects could not be stored here (64 GiB each).
            hostile(&|r| huge_chunk(r, 1)),
            ErrorCode::MemoryLimit,
            "above this server's max_object_bytes",
        ),
    ];
    for (frame, want_code, want_msg) in cases {
        let (code, msg) = error_for(addr, &frame).await;
        assert_eq!(code, want_code, "{msg}");
        assert!(msg.contains(want_msg), "{msg}");
    }

    // Unknown frame type, HTTP garbage on the gather port: errors, no crash.
    let (code, msg) = error_for(addr, &[0x7f, 0, 0, 0, 0, 0, 0, 0]).await;
    assert_eq!(
        (code, msg.as_str()),
        (ErrorCode::Malformed, "unknown frame type 0x7f")
    );

    // A missing bucket is a request-level error; the connection stays usable.
    let mut c = gather_client(addr).await;
    let mut req = request(&g, 1, &[256]);
    req.bucket = "no-such-bucket".into();
    match c.load(&req, &VerifySink::new(&g, 1, &[256])).await {
        Err(GatherError::Remote {
            code: ErrorCode::NoSuchBucket,
            ..
        }) => {}
        other => panic!("{other:?}"),
    }
    // The server still serves.
    save_prefix(&mut c, &g, 1, &[256]).await;
    let sink = VerifySink::new(&g, 1, &[256]);
    c.load(&request(&g, 1, &[256]), &sink).await.unwrap();
    assert_eq!(sink.complete_layers(), g.layers as usize);
    let (st, body) = http_get(addr, "/_objectcache/health").await;
    assert_eq!((st, body.as_str()), (200, "ok\n"));
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnecting_mid_stream_frees_resources() {
    let g = KvGeometry::llama31_8b();
    let server = start(Arc::new(MemoryStore::new()), config()).await;
    let addr = server.local_addr();
    let tokens = vec![256u32; 32]; // 8K tokens: 32 MiB per layer, 1 GiB per load
    let mut c = gather_client(addr).await;
    save_prefix(&mut c, &g, 7, &tokens).await;
    // A raw client that reads a little and then vanishes.
    let mut s = raw_conn(addr).await;
    s.write_all(&gather_frame(request(&g, 7, &tokens)))
        .await
        .unwrap();
    let mut got = vec![0u8; 1 << 20];
    s.read_exact(&mut got).await.unwrap();
    drop(s);
    // The server notices, drops the load and its buffers.
    let mut freed = false;
    for _ in 0..200 {
        let m = server.metrics().encode();
        if metric(&m, "objectcache_server_active_loads") == Some(0.0)
            && metric(&m, "objectcache_server_inflight_bytes") == Some(0.0)
        {
            freed = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert!(
        freed,
        "load still active after the client left:\n{}",
        server.metrics().encode()
    );
    assert!(
        metric(
            &server.metrics().encode(),
            "objectcache_server_errors_total{kind=\"client_gone\"}"
        ) >= Some(1.0)
    );
    // A cancel through the client library stops the load and keeps the connection usable.
    let mut sink = VerifySink::new(&g, 7, &tokens);
    sink.cancel_after = 3;
    match c.load(&request(&g, 7, &tokens), &sink).await {
        Err(GatherError::Cancelled) => {}
        other => panic!("{other:?}"),
    }
    let sink = VerifySink::new(&g, 7, &tokens[..4]);
    c.load(&request(&g, 7, &tokens[..4]), &sink).await.unwrap();
    assert_eq!(sink.complete_layers(), 32);
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stock_s3_endpoint_is_detected_for_fallback() {
    // Something that answers HTTP, as a stock S3 server does to an unknown preface.
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        let (mut s, _) = l.accept().await.unwrap();
        let mut b = [0u8; 64];
        let _ = s.read(&mut b).await;
        let _ = s
            .write_all(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
            .await;
    });
    match GatherClient::connect_with(addr, creds()).await {
        Err(GatherError::NotOffered(m)) => assert!(m.contains("gather hello"), "{m}"),
        other => panic!("{other:?}"),
    }
    // And our server offers it, also through its capability endpoint.
    let server = start(Arc::new(MemoryStore::new()), config()).await;
    let (st, body) = http_get(server.local_addr(), "/_objectcache/capabilities").await;
    assert_eq!(st, 200);
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        v["gather"]["protocol_versions"][0],
        objectcache::protocol::PROTOCOL_VERSION
    );
    assert_eq!(v["gather"]["authentication"], "hmac-sha256");
    server.shutdown().await;
}

/// The gather endpoint authenticates with the server's S3 access keys: a wrong secret, an
/// unknown key id and no credentials are refused with a clear error before any request; the
/// right pair works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gather_connection_needs_a_valid_access_key() {
    let g = KvGeometry::smollm2_135m();
    let server = start(Arc::new(MemoryStore::new()), config()).await;
    let addr = server.local_addr();
    for (creds, what) in [
        (
            Some((ACCESS.to_string(), "wrong-secret".to_string())),
            "wrong secret",
        ),
        (
            Some(("nobody".to_string(), SECRET.to_string())),
            "unknown key id",
        ),
        (None, "no credentials"),
    ] {
        match GatherClient::connect_with(addr, creds).await {
            Err(GatherError::Unauthorized(m)) => {
                assert!(m.contains("authentication"), "{what}: {m}")
            }
            other => panic!("{what}: expected Unauthorized, got {other:?}"),
        }
    }
    // A raw version-2 client that skips the challenge and sends a request is refused too.
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut b = BytesMut::new();
    b.put_slice(&PREFACE);
    Frame::Hello {
        version_min: 2,
        version_max: 2,
    }
    .encode(&mut b);
    Frame::Gather(Box::new(request(&g, 1, &[256]))).encode(&mut b);
    s.write_all(&b).await.unwrap();
    let mut got = Vec::new();
    let _ = s.read_to_end(&mut got).await;
    let mut buf = BytesMut::from(&got[..]);
    let mut saw_error = false;
    while let Ok(Some(f)) = objectcache::protocol::decode_frame(&mut buf, 1 << 20, 4096) {
        match f {
            Frame::AuthChallenge { .. } => {}
            Frame::Error { code, .. } => {
                assert_eq!(code, ErrorCode::Malformed);
                saw_error = true;
            }
            other => panic!("unexpected {other:?} before authentication"),
        }
    }
    assert!(saw_error, "the server answered an unauthenticated request");
    // The right key pair: connected, authenticated, and a save and a load work.
    let mut c = gather_client(addr).await;
    assert_ne!(
        c.server_info().features & objectcache::protocol::ServerInfo::FEATURE_AUTH,
        0
    );
    let tokens = [256u32, 256];
    save_prefix(&mut c, &g, 11, &tokens).await;
    let sink = VerifySink::new(&g, 11, &tokens);
    let r = c.load(&request(&g, 11, &tokens), &sink).await.unwrap();
    assert!(r.failed_layers.is_empty());
    assert_eq!(sink.complete_layers(), g.layers as usize);
    assert_eq!(sink.mismatches.load(Ordering::Relaxed), 0);
    server.shutdown().await;
}
