//! Where one stripe of a striped gather load lands ([`Stripe`], a [`LayerSink`] over the
//! load's state): offsets and chunk numbers shifted, what it delivered kept for failing over
//! to another gateway, and the [`Lockstep`] that keeps the stripes layer-major.

use crate::connector::load::LoadShared;
use crate::error::{LayerError, LayerResult};
use crate::transport::LayerSink;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

/// Where one stripe of a striped load lands: the stripe's request covers the load's chunks
/// `base..`, so its byte offsets move by `shift` = `base x slice_bytes` within every layer
/// and the chunk indices its errors name move by `base`. Layers become ready in the load's
/// state once every stripe's bytes of them are written and verified.
///
/// A stripe also keeps what it delivered, so that when its gateway fails in the middle of
/// the load the rest can come from another one ([`Stripe::rewind`], [`Stripe::resume_from`]):
/// a unit that was being received is given back to the load state, and units already
/// delivered that the next gateway sends again are dropped, not written twice.
pub(super) struct Stripe {
    pub(super) sh: Arc<LoadShared>,
    base: usize,
    shift: u64,
    /// Bytes of one full slice.
    slice: u64,
    /// The stripes' progress, and this stripe's place in it.
    step: Arc<Lockstep>,
    index: usize,
    /// Failover bookkeeping (a stripe's units arrive one after another, on one task).
    pub(super) track: Mutex<Track>,
}

/// What a stripe delivered, and the unit it is receiving.
#[derive(Default)]
pub(super) struct Track {
    /// Per layer: byte ranges of the load (offsets in the whole layer) this stripe wrote and
    /// verified; disjoint (the load state refuses overlaps).
    done: Vec<Vec<(u64, u64)>>,
    /// The unit being received.
    cur: Option<Cur>,
    /// Layers the transport reported broken (the connection failed before they were
    /// complete), with the error to fail them with if no other gateway can serve them.
    pub(super) held: Vec<(u32, LayerError)>,
}

/// A unit being received: the byte ranges of the load state it reserved.
struct Cur {
    layer: u32,
    /// Lent in place: `(offset, len)`, and whether it was filled (counted as written).
    lent: Option<(u64, u64, bool)>,
    /// Written piece by piece (`write`): the ranges written, skipping bytes already
    /// delivered by an earlier gateway.
    pieces: Vec<(u64, u64)>,
}

impl Track {
    fn done(&mut self, layer: u32) -> &mut Vec<(u64, u64)> {
        let l = layer as usize;
        if self.done.len() <= l {
            self.done.resize_with(l + 1, Vec::new);
        }
        &mut self.done[l]
    }

    /// Whether any byte of `a..b` of `layer` was delivered already.
    fn overlaps(&self, layer: u32, a: u64, b: u64) -> bool {
        self.done
            .get(layer as usize)
            .is_some_and(|d| d.iter().any(|&(o, n)| o < b && a < o + n))
    }

    /// Bytes of `a..b` of `layer` delivered already.
    fn covered(&self, layer: u32, a: u64, b: u64) -> u64 {
        self.done.get(layer as usize).map_or(0, |d| {
            d.iter()
                .map(|&(o, n)| (o + n).min(b).saturating_sub(o.max(a)))
                .sum()
        })
    }

    /// The parts of `a..b` of `layer` not delivered yet, in order.
    fn gaps(&self, layer: u32, a: u64, b: u64) -> Vec<(u64, u64)> {
        let mut have: Vec<(u64, u64)> = self
            .done
            .get(layer as usize)
            .map(|d| {
                d.iter()
                    .copied()
                    .filter(|&(o, n)| o < b && a < o + n)
                    .collect()
            })
            .unwrap_or_default();
        have.sort_unstable();
        let mut out = Vec::new();
        let mut at = a;
        for (o, n) in have {
            if o > at {
                out.push((at, o - at));
            }
            at = at.max(o + n);
        }
        if at < b {
            out.push((at, b - at));
        }
        out
    }
}

impl Stripe {
    /// Lends the destination of `len` bytes at the stripe's `offset` of `layer` through
    /// `get` (given the load's absolute offset), unless the range overlaps bytes this stripe
    /// already delivered before a failover (then the unit is received piece by piece and
    /// filtered: `Ok(None)`); what is lent becomes the current unit.
    fn lend<T>(
        &self,
        layer: u32,
        offset: u64,
        len: u64,
        get: impl FnOnce(u64) -> LayerResult<Option<T>>,
    ) -> LayerResult<Option<T>> {
        let abs = offset + self.shift;
        let mut t = self.track.lock().expect("lock");
        if t.overlaps(layer, abs, abs + len) {
            self.begin_filtered(&mut t, layer);
            return Ok(None);
        }
        let d = get(abs)?;
        if d.is_some() {
            t.cur = Some(Cur {
                layer,
                lent: Some((abs, len, false)),
                pieces: Vec::new(),
            });
        }
        Ok(d)
    }
    pub(super) fn new(
        sh: Arc<LoadShared>,
        base: usize,
        shift: u64,
        slice: u64,
        step: Arc<Lockstep>,
        index: usize,
    ) -> Self {
        Stripe {
            sh,
            base,
            shift,
            slice,
            step,
            index,
            track: Mutex::new(Track::default()),
        }
    }

    /// Gives the unit that was being received back to the load state (its bytes were not
    /// verified) and forgets the layers reported broken, before the rest of the stripe is
    /// asked of another gateway. Takes `&mut self`: the transport that borrowed the stripe
    /// (and any slice it lent) has returned.
    pub(super) fn rewind(&mut self) {
        let t = self.track.get_mut().expect("lock");
        t.held.clear();
        if let Some(c) = t.cur.take() {
            if let Some((o, n, filled)) = c.lent {
                self.sh.state.release(c.layer, o, n, filled);
            }
            for (o, n) in c.pieces {
                self.sh.state.release(c.layer, o, n, true);
            }
        }
    }

    /// The first layer of `layers` that this stripe (bytes `lo..hi` of every layer) has not
    /// delivered in full and that is not a miss already; `None` when there is none.
    pub(super) fn resume_from(
        &self,
        layers: std::ops::Range<u32>,
        lo: u64,
        hi: u64,
    ) -> Option<u32> {
        let t = self.track.lock().expect("lock");
        layers.into_iter().find(|&l| {
            t.covered(l, lo, hi) < hi - lo
                && !matches!(
                    self.sh.state.status(l as usize),
                    crate::connector::buffers::LayerStatus::Failed(_)
                )
        })
    }

    /// Fails the layers the transport reported broken (no other gateway could serve them).
    pub(super) fn fail_held(&mut self) {
        let held = std::mem::take(&mut self.track.get_mut().expect("lock").held);
        for (l, e) in held {
            self.sh.state.fail(l, e);
        }
    }

    /// The unit starting at `abs` of `layer` overlaps bytes delivered already (a gateway
    /// after a failover resends part of a layer): receive it piece by piece, keeping only
    /// the new bytes.
    fn begin_filtered(&self, t: &mut Track, layer: u32) {
        t.cur = Some(Cur {
            layer,
            lent: None,
            pieces: Vec::new(),
        });
    }
}

/// Where each stripe of a striped load is: `at[s]` = the layer stripe `s` receives (every
/// layer before it complete), `u32::MAX` once it ended. Independent TCP streams would drift
/// apart (one racing through later layers on the cores the others need for layer 0, which
/// gates the first layer ready); a stripe may begin layer `first + r` only when every stripe
/// has reached `first + need(r)`: `need(0) = 0`, `need(1) = 1` (nobody starts the second
/// layer before all finished the first: time to first layer), `need(r) = r - 1` after
/// (at most one layer ahead of the slowest). The slowest stripe never waits, so the
/// stripes cannot deadlock; an ended or aborted stripe counts as infinitely far.
pub(super) struct Lockstep {
    first: u32,
    at: Vec<std::sync::atomic::AtomicU32>,
    moved: tokio::sync::Notify,
}

impl Lockstep {
    pub(super) fn new(stripes: usize, first: u32) -> Self {
        Lockstep {
            first,
            at: (0..stripes)
                .map(|_| std::sync::atomic::AtomicU32::new(first))
                .collect(),
            moved: tokio::sync::Notify::new(),
        }
    }

    fn set(&self, s: usize, layer: u32) {
        self.at[s].store(layer, Ordering::Release);
        self.moved.notify_waiters();
    }

    /// Whether a stripe may begin `layer`.
    fn may_begin(&self, layer: u32) -> bool {
        let r = layer.saturating_sub(self.first);
        let need = self.first + if r <= 1 { r } else { r - 1 };
        self.at.iter().all(|a| a.load(Ordering::Acquire) >= need)
    }
}

impl Drop for Stripe {
    fn drop(&mut self) {
        // Ended, failed or aborted: hold nobody back.
        self.step.set(self.index, u32::MAX);
    }
}

/// `e` with its chunk index (relative to a stripe starting at chunk `base`) made relative
/// to the whole load.
fn shift_chunk(e: LayerError, base: usize) -> LayerError {
    match e {
        LayerError::Missing { chunk, key } => LayerError::Missing {
            chunk: chunk + base,
            key,
        },
        LayerError::ChecksumMismatch {
            chunk,
            layer,
            stored,
            computed,
        } => LayerError::ChecksumMismatch {
            chunk: chunk + base,
            layer,
            stored,
            computed,
        },
        LayerError::GeometryMismatch { chunk, reason } => LayerError::GeometryMismatch {
            chunk: chunk + base,
            reason,
        },
        LayerError::Storage { chunk, message } => LayerError::Storage {
            chunk: chunk + base,
            message,
        },
        other => other,
    }
}

impl LayerSink for Stripe {
    fn write(&self, layer: u32, offset: u64, data: &[u8]) -> LayerResult<()> {
        let abs = offset + self.shift;
        let mut t = self.track.lock().expect("lock");
        if t.cur
            .as_ref()
            .is_none_or(|c| c.layer != layer || c.lent.is_some())
        {
            self.begin_filtered(&mut t, layer);
        }
        let end = abs + data.len() as u64;
        for (o, n) in t.gaps(layer, abs, end) {
            let from = (o - abs) as usize;
            self.sh
                .state
                .write(layer, o, &data[from..from + n as usize])?;
            t.cur.as_mut().expect("a unit").pieces.push((o, n));
        }
        Ok(())
    }
    fn placed(&self, layer: u32, offset: u64, len: u64) -> LayerResult<()> {
        self.sh.state.placed(layer, offset + self.shift, len)
    }
    fn dest_mut(&self, layer: u32, offset: u64, len: u64) -> LayerResult<Option<&mut [u8]>> {
        self.lend(layer, offset, len, |abs| {
            self.sh.state.dest_mut(layer, abs, len)
        })
    }
    fn dest_parts(&self, layer: u32, offset: u64, len: u64) -> LayerResult<Option<Vec<&mut [u8]>>> {
        self.lend(layer, offset, len, |abs| {
            self.sh.state.dest_parts(layer, abs, len)
        })
    }
    fn dest_filled(&self, layer: u32, len: u64) {
        if let Some(Cur {
            lent: Some((_, _, filled)),
            ..
        }) = self.track.lock().expect("lock").cur.as_mut()
        {
            *filled = true;
        }
        self.sh.state.dest_filled(layer, len)
    }
    fn complete(&self, layer: u32, bytes: u64) {
        let mut t = self.track.lock().expect("lock");
        match t.cur.take() {
            Some(Cur {
                lent: Some((o, n, _)),
                ..
            }) => {
                t.done(layer).push((o, n));
                drop(t);
                self.sh.state.complete(layer, bytes);
            }
            Some(c) => {
                let new: u64 = c.pieces.iter().map(|p| p.1).sum();
                t.done(layer).extend(c.pieces);
                drop(t);
                if new > 0 {
                    self.sh.state.complete(layer, new);
                }
            }
            None => {
                drop(t);
                self.sh.state.complete(layer, bytes)
            }
        }
    }
    fn fail(&self, layer: u32, err: LayerError) {
        {
            let mut t = self.track.lock().expect("lock");
            if t.cur.as_ref().is_some_and(|c| c.layer == layer) {
                // The unit's bytes stay reserved: the layer is a miss, never ready.
                t.cur = None;
            }
        }
        self.sh.state.fail(layer, shift_chunk(err, self.base))
    }
    fn broken(&self, layer: u32, err: LayerError) {
        self.track
            .lock()
            .expect("lock")
            .held
            .push((layer, shift_chunk(err, self.base)));
    }
    fn is_cancelled(&self) -> bool {
        self.sh.state.is_cancelled()
    }
    fn progress(&self, bytes: u64) {
        self.sh.progress.arrived(bytes)
    }
    fn verified(&self, layer: u32, offset: u64, len: u64, crc: u32) {
        // A unit that is exactly one slice (the connector asks for slice-sized units): its
        // CRC is the slice's, which followers check their copies against.
        if len == self.slice && (offset + self.shift).is_multiple_of(self.slice) {
            self.sh.record_slice_crc(
                ((offset + self.shift) / self.slice) as usize,
                layer as usize,
                crc,
            );
        }
    }
    fn begin_layer(&self, layer: u32) -> Option<futures::future::BoxFuture<'_, ()>> {
        self.step.set(self.index, layer);
        if self.step.may_begin(layer) {
            return None;
        }
        Some(Box::pin(async move {
            loop {
                let moved = self.step.moved.notified();
                tokio::pin!(moved);
                moved.as_mut().enable();
                if self.step.may_begin(layer) || self.sh.state.is_cancelled() {
                    return;
                }
                moved.await;
            }
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stripes_move_in_lockstep() {
        let s = Lockstep::new(2, 0);
        assert!(s.may_begin(0));
        // Stripe 0 finished layer 0; stripe 1 is still in it: nobody starts layer 1.
        s.set(0, 1);
        assert!(!s.may_begin(1));
        s.set(1, 1);
        assert!(
            s.may_begin(1) && s.may_begin(2),
            "one layer ahead of the slowest"
        );
        assert!(!s.may_begin(3), "two layers ahead");
        // An ended stripe holds nobody back.
        s.set(1, u32::MAX);
        s.set(0, 31);
        assert!(s.may_begin(31));
    }
}
