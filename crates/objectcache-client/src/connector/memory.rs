//! Registered memory: the areas an engine's loads may write into (for an inference engine,
//! its whole KV buffer, registered once), and loads whose destinations are ranges inside
//! them ([`Engine::load_registered`]). The C ABI's `objectcache_register_memory`,
//! `objectcache_deregister_memory`, `objectcache_load` and `objectcache_load_paged` are
//! these calls with their arguments converted.
//!
//! A load into registered memory checks that every range lies inside one registered area
//! and that no two ranges share a byte, and holds every area it writes into until it is
//! dropped (deregistering a held area is refused with [`Error::Busy`]). Ranges in device
//! memory (feature `cuda`) land in the area's pinned staging twin at the same offset, are
//! verified there, and are copied to the device layer by layer ([`super::DeviceLoad`]).
#![allow(unsafe_code)]

use super::{Engine, LayerBuffers, LayerStatus, LoadHandle, LoadRequest};
use crate::error::{Error, LayerResult};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

/// Where a registered area lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemoryKind {
    /// Host memory of this process.
    Host,
    /// Memory of a CUDA device (feature `cuda`; other builds refuse it with
    /// [`Error::Unsupported`]).
    Device {
        /// The device's CUDA ordinal.
        ordinal: i32,
    },
}

/// A registered area's id: unique in the process, never reused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RegionId(u64);

impl RegionId {
    /// The id as a number.
    pub fn get(self) -> u64 {
        self.0
    }
}

static NEXT_REGION: AtomicU64 = AtomicU64::new(1);

struct Region {
    id: RegionId,
    addr: usize,
    len: usize,
    /// Loads alive that write into this area.
    users: AtomicUsize,
    /// Device memory: the device and the pinned host staging that loads land in first.
    #[cfg(feature = "cuda")]
    device: Option<(crate::cuda::Device, crate::cuda::PinnedStaging)>,
}

impl Region {
    /// Where loads into this area land, as `(address, length)`: the area itself (host
    /// memory) or its pinned staging twin (device memory). The address is only handed to
    /// memory registration (RDMA), never dereferenced through this pointer.
    fn landing(&self) -> Result<(*mut u8, usize), Error> {
        #[cfg(feature = "cuda")]
        if let Some((_, staging)) = &self.device {
            return Ok((staging.as_mut_ptr()?, staging.len()));
        }
        Ok((std::ptr::without_provenance_mut(self.addr), self.len))
    }
}

/// An engine's registered areas.
#[derive(Default)]
pub(crate) struct Registry {
    regions: Mutex<Vec<Arc<Region>>>,
}

impl Registry {
    fn lock(&self) -> MutexGuard<'_, Vec<Arc<Region>>> {
        self.regions.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A load's hold on the areas it writes into: while it lives, deregistering them is
/// refused.
struct Lease(Vec<Arc<Region>>);

impl Lease {
    fn new(regions: Vec<Arc<Region>>) -> Lease {
        for r in &regions {
            r.users.fetch_add(1, Ordering::AcqRel);
        }
        Lease(regions)
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        for r in &self.0 {
            r.users.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// A load into registered memory ([`Engine::load_registered`]).
///
/// Its fields drop in the order that frees the memory: the device copies (dropping them
/// waits for every queued copy to finish reading the staging memory), then the load
/// (dropping the last handle stops every task of the load and waits until none can touch
/// the destinations), and last the hold on the areas.
pub struct RegisteredLoad {
    /// Copies of the layers whose destination is device memory (none: all host).
    #[cfg(feature = "cuda")]
    device: Option<super::DeviceLoad>,
    handle: Arc<LoadHandle>,
    _lease: Lease,
}

impl std::fmt::Debug for RegisteredLoad {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegisteredLoad")
            .field("layers", &self.handle.layers())
            .finish_non_exhaustive()
    }
}

impl RegisteredLoad {
    /// The load in host memory: chunk status, statistics, stall advice, cancel.
    pub fn handle(&self) -> &LoadHandle {
        &self.handle
    }

    /// Non-blocking status of layer `l` where the caller reads it: for a device
    /// destination, `Ready` once its bytes are on the device.
    ///
    /// # Panics
    /// If `l` is not below the load's layer count.
    pub fn poll_layer(&self, l: usize) -> LayerStatus {
        #[cfg(feature = "cuda")]
        if let Some(d) = &self.device {
            return d.poll_layer(l);
        }
        self.handle.poll_layer(l)
    }

    /// Waits until layer `l` is in place (on the device for a device destination), at most
    /// `timeout` (none: no limit).
    ///
    /// # Errors
    /// The layer's [`LayerError`](crate::LayerError);
    /// [`LayerError::Timeout`](crate::LayerError::Timeout) when `timeout` passes first (the
    /// load goes on).
    ///
    /// # Panics
    /// If `l` is not below the load's layer count.
    pub fn wait_layer_blocking(&self, l: usize, timeout: Option<Duration>) -> LayerResult<()> {
        #[cfg(feature = "cuda")]
        if let Some(d) = &self.device {
            return d.wait_layer_blocking(l, timeout);
        }
        self.handle.wait_layer_blocking(l, timeout)
    }
}

impl Engine {
    /// Registers `len` bytes at `addr` as memory that [`Engine::load_registered`] may write
    /// into, and returns its id. An inference engine registers its whole KV buffer once.
    /// Device memory (`MemoryKind::Device`, feature `cuda`) gets a pinned host staging twin
    /// of the same length.
    ///
    /// # Safety
    /// `addr..addr + len` is valid for writes (host memory of this process; or memory
    /// allocated on that CUDA device) from now until [`Engine::deregister_memory`] succeeds
    /// for it, or until the engine and every [`RegisteredLoad`] into it are dropped. While
    /// a load into it is alive, the caller neither reads nor writes the ranges that load
    /// names, except a layer's ranges once that layer is reported ready.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a NULL `addr`, a zero `len` or a range that overflows;
    /// device memory: [`Error::Unsupported`] in builds without `cuda` or where the device
    /// cannot be opened, [`Error::InvalidArgument`] when the range is not memory of that
    /// device or its staging cannot be pinned.
    pub unsafe fn register_memory(
        &self,
        addr: *mut u8,
        len: usize,
        kind: MemoryKind,
    ) -> Result<RegionId, Error> {
        if addr.is_null() {
            return Err(Error::InvalidArgument("addr is NULL".into()));
        }
        if len == 0 {
            return Err(Error::InvalidArgument("len is 0".into()));
        }
        if addr.addr().checked_add(len).is_none() || len > isize::MAX as usize {
            return Err(Error::InvalidArgument(format!(
                "addr {addr:p} + len {len} overflows"
            )));
        }
        #[cfg(not(feature = "cuda"))]
        if let MemoryKind::Device { ordinal } = kind {
            return Err(Error::Unsupported(format!(
                "device memory (device {ordinal}): this library was built without the cuda \
                 feature"
            )));
        }
        #[cfg(feature = "cuda")]
        let device = match kind {
            MemoryKind::Host => None,
            MemoryKind::Device { ordinal } => {
                let on = |x: Error| format!("device memory (device {ordinal}): {x}");
                let dev =
                    crate::cuda::Device::open(ordinal).map_err(|x| Error::Unsupported(on(x)))?;
                dev.check_device_range(addr.addr(), len)
                    .map_err(|x| Error::InvalidArgument(on(x)))?;
                let staging = dev
                    .staging(len)
                    .map_err(|x| Error::InvalidArgument(on(x)))?;
                Some((dev, staging))
            }
        };
        let id = RegionId(NEXT_REGION.fetch_add(1, Ordering::Relaxed));
        self.memory.lock().push(Arc::new(Region {
            id,
            addr: addr.addr(),
            len,
            users: AtomicUsize::new(0),
            #[cfg(feature = "cuda")]
            device,
        }));
        Ok(id)
    }

    /// Deregisters area `id`: loads can no longer write into it, and whatever the engine
    /// kept about it (an RDMA registration) is forgotten, so the caller may free it.
    ///
    /// # Errors
    /// [`Error::Busy`] while a [`RegisteredLoad`] writing into it is alive;
    /// [`Error::InvalidArgument`] when `id` is not registered with this engine.
    pub fn deregister_memory(&self, id: RegionId) -> Result<(), Error> {
        let r = {
            let mut regions = self.memory.lock();
            let Some(pos) = regions.iter().position(|r| r.id == id) else {
                return Err(Error::InvalidArgument(format!(
                    "region {} is not registered with this engine",
                    id.0
                )));
            };
            let users = regions[pos].users.load(Ordering::Acquire);
            if users > 0 {
                return Err(Error::Busy(format!(
                    "{users} unreleased transfer(s) write into this region"
                )));
            }
            regions.remove(pos)
        };
        // No registration of the memory (RDMA) may outlive the caller's promise.
        let (p, n) = r.landing()?;
        self.forget_memory(p, n);
        Ok(())
    }

    /// Number of areas registered with this engine.
    pub fn registered_regions(&self) -> usize {
        self.memory.lock().len()
    }

    /// Starts a load into registered memory: `ranges[l]` are layer `l`'s destination ranges
    /// `(address, length)`, taken in order as the layer's logical buffer (chunk `c`'s slice
    /// at offset `c x slice_bytes` of their concatenation; one range per layer for a
    /// contiguous destination, one per engine block for paged KV). Ranges in device memory
    /// land in their area's staging twin and are copied to the device layer by layer.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the range (`layer L range I`) when one overflows,
    /// lies outside every area registered with this engine, or shares a byte with another
    /// (as named, or as landed in staging), and when device ranges lie on two devices;
    /// [`Engine::load`]'s errors (the ranges' total per layer, the hints).
    pub fn load_registered(
        &self,
        req: LoadRequest,
        ranges: Vec<Vec<(*mut u8, usize)>>,
    ) -> Result<RegisteredLoad, Error> {
        let bad = |m: String| Error::InvalidArgument(m);
        let name = |l: usize, i: usize| format!("layer {l} range {i}");
        let regions = self.memory.lock().clone();
        // Where the bytes land (host memory: the range itself; device memory: its staging
        // twin).
        let mut raw: Vec<Vec<(*mut u8, usize)>> = Vec::with_capacity(ranges.len());
        let mut used: Vec<Arc<Region>> = Vec::new();
        // (address, length, (layer, index)) of every range as named, and as landed.
        let mut named = Vec::new();
        let mut landed = Vec::new();
        // Per layer: the host-to-device copies of device ranges (staging -> device).
        #[cfg(feature = "cuda")]
        let mut copies: Vec<Vec<crate::cuda::LayerCopy>> = Vec::with_capacity(ranges.len());
        #[cfg(feature = "cuda")]
        let mut load_device: Option<crate::cuda::Device> = None;
        for (l, rs) in ranges.iter().enumerate() {
            let mut layer_raw = Vec::with_capacity(rs.len());
            #[cfg(feature = "cuda")]
            let mut layer_copies = Vec::new();
            for (i, &(p, len)) in rs.iter().enumerate() {
                let a = p.addr();
                let end = a
                    .checked_add(len)
                    .ok_or_else(|| bad(format!("{} overflows", name(l, i))))?;
                let Some(r) = regions
                    .iter()
                    .find(|r| a >= r.addr && end <= r.addr + r.len)
                else {
                    return Err(bad(format!(
                        "{} ({a:#x}, {len} bytes) is not inside memory registered with this \
                         engine",
                        name(l, i)
                    )));
                };
                if !used.iter().any(|u| u.id == r.id) {
                    used.push(r.clone());
                }
                named.push((a, len, (l, i)));
                #[cfg(feature = "cuda")]
                if let Some((dev, staging)) = &r.device {
                    match &load_device {
                        Some(ld) if ld.ordinal() != dev.ordinal() => {
                            return Err(bad(format!(
                                "{} is on device {}, other destinations on device {}: one \
                                 load writes to one device",
                                name(l, i),
                                dev.ordinal(),
                                ld.ordinal()
                            )))
                        }
                        Some(_) => {}
                        None => load_device = Some(dev.clone()),
                    }
                    // The load lands in the staging bytes at the same offset as the device
                    // range.
                    let src = staging.as_mut_ptr()?.wrapping_add(a - r.addr);
                    layer_copies.push(crate::cuda::LayerCopy {
                        dst: a as u64,
                        src: src.addr(),
                        len,
                    });
                    landed.push((src.addr(), len, (l, i)));
                    layer_raw.push((src, len));
                    continue;
                }
                landed.push((a, len, (l, i)));
                layer_raw.push((p, len));
            }
            #[cfg(feature = "cuda")]
            copies.push(layer_copies);
            raw.push(layer_raw);
        }
        for set in [&mut named, &mut landed] {
            if let Some(((l1, i1), (l2, i2))) = super::first_overlap(set) {
                return Err(bad(format!(
                    "{} and {} overlap",
                    name(l1, i1),
                    name(l2, i2)
                )));
            }
        }
        // The memory areas the ranges land in: each used host area, or a device area's
        // staging twin. (Addresses only: RDMA registers them; nothing dereferences these.)
        let memory = used
            .iter()
            .map(|r| r.landing())
            .collect::<Result<Vec<_>, Error>>()?;
        // SAFETY: every range lies in memory the caller registered (and so promised valid
        // for writes, and untouched while a load into it is alive, until deregistered, which
        // is refused while this load's lease holds it) or in the staging twin of a
        // registered device range (owned by that area, which the lease keeps alive); no two
        // ranges share a byte (checked above, as named and as landed). Each range lies in one
        // of `memory` (found above), which stays mapped until the area is deregistered, and
        // deregistering forgets the memory (`forget_memory`) first.
        let bufs = unsafe { LayerBuffers::from_raw_ranges(&raw, &memory) };
        // Held from here; an error below drops it after the load it guards.
        let lease = Lease::new(used);
        let handle = Arc::new(self.load(req, bufs)?);
        #[cfg(feature = "cuda")]
        let device = match load_device {
            None => None,
            // SAFETY: every copy's source is the staging twin of a registered device range
            // (pinned, owned by an area this load's lease keeps, and written only by this
            // load); every destination is that device range, checked at registration;
            // `RegisteredLoad` drops the DeviceLoad (waiting for its copies) before the
            // lease.
            Some(dev) => match unsafe { super::DeviceLoad::start(&dev, handle.clone(), copies) } {
                Ok(d) => Some(d),
                Err(x) => {
                    handle.cancel();
                    // The load (its last reference) drops before the lease.
                    drop(handle);
                    drop(lease);
                    return Err(x);
                }
            },
        };
        Ok(RegisteredLoad {
            #[cfg(feature = "cuda")]
            device,
            handle,
            _lease: lease,
        })
    }
}
