//! Which data paths a load tries, chosen as a value: pure code over what the engine's
//! settings, the gateway probes and the segment markers say ([`PathFacts`]), no I/O. The
//! fetch ([`super::fetch`]) gathers the facts, then runs the [`Plan`]'s paths in order, each
//! in its own module: [`Path::Rdma`] (`rdma.rs`), [`Path::Gather`] (`gather/`),
//! [`Path::Ranged`] (`load/`). Every path but the last may hand the load on before it
//! delivers a byte (the server refused, no session, no device); the ranged GETs always end it.

/// What the choice of a load's data paths rests on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PathFacts {
    /// Gateways the store routes this prefix to for gather (0: gather is off in the settings,
    /// or the store has no gather endpoint).
    pub(crate) gateways: usize,
    /// Some prefix position lies in a segment object that no publish marker places: only the
    /// ranged-GET path, which reads the markers itself, can settle it.
    pub(crate) unplaced: bool,
    /// RDMA is allowed (a build with RDMA, `transport` not `tcp`) and the first gateway
    /// offers gather.
    pub(crate) rdma: bool,
}

/// One data path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Path {
    /// One gather request whose target is this host's registered memory: the server writes
    /// every unit with RDMA (first gateway only).
    Rdma,
    /// Gather over TCP, in `streams` stripes, failing over across the gateways.
    Gather {
        /// Stripes (connections) per load (`EngineConfig::gather_streams`).
        streams: usize,
    },
    /// Ranged GETs of the chunk objects, layer by layer (any S3 store).
    Ranged,
}

/// The paths a load tries, in order: always ending with [`Path::Ranged`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Plan(pub(crate) Vec<Path>);

impl Plan {
    /// The plan for `facts`: RDMA where allowed and offered, then gather where a gateway
    /// serves the prefix and every chunk is placed, then ranged GETs.
    pub(crate) fn choose(facts: &PathFacts, streams: usize) -> Plan {
        let mut paths = Vec::with_capacity(3);
        if facts.gateways > 0 && !facts.unplaced {
            if facts.rdma {
                paths.push(Path::Rdma);
            }
            paths.push(Path::Gather { streams });
        }
        paths.push(Path::Ranged);
        Plan(paths)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(gateways: usize, unplaced: bool, rdma: bool) -> Vec<Path> {
        let f = PathFacts {
            gateways,
            unplaced,
            rdma,
        };
        Plan::choose(&f, 2).0
    }

    #[test]
    fn every_plan_ends_with_ranged_gets() {
        let g = Path::Gather { streams: 2 };
        assert_eq!(plan(1, false, true), vec![Path::Rdma, g, Path::Ranged]);
        assert_eq!(plan(3, false, false), vec![g, Path::Ranged]);
        // No gateway: RDMA, which needs one, is never tried.
        assert_eq!(plan(0, false, true), vec![Path::Ranged]);
        // A chunk no marker places: only the ranged-GET path reads the markers.
        assert_eq!(plan(2, true, true), vec![Path::Ranged]);
    }
}
