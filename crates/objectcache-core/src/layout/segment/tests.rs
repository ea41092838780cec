//! Tests of the segment format: offsets, markers, digests, and hostile headers.
use super::*;
use crate::layout::encode_marker;

fn tiny() -> KvGeometry {
    let mut g = KvGeometry::new("test/tiny", 3, 2, 2, Dtype::Fp16).unwrap();
    g.tokens_per_chunk = 4;
    g
}

fn hashes(n: usize) -> Vec<ChunkHash> {
    // Unequal lengths on purpose: external hashes are 1..=64 bytes each.
    (0..n)
        .map(|i| ChunkHash::new(&vec![i as u8 + 1; 1 + i * 7 % 64]).unwrap())
        .collect()
}

/// Layer l of chunk i is filled with the byte `16 l + i + 1`.
fn fill(l: u32, i: u32) -> u8 {
    (16 * l + i + 1) as u8
}

#[test]
fn slices_sit_layer_major_across_chunks_and_verify_alone() {
    let g = tiny();
    let slice = g.slice_bytes() as usize;
    let hs = hashes(5);
    let data: Vec<Vec<Vec<u8>>> = (0..3)
        .map(|l| (0..5).map(|i| vec![fill(l, i); slice]).collect())
        .collect();
    let (h, obj) =
        encode_segment_parts(&g, &hs, |l, i| vec![&data[l as usize][i as usize][..]]).unwrap();
    assert_eq!(obj.len() as u64, h.object_len());
    let list: u64 = hs.iter().map(|x| 1 + x.as_bytes().len() as u64).sum();
    assert_eq!(h.header_len as u64, 64 + list + 4);
    assert_eq!(
        h.object_len(),
        h.header_len as u64 + 3 * 5 * (slice as u64 + 4)
    );
    // Decoding gives the header and the chunk list back.
    let back = SegmentHeader::decode(&obj).unwrap();
    assert_eq!(back, h);
    back.check(&g).unwrap();
    assert_eq!(back.decode_chunk_list(&obj).unwrap(), hs);
    // Every slice is where the layout says, holds its bytes and verifies on its own.
    let lay = back.layout();
    for l in 0..3u32 {
        for i in 0..5u32 {
            let r = lay.slice_range(l, i);
            let s = &obj[r.start as usize..r.end as usize];
            crate::layout::verify_slice(l as usize, s, slice as u64).unwrap();
            assert!(
                s[..slice].iter().all(|&b| b == fill(l, i)),
                "layer {l} chunk {i}"
            );
        }
        // A run of chunks of one layer is one range: its slices back to back.
        let r = lay.run_range(l, 1..4);
        assert_eq!(r.start, lay.slice_range(l, 1).start);
        assert_eq!(r.end, lay.slice_range(l, 3).end);
    }
    // Layer 1 of chunk 0 follows layer 0 of the last chunk.
    assert_eq!(lay.slice_range(1, 0).start, lay.slice_range(0, 4).end);
}

#[test]
fn markers_of_both_versions_decode_and_give_the_layout() {
    let g = tiny();
    let hs = hashes(3);
    let h = SegmentHeader::for_geometry(&g, &hs).unwrap();
    let m = SegmentMarker::new(&h, 2, segment_digest(&hs));
    let b = m.encode();
    assert_eq!(decode_marker(&b).unwrap(), Marker::Segment(m.clone()));
    assert_eq!(m.layout(g.slice_bytes()), h.layout());
    assert_eq!(
        decode_marker(&encode_marker(1234)).unwrap(),
        Marker::Chunk { object_len: 1234 }
    );
    // A flipped bit, a short marker, an index past the end, another magic: refused.
    let mut bad = b;
    bad[30] ^= 1;
    assert_eq!(decode_marker(&bad), Err(FormatError::HeaderChecksum));
    assert!(matches!(
        decode_marker(&b[..40]),
        Err(FormatError::Truncated { .. })
    ));
    let past = SegmentMarker { index: 3, ..m };
    assert!(matches!(
        decode_marker(&past.encode()),
        Err(FormatError::InvalidField(_))
    ));
    assert_eq!(
        decode_marker(b"OCKVCHNK........"),
        Err(FormatError::BadMagic)
    );
}

#[test]
fn digest_tells_chunk_lists_apart() {
    let hs = hashes(4);
    assert_eq!(segment_digest(&hs), segment_digest(&hashes(4)));
    assert_ne!(segment_digest(&hs), segment_digest(&hs[..3]));
    let mut swapped = hs.clone();
    swapped.swap(1, 2);
    assert_ne!(segment_digest(&hs), segment_digest(&swapped));
    // Length bytes keep [ab][c] and [a][bc] apart.
    let ab_c = [
        ChunkHash::new(b"ab").unwrap(),
        ChunkHash::new(b"c").unwrap(),
    ];
    let a_bc = [
        ChunkHash::new(b"a").unwrap(),
        ChunkHash::new(b"bc").unwrap(),
    ];
    assert_ne!(segment_digest(&ab_c), segment_digest(&a_bc));
}

#[test]
fn hostile_headers_are_refused_before_anything_is_sized_from_them() {
    let g = tiny();
    let hs = hashes(2);
    let h = SegmentHeader::for_geometry(&g, &hs).unwrap();
    let good = h.encode(&hs).unwrap();
    let patch = |at: usize, bytes: &[u8]| {
        let mut b = good.clone();
        b[at..at + bytes.len()].copy_from_slice(bytes);
        let crc = crate::layout::crc::crc32c(&b[0..60]);
        b[60..64].copy_from_slice(&crc.to_le_bytes());
        SegmentHeader::decode(&b)
    };
    let invalid = |r: Result<SegmentHeader, FormatError>, what: &str| match r {
        Err(FormatError::InvalidField(m)) => assert!(m.contains(what), "{m}"),
        other => panic!("{what}: {other:?}"),
    };
    invalid(patch(28, &0u32.to_le_bytes()), "chunks");
    invalid(patch(28, &(MAX_SEGMENT_CHUNKS + 1).to_le_bytes()), "chunks");
    invalid(patch(52, &70u32.to_le_bytes()), "header length");
    invalid(patch(52, &u32::MAX.to_le_bytes()), "header length");
    invalid(patch(40, &(u64::MAX / 2).to_le_bytes()), "slice length");
    invalid(patch(56, &[1]), "reserved");
    // Huge but consistent geometry whose object length overflows u64.
    let mut b = good.clone();
    b[24..28].copy_from_slice(&u32::MAX.to_le_bytes()); // layers
    b[32..36].copy_from_slice(&u32::MAX.to_le_bytes()); // bytes/token/layer
    b[48..52].copy_from_slice(&u32::MAX.to_le_bytes()); // tokens/chunk
    let slice = u32::MAX as u64 * u32::MAX as u64;
    b[40..48].copy_from_slice(&slice.to_le_bytes());
    let crc = crate::layout::crc::crc32c(&b[0..60]);
    b[60..64].copy_from_slice(&crc.to_le_bytes());
    invalid(SegmentHeader::decode(&b), "overflow");
    // The chunk list: its CRC, and entries that do not fill it.
    let mut flip = good.clone();
    flip[66] ^= 1;
    assert_eq!(h.decode_chunk_list(&flip), Err(FormatError::HeaderChecksum));
    assert!(matches!(
        h.decode_chunk_list(&good[..good.len() - 1]),
        Err(FormatError::Truncated { .. })
    ));
    // A geometry of the same size but another layout is a mismatch.
    let other = KvGeometry::new("test/tiny", 3, 1, 4, Dtype::Fp16).unwrap();
    assert!(matches!(
        h.check(&other.with_tokens_per_chunk(4).unwrap()),
        Err(FormatError::GeometryMismatch(_))
    ));
}

#[test]
fn encoding_refuses_wrong_sizes_and_counts() {
    let g = tiny();
    let slice = vec![0u8; g.slice_bytes() as usize];
    let hs = hashes(2);
    assert!(matches!(
        encode_segment_parts(&g, &hs, |l, i| if l == 2 && i == 1 {
            vec![&slice[1..]]
        } else {
            vec![&slice[..]]
        }),
        Err(FormatError::WrongSize(m)) if m.contains("layer 2 of chunk 1")
    ));
    assert!(matches!(
        SegmentHeader::for_geometry(&g, &[]),
        Err(FormatError::InvalidField(_))
    ));
    let h = SegmentHeader::for_geometry(&g, &hs).unwrap();
    assert!(matches!(h.encode(&hs[..1]), Err(FormatError::WrongSize(_))));
}
