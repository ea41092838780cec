//! The connector picks its data path by capability: one gather request per load where the
//! store's endpoint is an ObjectCache server, ranged GETs where it is a stock S3 server (Ceph
//! RGW) or where gather is switched off — the same API and the same bytes either way.
#![cfg(feature = "s3")]

use crate::common;
use crate::common::shared_rt as rt;
use crate::gather_util;

use common::{
    assert_every_layer_misses, assert_layers_exact, engine_with, hashes, save_prefix, start_load,
    temp_fs_store, unique_ns,
};
use gather_util::{config, start, BUCKET};
use objectcache::connector::{ChunkStatus, Engine, EngineConfig, LayerBuffers, LoadRequest};
use objectcache::layout::{segment_digest, SegmentHeader};
use objectcache::server::ServerHandle;
use objectcache::store::Store;
use objectcache::KvGeometry;
use std::sync::Arc;

fn s3_on(endpoint: &str) -> Arc<dyn Store> {
    rt().block_on(gather_util::s3_store_on(endpoint))
}

/// An engine with default settings (gather on) over `store`, in a fresh namespace.
fn engine(store: Arc<dyn Store>, ns: &str) -> Engine {
    common::engine(store, &unique_ns(ns))
}

/// A server over an FS store in a new temporary directory (kept as long as the server runs)
/// and an S3 store on it.
fn fs_server() -> (tempfile::TempDir, ServerHandle, Arc<dyn Store>) {
    let (dir, backend) = temp_fs_store();
    let server = rt().block_on(start(backend, config()));
    let store = s3_on(&server.endpoint());
    (dir, server, store)
}

/// Saves `chunks` chunks through `e`, loads them back, checks every byte; returns requests.
fn save_and_load(e: &Engine, g: &KvGeometry, chunks: usize, seed: u64) -> u64 {
    let (hs, data) = save_prefix(e, g, chunks, seed);
    assert_eq!(e.lookup_blocking(g, &hs).unwrap(), chunks);
    let h = start_load(e, g, hs, data[0].len());
    assert_layers_exact(&h, &data);
    assert!(h.chunk_status().iter().all(|s| *s == ChunkStatus::Ok));
    let st = h.stats();
    assert_eq!(st.bytes, chunks as u64 * g.slice_bytes() * g.layers as u64);
    st.requests
}

/// The load's per-chunk status once no chunk is pending (the chunks not named by a miss are
/// marked whole when the stream ends, which may come after the last layer settles); gives up
/// after 60 s and returns what it has.
fn settled_chunk_status(h: &objectcache::connector::LoadHandle) -> Vec<ChunkStatus> {
    let t = std::time::Instant::now();
    while h.chunk_status().contains(&ChunkStatus::Pending)
        && t.elapsed() < std::time::Duration::from_secs(60)
    {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    h.chunk_status()
}

/// Of a 4-chunk load over the default 2 gather streams, only chunk 2 (in the second stream,
/// so its number was shifted back to the load's) is `bad`; no ranged-GET fallback.
fn assert_only_chunk_2_bad(h: &objectcache::connector::LoadHandle, bad: ChunkStatus) {
    assert_eq!(
        settled_chunk_status(h),
        vec![ChunkStatus::Ok, ChunkStatus::Ok, bad, ChunkStatus::Ok]
    );
    assert_eq!(
        h.stats().requests,
        2,
        "one gather request per stream (2 streams by default), no fallback"
    );
}

/// Every layer of `h` but layer 5 arrives byte-exact (`data`); layer 5 is a checksum miss
/// naming chunk 2 (a byte flipped in that slice), and is never exposed.
fn assert_only_layer_5_of_chunk_2_corrupt(
    h: &objectcache::connector::LoadHandle,
    data: &[Vec<u8>],
) {
    for (l, want) in data.iter().enumerate() {
        match h.wait_layer_blocking(l, None) {
            Ok(()) => {
                assert_ne!(l, 5, "the corrupt layer must never be ready");
                assert_eq!(h.layer(l).unwrap(), &want[..], "layer {l}");
            }
            Err(err) => {
                assert_eq!(l, 5, "only layer 5 misses: {err:?}");
                assert!(
                    matches!(
                        err,
                        objectcache::LayerError::ChecksumMismatch {
                            chunk: 2,
                            layer: 5,
                            ..
                        }
                    ),
                    "{err:?}"
                );
                assert!(h.layer(l).is_none());
            }
        }
    }
}

#[test]
fn gather_where_offered_ranged_gets_where_off() {
    let (_dir, server, store) = fs_server();
    let g = KvGeometry::llama31_8b();
    // 1K tokens at 8B geometry: 4 chunks x 32 layers.
    let ns = unique_ns("gather");
    let e = Engine::with_store(
        store.clone(),
        EngineConfig {
            namespace: ns.clone(),
            ..Default::default()
        },
    )
    .unwrap();
    // Striped over the default 2 connections: chunks 0-1 and 2-3, byte-exact.
    assert_eq!(
        save_and_load(&e, &g, 4, 1),
        2,
        "one gather request per stream"
    );
    // One stream: one request per load; three streams split 4 chunks as 1 + 1 + 2.
    for (streams, want) in [(1, 1), (3, 3)] {
        let es = Engine::with_store(
            store.clone(),
            EngineConfig {
                namespace: ns.clone(),
                gather_streams: streams,
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(
            save_and_load(&es, &g, 4, 3 + streams as u64),
            want,
            "{streams} streams"
        );
    }
    let off = EngineConfig {
        namespace: ns,
        gather: false,
        ..Default::default()
    };
    let e2 = Engine::with_store(store, off).unwrap();
    let n = save_and_load(&e2, &g, 4, 2);
    assert!(
        n >= 4 * 2,
        "ranged GETs: layer 0 per chunk plus coalesced later layers, got {n}"
    );
    drop((e, e2));
    rt().block_on(server.shutdown());
}

/// Engines over one S3 store in turn, each dropped before the next starts (as the tests and
/// the benchmarks use them): no request of a later engine meets a pooled connection of an
/// earlier engine's runtime that is still being torn down (CI once failed a save here with
/// "dispatch task is gone: runtime dropped the dispatch task"). Gather and ranged GETs
/// alternate, so both kinds of connection are handed on; every load is byte-exact.
#[test]
fn engines_in_turn_share_one_s3_store() {
    let (_dir, server, store) = fs_server();
    let g = common::small_geometry("test/turns", 6);
    for turn in 0..24u64 {
        let cfg = EngineConfig {
            namespace: unique_ns("turns"),
            gather: turn % 2 == 0,
            ..Default::default()
        };
        let e = Engine::with_store(store.clone(), cfg).unwrap();
        let requests = save_and_load(&e, &g, 3, 100 + turn);
        assert!(requests >= 1, "turn {turn}: {requests} requests");
        drop(e);
    }
    rt().block_on(server.shutdown());
}

#[test]
fn version_2_saves_gather_from_segments_and_version_1_prefixes_still_gather() {
    let (_dir, _server, store) = fs_server();
    let g = KvGeometry::llama31_8b();
    let ns = unique_ns("gather-v2");
    let with = |pairs: &[(&str, &str)]| engine_with(store.clone(), &ns, pairs);
    let v2 = with(&[("save_format", "v2")]);
    // 4 chunks of 1 MiB slices in one segment: the server reads them from the segment, one
    // gather request per stream (2 streams), byte for byte; ranged GETs would take 4 x 32.
    assert_eq!(save_and_load(&v2, &g, 4, 11), 2);
    // A version 1 prefix on the same server still gathers for both engines: one request per
    // stream; an engine writing version 2 that knows no marker reads marker 0 first.
    let v1 = with(&[]);
    let (hs, data) = save_prefix(&v1, &g, 4, 12);
    assert_eq!(v2.lookup_blocking(&g, &hs).unwrap(), 4);
    for (e, lookup_cache, want) in [(&v1, "2000", 2), (&v2, "2000", 2), (&v2, "0", 1 + 2)] {
        let e = if lookup_cache == "0" {
            &with(&[("save_format", "v2"), ("lookup_cache_ttl_ms", "0")])
        } else {
            e
        };
        let h = start_load(e, &g, hs.clone(), data[0].len());
        assert_layers_exact(&h, &data);
        assert_eq!(h.stats().requests, want, "lookup cache {lookup_cache} ms");
    }
    // A prefix whose first 4 chunks are chunk objects (saved by the version 1 engine) and
    // whose next 4 are one segment (the version 2 engine knows the first 4 are published and
    // writes only the rest): another engine's load gathers all 8 in one request per stream.
    let (hs8, data8) = common::seeded_prefix(&g, 8, 13);
    let half: Vec<&[u8]> = data8.iter().map(|l| &l[..l.len() / 2]).collect();
    v1.save_blocking(&g, &hs8[..4], &half).unwrap();
    assert_eq!(v2.lookup_blocking(&g, &hs8).unwrap(), 4);
    let all: Vec<&[u8]> = data8.iter().map(|l| l.as_slice()).collect();
    v2.save_blocking(&g, &hs8, &all).unwrap();
    let reader = with(&[("save_format", "v2")]);
    assert_eq!(reader.lookup_blocking(&g, &hs8).unwrap(), 8);
    let h = start_load(&reader, &g, hs8, data8[0].len());
    assert_layers_exact(&h, &data8);
    assert!(h.chunk_status().iter().all(|s| *s == ChunkStatus::Ok));
    assert_eq!(h.stats().requests, 2, "one gather request per stream");
}

/// A segment object read over gather that is damaged: a flipped byte in one slice is a miss
/// of that layer only (the client checks the slice's stored CRC32C), naming the chunk; a
/// flipped byte in its chunk list fails the server's check of the segment's header, and every
/// layer misses, never bytes. Neither falls back to ranged GETs.
#[test]
fn a_damaged_segment_over_gather_is_a_miss_never_bytes() {
    let (dir, _server, store) = fs_server();
    let g = KvGeometry::llama31_8b();
    let ns = unique_ns("gather-v2-bad");
    let e = engine_with(store, &ns, &[("save_format", "v2")]);
    let (hs, data) = save_prefix(&e, &g, 4, 21);
    let path = dir
        .path()
        .join(BUCKET)
        .join(e.keys(&g).unwrap().segment(&segment_digest(&hs)));
    let clean = std::fs::read(&path).unwrap();
    let header = SegmentHeader::decode(&clean).unwrap();
    // Layer 5 of chunk 2.
    let mut obj = clean.clone();
    obj[header.layout().slice_range(5, 2).start as usize + 10] ^= 0x40;
    std::fs::write(&path, &obj).unwrap();
    let h = start_load(&e, &g, hs.clone(), data[0].len());
    assert_only_layer_5_of_chunk_2_corrupt(&h, &data);
    assert_eq!(h.stats().requests, 2, "gather, no fallback");
    // The chunk list (just after the 64-byte fixed header).
    let mut obj = clean;
    obj[70] ^= 0x01;
    std::fs::write(&path, &obj).unwrap();
    let h = start_load(&e, &g, hs, data[0].len());
    assert_every_layer_misses(&h, "", |err| {
        matches!(err, objectcache::LayerError::GeometryMismatch { .. })
    });
    // Every layer failed with the first stripe's misses, so the second stripe may or may not
    // have sent its request before the load ended; either way no ranged GET was sent.
    let st = h.stats();
    assert!(
        (1..=2).contains(&st.requests),
        "gather, no fallback: {st:?}"
    );
    assert_eq!(st.peak_requests_in_flight, 0, "no ranged GET: {st:?}");
}

/// A marker that places chunks at indexes of a segment that hold other chunks (here, every
/// chunk one index on): the server checks each chunk's hash against the segment's chunk list
/// and sends a miss naming the chunk, never the bytes of the chunk that is there.
#[test]
fn a_chunk_placed_at_the_wrong_index_of_a_segment_is_a_miss() {
    let (_dir, _server, store) = fs_server();
    let g = KvGeometry::llama31_8b();
    let ns = unique_ns("gather-v2-index");
    let saver = engine_with(store.clone(), &ns, &[("save_format", "v2")]);
    let (hs, data) = save_prefix(&saver, &g, 4, 31);
    let mut marker = saver.segment_markers(&g, &hs).unwrap()[&0].clone();
    assert_eq!(marker.index, 0);
    // Position 0 claimed at index 1: positions 0..3 would read the chunks at 1..4.
    marker.index = 1;
    let reader = engine_with(store, &ns, &[]);
    let req = LoadRequest::new(g.clone(), hs[..3].to_vec())
        .with_segment_markers([(0, marker)].into_iter().collect());
    let h = reader
        .load(
            req,
            LayerBuffers::allocate(g.layers as usize, 3 * data[0].len() / 4),
        )
        .unwrap();
    assert_every_layer_misses(&h, "", |err| {
        matches!(err, objectcache::LayerError::Missing { .. })
    });
    assert_eq!(
        settled_chunk_status(&h),
        vec![ChunkStatus::Missing; 3],
        "each chunk named"
    );
    assert_eq!(h.stats().requests, 2, "gather (2 streams), no fallback");
}

#[test]
fn stock_s3_falls_back_to_ranged_gets() {
    let Some((s, _)) = rt().block_on(common::test_s3_store("fallback")) else {
        return;
    };
    let store: Arc<dyn Store> = Arc::new(s);
    assert!(
        objectcache::store::Gateways::of(&*store).first().is_some(),
        "an endpoint is configured, so the connector probes it"
    );
    let e = engine(store, "fallback");
    let mut g = KvGeometry::smollm2_135m();
    g.tokens_per_chunk = 16;
    let n = save_and_load(&e, &g, 3, 3);
    assert!(
        n > 1,
        "Ceph RGW offers no gather: ranged GETs ({n} requests)"
    );
}

/// One missing chunk over gather: every layer fails naming that chunk (a layer is never
/// ready with bytes missing, as on the ranged-GET path), and `chunk_status` names only it:
/// the chunks before it are the longest valid prefix, the others were delivered whole.
#[test]
fn gather_missing_chunk_is_a_per_chunk_miss() {
    let backend: Arc<dyn Store> = Arc::new(objectcache::store::MemoryStore::new());
    let server = rt().block_on(start(backend, config()));
    let store = s3_on(&server.endpoint());
    let g = KvGeometry::smollm2_135m();
    let e = engine(store.clone(), "gmiss");
    let (hs, data) = save_prefix(&e, &g, 4, 7);
    let keys = e.keys(&g).unwrap();
    rt().block_on(store.delete(&keys.data(&hs[2]))).unwrap();
    let h = start_load(&e, &g, hs.clone(), data[0].len());
    assert_every_layer_misses(&h, "", |err| {
        matches!(err, objectcache::LayerError::Missing { chunk: 2, .. })
    });
    // The layers fail as soon as the miss arrives; the other chunks are marked whole when
    // the stream ends.
    assert_only_chunk_2_bad(&h, ChunkStatus::Missing);
    drop(e);
    rt().block_on(server.shutdown());
}

/// A corrupt slice in a file of a file-backed server (sent with sendfile, unverified by the
/// server) is caught by the client's check of the slice's stored CRC32C: only that layer
/// misses, naming the chunk; every other layer arrives byte-exact; no fallback.
#[test]
fn gather_corrupt_slice_in_a_file_is_a_miss_naming_its_chunk() {
    let (dir, server, store) = fs_server();
    let g = KvGeometry::llama31_8b();
    let e = engine(store, "gcorrupt");
    let (hs, data) = save_prefix(&e, &g, 4, 9);
    let path = dir
        .path()
        .join(BUCKET)
        .join(e.keys(&g).unwrap().data(&hs[2]));
    let mut obj = std::fs::read(&path).unwrap();
    obj[objectcache::layout::slice_range(5, g.slice_bytes()).start as usize + 10] ^= 0x40;
    std::fs::write(&path, obj).unwrap();
    let h = start_load(&e, &g, hs, data[0].len());
    assert_only_layer_5_of_chunk_2_corrupt(&h, &data);
    assert_only_chunk_2_bad(&h, ChunkStatus::Corrupt);
    drop(e);
    rt().block_on(server.shutdown());
}

/// Issue 18 (stock S3 compatibility): an S3 server that stays silent on the gather preface
/// until a full HTTP request line arrives (as moto's server mode and MinIO do) once cost every
/// load a 10 s hello timeout. The engine now learns that gather is not offered from one plain
/// HTTP request, once per engine, and never sends the preface there.
#[test]
fn a_server_silent_on_the_preface_costs_one_http_probe_per_engine() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (http, prefaces) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let addr = rt().block_on(async {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let (http, prefaces) = (http.clone(), prefaces.clone());
        tokio::spawn(async move {
            loop {
                let (mut s, _) = l.accept().await.unwrap();
                let (http, prefaces) = (http.clone(), prefaces.clone());
                tokio::spawn(async move {
                    let mut b = Vec::new();
                    let mut chunk = [0u8; 4096];
                    loop {
                        if b.starts_with(b"OCGATHER") {
                            // Silent, as a server waiting for a request line is.
                            prefaces.fetch_add(1, Ordering::SeqCst);
                            tokio::time::sleep(std::time::Duration::from_secs(30)).await;
                            return;
                        }
                        if b.windows(4).any(|w| w == b"\r\n\r\n") {
                            if b.starts_with(b"GET /_objectcache/capabilities ") {
                                http.fetch_add(1, Ordering::SeqCst);
                            }
                            let body = b"<Error><Code>NoSuchKey</Code></Error>";
                            let head = format!(
                                "HTTP/1.1 404 Not Found\r\nContent-Type: application/xml\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                                body.len()
                            );
                            let _ = s.write_all(head.as_bytes()).await;
                            let _ = s.write_all(body).await;
                            return;
                        }
                        match s.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => b.extend_from_slice(&chunk[..n]),
                        }
                    }
                });
            }
        });
        addr
    });
    let store = s3_on(&format!("http://{addr}"));
    let e = engine(store, "silent");
    let mut g = KvGeometry::smollm2_135m();
    g.tokens_per_chunk = 16;
    let hs = hashes(&g, 32, 9);
    let t = std::time::Instant::now();
    for _ in 0..3 {
        let h = e
            .load(
                LoadRequest::new(g.clone(), hs.clone()),
                LayerBuffers::allocate(g.layers as usize, 2 * g.slice_bytes() as usize),
            )
            .unwrap();
        // Nothing is stored there: every layer is a miss, never bytes.
        assert!(h.wait_layer_blocking(0, None).is_err());
    }
    assert_eq!(prefaces.load(Ordering::SeqCst), 0, "no gather preface sent");
    assert_eq!(
        http.load(Ordering::SeqCst),
        1,
        "one capabilities request per engine"
    );
    println!(
        "3 loads against a server silent on the preface: {:?}",
        t.elapsed()
    );
}
