//! Completion queue: where the NIC reports finished work requests.

use std::ffi::CStr;
use std::mem::MaybeUninit;
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::Duration;

use rdma_sys as ffi;

use super::context::Context;
use super::{RdmaError, Result};

/// One work completion, copied out of the CQ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    /// The `wr_id` of the work request (chosen by the poster).
    pub wr_id: u64,
    /// `ibv_wc_status` (0 = success).
    pub status: u32,
    /// `ibv_wc_opcode`.
    pub opcode: u32,
    /// Bytes transferred (for a received RDMA_WRITE_WITH_IMM: the write's length).
    pub byte_len: u32,
    /// The immediate value in host order, when the completion carries one.
    pub imm: Option<u32>,
    /// Local QP number the completion belongs to.
    pub qp_num: u32,
}

impl Completion {
    /// `true` when the work request succeeded.
    pub fn is_ok(&self) -> bool {
        self.status == ffi::ibv_wc_status::IBV_WC_SUCCESS
    }
    /// `true` for a receive completion of an RDMA_WRITE_WITH_IMM.
    pub fn is_recv_write_imm(&self) -> bool {
        self.opcode == ffi::ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM
    }
    /// The status as text (`ibv_wc_status_str`), e.g. "transport retry counter exceeded".
    pub fn status_str(&self) -> String {
        // SAFETY: `ibv_wc_status_str` returns a static NUL-terminated string for any value.
        unsafe { CStr::from_ptr(ffi::ibv_wc_status_str(self.status)) }
            .to_string_lossy()
            .into_owned()
    }
}

/// An `ibv_cq` of fixed depth, polled (never armed for events: callers poll with back-off).
#[derive(Debug)]
pub struct CompletionQueue {
    raw: NonNull<ffi::ibv_cq>,
    _ctx: Arc<Context>,
    depth: u32,
}

// SAFETY: `ibv_poll_cq` is thread-safe in libibverbs providers (they lock the CQ).
unsafe impl Send for CompletionQueue {}
// SAFETY: as above.
unsafe impl Sync for CompletionQueue {}

/// Completions read per `ibv_poll_cq` call.
const POLL_BATCH: usize = 32;

impl CompletionQueue {
    /// Creates a CQ holding at least `depth` completions.
    ///
    /// # Errors
    /// [`RdmaError::Verbs`] when `ibv_create_cq` fails (e.g. `depth` above the device limit).
    pub fn new(ctx: &Arc<Context>, depth: u32) -> Result<Arc<Self>> {
        // SAFETY: `ctx` is open; no completion channel, no user context.
        let raw = unsafe {
            ffi::ibv_create_cq(
                ctx.as_ptr(),
                depth as i32,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                0,
            )
        };
        let raw = NonNull::new(raw).ok_or_else(|| RdmaError::verbs("ibv_create_cq", 0))?;
        Ok(Arc::new(CompletionQueue {
            raw,
            _ctx: ctx.clone(),
            depth,
        }))
    }
    pub(crate) fn as_ptr(&self) -> *mut ffi::ibv_cq {
        self.raw.as_ptr()
    }
    /// Depth asked for at creation.
    pub fn depth(&self) -> u32 {
        self.depth
    }
    /// Appends up to 32 ready completions to `out`; returns how many were appended.
    ///
    /// # Errors
    /// [`RdmaError::Verbs`] when `ibv_poll_cq` fails (the CQ is broken).
    pub fn poll(&self, out: &mut Vec<Completion>) -> Result<usize> {
        let mut wc: [MaybeUninit<ffi::ibv_wc>; POLL_BATCH] =
            [const { MaybeUninit::uninit() }; POLL_BATCH];
        // SAFETY: the CQ is live; `wc` has room for `POLL_BATCH` entries and the provider
        // initialises the first `n` it returns.
        let n = unsafe {
            ffi::ibv_poll_cq(self.raw.as_ptr(), POLL_BATCH as i32, wc.as_mut_ptr().cast())
        };
        if n < 0 {
            return Err(RdmaError::verbs("ibv_poll_cq", -n));
        }
        for w in wc.iter().take(n as usize) {
            // SAFETY: the first `n` entries were written by `ibv_poll_cq`.
            let w = unsafe { w.assume_init_ref() };
            let with_imm = w.wc_flags & ffi::ibv_wc_flags::IBV_WC_WITH_IMM.0 != 0;
            let imm = if with_imm && w.status == ffi::ibv_wc_status::IBV_WC_SUCCESS {
                // SAFETY: with IBV_WC_WITH_IMM set the union holds the immediate (big-endian).
                Some(u32::from_be(unsafe {
                    w.imm_data_invalidated_rkey_union.imm_data
                }))
            } else {
                None
            };
            out.push(Completion {
                wr_id: w.wr_id,
                status: w.status,
                opcode: w.opcode,
                byte_len: w.byte_len,
                imm,
                qp_num: w.qp_num,
            });
        }
        Ok(n as usize)
    }
}

impl Drop for CompletionQueue {
    fn drop(&mut self) {
        // SAFETY: created by `ibv_create_cq`; every QP using it holds an `Arc`, so none remain.
        unsafe { ffi::ibv_destroy_cq(self.raw.as_ptr()) };
    }
}

/// Idle back-off for CQ polling: a few yields, then sleeps growing to 1 ms (polling must not
/// starve a software RDMA device of CPU).
pub(crate) fn backoff(idle: &mut u32) {
    *idle += 1;
    if *idle < 16 {
        std::thread::yield_now();
    } else {
        std::thread::sleep(Duration::from_micros(u64::from((*idle - 15).min(20)) * 50));
    }
}
