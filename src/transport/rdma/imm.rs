//! The 32-bit immediate carried by each RDMA_WRITE_WITH_IMM: it names the delivery unit the
//! write completed, so the receiver can count completions per layer. Pure code.
//!
//! Layout (most significant bit first): `slot:6 | layer:10 | unit:16`. `slot` tells concurrent
//! loads on one connection apart (64 per connection), `layer` allows 1024 layers, `unit`
//! (a chunk index) 65 536 units per layer (16.7 M tokens at 256 tokens per chunk).

/// Decoded immediate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Imm {
    /// Load slot on the connection, `< 64`.
    pub slot: u8,
    /// Layer index, `< 1024`.
    pub layer: u16,
    /// Unit (chunk) index within the layer, `< 65536`.
    pub unit: u16,
}

impl Imm {
    /// Number of load slots per connection.
    pub const SLOTS: u32 = 1 << 6;
    /// Largest number of layers a load may name.
    pub const MAX_LAYERS: u32 = 1 << 10;
    /// Largest number of units per layer.
    pub const MAX_UNITS: u32 = 1 << 16;

    /// Builds an immediate; `None` when a field is out of range.
    pub fn new(slot: u32, layer: u32, unit: u32) -> Option<Self> {
        if slot >= Self::SLOTS || layer >= Self::MAX_LAYERS || unit >= Self::MAX_UNITS {
            return None;
        }
        Some(Imm {
            slot: slot as u8,
            layer: layer as u16,
            unit: unit as u16,
        })
    }
    /// The 32-bit value (host order; the verbs layer converts to network order).
    pub fn encode(self) -> u32 {
        (u32::from(self.slot) << 26) | (u32::from(self.layer) << 16) | u32::from(self.unit)
    }
    /// Decodes any 32-bit value (every value is a valid triple).
    pub fn decode(v: u32) -> Self {
        Imm {
            slot: (v >> 26) as u8,
            layer: ((v >> 16) & 0x3ff) as u16,
            unit: (v & 0xffff) as u16,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_bounds() {
        for (s, l, u) in [(0, 0, 0), (63, 1023, 65535), (5, 79, 1234), (1, 2, 3)] {
            let i = Imm::new(s, l, u).unwrap();
            assert_eq!(Imm::decode(i.encode()), i);
            assert_eq!(
                (u32::from(i.slot), u32::from(i.layer), u32::from(i.unit)),
                (s, l, u)
            );
        }
        assert!(Imm::new(64, 0, 0).is_none());
        assert!(Imm::new(0, 1024, 0).is_none());
        assert!(Imm::new(0, 0, 65536).is_none());
        assert_ne!(
            Imm::new(1, 0, 0).unwrap().encode(),
            Imm::new(0, 1, 0).unwrap().encode()
        );
    }
}
