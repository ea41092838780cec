//! Gather over TCP, client side: a thin tokio driver over [`ClientConnection`].
//!
//! ```text
//! let mut c = GatherClient::connect("127.0.0.1:9000").await?;   // hello: capability check
//! let report = c.load(&request, &sink).await?;                    // one request per load
//! c.save(&save_request, &objects).await?;                         // one request per save
//! ```
//! [`GatherClient::connect`] fails with [`GatherError::NotOffered`] when the endpoint does
//! not speak gather (a stock S3 server answers the preface with HTTP), which is the
//! connector's signal to use ranged GETs instead. A connection carries one request at a time
//! and can be reused for the next.

use super::LayerSink;
use crate::error::LayerError;
use crate::protocol::{
    ClientConnection, ClientEvent, ErrorCode, GatherRequest, LoadTracker, MissReason,
    ProtocolError, SaveRequest, ServerInfo, UnitHeader, FRAME_HEADER_LEN, MAX_UNIT_BYTES,
};
use bytes::{Buf, Bytes, BytesMut};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpStream, ToSocketAddrs};

/// Why a gather call failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GatherError {
    /// The endpoint does not offer gather (fall back to ranged GETs).
    #[error("the server does not offer gather: {0}")]
    NotOffered(String),
    /// Socket error, or the connection closed mid-request.
    #[error("gather connection: {0}")]
    Io(#[from] std::io::Error),
    /// The request was refused locally, or the server broke the protocol.
    #[error("gather protocol: {0}")]
    Protocol(#[from] ProtocolError),
    /// The server refused or failed the request.
    #[error("gather server error {code:?}: {message}")]
    Remote {
        /// Code.
        code: ErrorCode,
        /// Server's message.
        message: String,
    },
    /// The sink was cancelled; the server was told to stop.
    #[error("load cancelled")]
    Cancelled,
    /// The server requires authentication and refused (or was not given) credentials.
    #[error("gather authentication: {0}")]
    Unauthorized(String),
}

impl From<GatherError> for crate::Error {
    fn from(e: GatherError) -> Self {
        match e {
            GatherError::Io(e) => crate::Error::Io(e),
            GatherError::Cancelled => crate::Error::Layer(LayerError::Cancelled),
            other => crate::Error::Store(crate::StoreError::other("gather", other)),
        }
    }
}

/// What a load delivered.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadReport {
    /// Units received and written.
    pub units: u64,
    /// Payload bytes written into the sink.
    pub bytes: u64,
    /// Layers reported failed to the sink (miss, corrupt unit, incomplete), ascending.
    pub failed_layers: Vec<u32>,
    /// Chunks the server reported as misses (missing object, wrong geometry, corrupt or
    /// unreadable slice) with the server's reason, ascending by chunk. The other chunks' slices were still delivered: every
    /// layer that contains a missed chunk is failed, but its other bytes reached the sink.
    pub missed_chunks: Vec<(u32, MissReason)>,
    /// From sending the request to the first unit written, if any.
    pub ttfl: Option<Duration>,
    /// From sending the request to the end.
    pub elapsed: Duration,
}

/// What a batched save did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SaveReport {
    /// Data objects this save wrote.
    pub written: u32,
    /// Data objects already present (first writer wins).
    pub already_present: u32,
}

/// Bytes of a unit payload read per socket read and checksummed right after, while they
/// are still in the CPU cache (256 KiB: well inside a core's L2).
const PIECE_BYTES: usize = 1 << 20;

/// What became of one unit received by [`GatherClient::recv_unit`].
enum UnitFate {
    /// Written into the sink and verified.
    Delivered,
    /// Written, but its CRC32C did not match: the layer is a miss.
    Corrupt {
        /// CRC in the frame.
        expected: u32,
        /// CRC of the bytes received.
        computed: u32,
    },
    /// The sink refused the bytes (they were read off the stream and dropped).
    Refused(LayerError),
}

/// A gather connection to an ObjectCache server.
#[derive(Debug)]
pub struct GatherClient {
    stream: TcpStream,
    /// The protocol state; the RDMA driver (`transport/rdma/gather.rs`) runs its loads on it.
    pub(super) conn: ClientConnection,
    /// Bytes read and not yet handled by `conn`.
    pub(super) buf: BytesMut,
    info: ServerInfo,
    /// While a load runs, read only small control reads into `buf`: unit payloads are read
    /// by [`GatherClient::recv_unit`] straight into their destination.
    direct: bool,
    /// Bounce buffer for sinks that cannot lend their memory, and for dropped payloads.
    scratch: Vec<u8>,
}

impl GatherClient {
    /// Connects and exchanges hellos.
    ///
    /// # Errors
    /// [`GatherError::Io`] if the connection fails, is closed before the hello or no hello
    /// comes within 10 s (transient faults); [`GatherError::NotOffered`] if the server
    /// answers with anything but a gather hello (e.g. HTTP from a stock S3 server).
    pub async fn connect(addr: impl ToSocketAddrs) -> Result<Self, GatherError> {
        Self::connect_with(addr, None).await
    }

    /// Connects, exchanges hellos and, when the server asks for it, authenticates with
    /// `credentials = (access_key_id, secret_key)`: one of the server's S3 access keys (an
    /// HMAC-SHA256 answer to the server's nonce, see [`crate::protocol::auth`]).
    ///
    /// # Errors
    /// As [`GatherClient::connect`], plus [`GatherError::Unauthorized`] when the server
    /// requires authentication and the credentials are missing or refused.
    pub async fn connect_with(
        addr: impl ToSocketAddrs,
        credentials: Option<(String, String)>,
    ) -> Result<Self, GatherError> {
        let stream = TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        let mut c = GatherClient {
            stream,
            conn: ClientConnection::with_credentials(credentials),
            buf: BytesMut::with_capacity(1 << 20),
            direct: false,
            scratch: Vec::new(),
            info: ServerInfo {
                version: 0,
                features: 0,
                max_descriptor_bytes: 0,
                max_chunks: 0,
                max_request_bytes: 0,
            },
        };
        c.flush().await?;
        let hello = tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                if let Some(ev) = c.conn.poll_event() {
                    return match ev {
                        ClientEvent::Connected(i) => Ok(i),
                        ClientEvent::Error {
                            code: ErrorCode::Unauthorized,
                            message,
                        } => Err(GatherError::Unauthorized(message)),
                        ClientEvent::Error { code, message } => {
                            Err(GatherError::NotOffered(format!("{code:?}: {message}")))
                        }
                        other => Err(GatherError::NotOffered(format!("unexpected {other:?}"))),
                    };
                }
                if c.read_more().await? == 0 {
                    // Closed without a word: a transient fault (a server restarting, a
                    // dropped connection), not proof that gather is not offered.
                    return Err(GatherError::Io(std::io::Error::new(
                        std::io::ErrorKind::UnexpectedEof,
                        "the server closed the connection after the preface",
                    )));
                }
                if let Err(e) = c.conn.handle_bytes(&mut c.buf) {
                    return Err(GatherError::NotOffered(format!(
                        "the server did not answer with a gather hello ({e})"
                    )));
                }
                // The answer to an authentication challenge, if one came.
                c.flush().await?;
            }
        })
        .await
        .map_err(|_| {
            // Silence is transient too (a stalled server or network), not a stock S3 server.
            GatherError::Io(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "no gather hello within 10 s",
            ))
        })??;
        c.info = hello;
        Ok(c)
    }

    /// Whether this idle connection is no longer usable: the server closed or reset it (it
    /// restarted, or dropped an idle connection), or sent bytes nobody asked for. Checked
    /// without waiting, so a pooled connection can be skipped before a load is put on it.
    pub fn is_stale(&self) -> bool {
        let mut b = [0u8; 1];
        !matches!(
            self.stream.try_read(&mut b),
            Err(ref e) if e.kind() == std::io::ErrorKind::WouldBlock
        )
    }

    /// The server's hello: version, features and limits.
    pub fn server_info(&self) -> ServerInfo {
        self.info
    }

    /// Sends everything the protocol has queued.
    pub(super) async fn flush(&mut self) -> std::io::Result<()> {
        while let Some(b) = self.conn.poll_transmit() {
            self.stream.write_all(&b).await?;
        }
        Ok(())
    }

    /// Reads more of the stream into `buf`; `Ok(0)` when the server closed it.
    pub(super) async fn read_more(&mut self) -> std::io::Result<usize> {
        if self.direct {
            // Frame headers and small control frames only: a unit's payload is read by
            // `recv_unit` into its destination, so at most this much of it is copied twice.
            self.buf.reserve(4096);
            return (&mut self.stream).take(4096).read_buf(&mut self.buf).await;
        }
        // Room for the whole frame being received (a unit is up to 16 MiB): one allocation
        // per frame at most, reused once the previous frame's bytes are dropped, instead of
        // growing (and copying) the buffer step by step.
        let mut want = 1 << 20;
        if self.buf.len() >= FRAME_HEADER_LEN {
            let body = u32::from_le_bytes(self.buf[4..8].try_into().expect("4 bytes")) as usize;
            want = want.max(FRAME_HEADER_LEN + body.min(MAX_UNIT_BYTES as usize + 64));
        }
        if self.buf.capacity() < want || self.buf.capacity() - self.buf.len() < (64 << 10) {
            self.buf
                .reserve(want.saturating_sub(self.buf.len()).max(64 << 10));
        }
        self.stream.read_buf(&mut self.buf).await
    }

    /// Receives the payload of the direct unit `h` announced by the protocol: first what is
    /// left in `buf`, then from the socket in [`PIECE_BYTES`] reads, each checksummed at once.
    /// The bytes go straight into the sink's memory when it lends it
    /// ([`LayerSink::dest_parts`]: one slice per destination range the unit spans, e.g. per
    /// engine block of paged KV; one copy, the kernel's), otherwise through a bounce buffer
    /// and [`LayerSink::write`]; with `discard` (a cancelled load) they are dropped.
    async fn recv_unit(
        &mut self,
        h: UnitHeader,
        sink: &dyn LayerSink,
        discard: bool,
    ) -> Result<UnitFate, GatherError> {
        let len = h.len as usize;
        let (layer, offset) = (h.layer, h.offset);
        let mut refused: Option<LayerError> = discard.then_some(LayerError::Cancelled);
        let mut dest = match refused {
            Some(_) => None,
            None => match sink.dest_parts(layer, offset, len as u64) {
                Ok(d) => d,
                Err(e) => {
                    refused = Some(e);
                    None
                }
            },
        };
        let lent = dest.is_some();
        if !lent && self.scratch.len() < PIECE_BYTES.min(len) {
            self.scratch.resize(PIECE_BYTES.min(len), 0);
        }
        let mut crc = 0u32;
        let mut pos = 0usize;
        // Where `pos` is in the lent parts: part index and offset in it.
        let (mut part, mut in_part) = (0usize, 0usize);
        while pos < len {
            let piece: &mut [u8] = match dest.as_deref_mut() {
                Some(parts) => {
                    while parts.get(part).is_some_and(|p| in_part == p.len()) {
                        part += 1;
                        in_part = 0;
                    }
                    let Some(p) = parts.get_mut(part) else {
                        return Err(GatherError::Protocol(ProtocolError::invalid(
                            "unit",
                            format!("the sink lent fewer than the unit's {len} bytes"),
                        )));
                    };
                    let want = (p.len() - in_part).min(len - pos).min(PIECE_BYTES);
                    &mut p[in_part..in_part + want]
                }
                None => {
                    let want = (len - pos).min(PIECE_BYTES);
                    &mut self.scratch[..want]
                }
            };
            let from_buf = piece.len().min(self.buf.len());
            let n = if from_buf > 0 {
                piece[..from_buf].copy_from_slice(&self.buf[..from_buf]);
                self.buf.advance(from_buf);
                from_buf
            } else {
                match self.stream.read(piece).await? {
                    0 => {
                        return Err(GatherError::Io(std::io::Error::new(
                            std::io::ErrorKind::UnexpectedEof,
                            "the server closed the connection mid-unit",
                        )))
                    }
                    n => {
                        sink.progress(n as u64);
                        n
                    }
                }
            };
            crc = crate::layout::crc::crc32c_append(crc, &piece[..n]);
            if !lent && refused.is_none() {
                if let Err(e) = sink.write(layer, offset + pos as u64, &piece[..n]) {
                    refused = Some(e);
                }
            }
            pos += n;
            in_part += n;
        }
        if lent {
            sink.dest_filled(layer, len as u64);
        }
        let good = self.conn.unit_end(crc)?;
        Ok(match refused {
            Some(e) => UnitFate::Refused(e),
            None if good => UnitFate::Delivered,
            None => UnitFate::Corrupt {
                expected: h.crc32c,
                computed: crc,
            },
        })
    }

    /// Loads one prefix: sends `req` (one request) and writes every unit into `sink` as it
    /// arrives, marking bytes complete per layer. Layers that miss (object missing, geometry
    /// mismatch, corrupt slice) are reported with [`LayerSink::fail`] and never completed;
    /// when the connection breaks or the server stops the request, the layers not finished
    /// are reported with [`LayerSink::broken`]. If `sink` is cancelled, the server is told to
    /// stop and the call returns [`GatherError::Cancelled`] once it has (the connection stays
    /// usable).
    ///
    /// # Errors
    /// [`GatherError::Remote`] if the server refused the request (too many chunks, busy, ...);
    /// [`GatherError::Io`] if the connection broke (incomplete layers reported first);
    /// [`GatherError::Protocol`] for an invalid request or a server protocol violation.
    pub async fn load(
        &mut self,
        req: &GatherRequest,
        sink: &dyn LayerSink,
    ) -> Result<LoadReport, GatherError> {
        self.conn.start_gather(req)?;
        self.conn.set_direct_units(true);
        self.direct = true;
        let r = self.load_inner(req, sink).await;
        self.direct = false;
        self.conn.set_direct_units(false);
        r
    }

    async fn load_inner(
        &mut self,
        req: &GatherRequest,
        sink: &dyn LayerSink,
    ) -> Result<LoadReport, GatherError> {
        let t0 = Instant::now();
        // Which layers are misses, and why, is the tracker's (sans-IO) decision; this loop
        // reads the stream, writes the sink and reports those decisions to it.
        let mut track = LoadTracker::new(req);
        let mut ttfl: Option<Duration> = None;
        let mut cancelled = false;
        let mut begun: Option<u32> = None;
        let fail = |layer: u32, err: Option<LayerError>| {
            if let Some(e) = err {
                sink.fail(layer, e);
            }
        };
        let result = loop {
            if let Err(e) = self.flush().await {
                break Err(GatherError::Io(e));
            }
            let mut done = None;
            while let Some(ev) = self.conn.poll_event() {
                match ev {
                    ClientEvent::Accepted(_) => {}
                    ClientEvent::UnitBegin(h) => {
                        let layer = h.layer;
                        if begun != Some(layer) {
                            begun = Some(layer);
                            if let Some(turn) = sink.begin_layer(layer) {
                                turn.await;
                            }
                        }
                        let fate = match self.recv_unit(h, sink, cancelled).await {
                            Ok(f) => f,
                            Err(e) => {
                                done = Some(Err(e));
                                break;
                            }
                        };
                        match fate {
                            UnitFate::Delivered => {
                                // The CRC first: the unit may make its layer ready.
                                sink.verified(layer, h.offset, h.len as u64, h.crc32c);
                                sink.complete(layer, h.len as u64);
                                track.delivered(layer, h.len as u64);
                                ttfl.get_or_insert_with(|| t0.elapsed());
                            }
                            UnitFate::Corrupt { expected, computed } => {
                                fail(layer, track.corrupt(layer, h.offset, expected, computed));
                            }
                            UnitFate::Refused(e) => fail(layer, track.refused(layer, e)),
                        }
                        // Frames after the unit may already be buffered: decode them now,
                        // not after the next socket read (which may never come).
                        if let Err(e) = self.conn.handle_bytes(&mut self.buf) {
                            done = Some(Err(GatherError::Protocol(e)));
                            break;
                        }
                    }
                    ClientEvent::Unit {
                        layer,
                        offset,
                        data,
                    } => {
                        if cancelled {
                            continue;
                        }
                        // Units of a layer that already has a miss are still offered to the
                        // sink: the other chunks' bytes are good (a sink that refuses writes
                        // to failed layers just drops them).
                        match sink.write(layer, offset, &data) {
                            Ok(()) => {
                                sink.complete(layer, data.len() as u64);
                                track.delivered(layer, data.len() as u64);
                                ttfl.get_or_insert_with(|| t0.elapsed());
                            }
                            Err(e) => fail(layer, track.refused(layer, e)),
                        }
                    }
                    ClientEvent::Corrupt {
                        layer,
                        offset,
                        expected,
                        computed,
                    } => fail(layer, track.corrupt(layer, offset, expected, computed)),
                    ClientEvent::Miss(m) => {
                        let key = req.chunks.key(m.chunk as usize).unwrap_or_default();
                        for (l, e) in track.miss(&m, &key) {
                            sink.fail(l, e);
                        }
                    }
                    // Held on purpose by the server (admission, bandwidth pacing): alive.
                    ClientEvent::Held { .. } => sink.progress(0),
                    ClientEvent::End(_) => {
                        done = Some(Ok(()));
                        break;
                    }
                    ClientEvent::Error { code, message } => {
                        done = Some(Err(GatherError::Remote { code, message }));
                        break;
                    }
                    other => {
                        done = Some(Err(GatherError::Protocol(ProtocolError::invalid(
                            "event",
                            format!("{other:?} during a load"),
                        ))));
                        break;
                    }
                }
            }
            if let Some(d) = done {
                break d;
            }
            if !cancelled && sink.is_cancelled() {
                cancelled = true;
                self.conn.cancel(req.request_id);
                continue;
            }
            match self.read_more().await {
                Ok(0) => {
                    break Err(GatherError::Io(std::io::Error::new(
                        std::io::ErrorKind::UnexpectedEof,
                        "the server closed the connection mid-load",
                    )))
                }
                Ok(n) => {
                    sink.progress(n as u64);
                    if let Err(e) = self.conn.handle_bytes(&mut self.buf) {
                        break Err(GatherError::Protocol(e));
                    }
                }
                Err(e) => break Err(GatherError::Io(e)),
            }
        };
        let elapsed = t0.elapsed();
        match result {
            Ok(()) if cancelled => {
                for l in track.unfinished() {
                    sink.fail(l, LayerError::Cancelled);
                }
                Err(GatherError::Cancelled)
            }
            Ok(()) => {
                for l in track.unfinished() {
                    sink.fail(
                        l,
                        LayerError::Storage {
                            chunk: 0,
                            message: "the server ended the load with this layer incomplete".into(),
                        },
                    );
                }
                let o = track.outcome();
                Ok(LoadReport {
                    units: o.units,
                    bytes: o.bytes,
                    failed_layers: o.failed_layers,
                    missed_chunks: o.missed_chunks,
                    ttfl,
                    elapsed,
                })
            }
            Err(e) => {
                // `broken`: the server or the connection stopped the load (the sink may fetch
                // the rest elsewhere) rather than a layer being a miss.
                let cancelled = cancelled || matches!(e, GatherError::Cancelled);
                for l in track.unfinished() {
                    if cancelled {
                        sink.fail(l, LayerError::Cancelled);
                    } else {
                        sink.broken(
                            l,
                            LayerError::Storage {
                                chunk: 0,
                                message: e.to_string(),
                            },
                        );
                    }
                }
                Err(e)
            }
        }
    }

    /// Saves all chunk objects of a prefix in one request: `objects` yields chunk
    /// `req.chunks[i]`'s encoded object ([`crate::layout::encode_chunk`]) in order, and is
    /// consumed as it is sent (one object in memory at a time if the iterator makes them
    /// lazily). The server checks each object, writes it at `{prefix}kv/{hash}` if absent,
    /// and only after all are durable writes the publish markers at `{prefix}pub/{hash}` in
    /// prefix order.
    ///
    /// # Errors
    /// [`GatherError::Protocol`] if an object has the wrong size or their count differs from
    /// `req.chunks` (the connection is then shut down so nothing is published);
    /// [`GatherError::Remote`] if the server refused an object or failed to store it (nothing
    /// is published then); [`GatherError::Io`]. After an error the connection is closed.
    pub async fn save(
        &mut self,
        req: &SaveRequest,
        objects: impl IntoIterator<Item = Bytes>,
    ) -> Result<SaveReport, GatherError> {
        self.conn.start_save(req)?;
        let step = MAX_UNIT_BYTES as usize;
        let mut sent = self.flush().await;
        let mut count = 0usize;
        let mut bad: Option<ProtocolError> = None;
        'outer: for (i, o) in objects.into_iter().enumerate() {
            count = i + 1;
            if i >= req.chunks.len() || o.len() as u64 != req.object_len(i) {
                bad = Some(ProtocolError::invalid(
                    "objects",
                    if i >= req.chunks.len() {
                        format!(
                            "more objects than the {} chunks of the request",
                            req.chunks.len()
                        )
                    } else {
                        format!(
                            "object {i} has {} bytes, expected {}",
                            o.len(),
                            req.object_len(i)
                        )
                    },
                ));
                break;
            }
            let mut a = 0;
            while a < o.len() {
                let b = (a + step).min(o.len());
                self.conn.save_data(i as u32, a as u64, o.slice(a..b))?;
                sent = self.flush().await;
                if sent.is_err() {
                    break 'outer;
                }
                a = b;
            }
        }
        if bad.is_none() && sent.is_ok() && count != req.chunks.len() {
            bad = Some(ProtocolError::invalid(
                "objects",
                format!("{count} objects for {} chunks", req.chunks.len()),
            ));
        }
        if let Some(e) = bad {
            // Abandon the save: the server publishes nothing for an unfinished save.
            let _ = self.stream.shutdown().await;
            return Err(e.into());
        }
        if sent.is_ok() {
            self.conn.save_end()?;
            sent = self.flush().await;
        }
        // Read the answer even after a write error: the server may have said why it stopped.
        loop {
            while let Some(ev) = self.conn.poll_event() {
                match ev {
                    ClientEvent::SaveDone(d) => {
                        return Ok(SaveReport {
                            written: d.written,
                            already_present: d.already_present,
                        })
                    }
                    ClientEvent::Error { code, message } => {
                        return Err(GatherError::Remote { code, message })
                    }
                    _ => {}
                }
            }
            match self.read_more().await {
                Ok(0) => {
                    return Err(match sent {
                        Err(e) => GatherError::Io(e),
                        Ok(()) => GatherError::Io(std::io::Error::new(
                            std::io::ErrorKind::UnexpectedEof,
                            "the server closed the connection mid-save",
                        )),
                    })
                }
                Ok(_) => self.conn.handle_bytes(&mut self.buf)?,
                Err(e) => return Err(GatherError::Io(e)),
            }
        }
    }
}
