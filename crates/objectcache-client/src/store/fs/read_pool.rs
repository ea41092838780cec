//! Pooled buffers for the filesystem store's reads: a load's pieces of up to 4 MiB reuse
//! buffers instead of faulting fresh zeroed pages in for every piece.

use bytes::Bytes;

/// Bytes read per body chunk.
pub(super) const READ_CHUNK: usize = 4 << 20;

/// Reads of at least this many bytes use pooled [`READ_CHUNK`] buffers ([`read_buffer`]).
const POOLED_READ_MIN: usize = 256 << 10;

/// Most pooled read buffers kept between reads, process-wide (8 x 4 MiB = 32 MiB).
pub(super) const POOLED_READS_KEPT: usize = 8;

/// Read buffers kept for the next read. A load reads tens of MiB in pieces of up to
/// [`READ_CHUNK`]; with a fresh buffer per piece, the allocator hands each one back to the
/// OS when the piece is dropped, and the next read faults the pages in again, zeroed by the
/// kernel. Measured on a 94 MB load from the file store (30 layers x 32 chunks of
/// SmolLM2-135M, through the C ABI): 55-59 ms of CPU against 36 ms with glibc told to keep
/// freed memory (`GLIBC_TUNABLES=glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=1073741824`),
/// which this pool does for read buffers only.
pub(super) static READ_POOL: std::sync::Mutex<Vec<Vec<u8>>> = std::sync::Mutex::new(Vec::new());

/// An empty buffer for a read of `n` bytes: a pooled [`READ_CHUNK`] one for large reads,
/// else a fresh one of capacity `n`.
pub(super) fn read_buffer(n: usize) -> Vec<u8> {
    if !(POOLED_READ_MIN..=READ_CHUNK).contains(&n) {
        return Vec::with_capacity(n);
    }
    let pooled = READ_POOL.lock().unwrap_or_else(|e| e.into_inner()).pop();
    let mut v = pooled.unwrap_or_else(|| Vec::with_capacity(READ_CHUNK));
    v.clear();
    v
}

/// A read's bytes; a pooled buffer goes back to [`READ_POOL`] when the last `Bytes` of it
/// is dropped.
pub(super) fn into_bytes(buf: Vec<u8>) -> Bytes {
    if buf.capacity() == READ_CHUNK {
        Bytes::from_owner(PooledRead(buf))
    } else {
        Bytes::from(buf)
    }
}

/// A pooled read buffer lent to `Bytes`.
struct PooledRead(Vec<u8>);

impl AsRef<[u8]> for PooledRead {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl Drop for PooledRead {
    fn drop(&mut self) {
        let v = std::mem::take(&mut self.0);
        let mut pool = READ_POOL.lock().unwrap_or_else(|e| e.into_inner());
        if pool.len() < POOLED_READS_KEPT {
            pool.push(v);
        }
    }
}
