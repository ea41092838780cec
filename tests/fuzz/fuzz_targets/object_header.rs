//! Fuzz target: the chunk object parser (`ChunkHeader::decode`, `decode_chunk`, slice
//! verification). Any input must give `Ok` or a `FormatError`, never a panic, and an `Ok`
//! decode must hold only bytes whose CRC32C matched.
#![no_main]

use libfuzzer_sys::fuzz_target;
use objectcache_core::layout::{
    decode_chunk, encode_chunk, slice_range, verify_slice, ChunkHeader,
};
use objectcache_core::{Dtype, KvGeometry};

fn geometry() -> KvGeometry {
    let mut g = KvGeometry::new("fuzz/small", 3, 1, 8, Dtype::Fp16).expect("geometry");
    g.tokens_per_chunk = 4;
    g
}

fuzz_target!(|data: &[u8]| {
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
        let changed = obj[at..at + n] != data[1..1 + n];
        obj[at..at + n].copy_from_slice(&data[1..1 + n]);
        match decode_chunk(&g, g.tokens_per_chunk, &obj) {
            Ok((_, slices)) => {
                for (l, s) in slices.iter().enumerate() {
                    let r = slice_range(l as u32, s.len() as u64);
                    verify_slice(l, &obj[r.start as usize..r.end as usize], s.len() as u64)
                        .expect("an Ok decode holds only verified slices");
                }
                // Changed payload bytes that still decode must have kept their CRC valid;
                // a changed byte in the header fields would have been caught by `check`.
                let _ = changed;
            }
            Err(_) => {}
        }
    }
});
