//! CUDA driver shell (cargo feature `cuda`): devices, pinned host staging, and
//! host-to-device copies on a stream. The connector builds loads into GPU memory on it
//! (`connector::DeviceLoad`); nothing here knows about loads.
//!
//! A load always lands in host memory first: the transports (ranged GETs, TCP gather, RDMA)
//! write each slice into a [`PinnedStaging`] buffer (page-locked, so the copy engine reads
//! it by DMA), the connector verifies every slice's CRC32C there, and only then does
//! the connector's device load copy the layer to the device with `cuMemcpyHtoDAsync` on
//! its own [`CopyStream`]. Layer `l` is reported ready once its copy's CUDA event has completed, so a
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

use crate::{Error, Result};
use cudarc::driver::{result as cu, sys, CudaContext, CudaEvent, CudaStream, PinnedHostSlice};
use std::sync::{Arc, Mutex};

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
        // a load has written and verified them (the device load copies ready layers only).
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

    /// The buffer's first byte, for building the connector's `LayerBuffers` over it.
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

/// A CUDA stream of this device that queues host-to-device copies in order.
pub struct CopyStream {
    stream: Arc<CudaStream>,
}

impl std::fmt::Debug for CopyStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CopyStream")
            .field("ordinal", &self.stream.context().ordinal())
            .finish()
    }
}

impl Device {
    /// A new stream for copies into this device's memory.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if the driver refuses a stream.
    pub fn copy_stream(&self) -> Result<CopyStream> {
        let stream = self
            .ctx
            .new_stream()
            .map_err(|e| cuda_err("create stream", e))?;
        Ok(CopyStream { stream })
    }
}

impl CopyStream {
    /// Queues `copies` (`cuMemcpyHtoDAsync` each, in order) and returns the event that
    /// completes once all of them have.
    ///
    /// # Safety
    /// Every `src..src+len` is pinned host memory that holds the bytes to copy and stays
    /// valid and unwritten until the returned event has completed or [`CopyStream::synchronize`]
    /// has returned; every `dst..dst+len` is device memory of this stream's device that stays
    /// allocated until then.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the driver call that failed.
    pub unsafe fn queue(&self, copies: &[LayerCopy]) -> Result<CopyDone> {
        self.stream
            .context()
            .bind_to_thread()
            .map_err(|e| cuda_err("bind context", e))?;
        for c in copies {
            // SAFETY: this function's contract: `src..src+len` is valid host memory until
            // the copy has completed, `dst..dst+len` device memory of this context.
            unsafe {
                let src = std::slice::from_raw_parts(c.src as *const u8, c.len);
                cu::memcpy_htod_async(c.dst as sys::CUdeviceptr, src, self.stream.cu_stream())
            }
            .map_err(|e| cuda_err(&format!("cuMemcpyHtoDAsync of {} bytes", c.len), e))?;
        }
        let ev = self
            .stream
            .record_event(None)
            .map_err(|e| cuda_err("record event", e))?;
        Ok(CopyDone(ev))
    }

    /// Waits until every copy queued so far has completed.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] with the driver's error (a copy failed).
    pub fn synchronize(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(|e| cuda_err("synchronize stream", e))
    }
}

/// The completion of copies queued by [`CopyStream::queue`].
pub struct CopyDone(CudaEvent);

/// Copies to device memory that the CUDA driver reported failed ([`CopyDone`]): the layer
/// they carried is a miss.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{driver}")]
pub struct CopyFailed {
    /// The driver's error text.
    pub driver: String,
}

impl std::fmt::Debug for CopyDone {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CopyDone").finish_non_exhaustive()
    }
}

impl CopyDone {
    /// Whether the copies have completed, without blocking.
    ///
    /// # Errors
    /// [`CopyFailed`] with the driver's error text when a copy failed.
    pub fn is_complete(&self) -> std::result::Result<bool, CopyFailed> {
        self.0.try_is_complete().map_err(|e| CopyFailed {
            driver: e.to_string(),
        })
    }

    /// Blocks until the copies have completed.
    ///
    /// # Errors
    /// [`CopyFailed`] with the driver's error text when a copy failed.
    pub fn wait(&self) -> std::result::Result<(), CopyFailed> {
        self.0.synchronize().map_err(|e| CopyFailed {
            driver: e.to_string(),
        })
    }
}
