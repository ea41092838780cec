//! Prefix-chained chunk hashing, bit-compatible with vLLM's `sha256_cbor` block hashes.
//!
//! vLLM (`vllm/v1/core/kv_cache_utils.py`, `hash_block_tokens` with `sha256_cbor`) computes
//! `hash_i = SHA-256(CBOR_canonical((hash_{i-1}, tuple(block_tokens_i), extra_keys_i)))`
//! where the first block's parent is `NONE_HASH = SHA-256(CBOR_canonical(seed))`, `seed` being
//! the `PYTHONHASHSEED` string, and `extra_keys_i` is a tuple (LoRA name, multimodal hashes,
//! cache salt on the first block only) or `None`. Only full blocks are hashed. With the same
//! seed, an engine's block hashes and ours are interchangeable (checked against vectors from
//! the reference algorithm in `tests/data/vllm_sha256_cbor_vectors.json`).
//!
//! CBOR encoding is done by the `ciborium` crate: Python's canonical `cbor2` encodes these
//! values (byte strings, unsigned integers, text, arrays, null) with the same shortest-form
//! bytes.
#![forbid(unsafe_code)]

use crate::error::Error;
use crate::layout::ChunkHash;
use serde::Serialize;
use sha2::{Digest, Sha256};

/// One element of a block's `extra_keys` tuple.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(untagged)]
pub enum ExtraKey {
    /// A string: LoRA name, cache salt, multimodal hash.
    Str(String),
    /// An integer (e.g. a multimodal offset).
    Int(i64),
}

/// Parameters of the hash chain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HashParams {
    /// The engine's hash seed (vLLM: `PYTHONHASHSEED`); the chain's root is
    /// `SHA-256(CBOR(seed))`. Engines and ObjectCache must use the same seed to share entries.
    pub seed: String,
    /// Tokens per block (= [`crate::layout::KvGeometry::tokens_per_chunk`]).
    pub block_size: usize,
    /// Extra keys of the first block (cache salt, LoRA name), `None` for none. A tenant's salt
    /// here makes its hashes, and so its keys, unguessable to other tenants.
    pub first_block_extra: Option<Vec<ExtraKey>>,
}

impl HashParams {
    /// Seed `"0"`, no extra keys.
    pub fn new(block_size: usize) -> Self {
        HashParams {
            seed: "0".into(),
            block_size,
            first_block_extra: None,
        }
    }
    /// Sets a cache salt (vLLM's `cache_salt`), which enters the first block's extra keys.
    pub fn with_salt(mut self, salt: &str) -> Self {
        self.first_block_extra = Some(vec![ExtraKey::Str(salt.to_string())]);
        self
    }
}

fn cbor_sha256<T: Serialize>(v: &T) -> [u8; 32] {
    let mut buf = Vec::with_capacity(64);
    ciborium::into_writer(v, &mut buf).expect("CBOR encoding into a Vec cannot fail");
    Sha256::digest(&buf).into()
}

/// `NONE_HASH` for a seed: SHA-256 over the CBOR text string `seed`.
pub fn none_hash(seed: &str) -> [u8; 32] {
    cbor_sha256(&seed)
}

/// Hash of one block given its parent hash.
pub fn block_hash(parent: &[u8; 32], tokens: &[u32], extra: Option<&[ExtraKey]>) -> [u8; 32] {
    cbor_sha256(&(serde_bytes::Bytes::new(parent), tokens, extra))
}

/// Hashes of every **full** block of `tokens`, chained from the seed's `NONE_HASH`. A trailing
/// partial block gets no hash (it is neither saved nor reported as a hit).
///
/// # Errors
/// [`Error::InvalidArgument`] if `block_size` is 0.
pub fn chunk_hashes(tokens: &[u32], p: &HashParams) -> Result<Vec<ChunkHash>, Error> {
    if p.block_size == 0 {
        return Err(Error::InvalidArgument(
            "hash block_size must be at least 1".into(),
        ));
    }
    let mut parent = none_hash(&p.seed);
    let mut out = Vec::with_capacity(tokens.len() / p.block_size);
    for (i, block) in tokens.chunks_exact(p.block_size).enumerate() {
        let extra = if i == 0 {
            p.first_block_extra.as_deref()
        } else {
            None
        };
        parent = block_hash(&parent, block, extra);
        out.push(ChunkHash::from_digest(parent));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn none_hash_of_seed_zero() {
        assert_eq!(
            hex::encode(none_hash("0")),
            "4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e"
        );
    }

    #[test]
    fn vllm_reference_vectors() {
        let v: serde_json::Value = serde_json::from_str(include_str!(
            "../../../../tests/data/vllm_sha256_cbor_vectors.json"
        ))
        .unwrap();
        let cases = v["cases"].as_array().unwrap();
        assert!(cases.len() >= 5);
        for (i, c) in cases.iter().enumerate() {
            let seed = c["python_hash_seed"].as_str().unwrap();
            assert_eq!(
                hex::encode(none_hash(seed)),
                c["none_hash"].as_str().unwrap(),
                "case {i} none_hash"
            );
            let tokens: Vec<u32> = c["token_ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_u64().unwrap() as u32)
                .collect();
            let extra = c["extra_keys_first_block"].as_array().map(|a| {
                a.iter()
                    .map(|e| match e.as_str() {
                        Some(s) => ExtraKey::Str(s.into()),
                        None => ExtraKey::Int(e.as_i64().unwrap()),
                    })
                    .collect::<Vec<_>>()
            });
            let p = HashParams {
                seed: seed.into(),
                block_size: c["block_size"].as_u64().unwrap() as usize,
                first_block_extra: extra,
            };
            let got: Vec<String> = chunk_hashes(&tokens, &p)
                .unwrap()
                .iter()
                .map(|h| h.to_hex())
                .collect();
            let want: Vec<String> = c["block_hashes"]
                .as_array()
                .unwrap()
                .iter()
                .map(|h| h.as_str().unwrap().to_string())
                .collect();
            assert_eq!(got, want, "case {i}");
        }
    }

    #[test]
    fn salt_changes_every_hash() {
        let toks: Vec<u32> = (0..64).collect();
        let a = chunk_hashes(&toks, &HashParams::new(16)).unwrap();
        let b = chunk_hashes(&toks, &HashParams::new(16).with_salt("tenant-a")).unwrap();
        assert_eq!(a.len(), 4);
        assert!(a.iter().zip(&b).all(|(x, y)| x != y));
    }
}
