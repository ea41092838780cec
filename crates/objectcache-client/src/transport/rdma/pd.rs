//! Protection domain: the scope in which memory regions and queue pairs may be combined.

use std::ptr::NonNull;
use std::sync::Arc;

use rdma_sys as ffi;

use super::context::Context;
use super::{RdmaError, Result};

/// An `ibv_pd`. Memory regions and queue pairs hold an `Arc` to it so it outlives them.
#[derive(Debug)]
pub struct ProtectionDomain {
    raw: NonNull<ffi::ibv_pd>,
    ctx: Arc<Context>,
}

// SAFETY: a PD is an immutable handle; verbs using it are thread-safe per libibverbs.
unsafe impl Send for ProtectionDomain {}
// SAFETY: as above.
unsafe impl Sync for ProtectionDomain {}

impl ProtectionDomain {
    /// Allocates a protection domain on `ctx`.
    ///
    /// # Errors
    /// [`RdmaError::Verbs`] when `ibv_alloc_pd` fails.
    pub fn new(ctx: &Arc<Context>) -> Result<Arc<Self>> {
        // SAFETY: `ctx` is an open context kept alive by the `Arc` stored below.
        let raw = unsafe { ffi::ibv_alloc_pd(ctx.as_ptr()) };
        let raw = NonNull::new(raw).ok_or_else(|| RdmaError::verbs("ibv_alloc_pd", 0))?;
        Ok(Arc::new(ProtectionDomain {
            raw,
            ctx: ctx.clone(),
        }))
    }
    pub(crate) fn as_ptr(&self) -> *mut ffi::ibv_pd {
        self.raw.as_ptr()
    }
    /// The device context.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }
}

impl Drop for ProtectionDomain {
    fn drop(&mut self) {
        // SAFETY: allocated by `ibv_alloc_pd`; MRs and QPs hold `Arc`s, so none remain.
        unsafe { ffi::ibv_dealloc_pd(self.raw.as_ptr()) };
    }
}
