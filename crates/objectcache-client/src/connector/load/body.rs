//! One ranged read's body, cut into its parts and put in place ([`BodyReader`]), for both
//! ways a store hands a body over:
//! - a stream of pieces ([`Store::get_opts`]): each piece's slice bytes are copied into the
//!   destination as they pass the demultiplexer;
//! - a body the load reads itself ([`Store::get_range_body`]): slice bytes are read from the
//!   connection straight into the destination ranges the load lends, and checksummed there
//!   (the gather path's way; one pass over each byte fewer).
//!
//! The caller sees the same events either way: the header complete, each slice's end with
//! its CRC32C verdict, the end of the body; and one error type. A slice of a layer that
//! another chunk already failed is still read (the body is one stream) but dropped.
//!
//! [`Store::get_opts`]: crate::store::Store::get_opts
//! [`Store::get_range_body`]: crate::store::Store::get_range_body

use super::window::FlightPermit;
use super::LoadShared;
use crate::connector::buffers::LayerStatus;
use crate::error::{LayerError, StoreError};
use crate::layout::{BodyPart, SliceDemux, Wanted};
use crate::store::{ByteStream, RangeBody};
use crate::transport::LayerSink;
use bytes::{Buf, Bytes};
use futures::StreamExt;

/// Where a read's bytes come from.
pub(super) enum Source {
    /// Pieces from the store's stream.
    Stream(ByteStream),
    /// A body read into the load's memory.
    Direct(RangeBody),
}

/// What a body brought ([`BodyReader::next`]).
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Event {
    /// The header is complete: [`BodyReader::demux`]'s `header()` holds it.
    Header,
    /// A slice and its trailer arrived.
    SliceEnd(SliceEnd),
    /// The body ended: complete if [`SliceDemux::complete`] says so, else truncated.
    End,
}

/// A slice of a read whose trailer arrived ([`Event::SliceEnd`]).
#[derive(Debug, PartialEq, Eq)]
pub(super) struct SliceEnd {
    /// Index of the slice within the read.
    pub slice: usize,
    /// Its CRC32C as stored in the object.
    pub stored: u32,
    /// Its CRC32C as computed over the bytes received.
    pub computed: u32,
    /// Its layer had already failed, so its bytes were dropped, not put in place.
    pub dropped: bool,
}

/// Why a body stopped.
#[derive(Debug)]
pub(super) enum BodyError {
    /// The load was cancelled.
    Cancelled,
    /// The store's body failed (connection, idle timeout, early end).
    Body(StoreError),
    /// The destination refused the bytes of the current slice.
    Dest(LayerError),
    /// Bytes past the end of the range asked for.
    Excess,
}

/// A read's body: [`BodyReader::next`] until [`Event::End`] or an error.
pub(super) struct BodyReader<'a, P: Fn(usize) -> (u32, u64)> {
    src: Source,
    demux: SliceDemux,
    sh: &'a LoadShared,
    /// Where slice `i` of the read lands: its layer, and its byte offset in that layer.
    place: P,
    /// The rest of the current stream piece.
    piece: Bytes,
    /// The current slice's layer already failed: its bytes are dropped.
    dropped: bool,
    scratch: Vec<u8>,
}

impl<'a, P: Fn(usize) -> (u32, u64)> BodyReader<'a, P> {
    /// A reader of `src`, cut by `demux`, into `sh`'s destination at `place(slice)`.
    pub(super) fn new(src: Source, demux: SliceDemux, sh: &'a LoadShared, place: P) -> Self {
        BodyReader {
            src,
            demux,
            sh,
            place,
            piece: Bytes::new(),
            dropped: false,
            scratch: Vec::new(),
        }
    }

    /// The demultiplexer: the header, the current slice, the bytes received.
    pub(super) fn demux(&self) -> &SliceDemux {
        &self.demux
    }

    /// The body's next event; bytes that arrive count as progress (stall watchdog) and
    /// against `permit` (the flight window).
    ///
    /// # Errors
    /// [`BodyError`]: the caller fails the read's slices from the current one on.
    pub(super) async fn next(&mut self, permit: &mut FlightPermit) -> Result<Event, BodyError> {
        loop {
            if self.sh.state.is_cancelled() {
                return Err(BodyError::Cancelled);
            }
            let part = match &mut self.src {
                Source::Stream(body) => {
                    if self.piece.is_empty() {
                        match body.next().await {
                            None => return Ok(Event::End),
                            Some(Err(e)) => return Err(BodyError::Body(e)),
                            Some(Ok(p)) => {
                                self.sh.progress.arrived(p.len() as u64);
                                permit.received(p.len() as u64);
                                self.piece = p;
                            }
                        }
                    }
                    let mut p: &[u8] = &self.piece;
                    let part = self.demux.next(&mut p).map(owned);
                    let used = self.piece.len() - p.len();
                    if let Some(Owned::Data { slice, offset, len }) = part {
                        // The bytes just cut are the piece's `used` bytes before its rest.
                        let bytes = self.piece.slice(used - len..used);
                        self.put(slice, offset, &bytes)?;
                    }
                    self.piece.advance(used);
                    part
                }
                Source::Direct(body) => match self.demux.wanted() {
                    Wanted::Done => return Ok(Event::End),
                    Wanted::Data { slice, offset, len } => {
                        let (layer, at) = (self.place)(slice);
                        read_in_place(
                            body,
                            &mut self.demux,
                            self.sh,
                            (layer, at + offset),
                            len,
                            &mut self.dropped,
                            &mut self.scratch,
                            permit,
                        )
                        .await?;
                        continue;
                    }
                    Wanted::Framing(n) => {
                        if self.scratch.len() < n {
                            self.scratch.resize(n, 0);
                        }
                        let got = body
                            .read(&mut self.scratch[..n])
                            .await
                            .map_err(BodyError::Body)?;
                        if got == 0 {
                            return Ok(Event::End);
                        }
                        self.sh.progress.arrived(got as u64);
                        permit.received(got as u64);
                        let mut p: &[u8] = &self.scratch[..got];
                        let part = self.demux.next(&mut p).map(owned);
                        debug_assert!(p.is_empty(), "framing bytes beyond one part");
                        part
                    }
                },
            };
            match part {
                None | Some(Owned::Data { .. }) => {}
                Some(Owned::Header) => return Ok(Event::Header),
                Some(Owned::Excess) => return Err(BodyError::Excess),
                Some(Owned::SliceEnd {
                    slice,
                    stored,
                    computed,
                }) => {
                    let dropped = std::mem::take(&mut self.dropped);
                    return Ok(Event::SliceEnd(SliceEnd {
                        slice,
                        stored,
                        computed,
                        dropped,
                    }));
                }
            }
        }
    }

    /// Copies `bytes` (at `offset` in slice `slice`) into place, unless the slice is dropped.
    fn put(&mut self, slice: usize, offset: u64, bytes: &[u8]) -> Result<(), BodyError> {
        if self.dropped {
            return Ok(());
        }
        let (layer, at) = (self.place)(slice);
        match self.sh.write_slice_part(layer, at + offset, bytes) {
            Ok(needed) => {
                self.dropped = !needed;
                Ok(())
            }
            Err(e) => Err(BodyError::Dest(e)),
        }
    }
}

/// A [`BodyPart`] without its borrowed bytes (only their length).
enum Owned {
    Header,
    Data {
        slice: usize,
        offset: u64,
        len: usize,
    },
    SliceEnd {
        slice: usize,
        stored: u32,
        computed: u32,
    },
    Excess,
}

fn owned(p: BodyPart<'_>) -> Owned {
    match p {
        BodyPart::Header => Owned::Header,
        BodyPart::Data {
            slice,
            offset,
            bytes,
        } => Owned::Data {
            slice,
            offset,
            len: bytes.len(),
        },
        BodyPart::SliceEnd {
            slice,
            stored,
            computed,
        } => Owned::SliceEnd {
            slice,
            stored,
            computed,
        },
        BodyPart::Excess { .. } => Owned::Excess,
    }
}

/// Reads the current slice's remaining `len` bytes from `body` into the destination range
/// the load lends at `(layer, at)`, reporting them to `demux` (which checksums them in
/// place). A slice whose layer already failed (or is `dropped`) is read into `scratch` and
/// dropped. On an error the lent range stays reserved and unfilled; the caller fails the
/// layer.
#[allow(clippy::too_many_arguments)]
async fn read_in_place(
    body: &mut RangeBody,
    demux: &mut SliceDemux,
    sh: &LoadShared,
    (layer, at): (u32, u64),
    len: u64,
    dropped: &mut bool,
    scratch: &mut Vec<u8>,
    permit: &mut FlightPermit,
) -> Result<(), BodyError> {
    // `RangeBody::read` returns 0 only past the range's end, which a demultiplexer wanting
    // bytes says was reached early: the range asked for was shorter than the parts.
    let ended = || {
        BodyError::Body(StoreError::other(
            "load",
            format!("the body ended {len} bytes short of its slice"),
        ))
    };
    let parts = if *dropped {
        None
    } else {
        match sh.state.dest_parts_impl(layer, at, len) {
            Ok(p) => Some(p),
            Err(e)
                if e != LayerError::Cancelled
                    && matches!(sh.state.status(layer as usize), LayerStatus::Failed(_)) =>
            {
                *dropped = true;
                None
            }
            Err(e) => return Err(BodyError::Dest(e)),
        }
    };
    match parts {
        Some(mut parts) => {
            for part in parts.iter_mut() {
                let mut filled = 0;
                while filled < part.len() {
                    let n = body
                        .read(&mut part[filled..])
                        .await
                        .map_err(BodyError::Body)?;
                    if n == 0 {
                        return Err(ended());
                    }
                    demux.placed(&part[filled..filled + n]);
                    sh.progress.arrived(n as u64);
                    permit.received(n as u64);
                    filled += n;
                }
            }
            sh.state.dest_filled(layer, len);
        }
        None => {
            scratch.resize(scratch.len().max(64 << 10), 0);
            let mut left = len;
            while left > 0 {
                let want = left.min(scratch.len() as u64) as usize;
                let n = body
                    .read(&mut scratch[..want])
                    .await
                    .map_err(BodyError::Body)?;
                if n == 0 {
                    return Err(ended());
                }
                demux.placed(&scratch[..n]);
                sh.progress.arrived(n as u64);
                permit.received(n as u64);
                left -= n as u64;
            }
        }
    }
    Ok(())
}
