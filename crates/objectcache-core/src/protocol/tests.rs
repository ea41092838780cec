//! Tests of the gather protocol: descriptors and frames round-trip and are bounded, and the
//! client and server state machines driven against each other.

use super::*;
use crate::layout::{ChunkHash, HashAlgo, KeyBuilder, KvGeometry};
use bytes::{Bytes, BytesMut};

fn req(chunks: usize, tail: u32) -> GatherRequest {
    let g = KvGeometry::llama31_8b();
    let kb = KeyBuilder::new("ns", &g, HashAlgo::Sha256Cbor).unwrap();
    let hashes = (0..chunks)
        .map(|i| ChunkHash::from_digest([i as u8; 32]))
        .collect();
    let mut toks = vec![256; chunks];
    *toks.last_mut().unwrap() = tail;
    GatherRequest::for_prefix(7, "kv-test", &kb, &g, hashes, toks)
}

#[test]
fn descriptor_round_trips_and_keys_match_key_builder() {
    let mut r = req(16, 100);
    r.hints = SchedHints::LayerComputeUs(vec![150; 32]);
    let mut b = BytesMut::new();
    r.encode(&mut b);
    let d = GatherRequest::decode(&b, 4096).unwrap();
    assert_eq!(d, r);
    let g = KvGeometry::llama31_8b();
    let kb = KeyBuilder::new("ns", &g, HashAlgo::Sha256Cbor).unwrap();
    assert_eq!(
        d.chunks.key(3).unwrap(),
        kb.data(&ChunkHash::from_digest([3; 32]))
    );
    // Every strict prefix is a clean truncation error, never a panic.
    for n in 0..b.len() {
        assert!(GatherRequest::decode(&b[..n], 4096).is_err(), "prefix {n}");
    }
    assert!(matches!(
        GatherRequest::decode(&b, 8),
        Err(ProtocolError::TooLarge {
            what: "chunks per request",
            ..
        })
    ));
}

#[test]
fn load_group_block_round_trips_and_is_checked() {
    let mut r = req(4, 256);
    let own = r.layer_bytes();
    r.group = Some(LoadGroup {
        load_id: 0x0123_4567_89ab_cdef,
        stripe: 1,
        stripes: 2,
        load_layer_bytes: 2 * own,
    });
    let mut b = BytesMut::new();
    r.encode(&mut b);
    let mut plain = BytesMut::new();
    GatherRequest {
        group: None,
        ..r.clone()
    }
    .encode(&mut plain);
    // Flag bit 2 and 20 bytes at the end: load id, stripe, stripes, load layer bytes.
    assert_eq!(b.len(), plain.len() + 20);
    assert_eq!(u16::from_le_bytes([b[10], b[11]]) & 4, 4);
    assert_eq!(
        &b[b.len() - 20..b.len() - 12],
        &0x0123_4567_89ab_cdefu64.to_le_bytes()
    );
    assert_eq!(&b[b.len() - 12..b.len() - 8], &[1, 0, 2, 0]);
    assert_eq!(&b[b.len() - 8..], &(2 * own).to_le_bytes());
    assert_eq!(GatherRequest::decode(&b, 4096).unwrap(), r);
    for n in 0..b.len() {
        assert!(GatherRequest::decode(&b[..n], 4096).is_err(), "prefix {n}");
    }
    // The flag without the block, or the block without the flag: refused.
    let mut flag_only = plain.clone();
    flag_only[10] |= 4;
    assert!(GatherRequest::decode(&flag_only, 4096).is_err());
    let mut block_only = b.clone();
    block_only[10] &= !4;
    assert!(GatherRequest::decode(&block_only, 4096).is_err());
    for (stripe, stripes, bytes, field) in [
        (2u16, 2u16, 2 * own, "stripe 2 of 2"),
        (0, 0, own, "stripe 0 of 0"),
        (0, MAX_STRIPES + 1, own, "of 65"),
        (0, 2, own - 1, "this stripe's is"),
        (0, 2, u64::MAX, "this stripe's is"),
    ] {
        let mut bad = r.clone();
        bad.group = Some(LoadGroup {
            load_id: 1,
            stripe,
            stripes,
            load_layer_bytes: bytes,
        });
        let e = bad.validate(4096).unwrap_err().to_string();
        assert!(e.contains("load group") && e.contains(field), "{e}");
        let mut w = BytesMut::new();
        bad.encode(&mut w);
        assert!(GatherRequest::decode(&w, 4096).is_err());
    }
}

/// A client and a server connection past the hello, the server announcing `features`, and
/// the server's hello as the client got it.
pub(crate) fn connected(features: u32) -> (ClientConnection, ServerConnection, ServerInfo) {
    let mut c = ClientConnection::new();
    let mut s = ServerConnection::new(ServerLimits {
        features,
        ..Default::default()
    });
    let mut b = BytesMut::new();
    while let Some(x) = c.poll_transmit() {
        b.extend_from_slice(&x);
    }
    s.handle_bytes(&mut b).unwrap();
    while let Some(x) = s.poll_transmit() {
        b.extend_from_slice(&x);
    }
    c.handle_bytes(&mut b).unwrap();
    let Some(ClientEvent::Connected(info)) = c.poll_event() else {
        panic!("no hello")
    };
    (c, s, info)
}

#[test]
fn load_groups_need_the_feature_bit_on_both_sides() {
    let mut r = req(2, 256);
    r.group = Some(LoadGroup {
        load_id: 5,
        stripe: 0,
        stripes: 2,
        load_layer_bytes: 2 * r.layer_bytes(),
    });
    // Announced (the default): the block goes through.
    let (mut c, mut s, info) = connected(ServerLimits::default().features);
    assert_ne!(info.features & ServerInfo::FEATURE_LOAD_GROUPS, 0);
    c.start_gather(&r).unwrap();
    let mut b = BytesMut::new();
    while let Some(x) = c.poll_transmit() {
        b.extend_from_slice(&x);
    }
    s.handle_bytes(&mut b).unwrap();
    let Some(ServerEvent::Gather(g)) = s.poll_event() else {
        panic!("no gather")
    };
    assert_eq!(g.group, r.group);
    // Not announced (an older server): the client does not send it...
    let old = ServerInfo::FEATURE_GATHER_TCP | ServerInfo::FEATURE_SAVE;
    let (mut c, mut s, info) = connected(old);
    assert_eq!(info.features & ServerInfo::FEATURE_LOAD_GROUPS, 0);
    let e = c.start_gather(&r).unwrap_err().to_string();
    assert!(e.contains("load group"), "{e}");
    // ...and a server that did not announce it refuses one sent anyway.
    let mut b = BytesMut::new();
    Frame::Gather(Box::new(r.clone())).encode(&mut b);
    let e = s.handle_bytes(&mut b).unwrap_err().to_string();
    assert!(e.contains("load group"), "{e}");
    assert!(s.is_closed());
}

#[test]
fn rdma_targets_round_trip_as_kind_2_or_3() {
    let seg = |addr: u64, len: u64| RdmaRegion { addr, rkey: 9, len };
    let mut r = req(2, 256); // 2 MiB per layer, 32 layers
    let lb = r.layer_bytes();
    // One segment per layer: kind 2, byte for byte what servers before scatter read.
    let one = RdmaTarget::contiguous(5, 3, (0..32).map(|l| seg(l << 24, lb)).collect());
    r.target = TransportTarget::Rdma(one.clone());
    let mut b = BytesMut::new();
    r.encode(&mut b);
    let tail = 1 + 4 + 32 * 20 + 8 + 1;
    assert_eq!(b[b.len() - tail], 2, "contiguous: kind 2");
    assert_eq!(GatherRequest::decode(&b, 4096).unwrap(), r);
    // Layer 7 in three segments: kind 3.
    let mut t = one;
    t.layers[7] = vec![
        seg(100, lb / 2),
        seg(5000 << 20, 1),
        seg(9000 << 20, lb / 2),
    ];
    r.target = TransportTarget::Rdma(t.clone());
    let mut b = BytesMut::new();
    r.encode(&mut b);
    let d = GatherRequest::decode(&b, 4096).unwrap();
    assert_eq!(d, r);
    for n in 0..b.len() {
        assert!(GatherRequest::decode(&b[..n], 4096).is_err(), "prefix {n}");
    }
    // Cutting units: a unit across segments gives one piece per segment it touches.
    assert_eq!(t.pieces(7, 0, 10), Some(vec![seg(100, 10)]));
    assert_eq!(
        t.pieces(7, lb / 2 - 4, 6),
        Some(vec![
            seg(100 + lb / 2 - 4, 4),
            seg(5000 << 20, 1),
            seg(9000 << 20, 1)
        ])
    );
    assert_eq!(
        t.pieces(7, lb / 2 + 1, lb / 2),
        Some(vec![seg(9000 << 20, lb / 2)])
    );
    assert_eq!(t.pieces(7, lb / 2 + 2, lb / 2), None, "past the end");
    assert_eq!(t.pieces(40, 0, 1), None, "no such layer");
    // Empty segments hold nothing (and the indexed cut agrees with the linear one).
    let segs = vec![seg(0, 4), seg(100, 0), seg(200, 4)];
    assert_eq!(rdma_pieces(&segs, 2, 4), Some(vec![seg(2, 2), seg(200, 2)]));
    assert_eq!(rdma_pieces(&segs, 4, 4), Some(vec![seg(200, 4)]));
    let idx = RdmaSegments::new(segs).unwrap();
    assert_eq!(idx.pieces(2, 4), Some(vec![seg(2, 2), seg(200, 2)]));
    assert_eq!(idx.pieces(0, 9), None);
    assert_eq!(idx.pieces(8, 0), Some(vec![]));
    // Too few bytes, an empty segment, or the wrong number of layers are refused.
    for (bad, needle) in [
        (vec![seg(1, lb - 1)], "needs"),
        (vec![seg(1, lb), seg(2, 0)], "empty"),
        (vec![], "empty"),
    ] {
        let mut t2 = t.clone();
        t2.layers[3] = bad;
        r.target = TransportTarget::Rdma(t2);
        let e = r.validate(4096).unwrap_err().to_string();
        assert!(e.contains(needle), "{e}");
    }
    let mut t2 = t;
    t2.layers.pop();
    r.target = TransportTarget::Rdma(t2);
    assert!(r
        .validate(4096)
        .unwrap_err()
        .to_string()
        .contains("31 destinations for 32 layers"));
}

#[test]
fn units_are_layer_major_and_bounded() {
    let mut r = req(128, 256); // 32K tokens: 128 MiB per layer
    let units = plan_units(&r);
    assert_eq!(units.len(), 32 * 8);
    assert!(units.iter().all(|u| u.len <= MAX_UNIT_BYTES as u64));
    assert!(units.windows(2).all(|w| w[0].layer <= w[1].layer));
    let l0: u64 = units.iter().filter(|u| u.layer == 0).map(|u| u.len).sum();
    assert_eq!(l0, r.layer_bytes());
    r.max_unit_bytes = 300 << 10; // smaller than a 1 MiB slice: slices split
    let units = plan_units(&r);
    assert!(units
        .iter()
        .all(|u| u.pieces.len() == 1 && u.len <= 300 << 10));
    assert_eq!(
        units
            .iter()
            .filter(|u| u.layer == 5)
            .map(|u| u.len)
            .sum::<u64>(),
        r.layer_bytes()
    );
}

#[test]
fn hostile_sizes_are_refused_before_planning() {
    // 2^24 bytes per token, tokens per chunk and tokens: once a 24 GB unit plan.
    let mut r = req(1, 256);
    r.geometry.bytes_per_token_per_layer = 1 << 24;
    r.geometry.tokens_per_chunk = 1 << 24;
    r.chunk_tokens = vec![1 << 24];
    let mut b = BytesMut::new();
    r.encode(&mut b);
    assert!(matches!(
        GatherRequest::decode(&b, 4096),
        Err(ProtocolError::Invalid {
            field: "geometry.bytes_per_token_per_layer",
            ..
        })
    ));
    // Every field in range, the product too large to plan.
    let mut r = req(4096, 256);
    r.geometry.layers = 4096;
    r.layers = 0..4096;
    assert!(matches!(
        r.validate(4096),
        Err(ProtocolError::TooLarge {
            what: "slices per request (layers x chunks)",
            got: 16_777_216,
            ..
        })
    ));
    // The bound holds for what does validate: the plan never exceeds it.
    let mut r = req(8, 256);
    r.max_unit_bytes = MIN_UNIT_BYTES;
    r.validate(4096).unwrap();
    let units = plan_units(&r).len() as u64;
    assert!(units <= 32 * r.max_units_per_layer(), "{units}");
}

/// Queues a 4-byte unit of layer 4 whose CRC32C (0) does not match its payload.
fn send_corrupt_unit(s: &mut ServerConnection) {
    let h = UnitHeader {
        layer: 4,
        crc32c: 0,
        offset: 0,
        len: 4,
    };
    s.send_unit(h, [Bytes::from_static(b"abcd")]);
}

#[test]
fn client_and_server_machines_talk() {
    let mut c = ClientConnection::new();
    let mut s = ServerConnection::new(ServerLimits::default());
    let pump_cs = |c: &mut ClientConnection, s: &mut ServerConnection| {
        let mut b = BytesMut::new();
        while let Some(x) = c.poll_transmit() {
            b.extend_from_slice(&x);
        }
        s.handle_bytes(&mut b)
    };
    let pump_sc = |s: &mut ServerConnection, c: &mut ClientConnection| {
        let mut b = BytesMut::new();
        while let Some(x) = s.poll_transmit() {
            b.extend_from_slice(&x);
        }
        c.handle_bytes(&mut b)
    };
    pump_cs(&mut c, &mut s).unwrap();
    pump_sc(&mut s, &mut c).unwrap();
    assert!(matches!(c.poll_event(), Some(ClientEvent::Connected(_))));
    let r = req(2, 10);
    c.start_gather(&r).unwrap();
    pump_cs(&mut c, &mut s).unwrap();
    let Some(ServerEvent::Gather(g)) = s.poll_event() else {
        panic!("no gather")
    };
    assert_eq!(*g, r);
    let payload = Bytes::from(vec![5u8; 1000]);
    s.accept(7, 1, 1000);
    s.send_unit(
        UnitHeader {
            layer: 3,
            crc32c: crate::layout::crc::crc32c(&payload),
            offset: 0,
            len: 1000,
        },
        [payload.slice(..400), payload.slice(400..)],
    );
    send_corrupt_unit(&mut s);
    s.finish(7, 2, 1004);
    pump_sc(&mut s, &mut c).unwrap();
    assert!(matches!(
        c.poll_event(),
        Some(ClientEvent::Accepted(UnitTally { request_id: 7, .. }))
    ));
    assert_eq!(
        c.poll_event(),
        Some(ClientEvent::Unit {
            layer: 3,
            offset: 0,
            data: payload
        })
    );
    assert!(matches!(
        c.poll_event(),
        Some(ClientEvent::Corrupt { layer: 4, .. })
    ));
    assert!(matches!(
        c.poll_event(),
        Some(ClientEvent::End(UnitTally { request_id: 7, .. }))
    ));
    assert!(c.is_idle());
}

#[test]
fn direct_units_leave_payloads_to_the_driver() {
    let mut c = ClientConnection::new();
    let mut s = ServerConnection::new(ServerLimits::default());
    let mut wire = BytesMut::new();
    let pump = |from: &mut dyn FnMut() -> Option<Bytes>, b: &mut BytesMut| {
        while let Some(x) = from() {
            b.extend_from_slice(&x);
        }
    };
    pump(&mut || c.poll_transmit(), &mut wire);
    s.handle_bytes(&mut wire).unwrap();
    pump(&mut || s.poll_transmit(), &mut wire);
    c.handle_bytes(&mut wire).unwrap();
    assert!(matches!(c.poll_event(), Some(ClientEvent::Connected(_))));
    assert!(c.unit_end(0).is_err(), "no unit in progress");
    let r = req(2, 10);
    c.start_gather(&r).unwrap();
    c.set_direct_units(true);
    pump(&mut || c.poll_transmit(), &mut wire);
    s.handle_bytes(&mut wire).unwrap();
    assert!(matches!(s.poll_event(), Some(ServerEvent::Gather(_))));
    let payload = Bytes::from((0..1000u32).map(|i| i as u8).collect::<Vec<u8>>());
    let good = UnitHeader {
        layer: 3,
        crc32c: crate::layout::crc::crc32c(&payload),
        offset: 0,
        len: 1000,
    };
    s.accept(7, 2, 1004);
    s.send_unit(good, [payload.clone()]);
    send_corrupt_unit(&mut s);
    s.finish(7, 2, 1004);
    let mut all = BytesMut::new();
    pump(&mut || s.poll_transmit(), &mut all);
    // The Accepted frame, then only 20 bytes of the unit's 32-byte prefix: nothing yet.
    let accepted_len = all.len() - (32 + 1000) - (32 + 4) - 32;
    let mut b = all.split_to(accepted_len + 20);
    c.handle_bytes(&mut b).unwrap();
    assert!(matches!(c.poll_event(), Some(ClientEvent::Accepted { .. })));
    assert_eq!(c.poll_event(), None);
    b.unsplit(all);
    c.handle_bytes(&mut b).unwrap();
    assert_eq!(c.poll_event(), Some(ClientEvent::UnitBegin(good)));
    // The payload is the driver's: nothing is decoded until unit_end.
    c.handle_bytes(&mut b).unwrap();
    assert_eq!(c.poll_event(), None);
    assert_eq!(&b[..1000], &payload[..]);
    let got = b.split_to(1000);
    assert_eq!(c.unit_end(crate::layout::crc::crc32c(&got)), Ok(true));
    c.handle_bytes(&mut b).unwrap();
    let Some(ClientEvent::UnitBegin(h)) = c.poll_event() else {
        panic!("second unit")
    };
    assert_eq!((h.layer, h.len), (4, 4));
    let got = b.split_to(4);
    assert_eq!(
        c.unit_end(crate::layout::crc::crc32c(&got)),
        Ok(false),
        "corrupt unit"
    );
    c.handle_bytes(&mut b).unwrap();
    assert!(matches!(
        c.poll_event(),
        Some(ClientEvent::End(UnitTally { request_id: 7, .. }))
    ));
    assert!(c.is_idle());

    // A unit outside the request is refused from its prefix alone.
    c.start_gather(&r).unwrap();
    let mut bad = BytesMut::new();
    bad.extend_from_slice(
        &UnitHeader {
            layer: 99,
            crc32c: 0,
            offset: 0,
            len: 8,
        }
        .encode_prefix(),
    );
    let e = c.handle_bytes(&mut bad).unwrap_err();
    assert!(e.to_string().contains("layer 99"), "{e}");
    assert!(c.is_closed());
}

#[test]
fn save_sizes_are_bounded_when_decoded() {
    let g = KvGeometry::llama31_8b();
    let kb = KeyBuilder::new("ns", &g, HashAlgo::Sha256Cbor).unwrap();
    let save = |f: &dyn Fn(&mut SaveRequest)| {
        let mut r = SaveRequest {
            request_id: 1,
            bucket: "kv-test".into(),
            prefix: kb.prefix().to_string(),
            geometry: WireGeometry::from_geometry(&g),
            chunks: vec![SaveChunk {
                hash: ChunkHash::from_digest([1; 32]),
                tokens: 256,
            }],
        };
        f(&mut r);
        let mut b = BytesMut::new();
        r.encode(&mut b);
        SaveRequest::decode(&b, 4096)
    };
    assert!(save(&|_| {}).is_ok());
    // The same per-field bounds as a gather: a 2^24-byte token, 2^24 tokens per chunk,
    // more tokens than a chunk holds, 5,000 layers, no chunk.
    let bad: [&dyn Fn(&mut SaveRequest); 5] = [
        &|r| r.geometry.bytes_per_token_per_layer = 1 << 24,
        &|r| r.geometry.tokens_per_chunk = 1 << 24,
        &|r| r.chunks[0].tokens = 257,
        &|r| r.geometry.layers = 5000,
        &|r| r.chunks.clear(),
    ];
    for f in bad {
        assert!(save(f).is_err());
    }
    // The largest object a valid save can name is bounded: 4,096 layers of 64 GiB
    // slices (the server then refuses it against max_request_bytes before reading data).
    let r = save(&|r| {
        r.geometry.layers = 4096;
        r.geometry.bytes_per_token_per_layer = MAX_BYTES_PER_TOKEN_PER_LAYER;
        r.geometry.tokens_per_chunk = MAX_TOKENS_PER_CHUNK;
        r.chunks[0].tokens = MAX_TOKENS_PER_CHUNK;
    })
    .unwrap();
    assert_eq!(r.object_len(0), crate::layout::object_len(4096, 1 << 36));
}

#[test]
fn frame_headers_are_screened_before_any_body_is_buffered() {
    let hello = |b: &mut BytesMut| {
        b.extend_from_slice(&PREFACE);
        Frame::Hello {
            version_min: PROTOCOL_VERSION,
            version_max: PROTOCOL_VERSION,
        }
        .encode(b);
    };
    // Before authentication: a 16 MiB save-data header is refused from its 8 bytes,
    // and nothing is reserved for its body.
    let mut s = ServerConnection::with_auth(ServerLimits::default(), [7; 32]);
    let mut b = BytesMut::with_capacity(64);
    hello(&mut b);
    s.handle_bytes(&mut b).unwrap();
    assert!(!s.is_established());
    encode_frame_header(FrameType::SaveData, 16 << 20, &mut b);
    assert_eq!(s.partial_frame_len(&b), Some(8 + (16 << 20)));
    let e = s.handle_bytes(&mut b).unwrap_err();
    assert_eq!(
        e,
        ProtocolError::UnexpectedFrame {
            frame: "SaveData",
            state: "awaiting authentication"
        }
    );
    assert!(b.capacity() < 4096, "{} bytes reserved", b.capacity());
    // An Auth frame longer than any access key allows: refused from its header.
    let mut s = ServerConnection::with_auth(ServerLimits::default(), [7; 32]);
    let mut b = BytesMut::with_capacity(64);
    hello(&mut b);
    encode_frame_header(FrameType::Auth, 64 << 10, &mut b);
    let e = s.handle_bytes(&mut b).unwrap_err();
    assert!(
        matches!(e, ProtocolError::TooLarge { what: "frame body before authentication", got: 65536, max } if max == MAX_HANDSHAKE_BODY_BYTES as u64),
        "{e}"
    );
    assert!(b.capacity() < 4096, "{} bytes reserved", b.capacity());
    // Established: a frame the state does not take is refused from its header too.
    let mut s = ServerConnection::new(ServerLimits::default());
    let mut b = BytesMut::with_capacity(64);
    hello(&mut b);
    s.handle_bytes(&mut b).unwrap();
    assert!(s.is_established() && s.is_idle());
    encode_frame_header(FrameType::SaveData, 16 << 20, &mut b);
    let e = s.handle_bytes(&mut b).unwrap_err();
    assert!(
        matches!(
            e,
            ProtocolError::UnexpectedFrame {
                frame: "SaveData",
                state: "idle"
            }
        ),
        "{e}"
    );
    assert!(b.capacity() < 4096, "{} bytes reserved", b.capacity());
    // A descriptor the state takes: its full length is known from the header.
    let mut s = ServerConnection::new(ServerLimits::default());
    let mut b = BytesMut::new();
    hello(&mut b);
    s.handle_bytes(&mut b).unwrap();
    encode_frame_header(FrameType::Gather, 5000, &mut b);
    b.extend_from_slice(&[0u8; 100]);
    assert_eq!(s.partial_frame_len(&b), Some(5008));
    s.handle_bytes(&mut b).unwrap();
    assert_eq!(s.partial_frame_len(&b), Some(5008), "still partial");
}

#[test]
fn server_rejects_bad_preface_and_oversized_descriptor() {
    let mut s = ServerConnection::new(ServerLimits::default());
    let mut b = BytesMut::from(&b"GET / HTTP/1.1\r\n"[..]);
    assert_eq!(s.handle_bytes(&mut b), Err(ProtocolError::BadPreface));
    assert!(s.is_closed());
    let mut s = ServerConnection::new(ServerLimits {
        max_descriptor_bytes: 1000,
        ..Default::default()
    });
    let mut b = BytesMut::new();
    b.extend_from_slice(&PREFACE);
    Frame::Hello {
        version_min: PROTOCOL_VERSION,
        version_max: PROTOCOL_VERSION,
    }
    .encode(&mut b);
    encode_frame_header(FrameType::Gather, 5000, &mut b);
    let e = s.handle_bytes(&mut b).unwrap_err();
    assert!(
        matches!(
            e,
            ProtocolError::TooLarge {
                what: "descriptor size",
                got: 5000,
                max: 1000
            }
        ),
        "{e}"
    );
    let mut out = BytesMut::new();
    while let Some(x) = s.poll_transmit() {
        out.extend_from_slice(&x);
    }
    let mut c = ClientConnection::new();
    c.handle_bytes(&mut out).unwrap();
    assert!(matches!(c.poll_event(), Some(ClientEvent::Connected(_))));
    assert!(matches!(
        c.poll_event(),
        Some(ClientEvent::Error {
            code: ErrorCode::DescriptorTooLarge,
            ..
        })
    ));
}
