//! Saving a prefix's KV ([`Engine::save`], [`Engine::save_paged`] and their blocking forms):
//! every object written create-only (a chunk object per chunk in format version 1, segment
//! objects of the save's chunks in version 2, `save_format`), then the publish markers.

use super::config::SaveFormat;
use super::markers::Known;
use super::{Engine, SaveReport};
use crate::error::{Error, StoreResult};
use crate::layout::{
    encode_segment_parts, object_len, segment_digest, ChunkHash, KeyBuilder, KvGeometry, Marker,
    SegmentMarker, MAX_SEGMENT_CHUNKS,
};
use crate::store::{PutIfAbsent, Store, StoreExt};
use bytes::Bytes;
use futures::StreamExt;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

impl Engine {
    /// Saves a prefix's KV: `layers[l]` holds layer `l` of every chunk, chunk `c`'s slice
    /// (K of its `tokens_per_chunk` tokens, then V) at `c x slice_bytes`. Writes every chunk
    /// object create-only, then the publish markers.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if `layers.len() != geometry.layers` or a buffer is not
    /// `hashes.len() x slice_bytes` bytes, or a hash of the wrong length for `hash_algo` (32
    /// bytes under `sha256cbor`, naming its position); the store's error if a write fails (then no marker
    /// of this call is written past the failure, and nothing stored before is touched).
    pub async fn save(
        &self,
        g: &KvGeometry,
        hashes: &[ChunkHash],
        layers: &[&[u8]],
    ) -> Result<SaveReport, Error> {
        let paged: Vec<Vec<&[u8]>> = layers.iter().map(|b| vec![*b]).collect();
        self.save_paged(g, hashes, &paged).await
    }

    /// Saves a prefix's KV from paged memory: `layers[l]` lists layer `l`'s source ranges in
    /// order, and their concatenation holds chunk `c`'s slice at `c x slice_bytes` (for an
    /// engine that keeps KV in blocks: one range per engine block of the chunks' tokens, in
    /// token order; with a [`crate::layout::KvLayout`] in the geometry the blocks are stored
    /// as they are). The ranges are only read, and may lie anywhere. As [`Engine::save`]
    /// otherwise.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if `layers.len() != geometry.layers` or a layer's ranges do
    /// not add up to `hashes.len() x slice_bytes` bytes (naming the layer); as
    /// [`Engine::save`] otherwise.
    pub async fn save_paged(
        &self,
        g: &KvGeometry,
        hashes: &[ChunkHash],
        layers: &[Vec<&[u8]>],
    ) -> Result<SaveReport, Error> {
        let keys = self.keys_for(g, hashes)?;
        let slice = g.slice_bytes() as usize;
        super::check_layer_count("save", layers.len(), "layer buffers", g)?;
        for (l, parts) in layers.iter().enumerate() {
            let n: usize = parts.iter().map(|p| p.len()).sum();
            if n != hashes.len() * slice {
                return Err(Error::InvalidArgument(format!(
                    "save: layer {l} {} {n} bytes, expected {} chunks x {slice} bytes = {}",
                    if parts.len() == 1 {
                        "buffer has"
                    } else {
                        "ranges add up to"
                    },
                    hashes.len(),
                    hashes.len() * slice
                )));
            }
        }
        // A store that failed its self-check takes no save (`self_check.rs`).
        if let Some(v) = &self.self_check {
            super::self_check::allow_save(v, &self.cfg.store).await?;
        }
        // Format version 2: leading chunks this engine knows are published (its lookup or
        // save said so within `lookup_cache_ttl`) are not written again, so the segment holds
        // the save's new chunks only.
        let v2 = self.cfg.save_format == SaveFormat::V2;
        let skip = if v2 {
            self.published_prefix(&keys, hashes)
        } else {
            0
        };
        let (objects, markers) = if v2 {
            segment_objects(g, &keys, hashes, layers, skip, self.cfg.segment_max_bytes)?
        } else {
            chunk_objects(g, &keys, hashes, layers)?
        };
        let store = self.store.clone();
        let conc = self.cfg.save_concurrency.max(1);
        // Phase 1: data objects (version 1) or segments (version 2), create-only.
        let data = self.spawn(put_all(store.clone(), objects, conc));
        let mut report = SaveReport {
            already_present: skip,
            ..SaveReport::default()
        };
        for r in data.await? {
            match r? {
                (PutIfAbsent::Written, n) => {
                    report.bytes += n;
                    if !v2 {
                        report.written += 1;
                    }
                }
                (PutIfAbsent::AlreadyPresent, _) if !v2 => report.already_present += 1,
                (PutIfAbsent::AlreadyPresent, _) => {}
            }
        }
        // Phase 2: publish markers, after every object they name is durable.
        let puts: Vec<(String, Bytes)> = markers
            .iter()
            .map(|(k, _, b)| (k.clone(), b.clone()))
            .collect();
        let published = self.spawn(put_all(store, puts, conc));
        let mut outcome = Vec::with_capacity(markers.len());
        for r in published.await? {
            let (w, n) = r?;
            if w == PutIfAbsent::Written {
                report.bytes += n;
            }
            if v2 {
                match w {
                    PutIfAbsent::Written => report.written += 1,
                    PutIfAbsent::AlreadyPresent => report.already_present += 1,
                }
            }
            outcome.push(w);
        }
        // What this save wrote is known; a marker another writer published first is present,
        // its content unread (it may name another object).
        let now = Instant::now();
        let mut cache = self.shared.lookup_cache.lock().expect("lock");
        for ((k, m, _), w) in markers.into_iter().zip(outcome) {
            let known = match w {
                PutIfAbsent::Written => Known::Read(m),
                PutIfAbsent::AlreadyPresent => Known::Present,
            };
            cache.insert(k, (known, now));
        }
        drop(cache);
        self.counters.saves.fetch_add(1, Ordering::Relaxed);
        self.counters
            .bytes_saved
            .fetch_add(report.bytes, Ordering::Relaxed);
        Ok(report)
    }

    /// How many leading chunks of `hashes` this engine knows to be published under `keys`
    /// (its lookup cache, answers younger than `lookup_cache_ttl`).
    fn published_prefix(&self, keys: &KeyBuilder, hashes: &[ChunkHash]) -> usize {
        let ttl = self.cfg.lookup_cache_ttl;
        let cache = self.shared.lookup_cache.lock().expect("lock");
        hashes
            .iter()
            .take_while(|h| {
                matches!(cache.get(&keys.marker(h)),
                    Some((k, t)) if t.elapsed() < ttl && !matches!(k, Known::Absent))
            })
            .count()
    }

    /// Blocking form of [`Engine::save`].
    ///
    /// # Errors
    /// As [`Engine::save`].
    pub fn save_blocking(
        &self,
        g: &KvGeometry,
        hashes: &[ChunkHash],
        layers: &[&[u8]],
    ) -> Result<SaveReport, Error> {
        self.run_blocking("save", || self.save(g, hashes, layers))
    }

    /// Blocking form of [`Engine::save_paged`].
    ///
    /// # Errors
    /// As [`Engine::save_paged`].
    pub fn save_paged_blocking(
        &self,
        g: &KvGeometry,
        hashes: &[ChunkHash],
        layers: &[Vec<&[u8]>],
    ) -> Result<SaveReport, Error> {
        self.run_blocking("save", || self.save_paged(g, hashes, layers))
    }
}

/// Objects to write and, after them, markers to publish (key, what it says, its bytes).
type SavePlan = (Vec<(String, Bytes)>, Vec<(String, Marker, Bytes)>);

/// Format version 1: one chunk object per chunk, and a 16-byte marker naming it.
fn chunk_objects(
    g: &KvGeometry,
    keys: &KeyBuilder,
    hashes: &[ChunkHash],
    layers: &[Vec<&[u8]>],
) -> Result<SavePlan, Error> {
    let slice = g.slice_bytes() as usize;
    let mut objects = Vec::with_capacity(hashes.len());
    for (c, h) in hashes.iter().enumerate() {
        let obj = crate::layout::encode_chunk_parts(g, g.tokens_per_chunk, |l| {
            sub_parts(&layers[l as usize], c * slice, slice)
        })?;
        objects.push((keys.data(h), Bytes::from(obj)));
    }
    let len = object_len(g.layers, g.slice_bytes());
    let bytes = Bytes::copy_from_slice(&crate::layout::encode_marker(len));
    let markers = hashes
        .iter()
        .map(|h| {
            let m = Marker::Chunk { object_len: len };
            (keys.marker(h), m, bytes.clone())
        })
        .collect();
    Ok((objects, markers))
}

/// Format version 2: chunks `skip..` of `hashes` as segment objects of consecutive chunks, each
/// holding at most `max_bytes` of KV (at least one chunk), and a 64-byte marker per chunk
/// naming its segment and index (`docs/object-format.md`, "Format version 2").
fn segment_objects(
    g: &KvGeometry,
    keys: &KeyBuilder,
    hashes: &[ChunkHash],
    layers: &[Vec<&[u8]>],
    skip: usize,
    max_bytes: u64,
) -> Result<SavePlan, Error> {
    let slice = g.slice_bytes() as usize;
    let per_segment = (max_bytes / (g.layers as u64 * g.slice_bytes()).max(1))
        .clamp(1, MAX_SEGMENT_CHUNKS as u64) as usize;
    let (mut objects, mut markers) = (Vec::new(), Vec::new());
    let mut start = skip;
    while start < hashes.len() {
        let end = (start + per_segment).min(hashes.len());
        let listed = &hashes[start..end];
        let (h, obj) = encode_segment_parts(g, listed, |l, i| {
            sub_parts(&layers[l as usize], (start + i as usize) * slice, slice)
        })?;
        let digest = segment_digest(listed);
        objects.push((keys.segment(&digest), Bytes::from(obj)));
        for (i, hash) in listed.iter().enumerate() {
            let m = SegmentMarker::new(&h, i as u32, digest);
            let bytes = Bytes::copy_from_slice(&m.encode());
            markers.push((keys.marker(hash), Marker::Segment(m), bytes));
        }
        start = end;
    }
    Ok((objects, markers))
}

/// Writes every object create-only, `conc` at a time, in order; each result with the bytes
/// of its object.
async fn put_all(
    store: Arc<dyn Store>,
    objects: Vec<(String, Bytes)>,
    conc: usize,
) -> Vec<StoreResult<(PutIfAbsent, u64)>> {
    futures::stream::iter(objects)
        .map(|(k, b)| {
            let store = store.clone();
            async move {
                let n = b.len() as u64;
                store.put_if_absent(&k, b).await.map(|r| (r, n))
            }
        })
        .buffered(conc)
        .collect()
        .await
}

/// The pieces of `parts` (taken in order as one buffer) that hold bytes `start..start+len`;
/// the caller has checked that the parts hold at least `start + len` bytes.
pub(super) fn sub_parts<'a>(parts: &[&'a [u8]], start: usize, len: usize) -> Vec<&'a [u8]> {
    let mut out = Vec::new();
    let (mut at, end) = (0usize, start + len);
    for p in parts {
        let (a, b) = (at, at + p.len());
        at = b;
        if b <= start || p.is_empty() {
            continue;
        }
        if a >= end {
            break;
        }
        out.push(&p[start.max(a) - a..end.min(b) - a]);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sub_parts_cut_a_range_out_of_scattered_parts() {
        let (a, b, c) = ([1u8, 2, 3], [4u8], [5u8, 6, 7, 8]);
        let parts: Vec<&[u8]> = vec![&a, &[], &b, &c];
        let flat = |v: Vec<&[u8]>| v.concat();
        assert_eq!(flat(sub_parts(&parts, 0, 8)), vec![1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(flat(sub_parts(&parts, 2, 3)), vec![3, 4, 5]);
        assert_eq!(sub_parts(&parts, 3, 1), vec![&[4u8][..]]);
        assert_eq!(flat(sub_parts(&parts, 5, 3)), vec![6, 7, 8]);
        assert!(sub_parts(&parts, 4, 0).is_empty());
    }
}
