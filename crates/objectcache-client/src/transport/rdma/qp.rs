//! RC queue pairs with a typestate bring-up: `QueuePair<Reset>` → `<Init>` → `<Rtr>` →
//! `<Rts>`. Only an `Rts` pair can post RDMA writes; receives may be posted from `Init` on
//! (they must be posted before the peer's first RDMA_WRITE_WITH_IMM arrives).

use std::marker::PhantomData;
use std::ptr::NonNull;
use std::sync::Arc;

use rdma_sys as ffi;

use super::context::mtu_enum;
use super::control::Endpoint;
use super::cq::CompletionQueue;
use super::mr::MemoryRegion;
use super::pd::ProtectionDomain;
use super::{RdmaError, Result};

/// Typestate: just created.
#[derive(Debug)]
pub struct Reset;
/// Typestate: INIT (port and access flags set; receives may be posted).
#[derive(Debug)]
pub struct Init;
/// Typestate: ready to receive (connected to the peer's QP number, PSN and GID).
#[derive(Debug)]
pub struct Rtr;
/// Typestate: ready to send.
#[derive(Debug)]
pub struct Rts;

/// Queue sizes of a QP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpCaps {
    /// Send queue depth (outstanding RDMA writes).
    pub max_send_wr: u32,
    /// Receive queue depth (outstanding receives, one consumed per RDMA_WRITE_WITH_IMM).
    pub max_recv_wr: u32,
}

impl Default for QpCaps {
    fn default() -> Self {
        QpCaps {
            max_send_wr: 128,
            max_recv_wr: 256,
        }
    }
}

/// An RC queue pair in state `S`. Dropping it destroys the QP.
#[derive(Debug)]
pub struct QueuePair<S> {
    raw: NonNull<ffi::ibv_qp>,
    pd: Arc<ProtectionDomain>,
    _send_cq: Arc<CompletionQueue>,
    _recv_cq: Arc<CompletionQueue>,
    qpn: u32,
    psn: u32,
    _state: PhantomData<S>,
}

// SAFETY: posting to and modifying a QP are thread-safe in libibverbs providers (the provider
// locks each work queue); the struct holds only handles.
unsafe impl<S> Send for QueuePair<S> {}
// SAFETY: as above.
unsafe impl<S> Sync for QueuePair<S> {}

impl<S> QueuePair<S> {
    /// This QP's number.
    pub fn qp_num(&self) -> u32 {
        self.qpn
    }
    /// This side's endpoint (QP number, starting PSN, GID, LID, MTU) for the peer.
    pub fn endpoint(&self) -> Endpoint {
        let ctx = self.pd.context();
        Endpoint {
            qpn: self.qpn,
            psn: self.psn,
            gid: ctx.gid(),
            lid: ctx.lid(),
            mtu: ctx.active_mtu(),
        }
    }
    fn modify(
        &self,
        attr: &mut ffi::ibv_qp_attr,
        mask: ffi::ibv_qp_attr_mask,
        op: &'static str,
    ) -> Result<()> {
        // SAFETY: the QP is live; `attr` is a fully initialised attribute struct whose fields
        // named by `mask` are set by the caller.
        let rc = unsafe { ffi::ibv_modify_qp(self.raw.as_ptr(), attr, mask.0 as i32) };
        if rc != 0 {
            return Err(RdmaError::verbs(op, rc));
        }
        Ok(())
    }
    fn into_state<T>(self) -> QueuePair<T> {
        let me = std::mem::ManuallyDrop::new(self);
        // SAFETY: `me` is never dropped, so each field is moved out exactly once.
        unsafe {
            QueuePair {
                raw: me.raw,
                pd: std::ptr::read(&me.pd),
                _send_cq: std::ptr::read(&me._send_cq),
                _recv_cq: std::ptr::read(&me._recv_cq),
                qpn: me.qpn,
                psn: me.psn,
                _state: PhantomData,
            }
        }
    }
    /// Moves the QP to the ERROR state: outstanding and future work requests complete with
    /// a flush error and incoming writes are dropped. Used for teardown and on failure.
    ///
    /// # Errors
    /// [`RdmaError::Verbs`] when the transition is refused.
    pub fn set_error(&self) -> Result<()> {
        // SAFETY: zeroed is a valid `ibv_qp_attr`; only `qp_state` is read for this mask.
        let mut a: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ffi::ibv_qp_state::IBV_QPS_ERR;
        self.modify(
            &mut a,
            ffi::ibv_qp_attr_mask::IBV_QP_STATE,
            "ibv_modify_qp(ERR)",
        )
    }
    /// Posts one receive without scatter entries (what RDMA_WRITE_WITH_IMM consumes).
    ///
    /// # Errors
    /// [`RdmaError::Verbs`] when the receive queue is full or the QP is in error.
    fn post_recv_inner(&self, wr_id: u64) -> Result<()> {
        // SAFETY: zeroed is a valid `ibv_recv_wr` (null `next`, no SGEs).
        let mut wr: ffi::ibv_recv_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        let mut bad: *mut ffi::ibv_recv_wr = std::ptr::null_mut();
        // SAFETY: the QP is live; `wr` is a single well-formed WR with no memory attached, so
        // the NIC touches no local buffer for it.
        let rc = unsafe { ffi::ibv_post_recv(self.raw.as_ptr(), &mut wr, &mut bad) };
        if rc != 0 {
            return Err(RdmaError::verbs("ibv_post_recv", rc));
        }
        Ok(())
    }
}

impl QueuePair<Reset> {
    /// Creates an RC QP in `pd` with its send and receive completions on the given CQs.
    ///
    /// # Errors
    /// [`RdmaError::Verbs`] when `ibv_create_qp` fails (e.g. caps above device limits).
    pub fn create(
        pd: &Arc<ProtectionDomain>,
        send_cq: &Arc<CompletionQueue>,
        recv_cq: &Arc<CompletionQueue>,
        caps: QpCaps,
    ) -> Result<Self> {
        // SAFETY: zeroed is a valid `ibv_qp_init_attr` (null pointers, zero caps).
        let mut init: ffi::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        init.send_cq = send_cq.as_ptr();
        init.recv_cq = recv_cq.as_ptr();
        init.cap.max_send_wr = caps.max_send_wr;
        init.cap.max_recv_wr = caps.max_recv_wr;
        init.cap.max_send_sge = 1;
        init.cap.max_recv_sge = 1;
        init.qp_type = ffi::ibv_qp_type::IBV_QPT_RC;
        init.sq_sig_all = 0;
        // SAFETY: `pd` and both CQs are live and kept alive by the `Arc`s stored in the result.
        let raw = unsafe { ffi::ibv_create_qp(pd.as_ptr(), &mut init) };
        let raw = NonNull::new(raw).ok_or_else(|| RdmaError::verbs("ibv_create_qp", 0))?;
        // SAFETY: `raw` is the QP just created; `qp_num` is a plain field.
        let qpn = unsafe { (*raw.as_ptr()).qp_num };
        // A random 24-bit starting PSN, as the IB spec recommends, from the std hasher's seed.
        let psn = {
            use std::hash::{BuildHasher, Hasher};
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_u32(qpn);
            (h.finish() as u32) & 0x00ff_ffff
        };
        Ok(QueuePair {
            raw,
            pd: pd.clone(),
            _send_cq: send_cq.clone(),
            _recv_cq: recv_cq.clone(),
            qpn,
            psn,
            _state: PhantomData,
        })
    }

    /// RESET → INIT on the context's port, allowing remote writes into this side's regions.
    ///
    /// # Errors
    /// [`RdmaError::Verbs`] when the transition is refused.
    pub fn to_init(self) -> Result<QueuePair<Init>> {
        // SAFETY: zeroed is a valid `ibv_qp_attr`; the fields named in the mask are set below.
        let mut a: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ffi::ibv_qp_state::IBV_QPS_INIT;
        a.pkey_index = 0;
        a.port_num = self.pd.context().port();
        a.qp_access_flags = (ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE
            | ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE)
            .0;
        use ffi::ibv_qp_attr_mask as M;
        self.modify(
            &mut a,
            M::IBV_QP_STATE | M::IBV_QP_PKEY_INDEX | M::IBV_QP_PORT | M::IBV_QP_ACCESS_FLAGS,
            "ibv_modify_qp(INIT)",
        )?;
        Ok(self.into_state())
    }
}

impl QueuePair<Init> {
    /// Posts one receive (see [`QueuePair::<Rts>::post_recv`]); allowed from INIT on.
    ///
    /// # Errors
    /// [`RdmaError::Verbs`] when the receive queue is full.
    pub fn post_recv(&self, wr_id: u64) -> Result<()> {
        self.post_recv_inner(wr_id)
    }

    /// INIT → RTR: connects to the peer's QP number and PSN over RoCE/IB addressing (GRH with
    /// the peer's GID; path MTU = the smaller of both ports' active MTUs).
    ///
    /// # Errors
    /// [`RdmaError::Verbs`] when the transition is refused (bad GID index, unreachable GID).
    pub fn to_rtr(self, remote: &Endpoint) -> Result<QueuePair<Rtr>> {
        let ctx = self.pd.context().clone();
        // SAFETY: zeroed is a valid `ibv_qp_attr`; the fields named in the mask are set below.
        let mut a: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ffi::ibv_qp_state::IBV_QPS_RTR;
        a.path_mtu = mtu_enum(ctx.active_mtu().min(remote.mtu));
        a.dest_qp_num = remote.qpn;
        a.rq_psn = remote.psn;
        a.max_dest_rd_atomic = 1;
        a.min_rnr_timer = 12; // 0.64 ms before the sender retries a receiver-not-ready NAK
        a.ah_attr.is_global = 1;
        a.ah_attr.dlid = remote.lid;
        a.ah_attr.sl = 0;
        a.ah_attr.src_path_bits = 0;
        a.ah_attr.port_num = ctx.port();
        a.ah_attr.grh.dgid.raw = remote.gid;
        a.ah_attr.grh.sgid_index = ctx.gid_index();
        a.ah_attr.grh.hop_limit = 64;
        a.ah_attr.grh.traffic_class = 0;
        a.ah_attr.grh.flow_label = 0;
        use ffi::ibv_qp_attr_mask as M;
        let mask = M::IBV_QP_STATE
            | M::IBV_QP_AV
            | M::IBV_QP_PATH_MTU
            | M::IBV_QP_DEST_QPN
            | M::IBV_QP_RQ_PSN
            | M::IBV_QP_MAX_DEST_RD_ATOMIC
            | M::IBV_QP_MIN_RNR_TIMER;
        self.modify(&mut a, mask, "ibv_modify_qp(RTR)")?;
        Ok(self.into_state())
    }
}

impl QueuePair<Rtr> {
    /// RTR → RTS with retry settings: local ACK timeout 4.096 µs × 2^14 ≈ 67 ms, 7 transport
    /// retries (so a dead peer surfaces as a "retry exceeded" completion in about half a
    /// second), unlimited receiver-not-ready retries.
    ///
    /// # Errors
    /// [`RdmaError::Verbs`] when the transition is refused.
    pub fn to_rts(self) -> Result<QueuePair<Rts>> {
        // SAFETY: zeroed is a valid `ibv_qp_attr`; the fields named in the mask are set below.
        let mut a: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ffi::ibv_qp_state::IBV_QPS_RTS;
        a.timeout = 14;
        a.retry_cnt = 7;
        a.rnr_retry = 7;
        a.sq_psn = self.psn;
        a.max_rd_atomic = 1;
        use ffi::ibv_qp_attr_mask as M;
        let mask = M::IBV_QP_STATE
            | M::IBV_QP_TIMEOUT
            | M::IBV_QP_RETRY_CNT
            | M::IBV_QP_RNR_RETRY
            | M::IBV_QP_SQ_PSN
            | M::IBV_QP_MAX_QP_RD_ATOMIC;
        self.modify(&mut a, mask, "ibv_modify_qp(RTS)")?;
        Ok(self.into_state())
    }
}

impl QueuePair<Rts> {
    /// Posts one receive without scatter entries; each incoming RDMA_WRITE_WITH_IMM consumes
    /// one and produces a receive completion carrying the immediate.
    ///
    /// # Errors
    /// [`RdmaError::Verbs`] when the receive queue is full or the QP is in error.
    pub fn post_recv(&self, wr_id: u64) -> Result<()> {
        self.post_recv_inner(wr_id)
    }

    /// Posts a signalled RDMA_WRITE_WITH_IMM (or a plain RDMA_WRITE when `imm` is `None`) of
    /// `len` bytes from `local` at `local_off` to `remote_addr` under `rkey`.
    ///
    /// # Safety
    /// The NIC reads `local[local_off..local_off + len]` after this returns, outside the
    /// compiler's view. Until the completion with `wr_id` is polled, or the QP has moved to the
    /// error state and its work requests are flushed, nothing may write that range and
    /// `local` (the region and its memory) must stay alive: otherwise the peer receives bytes
    /// from a later write, or from freed memory. Unsignalled writes complete with the next
    /// signalled one on this QP. (The staging arena holds each slot off its free list until
    /// then.)
    ///
    /// # Errors
    /// [`RdmaError::InvalidArgument`] when the local range is outside the region or `len`
    /// exceeds 2^31; [`RdmaError::Verbs`] when the send queue is full or the QP is in error.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn post_write(
        &self,
        wr_id: u64,
        local: &MemoryRegion,
        local_off: usize,
        len: usize,
        remote_addr: u64,
        rkey: u32,
        imm: Option<u32>,
        signaled: bool,
    ) -> Result<()> {
        if local_off.checked_add(len).is_none_or(|e| e > local.len()) || len > (1 << 31) {
            return Err(RdmaError::InvalidArgument(format!(
                "write of {len} bytes at {local_off} is outside a region of {} bytes",
                local.len()
            )));
        }
        let mut sge = ffi::ibv_sge {
            addr: local.addr() + local_off as u64,
            length: len as u32,
            lkey: local.lkey(),
        };
        // SAFETY: zeroed is a valid `ibv_send_wr` (null `next`, no SGEs, opcode 0).
        let mut wr: ffi::ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        match imm {
            Some(v) => {
                wr.opcode = ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM;
                wr.imm_data_invalidated_rkey_union.imm_data = v.to_be();
            }
            None => wr.opcode = ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE,
        }
        wr.send_flags = if signaled {
            ffi::ibv_send_flags::IBV_SEND_SIGNALED.0
        } else {
            0
        };
        wr.wr.rdma = ffi::rdma_t { remote_addr, rkey };
        let mut bad: *mut ffi::ibv_send_wr = std::ptr::null_mut();
        // SAFETY: the QP is live; `wr` and `sge` are valid for the call (the provider copies
        // them into the send queue before returning); the SGE lies inside `local` (checked
        // above), a region registered in this QP's PD, so the NIC reads only registered memory.
        let rc = unsafe { ffi::ibv_post_send(self.raw.as_ptr(), &mut wr, &mut bad) };
        if rc != 0 {
            return Err(RdmaError::verbs("ibv_post_send", rc));
        }
        Ok(())
    }
}

impl<S> Drop for QueuePair<S> {
    fn drop(&mut self) {
        // SAFETY: created by `ibv_create_qp` and destroyed exactly once (`into_state` moves
        // ownership without dropping).
        unsafe { ffi::ibv_destroy_qp(self.raw.as_ptr()) };
    }
}
