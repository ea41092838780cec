//! Object key grammar (normative text: `docs/object-format.md`, section "Keys").
//!
//! ```text
//! data object:      {namespace}/v1/{fingerprint:016x}/tp{rank}-{world}/{algo}/kv/{hash:hex}
//! publish marker:   {namespace}/v1/{fingerprint:016x}/tp{rank}-{world}/{algo}/pub/{hash:hex}
//! segment object:   {namespace}/v1/{fingerprint:016x}/tp{rank}-{world}/{algo}/seg/{digest:hex}
//! ```
//! A segment object (format version 2, `docs/object-format.md`) holds several chunks; its
//! chunks' publish markers name it. Markers keep one key per chunk in both versions, their
//! magic telling which object holds the chunk.
//! `v1` is the object format version, `fingerprint` the [`KvGeometry::fingerprint`] (model and
//! layout), `algo` the block-hash algorithm ([`HashAlgo`]). Two models, two TP layouts, two
//! hash algorithms or two format versions therefore never share a key.
#![forbid(unsafe_code)]

use super::geometry::KvGeometry;
use crate::error::Error;
use std::fmt;

/// Which algorithm produced a chunk hash; it is part of the key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HashAlgo {
    /// vLLM's `sha256_cbor` prefix-chained block hash (32 bytes), see [`crate::hash`].
    Sha256Cbor,
    /// Opaque hashes supplied by the caller (1 to 64 bytes each), e.g. an engine's own.
    External,
}

impl HashAlgo {
    /// Key component: `sha256cbor` or `ext`.
    pub fn key_name(self) -> &'static str {
        match self {
            HashAlgo::Sha256Cbor => "sha256cbor",
            HashAlgo::External => "ext",
        }
    }

    /// Checks that every hash in `hashes` is one this algorithm makes: 32 bytes under
    /// [`HashAlgo::Sha256Cbor`] (a SHA-256 digest), any [`ChunkHash`] (1 to 64 bytes) under
    /// [`HashAlgo::External`]. A hash of another length under `sha256cbor` would be stored
    /// beside vLLM's hashes as if it were one.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the first wrong hash's position and length and the
    /// algorithm.
    pub fn check_hashes(self, hashes: &[ChunkHash]) -> Result<(), Error> {
        if self != HashAlgo::Sha256Cbor {
            return Ok(());
        }
        match hashes.iter().position(|h| h.as_bytes().len() != 32) {
            None => Ok(()),
            Some(i) => Err(Error::InvalidArgument(format!(
                "chunk hash {i} has {} bytes; hash_algo sha256cbor takes 32-byte hashes \
                 (hash_algo ext takes an engine's own hashes of 1 to 64 bytes)",
                hashes[i].as_bytes().len()
            ))),
        }
    }
}

/// One chunk's hash: 1 to 64 bytes (32 for `sha256_cbor`).
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ChunkHash(Vec<u8>);

impl ChunkHash {
    /// Wraps hash bytes.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if `bytes` is empty or longer than 64 bytes.
    pub fn new(bytes: &[u8]) -> Result<Self, Error> {
        if bytes.is_empty() || bytes.len() > 64 {
            return Err(Error::InvalidArgument(format!(
                "a chunk hash has 1 to 64 bytes, got {}",
                bytes.len()
            )));
        }
        Ok(ChunkHash(bytes.to_vec()))
    }
    /// From a 32-byte digest.
    pub fn from_digest(d: [u8; 32]) -> Self {
        ChunkHash(d.to_vec())
    }
    /// Parses lowercase or uppercase hex.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for bad hex or length.
    pub fn from_hex(s: &str) -> Result<Self, Error> {
        let b = hex::decode(s)
            .map_err(|e| Error::InvalidArgument(format!("chunk hash {s:?} is not hex: {e}")))?;
        Self::new(&b)
    }
    /// The hash bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }
    /// Lowercase hex.
    pub fn to_hex(&self) -> String {
        hex::encode(&self.0)
    }
}

impl fmt::Debug for ChunkHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ChunkHash({})", self.to_hex())
    }
}
impl fmt::Display for ChunkHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

/// Checks a namespace: 1 to 128 bytes of `[A-Za-z0-9._-]` segments separated by single `/`,
/// no segment `.` or `..`.
///
/// # Errors
/// [`Error::InvalidArgument`] naming the namespace and the rule it breaks.
pub fn validate_namespace(ns: &str) -> Result<(), Error> {
    let bad = |why: &str| Err(Error::InvalidArgument(format!("namespace {ns:?}: {why}")));
    if ns.is_empty() || ns.len() > 128 {
        return bad("must be 1 to 128 bytes");
    }
    for seg in ns.split('/') {
        if seg.is_empty() || seg == "." || seg == ".." {
            return bad("empty, '.' or '..' segment");
        }
        if !seg
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || b"._-".contains(&c))
        {
            return bad("only letters, digits, '.', '_', '-' and '/' are allowed");
        }
    }
    Ok(())
}

/// Builds keys for one (namespace, geometry incl. TP rank, hash algorithm).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyBuilder {
    prefix: String,
}

impl KeyBuilder {
    /// # Errors
    /// [`Error::InvalidArgument`] for a bad namespace (see [`validate_namespace`]).
    pub fn new(namespace: &str, g: &KvGeometry, algo: HashAlgo) -> Result<Self, Error> {
        validate_namespace(namespace)?;
        Ok(KeyBuilder {
            prefix: format!(
                "{namespace}/v{}/{:016x}/tp{}-{}/{}/",
                super::format::FORMAT_VERSION,
                g.fingerprint(),
                g.tp_rank,
                g.tp_world,
                algo.key_name()
            ),
        })
    }
    /// Common prefix of every key of this builder (ends with `/`).
    pub fn prefix(&self) -> &str {
        &self.prefix
    }
    /// Key of a chunk's data object.
    pub fn data(&self, h: &ChunkHash) -> String {
        format!("{}kv/{}", self.prefix, h.to_hex())
    }
    /// Key of a chunk's publish marker (written after the data is durable).
    pub fn marker(&self, h: &ChunkHash) -> String {
        format!("{}pub/{}", self.prefix, h.to_hex())
    }
    /// Key of a segment object (format version 2) by its digest
    /// ([`crate::layout::segment_digest`] of its chunk list).
    pub fn segment(&self, digest: &[u8; 32]) -> String {
        format!("{}seg/{}", self.prefix, hex::encode(digest))
    }
    /// Prefix under which all segment objects of this builder live.
    pub fn segment_prefix(&self) -> String {
        format!("{}seg/", self.prefix)
    }
    /// Prefix under which all data objects of this builder live.
    pub fn data_prefix(&self) -> String {
        format!("{}kv/", self.prefix)
    }
    /// Prefix under which all publish markers of this builder live.
    pub fn marker_prefix(&self) -> String {
        format!("{}pub/", self.prefix)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sha256cbor_takes_only_32_byte_hashes() {
        let ok = [ChunkHash::from_digest([7; 32])];
        let short = [
            ChunkHash::from_digest([7; 32]),
            ChunkHash::new(b"xxxxx").unwrap(),
        ];
        assert!(HashAlgo::Sha256Cbor.check_hashes(&ok).is_ok());
        let e = HashAlgo::Sha256Cbor
            .check_hashes(&short)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("chunk hash 1 has 5 bytes") && e.contains("sha256cbor"),
            "{e}"
        );
        assert!(HashAlgo::External.check_hashes(&short).is_ok());
    }

    #[test]
    fn keys_separate_models_ranks_and_algos() {
        let h = ChunkHash::new(&[0xab; 32]).unwrap();
        let a = KeyBuilder::new("ns", &KvGeometry::llama31_8b(), HashAlgo::Sha256Cbor).unwrap();
        let b = KeyBuilder::new("ns", &KvGeometry::smollm2_135m(), HashAlgo::Sha256Cbor).unwrap();
        let c = KeyBuilder::new("ns", &KvGeometry::llama31_8b(), HashAlgo::External).unwrap();
        assert_ne!(a.data(&h), b.data(&h));
        assert_ne!(a.data(&h), c.data(&h));
        assert!(a.data(&h).starts_with("ns/v1/"));
        assert!(a.data(&h).contains("/tp0-1/sha256cbor/kv/abab"));
        let r3 = KeyBuilder::new(
            "ns",
            &KvGeometry::llama31_70b(8, 3).unwrap(),
            HashAlgo::Sha256Cbor,
        )
        .unwrap();
        assert!(r3.data(&h).contains("/tp3-8/"));
        // Segments live beside data objects and markers, under the same prefix.
        let s = a.segment(&[0xcd; 32]);
        assert_eq!(s, format!("{}seg/{}", a.prefix(), "cd".repeat(32)));
        assert!(s.starts_with(&a.segment_prefix()));
        assert!(!s.starts_with(&a.data_prefix()) && !s.starts_with(&a.marker_prefix()));
    }

    #[test]
    fn bad_namespaces_rejected() {
        for ns in ["", "a//b", "../x", "a/./b", "sp ace", "a\\b"] {
            assert!(validate_namespace(ns).is_err(), "{ns:?}");
        }
        validate_namespace("tenant-a/kv.cache_1").unwrap();
    }
}
