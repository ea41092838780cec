//! Publish markers as the engine reads them: what one marker says ([`Known`]), one read
//! ([`read_marker`]), and a load's rounds of reads for the positions its lookup did not place
//! ([`resolve_markers`]). Below both the lookup (`lookup.rs`), the save (`save.rs`) and a
//! load's fetch (`fetch.rs`).

use crate::error::{StoreError, StoreResult};
use crate::layout::{decode_marker, ChunkHash, KeyBuilder, Marker};
use crate::store::{Store, StoreExt};
use std::collections::BTreeMap;
use std::sync::atomic::Ordering;

/// What a lookup learnt of one publish marker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Known {
    /// Not published (no marker, or one that does not decode: a miss, never bytes).
    Absent,
    /// Published; its content was not read (a position implied by the markers after it).
    Present,
    /// Published, and this is what it says.
    Read(Marker),
}

impl Known {
    /// Published (read or implied).
    pub(crate) fn present(&self) -> bool {
        !matches!(self, Known::Absent)
    }
}

/// Reads the marker at `key`: `Absent` when there is none or it does not decode.
///
/// # Errors
/// A store error other than not-found.
pub(crate) async fn read_marker(store: &dyn Store, key: &str) -> StoreResult<Known> {
    match store.get_bytes(key).await {
        Ok(b) => Ok(match decode_marker(&b) {
            Ok(m) => Known::Read(m),
            Err(e) => {
                tracing::warn!(key, error = %e, "publish marker does not decode: taken as absent");
                Known::Absent
            }
        }),
        Err(StoreError::NotFound { .. }) => Ok(Known::Absent),
        Err(e) => Err(e),
    }
}

/// Most rounds of marker reads one load makes before it starts ([`resolve_markers`]): a
/// prefix saved in more requests than this reads its later chunks as chunk objects.
const MAX_MARKER_ROUNDS: usize = 64;

/// Reads the markers of a load's positions that nothing in `markers` places
/// (`layout::place`'s `unknown`: where a stretch of positions no known marker covers starts),
/// round after round, until every position is placed, a round learns nothing (a marker that
/// is absent, does not decode or cannot be read: such positions are read as chunk objects,
/// a miss if there is none), or [`MAX_MARKER_ROUNDS`] rounds. A prefix saved in `s` segments
/// costs `s` rounds when no marker was known, none when its lookup's markers were handed over.
/// Each read counts as one of the load's requests.
pub(crate) async fn resolve_markers(
    store: &dyn Store,
    keys: &KeyBuilder,
    hashes: &[ChunkHash],
    markers: &mut BTreeMap<usize, Marker>,
    sh: &super::load::LoadShared,
) {
    for _ in 0..MAX_MARKER_ROUNDS {
        let unknown = crate::layout::place(hashes.len(), markers).unknown;
        if unknown.is_empty() {
            return;
        }
        sh.requests
            .fetch_add(unknown.len() as u64, Ordering::Relaxed);
        let mkeys: Vec<String> = unknown.iter().map(|&p| keys.marker(&hashes[p])).collect();
        let answers = futures::future::join_all(mkeys.iter().map(|k| read_marker(store, k))).await;
        let mut learnt = false;
        for (p, a) in unknown.into_iter().zip(answers) {
            match a {
                Ok(Known::Read(m)) => {
                    markers.insert(p, m);
                    learnt = true;
                }
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!(position = p, error = %e, "publish marker not read: its chunks are read as chunk objects")
                }
            }
        }
        if !learnt {
            return;
        }
    }
}
