//! [`RangeBody`]: a ranged read whose bytes the caller reads into buffers of its own
//! ([`Store::get_range_body`](super::Store::get_range_body)), so that a load puts a body's
//! bytes straight into the engine's KV destination instead of copying them out of the HTTP
//! client's buffers. The backend supplies the bytes ([`RangeRead`]); this type holds what
//! every backend must guarantee: an idle timeout per read, and exactly the range's length
//! (a body that ends early is an error, never a short success).

use super::{ByteStream, GetResult, ObjectMeta};
use crate::error::{StoreError, StoreResult};
use async_trait::async_trait;
use bytes::{Buf, Bytes};
use futures::StreamExt;
use std::ops::Range;
use std::time::Duration;

/// The bytes of one ranged read, for [`RangeBody`]: a backend's connection with the response
/// head already read.
#[async_trait]
pub trait RangeRead: Send {
    /// Reads the body's next bytes into `buf` and returns how many: 1 to `buf.len()`, or 0 at
    /// the end of the body. Never reads past the body (a connection kept for the next request
    /// holds none of its bytes).
    ///
    /// # Errors
    /// The connection's I/O error.
    async fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize>;
}

/// A ranged read in progress: the object's metadata, the range, and a body that
/// [`RangeBody::read`] reads into the caller's memory.
pub struct RangeBody {
    /// The object's metadata: `size` is the whole object's size; `last_modified` may be
    /// `None` where the backend does not parse it on this path.
    pub meta: ObjectMeta,
    /// The byte range this body holds (`start..end`, end exclusive).
    pub range: Range<u64>,
    reader: Box<dyn RangeRead>,
    backend: &'static str,
    idle: Duration,
    got: u64,
}

impl std::fmt::Debug for RangeBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RangeBody")
            .field("meta", &self.meta)
            .field("range", &self.range)
            .field("got", &self.got)
            .finish_non_exhaustive()
    }
}

impl RangeBody {
    /// A body of `range` of the object `meta` describes, read from `reader`; each read must
    /// bring a byte within `idle`. `backend` names the store in errors.
    pub fn new(
        meta: ObjectMeta,
        range: Range<u64>,
        reader: Box<dyn RangeRead>,
        backend: &'static str,
        idle: Duration,
    ) -> Self {
        RangeBody {
            meta,
            range,
            reader,
            backend,
            idle,
            got: 0,
        }
    }

    /// A body over a [`GetResult`]'s stream (a backend that had to fall back to its stream
    /// for this read): each read copies from the stream's pieces.
    pub fn from_stream(res: GetResult, backend: &'static str, idle: Duration) -> Self {
        let reader = StreamRead {
            body: res.body,
            piece: Bytes::new(),
        };
        RangeBody::new(res.meta, res.range, Box::new(reader), backend, idle)
    }

    /// Bytes of the range not read yet.
    pub fn remaining(&self) -> u64 {
        (self.range.end - self.range.start) - self.got
    }

    /// Reads the range's next bytes into `buf` (at most [`RangeBody::remaining`]) and returns
    /// how many; 0 only once the whole range was read (or for an empty `buf`).
    ///
    /// # Errors
    /// [`StoreError::Timeout`] when no byte came for the idle timeout; [`StoreError::Other`]
    /// when the body ended early or its connection failed, naming the key and the bytes
    /// read of the range's. After an error the body is not to be read again.
    pub async fn read(&mut self, buf: &mut [u8]) -> StoreResult<usize> {
        let want = self.remaining().min(buf.len() as u64) as usize;
        if want == 0 {
            return Ok(0);
        }
        let (key, backend) = (&self.meta.key, self.backend);
        let (got, len) = (self.got, self.range.end - self.range.start);
        let failed = |what: String| StoreError::Other {
            backend,
            message: format!("GET {key}: {what} after {got} of {len} bytes"),
        };
        match tokio::time::timeout(self.idle, self.reader.read(&mut buf[..want])).await {
            Err(_) => Err(StoreError::Timeout {
                backend,
                message: format!(
                    "GET {key}: no body bytes for {:?} after {got} of {len} bytes",
                    self.idle
                ),
            }),
            Ok(Err(e)) => Err(failed(format!("body failed ({e})"))),
            Ok(Ok(0)) => Err(failed("body ended".to_string())),
            Ok(Ok(n)) if n > want => Err(failed(format!("{n} bytes from a read of {want}"))),
            Ok(Ok(n)) => {
                self.got += n as u64;
                Ok(n)
            }
        }
    }
}

/// [`RangeRead`] over a stream of pieces ([`RangeBody::from_stream`]).
struct StreamRead {
    body: ByteStream,
    piece: Bytes,
}

#[async_trait]
impl RangeRead for StreamRead {
    async fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        while self.piece.is_empty() {
            match self.body.next().await {
                None => return Ok(0),
                Some(Err(e)) => return Err(std::io::Error::other(e)),
                Some(Ok(p)) => self.piece = p,
            }
        }
        let n = buf.len().min(self.piece.len());
        buf[..n].copy_from_slice(&self.piece[..n]);
        self.piece.advance(n);
        Ok(n)
    }
}
