//! Memory: page-aligned host buffers, memory regions (`ibv_mr`) and a registration cache so a
//! destination buffer is registered once and reused by every later load.

use std::alloc::Layout;
use std::collections::HashMap;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use rdma_sys as ffi;

use super::pd::ProtectionDomain;
use super::{RdmaError, Result};

/// Alignment of [`HostBuffer`]s: one 4 KiB page, so registration pins whole pages only.
pub const PAGE: usize = 4096;

/// A zero-filled, page-aligned host buffer of fixed length that a NIC may write into.
///
/// Its bytes are only reached through raw pointers ([`HostBuffer::read_at`],
/// [`HostBuffer::write_at`]), never through a long-lived `&[u8]`, because a remote peer may
/// write into it at any time while it is registered. Read a layer's bytes after the layer is
/// reported ready; before that they may be partly written.
///
/// It is shared (`Arc`, `Sync`) between the code that posts work requests, the memory region
/// and the reader, so nothing in the type keeps two writers apart: the copy functions are
/// `unsafe fn`, and their one contract ([`HostBuffer::read_at`]'s) is what makes sharing
/// sound.
pub struct HostBuffer {
    ptr: NonNull<u8>,
    len: usize,
}

impl std::fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostBuffer")
            .field("addr", &(self.ptr.as_ptr() as usize))
            .field("len", &self.len)
            .finish()
    }
}

// SAFETY: the buffer is plain owned memory; all accesses go through raw-pointer copies.
unsafe impl Send for HostBuffer {}
// SAFETY: as above. Shared access only reaches the bytes through the `unsafe fn` copies,
// whose contract rules out racing accesses to a range; the rest reads `ptr` and `len`.
unsafe impl Sync for HostBuffer {}

impl HostBuffer {
    /// Allocates `len` zeroed bytes aligned to [`PAGE`].
    ///
    /// # Errors
    /// [`RdmaError::InvalidArgument`] when `len` is 0 or too large to allocate.
    pub fn new(len: usize) -> Result<Arc<Self>> {
        if len == 0 {
            return Err(RdmaError::InvalidArgument(
                "a host buffer needs at least one byte".into(),
            ));
        }
        let layout = Layout::from_size_align(len, PAGE).map_err(|_| {
            RdmaError::InvalidArgument(format!("buffer of {len} bytes is too large"))
        })?;
        // SAFETY: `layout` has non-zero size (checked above).
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(p)
            .ok_or_else(|| RdmaError::InvalidArgument(format!("cannot allocate {len} bytes")))?;
        Ok(Arc::new(HostBuffer { ptr, len }))
    }
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Always `false` (a buffer has at least one byte); present for API symmetry.
    pub fn is_empty(&self) -> bool {
        false
    }
    /// Start address (the value a peer uses as `remote_addr` base).
    pub fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }
    pub(crate) fn as_mut_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
    fn check(&self, offset: usize, n: usize) -> Result<()> {
        if offset.checked_add(n).is_none_or(|e| e > self.len) {
            return Err(RdmaError::InvalidArgument(format!(
                "range {offset}+{n} is outside a buffer of {} bytes",
                self.len
            )));
        }
        Ok(())
    }
    /// Copies `out.len()` bytes starting at `offset` into `out`.
    ///
    /// # Safety
    /// The contract of every copy in or out of a host buffer (`read_at`, `to_vec`,
    /// `write_at`, `fill`): while the copy runs, nothing writes the bytes it touches, and a
    /// copy into the buffer has nothing reading them either. Writers are other copies on other
    /// threads, a [`slice_mut`](Self::slice_mut) view, and the NIC: a peer's RDMA write into a
    /// registered buffer (read a layer only after its completion reported it ready) or a local
    /// one still being posted. Reads that overlap each other are fine.
    ///
    /// # Errors
    /// [`RdmaError::InvalidArgument`] when the range is outside the buffer.
    pub unsafe fn read_at(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        self.check(offset, out.len())?;
        std::sync::atomic::fence(Ordering::Acquire);
        // SAFETY: the range is inside the allocation (checked); `out` is a distinct Rust
        // buffer, so the regions do not overlap; no write races the copy (the contract).
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.ptr.as_ptr().add(offset),
                out.as_mut_ptr(),
                out.len(),
            )
        };
        Ok(())
    }
    /// Copies `data` into the buffer at `offset`.
    ///
    /// # Safety
    /// As [`read_at`](Self::read_at): nothing else reads or writes the range while it runs.
    ///
    /// # Errors
    /// [`RdmaError::InvalidArgument`] when the range is outside the buffer.
    pub unsafe fn write_at(&self, offset: usize, data: &[u8]) -> Result<()> {
        self.check(offset, data.len())?;
        // SAFETY: the range is inside the allocation (checked); `data` is a distinct Rust
        // slice, so the regions do not overlap; nothing else touches the range (the contract).
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.as_ptr().add(offset), data.len())
        };
        std::sync::atomic::fence(Ordering::Release);
        Ok(())
    }
    /// A mutable view of `len` bytes at `offset`.
    ///
    /// # Safety
    /// The caller guarantees that for the lifetime of the returned slice nothing else reads
    /// or writes the range: no other view, no posted work request using it, and no remote
    /// write access to it (a local-only region, or a range no peer has been told about).
    /// Panics if the range is outside the buffer.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn slice_mut(&self, offset: usize, len: usize) -> &mut [u8] {
        assert!(
            offset.checked_add(len).is_some_and(|e| e <= self.len),
            "range outside the host buffer"
        );
        // SAFETY: in bounds (asserted); exclusivity is the caller's contract above.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(offset), len) }
    }
    /// A copy of `len` bytes at `offset`.
    ///
    /// # Safety
    /// As [`read_at`](Self::read_at): nothing writes the range while it runs.
    ///
    /// # Errors
    /// [`RdmaError::InvalidArgument`] when the range is outside the buffer.
    pub unsafe fn to_vec(&self, offset: usize, len: usize) -> Result<Vec<u8>> {
        let mut v = vec![0u8; len];
        // SAFETY: the caller's contract is `read_at`'s.
        unsafe { self.read_at(offset, &mut v)? };
        Ok(v)
    }
    /// Sets every byte to `b`.
    ///
    /// # Safety
    /// As [`read_at`](Self::read_at), for the whole buffer: nothing else reads or writes any
    /// of it while it runs (no peer may be writing into it).
    pub unsafe fn fill(&self, b: u8) {
        // SAFETY: the whole allocation is `len` bytes; nothing else touches it (the contract).
        unsafe { std::ptr::write_bytes(self.ptr.as_ptr(), b, self.len) };
        std::sync::atomic::fence(Ordering::Release);
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        // Cannot fail: the same layout was accepted at allocation.
        if let Ok(layout) = Layout::from_size_align(self.len, PAGE) {
            // SAFETY: allocated in `new` with this layout; every memory region over it holds an
            // `Arc<HostBuffer>`, so it is deregistered before this runs.
            unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) };
        }
    }
}

/// Access rights of a memory region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Local use only (a staging arena the NIC reads from).
    Local,
    /// Local write plus remote write (a destination that peers write into with RDMA_WRITE).
    RemoteWrite,
}

impl Access {
    fn flags(self) -> i32 {
        let f = match self {
            Access::Local => ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE,
            Access::RemoteWrite => {
                ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE
                    | ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE
            }
        };
        f.0 as i32
    }
}

/// A registered memory region (`ibv_mr`) over a [`HostBuffer`], which it keeps alive.
///
/// Or over caller memory registered with [`MemoryRegion::register_raw`] (for example the
/// connector's `LayerBuffers` regions, or pinned memory of an inference engine).
#[derive(Debug)]
pub struct MemoryRegion {
    raw: NonNull<ffi::ibv_mr>,
    buf: Option<Arc<HostBuffer>>,
    addr: u64,
    len: usize,
    _pd: Arc<ProtectionDomain>,
    lkey: u32,
    rkey: u32,
}

// SAFETY: an MR is an immutable handle after registration; keys are copied out.
unsafe impl Send for MemoryRegion {}
// SAFETY: as above.
unsafe impl Sync for MemoryRegion {}

impl MemoryRegion {
    /// Registers all of `buf` in `pd` with `access` (pins its pages).
    ///
    /// # Errors
    /// [`RdmaError::Verbs`] when `ibv_reg_mr` fails (often `ENOMEM`: the locked-memory limit,
    /// `ulimit -l`, is too low; see docs/rdma.md).
    pub fn register(
        pd: &Arc<ProtectionDomain>,
        buf: &Arc<HostBuffer>,
        access: Access,
    ) -> Result<Self> {
        // SAFETY: `buf` is a live allocation of `buf.len()` bytes that this MR keeps alive
        // (it stores the `Arc`) until `ibv_dereg_mr` in `Drop`; that memory is only reached
        // through raw-pointer copies, so DMA into it never aliases a Rust reference.
        let mut mr = unsafe { Self::register_raw(pd, buf.as_mut_ptr(), buf.len(), access)? };
        mr.buf = Some(buf.clone());
        Ok(mr)
    }

    /// Registers caller memory `ptr..ptr+len`.
    ///
    /// # Safety
    /// The memory must stay allocated and mapped at this address until the returned region
    /// is dropped, and while remote-write access is granted nothing may hold a Rust reference
    /// to it that a NIC write could invalidate (read it through raw pointers, after the
    /// layer is ready). Freeing and re-mapping it while registered leaves the region pinned
    /// to the old pages: evict it from any [`RegistrationCache`] first.
    ///
    /// # Errors
    /// [`RdmaError::InvalidArgument`] for a null or empty range; otherwise as
    /// [`MemoryRegion::register`].
    pub unsafe fn register_raw(
        pd: &Arc<ProtectionDomain>,
        ptr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<Self> {
        if ptr.is_null() || len == 0 {
            return Err(RdmaError::InvalidArgument(
                "cannot register a null or empty memory range".into(),
            ));
        }
        // SAFETY: the caller guarantees `ptr..ptr+len` stays mapped until `Drop` deregisters
        // it; `pd` is a live PD kept alive by the `Arc` stored in the result.
        let raw = unsafe { ffi::ibv_reg_mr(pd.as_ptr(), ptr.cast(), len, access.flags()) };
        let raw = NonNull::new(raw).ok_or_else(|| RdmaError::verbs("ibv_reg_mr", 0))?;
        // SAFETY: `raw` points to the `ibv_mr` just returned; the keys are plain fields.
        let (lkey, rkey) = unsafe { ((*raw.as_ptr()).lkey, (*raw.as_ptr()).rkey) };
        Ok(MemoryRegion {
            raw,
            buf: None,
            addr: ptr as u64,
            len,
            _pd: pd.clone(),
            lkey,
            rkey,
        })
    }
    /// Local key (used in this side's scatter/gather entries).
    pub fn lkey(&self) -> u32 {
        self.lkey
    }
    /// Remote key (given to the peer that writes into this region).
    pub fn rkey(&self) -> u32 {
        self.rkey
    }
    /// Start address of the region.
    pub fn addr(&self) -> u64 {
        self.addr
    }
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// `true` when the region has no bytes (never: buffers have at least one byte).
    pub fn is_empty(&self) -> bool {
        false
    }
    /// The registered [`HostBuffer`] (`None` for caller memory).
    pub fn buffer(&self) -> Option<&Arc<HostBuffer>> {
        self.buf.as_ref()
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        // SAFETY: registered by `ibv_reg_mr`, deregistered exactly once; the buffer is freed
        // only after this (we hold an `Arc` to it).
        unsafe { ffi::ibv_dereg_mr(self.raw.as_ptr()) };
    }
}

/// Registers each destination buffer once per protection domain and hands the same region
/// back on later loads (keyed by the buffer's address and length; the cached region keeps
/// the buffer alive, so an address is never reused while cached).
#[derive(Debug)]
pub struct RegistrationCache {
    pd: Arc<ProtectionDomain>,
    map: Mutex<HashMap<(u64, usize), Arc<MemoryRegion>>>,
    registrations: AtomicU64,
}

impl RegistrationCache {
    /// An empty cache over `pd`.
    pub fn new(pd: &Arc<ProtectionDomain>) -> Self {
        RegistrationCache {
            pd: pd.clone(),
            map: Mutex::new(HashMap::new()),
            registrations: AtomicU64::new(0),
        }
    }
    /// The region for `buf` with remote-write access, registering it on first use.
    ///
    /// # Errors
    /// As [`MemoryRegion::register`].
    pub fn get_or_register(&self, buf: &Arc<HostBuffer>) -> Result<Arc<MemoryRegion>> {
        let key = (buf.addr(), buf.len());
        let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(mr) = map.get(&key) {
            return Ok(mr.clone());
        }
        let mr = Arc::new(MemoryRegion::register(&self.pd, buf, Access::RemoteWrite)?);
        self.registrations.fetch_add(1, Ordering::Relaxed);
        map.insert(key, mr.clone());
        Ok(mr)
    }
    /// The region for caller memory `ptr..ptr+len` with remote-write access, registering it
    /// on first use (keyed by address and length).
    ///
    /// # Safety
    /// As [`MemoryRegion::register_raw`], for as long as the region stays cached: call
    /// [`RegistrationCache::evict_raw`] before the memory is freed or re-mapped.
    ///
    /// # Errors
    /// As [`MemoryRegion::register_raw`].
    pub unsafe fn get_or_register_raw(
        &self,
        ptr: *mut u8,
        len: usize,
    ) -> Result<Arc<MemoryRegion>> {
        let key = (ptr as u64, len);
        let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(mr) = map.get(&key) {
            return Ok(mr.clone());
        }
        // SAFETY: forwarded from this function's contract.
        let mr = Arc::new(unsafe {
            MemoryRegion::register_raw(&self.pd, ptr, len, Access::RemoteWrite)?
        });
        self.registrations.fetch_add(1, Ordering::Relaxed);
        map.insert(key, mr.clone());
        Ok(mr)
    }
    /// Drops the cached region of caller memory `ptr..ptr+len`; `true` if it was cached. The
    /// region is deregistered once no running load holds it.
    pub fn evict_raw(&self, ptr: *mut u8, len: usize) -> bool {
        self.map
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&(ptr as u64, len))
            .is_some()
    }
    /// Drops the cached region of `buf` (deregistered once no load uses it); `true` if cached.
    pub fn evict(&self, buf: &Arc<HostBuffer>) -> bool {
        self.map
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&(buf.addr(), buf.len()))
            .is_some()
    }
    /// How many `ibv_reg_mr` calls this cache has made (hits do not count).
    pub fn registrations(&self) -> u64 {
        self.registrations.load(Ordering::Relaxed)
    }
    /// Number of cached regions.
    pub fn len(&self) -> usize {
        self.map.lock().unwrap_or_else(|p| p.into_inner()).len()
    }
    /// `true` when nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
