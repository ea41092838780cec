//! The benchmark's data: seeded chunk hashes and chunk objects of pseudo-random KV, and
//! destination buffers with every page touched.

use bytes::Bytes;
use objectcache::layout::{encode_chunk, ChunkHash, KvGeometry};

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

pub(super) fn hashes(n: usize, salt: u64) -> Vec<ChunkHash> {
    (0..n)
        .map(|c| {
            let mut d = [0u8; 32];
            for (k, w) in d.chunks_mut(8).enumerate() {
                w.copy_from_slice(&splitmix(salt ^ (c as u64 * 4 + k as u64)).to_le_bytes());
            }
            ChunkHash::from_digest(d)
        })
        .collect()
}

pub(super) fn object(g: &KvGeometry, c: usize) -> Bytes {
    let sl = g.slice_bytes() as usize;
    let data: Vec<Vec<u8>> = (0..g.layers)
        .map(|l| {
            let mut v = vec![0u8; sl];
            let s = splitmix((c as u64) << 32 | l as u64);
            for (i, w) in v.chunks_mut(8).enumerate() {
                let x = splitmix(s ^ i as u64).to_le_bytes();
                w.copy_from_slice(&x[..w.len()]);
            }
            v
        })
        .collect();
    Bytes::from(encode_chunk(g, g.tokens_per_chunk, |l| &data[l as usize]).expect("encode"))
}

pub(super) fn touched(n: usize) -> Vec<u8> {
    let mut v = vec![0u8; n];
    v.iter_mut().step_by(4096).for_each(|b| *b = 1);
    v
}
