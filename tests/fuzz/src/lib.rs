//! The bodies of the fuzz targets (`fuzz_targets/*.rs`), one function a target. The
//! integration test `security_fuzz_regressions` includes this file as a module and replays
//! the stored crash inputs through the same functions, so the two cannot drift apart. It
//! names only `objectcache_core` and `bytes`, which both crates depend on.

use bytes::BytesMut;
use objectcache_core::layout::{
    decode_chunk, encode_chunk, slice_range, verify_slice, ChunkHeader,
};
use objectcache_core::protocol::{
    decode_frame, plan_units, ClientConnection, GatherRequest, SaveRequest, ServerConnection,
    ServerLimits, MAX_UNITS_PER_REQUEST,
};
use objectcache_core::{Dtype, KvGeometry};

/// The geometry the chunk objects are decoded against: 3 layers of one 8-dimension fp16 head,
/// 4 tokens a chunk.
pub fn geometry() -> KvGeometry {
    let mut g = KvGeometry::new("fuzz/small", 3, 1, 8, Dtype::Fp16).expect("geometry");
    g.tokens_per_chunk = 4;
    g
}

/// Target `object_header`: the chunk object parser (`ChunkHeader::decode`, `decode_chunk`,
/// slice verification). Any input must give `Ok` or a `FormatError`, never a panic, and an
/// `Ok` decode must hold only bytes whose CRC32C matched.
pub fn object_header(data: &[u8]) {
    // 1. The header alone, and the sizes derived from it.
    if let Ok(h) = ChunkHeader::decode(data) {
        let _ = h.object_len();
        for l in 0..h.layers.min(4) {
            let _ = slice_range(l, h.slice_len);
        }
        let g = geometry();
        let _ = h.check(&g, g.tokens_per_chunk);
    }
    // 2. A whole object against a fixed geometry: raw input, and a valid object with the
    //    input's bytes written over part of it (reaches the slice CRC checks).
    let g = geometry();
    let _ = decode_chunk(&g, g.tokens_per_chunk, data);
    if data.len() >= 2 {
        let slice = (g.tokens_per_chunk as u64 * g.bytes_per_token_per_layer()) as usize;
        let layer = vec![0x5au8; slice];
        let mut obj = encode_chunk(&g, g.tokens_per_chunk, |_| &layer[..]).expect("encode");
        let at = data[0] as usize % obj.len();
        let n = (data.len() - 1).min(obj.len() - at);
        obj[at..at + n].copy_from_slice(&data[1..1 + n]);
        // Changed payload bytes that still decode must have kept their CRC valid; a changed
        // byte in the header fields would have been caught by `check`.
        if let Ok((_, slices)) = decode_chunk(&g, g.tokens_per_chunk, &obj) {
            for (l, s) in slices.iter().enumerate() {
                let r = slice_range(l as u32, s.len() as u64);
                verify_slice(l, &obj[r.start as usize..r.end as usize], s.len() as u64)
                    .expect("an Ok decode holds only verified slices");
            }
        }
    }
}

/// Target `gather_descriptor`: the gather and save descriptor parsers
/// (`GatherRequest::decode`, `SaveRequest::decode`) together with the unit planner: any body
/// gives a request or a `ProtocolError`, never a panic, and a request that decodes plans in
/// bounded memory (run with `-rss_limit_mb`, as scripts/fuzz-smoke.sh does).
pub fn gather_descriptor(data: &[u8]) {
    if let Ok(req) = GatherRequest::decode(data, 4096) {
        let units = plan_units(&req);
        assert!(units.len() as u64 <= MAX_UNITS_PER_REQUEST);
    }
    let _ = SaveRequest::decode(data, 4096);
}

/// Target `frame_decoder`: the frame decoder (`decode_frame`) and both connection state
/// machines fed the same bytes: any stream gives frames, "need more" or a `ProtocolError`,
/// never a panic.
pub fn frame_decoder(data: &[u8]) {
    let mut buf = BytesMut::from(data);
    while let Ok(Some(_)) = decode_frame(&mut buf, 1 << 20, 4096) {}
    let mut s = ServerConnection::new(ServerLimits::default());
    let _ = s.handle_bytes(&mut BytesMut::from(data));
    let mut c = ClientConnection::new();
    let _ = c.handle_bytes(&mut BytesMut::from(data));
}
