//! Loads into GPU memory (feature `cuda`): a [`LoadHandle`] writing into pinned host staging,
//! and a copier thread that queues each layer's host-to-device copies on a CUDA stream as
//! soon as the layer is verified in host memory (`crate::cuda` is the driver shell it uses).
#![allow(unsafe_code)]

use super::{LayerStatus, LoadHandle};
use crate::cuda::{CopyDone, CopyStream, Device, LayerCopy};
use crate::error::{Error, LayerError, LayerResult};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

enum Slot {
    /// The layer has not landed in host memory yet.
    Waiting,
    /// Its copies are queued on the stream; done when they complete.
    Copying(CopyDone),
    /// On the device (or it had nothing to copy).
    Ready,
    /// A miss.
    Failed(LayerError),
}

struct SlotTable {
    slots: Mutex<Vec<Slot>>,
    cv: Condvar,
}

impl SlotTable {
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
    shared: Arc<SlotTable>,
    stream: Arc<CopyStream>,
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
    /// driver refuses a stream; [`Error::Io`] if the copier thread cannot start.
    pub unsafe fn start(
        device: &Device,
        handle: Arc<LoadHandle>,
        copies: Vec<Vec<LayerCopy>>,
    ) -> Result<Self, Error> {
        if copies.len() != handle.layers() {
            return Err(Error::InvalidArgument(format!(
                "CUDA: {} layer copy lists for a load of {} layers",
                copies.len(),
                handle.layers()
            )));
        }
        let stream = Arc::new(device.copy_stream()?);
        let shared = Arc::new(SlotTable {
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
    pub fn wait_layer_blocking(&self, l: usize, timeout: Option<Duration>) -> LayerResult<()> {
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
                Slot::Copying(done) => {
                    // Blocks in the driver until the copies are done (the event was recorded
                    // right after this layer's copies on the stream).
                    slots[l] = match done.wait() {
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
    if let Slot::Copying(done) = slot {
        match done.is_complete() {
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
fn copy_layers(h: &LoadHandle, sh: &SlotTable, stream: &CopyStream, copies: &[Vec<LayerCopy>]) {
    for (l, cs) in copies.iter().enumerate() {
        let next = match h.wait_layer_blocking(l, None) {
            Err(e) => Slot::Failed(e),
            Ok(()) if cs.is_empty() => Slot::Ready,
            // SAFETY: `DeviceLoad::start`'s contract: each `src..src+len` is staging memory
            // holding this layer's verified bytes (the layer is ready, so no write to it
            // follows), valid until the DeviceLoad is dropped, which synchronises the stream
            // first; each `dst..dst+len` is device memory of the stream's device.
            Ok(()) => match unsafe { stream.queue(cs) } {
                Ok(done) => Slot::Copying(done),
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
