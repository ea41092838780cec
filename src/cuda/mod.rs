//! CUDA destinations (cargo feature `cuda`): loads whose destination is GPU memory.
//!
//! A load always lands in host memory first: the transports (ranged GETs, TCP gather, RDMA)
//! write each slice into a [`PinnedStaging`] buffer (page-locked, so the copy engine reads
//! it by DMA), the connector verifies every slice's CRC32C there, and only then does
//! [`DeviceLoad`] copy the layer to the device with `cuMemcpyHtoDAsync` on its own CUDA
//! stream. Layer `l` is reported ready once its copy's CUDA event has completed, so a
//! caller that waits for layer `l` before running layer `l`'s attention sees exactly the
//! verified bytes, while layer `l + 1` is still arriving and layer `l`'s copy overlaps it.
//! This is the "per-layer copies from a pinned host buffer on a CUDA stream" path; GPUDirect
//! (NIC writing VRAM by dma-buf) needs a GPU, a RoCE NIC and `nvidia-peermem`/dma-buf
//! support, none of which this path assumes.
//!
//! The CUDA driver (`libcuda.so`) is looked for at run time (cudarc's dynamic loading), so
//! a build with this feature runs on machines without CUDA: [`Device::open`] then fails
//! with [`crate::Error::InvalidArgument`] naming what is missing, and nothing else changes.
//!
//! Cost, for sizing: one layer of a 4,096-token Llama-3.1-8B prefix (bf16) is
//! 4,096 x 2 x 8 x 128 x 2 bytes = 16 MiB; at a PCIe Gen5 x16 host-to-device rate of about
//! 50 GB/s (see `sched::model::GpuKind::h2d_bytes_per_s`) its copy takes about 0.34 ms.

#![allow(unsafe_code)]

pub use cudarc;

use crate::connector::{LayerStatus, LoadHandle};
use crate::{Error, LayerError, Result};
use cudarc::driver::{result as cu, sys, CudaContext, CudaEvent, CudaStream, PinnedHostSlice};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// One CUDA device (its primary context), opened for copies into its memory.
#[derive(Clone)]
pub struct Device {
    ctx: Arc<CudaContext>,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device")
            .field("ordinal", &self.ctx.ordinal())
            .finish()
    }
}

fn cuda_err(what: &str, e: impl std::fmt::Display) -> Error {
    Error::InvalidArgument(format!("CUDA: {what}: {e}"))
}

impl Device {
    /// Opens device `ordinal` (retaining its primary context).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the CUDA driver library cannot be loaded (no NVIDIA
    /// driver on this machine), when `ordinal` is negative or not below the device count,
    /// or when the driver refuses the context; the message says which.
    pub fn open(ordinal: i32) -> Result<Self> {
        // SAFETY: only probes whether libcuda can be dlopen'ed; no CUDA call is made.
        if !unsafe { sys::is_culib_present() } {
            return Err(Error::InvalidArgument(
                "CUDA: the driver library (libcuda.so) is not present on this machine".into(),
            ));
        }
        let n = CudaContext::device_count().map_err(|e| cuda_err("device count", e))?;
        if ordinal < 0 || ordinal >= n {
            return Err(Error::InvalidArgument(format!(
                "CUDA: device {ordinal} does not exist (this machine has {n})"
            )));
        }
        let ctx = CudaContext::new(ordinal as usize)
            .map_err(|e| cuda_err(&format!("device {ordinal} context"), e))?;
        Ok(Self { ctx })
    }

    /// The device's CUDA ordinal.
    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// The device's primary context (for callers that allocate or copy device memory with
    /// cudarc themselves, e.g. tests; re-exported as [`cudarc`]).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Checks that `addr..addr+len` is device memory of this device, inside one allocation.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming what is wrong: not a device pointer (host or
    /// unknown memory), another device's memory, or a range running past the allocation.
    pub fn check_device_range(&self, addr: usize, len: usize) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| cuda_err("bind context", e))?;
        let attr = |a: sys::CUpointer_attribute, out: *mut std::ffi::c_void| {
            // SAFETY: `out` points to a value of the size the attribute writes (u32 for the
            // memory type and ordinal, u64 for the start address and size); cuPointerGet-
            // Attribute only reads the pointer's metadata, never the memory behind it.
            unsafe { sys::cuPointerGetAttribute(out, a, addr as sys::CUdeviceptr) }.result()
        };
        let mut mem_type: u32 = 0;
        attr(
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
            (&mut mem_type as *mut u32).cast(),
        )
        .map_err(|e| cuda_err(&format!("{addr:#x} is not memory CUDA knows"), e))?;
        if mem_type != sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 {
            return Err(Error::InvalidArgument(format!(
                "CUDA: {addr:#x} is not device memory (memory type {mem_type})"
            )));
        }
        let mut ordinal: i32 = -1;
        attr(
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            (&mut ordinal as *mut i32).cast(),
        )
        .map_err(|e| cuda_err("device ordinal of pointer", e))?;
        if ordinal != self.ctx.ordinal() as i32 {
            return Err(Error::InvalidArgument(format!(
                "CUDA: {addr:#x} belongs to device {ordinal}, not device {}",
                self.ctx.ordinal()
            )));
        }
        let (mut start, mut size): (u64, u64) = (0, 0);
        attr(
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
            (&mut start as *mut u64).cast(),
        )
        .map_err(|e| cuda_err("allocation start", e))?;
        attr(
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
            (&mut size as *mut u64).cast(),
        )
        .map_err(|e| cuda_err("allocation size", e))?;
        let end = addr as u64 + len as u64;
        if end > start + size {
            return Err(Error::InvalidArgument(format!(
                "CUDA: {addr:#x} + {len} bytes runs past its allocation \
                 ({start:#x} + {size} bytes)"
            )));
        }
        Ok(())
    }

    /// Allocates a page-locked host staging buffer of `len` bytes for this device.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `len` is 0 or the driver cannot pin that much memory.
    pub fn staging(&self, len: usize) -> Result<PinnedStaging> {
        if len == 0 {
            return Err(Error::InvalidArgument("CUDA: staging length is 0".into()));
        }
        // SAFETY: the bytes start uninitialised; they are only read by the copy engine after
        // a load has written and verified them (DeviceLoad copies ready layers only).
        // Flags: portable (usable from every context), not write-combined, because the
        // connector reads every slice back to check its CRC32C.
        let buf = unsafe {
            self.ctx
                .alloc_pinned_with_flags::<u8>(len, sys::CU_MEMHOSTALLOC_PORTABLE)
        }
        .map_err(|e| cuda_err(&format!("pin {len} bytes of host memory"), e))?;
        Ok(PinnedStaging {
            buf: Mutex::new(buf),
            len,
        })
    }
}

/// A page-locked host buffer that loads land in before their copy to the device.
pub struct PinnedStaging {
    buf: Mutex<PinnedHostSlice<u8>>,
    len: usize,
}

impl std::fmt::Debug for PinnedStaging {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedStaging")
            .field("len", &self.len)
            .finish()
    }
}

impl PinnedStaging {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer is empty (never: [`Device::staging`] refuses 0 bytes).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The buffer's first byte, for building [`crate::connector::LayerBuffers`] over it.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if the driver reports the buffer unusable.
    pub fn as_mut_ptr(&self) -> Result<*mut u8> {
        let mut b = self.buf.lock().unwrap_or_else(|p| p.into_inner());
        b.as_mut_ptr().map_err(|e| cuda_err("staging pointer", e))
    }
}

/// One host-to-device copy of a layer: `len` bytes from host `src` to device `dst`.
#[derive(Debug, Clone, Copy)]
pub struct LayerCopy {
    /// Device address (a `CUdeviceptr`) of the destination.
    pub dst: u64,
    /// Host address of the source, inside a [`PinnedStaging`] buffer.
    pub src: usize,
    /// Bytes.
    pub len: usize,
}

enum Slot {
    /// The layer has not landed in host memory yet.
    Waiting,
    /// Its copy is queued on the stream; done when the event completes.
    Copying(CudaEvent),
    /// On the device (or it had nothing to copy).
    Ready,
    /// A miss.
    Failed(LayerError),
}

struct Shared {
    slots: Mutex<Vec<Slot>>,
    cv: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Vec<Slot>> {
        self.slots.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A load whose layers end in device memory: wraps a [`LoadHandle`] writing into pinned
/// staging, and copies each layer to the device as soon as it is ready in host memory.
///
/// Layer status follows [`LoadHandle`]'s: `Ready` only after the layer's bytes are on the
/// device; a layer that failed on the host side fails here with the same error; a failed
/// copy fails the layer with [`LayerError::Device`]. Dropping it cancels the load and waits
/// for every queued copy, so the staging buffers may be freed afterwards.
pub struct DeviceLoad {
    handle: Arc<LoadHandle>,
    shared: Arc<Shared>,
    stream: Arc<CudaStream>,
    copier: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for DeviceLoad {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceLoad")
            .field("layers", &self.handle.layers())
            .finish_non_exhaustive()
    }
}

impl DeviceLoad {
    /// Starts copying: `copies[l]` are layer `l`'s copies (empty for a layer whose
    /// destination is host memory).
    ///
    /// # Safety
    /// Every `src..src+len` lies in the staging memory `handle` writes layer `l` into and
    /// stays valid until this value is dropped; every `dst..dst+len` is device memory of
    /// `device` (see [`Device::check_device_range`]) that stays allocated, and is not used
    /// by the caller, until the layer is reported ready or this value is dropped.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if `copies` does not have one entry per layer or the
    /// driver refuses a stream.
    pub unsafe fn start(
        device: &Device,
        handle: Arc<LoadHandle>,
        copies: Vec<Vec<LayerCopy>>,
    ) -> Result<Self> {
        if copies.len() != handle.layers() {
            return Err(Error::InvalidArgument(format!(
                "CUDA: {} layer copy lists for a load of {} layers",
                copies.len(),
                handle.layers()
            )));
        }
        let stream = device
            .ctx
            .new_stream()
            .map_err(|e| cuda_err("create stream", e))?;
        let shared = Arc::new(Shared {
            slots: Mutex::new((0..copies.len()).map(|_| Slot::Waiting).collect()),
            cv: Condvar::new(),
        });
        let (h, sh, st) = (handle.clone(), shared.clone(), stream.clone());
        let copier = std::thread::Builder::new()
            .name("objectcache-cuda-copy".into())
            .spawn(move || copy_layers(&h, &sh, &st, &copies))
            .map_err(Error::Io)?;
        Ok(Self {
            handle,
            shared,
            stream,
            copier: Some(copier),
        })
    }

    /// Number of layers.
    pub fn layers(&self) -> usize {
        self.handle.layers()
    }

    /// The host-side load (chunk status, statistics, cancel).
    pub fn host(&self) -> &LoadHandle {
        &self.handle
    }

    /// Non-blocking status of layer `l`: `Ready` once its bytes are on the device.
    ///
    /// # Panics
    /// If `l >= layers()`.
    pub fn poll_layer(&self, l: usize) -> LayerStatus {
        let mut slots = self.shared.lock();
        settle(&mut slots[l], l)
    }

    /// Waits until layer `l` is on the device, at most `timeout` (none: no limit).
    ///
    /// # Errors
    /// The layer's [`LayerError`]; [`LayerError::Timeout`] when `timeout` passes first (the
    /// load goes on).
    ///
    /// # Panics
    /// If `l >= layers()`.
    pub fn wait_layer_blocking(
        &self,
        l: usize,
        timeout: Option<Duration>,
    ) -> Result<(), LayerError> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut slots = self.shared.lock();
        loop {
            match &slots[l] {
                Slot::Waiting => {
                    slots = match deadline {
                        None => self
                            .shared
                            .cv
                            .wait(slots)
                            .unwrap_or_else(|p| p.into_inner()),
                        Some(d) => {
                            let left = d.saturating_duration_since(Instant::now());
                            if left.is_zero() {
                                return Err(LayerError::Timeout { layer: l });
                            }
                            self.shared
                                .cv
                                .wait_timeout(slots, left)
                                .unwrap_or_else(|p| p.into_inner())
                                .0
                        }
                    };
                }
                Slot::Copying(ev) => {
                    // Blocks in the driver until the copy is done (the event was recorded
                    // right after this layer's copies on the stream).
                    let r = ev.synchronize();
                    slots[l] = match r {
                        Ok(()) => Slot::Ready,
                        Err(e) => Slot::Failed(LayerError::Device {
                            layer: l,
                            message: format!("copy to device: {e}"),
                        }),
                    };
                }
                Slot::Ready => return Ok(()),
                Slot::Failed(e) => return Err(e.clone()),
            }
        }
    }

    /// Cancels the load; layers not yet on the device fail with [`LayerError::Cancelled`].
    pub fn cancel(&self) {
        self.handle.cancel();
    }
}

/// Turns a finished copy into `Ready` (or `Failed`), without blocking.
fn settle(slot: &mut Slot, layer: usize) -> LayerStatus {
    if let Slot::Copying(ev) = slot {
        match ev.try_is_complete() {
            Ok(true) => *slot = Slot::Ready,
            Ok(false) => return LayerStatus::Pending,
            Err(e) => {
                *slot = Slot::Failed(LayerError::Device {
                    layer,
                    message: format!("copy to device: {e}"),
                })
            }
        }
    }
    match slot {
        Slot::Waiting | Slot::Copying(_) => LayerStatus::Pending,
        Slot::Ready => LayerStatus::Ready,
        Slot::Failed(e) => LayerStatus::Failed(e.clone()),
    }
}

/// The copier thread: layer by layer, in the order the model consumes them, waits for the
/// layer to be verified in host memory and queues its copies.
fn copy_layers(h: &LoadHandle, sh: &Shared, stream: &CudaStream, copies: &[Vec<LayerCopy>]) {
    for (l, cs) in copies.iter().enumerate() {
        let next = match h.wait_layer_blocking(l, None) {
            Err(e) => Slot::Failed(e),
            Ok(()) if cs.is_empty() => Slot::Ready,
            Ok(()) => match queue_copies(stream, cs) {
                Ok(ev) => Slot::Copying(ev),
                Err(e) => Slot::Failed(LayerError::Device {
                    layer: l,
                    message: e.to_string(),
                }),
            },
        };
        sh.lock()[l] = next;
        sh.cv.notify_all();
    }
}

fn queue_copies(stream: &CudaStream, cs: &[LayerCopy]) -> Result<CudaEvent> {
    stream
        .context()
        .bind_to_thread()
        .map_err(|e| cuda_err("bind context", e))?;
    for c in cs {
        // SAFETY: DeviceLoad::start's contract: `src..src+len` is staging memory holding this
        // layer's verified bytes, valid until the DeviceLoad is dropped (which synchronises
        // the stream first), and `dst..dst+len` is device memory of this context.
        unsafe {
            let src = std::slice::from_raw_parts(c.src as *const u8, c.len);
            cu::memcpy_htod_async(c.dst as sys::CUdeviceptr, src, stream.cu_stream())
        }
        .map_err(|e| cuda_err(&format!("cuMemcpyHtoDAsync of {} bytes", c.len), e))?;
    }
    stream
        .record_event(None)
        .map_err(|e| cuda_err("record event", e))
}

impl Drop for DeviceLoad {
    fn drop(&mut self) {
        // Stop the host-side load: the copier's waits then end (as misses) and it exits.
        self.handle.cancel();
        if let Some(t) = self.copier.take() {
            let _ = t.join();
        }
        // No queued copy may read staging memory after this value is gone.
        let _ = self.stream.synchronize();
    }
}
