//! Object bytes in local files, lent from the page cache: the S3 front end's GET bodies
//! ([`local_file_body`]) and the gather's slices ([`map_whole`]). Each is a
//! read-only memory mapping of part of an object's file, owned by a [`Bytes`]. Writing such a
//! body to a socket copies each byte once, from the page cache into the socket's buffers,
//! where reading it first copied it into a heap buffer as well.
//!
//! The one rule that makes this sound is the [`LocalObject`] contract: a store never changes
//! or shortens a file it handed out. The filesystem store keeps it by never writing to an
//! object's file once it is committed (`store/fs/`: every put writes a temporary file it
//! created with `O_EXCL`, then renames it over the key's path or links it there; nothing
//! opens an object's file for writing). A committed object is
//! replaced by a rename, which gives the path a new inode and leaves the mapped one as it was;
//! deleting it (`DELETE`, the lifecycle's GC) unlinks the name, and the mapping keeps the inode
//! and its pages alive until it is unmapped. What the rule does not cover is another program
//! rewriting the store's files in place: bytes changed under a mapping reach the client as
//! they are now, and a file truncated below a mapped range makes the process fault (`SIGBUS`)
//! when those pages are touched. The store's directory belongs to the store.
#![allow(unsafe_code)]

use bytes::Bytes;
use futures::StreamExt;
use objectcache_client::error::{StoreError, StoreResult};
use objectcache_client::store::{ByteStream, LocalObject};
use rustix::mm::{MapFlags, ProtFlags};
use std::ffi::c_void;
use std::fs::File;
use std::ops::Range;
use std::ptr::NonNull;
use std::sync::Arc;

/// Pieces of a local file's body below this many bytes are read rather than mapped: for a
/// few pages, `mmap(2)` and `munmap(2)` cost more than the copy they save.
const MAP_MIN_BYTES: u64 = 64 << 10;

/// The body of `range` of `obj`, an object's file opened by the store
/// ([`objectcache_client::store::Store::open_local`]), in pieces of at most `piece_bytes` (at least 1),
/// each made on the blocking pool when
/// the previous one has been taken: a piece of at least [`MAP_MIN_BYTES`] is the file's pages
/// themselves, mapped ([`map`]), so the socket write is the only copy of its bytes; a smaller
/// one is read. A range reaching past `obj.meta().size` (the size of this open file) is an
/// error.
pub(crate) fn local_file_body(
    obj: LocalObject,
    range: Range<u64>,
    key: String,
    piece_bytes: u64,
) -> ByteStream {
    let size = obj.meta().size;
    if range.start > range.end || range.end > size {
        let e = StoreError::InvalidRange {
            key,
            start: range.start,
            end: range.end,
            size,
        };
        return futures::stream::once(async move { Err(e) }).boxed();
    }
    let st = (
        Arc::new(obj.into_parts().0),
        range.start,
        range.end,
        Arc::<str>::from(key),
    );
    futures::stream::try_unfold(st, move |(file, at, end, key)| async move {
        if at >= end {
            return Ok(None);
        }
        let n = (end - at).min(piece_bytes.max(1));
        let (f, k) = (file.clone(), key.clone());
        let piece = tokio::task::spawn_blocking(move || local_piece(&f, size, at, n as usize, &k))
            .await
            .map_err(|e| StoreError::other("fs", format!("blocking task failed: {e}")))??;
        Ok(Some((piece, (file, at + n, end, key))))
    })
    .boxed()
}

/// The whole of `obj`'s file, mapped read-only ([`map`] without populating: its pages come
/// in as they are first touched), for the gather path's socket writes (`gather/fetch.rs`).
/// Sound for the same reason as [`local_file_body`]: `obj` is a [`LocalObject`], whose file
/// never changes or shrinks; the mapping holds the inode once the file is closed.
///
/// # Errors
/// The OS error of `mmap(2)`; an empty object (nothing to map) is an error too.
pub(crate) fn map_whole(obj: &LocalObject) -> std::io::Result<Bytes> {
    let size = obj.meta().size;
    let len = usize::try_from(size)
        .ok()
        .filter(|&n| n > 0)
        .ok_or_else(|| {
            std::io::Error::other(format!("no mapping for an object of {size} bytes"))
        })?;
    // SAFETY: `obj` is a `LocalObject`, under the contract of `LocalObject::new`: its file's
    // bytes never change and it is never shortened; `0 + len` is its size when opened.
    unsafe { map(obj.file(), 0, len, size, false) }
}

/// `n` bytes of an object's `file` (of `size` bytes) from byte `at`: mapped, or read if
/// small.
fn local_piece(file: &File, size: u64, at: u64, n: usize, key: &str) -> StoreResult<Bytes> {
    let failed = |what: &str, e: std::io::Error| {
        StoreError::other("fs", format!("{what} {n} bytes of {key} at {at}: {e}"))
    };
    if n as u64 >= MAP_MIN_BYTES {
        // SAFETY: `file` is a `LocalObject`'s (`local_file_body`), under the contract of
        // `LocalObject::new`: its bytes never change and it is never shortened. `at + n` is
        // at most `size`, the size of this open file (checked by `local_file_body`).
        return unsafe { map(file, at, n, size, true) }.map_err(|e| failed("map", e));
    }
    let mut buf = vec![0u8; n];
    std::os::unix::fs::FileExt::read_exact_at(file, &mut buf, at).map_err(|e| failed("read", e))?;
    Ok(Bytes::from(buf))
}

/// A read-only shared mapping; `data` bytes from `offset` into it are the ones lent out.
struct Mapping {
    base: NonNull<c_void>,
    len: usize,
    offset: usize,
    data: usize,
}

// SAFETY: the mapping is only ever read, and its bytes never change (module documentation),
// so it can be read from any thread and dropped (unmapped) on any thread.
unsafe impl Send for Mapping {}
// SAFETY: as above: shared references only read memory that nothing writes.
unsafe impl Sync for Mapping {}

impl AsRef<[u8]> for Mapping {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: `base..base + len` is a live, readable mapping of the file, and
        // `offset..offset + data` lies within it and within the file (`map`'s contract); it is
        // unmapped only when `self` is dropped, and its bytes never change (module
        // documentation).
        unsafe {
            std::slice::from_raw_parts(
                self.base
                    .as_ptr()
                    .cast::<u8>()
                    .add(self.offset)
                    .cast_const(),
                self.data,
            )
        }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `base` and `len` are exactly what `mmap` returned and was asked for, and no
        // reference into the mapping outlives `self` (`AsRef` borrows it).
        if let Err(e) = unsafe { rustix::mm::munmap(self.base.as_ptr(), self.len) } {
            tracing::warn!(error = %e, "munmap of a GET body");
        }
    }
}

/// Mappings start and end at multiples of this file offset where the file allows: a 2 MiB
/// folio of the page cache (what a file written in large steps is cached in: `store/fs/tmp.rs`,
/// `WRITE_STEP`) is mapped with one page-table entry when the mapping covers all of it, with
/// 512 otherwise.
const MAP_ALIGN: u64 = 2 << 20;

/// `len` bytes of `file` (of `size` bytes) from byte `at`, mapped read-only. The mapping
/// reaches out to [`MAP_ALIGN`] boundaries around them (within the file). With `populate`
/// the pages lent out are put in place now (read from the disk if need be) before the body
/// goes to a socket, so call it so on a blocking thread, never on the runtime's; without it,
/// pages come in as they are first touched (a socket write of a page not in the page cache
/// reads it, as `sendfile(2)` would).
///
/// # Safety
/// `file` must be an object's file under the [`LocalObject`] contract (never changed or
/// shortened) and `at + len <= size`, where `size` is the file's size.
///
/// # Errors
/// The OS error of `mmap(2)`.
unsafe fn map(
    file: &File,
    at: u64,
    len: usize,
    size: u64,
    populate: bool,
) -> std::io::Result<Bytes> {
    if len == 0 {
        return Ok(Bytes::new());
    }
    let page = rustix::param::page_size() as u64;
    let start = at - at % MAP_ALIGN;
    let file_end = size.div_ceil(page) * page;
    let end = (at + len as u64).div_ceil(MAP_ALIGN) * MAP_ALIGN;
    let map_len = (end.min(file_end) - start) as usize;
    let offset = (at - start) as usize;
    // SAFETY: a new mapping at an address of the kernel's choosing, so no existing memory is
    // affected; `start` is page-aligned and the mapping ends within the file's last page; the
    // caller vouches for the file (see above), so its bytes never change while mapped.
    let base = unsafe {
        rustix::mm::mmap(
            std::ptr::null_mut(),
            map_len,
            ProtFlags::READ,
            MapFlags::SHARED,
            file,
            start,
        )
    }?;
    let base = NonNull::new(base).ok_or_else(|| std::io::Error::other("mmap returned null"))?;
    let m = Mapping {
        base,
        len: map_len,
        offset,
        data: len,
    };
    if !populate {
        return Ok(Bytes::from_owner(m));
    }
    // The pages lent out, whole.
    let first = offset - offset % page as usize;
    let last = (offset + len).div_ceil(page as usize) * page as usize;
    // SAFETY: `first..last` lies within the mapping (`offset + len <= map_len`, and
    // `map_len` is a whole number of pages); populating reads pages, it changes no memory.
    let populated = unsafe {
        rustix::mm::madvise(
            base.as_ptr().cast::<u8>().add(first).cast(),
            last - first,
            rustix::mm::Advice::LinuxPopulateRead,
        )
    };
    if populated.is_err() {
        // A kernel before 5.14: touch each page instead.
        let data = m.as_ref();
        let mut sum = 0u8;
        for i in (0..data.len()).step_by(page as usize) {
            sum = sum.wrapping_add(data[i]);
        }
        std::hint::black_box(sum);
    }
    Ok(Bytes::from_owner(m))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// Mapped bytes are the file's, at any offset (page-aligned or not), and slices of them
    /// stay readable after the file is closed and its name removed.
    #[test]
    fn mapped_ranges_are_the_files_bytes_and_outlive_the_name() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("obj");
        let data: Vec<u8> = (0..(3 << 20) + 777)
            .map(|i: usize| (i * 7 + i / 4093) as u8)
            .collect();
        std::fs::File::create(&path)
            .unwrap()
            .write_all(&data)
            .unwrap();
        let file = File::open(&path).unwrap();
        let ranges = [
            (0, 4096),
            (1, 1),
            (4095, 70_000),
            (1 << 20, 2 << 20),
            (data.len() - 5000, 5000),
            (100, 0),
        ];
        let mut held = Vec::new();
        for (at, len) in ranges {
            // SAFETY: this test's file is never written again.
            let b = unsafe { map(&file, at as u64, len, data.len() as u64, at % 2 == 0) }.unwrap();
            assert!(b[..] == data[at..at + len], "{at}+{len}");
            held.push((at + len / 3, b.slice(len / 3..len - len / 3)));
        }
        drop(file);
        std::fs::remove_file(&path).unwrap();
        for (at, b) in held {
            assert!(b[..] == data[at..at + b.len()], "held slice at {at}");
        }
    }
}
