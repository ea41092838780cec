//! Lookup ([`Engine::lookup_report`], [`Engine::lookup`]): how many leading chunks of a
//! prefix are published, by a k-ary search over the publish markers of every tensor-parallel
//! rank, with answers cached for `lookup_cache_ttl`. A probe reads the marker (16 or 64
//! bytes, the same round trip as asking whether it exists), so a load that follows knows
//! which object holds each probed chunk: its own (format version 1) or a segment (version
//! 2, `docs/object-format.md`).

use super::markers::{read_marker, Known};
use super::{Engine, LookupReport};
use crate::error::Error;
use crate::layout::{ChunkHash, KeyBuilder, KvGeometry, Marker, SegmentMarker};
use std::collections::BTreeMap;
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::time::Instant;

impl Engine {
    /// How many leading chunks of `hashes` are published. Costs at most
    /// ceil(log_{fanout+1}(n+1)) sequential round trips (a k-ary search over publish markers,
    /// which are published in prefix order), stops at the first missing chunk, and reuses
    /// answers younger than `lookup_cache_ttl` (hits and misses; a save by this engine marks
    /// its chunks present at once).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a bad geometry or a hash of the wrong length for
    /// `hash_algo` (32 bytes under `sha256cbor`); a store error other than not-found.
    pub async fn lookup_report(
        &self,
        g: &KvGeometry,
        hashes: &[ChunkHash],
    ) -> Result<LookupReport, Error> {
        self.keys_for(g, hashes)?;
        // Every tensor-parallel rank's marker: a chunk is a hit only when every rank has it,
        // so the ranks of one engine group agree on every hit (case C16).
        let ranks: Vec<KeyBuilder> = (0..g.tp_world.max(1))
            .map(|r| {
                let mut gr = g.clone();
                gr.tp_rank = r;
                KeyBuilder::new(&self.cfg.namespace, &gr, self.cfg.hash_algo)
            })
            .collect::<Result<_, _>>()?;
        let mkeys: Vec<Vec<String>> = hashes
            .iter()
            .map(|h| ranks.iter().map(|k| k.marker(h)).collect())
            .collect();
        let ttl = self.cfg.lookup_cache_ttl;
        let deadline = (!self.cfg.lookup_deadline.is_zero())
            .then(|| tokio::time::Instant::now() + self.cfg.lookup_deadline);
        // A position's state from per-key answers: present if every rank's marker is, absent
        // if one is absent, else unknown.
        let state = |answers: &dyn Fn(&str) -> Option<bool>, keys: &[String]| -> Option<bool> {
            let mut all = true;
            for k in keys {
                match answers(k) {
                    Some(false) => return Some(false),
                    Some(true) => {}
                    None => all = false,
                }
            }
            all.then_some(true)
        };
        // Known state per position from the cache: Some(true/false) or None.
        let mut known: Vec<Option<bool>> = {
            let mut cache = self.shared.lookup_cache.lock().expect("lock");
            cache.retain(|_, (_, t)| t.elapsed() < ttl);
            let cached = |k: &str| cache.get(k).map(|(p, _)| p.present());
            mkeys.iter().map(|ks| state(&cached, ks)).collect()
        };
        // Answers of this lookup's probes, per marker key.
        let mut probed: HashMap<String, Known> = HashMap::new();
        // Markers are monotone along the prefix (published in order): find the boundary.
        let mut lo = 0usize; // every position < lo is present
        let mut hi = hashes.len(); // every position >= hi is absent (or beyond)
        let tighten = |known: &[Option<bool>], lo: &mut usize, hi: &mut usize| {
            while *lo < *hi && known[*lo] == Some(true) {
                *lo += 1;
            }
            if let Some(p) = known[*lo..*hi].iter().position(|k| *k == Some(false)) {
                *hi = *lo + p;
            }
        };
        tighten(&known, &mut lo, &mut hi);
        let mut report = LookupReport::default();
        let fanout = self.cfg.lookup_fanout.max(1);
        while lo < hi {
            // Probe up to `fanout` positions spread over [lo, hi), always including lo (every
            // rank's marker of each, in the same round trip).
            let span = hi - lo;
            let n = fanout.min(span);
            let mut probes: Vec<usize> = (0..n).map(|i| lo + i * span / n).collect();
            probes.dedup();
            let pk: Vec<String> = probes
                .iter()
                .flat_map(|&i| mkeys[i].iter().cloned())
                .filter(|k| !probed.contains_key(k))
                .collect();
            report.probes += pk.len();
            let round = self.probe_round(pk, deadline, ttl);
            let (answers, late) = self.spawn(round).await?;
            report.round_trips += 1;
            for (k, a) in answers {
                probed.insert(k, a?);
            }
            for &i in &probes {
                let p = |k: &str| probed.get(k).map(Known::present);
                known[i] = state(&p, &mkeys[i]);
            }
            // Monotonicity: a present marker implies all before it are present; an absent one
            // that all after it are absent.
            // An absent marker bounds the answer even if a later one is present (markers that
            // are not a prefix: a marker phase that failed part way, a chunk evicted).
            if let Some(&first_absent) = probes.iter().filter(|&&i| known[i] == Some(false)).min() {
                hi = hi.min(first_absent);
            }
            if let Some(&last_present) = probes
                .iter()
                .filter(|&&i| i < hi && known[i] == Some(true))
                .max()
            {
                lo = lo.max(last_present + 1);
            }
            tighten(&known, &mut lo, &mut hi);
            if late {
                // Out of time: what the answers so far show is the answer (an unanswered
                // position counts as absent); the probes still out enter the lookup cache
                // when they answer.
                report.cut_short = true;
                self.counters
                    .lookups_cut_short
                    .fetch_add(1, Ordering::Relaxed);
                tracing::debug!(
                    chunks = hashes.len(),
                    confirmed = lo,
                    deadline_ms = self.cfg.lookup_deadline.as_millis() as u64,
                    "lookup out of time: answered with the prefix confirmed so far"
                );
                break;
            }
        }
        report.chunks = lo;
        {
            let now = Instant::now();
            let mut cache = self.shared.lookup_cache.lock().expect("lock");
            for (i, ks) in mkeys.iter().enumerate() {
                if i < lo {
                    for k in ks {
                        // Published (the search's answer); what a probe read of it is kept.
                        let e = cache.entry(k.clone()).or_insert((Known::Present, now));
                        if !e.0.present() {
                            *e = (Known::Present, now);
                        }
                    }
                }
            }
        }
        self.counters.lookups.fetch_add(1, Ordering::Relaxed);
        self.counters
            .lookup_hit_chunks
            .fetch_add(lo as u64, Ordering::Relaxed);
        self.counters
            .lookup_probes
            .fetch_add(report.probes as u64, Ordering::Relaxed);
        Ok(report)
    }

    /// One round of a lookup's probes: reads the markers `keys` at once, each answer entering
    /// the lookup cache as it arrives (a save's own entry is kept); returns the answers
    /// received, and whether `deadline` came first (then the others are still out, and enter
    /// the cache when they answer).
    fn probe_round(
        &self,
        keys: Vec<String>,
        deadline: Option<tokio::time::Instant>,
        ttl: std::time::Duration,
    ) -> impl std::future::Future<Output = (Vec<(String, Result<Known, Error>)>, bool)> + Send + 'static
    {
        let (store, shared, handle) =
            (self.store.clone(), self.shared.clone(), self.handle.clone());
        async move {
            let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
            let n = keys.len();
            for k in keys {
                let (store, shared, tx) = (store.clone(), shared.clone(), tx.clone());
                handle.spawn(async move {
                    let a = read_marker(&*store, &k).await;
                    if let Ok(known) = &a {
                        let mut cache = shared.lookup_cache.lock().expect("lock");
                        let fresh = cache.get(&k).is_some_and(|(_, t)| t.elapsed() < ttl);
                        if !fresh {
                            cache.insert(k.clone(), (known.clone(), Instant::now()));
                        }
                    }
                    let _ = tx.send((k, a.map_err(Error::from)));
                });
            }
            drop(tx);
            let mut got = Vec::with_capacity(n);
            while got.len() < n {
                let next = match deadline {
                    Some(d) => match tokio::time::timeout_at(d, rx.recv()).await {
                        Ok(a) => a,
                        Err(_) => return (got, true),
                    },
                    None => rx.recv().await,
                };
                match next {
                    Some(a) => got.push(a),
                    None => break,
                }
            }
            (got, false)
        }
    }

    /// Leading published chunks of `hashes` (see [`Engine::lookup_report`]).
    ///
    /// # Errors
    /// As [`Engine::lookup_report`].
    pub async fn lookup(&self, g: &KvGeometry, hashes: &[ChunkHash]) -> Result<usize, Error> {
        Ok(self.lookup_report(g, hashes).await?.chunks)
    }

    /// Blocking form of [`Engine::lookup`].
    ///
    /// # Errors
    /// As [`Engine::lookup_report`].
    pub fn lookup_blocking(&self, g: &KvGeometry, hashes: &[ChunkHash]) -> Result<usize, Error> {
        self.run_blocking("lookup", || self.lookup(g, hashes))
    }
}

impl Engine {
    /// The publish markers of format v2 that this engine's lookups of `hashes` read within
    /// `lookup_cache_ttl`, one per segment (the first position that names it), by prefix
    /// position: what a load in another process passes as
    /// [`LoadHints::segment_markers`](crate::connector::LoadHints::segment_markers) to find
    /// the prefix's chunks in segment objects (vLLM's scheduler process looks up, its workers
    /// load). Empty for a prefix of chunk objects (format v1), or when nothing was looked up.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a geometry this engine cannot key (as [`Engine::keys`]) or
    /// a hash of the wrong length for `hash_algo`.
    pub fn segment_markers(
        &self,
        g: &KvGeometry,
        hashes: &[ChunkHash],
    ) -> Result<BTreeMap<usize, SegmentMarker>, Error> {
        let keys = self.keys_for(g, hashes)?;
        let mut seen = std::collections::HashSet::new();
        Ok(self
            .markers_known(&keys, hashes)
            .into_iter()
            .filter_map(|(p, m)| match m {
                Marker::Segment(s) if seen.insert(s.digest) => Some((p, s)),
                _ => None,
            })
            .collect())
    }

    /// Takes version 2 markers that a lookup in another engine read ([`Engine::segment_markers`]
    /// there, by position in `hashes`) as if this engine's own lookup had read them: loads of
    /// these chunks started within `lookup_cache_ttl` place them without reading markers (as
    /// [`LoadHints::segment_markers`](crate::connector::LoadHints::segment_markers), for
    /// callers that cannot pass hints with a load, such as the C ABI's). Lookups of these
    /// chunks meanwhile find them published.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a position at or past `hashes.len()` (naming it), a
    /// geometry this engine cannot key, or a hash of the wrong length for `hash_algo`.
    pub fn add_segment_markers(
        &self,
        g: &KvGeometry,
        hashes: &[ChunkHash],
        markers: &BTreeMap<usize, SegmentMarker>,
    ) -> Result<(), Error> {
        let keys = self.keys_for(g, hashes)?;
        if let Some(p) = markers.keys().find(|&&p| p >= hashes.len()) {
            return Err(Error::InvalidArgument(format!(
                "segment markers: prefix position {p}, the prefix has {} chunks",
                hashes.len()
            )));
        }
        let now = Instant::now();
        let mut cache = self.shared.lookup_cache.lock().expect("lock");
        for (p, m) in markers {
            let known = Known::Read(Marker::Segment(m.clone()));
            cache.insert(keys.marker(&hashes[*p]), (known, now));
        }
        Ok(())
    }

    /// The markers of `hashes` (this rank's, under `keys`) that a lookup read within
    /// `lookup_cache_ttl`, by prefix position: what a load starts from to place its chunks
    /// (`layout::place`).
    pub(crate) fn markers_known(
        &self,
        keys: &KeyBuilder,
        hashes: &[ChunkHash],
    ) -> BTreeMap<usize, Marker> {
        let ttl = self.cfg.lookup_cache_ttl;
        let cache = self.shared.lookup_cache.lock().expect("lock");
        hashes
            .iter()
            .enumerate()
            .filter_map(|(i, h)| match cache.get(&keys.marker(h)) {
                Some((Known::Read(m), t)) if t.elapsed() < ttl => Some((i, m.clone())),
                _ => None,
            })
            .collect()
    }
}
