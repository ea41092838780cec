//! Bounds-checked little-endian reading and writing of frame bodies.

use super::ProtocolError;
use bytes::BufMut;

/// Reads fields from a frame body; every read checks the remaining length.
pub(crate) struct Reader<'a> {
    b: &'a [u8],
    what: &'static str,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(b: &'a [u8], what: &'static str) -> Self {
        Reader { b, what }
    }
    pub(crate) fn take(&mut self, n: usize) -> Result<&'a [u8], ProtocolError> {
        if self.b.len() < n {
            return Err(ProtocolError::Truncated {
                what: self.what,
                needed: n - self.b.len(),
            });
        }
        let (a, rest) = self.b.split_at(n);
        self.b = rest;
        Ok(a)
    }
    pub(crate) fn u8(&mut self) -> Result<u8, ProtocolError> {
        Ok(self.take(1)?[0])
    }
    pub(crate) fn u16(&mut self) -> Result<u16, ProtocolError> {
        Ok(u16::from_le_bytes(
            self.take(2)?.try_into().expect("2 bytes"),
        ))
    }
    pub(crate) fn u32(&mut self) -> Result<u32, ProtocolError> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }
    pub(crate) fn u64(&mut self) -> Result<u64, ProtocolError> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }
    /// A string with a u16 length prefix, at most `max` bytes of UTF-8.
    pub(crate) fn str16(
        &mut self,
        field: &'static str,
        max: usize,
    ) -> Result<String, ProtocolError> {
        let n = self.u16()? as usize;
        if n > max {
            return Err(ProtocolError::TooLarge {
                what: field,
                got: n as u64,
                max: max as u64,
            });
        }
        let b = self.take(n)?;
        String::from_utf8(b.to_vec()).map_err(|_| ProtocolError::invalid(field, "not UTF-8"))
    }
    /// Bounds a count before allocating: each element needs at least `min_each` bytes.
    pub(crate) fn count(
        &mut self,
        field: &'static str,
        max: u32,
        min_each: usize,
    ) -> Result<usize, ProtocolError> {
        let n = self.u32()?;
        if n > max {
            return Err(ProtocolError::TooLarge {
                what: field,
                got: n as u64,
                max: max as u64,
            });
        }
        let need = n as usize * min_each;
        if need > self.b.len() {
            return Err(ProtocolError::Truncated {
                what: self.what,
                needed: need - self.b.len(),
            });
        }
        Ok(n as usize)
    }
    pub(crate) fn zero(&mut self, n: usize, field: &'static str) -> Result<(), ProtocolError> {
        if self.take(n)?.iter().any(|&b| b != 0) {
            return Err(ProtocolError::invalid(field, "reserved bytes must be zero"));
        }
        Ok(())
    }
    pub(crate) fn finish(&self) -> Result<(), ProtocolError> {
        if !self.b.is_empty() {
            return Err(ProtocolError::invalid(
                self.what,
                format!("{} trailing bytes", self.b.len()),
            ));
        }
        Ok(())
    }
}

/// Writes a string with a u16 length prefix (callers validate the length first).
pub(crate) fn put_str16(out: &mut impl BufMut, s: &str) {
    out.put_u16_le(s.len() as u16);
    out.put_slice(s.as_bytes());
}
