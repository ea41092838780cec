//! Cutting a ranged read's body into its parts as the bytes arrive: an optional header, then
//! slices each followed by its CRC32C ([`SliceDemux`]). Pure code shared by the load paths:
//! a version 1 read (a chunk's header and layer 0, or consecutive layers of one chunk) and a
//! version 2 run read (a segment's header and one layer of consecutive chunks) are both
//! "a header of `h` bytes, then `n` slices of `slice_len` bytes with their CRCs".
//!
//! The demultiplexer computes each slice's CRC32C as its bytes pass and hands the driver
//! borrowed pieces of the body (no copy), so the driver only writes them into place and acts
//! on the verdicts; it may `await` between pieces ([`SliceDemux::next`] is pull-style).
//!
//! A driver that can read the body straight into the destination (a body it reads with
//! `read(2)` itself, not one handed over in pieces) asks [`SliceDemux::wanted`] what comes
//! next: for slice bytes it reads into the slice's destination and reports them with
//! [`SliceDemux::placed`], which checksums them in place; header and trailer bytes it feeds
//! through [`SliceDemux::next`] as before.
#![forbid(unsafe_code)]

use super::format::SLICE_CRC_LEN;

/// Where a body's bytes go, one step at a time (see [`SliceDemux::next`]).
#[derive(Debug, PartialEq, Eq)]
pub enum BodyPart<'a> {
    /// The header is complete: [`SliceDemux::header`] holds all its bytes.
    Header,
    /// Bytes `offset .. offset + bytes.len()` of slice `slice` (0-based within the read).
    Data {
        /// Slice index within the read.
        slice: usize,
        /// Offset of `bytes` within the slice.
        offset: u64,
        /// The bytes, borrowed from the body piece.
        bytes: &'a [u8],
    },
    /// Slice `slice`'s bytes and its CRC trailer have all arrived.
    SliceEnd {
        /// Slice index within the read.
        slice: usize,
        /// The CRC32C stored after the slice.
        stored: u32,
        /// The CRC32C of the bytes that arrived.
        computed: u32,
    },
    /// `len` bytes arrived after the last slice's CRC: the body is longer than the range
    /// asked for. They are consumed and dropped; the driver should fail the read.
    Excess {
        /// Bytes past the end.
        len: usize,
    },
}

/// What a body needs next ([`SliceDemux::wanted`]), for a driver that reads slice bytes
/// straight into place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wanted {
    /// `n` more header bytes, or `n` more bytes of a slice's CRC trailer: feed them through
    /// [`SliceDemux::next`].
    Framing(usize),
    /// Bytes `offset .. offset + len` of slice `slice` (the rest of it): read them into place
    /// and report them with [`SliceDemux::placed`] (or feed them through
    /// [`SliceDemux::next`]).
    Data {
        /// Slice index within the read.
        slice: usize,
        /// Offset within the slice of the first byte wanted.
        offset: u64,
        /// Bytes of the slice still to come.
        len: u64,
    },
    /// Every part arrived; any further byte is excess.
    Done,
}

/// Demultiplexer of one ranged read's body: `header_len` header bytes, then `slices` slices
/// of `slice_len` bytes, each followed by its 4-byte CRC32C (little-endian).
#[derive(Debug, Clone)]
pub struct SliceDemux {
    header_len: usize,
    header: Vec<u8>,
    slices: usize,
    slice_len: u64,
    /// Index of the slice being received (`slices` once all are done).
    slice: usize,
    /// Bytes of the current slice received.
    in_slice: u64,
    crc: u32,
    trailer: [u8; 4],
    trailer_len: usize,
    received: u64,
}

impl SliceDemux {
    /// A demultiplexer for a body of `header_len` header bytes then `slices` slices of
    /// `slice_len` bytes with their CRCs.
    pub fn new(header_len: usize, slices: usize, slice_len: u64) -> Self {
        SliceDemux {
            header_len,
            header: Vec::with_capacity(header_len),
            slices,
            slice_len,
            slice: 0,
            in_slice: 0,
            crc: 0,
            trailer: [0; 4],
            trailer_len: 0,
            received: 0,
        }
    }

    /// Bytes the whole body should have.
    pub fn expected_len(&self) -> u64 {
        self.header_len as u64 + self.slices as u64 * (self.slice_len + SLICE_CRC_LEN)
    }

    /// Bytes consumed so far (excess included).
    pub fn received(&self) -> u64 {
        self.received
    }

    /// The header bytes received so far (all of them once [`BodyPart::Header`] was returned).
    pub fn header(&self) -> &[u8] {
        &self.header
    }

    /// Index of the first slice not yet complete (`slices` when every slice is).
    pub fn current_slice(&self) -> usize {
        self.slice
    }

    /// `true` when the header and every slice with its CRC have arrived.
    pub fn complete(&self) -> bool {
        self.header.len() == self.header_len && self.slice == self.slices
    }

    /// What the body needs next. A driver reading slice bytes into place reads at most
    /// [`Wanted::Data`]'s `len` bytes before asking again.
    pub fn wanted(&self) -> Wanted {
        if self.header.len() < self.header_len {
            Wanted::Framing(self.header_len - self.header.len())
        } else if self.slice >= self.slices {
            Wanted::Done
        } else if self.in_slice < self.slice_len {
            Wanted::Data {
                slice: self.slice,
                offset: self.in_slice,
                len: self.slice_len - self.in_slice,
            }
        } else {
            Wanted::Framing(4 - self.trailer_len)
        }
    }

    /// Reports `bytes` as the next bytes of the current slice, read into place by the driver:
    /// they enter the slice's CRC32C as if fed through [`SliceDemux::next`]. The slice's end
    /// (its trailer) is still fed through [`SliceDemux::next`].
    ///
    /// # Panics
    /// If [`SliceDemux::wanted`] is not [`Wanted::Data`] or `bytes` is longer than its `len`:
    /// a driver bug, not a property of the body.
    pub fn placed(&mut self, bytes: &[u8]) {
        match self.wanted() {
            Wanted::Data { len, .. } if bytes.len() as u64 <= len => {}
            w => panic!(
                "{} slice bytes placed while the body wants {w:?}",
                bytes.len()
            ),
        }
        self.crc = super::crc::crc32c_append(self.crc, bytes);
        self.in_slice += bytes.len() as u64;
        self.received += bytes.len() as u64;
    }

    /// Takes the next part from the front of `p` (advancing it), or `None` when `p` is empty.
    /// Call until it returns `None`, then feed the next piece of the body.
    pub fn next<'a>(&mut self, p: &mut &'a [u8]) -> Option<BodyPart<'a>> {
        loop {
            if p.is_empty() {
                return None;
            }
            if self.header.len() < self.header_len {
                let n = p.len().min(self.header_len - self.header.len());
                self.header.extend_from_slice(&p[..n]);
                self.take(p, n);
                if self.header.len() == self.header_len {
                    return Some(BodyPart::Header);
                }
                continue;
            }
            if self.slice >= self.slices {
                let len = p.len();
                self.take(p, len);
                return Some(BodyPart::Excess { len });
            }
            if self.in_slice < self.slice_len {
                let n = (p.len() as u64).min(self.slice_len - self.in_slice) as usize;
                let bytes = &p[..n];
                self.crc = super::crc::crc32c_append(self.crc, bytes);
                let offset = self.in_slice;
                self.in_slice += n as u64;
                self.take(p, n);
                return Some(BodyPart::Data {
                    slice: self.slice,
                    offset,
                    bytes,
                });
            }
            let n = p.len().min(4 - self.trailer_len);
            self.trailer[self.trailer_len..self.trailer_len + n].copy_from_slice(&p[..n]);
            self.trailer_len += n;
            self.take(p, n);
            if self.trailer_len == 4 {
                let end = BodyPart::SliceEnd {
                    slice: self.slice,
                    stored: u32::from_le_bytes(self.trailer),
                    computed: self.crc,
                };
                self.slice += 1;
                self.in_slice = 0;
                self.crc = 0;
                self.trailer_len = 0;
                return Some(end);
            }
        }
    }

    fn take(&mut self, p: &mut &[u8], n: usize) {
        *p = &p[n..];
        self.received += n as u64;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::crc::crc32c;

    /// A body: `header`, then each slice and its CRC (the CRC of slice `bad` flipped).
    fn body(header: &[u8], slices: &[Vec<u8>], bad: Option<usize>) -> Vec<u8> {
        let mut b = header.to_vec();
        for (i, s) in slices.iter().enumerate() {
            b.extend_from_slice(s);
            let crc = crc32c(s) ^ u32::from(bad == Some(i));
            b.extend_from_slice(&crc.to_le_bytes());
        }
        b
    }

    /// Feeds `b` in pieces of `step` bytes; returns the slices rebuilt from the data parts,
    /// the verdicts, and whether the header was announced once, after all its bytes.
    fn run(d: &mut SliceDemux, b: &[u8], step: usize) -> (Vec<Vec<u8>>, Vec<(usize, bool)>, usize) {
        let mut rebuilt: Vec<Vec<u8>> = Vec::new();
        let (mut ends, mut headers) = (Vec::new(), 0);
        for piece in b.chunks(step) {
            let mut p = piece;
            while let Some(part) = d.next(&mut p) {
                match part {
                    BodyPart::Header => headers += 1,
                    BodyPart::Data {
                        slice,
                        offset,
                        bytes,
                    } => {
                        if rebuilt.len() <= slice {
                            rebuilt.resize(slice + 1, Vec::new());
                        }
                        assert_eq!(rebuilt[slice].len() as u64, offset);
                        rebuilt[slice].extend_from_slice(bytes);
                    }
                    BodyPart::SliceEnd {
                        slice,
                        stored,
                        computed,
                    } => ends.push((slice, stored == computed)),
                    BodyPart::Excess { len } => panic!("excess {len}"),
                }
            }
        }
        (rebuilt, ends, headers)
    }

    #[test]
    fn every_cut_of_the_body_gives_the_same_parts() {
        let slices: Vec<Vec<u8>> = (0..3u8).map(|i| vec![i + 1; 10]).collect();
        let b = body(b"HEADER", &slices, Some(1));
        for step in [1, 3, 4, 6, 13, 14, 1000] {
            let mut d = SliceDemux::new(6, 3, 10);
            assert_eq!(d.expected_len(), b.len() as u64);
            let (rebuilt, ends, headers) = run(&mut d, &b, step);
            assert_eq!(rebuilt, slices, "step {step}");
            assert_eq!(ends, vec![(0, true), (1, false), (2, true)], "step {step}");
            assert_eq!((headers, d.header()), (1, &b"HEADER"[..]), "step {step}");
            assert!(d.complete() && d.received() == b.len() as u64);
        }
    }

    #[test]
    fn no_header_and_empty_slices_and_truncation() {
        let slices = vec![vec![7u8; 5], vec![8u8; 5]];
        let b = body(b"", &slices, None);
        let mut d = SliceDemux::new(0, 2, 5);
        let (rebuilt, ends, headers) = run(&mut d, &b, 2);
        assert_eq!((rebuilt, headers), (slices.clone(), 0));
        assert_eq!(ends, vec![(0, true), (1, true)]);
        // Cut short inside the second slice's CRC: not complete, slice 1 still current.
        let mut d = SliceDemux::new(0, 2, 5);
        run(&mut d, &b[..b.len() - 2], 4);
        assert!(!d.complete());
        assert_eq!(d.current_slice(), 1);
        // Zero-length slices still carry their CRC (of no bytes).
        let b = body(b"H", &[vec![], vec![]], None);
        let mut d = SliceDemux::new(1, 2, 0);
        let (_, ends, headers) = run(&mut d, &b, 3);
        assert_eq!((ends, headers), (vec![(0, true), (1, true)], 1));
    }

    /// A driver that places slice bytes itself (in pieces of `step`) and feeds only the
    /// framing gets the same slices and verdicts as one fed the whole body.
    #[test]
    fn placing_slice_bytes_gives_the_same_verdicts() {
        let slices: Vec<Vec<u8>> = (0..3u8).map(|i| vec![i + 7; 10]).collect();
        let b = body(b"HDR", &slices, Some(2));
        for step in [1, 3, 10] {
            let mut d = SliceDemux::new(3, 3, 10);
            let mut rebuilt = vec![Vec::new(); 3];
            let (mut ends, mut at) = (Vec::new(), 0usize);
            loop {
                match d.wanted() {
                    Wanted::Done => break,
                    Wanted::Data { slice, offset, len } => {
                        assert_eq!(rebuilt[slice].len() as u64, offset);
                        let n = (len as usize).min(step);
                        rebuilt[slice].extend_from_slice(&b[at..at + n]);
                        d.placed(&b[at..at + n]);
                        at += n;
                    }
                    Wanted::Framing(n) => {
                        let mut p = &b[at..at + n];
                        at += n;
                        while let Some(part) = d.next(&mut p) {
                            match part {
                                BodyPart::SliceEnd {
                                    slice,
                                    stored,
                                    computed,
                                } => ends.push((slice, stored == computed)),
                                BodyPart::Header => assert_eq!(d.header(), b"HDR"),
                                other => panic!("{other:?} from framing bytes"),
                            }
                        }
                    }
                }
            }
            assert_eq!(rebuilt, slices, "step {step}");
            assert_eq!(ends, vec![(0, true), (1, true), (2, false)], "step {step}");
            assert!(d.complete() && d.received() == b.len() as u64);
        }
    }

    #[test]
    fn bytes_past_the_end_are_reported_as_excess() {
        let mut b = body(b"", &[vec![1u8; 4]], None);
        b.extend_from_slice(b"tail");
        let mut d = SliceDemux::new(0, 1, 4);
        let mut p = &b[..];
        let mut parts = Vec::new();
        while let Some(part) = d.next(&mut p) {
            parts.push(format!("{part:?}"));
        }
        assert_eq!(parts.len(), 3, "{parts:?}");
        assert_eq!(parts[2], "Excess { len: 4 }");
        assert!(d.complete());
    }
}
