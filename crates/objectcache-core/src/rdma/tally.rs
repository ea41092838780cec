//! The completion bookkeeping of one layer of an RDMA load, pure: which planned units and
//! lone slices have landed (counted from each receive completion's immediate and byte count),
//! when the layer is ready, and when it became a miss. No verbs, no locks, no clock: the
//! client's completion thread hands it what each completion says and acts on the answer.

use std::collections::HashMap;

/// Where a layer stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerState {
    /// Units are still due.
    Pending,
    /// Every planned unit landed.
    Ready,
    /// A miss (a server report, a broken connection or a deadline).
    Failed,
}

/// What a completion's write delivered, for the sink: `len` bytes at `offset` of the
/// layer's destination.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Landed {
    /// Destination offset, bytes.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
    /// True when this unit made the layer ready.
    pub ready: bool,
}

/// A completion the tally cannot place: the peer broke the protocol ([`LayerTally::unit`],
/// [`LayerTally::slice`]). The connection is not to be trusted after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum TallyError {
    /// A unit index the layer's plan does not hold, or one that already landed.
    #[error("unexpected or repeated unit {unit} of layer {layer}")]
    UnexpectedUnit {
        /// The layer.
        layer: u32,
        /// The unit index the immediate named.
        unit: usize,
    },
    /// A unit whose last write carried another byte count than planned.
    #[error("unit {unit} of layer {layer} carried {got} bytes in its last write, want {want}")]
    UnitLength {
        /// The layer.
        layer: u32,
        /// The unit index.
        unit: usize,
        /// Bytes the write carried.
        got: u64,
        /// Bytes planned.
        want: u64,
    },
    /// A lone slice write for a chunk that no unit of several slices holds.
    #[error(
        "slice write for chunk {chunk} of layer {layer}, which no unit of several slices holds"
    )]
    UnexpectedSlice {
        /// The layer.
        layer: u32,
        /// The chunk index the immediate named.
        chunk: u16,
    },
    /// A second lone slice write for the same chunk.
    #[error("repeated slice write for chunk {chunk} of layer {layer}")]
    RepeatedSlice {
        /// The layer.
        layer: u32,
        /// The chunk index.
        chunk: u16,
    },
    /// A lone slice whose last write carried another byte count than planned.
    #[error("the slice of chunk {chunk} of layer {layer} carried {got} bytes in its last write, want {want}")]
    SliceLength {
        /// The layer.
        layer: u32,
        /// The chunk index.
        chunk: u16,
        /// Bytes the write carried.
        got: u64,
        /// Bytes planned.
        want: u64,
    },
}

/// One layer's tally (see the module docs).
#[derive(Debug)]
pub struct LayerTally {
    /// `(offset, len)` of each unit in the layer's destination, by unit index.
    units: Vec<(u64, u64)>,
    /// Bytes the immediate's write of each unit carries: the unit's last destination piece
    /// (the whole unit for a contiguous destination).
    imm_len: Vec<u64>,
    seen: Vec<bool>,
    /// Chunk index -> `(offset, len, last write's len)` of each slice a server may write alone
    /// (a slice immediate), and whether it has arrived.
    slices: HashMap<u16, (u64, u64, u64, bool)>,
    got: usize,
    state: LayerState,
}

impl LayerTally {
    /// A pending layer of `units` (`(offset, len)` by unit index), whose units' last writes
    /// carry `imm_len` bytes each, and whose `slices` (chunk -> `(offset, len, last write's
    /// len)`) the server may write alone.
    pub fn new(
        units: Vec<(u64, u64)>,
        imm_len: Vec<u64>,
        slices: HashMap<u16, (u64, u64, u64)>,
    ) -> Self {
        let seen = vec![false; units.len()];
        LayerTally {
            units,
            imm_len,
            seen,
            slices: slices
                .into_iter()
                .map(|(c, (o, n, last))| (c, (o, n, last, false)))
                .collect(),
            got: 0,
            state: LayerState::Pending,
        }
    }

    /// Where the layer stands.
    pub fn state(&self) -> LayerState {
        self.state
    }

    /// A completion of planned unit `unit` whose last write carried `byte_len` bytes. Returns
    /// what landed while the layer is pending (`None`: a late unit of a layer that is already
    /// a miss).
    ///
    /// # Errors
    /// [`TallyError`] naming the unit when it is not planned, repeated, or of the wrong
    /// length: the peer broke the protocol.
    pub fn unit(
        &mut self,
        layer: u32,
        unit: usize,
        byte_len: u64,
    ) -> Result<Option<Landed>, TallyError> {
        if unit >= self.seen.len() || self.seen[unit] {
            return Err(TallyError::UnexpectedUnit { layer, unit });
        }
        if byte_len != self.imm_len[unit] {
            return Err(TallyError::UnitLength {
                layer,
                unit,
                got: byte_len,
                want: self.imm_len[unit],
            });
        }
        self.seen[unit] = true;
        self.got += 1;
        if self.state != LayerState::Pending {
            return Ok(None);
        }
        let (offset, len) = self.units[unit];
        let ready = self.got == self.seen.len();
        if ready {
            self.state = LayerState::Ready;
        }
        Ok(Some(Landed { offset, len, ready }))
    }

    /// A completion of chunk `chunk`'s slice written alone (its unit was cut by a bad slice),
    /// whose last write carried `byte_len` bytes. It lands even though the layer is (or will
    /// be) a miss: the chunk's other layers still count. Returns `(offset, len)`.
    ///
    /// # Errors
    /// [`TallyError`] when no unit of several slices holds that chunk, the slice came before,
    /// or its length is wrong.
    pub fn slice(
        &mut self,
        layer: u32,
        chunk: u16,
        byte_len: u64,
    ) -> Result<(u64, u64), TallyError> {
        let Some(sl) = self.slices.get_mut(&chunk) else {
            return Err(TallyError::UnexpectedSlice { layer, chunk });
        };
        if sl.3 {
            return Err(TallyError::RepeatedSlice { layer, chunk });
        }
        if byte_len != sl.2 {
            return Err(TallyError::SliceLength {
                layer,
                chunk,
                got: byte_len,
                want: sl.2,
            });
        }
        sl.3 = true;
        Ok((sl.0, sl.1))
    }

    /// True when every planned unit has landed (whatever the layer's state): no further
    /// write of this layer can land, as each unit is written once.
    pub fn all_in(&self) -> bool {
        self.got == self.seen.len()
    }

    /// Makes a pending layer a miss. Returns the index of its first unit not yet landed (the
    /// error names it as the chunk), or `None` when the layer was already resolved.
    pub fn fail(&mut self) -> Option<usize> {
        if self.state != LayerState::Pending {
            return None;
        }
        self.state = LayerState::Failed;
        Some(self.seen.iter().position(|s| !s).unwrap_or(0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn three_units() -> LayerTally {
        let slices = HashMap::from([(0, (0, 100, 100)), (1, (100, 100, 40))]);
        LayerTally::new(
            vec![(0, 200), (200, 200), (400, 50)],
            vec![200, 200, 50],
            slices,
        )
    }

    #[test]
    fn a_layer_is_ready_when_every_unit_landed_once() {
        let mut t = three_units();
        let first = t.unit(3, 1, 200).unwrap();
        assert_eq!(
            first,
            Some(Landed {
                offset: 200,
                len: 200,
                ready: false
            })
        );
        assert!(t.unit(3, 0, 200).unwrap().is_some());
        assert_eq!(t.state(), LayerState::Pending);
        let last = t.unit(3, 2, 50).unwrap().unwrap();
        assert!(last.ready && t.state() == LayerState::Ready);
        // Resolved: a later failure changes nothing.
        assert_eq!(t.fail(), None);
        assert_eq!(t.state(), LayerState::Ready);
    }

    #[test]
    fn protocol_breaks_are_named() {
        let mut t = three_units();
        let e = t.unit(3, 7, 200).unwrap_err();
        assert_eq!(e, TallyError::UnexpectedUnit { layer: 3, unit: 7 });
        assert!(e.to_string().contains("unit 7 of layer 3"), "{e}");
        let e = t.unit(3, 0, 199).unwrap_err();
        assert_eq!(
            e,
            TallyError::UnitLength {
                layer: 3,
                unit: 0,
                got: 199,
                want: 200
            }
        );
        assert!(e.to_string().contains("carried 199 bytes") && e.to_string().contains("want 200"));
        t.unit(3, 0, 200).unwrap();
        assert_eq!(
            t.unit(3, 0, 200).unwrap_err(),
            TallyError::UnexpectedUnit { layer: 3, unit: 0 }
        );
        let e = t.slice(3, 5, 100).unwrap_err();
        assert_eq!(e, TallyError::UnexpectedSlice { layer: 3, chunk: 5 });
        assert!(e.to_string().contains("no unit of several"));
        let e = t.slice(3, 1, 100).unwrap_err();
        assert!(matches!(e, TallyError::SliceLength { want: 40, .. }), "{e}");
        assert_eq!(t.slice(3, 1, 40).unwrap(), (100, 100));
        assert_eq!(
            t.slice(3, 1, 40).unwrap_err(),
            TallyError::RepeatedSlice { layer: 3, chunk: 1 }
        );
    }

    #[test]
    fn a_failed_layer_names_its_first_missing_unit_and_ignores_late_ones() {
        let mut t = three_units();
        t.unit(2, 0, 200).unwrap();
        assert_eq!(t.fail(), Some(1));
        assert_eq!(t.state(), LayerState::Failed);
        assert_eq!(t.fail(), None);
        // A late unit is counted (not repeated later) but lands nothing.
        assert_eq!(t.unit(2, 1, 200).unwrap(), None);
        assert!(t.unit(2, 1, 200).is_err());
        // Lone slices of a failed layer still land (the chunk's other layers count).
        assert_eq!(t.slice(2, 0, 100).unwrap(), (0, 100));
    }
}
