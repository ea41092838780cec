//! Issue 19, part 4: misses stay local on every path. One bad slice (chunk 2, layer 5 of a
//! 4-chunk prefix) fails only layer 5, naming chunk 2; every other layer is delivered
//! byte-exact, on the ranged-GET path (coalesced reads and single-slice reads) and on the
//! gather path alike. A body cut short in the middle of a read fails only the layers that
//! read did not deliver. (Before, on the ranged-GET path, one corrupt slice failed every
//! layer of every chunk.)
#![cfg(feature = "s3")]

use crate::common;
use crate::common::shared_rt as rt;
use crate::fault_proxy;
use crate::gather_util;

use common::unique_ns;
use fault_proxy::{Fault, FaultProxy};
use gather_util::{config, start, BUCKET};
use objectcache::connector::{ChunkStatus, Engine, LayerBuffers, LoadHandle, LoadRequest};
use objectcache::layout::slice_range;
use objectcache::store::{MemoryStore, Store, StoreExt};
use objectcache::{ChunkHash, Dtype, KvGeometry, LayerError};
use std::sync::Arc;

/// 16 layers x 256 KiB slices.
fn geometry() -> KvGeometry {
    KvGeometry::new("traffic/misses", 16, 4, 64, Dtype::Fp16).unwrap()
}

const BAD_CHUNK: usize = 2;
const BAD_LAYER: usize = 5;

fn engine(endpoint: &str, ns: &str, pairs: &[(&str, &str)]) -> Engine {
    let store = rt().block_on(gather_util::s3_store_on(endpoint));
    common::engine_with(store, ns, pairs)
}

/// Waits until every layer settled and no chunk is pending; returns the failed layers.
fn settle(h: &LoadHandle) -> Vec<(usize, LayerError)> {
    let failed: Vec<(usize, LayerError)> = (0..h.layers())
        .filter_map(|l| h.wait_layer_blocking(l, None).err().map(|e| (l, e)))
        .collect();
    common::eventually(
        "every chunk settles",
        std::time::Duration::from_secs(30),
        || !h.chunk_status().contains(&ChunkStatus::Pending),
    );
    failed
}

/// Only `BAD_LAYER` failed, naming `BAD_CHUNK` with `want`; every other layer holds the
/// saved bytes.
fn assert_only_the_bad_slice_missed(
    h: &LoadHandle,
    data: &[Vec<u8>],
    want: &[ChunkStatus],
    what: &str,
) {
    let failed = settle(h);
    let layers: Vec<usize> = failed.iter().map(|(l, _)| *l).collect();
    assert_eq!(layers, vec![BAD_LAYER], "{what}: failed layers {failed:?}");
    let (_, e) = &failed[0];
    let named = match e {
        LayerError::ChecksumMismatch { chunk, .. } | LayerError::Storage { chunk, .. } => *chunk,
        other => panic!("{what}: {other}"),
    };
    assert_eq!(named, BAD_CHUNK, "{what}: {e}");
    for (l, want) in data.iter().enumerate() {
        if l != BAD_LAYER {
            assert!(
                h.layer(l).unwrap() == &want[..],
                "{what}: layer {l} differs"
            );
        }
    }
    let st = h.chunk_status();
    for (c, s) in st.iter().enumerate() {
        if c == BAD_CHUNK {
            assert!(
                want.contains(s),
                "{what}: chunk {c} is {s:?}, expected one of {want:?}"
            );
        } else {
            assert_eq!(*s, ChunkStatus::Ok, "{what}: chunk {c}");
        }
    }
    println!("MISS|{what}|layer {BAD_LAYER} failed naming chunk {BAD_CHUNK} ({e}); the other 15 layers delivered");
}

fn load(e: &Engine, g: &KvGeometry, hs: &[ChunkHash], n: usize) -> LoadHandle {
    e.load(
        LoadRequest::new(g.clone(), hs.to_vec()),
        LayerBuffers::allocate(g.layers as usize, n),
    )
    .unwrap()
}

#[test]
fn a_corrupt_slice_fails_only_its_layer_on_every_path() {
    let g = geometry();
    let backend: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let srv = rt().block_on(start(backend.clone(), config()));
    let ns = unique_ns("misses-corrupt");
    let saver = engine(&srv.endpoint(), &ns, &[]);
    let (hs, data) = common::save_prefix(&saver, &g, 4, 31);
    // Flip one byte of chunk 2's layer-5 slice in the server's backend.
    let key = format!("{BUCKET}/{}", saver.keys(&g).unwrap().data(&hs[BAD_CHUNK]));
    let mut obj = rt().block_on(backend.get_bytes(&key)).unwrap().to_vec();
    obj[(slice_range(BAD_LAYER as u32, g.slice_bytes()).start + 1000) as usize] ^= 0x40;
    rt().block_on(backend.put(&key, obj.into())).unwrap();
    let n = data[0].len();
    for (what, pairs) in [
        ("ranged GETs, coalesced reads", vec![("gather", "off")]),
        (
            "ranged GETs, one slice per read",
            vec![("gather", "off"), ("coalesce_bytes", "0")],
        ),
        ("gather, 2 streams", vec![]),
        ("gather, 1 stream", vec![("gather_streams", "1")]),
    ] {
        let e = engine(&srv.endpoint(), &ns, &pairs);
        let h = load(&e, &g, &hs, n);
        assert_only_the_bad_slice_missed(&h, &data, &[ChunkStatus::Corrupt], what);
    }
    rt().block_on(srv.shutdown());
}

#[test]
fn a_body_cut_short_fails_only_the_layers_it_did_not_deliver() {
    let g = geometry();
    let backend: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let srv = rt().block_on(start(backend, config()));
    let ns = unique_ns("misses-cut");
    let saver = engine(&srv.endpoint(), &ns, &[]);
    let (hs, data) = common::save_prefix(&saver, &g, 4, 32);
    // The ranged GET of chunk 2's layer-5 slice (one slice per read) is cut in half, on
    // every try.
    let data_key = saver.keys(&g).unwrap().data(&hs[BAD_CHUNK]);
    let r = slice_range(BAD_LAYER as u32, g.slice_bytes());
    let range = format!("bytes={}-{}", r.start, r.end - 1);
    let proxy = FaultProxy::http(srv.local_addr(), move |q| {
        if q.method == "GET"
            && q.path().ends_with(&data_key)
            && q.range.as_deref() == Some(range.as_str())
        {
            Fault::Truncate(0.5)
        } else {
            Fault::Pass
        }
    });
    let e = engine(
        &proxy.url(),
        &ns,
        &[("gather", "off"), ("coalesce_bytes", "0")],
    );
    let h = load(&e, &g, &hs, data[0].len());
    // (A short body is a storage error or a truncation, by where the client notices it.)
    assert_only_the_bad_slice_missed(
        &h,
        &data,
        &[ChunkStatus::Error, ChunkStatus::Corrupt],
        "ranged GETs, a body cut in half",
    );
    let tries = proxy
        .requests()
        .iter()
        .filter(|q| q.fault != "pass")
        .count();
    assert!(
        (1..=4).contains(&tries),
        "bounded retries of the cut read: {tries}"
    );
    drop(proxy);
    rt().block_on(srv.shutdown());
}
