//! The gather endpoint: a tokio driver over [`ServerConnection`] that serves loads (parallel
//! bounded reads, units streamed in layer order) and batched saves.

use super::budget::Hold;
use super::conn::RateFloor;
use super::{Abort, Shared};
use crate::error::StoreError;
use crate::layout::{slice_range, ChunkHeader, HEADER_LEN};
use crate::protocol::{
    plan_units, ErrorCode, GatherRequest, MissReason, SaveRequest, ServerConnection, ServerEvent,
    TransportTarget, UnitHeader, UnitPlan,
};
use crate::store::{GetOptions, StoreExt};
use bytes::{Bytes, BytesMut};
use futures::{stream, StreamExt};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

/// Bytes per permit of the memory budget semaphore.
pub(crate) const PERMIT_BYTES: u64 = 4096;

/// Buffers per vectored write (well under the kernel's IOV_MAX of 1024).
const MAX_IOV: usize = 64;

pub(crate) fn permits_for(bytes: u64) -> u32 {
    bytes.div_ceil(PERMIT_BYTES).min(u32::MAX as u64) as u32
}

struct Io {
    rd: OwnedReadHalf,
    wr: OwnedWriteHalf,
    buf: BytesMut,
    conn: ServerConnection,
    /// Memory budget held for the large frame being received (see [`Io::read_more`]).
    frame_hold: Option<(usize, Hold)>,
    /// Holds of large save-data frames received and not yet handed to their save, in order.
    save_holds: std::collections::VecDeque<Hold>,
    /// The progress the client owes while the server waits to write to it.
    write_floor: RateFloor,
}

/// Bytes of a gather connection's read buffer: before authentication it never holds more
/// (handshake frames are a few hundred bytes, [`crate::protocol::MAX_HANDSHAKE_BODY_BYTES`]);
/// a larger frame afterwards (a descriptor, save data) is read into memory held under the
/// budget.
const CONN_BUF_BYTES: usize = 8 << 10;
/// Bytes of a large frame read per budget step: memory is held for what arrived plus one
/// step, never for a size the frame header merely declares.
const FRAME_STEP_BYTES: usize = 1 << 20;

/// How long a read of the client may wait.
enum ReadWait<'a> {
    /// Until this instant (the handshake deadline).
    Until(Instant),
    /// This long with no request (an idle connection).
    Idle(Duration),
    /// Under the client's progress floor (data the server is waiting for).
    Floor(&'a mut RateFloor),
}

/// Bytes a write to the client moved (for its progress floor).
trait Moved {
    fn moved(&self) -> u64;
}
impl Moved for usize {
    fn moved(&self) -> u64 {
        *self as u64
    }
}

/// A write to the client under its progress floor ([`RateFloor`]: some bytes, and at least
/// `min_client_bytes_per_s`, over each `client_timeout_secs` the server waits on it): an
/// I/O error, or a client that takes too little (counted as a `client_timeout` error), ends
/// the connection.
async fn within_client_timeout<T: Moved>(
    sh: &Shared,
    floor: &mut RateFloor,
    write: impl std::future::Future<Output = std::io::Result<T>>,
) -> Result<T, Abort> {
    let moved = |r: &std::io::Result<T>| r.as_ref().map_or(0, Moved::moved);
    match floor.guard(write, moved).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(_)) => Err(Abort::Gone),
        Err(_) => {
            sh.metrics.error("client_timeout");
            Err(Abort::Gone)
        }
    }
}

impl Io {
    /// Writes everything queued with vectored writes (no copy: the queued `Bytes` are the
    /// backend's buffers); a client that accepts nothing for `client_timeout` is gone.
    async fn flush(&mut self, sh: &Shared) -> Result<(), Abort> {
        let mut q: std::collections::VecDeque<Bytes> = std::collections::VecDeque::new();
        while let Some(b) = self.conn.poll_transmit() {
            if !b.is_empty() {
                q.push_back(b);
            }
        }
        while !q.is_empty() {
            let slices: Vec<std::io::IoSlice<'_>> = q
                .iter()
                .take(MAX_IOV)
                .map(|b| std::io::IoSlice::new(b))
                .collect();
            let mut n =
                within_client_timeout(sh, &mut self.write_floor, self.wr.write_vectored(&slices))
                    .await?;
            if n == 0 {
                return Err(Abort::Gone);
            }
            drop(slices);
            while n > 0 {
                let front = q.front_mut().expect("written bytes were queued");
                if n >= front.len() {
                    n -= front.len();
                    q.pop_front();
                } else {
                    bytes::Buf::advance(front, n);
                    n = 0;
                }
            }
        }
        Ok(())
    }

    /// Writes the queued frames (a unit's prefix, and any misses before it) with `MSG_MORE`,
    /// so the kernel sends them in one segment with the `sendfile` payload that follows
    /// rather than alone (the socket has `TCP_NODELAY`): one wake-up of the client per unit
    /// fewer. A client that accepts nothing for `client_timeout` is gone.
    async fn flush_more(&mut self, sh: &Shared) -> Result<(), Abort> {
        let mut q: Vec<u8> = Vec::new();
        while let Some(b) = self.conn.poll_transmit() {
            q.extend_from_slice(&b);
        }
        let sock: &TcpStream = self.wr.as_ref();
        let mut off = 0;
        while off < q.len() {
            let send = sock.async_io(tokio::io::Interest::WRITABLE, || {
                rustix::net::send(sock, &q[off..], rustix::net::SendFlags::MORE)
                    .map_err(std::io::Error::from)
            });
            match within_client_timeout(sh, &mut self.write_floor, send).await? {
                0 => return Err(Abort::Gone),
                n => off += n,
            }
        }
        Ok(())
    }

    /// Sends a unit's payload parts after its prefix: buffers with plain writes, file ranges
    /// with `sendfile(2)` (page-cache pages to the socket, no copy through user space). A
    /// file shorter than its range (never, for immutable objects) or a client that accepts
    /// nothing for `client_timeout` ends the connection: the client fails what is incomplete.
    async fn send_parts(&mut self, sh: &Shared, parts: Vec<Part>) -> Result<(), Abort> {
        for p in parts {
            match p {
                Part::Mem(b) => {
                    let mut at = 0;
                    while at < b.len() {
                        match within_client_timeout(
                            sh,
                            &mut self.write_floor,
                            self.wr.write(&b[at..]),
                        )
                        .await?
                        {
                            0 => return Err(Abort::Gone),
                            n => at += n,
                        }
                    }
                }
                Part::File(f) => {
                    let sock: &TcpStream = self.wr.as_ref();
                    let end = f.offset + f.len;
                    let mut off = f.offset;
                    while off < end {
                        let send = sock.async_io(tokio::io::Interest::WRITABLE, || {
                            let n = (end - off).min(1 << 30) as usize;
                            rustix::fs::sendfile(sock, &*f.file, Some(&mut off), n)
                                .map_err(std::io::Error::from)
                        });
                        if within_client_timeout(sh, &mut self.write_floor, send).await? == 0 {
                            tracing::error!(offset = off, end, "local file shorter than its slice");
                            sh.metrics.error("storage");
                            return Err(Abort::Gone);
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Reads what the client sends next into the connection buffer and hands it to the
    /// state machine. A frame larger than [`CONN_BUF_BYTES`] is read [`FRAME_STEP_BYTES`] at
    /// a time, each step's memory taken from the budget before it is read (waiting up to the
    /// client timeout, then `Busy`); once decoded, a save-data frame's hold goes with its
    /// payload, any other's is given back, and the buffer shrinks back to its fixed size.
    ///
    /// # Errors
    /// [`Abort::Gone`] when the client closed, failed, sent a bad frame, or broke `wait`.
    async fn read_more(&mut self, sh: &Shared, wait: ReadWait<'_>) -> Result<(), Abort> {
        let mut limit = CONN_BUF_BYTES.saturating_sub(self.buf.len()).max(1);
        if let Some(total) = self.conn.partial_frame_len(&self.buf) {
            if total > CONN_BUF_BYTES {
                let want = total.min(self.buf.len() + FRAME_STEP_BYTES);
                let held = self
                    .frame_hold
                    .as_ref()
                    .map_or(0, |(_, h)| h.bytes() as usize);
                if want > held {
                    let wait = Duration::from_secs(sh.cfg.client_timeout_secs);
                    let Some(more) = sh.budget.acquire_within((want - held) as u64, wait).await
                    else {
                        sh.metrics.error("memory_budget");
                        self.conn.close_with(
                            ErrorCode::Busy,
                            "the server's memory budget is in use by other requests; retry",
                        );
                        let _ = self.flush(sh).await;
                        return Err(Abort::Gone);
                    };
                    match &mut self.frame_hold {
                        Some((_, h)) => h.merge(more),
                        None => self.frame_hold = Some((total, more)),
                    }
                }
                limit = want - self.buf.len();
            }
        }
        let mut room = bytes::BufMut::limit(&mut self.buf, limit);
        let read = self.rd.read_buf(&mut room);
        let r = match wait {
            ReadWait::Until(t) => match tokio::time::timeout_at(t, read).await {
                Ok(r) => r,
                Err(_) => {
                    sh.metrics.error("handshake");
                    return Err(Abort::Gone);
                }
            },
            ReadWait::Idle(d) => match tokio::time::timeout(d, read).await {
                Ok(r) => r,
                Err(_) => return Err(Abort::Gone),
            },
            ReadWait::Floor(f) => match f.guard(read, |r| *r.as_ref().unwrap_or(&0) as u64).await {
                Ok(r) => r,
                Err(_) => {
                    sh.metrics.error("client_too_slow");
                    return Err(Abort::Gone);
                }
            },
        };
        match r {
            Ok(0) | Err(_) => return Err(Abort::Gone),
            Ok(_) => {}
        }
        let whole = self
            .frame_hold
            .as_ref()
            .is_some_and(|(total, _)| self.buf.len() >= *total);
        let ty = self.buf.first().copied();
        let _ = self.conn.handle_bytes(&mut self.buf);
        if whole {
            let (_, h) = self.frame_hold.take().expect("held");
            if ty == Some(crate::protocol::FrameType::SaveData as u8) {
                self.save_holds.push_back(h);
            }
            // The frame's bytes now belong to its payload alone: a fresh small buffer.
            let rest = self.buf.split();
            self.buf = BytesMut::with_capacity(CONN_BUF_BYTES.max(rest.len()));
            self.buf.extend_from_slice(&rest);
        }
        Ok(())
    }

    /// The budget hold of a save-data frame with `len` payload bytes, if it was received as a
    /// large frame (see [`Io::read_more`]).
    fn save_hold(&mut self, len: usize) -> Option<Hold> {
        let frame = crate::protocol::FRAME_HEADER_LEN + crate::protocol::SAVE_DATA_HEADER_LEN + len;
        (frame > CONN_BUF_BYTES)
            .then(|| self.save_holds.pop_front())
            .flatten()
    }

    /// Reads until the client cancels or goes away (cancel-safe).
    async fn next_signal(&mut self) -> Abort {
        loop {
            match self.rd.read_buf(&mut self.buf).await {
                Ok(0) | Err(_) => return Abort::Gone,
                Ok(_) => {
                    if self.conn.handle_bytes(&mut self.buf).is_err() {
                        return Abort::Gone;
                    }
                    while let Some(ev) = self.conn.poll_event() {
                        if let ServerEvent::Cancel { .. } = ev {
                            return Abort::Cancelled;
                        }
                    }
                }
            }
        }
    }
}

/// A connection's protocol state: with access keys configured, the client must answer an
/// HMAC challenge over a fresh random nonce with one of them (protocol version 2,
/// [`crate::protocol::auth`]) before any request, as S3 requests must carry SigV4.
fn new_connection(sh: &Shared) -> ServerConnection {
    if sh.cfg.access_keys.is_empty() {
        return ServerConnection::new(sh.limits());
    }
    let mut nonce = [0u8; crate::protocol::auth::NONCE_LEN];
    if let Err(e) = getrandom::fill(&mut nonce) {
        // No OS randomness: refuse the connection rather than use a guessable nonce.
        tracing::error!(error = %e, "no random nonce for gather authentication");
        let mut c = ServerConnection::new(sh.limits());
        c.close_with(
            ErrorCode::Internal,
            "server has no randomness for authentication",
        );
        return c;
    }
    ServerConnection::with_auth(sh.limits(), nonce)
}

/// Serves one gather connection until the client closes it, fails, or the server stops.
/// `head`: the bytes the preface sniffer already read. The hello and authentication must be
/// done by `handshake_deadline`; an established connection with no request for
/// `idle_timeout_secs` is closed.
pub(crate) async fn serve(
    stream: TcpStream,
    sh: Arc<Shared>,
    head: &[u8],
    handshake_deadline: Instant,
) {
    let _ = stream.set_nodelay(true);
    let peer = stream.peer_addr().ok();
    let (rd, wr) = stream.into_split();
    let mut buf = BytesMut::with_capacity(CONN_BUF_BYTES);
    buf.extend_from_slice(head);
    let mut io = Io {
        rd,
        wr,
        buf,
        conn: new_connection(&sh),
        frame_hold: None,
        save_holds: std::collections::VecDeque::new(),
        write_floor: super::client_floor(&sh.cfg),
    };
    let _ = io.conn.handle_bytes(&mut io.buf);
    let mut floor = super::client_floor(&sh.cfg);
    tracing::debug!(?peer, "gather connection");
    loop {
        while let Some(ev) = io.conn.poll_event() {
            let r = match ev {
                ServerEvent::Gather(req) => run_gather(&mut io, *req, &sh).await,
                ServerEvent::SaveBegin(req) => run_save(&mut io, *req, &sh).await,
                ServerEvent::Authenticate { access_key, mac } => {
                    let secret = sh
                        .cfg
                        .access_keys
                        .iter()
                        .find(|k| k.access_key == access_key)
                        .map(|k| k.secret_key.as_str());
                    if io.conn.authenticate(&access_key, &mac, secret) {
                        tracing::debug!(?peer, %access_key, "gather connection authenticated");
                    } else {
                        sh.metrics.error("unauthorized");
                        tracing::warn!(?peer, %access_key, "gather authentication refused");
                    }
                    Ok(())
                }
                ServerEvent::Failed(e) => {
                    sh.metrics.error("protocol");
                    tracing::warn!(?peer, error = %e, "gather protocol error");
                    Ok(())
                }
                _ => Ok(()),
            };
            if let Err(a) = r {
                if a == Abort::Gone {
                    sh.metrics.error("client_gone");
                    tracing::info!(
                        ?peer,
                        "client went away mid-request; its resources are freed"
                    );
                }
                return;
            }
        }
        if io.flush(&sh).await.is_err() || io.conn.is_closed() {
            let _ = io.wr.shutdown().await;
            return;
        }
        // Before authentication, the handshake deadline; between requests, the idle timeout;
        // once a request's frame has begun, the client owes progress.
        let wait = if !io.conn.is_established() {
            ReadWait::Until(handshake_deadline)
        } else if io.buf.is_empty() {
            ReadWait::Idle(Duration::from_secs(sh.cfg.idle_timeout_secs))
        } else {
            ReadWait::Floor(&mut floor)
        };
        tokio::select! {
            r = io.read_more(&sh, wait) => if r.is_err() {
                tracing::debug!(?peer, "gather connection closed (client gone, idle or past its handshake deadline)");
                return;
            },
            _ = sh.shutdown.cancelled() => return,
        }
    }
}

/// Why a (chunk, layer) is not delivered.
struct Miss {
    chunk: u32,
    reason: MissReason,
    message: String,
}

fn miss_of(chunk: u32, e: &StoreError) -> Miss {
    let reason = match e {
        StoreError::NotFound { .. } => MissReason::NotFound,
        StoreError::InvalidRange { .. } => MissReason::GeometryMismatch,
        _ => MissReason::Storage,
    };
    Miss {
        chunk,
        reason,
        message: e.to_string(),
    }
}

/// Memory held by a unit between backend read and socket write.
struct MemoryHold {
    _permit: OwnedSemaphorePermit,
    bytes: i64,
    sh: Arc<Shared>,
}
impl Drop for MemoryHold {
    fn drop(&mut self) {
        self.sh.metrics.inflight_bytes.dec_by(self.bytes);
    }
}

/// A byte range of an object's open local file ([`crate::store::Store::open_local`]), sent
/// to the socket with `sendfile(2)`: the kernel hands page-cache pages to the socket, with no
/// copy through user space.
struct FileRange {
    file: Arc<std::fs::File>,
    offset: u64,
    len: u64,
}

/// Payload bytes of a unit: the backend's buffers (no copy), or a range of a local file.
enum Part {
    Mem(Bytes),
    File(FileRange),
}

/// `parts` as buffers, if none is a file range.
fn into_mem(parts: Vec<Part>) -> Result<Vec<Bytes>, Vec<Part>> {
    if parts.iter().all(|p| matches!(p, Part::Mem(_))) {
        Ok(parts
            .into_iter()
            .filter_map(|p| match p {
                Part::Mem(b) => Some(b),
                Part::File(_) => None,
            })
            .collect())
    } else {
        Err(parts)
    }
}

/// One piece of a unit, read: its payload and its CRC32C.
type PieceResult = Result<(Vec<Part>, u32), Miss>;

/// Per chunk of a load, its object opened as a local file by the load's opener
/// ([`open_chunks`], chunk order); `opened` counts the chunks it has got to. A chunk's cell
/// holds `None` when the backend keeps no local files or the open failed (the ranged read
/// then says why).
#[derive(Clone)]
struct LocalFiles {
    cells: Arc<Vec<std::sync::OnceLock<Option<Arc<LocalChunk>>>>>,
    opened: tokio::sync::watch::Receiver<usize>,
}

impl LocalFiles {
    /// Starts the opener of `keys` (chunk `i`'s slices `slice_lens[i]` bytes, `layers`
    /// requested) on the blocking pool.
    fn open(
        store: Arc<dyn crate::store::Store>,
        keys: Arc<Vec<String>>,
        layers: std::ops::Range<u32>,
        slice_lens: Vec<u64>,
    ) -> Self {
        let cells: Arc<Vec<_>> = Arc::new(
            (0..keys.len())
                .map(|_| std::sync::OnceLock::new())
                .collect(),
        );
        let (tx, opened) = tokio::sync::watch::channel(0usize);
        let c = cells.clone();
        tokio::task::spawn_blocking(move || {
            open_chunks(&*store, &keys, layers, &slice_lens, &c, &tx)
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
    store: &dyn crate::store::Store,
    keys: &[String],
    layers: std::ops::Range<u32>,
    slice_lens: &[u64],
    cells: &[std::sync::OnceLock<Option<Arc<LocalChunk>>>],
    opened: &tokio::sync::watch::Sender<usize>,
) {
    for (i, key) in keys.iter().enumerate() {
        if opened.is_closed() {
            return;
        }
        let _ = cells[i].set(open_local_chunk(store, key, layers.clone(), slice_lens[i]));
        opened.send_replace(i + 1);
    }
}

struct Fetched {
    plan: UnitPlan,
    /// Per piece of `plan.pieces`, in order.
    pieces: Vec<PieceResult>,
    _hold: MemoryHold,
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
    parts
        .iter()
        .fold(0, |c, p| crate::layout::crc::crc32c_append(c, p))
}

/// Reads one slice piece: the slice and its CRC trailer in one ranged read, streamed as the
/// backend's buffers (never concatenated).
async fn fetch_piece(
    sh: &Shared,
    key: &str,
    layer: u32,
    p: &crate::protocol::SlicePiece,
    verify: bool,
) -> PieceResult {
    let range = slice_range(layer, p.slice_len);
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
        return Err(Miss {
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
            return Err(Miss {
                chunk: p.chunk,
                reason: MissReason::ChecksumMismatch,
                message: format!(
                    "{key}: layer {layer} slice CRC32C {computed:#010x}, stored {stored:#010x}"
                ),
            });
        }
    }
    let mem = |v: Vec<Bytes>| v.into_iter().map(Part::Mem).collect();
    if whole {
        Ok((mem(data), stored))
    } else {
        let piece = sub_parts(&data, p.range.clone());
        let c = crc_of(&piece);
        Ok((mem(piece), c))
    }
}

/// A chunk object opened as a local file: its size and header bytes (for the header check,
/// so a chunk is opened once per load), and the layers the load requested (`layers`).
struct LocalChunk {
    file: Arc<std::fs::File>,
    /// Object size in bytes, from the open file.
    size: u64,
    /// The first [`HEADER_LEN`] bytes, or why they could not be read.
    header: Result<[u8; HEADER_LEN as usize], String>,
    layers: std::ops::Range<u32>,
}

impl LocalChunk {
    /// The stored CRC32C trailer of layer `layer`'s slice (`slice_len` bytes), read now: one
    /// 4-byte read from a page [`advise_slice`] asked the kernel for a layer earlier.
    fn trailer(&self, layer: u32, slice_len: u64) -> Result<u32, String> {
        use std::os::unix::fs::FileExt;
        if !self.layers.contains(&layer) {
            return Err(format!("layer {layer} outside the request"));
        }
        let mut t = [0u8; 4];
        self.file
            .read_exact_at(&mut t, slice_range(layer, slice_len).start + slice_len)
            .map(|()| u32::from_le_bytes(t))
            .map_err(|e| format!("layer {layer} slice CRC read: {e}"))
    }
}

/// Opens chunk `key` as a local file, if the backend keeps one, and reads its header, on the
/// calling (blocking) thread; asks the kernel to read the first requested layer's slice
/// (with its CRC trailer) ahead ([`advise_slice`]; each later slice is advised when the slice
/// before it is queued), so the `sendfile`s and trailer reads find their pages in the page
/// cache. One open and one read per chunk: on objects not in the page cache each read is a
/// device read, and the load's opener opens its chunks one after another. The header check
/// ([`check_header`]) and the unit reads share this open through the load's [`LocalFiles`].
fn open_local_chunk(
    store: &dyn crate::store::Store,
    key: &str,
    layers: std::ops::Range<u32>,
    slice_len: u64,
) -> Option<Arc<LocalChunk>> {
    use std::os::unix::fs::FileExt;
    let o = store.open_local_blocking(key).ok().flatten()?;
    let (f, size) = (o.file, o.meta.size);
    advise_slice(&f, layers.start, slice_len);
    let mut h = [0u8; HEADER_LEN as usize];
    let header = f
        .read_exact_at(&mut h, 0)
        .map(|()| h)
        .map_err(|e| format!("header read: {e}"));
    Some(Arc::new(LocalChunk {
        file: Arc::new(f),
        size,
        header,
        layers,
    }))
}

/// Asks the kernel to start reading layer `layer`'s slice of a chunk file into the page
/// cache (`POSIX_FADV_WILLNEED`; it does not wait for the read). Per slice, one layer ahead
/// of the send, rather than the whole object at open: advising a whole 8 MiB object walks
/// 2,048 pages per chunk (for 128 chunks at 32K tokens) while the first layer is being sent,
/// per slice spreads that work over the load; on cold objects the next slice's read still
/// overlaps the current one's send. (On the 2-core build machine, with objects cached,
/// whole-object, per-slice and no advice measured alike within its run-to-run noise.)
/// Advice only: a failure costs a slower send, not correctness.
fn advise_slice(f: &std::fs::File, layer: u32, slice_len: u64) {
    let r = slice_range(layer, slice_len);
    let _ = rustix::fs::fadvise(
        f,
        r.start,
        std::num::NonZeroU64::new(slice_len + crate::layout::SLICE_CRC_LEN),
        rustix::fs::Advice::WillNeed,
    );
}

/// A whole slice of a local file, unverified: its bytes are named in the file (sent with
/// `sendfile`), its CRC is the stored trailer (the client checks the payload against it, end
/// to end).
fn piece_local(
    c: &LocalChunk,
    key: &str,
    layer: u32,
    p: &crate::protocol::SlicePiece,
) -> PieceResult {
    let trailer = c.trailer(layer, p.slice_len);
    // The next layer's slice of this chunk is sent a layer later: start reading it now.
    if c.layers.contains(&(layer + 1)) {
        advise_slice(&c.file, layer + 1, p.slice_len);
    }
    match trailer {
        Ok(crc) => Ok((
            vec![Part::File(FileRange {
                file: c.file.clone(),
                offset: slice_range(layer, p.slice_len).start,
                len: p.slice_len,
            })],
            crc,
        )),
        Err(m) => Err(Miss {
            chunk: p.chunk,
            reason: MissReason::Storage,
            message: format!("{key}: {m}"),
        }),
    }
}

async fn fetch_unit(
    sh: Arc<Shared>,
    keys: Arc<Vec<String>>,
    reads: Arc<Semaphore>,
    plan: UnitPlan,
    verify: bool,
    files: Option<LocalFiles>,
) -> Fetched {
    let permit = sh
        .memory
        .clone()
        .acquire_many_owned(permits_for(plan.len))
        .await
        .expect("memory semaphore is never closed");
    sh.metrics.add_inflight(plan.len as i64);
    let hold = MemoryHold {
        _permit: permit,
        bytes: plan.len as i64,
        sh: sh.clone(),
    };
    let layer = plan.layer;
    let pieces = futures::future::join_all(plan.pieces.iter().map(|p| {
        let (sh, keys, reads, files) = (sh.clone(), keys.clone(), reads.clone(), files.clone());
        async move {
            let _r = reads
                .acquire()
                .await
                .expect("read semaphore is never closed");
            let key = &keys[p.chunk as usize];
            // Whole unverified slices of local files are sent from the file (sendfile).
            if let Some(files) = files.filter(|_| p.range.start == 0 && p.range.end == p.slice_len)
            {
                if let Some(c) = files.get(p.chunk as usize).await {
                    return piece_local(&c, key, layer, p);
                }
            }
            fetch_piece(&sh, key, layer, p, verify).await
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
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);
impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Reads and checks each chunk object's header, `read_concurrency` at a time, and sends each
/// result to `out` in chunk order as soon as it and those before it are known.
async fn check_headers(
    sh: Arc<Shared>,
    tokens: Vec<u32>,
    g: crate::protocol::WireGeometry,
    keys: Arc<Vec<String>>,
    files: Option<LocalFiles>,
    out: tokio::sync::mpsc::UnboundedSender<Result<(), Miss>>,
) {
    let n = keys.len();
    let conc = sh.cfg.read_concurrency;
    let mut checks = stream::iter(0..n)
        .map(move |i| check_header(sh.clone(), keys.clone(), files.clone(), i, tokens[i], g))
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
    sh: Arc<Shared>,
    keys: Arc<Vec<String>>,
    files: Option<LocalFiles>,
    i: usize,
    tokens: u32,
    g: crate::protocol::WireGeometry,
) -> Result<(), Miss> {
    let c = i as u32;
    let key = &keys[i];
    let local = match &files {
        Some(files) => files.get(i).await,
        None => None,
    };
    let (size, b) = match local {
        Some(lc) => match &lc.header {
            Ok(h) => (lc.size, Bytes::copy_from_slice(h)),
            Err(m) => {
                return Err(Miss {
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
    let geo = |message: String| Miss {
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

/// Ticks every [`crate::protocol::HELD_EVERY_MS`] ms, the first a period from now: while a
/// request is held on purpose, each tick sends a `Held` frame to a client that asked for them.
fn held_ticker() -> tokio::time::Interval {
    let every = Duration::from_millis(crate::protocol::HELD_EVERY_MS);
    let mut t = tokio::time::interval_at(Instant::now() + every, every);
    t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    t
}

/// Payload bytes per layer of `plan`, in delivery order (the link scheduler's layer sizes).
fn layer_bytes_of(plan: &[UnitPlan]) -> Vec<u64> {
    let mut v: Vec<(u32, u64)> = Vec::new();
    for u in plan {
        match v.last_mut() {
            Some((l, b)) if *l == u.layer => *b += u.len,
            _ => v.push((u.layer, u.len)),
        }
    }
    v.into_iter().map(|(_, b)| b).collect()
}

async fn run_gather(io: &mut Io, req: GatherRequest, sh: &Arc<Shared>) -> Result<(), Abort> {
    let t0 = Instant::now();
    sh.metrics.request("gather");
    let id = req.request_id;
    let refuse = |io: &mut Io, code: ErrorCode, msg: String| {
        sh.metrics.error(code.label());
        tracing::info!(request = id, code = code.label(), "gather refused: {msg}");
        io.conn.fail(code, &msg);
    };
    #[cfg(not(feature = "rdma"))]
    if matches!(req.target, TransportTarget::Rdma(_)) {
        refuse(
            io,
            ErrorCode::Unsupported,
            "this server offers no RDMA target; use the inline TCP target".into(),
        );
        return io.flush(sh).await;
    }
    // An object larger than any this server stores cannot exist: refuse before any I/O.
    let largest = req
        .chunk_tokens
        .iter()
        .map(|&t| crate::layout::object_len(req.geometry.layers, req.geometry.slice_len(t)))
        .max()
        .unwrap_or(0);
    if largest > sh.cfg.max_object_bytes {
        refuse(
            io,
            ErrorCode::MemoryLimit,
            format!(
                "the request's chunk objects would be {largest} bytes, above this server's \
                 max_object_bytes {}",
                sh.cfg.max_object_bytes
            ),
        );
        return io.flush(sh).await;
    }
    match sh.buckets.exists(&req.bucket).await {
        Ok(true) => {}
        Ok(false) => {
            refuse(
                io,
                ErrorCode::NoSuchBucket,
                format!("bucket {} does not exist", req.bucket),
            );
            return io.flush(sh).await;
        }
        Err(e) => {
            refuse(io, ErrorCode::Storage, e.to_string());
            return io.flush(sh).await;
        }
    }
    let plan = plan_units(&req);
    // RDMA target: units are written into the client's memory (gather_rdma), not the stream.
    #[cfg(feature = "rdma")]
    let mut rdma = match &req.target {
        TransportTarget::Rdma(_) => match super::gather_rdma::Delivery::start(sh, &req, &plan) {
            Ok(d) => Some(d),
            Err(msg) => {
                refuse(io, ErrorCode::Unsupported, msg);
                return io.flush(sh).await;
            }
        },
        TransportTarget::InlineTcp => None,
    };
    let max_unit = plan.iter().map(|u| u.len).max().unwrap_or(0);
    let total: u64 = plan.iter().map(|u| u.len).sum();
    let keys: Arc<Vec<String>> = Arc::new(
        (0..req.chunks.len())
            .map(|i| req.chunks.key(i).expect("in range"))
            .collect(),
    );
    if let Some(bad) = keys
        .iter()
        .find(|k| crate::store::validate_key(&format!("{}/{k}", req.bucket)).is_err())
    {
        refuse(
            io,
            ErrorCode::Malformed,
            format!("invalid object key {bad:?}"),
        );
        return io.flush(sh).await;
    }
    let keys: Arc<Vec<String>> =
        Arc::new(keys.iter().map(|k| format!("{}/{k}", req.bucket)).collect());
    // The load holds its chunks' entries from when it arrives (also while it waits for
    // admission) until it ends: collection never deletes them under it (released on
    // completion, cancel, failure, and with the process).
    let _lease = sh.leases.acquire(keys.iter().cloned());
    let now = std::time::SystemTime::now();
    for k in keys.iter() {
        sh.access.record(k, now);
    }

    // Admission: wait for a slot under the scheduler, watching the client meanwhile.
    let first_deadline_us = match &req.hints {
        crate::protocol::SchedHints::LayerDeadlinesUs(v) => v.first().map(|&d| d as u64),
        crate::protocol::SchedHints::LayerComputeUs(v) => v.first().map(|&d| d as u64),
        crate::protocol::SchedHints::None => None,
    };
    // The load this request belongs to (its stripes share admission and pacing; see group.rs).
    let member = super::group::Member::join(&sh.loads, &req);
    let nl = req.layers.len() as u64;
    let load_total = req
        .group
        .map_or(total, |g| g.load_layer_bytes.saturating_mul(nl));
    // A client that asked for them gets `Held` frames while the load waits on purpose.
    let admitted = member.admit(sh, req.priority, first_deadline_us, load_total);
    tokio::pin!(admitted);
    let mut held = held_ticker();
    let slot = loop {
        tokio::select! {
            s = &mut admitted => break s,
            _ = held.tick(), if req.held => { io.conn.send_held(id); io.flush(sh).await?; }
            a = io.next_signal() => return match a { Abort::Cancelled => { io.conn.finish(id, 0, 0); io.flush(sh).await } a => Err(a) },
            _ = sh.shutdown.cancelled() => { io.conn.close_with(ErrorCode::ShuttingDown, "server is shutting down"); let _ = io.flush(sh).await; return Err(Abort::Shutdown) }
        }
    };
    match slot {
        Ok(()) => {}
        Err(msg) => {
            refuse(io, ErrorCode::Busy, msg);
            return io.flush(sh).await;
        }
    };

    io.conn.accept(id, plan.len() as u64, total);
    io.flush(sh).await?;
    // Under a bandwidth cap the link scheduler paces the load's units (`crate::link`), once
    // per load whatever its stripes; the load's departure is when its last stripe ends.
    if let Some(link) = &sh.link {
        member.start_pacing(
            link,
            || match req.group {
                Some(g) => vec![g.load_layer_bytes; req.layers.len()],
                None => layer_bytes_of(&plan),
            },
            &req.hints,
        );
    }
    // Reads run in their own task, ahead of the socket: while unit u is being written, units
    // u+1.. are read (bounded by `depth` units and the server's memory budget). The header
    // checks run alongside; nothing is sent before they are known.
    let depth = ((sh.cfg.max_request_bytes / max_unit.max(1)) as usize).clamp(1, 64);
    let verify = req.verify || sh.cfg.always_verify;
    // Unverified slices bound for the TCP stream are sent from local files when the backend
    // keeps them (the client checks each unit's stored CRC32C end to end).
    let files: Option<LocalFiles> = (!verify && matches!(req.target, TransportTarget::InlineTcp))
        .then(|| {
            LocalFiles::open(
                sh.store.clone(),
                keys.clone(),
                req.layers.clone(),
                req.chunk_tokens
                    .iter()
                    .map(|&t| req.geometry.slice_len(t))
                    .collect(),
            )
        });
    let reads = Arc::new(Semaphore::new(sh.cfg.read_concurrency));
    let mut remaining: HashMap<u32, usize> = HashMap::new();
    for u in &plan {
        *remaining.entry(u.layer).or_default() += 1;
    }
    // Header checks stream their results in chunk order; a unit goes out once the headers of
    // every chunk it carries are known (not all of them: the first layer's first slices leave
    // while later headers are still being read).
    let (htx, mut hrx) = tokio::sync::mpsc::unbounded_channel();
    let _headers = AbortOnDrop(tokio::spawn(check_headers(
        sh.clone(),
        req.chunk_tokens.clone(),
        req.geometry,
        keys.clone(),
        files.clone(),
        htx,
    )));
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Fetched>(depth);
    let _reader = AbortOnDrop(tokio::spawn({
        let (sh, keys, reads) = (sh.clone(), keys.clone(), reads.clone());
        async move {
            // The first layer's units are read alone, with every read slot, before any
            // read-ahead starts: layer 0 is pure stall for the client (time to first layer).
            let first = plan.first().map(|u| u.layer);
            let split = plan.iter().take_while(|u| Some(u.layer) == first).count();
            let mut plan = plan;
            let rest = plan.split_off(split);
            let fetch = |u| {
                fetch_unit(
                    sh.clone(),
                    keys.clone(),
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
        }
    }));
    // Per-chunk misses: a bad chunk's Miss goes out before any unit that would carry its
    // slices, which are left out of every unit; the other chunks' slices are still delivered
    // (the client keeps their bytes and names the bad chunk).
    let n_chunks = req.chunks.len();
    let mut bad: std::collections::HashSet<u32> = std::collections::HashSet::new();
    let mut known = 0usize;
    let on_header = |io: &mut Io,
                     bad: &mut std::collections::HashSet<u32>,
                     known: &mut usize,
                     r: Option<Result<(), Miss>>| match r {
        Some(Ok(())) => *known += 1,
        Some(Err(m)) => {
            *known += 1;
            sh.metrics.error("miss");
            bad.insert(m.chunk);
            io.conn
                .send_miss(m.chunk, req.layers.clone(), m.reason, &m.message);
        }
        // The checker ended early (it never does before sending every result).
        None => *known = n_chunks,
    };
    let grace = async {
        sh.shutdown.cancelled().await;
        tokio::time::sleep(Duration::from_secs(sh.cfg.shutdown_grace_secs)).await;
    };
    tokio::pin!(grace);
    let (mut units, mut bytes) = (0u64, 0u64);
    let mut ttfl_seen = false;
    let mut all_sent = false;
    #[cfg(feature = "rdma")]
    let mut rdma_failed: std::collections::HashSet<u32> = std::collections::HashSet::new();
    'send: loop {
        tokio::select! {
            biased;
            _ = &mut grace => {
                sh.metrics.error("shutdown_abort");
                io.conn.close_with(ErrorCode::ShuttingDown, "server shut down before the load finished");
                let _ = io.flush(sh).await;
                return Err(Abort::Shutdown);
            }
            a = io.next_signal() => match a {
                Abort::Cancelled => break,
                a => return Err(a),
            },
            f = rx.recv() => {
                let Some(f) = f else {
                    all_sent = true;
                    break;
                };
                let need = f.plan.pieces.iter().map(|p| p.chunk as usize + 1).max().unwrap_or(0);
                while known < need {
                    tokio::select! {
                        r = hrx.recv() => on_header(io, &mut bad, &mut known, r),
                        a = io.next_signal() => match a { Abort::Cancelled => break 'send, a => return Err(a) },
                        _ = &mut grace => {
                            sh.metrics.error("shutdown_abort");
                            io.conn.close_with(ErrorCode::ShuttingDown, "server shut down before the load finished");
                            let _ = io.flush(sh).await;
                            return Err(Abort::Shutdown);
                        }
                    }
                }
                if known == n_chunks && bad.len() == n_chunks && units == 0 {
                    // Every chunk misses: nothing to send.
                    break;
                }
                if member.is_paced() {
                    // Held on purpose (its bandwidth share, or its stripes' order): a client
                    // that asked for them gets `Held` frames meanwhile.
                    let paced = member.pace(f.plan.layer, f.plan.len);
                    tokio::pin!(paced);
                    let mut held = held_ticker();
                    loop {
                        tokio::select! {
                            _ = &mut paced => break,
                            _ = held.tick(), if req.held => { io.conn.send_held(id); io.flush(sh).await?; }
                            a = io.next_signal() => match a { Abort::Cancelled => break 'send, a => return Err(a) },
                            _ = &mut grace => {
                                sh.metrics.error("shutdown_abort");
                                io.conn.close_with(ErrorCode::ShuttingDown, "server shut down before the load finished");
                                let _ = io.flush(sh).await;
                                return Err(Abort::Shutdown);
                            }
                        }
                    }
                }
                let layer = f.plan.layer;
                // The good pieces (chunk, offset, len, parts, CRC32C), in destination order;
                // `cut` when a bad chunk or slice left one out.
                let mut good: Vec<(u32, u64, u64, Vec<Part>, u32)> = Vec::new();
                let mut cut = false;
                let mut at = f.plan.offset;
                for (p, r) in f.plan.pieces.iter().zip(f.pieces) {
                    let len = p.range.end - p.range.start;
                    let off = at;
                    at += len;
                    if bad.contains(&p.chunk) {
                        cut = true;
                        continue;
                    }
                    match r {
                        Ok((parts, crc)) => good.push((p.chunk, off, len, parts, crc)),
                        Err(m) => {
                            // This (chunk, layer) slice misses; the chunk's other layers and
                            // the other chunks of this layer are still delivered.
                            cut = true;
                            sh.metrics.error("miss");
                            io.conn.send_miss(m.chunk, layer..layer + 1, m.reason, &m.message);
                        }
                    }
                }
                #[cfg(not(feature = "rdma"))]
                let _ = cut;
                // RDMA target: a whole planned unit is one write, which the client counts by its
                // unit index. A unit cut by a bad chunk or slice is written slice by slice, each
                // named by its chunk (in a unit of several pieces each piece is a whole slice):
                // the bad chunk's Miss fails the layer, and the other chunks' slices are in place.
                #[cfg(feature = "rdma")]
                if let Some(d) = rdma.as_mut() {
                    let writes: Vec<(Option<u32>, u64, u64, Vec<Part>)> = if !cut {
                        let parts = good.into_iter().flat_map(|g| g.3).collect();
                        vec![(None, f.plan.offset, f.plan.len, parts)]
                    } else if f.plan.pieces.len() > 1 {
                        good.into_iter().map(|(c, off, len, parts, _)| (Some(c), off, len, parts)).collect()
                    } else {
                        Vec::new()
                    };
                    good = Vec::new();
                    for (chunk, off, len, parts) in writes {
                        if rdma_failed.contains(&layer) {
                            break;
                        }
                        // RDMA loads never get file ranges (`files` is for the TCP stream).
                        let parts = into_mem(parts).map_err(|_| "file range on the RDMA path".to_string());
                        let posted = async {
                            match chunk {
                                None => d.unit(&f.plan, parts?).await,
                                Some(c) => d.slice(layer, c, off, len, parts?).await,
                            }
                        };
                        match posted.await {
                            Ok(()) => {
                                units += 1;
                                bytes += len;
                                sh.metrics.bytes("gather_out", len);
                            }
                            Err(msg) => {
                                sh.metrics.error("rdma");
                                rdma_failed.insert(layer);
                                let c = chunk.or(f.plan.pieces.first().map(|p| p.chunk)).unwrap_or(0);
                                io.conn.send_miss(c, layer..layer + 1, MissReason::Storage, &msg);
                            }
                        }
                    }
                }
                // Runs of consecutive good pieces become units (a bad chunk splits a unit).
                let mut out: Vec<(u64, Vec<Part>, u32, u64)> = Vec::new();
                for (_, off, len, parts, crc) in good {
                    match out.last_mut() {
                        Some((o, ps, c, l)) if *o + *l == off => {
                            *c = crate::layout::crc::crc32c_combine(*c, crc, len);
                            *l += len;
                            ps.extend(parts);
                        }
                        _ => out.push((off, parts, crc, len)),
                    }
                }
                for (offset, parts, crc, len) in out {
                    let h = UnitHeader { layer, crc32c: crc, offset, len: len as u32 };
                    match into_mem(parts) {
                        Ok(mem) => io.conn.send_unit(h, mem),
                        Err(parts) => {
                            // The unit's prefix, then its payload straight from the files.
                            io.conn.send_unit(h, []);
                            io.flush_more(sh).await?;
                            io.send_parts(sh, parts).await?;
                        }
                    }
                    units += 1;
                    bytes += len;
                    sh.metrics.bytes("gather_out", len);
                }
                io.flush(sh).await?;
                member.sent(f.plan.len);
                drop(f._hold);
                if units > 0 && !ttfl_seen {
                    ttfl_seen = true;
                    sh.metrics.observe_ttfl(t0.elapsed().as_secs_f64());
                }
                let r = remaining.get_mut(&layer).expect("planned layer");
                *r -= 1;
                if *r == 0 {
                    sh.metrics.observe_layer(t0.elapsed().as_secs_f64());
                }
            }
        }
    }
    // Every unit is out: the header results not needed yet still name their misses before End.
    while all_sent && known < n_chunks {
        let r = hrx.recv().await;
        on_header(io, &mut bad, &mut known, r);
    }
    #[cfg(feature = "rdma")]
    if let Some(d) = rdma.take() {
        // Every posted write completes (or fails) before End; End counts completed writes.
        let (bad, ok) = d.finish().await;
        for (layer, msg) in bad {
            if rdma_failed.insert(layer) {
                sh.metrics.error("rdma");
                io.conn
                    .send_miss(0, layer..layer + 1, MissReason::Storage, &msg);
            }
        }
        units = ok;
    }
    io.conn.finish(id, units, bytes);
    tracing::debug!(
        request = id,
        units,
        bytes,
        secs = t0.elapsed().as_secs_f64(),
        "gather done"
    );
    io.flush(sh).await
}

/// Serves a batched save, streaming each object to the store as it arrives. No memory is
/// reserved for the sizes the request declares: save-data frames are held under the memory
/// budget while they arrive ([`Io::read_more`]; small frames are copied out of the
/// connection buffer and held the same way), checked as they pass ([`ObjectCheck`]: the
/// header against the request, every slice's CRC32C), and handed to a streamed create-only
/// put ([`crate::store::Store::put_stream`]), which gives each piece's memory back once
/// written. An object that fails its check, or a client that goes away, aborts its put:
/// nothing of it is written. Markers follow once every object is durable. The client must
/// keep sending while the server waits for it ([`RateFloor`]).
async fn run_save(io: &mut Io, req: SaveRequest, sh: &Arc<Shared>) -> Result<(), Abort> {
    sh.metrics.request("save");
    let id = req.request_id;
    let fail = |io: &mut Io, code: ErrorCode, msg: String| {
        sh.metrics.error(code.label());
        tracing::info!(request = id, code = code.label(), "save failed: {msg}");
        io.conn.close_with(code, &msg);
    };
    match sh.buckets.exists(&req.bucket).await {
        Ok(true) => {}
        Ok(false) => {
            fail(
                io,
                ErrorCode::NoSuchBucket,
                format!("bucket {} does not exist", req.bucket),
            );
            let _ = io.flush(sh).await;
            return Err(Abort::Gone);
        }
        Err(e) => {
            fail(io, ErrorCode::Storage, e.to_string());
            let _ = io.flush(sh).await;
            return Err(Abort::Gone);
        }
    }
    let base = format!("{}/{}", req.bucket, req.prefix);
    // Every key the save writes is checked before any byte is taken.
    let key_of =
        |kind: &str, c: &crate::protocol::SaveChunk| format!("{base}{kind}/{}", c.hash.to_hex());
    if let Some(Err(e)) = req
        .chunks
        .iter()
        .map(|c| crate::store::validate_key(&key_of("kv", c)))
        .find(Result::is_err)
    {
        let reason = match e {
            StoreError::InvalidKey { reason, .. } => reason,
            _ => "invalid",
        };
        fail(
            io,
            ErrorCode::Malformed,
            format!(
                "key prefix {:?} makes invalid object keys: {reason}",
                req.prefix
            ),
        );
        let _ = io.flush(sh).await;
        return Err(Abort::Gone);
    }
    let largest = (0..req.chunks.len())
        .map(|i| req.object_len(i))
        .max()
        .unwrap_or(0);
    if largest > sh.cfg.max_request_bytes {
        fail(
            io,
            ErrorCode::MemoryLimit,
            format!(
                "a {largest}-byte object is above max_request_bytes {}",
                sh.cfg.max_request_bytes
            ),
        );
        let _ = io.flush(sh).await;
        return Err(Abort::Gone);
    }
    let wait = Duration::from_secs(sh.cfg.client_timeout_secs);
    let mut floor = super::client_floor(&sh.cfg);
    let (mut cur, mut written, mut present) = (0usize, 0u32, 0u32);
    // The object being received, streamed to the store as it comes.
    let mut put: Option<ObjectPut> = None;
    let mut got = 0u64;
    let mut lens: Vec<u64> = Vec::with_capacity(req.chunks.len());
    loop {
        while let Some(ev) = io.conn.poll_event() {
            match ev {
                ServerEvent::SaveData {
                    chunk,
                    offset,
                    data,
                } => {
                    let hold = io.save_hold(data.len());
                    if cur >= req.chunks.len() || chunk as usize != cur || offset != got {
                        fail(io, ErrorCode::BadObject, format!(
                            "save data for chunk {chunk} at offset {offset}; expected chunk {cur} at offset {got}"));
                        let _ = io.flush(sh).await;
                        return Err(Abort::Gone);
                    }
                    let want = req.object_len(cur);
                    if got + data.len() as u64 > want {
                        fail(
                            io,
                            ErrorCode::BadObject,
                            format!("chunk {cur}'s object is longer than {want} bytes"),
                        );
                        let _ = io.flush(sh).await;
                        return Err(Abort::Gone);
                    }
                    let data = match hold {
                        Some(h) => h.attach(data),
                        // A small frame: copied out of the connection buffer, held likewise.
                        None => {
                            match sh.budget.acquire_within(data.len() as u64, wait).await {
                                Some(h) => h.attach(Bytes::copy_from_slice(&data)),
                                None => {
                                    sh.metrics.error("memory_budget");
                                    fail(io, ErrorCode::Busy, "the server's memory budget is in use by other requests; retry".into());
                                    let _ = io.flush(sh).await;
                                    return Err(Abort::Gone);
                                }
                            }
                        }
                    };
                    got += data.len() as u64;
                    sh.metrics.bytes("save_in", data.len() as u64);
                    let p = put.get_or_insert_with(|| {
                        ObjectPut::start(sh.store.clone(), key_of("kv", &req.chunks[cur]), want)
                    });
                    if let Err(m) = p.check.feed(&req, cur, &data) {
                        // Dropping the put aborts it: nothing of the object is written.
                        drop(put.take());
                        fail(io, ErrorCode::BadObject, m);
                        let _ = io.flush(sh).await;
                        return Err(Abort::Gone);
                    }
                    if p.tx.send(Ok(data)).await.is_err() {
                        // The put ended early: the store failed.
                        let r = put.take().expect("started").finish().await;
                        let msg = match r {
                            Err(e) => e,
                            Ok(_) => "the store ended the write early".into(),
                        };
                        fail(io, ErrorCode::Storage, msg);
                        let _ = io.flush(sh).await;
                        return Err(Abort::Gone);
                    }
                    if got == want {
                        let p = put.take().expect("started");
                        got = 0;
                        match p.finish().await {
                            Ok(true) => written += 1,
                            Ok(false) => present += 1,
                            Err(m) => {
                                fail(io, ErrorCode::Storage, m);
                                let _ = io.flush(sh).await;
                                return Err(Abort::Gone);
                            }
                        }
                        lens.push(want);
                        cur += 1;
                    }
                }
                ServerEvent::SaveEnd => {
                    if cur != req.chunks.len() || got != 0 {
                        fail(
                            io,
                            ErrorCode::BadObject,
                            format!("save ended after {cur} of {} objects", req.chunks.len()),
                        );
                        let _ = io.flush(sh).await;
                        return Err(Abort::Gone);
                    }
                    // Every data object is durable: publish, in prefix order.
                    for (c, &len) in req.chunks.iter().zip(&lens) {
                        let marker = key_of("pub", c);
                        if let Err(e) = sh.store.put(&marker, marker_body(len)).await {
                            fail(io, ErrorCode::Storage, format!("{marker}: {e}"));
                            let _ = io.flush(sh).await;
                            return Err(Abort::Gone);
                        }
                    }
                    io.conn.save_done(id, written, present);
                    return io.flush(sh).await;
                }
                ServerEvent::Cancel { .. } => {
                    io.conn.close_with(
                        ErrorCode::Internal,
                        "save cancelled by the client; nothing published",
                    );
                    let _ = io.flush(sh).await;
                    return Err(Abort::Cancelled);
                }
                ServerEvent::Failed(_) => return Err(Abort::Gone),
                _ => {}
            }
        }
        io.flush(sh).await?;
        if io.conn.is_closed() {
            return Err(Abort::Gone);
        }
        tokio::select! {
            r = io.read_more(sh, ReadWait::Floor(&mut floor)) => r?,
            _ = sh.shutdown.cancelled() => {
                io.conn.close_with(ErrorCode::ShuttingDown, "server is shutting down; nothing published");
                let _ = io.flush(sh).await;
                return Err(Abort::Shutdown);
            }
        }
    }
}

/// One saved object on its way to the store: a create-only streamed put running in its own
/// task, fed the object's pieces as they arrive and checked. Dropping it aborts the put
/// (nothing of the object is written).
struct ObjectPut {
    tx: tokio::sync::mpsc::Sender<Result<Bytes, StoreError>>,
    task: AbortOnDrop<Result<crate::store::PutResult, StoreError>>,
    check: ObjectCheck,
    key: String,
}

impl ObjectPut {
    /// Pieces waiting between the connection and the store, at most.
    const QUEUE: usize = 4;

    fn start(store: Arc<dyn crate::store::Store>, key: String, len: u64) -> Self {
        let (tx, rx) = tokio::sync::mpsc::channel(Self::QUEUE);
        let body =
            stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|p| (p, rx)) }).boxed();
        let k = key.clone();
        let task = AbortOnDrop(tokio::spawn(async move {
            let create = crate::store::PutOptions {
                mode: crate::store::PutMode::Create,
            };
            store.put_stream(&k, body, Some(len), create).await
        }));
        ObjectPut {
            tx,
            task,
            check: ObjectCheck::default(),
            key,
        }
    }

    /// Ends the body and waits for the put: `true` written, `false` already present.
    async fn finish(mut self) -> Result<bool, String> {
        drop(std::mem::replace(
            &mut self.tx,
            tokio::sync::mpsc::channel(1).0,
        ));
        match (&mut self.task.0).await {
            Ok(Ok(_)) => Ok(true),
            Ok(Err(StoreError::AlreadyExists { .. })) => Ok(false),
            Ok(Err(e)) => Err(format!("{}: {e}", self.key)),
            Err(e) => Err(format!("{}: write task failed: {e}", self.key)),
        }
    }
}

/// Checks a saved object as its bytes pass: the header against the request once its
/// [`HEADER_LEN`] bytes are in, then each slice's CRC32C against its trailer.
#[derive(Default)]
struct ObjectCheck {
    /// Bytes seen.
    pos: u64,
    head: Vec<u8>,
    slice_len: Option<u64>,
    crc: u32,
    trailer: Vec<u8>,
}

impl ObjectCheck {
    /// Feeds the next bytes of chunk `i`'s object.
    ///
    /// # Errors
    /// A message naming the chunk and what is wrong.
    fn feed(&mut self, req: &SaveRequest, i: usize, mut d: &[u8]) -> Result<(), String> {
        while !d.is_empty() {
            let Some(sl) = self.slice_len else {
                let take = ((HEADER_LEN - self.pos) as usize).min(d.len());
                self.head.extend_from_slice(&d[..take]);
                self.pos += take as u64;
                d = &d[take..];
                if self.pos == HEADER_LEN {
                    let h =
                        ChunkHeader::decode(&self.head).map_err(|e| format!("chunk {i}: {e}"))?;
                    req.geometry
                        .check_header(&h, req.chunks[i].tokens)
                        .map_err(|m| format!("chunk {i}: {m}"))?;
                    self.slice_len = Some(h.slice_len);
                }
                continue;
            };
            let per = sl + crate::layout::SLICE_CRC_LEN;
            let at = (self.pos - HEADER_LEN) % per;
            let layer = (self.pos - HEADER_LEN) / per;
            let take = if at < sl {
                let n = ((sl - at) as usize).min(d.len());
                self.crc = crate::layout::crc::crc32c_append(self.crc, &d[..n]);
                n
            } else {
                let n = ((per - at) as usize).min(d.len());
                self.trailer.extend_from_slice(&d[..n]);
                if self.trailer.len() == crate::layout::SLICE_CRC_LEN as usize {
                    let stored = u32::from_le_bytes(self.trailer[..].try_into().expect("4 bytes"));
                    if stored != self.crc {
                        return Err(format!(
                            "chunk {i}: layer {layer} slice checksum mismatch: stored {stored:#010x}, computed {:#010x}",
                            self.crc
                        ));
                    }
                    self.crc = 0;
                    self.trailer.clear();
                }
                n
            };
            self.pos += take as u64;
            d = &d[take..];
        }
        Ok(())
    }
}

/// A publish marker's body (the layout module's encoding, shared with the connector).
fn marker_body(object_len: u64) -> Bytes {
    Bytes::copy_from_slice(&crate::layout::encode_marker(object_len))
}
