//! Replays the fuzz regressions (tests/fuzz/regressions/<target>/*.hex: inputs that once
//! crashed a fuzz target, stored as hex text) and a few hand-made hostile inputs through the
//! same code as the fuzz targets: each must end as `Ok` or an error, never a panic.

use objectcache::layout::encode_chunk;

/// The fuzz targets' bodies (`geometry`, `object_header`, `gather_descriptor`,
/// `frame_decoder`): the fuzz crate's library, shared so that a replay runs exactly what the
/// fuzzer ran.
#[path = "../fuzz/src/lib.rs"]
mod targets;

use targets::{frame_decoder, gather_descriptor, geometry, object_header};

fn replay(target: &str, f: fn(&[u8])) -> usize {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fuzz/regressions")
        .join(target);
    let mut n = 0;
    if let Ok(rd) = std::fs::read_dir(&dir) {
        for e in rd {
            let p = e.unwrap().path();
            if p.extension().is_some_and(|x| x == "hex") {
                let txt: String = std::fs::read_to_string(&p)
                    .unwrap()
                    .split_whitespace()
                    .collect();
                let bytes = hex::decode(&txt).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
                f(&bytes);
                n += 1;
            }
        }
    }
    n
}

#[test]
fn object_header_regressions_and_hostile_headers() {
    let n = replay("object_header", object_header);
    // Hostile headers: maximal field values, a valid header over a short body.
    let g = geometry();
    let slice = (g.tokens_per_chunk as u64 * g.bytes_per_token_per_layer()) as usize;
    let layer = vec![1u8; slice];
    let obj = encode_chunk(&g, g.tokens_per_chunk, |_| &layer[..]).unwrap();
    let mut inputs: Vec<Vec<u8>> = vec![
        vec![],
        vec![0xff; 64],
        obj[..64].to_vec(),
        obj[..obj.len() - 1].to_vec(),
    ];
    for off in (8..64).step_by(2) {
        let mut h = obj.clone();
        h[off] = 0xff;
        h[off + 1] = 0xff;
        inputs.push(h);
    }
    for i in &inputs {
        object_header(i);
        let mut x = vec![0u8];
        x.extend_from_slice(i);
        object_header(&x);
    }
    println!(
        "SECURITY|fuzz regressions + hostile object headers replayed|{}|no panic",
        n + 2 * inputs.len()
    );
}

#[test]
fn protocol_regressions_and_hostile_frames() {
    let mut n =
        replay("gather_descriptor", gather_descriptor) + replay("frame_decoder", frame_decoder);
    // Hostile inputs: every frame type byte with a maximal length, all-ones bodies.
    for ty in 0..=255u8 {
        let mut f = vec![ty, 0, 0, 0, 0xff, 0xff, 0xff, 0xff];
        f.extend_from_slice(&[0xff; 64]);
        frame_decoder(&f);
        gather_descriptor(&f);
        n += 2;
    }
    // Hostile load-group blocks (descriptor flag bit 2): a valid striped descriptor with
    // each byte of its block, and of its flags, set to 0x00 and 0xff, and cut anywhere.
    let g = geometry();
    let kb =
        objectcache::layout::KeyBuilder::new("fuzz", &g, objectcache::layout::HashAlgo::Sha256Cbor)
            .unwrap();
    let mut req = objectcache::protocol::GatherRequest::for_prefix(
        1,
        "kv-test",
        &kb,
        &g,
        vec![objectcache::ChunkHash::from_digest([3; 32]); 2],
        vec![g.tokens_per_chunk; 2],
    );
    req.group = Some(objectcache::protocol::LoadGroup {
        load_id: u64::MAX,
        stripe: 1,
        stripes: 2,
        load_layer_bytes: 2 * req.layer_bytes(),
    });
    let mut body = bytes::BytesMut::new();
    req.encode(&mut body);
    assert_eq!(
        objectcache::protocol::GatherRequest::decode(&body, 4096).unwrap(),
        req
    );
    let block = body.len() - 20;
    for at in (10..12).chain(block..body.len()) {
        for v in [0x00u8, 0xff] {
            let mut b = body.to_vec();
            b[at] = v;
            gather_descriptor(&b);
            let mut f = vec![0x02, 0, 0, 0];
            f.extend_from_slice(&(b.len() as u32).to_le_bytes());
            f.extend_from_slice(&b);
            frame_decoder(&f);
            n += 2;
        }
    }
    for cut in block..body.len() {
        gather_descriptor(&body[..cut]);
        n += 1;
    }
    // Hostile segment placements (descriptor flag bit 4): the striped descriptor with chunk 1
    // in a segment, each byte of the placement set to 0x00 and 0xff, and cut anywhere.
    let slice = g.slice_bytes() + 4;
    let header_len = 64 + 2 * 33 + 4;
    req.segments = objectcache::protocol::SegmentPlacement::from_runs(
        &[objectcache::layout::Run::Segment(
            objectcache::layout::SegmentRun {
                positions: 1..2,
                digest: [7; 32],
                first_index: 1,
                chunks: 2,
                header_len,
                object_len: header_len as u64 + g.layers as u64 * 2 * slice,
            },
        )],
        0..2,
    )
    .unwrap();
    let mut body = bytes::BytesMut::new();
    req.encode(&mut body);
    assert_eq!(
        objectcache::protocol::GatherRequest::decode(&body, 4096).unwrap(),
        req
    );
    let placement = body.len() - (2 + 48 + 4 + 2 * 6);
    for at in placement..body.len() {
        for v in [0x00u8, 0xff] {
            let mut b = body.to_vec();
            b[at] = v;
            gather_descriptor(&b);
            n += 1;
        }
    }
    for cut in placement..body.len() {
        gather_descriptor(&body[..cut]);
        n += 1;
    }
    println!("SECURITY|protocol fuzz regressions + hostile frames replayed|{n}|no panic");
}
