//! Pair tests: a server's [`ServerLoad`] and a client's [`LoadTracker`] run one load against
//! each other through [`ServerConnection`] and [`ClientConnection`], with no I/O: real bytes in
//! the "store", real frames on the "wire", the destination compared byte for byte.

use super::super::*;
use crate::error::LayerError;
use crate::layout::crc::crc32c;
use crate::layout::{ChunkHash, Dtype, HashAlgo, KeyBuilder, KvGeometry};
use bytes::{Bytes, BytesMut};

/// 4 layers, 512 bytes per token per layer, 16-token chunks: 8 KiB slices.
fn geometry() -> KvGeometry {
    let mut g = KvGeometry::new("pair-test", 4, 2, 64, Dtype::Fp16).unwrap();
    g.tokens_per_chunk = 16;
    g
}

/// A load of `chunks` full chunks, units of at most `max_unit` bytes.
fn request(chunks: usize, max_unit: u32) -> GatherRequest {
    let g = geometry();
    let kb = KeyBuilder::new("ns", &g, HashAlgo::Sha256Cbor).unwrap();
    let hashes = (0..chunks)
        .map(|i| ChunkHash::from_digest([i as u8 + 1; 32]))
        .collect();
    let mut r = GatherRequest::for_prefix(9, "kv-pair", &kb, &g, hashes, vec![16; chunks]);
    r.max_unit_bytes = max_unit;
    r
}

/// The stored bytes of (chunk, layer)'s slice: distinct in every slice.
fn slice(chunk: u32, layer: u32, len: u64) -> Bytes {
    (0..len)
        .map(|i| (i as u32 ^ (chunk * 131 + layer * 17)).wrapping_mul(2_654_435_761) as u8)
        .collect::<Vec<u8>>()
        .into()
}

/// What the "store" does with a read: `Ok(None)` reads the slice, `Ok(Some(b))` returns `b`
/// with the CRC32C of the true bytes (a corrupt store), `Err` misses.
type Read = Result<Option<Bytes>, PieceMiss>;

fn miss(chunk: u32, reason: MissReason, message: &str) -> PieceMiss {
    PieceMiss {
        chunk,
        reason,
        message: message.into(),
    }
}

/// What the client ended with.
struct Landed {
    /// Per layer, the destination buffer.
    dest: Vec<Vec<u8>>,
    /// Layer errors, in the order the client reported them.
    failed: Vec<(u32, LayerError)>,
    outcome: LoadOutcome,
    /// What the server's `End` said: units, bytes.
    end: (u64, u64),
    /// Per unit of the plan, in order: did the server wait for a header before it.
    waited: Vec<bool>,
}

fn pump(from: &mut dyn FnMut() -> Option<Bytes>, to: &mut BytesMut) {
    while let Some(b) = from() {
        to.extend_from_slice(&b);
    }
}

/// Runs one load of `req`: chunk `i`'s header check gives `header(i)`, the read of (chunk,
/// layer) `read(chunk, layer)`. Header results reach the server only when a unit needs them
/// (the real checker runs alongside the reads).
fn run(
    req: &GatherRequest,
    header: impl Fn(u32) -> Result<(), PieceMiss>,
    read: impl Fn(u32, u32) -> Read,
) -> Landed {
    let mut c = ClientConnection::new();
    let mut s = ServerConnection::new(ServerLimits::default());
    let (mut up, mut down) = (BytesMut::new(), BytesMut::new());
    pump(&mut || c.poll_transmit(), &mut up);
    s.handle_bytes(&mut up).unwrap();
    pump(&mut || s.poll_transmit(), &mut down);
    c.handle_bytes(&mut down).unwrap();
    assert!(matches!(c.poll_event(), Some(ClientEvent::Connected(_))));
    c.start_gather(req).unwrap();
    pump(&mut || c.poll_transmit(), &mut up);
    s.handle_bytes(&mut up).unwrap();
    let Some(ServerEvent::Gather(g)) = s.poll_event() else {
        panic!("no gather request")
    };

    // The server.
    let plan = plan_units(&g);
    let mut load = ServerLoad::new(g.layers.clone(), g.chunks.len(), &plan);
    let total: u64 = plan.iter().map(|u| u.len).sum();
    s.accept(g.request_id, plan.len() as u64, total);
    let mut next_header = 0u32;
    let mut waited = Vec::new();
    let mut layers_done = Vec::new();
    let mut feed = |load: &mut ServerLoad, s: &mut ServerConnection| {
        if let Some(m) = load.on_header(header(next_header)) {
            s.send_miss(m);
        }
        next_header += 1;
    };
    // The server driver's walk: ask the load whether the unit can go, then carry out its
    // actions.
    'units: for u in &plan {
        waited.push(load.readiness(u) == UnitReady::AwaitHeader);
        loop {
            match load.readiness(u) {
                UnitReady::AwaitHeader => feed(&mut load, &mut s),
                UnitReady::NothingToSend => break 'units,
                UnitReady::Deliver => break,
            }
        }
        let pieces = u
            .pieces
            .iter()
            .map(|p| {
                let whole = slice(p.chunk, u.layer, p.slice_len);
                let good = whole.slice(p.range.start as usize..p.range.end as usize);
                let sent = read(p.chunk, u.layer)?.map_or(good.clone(), |b| {
                    b.slice(p.range.start as usize..p.range.end as usize)
                });
                // Two parts per piece, as a backend's buffers may come.
                let half = sent.len() / 2;
                Ok((vec![sent.slice(..half), sent.slice(half..)], crc32c(&good)))
            })
            .collect();
        for a in load.unit_actions(u, pieces, false) {
            match a {
                LoadAction::SendMiss(m) => s.send_miss(m),
                LoadAction::SendUnit(h, parts) => {
                    load.sent(h.len as u64);
                    s.send_unit(h, parts);
                }
                LoadAction::WriteRdma(w) => panic!("an RDMA write on a stream load: {w:?}"),
            }
        }
        if load.unit_done(u.layer) {
            layers_done.push(u.layer);
        }
    }
    while load.headers_pending() {
        feed(&mut load, &mut s);
    }
    let end = load.totals();
    s.finish(g.request_id, end.0, end.1);
    if !load.nothing_to_send() {
        // Every layer's last unit was marked done, once, in order.
        assert_eq!(layers_done, g.layers.clone().collect::<Vec<_>>());
    }

    // The client.
    pump(&mut || s.poll_transmit(), &mut down);
    c.handle_bytes(&mut down).unwrap();
    let layer_bytes = req.layer_bytes() as usize;
    let mut dest = vec![vec![0u8; layer_bytes]; req.layers.len()];
    let mut track = LoadTracker::new(req);
    let mut failed = Vec::new();
    loop {
        match c.poll_event().expect("the load ends with End") {
            ClientEvent::Accepted(t) => assert_eq!((t.units, t.bytes), (plan.len() as u64, total)),
            ClientEvent::Unit {
                layer,
                offset,
                data,
            } => {
                let at = offset as usize;
                dest[layer as usize][at..at + data.len()].copy_from_slice(&data);
                track.delivered(layer, data.len() as u64);
            }
            ClientEvent::Corrupt {
                layer,
                offset,
                expected,
                computed,
            } => failed.extend(
                track
                    .corrupt(layer, offset, expected, computed)
                    .map(|e| (layer, e)),
            ),
            ClientEvent::Miss(m) => {
                let key = req.chunks.key(m.chunk as usize).unwrap();
                failed.extend(track.miss(&m, &key));
            }
            ClientEvent::End(t) => {
                assert_eq!((t.units, t.bytes), end);
                break;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    for l in track.unfinished() {
        failed.push((
            l,
            LayerError::Storage {
                chunk: 0,
                message: "incomplete".into(),
            },
        ));
    }
    Landed {
        dest,
        failed,
        outcome: track.outcome(),
        end,
        waited,
    }
}

/// Chunk `chunk`'s bytes in layer `layer`'s destination (full 8 KiB slices).
fn at(l: &Landed, layer: u32, chunk: u32) -> &[u8] {
    let sl = geometry().slice_bytes() as usize;
    &l.dest[layer as usize][chunk as usize * sl..(chunk as usize + 1) * sl]
}

fn expect(layer: u32, chunk: u32) -> Bytes {
    slice(chunk, layer, geometry().slice_bytes())
}

#[test]
fn a_whole_load_lands_byte_exact_with_combined_crcs() {
    for max_unit in [4 << 10, 16 << 10, 64 << 10] {
        let req = request(5, max_unit);
        let l = run(&req, |_| Ok(()), |_, _| Ok(None));
        assert!(l.failed.is_empty(), "{max_unit}: {:?}", l.failed);
        for layer in 0..4 {
            for chunk in 0..5 {
                assert_eq!(at(&l, layer, chunk), &expect(layer, chunk)[..]);
            }
        }
        // Every planned unit went out whole (no run was split).
        let plan = plan_units(&req);
        assert_eq!(l.end, (plan.len() as u64, 4 * 5 * (8 << 10)));
        assert_eq!(l.outcome.units, plan.len() as u64);
        assert!(l.outcome.failed_layers.is_empty() && l.outcome.missed_chunks.is_empty());
    }
}

#[test]
fn a_bad_chunk_misses_every_layer_and_the_others_still_land() {
    let req = request(4, 16 << 10);
    let l = run(
        &req,
        |c| match c {
            1 => Err(miss(1, MissReason::NotFound, "no such key")),
            _ => Ok(()),
        },
        |_, _| Ok(None),
    );
    let key = req.chunks.key(1).unwrap();
    let want: Vec<(u32, LayerError)> = (0..4)
        .map(|layer| {
            (
                layer,
                LayerError::Missing {
                    chunk: 1,
                    key: key.clone(),
                },
            )
        })
        .collect();
    assert_eq!(l.failed, want);
    for layer in 0..4 {
        for chunk in [0, 2, 3] {
            assert_eq!(at(&l, layer, chunk), &expect(layer, chunk)[..]);
        }
        // Nothing of the bad chunk was written.
        assert!(at(&l, layer, 1).iter().all(|&b| b == 0));
    }
    assert_eq!(l.outcome.failed_layers, vec![0, 1, 2, 3]);
    assert_eq!(l.outcome.missed_chunks, vec![(1, MissReason::NotFound)]);
    // Units of chunks 0..=1 waited for chunk 1's header; a unit splits around the bad chunk:
    // [0] and [2, 3] per layer instead of [0, 1] and [2, 3].
    assert!(l.waited[0]);
    assert_eq!(l.end, (8, 4 * 3 * (8 << 10)));
}

#[test]
fn a_bad_slice_misses_its_layer_only() {
    let req = request(4, 16 << 10);
    let l = run(
        &req,
        |_| Ok(()),
        |c, layer| match (c, layer) {
            (2, 2) => Err(miss(2, MissReason::Storage, "read failed")),
            _ => Ok(None),
        },
    );
    assert_eq!(
        l.failed,
        vec![(
            2,
            LayerError::Storage {
                chunk: 2,
                message: "read failed".into()
            }
        )]
    );
    for layer in 0..4 {
        for chunk in 0..4 {
            if (chunk, layer) != (2, 2) {
                assert_eq!(at(&l, layer, chunk), &expect(layer, chunk)[..]);
            }
        }
    }
    assert!(at(&l, 2, 2).iter().all(|&b| b == 0));
    assert_eq!(l.outcome.failed_layers, vec![2]);
    assert_eq!(l.outcome.missed_chunks, vec![(2, MissReason::Storage)]);
}

#[test]
fn a_corrupt_slice_is_caught_by_the_client_and_names_its_chunk() {
    // 16 KiB units: chunks [0, 1] and [2] per layer; the corrupt slice's unit fails its
    // CRC32C at the client, which names the chunk at the unit's offset (the unit's first).
    let req = request(3, 16 << 10);
    let l = run(
        &req,
        |_| Ok(()),
        |c, layer| {
            Ok(((c, layer) == (2, 1)).then(|| {
                let mut b = expect(1, 2).to_vec();
                b[100] ^= 1;
                Bytes::from(b)
            }))
        },
    );
    assert_eq!(l.failed.len(), 1);
    let (layer, e) = &l.failed[0];
    assert_eq!(*layer, 1);
    assert!(
        matches!(e, LayerError::ChecksumMismatch { chunk: 2, layer: 1, stored, computed } if stored != computed),
        "{e:?}"
    );
    assert_eq!(at(&l, 1, 0), &expect(1, 0)[..]);
    assert!(l.outcome.missed_chunks.is_empty());
}

#[test]
fn split_slices_and_every_chunk_missing() {
    // 4 KiB units: every 8 KiB slice is two pieces in two units; a bad second piece misses
    // its layer and the first piece still lands.
    let req = request(2, 4 << 10);
    let l = run(
        &req,
        |_| Ok(()),
        |c, layer| match (c, layer) {
            (1, 3) => Err(miss(1, MissReason::GeometryMismatch, "tokens 15")),
            _ => Ok(None),
        },
    );
    assert_eq!(
        l.failed,
        vec![(
            3,
            LayerError::GeometryMismatch {
                chunk: 1,
                reason: "tokens 15".into()
            }
        )]
    );
    assert_eq!(at(&l, 3, 0), &expect(3, 0)[..]);

    // Every chunk misses: nothing is sent, every layer fails once, each chunk is named.
    let req = request(3, 16 << 10);
    let l = run(
        &req,
        |c| Err(miss(c, MissReason::NotFound, "gone")),
        // The server reads ahead of the header checks; what it read of them is dropped.
        |_, _| Ok(None),
    );
    assert_eq!(l.end, (0, 0));
    assert_eq!(l.failed.len(), 4);
    assert!(l
        .failed
        .iter()
        .all(|(_, e)| matches!(e, LayerError::Missing { chunk: 0, .. })));
    assert_eq!(
        l.outcome.missed_chunks,
        vec![
            (0, MissReason::NotFound),
            (1, MissReason::NotFound),
            (2, MissReason::NotFound)
        ]
    );
}

/// The RDMA rule: an intact unit is one write, a cut unit of several pieces one write per
/// slice, a cut unit of one piece nothing.
#[test]
fn rdma_writes_follow_the_unit_rule() {
    let req = request(3, 32 << 10);
    let plan = plan_units(&req);
    let u = &plan[0];
    assert_eq!(u.pieces.len(), 3);
    let mut load = ServerLoad::new(req.layers.clone(), 3, &plan);
    for _ in 0..3 {
        assert_eq!(load.on_header(Ok(())), None);
    }
    let ok = |c: u32| Ok::<_, PieceMiss>((vec![c], c));
    let w = load.cut(u, vec![ok(0), ok(1), ok(2)]).into_rdma_writes();
    assert_eq!(w.len(), 1);
    assert_eq!(
        (w[0].slice_of, w[0].offset, w[0].len, &w[0].parts[..]),
        (None, 0, 24 << 10, &[0, 1, 2][..])
    );
    let cut = load.cut(
        u,
        vec![ok(0), Err(miss(1, MissReason::Storage, "x")), ok(2)],
    );
    assert_eq!(cut.misses.len(), 1);
    let w = cut.into_rdma_writes();
    let got: Vec<_> = w.iter().map(|w| (w.slice_of, w.offset, w.len)).collect();
    assert_eq!(
        got,
        vec![(Some(0), 0, 8 << 10), (Some(2), 16 << 10, 8 << 10)]
    );
    // As actions: the bad slice's Miss first, then the good slices' writes.
    let acts = load.unit_actions(
        u,
        vec![ok(0), Err(miss(1, MissReason::Storage, "x")), ok(2)],
        true,
    );
    let got: Vec<_> = acts
        .iter()
        .map(|a| match a {
            LoadAction::SendMiss(m) => (Some(m.chunk), None, m.layers.start),
            LoadAction::WriteRdma(w) => (None, w.slice_of, w.offset as u32),
            LoadAction::SendUnit(..) => panic!("a stream unit on an RDMA load"),
        })
        .collect();
    assert_eq!(
        got,
        vec![
            (Some(1), None, u.layer),
            (None, Some(0), 0),
            (None, Some(2), 16 << 10)
        ]
    );
    // One piece per unit (4 KiB units, split slices): a cut unit writes nothing.
    let req = request(1, 4 << 10);
    let plan = plan_units(&req);
    let load = ServerLoad::new(req.layers.clone(), 1, &plan);
    let cut = load.cut(
        &plan[0],
        vec![Err::<(Vec<u32>, u32), _>(miss(0, MissReason::Storage, "x"))],
    );
    assert!(cut.cut && cut.into_rdma_writes().is_empty());
    // A layer's failed write is named once.
    let mut load = ServerLoad::new(req.layers.clone(), 1, &plan);
    assert!(load.rdma_failed(2, 0, "qp error").is_some());
    assert!(load.rdma_layer_failed(2) && !load.rdma_layer_failed(1));
    assert_eq!(load.rdma_failed(2, 0, "again"), None);
}
