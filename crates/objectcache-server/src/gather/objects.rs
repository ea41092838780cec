//! The objects one gather load reads: per chunk, its own chunk object (format version 1) or
//! its place in a segment object (format version 2, the request's
//! [`SegmentPlacement`](objectcache_client::protocol::SegmentPlacement)); where each of its slices lies;
//! and the check of a segment's header, made once per load whatever the number of its chunks.

use crate::ServerState;
use objectcache_client::error::StoreError;
use objectcache_client::layout::{slice_range, ChunkHash, SegmentHeader, SegmentLayout};
use objectcache_client::protocol::{ChunkKeys, GatherRequest, MissReason, PieceMiss, WireGeometry};
use objectcache_client::store::GetOptions;
use std::ops::Range;

/// The miss that a store error on chunk `chunk` is reported as: not found, a range past the
/// object's end (another geometry), or a storage error, with the error's text.
pub(super) fn miss_of(chunk: u32, e: &StoreError) -> PieceMiss {
    let reason = match e {
        StoreError::NotFound { .. } => MissReason::NotFound,
        StoreError::InvalidRange { .. } => MissReason::GeometryMismatch,
        _ => MissReason::Storage,
    };
    PieceMiss {
        chunk,
        reason,
        message: e.to_string(),
    }
}

/// A segment object a load reads from.
struct Segment {
    /// Its key, bucket in front.
    key: String,
    /// What the request says of it (its chunks' publish markers).
    r: objectcache_client::protocol::SegmentRef,
    /// Its header check, made by the first chunk that needs it: per chunk of the request it
    /// holds, the hash the segment's chunk list has at the chunk's index where that is not
    /// the request's; or why the segment is unusable. (The chunk list itself, up to 65,536
    /// hashes, is not kept.)
    checked: tokio::sync::OnceCell<Result<Vec<(usize, ChunkHash)>, (MissReason, String)>>,
}

/// The objects a load reads (see the module docs).
pub(super) struct LoadObjects {
    /// Per chunk, the key of the object holding it, bucket in front.
    keys: Vec<String>,
    /// Per chunk held in a segment: that segment (index into `segments`), its index there,
    /// and the segment's layout.
    place: Vec<Option<(usize, u32, SegmentLayout)>>,
    segments: Vec<Segment>,
    /// The request's chunk hashes, to check each segment chunk against its segment's list.
    hashes: Vec<ChunkHash>,
}

impl LoadObjects {
    /// The objects of `req` (validated), under its bucket.
    ///
    /// # Errors
    /// The key that is not a valid object key.
    pub(super) fn of(req: &GatherRequest) -> Result<Self, String> {
        let bucket = &req.bucket;
        let full = |k: String| -> Result<String, String> {
            let f = format!("{bucket}/{k}");
            objectcache_client::store::validate_key(&f)
                .map(|()| f)
                .map_err(|_| format!("invalid object key {k:?}"))
        };
        let keys: Vec<String> = (0..req.chunks.len())
            .map(|i| full(req.chunks.key(i).expect("in range")))
            .collect::<Result<_, _>>()?;
        let (segments, place, hashes) = match (&req.segments, &req.chunks) {
            (Some(p), ChunkKeys::Hashed { prefix, hashes }) => {
                let slice = req.geometry.slice_len(req.geometry.tokens_per_chunk);
                let segments = p
                    .segments
                    .iter()
                    .map(|r| {
                        Ok(Segment {
                            key: full(format!("{prefix}seg/{}", hex::encode(r.digest)))?,
                            r: *r,
                            checked: tokio::sync::OnceCell::new(),
                        })
                    })
                    .collect::<Result<Vec<_>, String>>()?;
                let place = p
                    .chunks
                    .iter()
                    .map(|e| e.map(|(s, i)| (s as usize, i, p.layout(s, slice))))
                    .collect();
                (segments, place, hashes.clone())
            }
            _ => (Vec::new(), vec![None; keys.len()], Vec::new()),
        };
        let mut keys = keys;
        for (c, e) in place.iter().enumerate() {
            if let Some((s, _, _)) = e {
                keys[c] = segments[*s].key.clone();
            }
        }
        Ok(LoadObjects {
            keys,
            place,
            segments,
            hashes,
        })
    }

    /// Chunks in the load.
    pub(super) fn len(&self) -> usize {
        self.keys.len()
    }

    /// The key of the object holding chunk `c`.
    pub(super) fn key(&self, c: usize) -> &str {
        &self.keys[c]
    }

    /// Each object's key once (a segment's is named by each of its chunks).
    pub(super) fn distinct_keys(&self) -> Vec<String> {
        let mut seen = std::collections::HashSet::new();
        self.keys
            .iter()
            .filter(|k| seen.insert(k.as_str()))
            .cloned()
            .collect()
    }

    /// Whether chunk `c` lies in a segment object.
    pub(super) fn in_segment(&self, c: usize) -> bool {
        self.place[c].is_some()
    }

    /// Chunk `c`'s index in its segment object and the segment's layout, if it lies in one.
    pub(super) fn segment_slot(&self, c: usize) -> Option<(u32, SegmentLayout)> {
        self.place[c].map(|(_, i, layout)| (i, layout))
    }

    /// Byte range, CRC32C trailer included, of chunk `c`'s slice of layer `layer`
    /// (`slice_len` bytes) in its object.
    pub(super) fn slice_range(&self, c: usize, layer: u32, slice_len: u64) -> Range<u64> {
        slice_at(self.segment_slot(c), layer, slice_len)
    }

    /// Checks segment chunk `c` against its segment: the segment's header (geometry, chunk
    /// count, header and object length as the request says) and chunk list (its digest is the
    /// key's, and it holds the request's hash at the chunk's index). The segment's header is
    /// read once per load (one ranged read of its header length).
    pub(super) async fn check_segment_chunk(
        &self,
        sh: &ServerState,
        c: usize,
        g: &WireGeometry,
    ) -> Result<(), PieceMiss> {
        let (s, i, _) = self.place[c].expect("a segment chunk");
        let seg = &self.segments[s];
        let miss = |(reason, message): (MissReason, String)| PieceMiss {
            chunk: c as u32,
            reason,
            message,
        };
        let wrong = seg
            .checked
            .get_or_init(|| async {
                let list = check_segment(sh, seg, g).await?;
                Ok(self.mismatches(s, &list))
            })
            .await
            .as_ref()
            .map_err(|e| miss(e.clone()))?;
        match wrong.iter().find(|(w, _)| *w == c) {
            None => Ok(()),
            Some((_, there)) => Err(miss((
                MissReason::NotFound,
                format!(
                    "{}: chunk {i} of the segment is {there}, not the request's {}",
                    seg.key, self.hashes[c]
                ),
            ))),
        }
    }

    /// The request's chunks placed in segment `s` whose hash is not the one at their index in
    /// the segment's chunk list `list`, with the hash there.
    fn mismatches(&self, s: usize, list: &[ChunkHash]) -> Vec<(usize, ChunkHash)> {
        self.place
            .iter()
            .enumerate()
            .filter_map(|(c, p)| match p {
                Some((ps, i, _)) if *ps == s && list[*i as usize] != self.hashes[c] => {
                    Some((c, list[*i as usize].clone()))
                }
                _ => None,
            })
            .collect()
    }
}

/// Byte range, CRC32C trailer included, of layer `layer`'s slice (`slice_len` bytes) of a
/// chunk in its own chunk object (`at` `None`) or at `at` (index, layout) of a segment.
pub(super) fn slice_at(at: Option<(u32, SegmentLayout)>, layer: u32, slice_len: u64) -> Range<u64> {
    match at {
        Some((i, layout)) => layout.slice_range(layer, i),
        None => slice_range(layer, slice_len),
    }
}

/// Reads and checks a segment's header against the request (see
/// [`LoadObjects::check_segment_chunk`]); its chunk list, or the miss every chunk of it gets.
/// The request's indexes are below the chunk count checked here (the request's placement was
/// validated against the same count), so the list can be indexed by them.
async fn check_segment(
    sh: &ServerState,
    seg: &Segment,
    g: &WireGeometry,
) -> Result<Vec<ChunkHash>, (MissReason, String)> {
    let key = &seg.key;
    let store_miss = |e: objectcache_client::error::StoreError| {
        let m = miss_of(0, &e);
        (m.reason, m.message)
    };
    let r = sh
        .store
        .get_opts(
            key,
            GetOptions {
                range: Some(0..seg.r.header_len as u64),
            },
        )
        .await
        .map_err(store_miss)?;
    let size = r.meta.size;
    let b = r.bytes().await.map_err(store_miss)?;
    let geo = |m: String| (MissReason::GeometryMismatch, format!("{key}: {m}"));
    let h = SegmentHeader::decode(&b).map_err(|e| geo(e.to_string()))?;
    g.check_segment_header(&h).map_err(|e| geo(e.to_string()))?;
    if (h.chunks, h.header_len, h.object_len()) != (seg.r.chunks, seg.r.header_len, size)
        || size != seg.r.object_len
    {
        return Err(geo(format!(
            "segment of {} chunks, header {} bytes, {size} bytes stored; the request says {} \
             chunks, header {} bytes, {} bytes",
            h.chunks, h.header_len, seg.r.chunks, seg.r.header_len, seg.r.object_len
        )));
    }
    let list = h.decode_chunk_list(&b).map_err(|e| geo(e.to_string()))?;
    if objectcache_client::layout::segment_digest(&list) != seg.r.digest {
        return Err(geo("its chunk list is not the one its key names".into()));
    }
    Ok(list)
}

/// A refused gather request: the error code and the message the client gets.
pub(super) type Refusal = (objectcache_client::protocol::ErrorCode, String);

/// The refusal of an RDMA target by a server that offers none (a build without `rdma`, or no
/// RDMA device).
pub(super) const NO_RDMA: &str = "this server offers no RDMA target; use the inline TCP target";

/// Refuses a request for a bucket that does not exist (or that the backend cannot look up).
pub(super) async fn bucket_exists(sh: &ServerState, bucket: &str) -> Result<(), Refusal> {
    match sh.buckets.exists(bucket).await {
        Ok(true) => Ok(()),
        Ok(false) => Err((
            objectcache_client::protocol::ErrorCode::NoSuchBucket,
            format!("bucket {bucket} does not exist"),
        )),
        Err(e) => Err((
            objectcache_client::protocol::ErrorCode::Storage,
            e.to_string(),
        )),
    }
}
