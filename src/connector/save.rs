//! Saving a prefix's KV ([`Engine::save`], [`Engine::save_paged`] and their blocking forms):
//! every chunk object written create-only, then the publish markers.

use super::lookup::Known;
use super::{Engine, SaveReport};
use crate::error::{Error, StoreError};
use crate::layout::{object_len, ChunkHash, KvGeometry, Marker};
use crate::store::{PutIfAbsent, StoreExt};
use bytes::Bytes;
use futures::StreamExt;
use std::sync::atomic::Ordering;
use std::time::Instant;

impl Engine {
    /// Saves a prefix's KV: `layers[l]` holds layer `l` of every chunk, chunk `c`'s slice
    /// (K of its `tokens_per_chunk` tokens, then V) at `c x slice_bytes`. Writes every chunk
    /// object create-only, then the publish markers.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if `layers.len() != geometry.layers` or a buffer is not
    /// `hashes.len() x slice_bytes` bytes; the store's error if a write fails (then no marker
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
        let keys = self.keys(g)?;
        let slice = g.slice_bytes() as usize;
        if layers.len() != g.layers as usize {
            return Err(Error::InvalidArgument(format!(
                "save: {} layer buffers given, geometry {} has {} layers",
                layers.len(),
                g.model,
                g.layers
            )));
        }
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
        // Phase 1: data objects, create-only.
        let mut objects = Vec::with_capacity(hashes.len());
        for (c, h) in hashes.iter().enumerate() {
            let obj = crate::layout::encode_chunk_parts(g, g.tokens_per_chunk, |l| {
                sub_parts(&layers[l as usize], c * slice, slice)
            })?;
            objects.push((keys.data(h), Bytes::from(obj)));
        }
        let store = self.store.clone();
        let conc = self.cfg.save_concurrency;
        let data = self.spawn(async move {
            let results: Vec<Result<(PutIfAbsent, u64), StoreError>> =
                futures::stream::iter(objects)
                    .map(|(k, b)| {
                        let store = store.clone();
                        async move {
                            let n = b.len() as u64;
                            store.put_if_absent(&k, b).await.map(|r| (r, n))
                        }
                    })
                    .buffered(conc.max(1))
                    .collect()
                    .await;
            results
        });
        let mut report = SaveReport::default();
        for r in data.await? {
            match r? {
                (PutIfAbsent::Written, n) => {
                    report.written += 1;
                    report.bytes += n;
                }
                (PutIfAbsent::AlreadyPresent, _) => report.already_present += 1,
            }
        }
        // Phase 2: publish markers, after every data object is durable.
        let len = object_len(g.layers, g.slice_bytes());
        let marker = Bytes::copy_from_slice(&crate::layout::encode_marker(len));
        let mkeys: Vec<String> = hashes.iter().map(|h| keys.marker(h)).collect();
        let store = self.store.clone();
        let mk2 = mkeys.clone();
        let published = self.spawn(async move {
            futures::stream::iter(mk2)
                .map(|k| {
                    let store = store.clone();
                    let m = marker.clone();
                    async move { store.put_if_absent(&k, m).await }
                })
                .buffered(conc.max(1))
                .collect::<Vec<_>>()
                .await
        });
        for r in published.await? {
            if r? == PutIfAbsent::Written {
                report.bytes += 16;
            }
        }
        let now = Instant::now();
        let mut cache = self.lookup_cache.lock().expect("lock");
        let written = Marker::Chunk { object_len: len };
        for k in mkeys {
            cache.insert(k, (Known::Read(written.clone()), now));
        }
        drop(cache);
        self.counters.saves.fetch_add(1, Ordering::Relaxed);
        self.counters
            .bytes_saved
            .fetch_add(report.bytes, Ordering::Relaxed);
        Ok(report)
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
        std::thread::scope(|s| {
            s.spawn(|| {
                let h = self.handle.clone();
                h.block_on(self.save(g, hashes, layers))
            })
            .join()
            .expect("save panicked")
        })
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
        std::thread::scope(|s| {
            s.spawn(|| {
                let h = self.handle.clone();
                h.block_on(self.save_paged(g, hashes, layers))
            })
            .join()
            .expect("save panicked")
        })
    }
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
