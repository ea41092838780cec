//! A load's fetch: gathers the facts its data paths rest on (segment markers resolved, the
//! gateways for its prefix, whether RDMA is offered), takes the [`Plan`] for them
//! ([`super::path`]), and runs its paths in order until one ends the load. The deadline and
//! the stall watchdog around it are [`super::flight::Fetcher::start`]'s.

use super::gather::Outcome;
use super::load::{LoadRequest, LoadShared};
use super::path::{Path, PathFacts, Plan};
use super::EngineConfig;
use crate::layout::{KeyBuilder, Marker};
use crate::link::Link;
use crate::store::{Gateways, Store};
use std::collections::BTreeMap;
use std::sync::Arc;

/// One load's fetch, with everything it needs owned (it runs as its own task).
pub(crate) struct Fetch {
    pub(crate) store: Arc<dyn Store>,
    pub(crate) gateways: Gateways,
    pub(crate) probes: Arc<super::gather::Probes>,
    pub(crate) link: Option<Arc<Link>>,
    pub(crate) cfg: EngineConfig,
    #[cfg(feature = "rdma")]
    pub(crate) rdma: Arc<std::sync::Mutex<super::rdma::Probe>>,
    /// The publish markers the lookup read, by prefix position.
    pub(crate) markers: BTreeMap<usize, Marker>,
    pub(crate) req: LoadRequest,
    pub(crate) keys: KeyBuilder,
    pub(crate) sh: Arc<LoadShared>,
    pub(crate) request_id: u64,
}

impl Fetch {
    /// Runs the fetch to its end (every layer ready or a miss).
    pub(crate) async fn run(mut self) {
        // Markers of positions nothing known places are read first where a segment may hold
        // them: this engine writes version 2, or a known marker names a segment.
        if self.cfg.save_format == super::SaveFormat::V2 || any_segment(&self.markers) {
            super::markers::resolve_markers(
                &*self.store,
                &self.keys,
                &self.req.hashes,
                &mut self.markers,
                &self.sh,
            )
            .await;
        }
        // The gateways to try, in placement order for this prefix (one for a single endpoint).
        let route = crate::sched::placement::route_key(self.req.hashes[0].as_bytes());
        let targets = match self.cfg.gather {
            true => self.gateways.route(route),
            false => Vec::new(),
        };
        // Chunks in segment objects go to a gather server as runs of segments
        // (`docs/object-format.md`, "Gather and RDMA"), once every chunk is placed; a position
        // no marker places is the ranged-GET path's to settle.
        let (unplaced, runs) = match any_segment(&self.markers) {
            true => {
                let placed = crate::layout::place(self.req.hashes.len(), &self.markers);
                (!placed.unknown.is_empty(), placed.runs)
            }
            false => (false, Vec::new()),
        };
        let facts = PathFacts {
            gateways: targets.len(),
            unplaced,
            rdma: self.rdma_offered(&targets, unplaced).await,
        };
        for path in Plan::choose(&facts, self.cfg.gather_streams).0 {
            let (req, keys, sh, id) = (&self.req, &self.keys, &self.sh, self.request_id);
            let outcome = match path {
                #[cfg(feature = "rdma")]
                Path::Rdma => {
                    // Its bytes land without passing through this process: the watchdog
                    // cannot see them, so it is held off while the RDMA attempt runs.
                    let _unobserved = sh.progress.hold();
                    let t = &targets[0];
                    let tr = self.cfg.transport;
                    super::rdma::try_rdma(&self.rdma, tr, t, keys, req, &runs, id, sh).await
                }
                #[cfg(not(feature = "rdma"))]
                Path::Rdma => Outcome::Fallback,
                Path::Gather { streams } => {
                    let (p, g) = (&self.probes, &self.gateways);
                    super::gather::try_gather(p, g, route, keys, req, &runs, id, sh, streams).await
                }
                Path::Ranged => {
                    let cfg = &self.cfg;
                    let (window, max_req) = (cfg.window_bytes, cfg.max_requests);
                    super::load::run_store_load(
                        self.store,
                        self.keys,
                        self.req,
                        self.sh,
                        window,
                        max_req,
                        cfg.coalesce_bytes,
                        self.link,
                        self.markers,
                    )
                    .await;
                    return;
                }
            };
            if let Outcome::Done = outcome {
                return;
            }
        }
    }
}

impl Fetch {
    /// Whether RDMA is allowed (a build with RDMA, `transport` not `tcp`) and the first of
    /// `targets` offers gather (its probe, which the gather path would make too).
    #[cfg(feature = "rdma")]
    async fn rdma_offered(&self, targets: &[crate::store::GatherTarget], unplaced: bool) -> bool {
        if self.cfg.transport == super::Transport::Tcp || unplaced || targets.is_empty() {
            return false;
        }
        super::gather::offered(&self.probes.get(&targets[0].addr), &targets[0]).await
    }

    /// A build without RDMA never tries it.
    #[cfg(not(feature = "rdma"))]
    async fn rdma_offered(&self, _: &[crate::store::GatherTarget], _: bool) -> bool {
        false
    }
}

/// Whether any of `markers` names a segment object (format version 2).
pub(crate) fn any_segment(markers: &BTreeMap<usize, Marker>) -> bool {
    markers.values().any(|m| matches!(m, Marker::Segment(_)))
}
