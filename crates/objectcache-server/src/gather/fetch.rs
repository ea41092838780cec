//! A load's reads: chunk headers checked in chunk order, unit pieces read from the store
//! (joined with other loads' reads of the same bytes) or from local files, ahead of the socket
//! under the memory budget.

use super::objects::{miss_of, LoadObjects};
use crate::ServerState;

use bytes::Bytes;
use futures::{stream, StreamExt};
use objectcache_client::layout::{ChunkHeader, HEADER_LEN};
use objectcache_client::protocol::{MissReason, PieceMiss, PieceRead, UnitPlan};
use objectcache_client::store::GetOptions;
use std::sync::Arc;
use tokio::sync::Semaphore;

/// One piece of a unit, read: its payload and its CRC32C.
type PieceResult = PieceRead<Bytes>;

/// Per chunk of a load, its object opened as a local file by the load's opener
/// ([`open_chunks`], chunk order); `opened` counts the chunks it has got to. A chunk's cell
/// holds `None` when the backend keeps no local files or the open failed (the ranged read
/// then says why).
#[derive(Clone)]
pub(super) struct LocalFiles {
    cells: Arc<Vec<std::sync::OnceLock<Option<Arc<LocalChunk>>>>>,
    opened: tokio::sync::watch::Receiver<usize>,
}

impl LocalFiles {
    /// Starts the opener of the chunk objects of `objects` (chunk `i`'s slices
    /// `slice_lens[i]` bytes, `layers` requested) on the blocking pool. Chunks in segment
    /// objects are read from the store.
    pub(super) fn open(
        store: Arc<dyn objectcache_client::store::Store>,
        objects: Arc<LoadObjects>,
        layers: std::ops::Range<u32>,
        slice_lens: Vec<u64>,
    ) -> Self {
        let cells: Arc<Vec<_>> = Arc::new(
            (0..objects.len())
                .map(|_| std::sync::OnceLock::new())
                .collect(),
        );
        let (tx, opened) = tokio::sync::watch::channel(0usize);
        let c = cells.clone();
        tokio::task::spawn_blocking(move || {
            open_chunks(&*store, &objects, layers, &slice_lens, &c, &tx)
        });
        Self { cells, opened }
    }

    /// Chunk `i` as a local file, once the opener has got to it; `None`: read it from the
    /// store instead.
    async fn get(&self, i: usize) -> Option<Arc<LocalChunk>> {
        let mut rx = self.opened.clone();
        rx.wait_for(|&n| n > i).await.ok()?;
        self.cells.get(i)?.get()?.clone()
    }
}

/// A load's opener: opens its chunk files one after another, in chunk order (the order the
/// first layer's units leave in), on one blocking thread, and publishes each as it is done.
/// One trip to the blocking pool per load rather than one or two per chunk: on a busy host
/// each trip waits for a thread, and the first unit waits for chunk 0 (time to first layer).
/// Stops early once nobody waits (the load ended).
fn open_chunks(
    store: &dyn objectcache_client::store::Store,
    objects: &LoadObjects,
    layers: std::ops::Range<u32>,
    slice_lens: &[u64],
    cells: &[std::sync::OnceLock<Option<Arc<LocalChunk>>>],
    opened: &tokio::sync::watch::Sender<usize>,
) {
    // The segment file the last chunk was in: its other chunks share the open.
    let mut last: Option<(String, Arc<std::fs::File>, u64, Bytes)> = None;
    for i in 0..objects.len() {
        if opened.is_closed() {
            return;
        }
        let at = objects.segment_slot(i);
        let key = objects.key(i);
        let local = match (&last, at) {
            (Some((k, file, size, mapped)), Some(at)) if k == key => {
                let c = LocalChunk {
                    file: file.clone(),
                    mapped: mapped.clone(),
                    size: *size,
                    header: Err("a segment's header is checked once per load".into()),
                    layers: layers.clone(),
                    at: Some(at),
                };
                c.advise(layers.start, slice_lens[i]);
                Some(Arc::new(c))
            }
            _ => open_local_chunk(store, key, at, layers.clone(), slice_lens[i]),
        };
        if let (Some(c), Some(_)) = (&local, at) {
            last = Some((key.to_string(), c.file.clone(), c.size, c.mapped.clone()));
        }
        let _ = cells[i].set(local);
        opened.send_replace(i + 1);
    }
}

pub(super) struct Fetched {
    pub(super) plan: UnitPlan,
    /// Per piece of `plan.pieces`, in order.
    pub(super) pieces: Vec<PieceResult>,
    /// The unit's bytes under the memory budget, from its read until it is written.
    pub(super) _hold: crate::budget::Hold,
}

/// `range` of the concatenation of `parts`, as slices of the same buffers (no copy).
fn sub_parts(parts: &[Bytes], range: std::ops::Range<u64>) -> Vec<Bytes> {
    let mut out = Vec::new();
    let mut at = 0u64;
    for p in parts {
        let (s, e) = (at, at + p.len() as u64);
        at = e;
        let (a, b) = (range.start.max(s), range.end.min(e));
        if a < b {
            out.push(p.slice((a - s) as usize..(b - s) as usize));
        }
    }
    out
}

fn crc_of(parts: &[Bytes]) -> u32 {
    parts.iter().fold(0, |c, p| {
        objectcache_client::layout::crc::crc32c_append(c, p)
    })
}

/// Reads one slice piece: the slice and its CRC trailer (`range` of object `key`) in one
/// ranged read, streamed as the backend's buffers (never concatenated).
async fn fetch_piece(
    sh: &ServerState,
    key: &str,
    range: std::ops::Range<u64>,
    layer: u32,
    p: &objectcache_client::protocol::SlicePiece,
    verify: bool,
) -> PieceResult {
    let want = range.end - range.start;
    // Joins a read of the same bytes in flight for another load (reads.rs).
    let (read, joined) = sh.reads.read(&sh.store, key, range);
    sh.metrics.request(if joined {
        "backend_read_joined"
    } else {
        "backend_read"
    });
    let out = read.await;
    let parts: Vec<Bytes> = out.map_err(|e| miss_of(p.chunk, &e))?.as_ref().clone();
    let got: u64 = parts.iter().map(|b| b.len() as u64).sum();
    if got != want {
        return Err(PieceMiss {
            chunk: p.chunk,
            reason: MissReason::Storage,
            message: format!("{key}: layer {layer} slice read returned {got} of {want} bytes"),
        });
    }
    let sl = p.slice_len;
    let trailer: Vec<u8> = sub_parts(&parts, sl..sl + 4)
        .iter()
        .flat_map(|b| b.iter().copied())
        .collect();
    let stored = u32::from_le_bytes(trailer[..4].try_into().expect("4 bytes"));
    let data = sub_parts(&parts, 0..sl);
    let whole = p.range.start == 0 && p.range.end == sl;
    // Verified here, or passed through: the client checks the unit CRC either way.
    if verify || !whole {
        let computed = crc_of(&data);
        if computed != stored {
            return Err(PieceMiss {
                chunk: p.chunk,
                reason: MissReason::ChecksumMismatch,
                message: format!(
                    "{key}: layer {layer} slice CRC32C {computed:#010x}, stored {stored:#010x}"
                ),
            });
        }
    }
    if whole {
        Ok((data, stored))
    } else {
        let piece = sub_parts(&data, p.range.clone());
        let c = crc_of(&piece);
        Ok((piece, c))
    }
}

/// A chunk's object opened as a local file (a chunk object, or the segment object holding
/// the chunk, one open shared by its chunks): its size and, for a chunk object, its header
/// bytes (for the header check, so a chunk is opened once per load); the layers the load
/// requested (`layers`); where the chunk's slices lie (`at`).
struct LocalChunk {
    file: Arc<std::fs::File>,
    /// The whole file mapped read-only ([`crate::mapped::map_whole`]): slices are lent
    /// from it to the socket writes, which fault its pages in as they touch them.
    mapped: Bytes,
    /// Object size in bytes, from the open file.
    size: u64,
    /// A chunk object's first [`HEADER_LEN`] bytes, or why they could not be read (a
    /// segment's header is checked by [`LoadObjects::check_segment_chunk`] instead).
    header: Result<[u8; HEADER_LEN as usize], String>,
    layers: std::ops::Range<u32>,
    /// `None`: a chunk object; else the chunk's index in its segment and the segment's layout.
    at: Option<(u32, objectcache_client::layout::SegmentLayout)>,
}

impl LocalChunk {
    /// Byte range of layer `layer`'s slice (`slice_len` bytes) and its CRC32C trailer.
    fn range(&self, layer: u32, slice_len: u64) -> std::ops::Range<u64> {
        super::objects::slice_at(self.at, layer, slice_len)
    }

    /// The stored CRC32C trailer of layer `layer`'s slice (`slice_len` bytes), read now from
    /// the mapping: a page [`LocalChunk::advise`] asked the kernel for a layer earlier.
    fn trailer(&self, layer: u32, slice_len: u64) -> Result<u32, String> {
        if !self.layers.contains(&layer) {
            return Err(format!("layer {layer} outside the request"));
        }
        let at = self.range(layer, slice_len).start + slice_len;
        let t = usize::try_from(at)
            .ok()
            .and_then(|at| self.mapped.get(at..at.checked_add(4)?))
            .ok_or_else(|| format!("layer {layer} slice CRC at {at} is past the object's end"))?;
        Ok(u32::from_le_bytes(t.try_into().expect("four bytes")))
    }

    /// Asks the kernel to start reading layer `layer`'s slice (with its CRC trailer) into the
    /// page cache (`POSIX_FADV_WILLNEED`; it does not wait for the read), unless the slice is
    /// there already. Per slice, one layer ahead of the send, rather than the whole object at
    /// open: on cold objects the next slice's read overlaps the current one's send, and the
    /// first layer is not held up behind whole objects.
    ///
    /// The advice itself looks up every page of its range in the page cache (a 1 MiB slice:
    /// 256 lookups), which on cached objects, the common case of a KV cache, is all it does:
    /// measured with `perf` on a 32K-token load, 3.3% of the process's CPU samples were under
    /// `fadvise64`, about 5% of the load's CPU. So the slice's first, middle and last bytes
    /// are probed first with one-byte reads that never wait for the device
    /// ([`page_cached`]); the advice is given only when one of them is not cached. A slice
    /// evicted in part elsewhere is faulted in by the socket write instead: slower, never
    /// wrong. Advice only: a failure costs a slower send, not correctness.
    fn advise(&self, layer: u32, slice_len: u64) {
        let r = self.range(layer, slice_len);
        if r.is_empty() {
            return;
        }
        let probes = [r.start, r.start + (r.end - r.start) / 2, r.end - 1];
        if probes.iter().all(|&at| page_cached(&self.file, at)) {
            return;
        }
        let _ = rustix::fs::fadvise(
            &*self.file,
            r.start,
            std::num::NonZeroU64::new(r.end - r.start),
            rustix::fs::Advice::WillNeed,
        );
    }
}

/// Whether the byte at `at` of `file` is in the page cache: a one-byte `preadv2(2)` with
/// `RWF_NOWAIT`, which fails with `EAGAIN` rather than wait for the device (Linux 4.14 and
/// later). Any failure (an older kernel, a file system without the flag) answers "not
/// cached", which only means the caller gives its advice.
fn page_cached(file: &std::fs::File, at: u64) -> bool {
    let mut b = [0u8; 1];
    matches!(
        rustix::io::preadv2(
            file,
            &mut [std::io::IoSliceMut::new(&mut b)],
            at,
            rustix::io::ReadWriteFlags::NOWAIT,
        ),
        Ok(1)
    )
}

/// Opens the object `key` holding a chunk (its own chunk object, `at` `None`; else the
/// segment object holding it at `at`) as a local file, if the backend keeps one, and reads a
/// chunk object's header, on the calling (blocking) thread; asks the kernel to read the
/// first requested layer's slice (with its CRC trailer) ahead ([`LocalChunk::advise`]; each
/// later slice is advised when the slice before it is queued), so the socket writes and
/// trailer reads find their pages in the page cache. One open and one read per chunk object:
/// on objects not in the page cache each read is a device read, and the load's opener opens
/// its chunks one after another. The header check ([`check_header`]) and the unit reads
/// share this open through the load's [`LocalFiles`].
fn open_local_chunk(
    store: &dyn objectcache_client::store::Store,
    key: &str,
    at: Option<(u32, objectcache_client::layout::SegmentLayout)>,
    layers: std::ops::Range<u32>,
    slice_len: u64,
) -> Option<Arc<LocalChunk>> {
    use std::os::unix::fs::FileExt;
    let o = store.open_local_blocking(key).ok().flatten()?;
    let size = o.meta().size;
    // A file that cannot be mapped is read from the store instead, as a backend without
    // local files is.
    let mapped = crate::mapped::map_whole(&o)
        .inspect_err(|e| tracing::debug!(key, error = %e, "gather: mapping an object failed"))
        .ok()?;
    let (f, _) = o.into_parts();
    let mut h = [0u8; HEADER_LEN as usize];
    let header = match at {
        None => f
            .read_exact_at(&mut h, 0)
            .map(|()| h)
            .map_err(|e| format!("header read: {e}")),
        Some(_) => Err("a segment's header is checked once per load".into()),
    };
    let c = LocalChunk {
        file: Arc::new(f),
        mapped,
        size,
        header,
        layers,
        at,
    };
    c.advise(c.layers.start, slice_len);
    Some(Arc::new(c))
}

/// A whole slice of a local file, unverified: its bytes are lent from the file's mapping (the
/// socket write is their only copy), its CRC is the stored trailer (the client checks the
/// payload against it, end to end).
fn piece_local(
    c: &LocalChunk,
    key: &str,
    layer: u32,
    p: &objectcache_client::protocol::SlicePiece,
) -> PieceResult {
    let trailer = c.trailer(layer, p.slice_len);
    // The next layer's slice of this chunk is sent a layer later: start reading it now.
    if c.layers.contains(&(layer + 1)) {
        c.advise(layer + 1, p.slice_len);
    }
    let at = c.range(layer, p.slice_len).start as usize;
    match trailer {
        // The trailer lies after the slice, so the slice is within the mapping.
        Ok(crc) => Ok((vec![c.mapped.slice(at..at + p.slice_len as usize)], crc)),
        Err(m) => Err(PieceMiss {
            chunk: p.chunk,
            reason: MissReason::Storage,
            message: format!("{key}: {m}"),
        }),
    }
}

async fn fetch_unit(
    sh: Arc<ServerState>,
    objects: Arc<LoadObjects>,
    reads: Arc<Semaphore>,
    plan: UnitPlan,
    verify: bool,
    files: Option<LocalFiles>,
) -> Fetched {
    let hold = sh.budget.acquire(plan.len).await;
    let layer = plan.layer;
    let pieces = futures::future::join_all(plan.pieces.iter().map(|p| {
        let (sh, objects, reads, files) =
            (sh.clone(), objects.clone(), reads.clone(), files.clone());
        async move {
            let _r = reads
                .acquire()
                .await
                .expect("read semaphore is never closed");
            let (c, key) = (p.chunk as usize, objects.key(p.chunk as usize));
            // Whole unverified slices of local files are lent from the file's mapping.
            if let Some(files) = files.filter(|_| p.range.start == 0 && p.range.end == p.slice_len)
            {
                if let Some(lc) = files.get(c).await {
                    return piece_local(&lc, key, layer, p);
                }
            }
            let range = objects.slice_range(c, layer, p.slice_len);
            fetch_piece(&sh, key, range, layer, p, verify).await
        }
    }))
    .await;
    Fetched {
        plan,
        pieces,
        _hold: hold,
    }
}

/// Aborts a spawned task when dropped (a load that ends early stops its reads at once).
pub(super) struct AbortOnDrop<T>(pub(super) tokio::task::JoinHandle<T>);
impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Reads and checks each chunk object's header, `read_concurrency` at a time, and sends each
/// result to `out` in chunk order as soon as it and those before it are known.
pub(super) async fn check_headers(
    sh: Arc<ServerState>,
    tokens: Vec<u32>,
    g: objectcache_client::protocol::WireGeometry,
    objects: Arc<LoadObjects>,
    files: Option<LocalFiles>,
    out: tokio::sync::mpsc::UnboundedSender<Result<(), PieceMiss>>,
) {
    let n = objects.len();
    let conc = sh.cfg.read_concurrency;
    let mut checks = stream::iter(0..n)
        .map(move |i| {
            let (sh, objects, files, t) = (sh.clone(), objects.clone(), files.clone(), tokens[i]);
            async move {
                match objects.in_segment(i) {
                    true => objects.check_segment_chunk(&sh, i, &g).await,
                    false => check_header(sh, &objects, files, i, t, g).await,
                }
            }
        })
        .buffered(conc);
    while let Some(r) = checks.next().await {
        if out.send(r).is_err() {
            return;
        }
    }
}

/// Checks chunk `i`'s header against the request: from the load's local open of the chunk
/// when the backend keeps files (`files`), else with a ranged read of its first
/// [`HEADER_LEN`] bytes.
async fn check_header(
    sh: Arc<ServerState>,
    objects: &LoadObjects,
    files: Option<LocalFiles>,
    i: usize,
    tokens: u32,
    g: objectcache_client::protocol::WireGeometry,
) -> Result<(), PieceMiss> {
    let c = i as u32;
    let key = objects.key(i);
    let local = match &files {
        Some(files) => files.get(i).await,
        None => None,
    };
    let (size, b) = match local {
        Some(lc) => match &lc.header {
            Ok(h) => (lc.size, Bytes::copy_from_slice(h)),
            Err(m) => {
                return Err(PieceMiss {
                    chunk: c,
                    reason: MissReason::Storage,
                    message: format!("{key}: {m}"),
                })
            }
        },
        None => {
            let r = sh
                .store
                .get_opts(
                    key,
                    GetOptions {
                        range: Some(0..HEADER_LEN),
                    },
                )
                .await
                .map_err(|e| miss_of(c, &e))?;
            let size = r.meta.size;
            (size, r.bytes().await.map_err(|e| miss_of(c, &e))?)
        }
    };
    let geo = |message: String| PieceMiss {
        chunk: c,
        reason: MissReason::GeometryMismatch,
        message,
    };
    let h = ChunkHeader::decode(&b).map_err(|e| geo(format!("{key}: {e}")))?;
    g.check_header(&h, tokens)
        .map_err(|m| geo(format!("{key}: {m}")))?;
    if size != h.object_len() {
        return Err(geo(format!(
            "{key}: object has {size} bytes, its header says {}",
            h.object_len()
        )));
    }
    Ok(())
}

/// Starts a load's reads in their own task, ahead of the socket: `plan`'s units are read in
/// order, at most `depth` at a time (and `read_concurrency` backend reads), and sent to the
/// returned receiver in plan order. The first layer's units are read alone, with every read
/// slot, before any read-ahead starts: layer 0 is pure stall for the client (time to first
/// layer). Dropping the returned task stops the reads.
pub(super) fn start_reads(
    sh: &Arc<ServerState>,
    plan: Vec<UnitPlan>,
    objects: Arc<LoadObjects>,
    verify: bool,
    files: Option<LocalFiles>,
    depth: usize,
) -> (tokio::sync::mpsc::Receiver<Fetched>, AbortOnDrop<()>) {
    let (tx, rx) = tokio::sync::mpsc::channel::<Fetched>(depth);
    let reads = Arc::new(Semaphore::new(sh.cfg.read_concurrency));
    let sh = sh.clone();
    let task = AbortOnDrop(tokio::spawn(async move {
        let first = plan.first().map(|u| u.layer);
        let split = plan.iter().take_while(|u| Some(u.layer) == first).count();
        let mut plan = plan;
        let rest = plan.split_off(split);
        let fetch = |u| {
            fetch_unit(
                sh.clone(),
                objects.clone(),
                reads.clone(),
                u,
                verify,
                files.clone(),
            )
        };
        let mut fetches = stream::iter(plan)
            .map(fetch)
            .buffered(depth)
            .chain(stream::iter(rest).map(fetch).buffered(depth));
        while let Some(f) = fetches.next().await {
            if tx.send(f).await.is_err() {
                return;
            }
        }
    }));
    (rx, task)
}
