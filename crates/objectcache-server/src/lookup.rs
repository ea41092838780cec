//! `POST /_objectcache/lookup`: what the store holds of a prefix, for routers that place
//! requests by what is cached (served when the `lookup_http` setting is on).
//!
//! Request (JSON, at most [`MAX_BODY_BYTES`]):
//!
//! ```json
//! {"groups": ["objectcache/ns/v1-.../tp0-1/sha256cbor"], "hashes": ["9f2c...", "41d0..."]}
//! ```
//!
//! - `groups`: the key groups a chunk must be published in to count (one per tensor-parallel
//!   rank that stores it; one for MLA), as store keys up to `/pub/`, the way
//!   `objectcache stat` names them against the server's store (the bucket first). At most
//!   [`MAX_GROUPS`].
//! - `hashes`: the prefix's chunk hashes in order, hex (what the connector names chunks by:
//!   vLLM's block hash at the token that closes each chunk). At most [`MAX_HASHES`].
//!
//! Response:
//!
//! ```json
//! {"chunks": 2, "tiers": ["dram", "remote"], "asked": 3}
//! ```
//!
//! - `chunks`: how many leading chunks are published in every group (the longest cached
//!   prefix, in chunks; a load of more would miss).
//! - `tiers`: for each of those chunks, where this server would read it from: `dram` or
//!   `disk` (the node tier holds its data object in every group), else `remote`.
//! - `asked`: the number of hashes asked.
//!
//! Cost: concurrent HEAD requests to the store for the publish markers, in prefix order, at
//! most [`MAX_PROBES`], ending at the first absent one (a chunk counts only once its marker
//! is published, as for the connector's own lookup); the tier is asked in memory. Errors: 400 with a message naming what was wrong (bad JSON, too many
//! groups or hashes, a hash that is not hex, a group that is not a valid key prefix); 503
//! when the store cannot be asked.

use objectcache_client::store::{Store, StoreExt, TierLevel, TieredStore};
use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// Bytes of a lookup request body at most.
pub const MAX_BODY_BYTES: usize = 1 << 20;
/// Key groups per lookup at most (a TP world of 64).
pub const MAX_GROUPS: usize = 64;
/// Chunk hashes per lookup at most (4,096 chunks: 1M tokens at 256 tokens per chunk).
pub const MAX_HASHES: usize = 4096;
/// Publish markers (hashes x groups) one lookup may ask about at most.
pub const MAX_PROBES: usize = 16_384;
/// Marker HEADs in flight at once for one lookup.
const CONCURRENCY: usize = 64;

/// A lookup request (see the module documentation).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct LookupRequest {
    /// Key groups, store keys up to `/pub/` (without the trailing slash).
    pub groups: Vec<String>,
    /// Chunk hashes of the prefix in order, hex.
    pub hashes: Vec<String>,
}

/// A lookup's answer (see the module documentation).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
pub struct LookupAnswer {
    /// Leading chunks published in every group.
    pub chunks: usize,
    /// Where each of those chunks would be read from: `dram`, `disk` or `remote`.
    pub tiers: Vec<String>,
    /// Hashes asked.
    pub asked: usize,
}

/// Why a lookup could not be answered.
#[derive(Debug)]
pub enum LookupError {
    /// The request is malformed (HTTP 400); the message names what was wrong.
    BadRequest(String),
    /// The store could not be asked (HTTP 503).
    Store(String),
}

impl LookupRequest {
    /// Parses and checks a request body.
    ///
    /// # Errors
    /// [`LookupError::BadRequest`] naming the field at fault.
    pub fn parse(body: &[u8]) -> Result<Self, LookupError> {
        let bad = |m: String| Err(LookupError::BadRequest(m));
        let r: LookupRequest = match serde_json::from_slice(body) {
            Ok(r) => r,
            Err(e) => return bad(format!("lookup request: {e}")),
        };
        if r.groups.is_empty() || r.groups.len() > MAX_GROUPS {
            return bad(format!(
                "groups: {} given, 1 to {MAX_GROUPS} allowed",
                r.groups.len()
            ));
        }
        if r.hashes.len() * r.groups.len() > MAX_PROBES {
            return bad(format!(
                "{} hashes x {} groups: at most {MAX_PROBES} publish markers per lookup",
                r.hashes.len(),
                r.groups.len()
            ));
        }
        if r.hashes.len() > MAX_HASHES {
            return bad(format!(
                "hashes: {} given, at most {MAX_HASHES} allowed",
                r.hashes.len()
            ));
        }
        if let Some((i, h)) = r.hashes.iter().enumerate().find(|(_, h)| {
            h.is_empty() || h.len() > 128 || !h.bytes().all(|c| c.is_ascii_hexdigit())
        }) {
            return bad(format!("hashes[{i}] {h:?} is not 1 to 128 hex digits"));
        }
        for g in &r.groups {
            let probe = format!("{g}/pub/00");
            if g.is_empty()
                || g.ends_with('/')
                || objectcache_client::store::validate_key(&probe).is_err()
            {
                return bad(format!(
                    "group {g:?} is not a key group (a store key prefix up to /pub/, without \
                     the trailing slash)"
                ));
            }
        }
        Ok(r)
    }
}

/// Answers `req` from `store` (the remote store, or the tier in front of it) and `tier`.
///
/// # Errors
/// [`LookupError::Store`] when a marker HEAD fails with an error other than not-found.
pub async fn lookup(
    store: &Arc<dyn Store>,
    tier: Option<&TieredStore>,
    req: &LookupRequest,
) -> Result<LookupAnswer, LookupError> {
    use futures::StreamExt;
    let keys: Vec<(usize, String)> = req
        .hashes
        .iter()
        .enumerate()
        .flat_map(|(i, h)| req.groups.iter().map(move |g| (i, format!("{g}/pub/{h}"))))
        .collect();
    // Answers arrive in key order (chunk, then group): the first absent marker ends the
    // prefix, and the HEADs after it are dropped unasked or cancelled.
    let mut answers = futures::stream::iter(keys)
        .map(|(i, k)| {
            let store = store.clone();
            async move { store.exists(&k).await.map(|p| (i, p)) }
        })
        .buffered(CONCURRENCY);
    let mut chunks = req.hashes.len();
    while let Some(a) = answers.next().await {
        let (i, present) = a.map_err(|e| LookupError::Store(e.to_string()))?;
        if !present {
            chunks = i;
            break;
        }
    }
    drop(answers);
    let tiers = req.hashes[..chunks]
        .iter()
        .map(|h| {
            // The coldest level among the groups; `remote` when one group's object is not in
            // the tier.
            let mut level = Some(TierLevel::Dram);
            for g in &req.groups {
                let l = tier.and_then(|t| t.level_of(&format!("{g}/kv/{h}")));
                level = match (level, l) {
                    (Some(a), Some(b)) => Some(a.max(b)),
                    _ => None,
                };
            }
            level.map_or("remote", TierLevel::name).to_string()
        })
        .collect();
    Ok(LookupAnswer {
        chunks,
        tiers,
        asked: req.hashes.len(),
    })
}
