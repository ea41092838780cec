//! Batched saves: each object streamed to the store as it arrives, checked as it passes,
//! markers written once every object is durable.

use super::fetch::AbortOnDrop;
use super::io::{Io, ReadWait};
use crate::{Abort, ServerState};

use bytes::Bytes;
use futures::{stream, StreamExt};
use objectcache_client::error::{StoreError, StoreResult};
use objectcache_client::layout::{ChunkHeader, HEADER_LEN};
use objectcache_client::protocol::{ErrorCode, SaveRequest, ServerEvent};
use objectcache_client::store::StoreExt;
use std::sync::Arc;
use std::time::Duration;

/// Serves a batched save, streaming each object to the store as it arrives. No memory is
/// reserved for the sizes the request declares: save-data frames are held under the memory
/// budget while they arrive ([`Io::read_more`]; small frames are copied out of the
/// connection buffer and held the same way), checked as they pass ([`ObjectCheck`]: the
/// header against the request, every slice's CRC32C), and handed to a streamed create-only
/// put ([`objectcache_client::store::Store::put_stream`]), which gives each piece's memory back once
/// written. An object that fails its check, or a client that goes away, aborts its put:
/// nothing of it is written. Markers follow once every object is durable. The client must
/// keep sending while the server waits for it ([`RateFloor`]).
pub(super) async fn run_save(
    io: &mut Io,
    req: SaveRequest,
    sh: &Arc<ServerState>,
) -> Result<(), Abort> {
    sh.metrics.request("save");
    let id = req.request_id;
    let fail = |io: &mut Io, code: ErrorCode, msg: String| {
        sh.metrics.error(code.label());
        tracing::info!(request = id, code = code.label(), "save failed: {msg}");
        io.conn.close_with(code, &msg);
    };
    if let Err((code, msg)) = super::objects::bucket_exists(sh, &req.bucket).await {
        fail(io, code, msg);
        let _ = io.flush(sh).await;
        return Err(Abort::Gone);
    }
    let base = format!("{}/{}", req.bucket, req.prefix);
    // Every key the save writes is checked before any byte is taken.
    let key_of = |kind: &str, c: &objectcache_client::protocol::SaveChunk| {
        format!("{base}{kind}/{}", c.hash.to_hex())
    };
    if let Some(Err(e)) = req
        .chunks
        .iter()
        .map(|c| objectcache_client::store::validate_key(&key_of("kv", c)))
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
    let mut floor = super::super::client_floor(&sh.cfg);
    let (mut cur, mut written, mut present) = (0usize, 0u32, 0u32);
    // The object being received, streamed to the store as it comes.
    let mut put: Option<ObjectPut> = None;
    let mut got = 0u64;
    let mut lens: Vec<u64> = Vec::with_capacity(req.chunks.len());
    loop {
        while let Some(ev) = io.conn.poll_event() {
            match ev {
                ServerEvent::SaveData(objectcache_client::protocol::SaveData {
                    chunk,
                    offset,
                    data,
                }) => {
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
    tx: tokio::sync::mpsc::Sender<StoreResult<Bytes>>,
    task: AbortOnDrop<StoreResult<objectcache_client::store::PutResult>>,
    check: ObjectCheck,
    key: String,
}

impl ObjectPut {
    /// Pieces waiting between the connection and the store, at most.
    const QUEUE: usize = 4;

    fn start(store: Arc<dyn objectcache_client::store::Store>, key: String, len: u64) -> Self {
        let (tx, rx) = tokio::sync::mpsc::channel(Self::QUEUE);
        let body =
            stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|p| (p, rx)) }).boxed();
        let k = key.clone();
        let task = AbortOnDrop(tokio::spawn(async move {
            let create = objectcache_client::store::PutOptions {
                mode: objectcache_client::store::PutMode::Create,
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
            let per = sl + objectcache_client::layout::SLICE_CRC_LEN;
            let at = (self.pos - HEADER_LEN) % per;
            let layer = (self.pos - HEADER_LEN) / per;
            let take = if at < sl {
                let n = ((sl - at) as usize).min(d.len());
                self.crc = objectcache_client::layout::crc::crc32c_append(self.crc, &d[..n]);
                n
            } else {
                let n = ((per - at) as usize).min(d.len());
                self.trailer.extend_from_slice(&d[..n]);
                if self.trailer.len() == objectcache_client::layout::SLICE_CRC_LEN as usize {
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
    Bytes::copy_from_slice(&objectcache_client::layout::encode_marker(object_len))
}
