//! What a load asks for and what it reports: [`LoadRequest`], its scheduling inputs
//! ([`LoadHints`], [`LayerTiming`]) and their checks, and the load's counters ([`LoadStats`]).

use crate::layout::{ChunkHash, KvGeometry, SegmentMarker};
use crate::protocol::SchedHints;
use std::collections::BTreeMap;

/// What to load.
///
/// `LoadRequest::new(geometry, hashes)` (or a literal with `hints: Default::default()`) asks
/// for a load without scheduling inputs; [`LoadRequest::with_layer_compute_s`],
/// [`LoadRequest::with_layer_deadlines_s`] and [`LoadRequest::with_priority`] add them.
#[derive(Debug, Clone)]
pub struct LoadRequest {
    /// Geometry (incl. TP rank) the objects must have been written with.
    pub geometry: KvGeometry,
    /// The chunk hashes of the prefix, in order; every chunk holds `tokens_per_chunk` tokens.
    pub hashes: Vec<ChunkHash>,
    /// When the layers are needed and how urgent the load is: the inputs of the bandwidth
    /// schedulers (the engine's own link on the ranged-GET path, the server's on the gather
    /// path). Default: no timing, priority 128.
    pub hints: LoadHints,
}

impl LoadRequest {
    /// A request for `hashes` written with `geometry`, without scheduling hints.
    pub fn new(geometry: KvGeometry, hashes: Vec<ChunkHash>) -> Self {
        LoadRequest {
            geometry,
            hashes,
            hints: LoadHints::default(),
        }
    }

    /// Sets the per-layer compute time (seconds, one value per layer of the geometry;
    /// compute starts when `load` is called). Checked by `Engine::load`.
    pub fn with_layer_compute_s(mut self, compute_s: Vec<f64>) -> Self {
        self.hints.timing = LayerTiming::ComputeS(compute_s);
        self
    }

    /// Sets the per-layer deadlines (seconds after `load` is called, one value per layer of
    /// the geometry, non-decreasing). Checked by `Engine::load`.
    pub fn with_layer_deadlines_s(mut self, deadlines_s: Vec<f64>) -> Self {
        self.hints.timing = LayerTiming::DeadlinesS(deadlines_s);
        self
    }

    /// Sets the priority (higher first; default 128).
    pub fn with_priority(mut self, priority: u8) -> Self {
        self.hints.priority = priority;
        self
    }

    /// Sets the segment markers a lookup in another process read (see
    /// [`LoadHints::segment_markers`]).
    pub fn with_segment_markers(mut self, markers: BTreeMap<usize, SegmentMarker>) -> Self {
        self.hints.segment_markers = markers;
        self
    }
}

/// When a load's layers are needed (the timeline of `docs/scheduling.md`, section 2: layer
/// `l`'s KV is needed when layer `l`'s compute starts).
#[derive(Debug, Clone, Default, PartialEq)]
pub enum LayerTiming {
    /// Unknown: every layer is needed at once.
    #[default]
    None,
    /// The engine's compute time of each layer in seconds (one per layer of the geometry),
    /// compute of layer 0 starting when `load` is called.
    ComputeS(Vec<f64>),
    /// The time each layer is needed, in seconds after `load` is called (one per layer,
    /// non-decreasing).
    DeadlinesS(Vec<f64>),
}

/// Scheduling inputs of a load (see [`LoadRequest::hints`]).
#[derive(Debug, Clone, PartialEq)]
pub struct LoadHints {
    /// When the layers are needed.
    pub timing: LayerTiming,
    /// Priority, higher first (0..=255; default 128). Sent to a gather server, whose
    /// `priority` scheduler admits loads in this order; the bandwidth policies of the links
    /// use the timing only.
    pub priority: u8,
    /// Publish markers of format v2 that a lookup elsewhere read (the scheduler process of an
    /// engine whose workers load: `Engine::segment_markers` there), by prefix position: where
    /// the ranged-GET path finds this prefix's chunks in segment objects. One per segment is
    /// enough (`layout::place` reaches from it over the segment's other chunks). This
    /// engine's own lookups within `lookup_cache_ttl` count first; a position no marker
    /// places is read as a chunk object (format v1). Positions at or past the request's chunk
    /// count are refused by `Engine::load`. Default: none.
    pub segment_markers: BTreeMap<usize, SegmentMarker>,
}

impl Default for LoadHints {
    fn default() -> Self {
        LoadHints {
            timing: LayerTiming::None,
            priority: 128,
            segment_markers: BTreeMap::new(),
        }
    }
}

/// Largest time a hint can carry: the wire's `u32` microseconds (about 71.6 minutes).
const MAX_HINT_S: f64 = u32::MAX as f64 * 1e-6;

/// Largest token count [`LoadHandle::stall_advice`] accepts for the prefix or the new tokens:
/// 2^26 = 67,108,864 tokens, far beyond any context window, so the compute model's sums stay
/// exact and nonsense inputs are refused rather than answered.
///
/// [`LoadHandle::stall_advice`]: super::LoadHandle::stall_advice
pub const MAX_ADVICE_TOKENS: u64 = 1 << 26;

impl LoadHints {
    /// Checks the timing against a geometry of `layers` layers.
    ///
    /// # Errors
    /// [`crate::Error::InvalidArgument`] naming the problem: a vector whose length is not
    /// `layers`, a value that is negative, not finite or above `u32::MAX` microseconds, or
    /// deadlines that decrease.
    pub fn validate(&self, layers: u32) -> Result<(), crate::Error> {
        let (what, v) = match &self.timing {
            LayerTiming::None => return Ok(()),
            LayerTiming::ComputeS(v) => ("layer compute times", v),
            LayerTiming::DeadlinesS(v) => ("layer deadlines", v),
        };
        let bad = |m: String| Err(crate::Error::InvalidArgument(format!("load hints: {m}")));
        if v.len() != layers as usize {
            return bad(format!(
                "{} {what} given, the geometry has {layers} layers",
                v.len()
            ));
        }
        if let Some((l, x)) = v
            .iter()
            .enumerate()
            .find(|(_, x)| !x.is_finite() || **x < 0.0 || **x > MAX_HINT_S)
        {
            return bad(format!(
                "{what}: layer {l} has {x} s (need a finite value in 0..={MAX_HINT_S:.0} s)"
            ));
        }
        if matches!(self.timing, LayerTiming::DeadlinesS(_)) {
            if let Some(l) = (1..v.len()).find(|&l| v[l] < v[l - 1]) {
                return bad(format!(
                    "layer deadlines decrease at layer {l} ({} s after {} s)",
                    v[l],
                    v[l - 1]
                ));
            }
        }
        Ok(())
    }

    /// The wire form (microseconds, rounded), as the link schedulers and gather servers take
    /// it. Values are clamped to `0..=u32::MAX` microseconds ([`LoadHints::validate`]
    /// rejects anything outside).
    pub fn sched_hints(&self) -> SchedHints {
        let us = |v: &[f64]| {
            v.iter()
                .map(|s| (s * 1e6).round().clamp(0.0, u32::MAX as f64) as u32)
                .collect()
        };
        match &self.timing {
            LayerTiming::None => SchedHints::None,
            LayerTiming::ComputeS(v) => SchedHints::LayerComputeUs(us(v)),
            LayerTiming::DeadlinesS(v) => SchedHints::LayerDeadlinesUs(us(v)),
        }
    }
}

/// Counters of one load.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LoadStats {
    /// Storage requests issued: ranged GETs, or one gather request per stream of a gather
    /// load (`EngineConfig::gather_streams`, at most one per chunk).
    pub requests: u64,
    /// Payload bytes received.
    pub bytes: u64,
    /// Seconds from `load` to layer 0 ready (time to first layer), if it became ready.
    pub ttfl_s: Option<f64>,
    /// Seconds from `load` to the last layer ready, if every layer became ready.
    pub ttll_s: Option<f64>,
    /// Times a gather stream continued on another gateway after its gateway failed in the
    /// middle of the load (a store over several gateways; see `docs/deployment.md`).
    pub failovers: u64,
    /// Most storage requests this load had in flight at once (ranged-GET path; 0 on the
    /// gather path).
    pub peak_requests_in_flight: u64,
    /// Most bytes this load's requests had asked for and not yet received at once
    /// (ranged-GET path; 0 on the gather path). At most `window_bytes`, except that one read
    /// larger than the window goes alone.
    pub peak_bytes_in_flight: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hints_are_checked_and_become_microseconds() {
        let g = KvGeometry::smollm2_135m();
        let n = g.layers as usize;
        let r = LoadRequest::new(g.clone(), vec![]);
        assert_eq!(r.hints, LoadHints::default());
        assert_eq!(r.hints.priority, 128);
        assert_eq!(r.hints.sched_hints(), SchedHints::None);
        let r = r.with_layer_compute_s(vec![0.0015; n]).with_priority(7);
        r.hints.validate(g.layers).unwrap();
        assert_eq!(r.hints.priority, 7);
        assert_eq!(
            r.hints.sched_hints(),
            SchedHints::LayerComputeUs(vec![1500; n])
        );
        let d: Vec<f64> = (0..n).map(|l| l as f64 * 0.01).collect();
        let r = r.with_layer_deadlines_s(d);
        r.hints.validate(g.layers).unwrap();
        let SchedHints::LayerDeadlinesUs(us) = r.hints.sched_hints() else {
            panic!("deadlines expected")
        };
        assert_eq!(
            (us[0], us[1], us[n - 1]),
            (0, 10_000, (n as u32 - 1) * 10_000)
        );
        for (timing, needle) in [
            (
                LayerTiming::ComputeS(vec![0.001; n - 1]),
                "the geometry has 30 layers",
            ),
            (LayerTiming::ComputeS(vec![f64::NAN; n]), "layer 0"),
            (LayerTiming::ComputeS(vec![-1.0; n]), "layer 0"),
            (LayerTiming::DeadlinesS(vec![1e9; n]), "layer 0"),
            (
                LayerTiming::DeadlinesS((0..n).map(|l| if l == 3 { 0.0 } else { 1.0 }).collect()),
                "decrease at layer 3",
            ),
        ] {
            let h = LoadHints {
                timing,
                ..LoadHints::default()
            };
            let e = h.validate(g.layers).unwrap_err().to_string();
            assert!(e.contains("load hints") && e.contains(needle), "{e}");
        }
    }
}
