//! The server's state of one gather load, sans-IO.
//!
//! The driver (`objectcache-server`'s `gather`) admits the load, reads the store, paces, and
//! writes the socket or posts RDMA writes. Every decision about *what* the load sends is
//! taken here, on values the driver hands in:
//! - which chunks' object headers are known, and which are bad ([`ServerLoad::on_header`]):
//!   a bad chunk's `Miss` goes out, for every requested layer, before any unit that would
//!   carry its slices, and its slices are left out of every unit;
//! - how a read unit's pieces become what goes out ([`ServerLoad::cut`]): a slice that failed
//!   its read is a `Miss` for that (chunk, layer) only; runs of consecutive good pieces become
//!   unit frames with their CRC32Cs combined ([`CutUnit::into_units`]); on RDMA, an intact unit
//!   is one write and a unit cut by a bad piece is written slice by slice
//!   ([`CutUnit::into_rdma_writes`], the rule the client's completion count relies on);
//! - per-layer progress (when a layer's last unit is out) and the totals `End` carries.
//!
//! The client's side of the same load is [`super::LoadTracker`]; the tests at the end run
//! both against each other through [`super::ServerConnection`] and
//! [`super::ClientConnection`], with no I/O.

use super::{MissFrame, MissReason, UnitHeader, UnitPlan};
use crate::layout::crc::crc32c_combine;
use std::collections::{HashMap, HashSet};
use std::ops::Range;

/// What the server found wrong with a chunk's object (its header check) or with one (chunk,
/// layer) slice of it (its read).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PieceMiss {
    /// Chunk index in the request.
    pub chunk: u32,
    /// Why, as the `Miss` frame says it.
    pub reason: MissReason,
    /// The server's words (the store's error, or the check that failed).
    pub message: String,
}

/// One read piece of a planned unit: its payload as the driver holds it (`P`: a buffer, or a
/// range of a local file sent with `sendfile(2)`), and the CRC32C of those bytes.
pub type PieceRead<P> = Result<(Vec<P>, u32), PieceMiss>;

/// A piece of a unit that was read and is delivered.
#[derive(Debug)]
pub struct GoodPiece<P> {
    /// Chunk index in the request.
    pub chunk: u32,
    /// Destination offset in the layer's buffer, bytes.
    pub offset: u64,
    /// Payload length, bytes.
    pub len: u64,
    /// The payload, in order.
    pub parts: Vec<P>,
    /// CRC32C of the payload.
    pub crc32c: u32,
}

/// One planned unit after its read, cut by [`ServerLoad::cut`].
#[derive(Debug)]
pub struct CutUnit<P> {
    /// The unit's layer.
    pub layer: u32,
    /// `Miss` frames for the slices whose read failed: send them before the unit's bytes.
    pub misses: Vec<MissFrame>,
    /// The pieces that go out, in destination order.
    pub good: Vec<GoodPiece<P>>,
    /// True when a bad chunk or slice left a piece out.
    pub cut: bool,
    offset: u64,
    len: u64,
    pieces: usize,
}

/// One RDMA write of a [`CutUnit`] ([`CutUnit::into_rdma_writes`]).
#[derive(Debug)]
pub struct RdmaWrite<P> {
    /// `None`: the whole planned unit, which the client counts by its unit index;
    /// `Some(chunk)`: one slice of a cut unit, which the client counts by its chunk.
    pub slice_of: Option<u32>,
    /// Destination offset in the layer's buffer, bytes.
    pub offset: u64,
    /// Payload length, bytes.
    pub len: u64,
    /// The payload, in order.
    pub parts: Vec<P>,
}

impl<P> CutUnit<P> {
    /// The unit frames for the TCP stream: each run of consecutive good pieces is one unit,
    /// its CRC32C combined from the pieces' (a bad chunk or slice splits a planned unit).
    pub fn into_units(self) -> Vec<(UnitHeader, Vec<P>)> {
        let mut out: Vec<(UnitHeader, Vec<P>, u64)> = Vec::new();
        for g in self.good {
            match out.last_mut() {
                Some((h, parts, len)) if h.offset + *len == g.offset => {
                    h.crc32c = crc32c_combine(h.crc32c, g.crc32c, g.len);
                    *len += g.len;
                    parts.extend(g.parts);
                }
                _ => out.push((
                    UnitHeader {
                        layer: self.layer,
                        crc32c: g.crc32c,
                        offset: g.offset,
                        len: 0,
                    },
                    g.parts,
                    g.len,
                )),
            }
        }
        out.into_iter()
            .map(|(mut h, parts, len)| {
                // A planned unit is at most `max_unit_bytes` (a u32), and so is any run in it.
                h.len = u32::try_from(len).expect("a unit fits its u32 length");
                (h, parts)
            })
            .collect()
    }

    /// The RDMA writes: an intact unit is one write (the client counts it by its unit index);
    /// a cut unit of several pieces is written slice by slice, each named by its chunk (in such
    /// a unit every piece is a whole slice, so the client can count it); a cut unit of one
    /// piece writes nothing (its `Miss` fails the layer).
    pub fn into_rdma_writes(self) -> Vec<RdmaWrite<P>> {
        if !self.cut {
            vec![RdmaWrite {
                slice_of: None,
                offset: self.offset,
                len: self.len,
                parts: self.good.into_iter().flat_map(|g| g.parts).collect(),
            }]
        } else if self.pieces > 1 {
            self.good
                .into_iter()
                .map(|g| RdmaWrite {
                    slice_of: Some(g.chunk),
                    offset: g.offset,
                    len: g.len,
                    parts: g.parts,
                })
                .collect()
        } else {
            Vec::new()
        }
    }
}

/// Whether a read unit can go out yet ([`ServerLoad::readiness`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnitReady {
    /// A header the unit carries is not known yet: hand the next header result to
    /// [`ServerLoad::on_header`] and ask again.
    AwaitHeader,
    /// Every chunk misses and nothing went out: the load has nothing to send; end it.
    NothingToSend,
    /// Pace it if the load is paced, then deliver [`ServerLoad::unit_actions`].
    Deliver,
}

/// One thing the driver does for a read unit, in the order [`ServerLoad::unit_actions`]
/// returns them (`P`: a payload buffer as the driver holds it).
#[derive(Debug)]
pub enum LoadAction<P> {
    /// Send this `Miss` frame (it goes out before any unit that would carry the slice).
    SendMiss(MissFrame),
    /// Write this unit frame to the stream; count it with [`ServerLoad::sent`] once queued.
    SendUnit(UnitHeader, Vec<P>),
    /// Post this RDMA write of the unit's layer into the client's memory, unless a write of
    /// that layer already failed ([`ServerLoad::rdma_layer_failed`]); count it with
    /// [`ServerLoad::sent`] once posted, or report its failure with
    /// [`ServerLoad::rdma_failed`].
    WriteRdma(RdmaWrite<P>),
}

/// The server's state of one gather load (see the module docs).
#[derive(Debug)]
pub struct ServerLoad {
    layers: Range<u32>,
    n_chunks: usize,
    /// Chunks whose header check failed.
    bad: HashSet<u32>,
    /// Header results received, in chunk order.
    known: usize,
    /// Planned units not yet done, per layer.
    remaining: HashMap<u32, usize>,
    units: u64,
    bytes: u64,
    first_seen: bool,
    /// RDMA target: layers a write failed for (each named by one `Miss`).
    rdma_failed: HashSet<u32>,
}

impl ServerLoad {
    /// A load of `n_chunks` chunks for `layers`, planned as `plan`
    /// ([`super::plan_units`] of its request).
    pub fn new(layers: Range<u32>, n_chunks: usize, plan: &[UnitPlan]) -> Self {
        let mut remaining: HashMap<u32, usize> = HashMap::new();
        for u in plan {
            *remaining.entry(u.layer).or_default() += 1;
        }
        Self {
            layers,
            n_chunks,
            bad: HashSet::new(),
            known: 0,
            remaining,
            units: 0,
            bytes: 0,
            first_seen: false,
            rdma_failed: HashSet::new(),
        }
    }

    /// The next chunk's header check result (they come in chunk order). A bad chunk misses
    /// every requested layer: the returned `Miss` goes out before any unit that carries it.
    pub fn on_header(&mut self, result: Result<(), PieceMiss>) -> Option<MissFrame> {
        self.known = (self.known + 1).min(self.n_chunks);
        let m = result.err()?;
        self.bad.insert(m.chunk);
        Some(MissFrame {
            chunk: m.chunk,
            layers: self.layers.clone(),
            reason: m.reason,
            message: m.message,
        })
    }

    /// The header checker ended without a result for every chunk (it never does before
    /// sending every result): stop waiting for them.
    pub fn headers_ended(&mut self) {
        self.known = self.n_chunks;
    }

    /// True while a header that `unit` carries is not known yet: the unit must wait.
    pub fn awaits_headers(&self, unit: &UnitPlan) -> bool {
        let need = unit
            .pieces
            .iter()
            .map(|p| p.chunk as usize + 1)
            .max()
            .unwrap_or(0);
        self.known < need
    }

    /// True while some chunk's header result has not come (wait for them before `End`: they
    /// still name their misses).
    pub fn headers_pending(&self) -> bool {
        self.known < self.n_chunks
    }

    /// True when every chunk misses and nothing went out: the load has nothing to send.
    pub fn nothing_to_send(&self) -> bool {
        self.known == self.n_chunks && self.bad.len() == self.n_chunks && self.units == 0
    }

    /// Cuts planned unit `plan` after its read: `pieces` holds one result per piece of
    /// `plan.pieces`, in order. Pieces of bad chunks are left out; a piece whose read failed
    /// is left out and named by a `Miss` for its (chunk, layer).
    pub fn cut<P>(&self, plan: &UnitPlan, pieces: Vec<PieceRead<P>>) -> CutUnit<P> {
        let layer = plan.layer;
        let mut good = Vec::new();
        let mut misses = Vec::new();
        let mut cut = false;
        let mut at = plan.offset;
        for (p, r) in plan.pieces.iter().zip(pieces) {
            let len = p.range.end - p.range.start;
            let offset = at;
            at += len;
            if self.bad.contains(&p.chunk) {
                cut = true;
                continue;
            }
            match r {
                Ok((parts, crc32c)) => good.push(GoodPiece {
                    chunk: p.chunk,
                    offset,
                    len,
                    parts,
                    crc32c,
                }),
                Err(m) => {
                    // This (chunk, layer) slice misses; the chunk's other layers and the other
                    // chunks of this layer are still delivered.
                    cut = true;
                    misses.push(MissFrame {
                        chunk: m.chunk,
                        layers: layer..layer + 1,
                        reason: m.reason,
                        message: m.message,
                    });
                }
            }
        }
        CutUnit {
            layer,
            misses,
            good,
            cut,
            offset: plan.offset,
            len: plan.len,
            pieces: plan.pieces.len(),
        }
    }

    /// Whether read unit `unit` can go out yet: its headers known, and something to send.
    pub fn readiness(&self, unit: &UnitPlan) -> UnitReady {
        if self.awaits_headers(unit) {
            UnitReady::AwaitHeader
        } else if self.nothing_to_send() {
            UnitReady::NothingToSend
        } else {
            UnitReady::Deliver
        }
    }

    /// What goes out for planned unit `plan` after its read ([`Self::cut`] of `pieces`): the
    /// `Miss` frames of its failed slices first, then its unit frames for the TCP stream
    /// ([`CutUnit::into_units`]) or, when `rdma`, its RDMA writes
    /// ([`CutUnit::into_rdma_writes`]).
    pub fn unit_actions<P>(
        &self,
        plan: &UnitPlan,
        pieces: Vec<PieceRead<P>>,
        rdma: bool,
    ) -> Vec<LoadAction<P>> {
        let mut cut = self.cut(plan, pieces);
        let mut out: Vec<LoadAction<P>> = std::mem::take(&mut cut.misses)
            .into_iter()
            .map(LoadAction::SendMiss)
            .collect();
        if rdma {
            out.extend(
                cut.into_rdma_writes()
                    .into_iter()
                    .map(LoadAction::WriteRdma),
            );
        } else {
            let units = cut.into_units().into_iter();
            out.extend(units.map(|(h, parts)| LoadAction::SendUnit(h, parts)));
        }
        out
    }

    /// Counts one unit frame (or RDMA write) of `len` payload bytes sent.
    pub fn sent(&mut self, len: u64) {
        self.units += 1;
        self.bytes += len;
    }

    /// Once per load: true the first time it is asked after a unit went out (time to first
    /// layer, as the server sees it).
    pub fn first_out(&mut self) -> bool {
        if self.units > 0 && !self.first_seen {
            self.first_seen = true;
            return true;
        }
        false
    }

    /// Planned unit of `layer` is done (sent, or left out); true when it was the layer's last.
    pub fn unit_done(&mut self, layer: u32) -> bool {
        match self.remaining.get_mut(&layer) {
            Some(r) if *r > 0 => {
                *r -= 1;
                *r == 0
            }
            _ => false,
        }
    }

    /// RDMA target: true once a write of `layer` failed (its other writes are not posted).
    pub fn rdma_layer_failed(&self, layer: u32) -> bool {
        self.rdma_failed.contains(&layer)
    }

    /// RDMA target: a write of `layer` failed (posting it, or its completion). The first
    /// failure of a layer returns its `Miss` (storage, naming `chunk`); later ones nothing.
    pub fn rdma_failed(&mut self, layer: u32, chunk: u32, message: &str) -> Option<MissFrame> {
        self.rdma_failed.insert(layer).then(|| MissFrame {
            chunk,
            layers: layer..layer + 1,
            reason: MissReason::Storage,
            message: message.to_string(),
        })
    }

    /// RDMA target: `completed` writes completed; `End` counts those (not those posted).
    pub fn rdma_completed(&mut self, completed: u64) {
        self.units = completed;
    }

    /// What `End` carries: units sent (RDMA: writes completed) and payload bytes.
    pub fn totals(&self) -> (u64, u64) {
        (self.units, self.bytes)
    }
}

#[cfg(test)]
mod tests;
