//! The node tier of the cluster simulation: one ObjectCache server per node of GPUs, in front
//! of the gateways, with a DRAM level and a local-disk level (the server's tier,
//! `objectcache_server::ServerConfig::tier_dram_bytes` and `tier_disk_bytes`).
//!
//! Model (every figure a parameter of [`NodeTier`]):
//! - GPU `g` is on node `g mod nodes` (GPUs are dealt round-robin onto the nodes).
//! - A request's prefix is found in its node's DRAM level, its disk level, or neither. A hit
//!   loads at the GPU host's link or the level's read rate, whichever is slower, through no
//!   gateway and no storage node; reads of one node do not slow each other (a node's DRAM and
//!   NVMe bandwidth is well above one GPU host link's).
//! - A miss loads through a gateway as without the tier. When that load ends, its prefix is
//!   admitted to the node's DRAM level (every prefix, or only one asked for before within the
//!   window: [`TierAdmission`]); the DRAM level's least recently used prefixes move down to
//!   the disk level, whose least recently used ones are dropped. A disk hit moves its prefix
//!   up to DRAM. The unit is the whole prefix (a document's chunks are read together).
//! - A request that arrives while its prefix is still loading on its node is a miss of its
//!   own (the real server joins it to the fill, single-flight): the remote bytes this model
//!   gives are an upper bound for bursts of one prefix on one node.
//!
//! Pure and deterministic, like the rest of the simulation.

use std::collections::{BTreeMap, HashMap};

/// Which prefixes a node's tier keeps (the server's `tier_admission`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum TierAdmission {
    /// Every prefix loaded.
    All,
    /// A prefix asked for the second time on the node within `window_s` seconds (KVBM
    /// admits to disk at frequency 2): one-off prefixes do not push out reused ones.
    Second {
        /// Seconds the first request is remembered.
        window_s: f64,
    },
}

/// The node tier of [`super::ClusterConfig::tier`].
#[derive(Debug, Clone, PartialEq)]
pub struct NodeTier {
    /// Nodes the GPUs are on (each with one tier).
    pub nodes: usize,
    /// Each node's DRAM level, bytes.
    pub dram_bytes: u64,
    /// Each node's disk level, bytes (0: none).
    pub disk_bytes: u64,
    /// A load's read rate from DRAM, bytes/s.
    pub dram_bytes_per_s: f64,
    /// A load's read rate from disk, bytes/s.
    pub disk_bytes_per_s: f64,
    /// What is admitted.
    pub admission: TierAdmission,
}

/// Where a request's prefix was found on its node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Found {
    Dram,
    Disk,
    Miss,
}

/// One level: prefixes by recency, bounded in bytes.
#[derive(Debug, Default)]
struct Level {
    cap: u64,
    used: u64,
    /// The next recency stamp.
    clock: u64,
    /// prefix -> (bytes, recency stamp)
    entries: HashMap<u64, (u64, u64)>,
    /// recency stamp -> prefix (oldest first)
    order: BTreeMap<u64, u64>,
}

impl Level {
    fn new(cap: u64) -> Self {
        Level {
            cap,
            ..Level::default()
        }
    }

    fn take(&mut self, prefix: u64) -> Option<u64> {
        let (bytes, stamp) = self.entries.remove(&prefix)?;
        self.order.remove(&stamp);
        self.used -= bytes;
        Some(bytes)
    }

    /// Puts `prefix` in as the most recent; returns the prefixes pushed out (oldest first),
    /// or `prefix` itself when it is larger than the level.
    fn put(&mut self, prefix: u64, bytes: u64) -> Vec<(u64, u64)> {
        self.take(prefix);
        self.clock += 1;
        let stamp = self.clock;
        if bytes > self.cap {
            return vec![(prefix, bytes)];
        }
        let mut out = Vec::new();
        while self.used + bytes > self.cap {
            let Some((&s, &p)) = self.order.iter().next() else {
                break;
            };
            self.order.remove(&s);
            if let Some((b, _)) = self.entries.remove(&p) {
                self.used -= b;
                out.push((p, b));
            }
        }
        self.entries.insert(prefix, (bytes, stamp));
        self.order.insert(stamp, prefix);
        self.used += bytes;
        out
    }
}

/// One node's tier.
#[derive(Debug)]
struct Node {
    dram: Level,
    disk: Level,
    /// Last request time of each prefix not yet admitted (admission on the second request).
    seen: HashMap<u64, f64>,
}

/// Every node's tier, and the counts of the run.
#[derive(Debug)]
pub(super) struct Tiers {
    cfg: NodeTier,
    nodes: Vec<Node>,
    /// Requests found in DRAM, on disk, and missed.
    pub(super) dram_hits: u64,
    pub(super) disk_hits: u64,
    pub(super) misses: u64,
    /// Bytes loaded from the nodes' levels.
    pub(super) tier_bytes: f64,
}

impl Tiers {
    pub(super) fn new(cfg: &NodeTier) -> Self {
        let nodes = (0..cfg.nodes.max(1))
            .map(|_| Node {
                dram: Level::new(cfg.dram_bytes),
                disk: Level::new(cfg.disk_bytes),
                seen: HashMap::new(),
            })
            .collect();
        Tiers {
            cfg: cfg.clone(),
            nodes,
            dram_hits: 0,
            disk_hits: 0,
            misses: 0,
            tier_bytes: 0.0,
        }
    }

    /// The configuration.
    pub(super) fn config(&self) -> &NodeTier {
        &self.cfg
    }

    fn node(&self, gpu: u32) -> usize {
        gpu as usize % self.nodes.len()
    }

    /// Looks `prefix` (`bytes`) up on GPU `gpu`'s node (a hit becomes the most recent; a
    /// disk hit moves up to DRAM) and counts what was found. Returns where it was found and
    /// the read rate of that level (bytes/s; `None` for a miss).
    pub(super) fn lookup(&mut self, gpu: u32, prefix: u64, bytes: u64) -> (Found, Option<f64>) {
        let n = self.node(gpu);
        let node = &mut self.nodes[n];
        if node.dram.take(prefix).is_some() {
            node.dram.put(prefix, bytes);
            self.dram_hits += 1;
            self.tier_bytes += bytes as f64;
            return (Found::Dram, Some(self.cfg.dram_bytes_per_s));
        }
        if node.disk.take(prefix).is_some() {
            // What DRAM pushes out moves down (the prefix itself, were it larger than DRAM).
            for (p, b) in node.dram.put(prefix, bytes) {
                node.disk.put(p, b);
            }
            self.disk_hits += 1;
            self.tier_bytes += bytes as f64;
            return (Found::Disk, Some(self.cfg.disk_bytes_per_s));
        }
        self.misses += 1;
        (Found::Miss, None)
    }

    /// A miss's load of `prefix` (`bytes`) on GPU `gpu`'s node, asked for at `asked_s`,
    /// ended: admitted to DRAM if the admission policy takes it; what DRAM pushes out moves
    /// to disk, what disk pushes out is dropped.
    pub(super) fn fill(&mut self, gpu: u32, prefix: u64, bytes: u64, asked_s: f64) {
        let n = self.node(gpu);
        let admission = self.cfg.admission;
        let node = &mut self.nodes[n];
        let admit = match admission {
            TierAdmission::All => true,
            TierAdmission::Second { window_s } => {
                let again = node
                    .seen
                    .get(&prefix)
                    .is_some_and(|&first| asked_s - first <= window_s);
                if !again {
                    node.seen.insert(prefix, asked_s);
                }
                again
            }
        };
        if !admit {
            return;
        }
        node.seen.remove(&prefix);
        for (p, b) in node.dram.put(prefix, bytes) {
            node.disk.put(p, b);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tier(dram: u64, disk: u64, admission: TierAdmission) -> Tiers {
        Tiers::new(&NodeTier {
            nodes: 2,
            dram_bytes: dram,
            disk_bytes: disk,
            dram_bytes_per_s: 20e9,
            disk_bytes_per_s: 5e9,
            admission,
        })
    }

    #[test]
    fn dram_spills_to_disk_and_disk_hits_move_up() {
        let mut t = tier(100, 100, TierAdmission::All);
        assert_eq!(t.lookup(0, 1, 60).0, Found::Miss);
        t.fill(0, 1, 60, 0.0);
        assert_eq!(t.lookup(0, 1, 60), (Found::Dram, Some(20e9)));
        // Another node has its own tier.
        assert_eq!(t.lookup(1, 1, 60).0, Found::Miss);
        // Prefix 2 pushes 1 down to disk.
        t.fill(0, 2, 60, 1.0);
        assert_eq!(t.lookup(0, 1, 60), (Found::Disk, Some(5e9)));
        // 1 moved up, so 2 is on disk now.
        assert_eq!(t.lookup(0, 2, 60).0, Found::Disk);
        assert_eq!((t.dram_hits, t.disk_hits, t.misses), (1, 2, 2));
        assert_eq!(t.tier_bytes, 180.0);
        // Larger than both levels: never held.
        t.fill(0, 3, 500, 2.0);
        assert_eq!(t.lookup(0, 3, 500).0, Found::Miss);
    }

    #[test]
    fn without_disk_what_dram_pushes_out_is_gone() {
        let mut t = tier(100, 0, TierAdmission::All);
        t.fill(0, 1, 60, 0.0);
        t.fill(0, 2, 60, 0.0);
        assert_eq!(t.lookup(0, 1, 60).0, Found::Miss);
        assert_eq!(t.lookup(0, 2, 60).0, Found::Dram);
    }

    #[test]
    fn second_request_admission_keeps_one_off_prefixes_out() {
        let mut t = tier(1000, 0, TierAdmission::Second { window_s: 10.0 });
        t.fill(0, 1, 60, 0.0);
        assert_eq!(
            t.lookup(0, 1, 60).0,
            Found::Miss,
            "one request: not admitted"
        );
        t.fill(0, 1, 60, 5.0);
        assert_eq!(t.lookup(0, 1, 60).0, Found::Dram, "the second within 10 s");
        t.fill(0, 2, 60, 0.0);
        t.fill(0, 2, 60, 20.0);
        assert_eq!(
            t.lookup(0, 2, 60).0,
            Found::Miss,
            "the second came after the window"
        );
        t.fill(0, 2, 60, 25.0);
        assert_eq!(t.lookup(0, 2, 60).0, Found::Dram);
    }
}
