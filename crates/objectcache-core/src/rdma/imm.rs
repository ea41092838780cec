//! The 32-bit immediate carried by each RDMA_WRITE_WITH_IMM: it names the delivery unit the
//! write completed, so the receiver can count completions per layer. Pure code.
//!
//! Layout (most significant bit first): `slot:6 | layer:10 | slice:1 | unit:15`. `slot` tells
//! concurrent loads on one connection apart (64 per connection), `layer` allows 1024 layers.
//! With `slice` clear, `unit` is the index of a planned delivery unit within its layer (32 768
//! per layer). With `slice` set, the write carries one chunk's whole slice of the layer alone,
//! and `unit` is that chunk's index in the request: a gather server writes the good slices of
//! a unit this way when another chunk's slice in the unit is bad, so the miss stays with the
//! bad chunk (32 768 chunks, 8.4 M tokens at 256 tokens per chunk).

/// Decoded immediate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Imm {
    /// Load slot on the connection, `< 64`.
    pub slot: u8,
    /// Layer index, `< 1024`.
    pub layer: u16,
    /// `false`: `unit` is a planned unit's index within the layer. `true`: the write is one
    /// chunk's whole slice and `unit` is the chunk's index in the request.
    pub slice: bool,
    /// Unit index within the layer, or chunk index when `slice` is set; `< 32768`.
    pub unit: u16,
}

impl Imm {
    /// Number of load slots per connection.
    pub const SLOTS: u32 = 1 << 6;
    /// Largest number of layers a load may name.
    pub const MAX_LAYERS: u32 = 1 << 10;
    /// Largest number of units per layer, and of chunks a slice write can name.
    pub const MAX_UNITS: u32 = 1 << 15;

    /// Builds the immediate of a planned unit's write; `None` when a field is out of range.
    pub fn new(slot: u32, layer: u32, unit: u32) -> Option<Self> {
        Self::with_kind(slot, layer, false, unit)
    }
    /// Builds the immediate of a write that carries chunk `chunk`'s whole slice of `layer`
    /// alone; `None` when a field is out of range.
    pub fn slice(slot: u32, layer: u32, chunk: u32) -> Option<Self> {
        Self::with_kind(slot, layer, true, chunk)
    }
    fn with_kind(slot: u32, layer: u32, slice: bool, unit: u32) -> Option<Self> {
        if slot >= Self::SLOTS || layer >= Self::MAX_LAYERS || unit >= Self::MAX_UNITS {
            return None;
        }
        Some(Imm {
            slot: slot as u8,
            layer: layer as u16,
            slice,
            unit: unit as u16,
        })
    }
    /// The 32-bit value (host order; the verbs layer converts to network order).
    pub fn encode(self) -> u32 {
        (u32::from(self.slot) << 26)
            | (u32::from(self.layer) << 16)
            | (u32::from(self.slice) << 15)
            | u32::from(self.unit)
    }
    /// Decodes any 32-bit value (every value is a valid immediate).
    pub fn decode(v: u32) -> Self {
        Imm {
            slot: (v >> 26) as u8,
            layer: ((v >> 16) & 0x3ff) as u16,
            slice: v & 0x8000 != 0,
            unit: (v & 0x7fff) as u16,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_bounds() {
        for (s, l, u) in [(0, 0, 0), (63, 1023, 32767), (5, 79, 1234), (1, 2, 3)] {
            for i in [Imm::new(s, l, u).unwrap(), Imm::slice(s, l, u).unwrap()] {
                assert_eq!(Imm::decode(i.encode()), i);
                assert_eq!(
                    (u32::from(i.slot), u32::from(i.layer), u32::from(i.unit)),
                    (s, l, u)
                );
            }
            assert!(!Imm::new(s, l, u).unwrap().slice);
            assert!(Imm::slice(s, l, u).unwrap().slice);
            assert_ne!(
                Imm::new(s, l, u).unwrap().encode(),
                Imm::slice(s, l, u).unwrap().encode()
            );
        }
        assert!(Imm::new(64, 0, 0).is_none());
        assert!(Imm::new(0, 1024, 0).is_none());
        assert!(Imm::new(0, 0, 32768).is_none());
        assert!(Imm::slice(0, 0, 32768).is_none());
        assert_ne!(
            Imm::new(1, 0, 0).unwrap().encode(),
            Imm::new(0, 1, 0).unwrap().encode()
        );
    }
}
