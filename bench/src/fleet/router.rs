//! The fleet benchmark's routers: round-robin, and a small prefix-aware one.
//!
//! The prefix-aware router remembers, per replica, the chained block hashes of the prompts it
//! sent there ([`super::trace::block_hashes`]): an approximate view of each replica's own
//! prefix cache, as routers that score replicas by the prefixes they were sent keep (it
//! never asks a replica). A request goes to the replica holding its longest prefix, unless
//! that replica has [`SLACK`] more requests in flight than the least loaded one; a request
//! no replica holds goes to the least loaded replica (lowest index on ties, as between
//! replicas holding as much at the same load). It is a router
//! for the benchmark, not for production: it forgets nothing, and knows nothing of
//! evictions.

use std::cmp::Reverse;
use std::collections::HashSet;

/// Requests in flight by which the replica holding a prefix may exceed the least loaded one
/// and still get the request.
pub const SLACK: usize = 2;

/// The routings.
pub const ROUTINGS: &[&str] = &["round-robin", "prefix"];

/// A router's state.
#[derive(Debug)]
pub enum Router {
    /// Replica `next`, then the one after it.
    RoundRobin { next: usize },
    /// Per replica, the block hashes of what it was sent.
    Prefix { held: Vec<HashSet<u64>> },
}

impl Router {
    /// The router `routing` names, for `replicas` replicas.
    ///
    /// # Panics
    /// On a name not in [`ROUTINGS`] (the command line checks them).
    pub fn new(routing: &str, replicas: usize) -> Router {
        match routing {
            "round-robin" => Router::RoundRobin { next: 0 },
            "prefix" => Router::Prefix {
                held: vec![HashSet::new(); replicas],
            },
            _ => panic!("unknown routing {routing:?}"),
        }
    }

    /// The replica for a request whose prompt has block hashes `blocks`, given the requests
    /// each replica has in flight (`loads`, one entry per replica).
    pub fn pick(&mut self, blocks: &[u64], loads: &[usize]) -> usize {
        let n = loads.len();
        match self {
            Router::RoundRobin { next } => {
                let r = *next % n;
                *next = (r + 1) % n;
                r
            }
            Router::Prefix { held } => {
                let least = (0..n).min_by_key(|&r| loads[r]).unwrap_or(0);
                let matched = |r: usize| blocks.iter().take_while(|b| held[r].contains(b)).count();
                let best = (0..n)
                    .filter(|&r| loads[r] <= loads[least] + SLACK)
                    .max_by_key(|&r| (matched(r), Reverse(loads[r]), Reverse(r)))
                    .filter(|&r| matched(r) > 0)
                    .unwrap_or(least);
                held[best].extend(blocks.iter().copied());
                best
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_robin_cycles() {
        let mut r = Router::new("round-robin", 3);
        let picks: Vec<usize> = (0..5).map(|_| r.pick(&[1], &[0, 0, 0])).collect();
        assert_eq!(picks, [0, 1, 2, 0, 1]);
    }

    #[test]
    fn prefix_follows_the_longest_prefix_within_the_slack() {
        let mut r = Router::new("prefix", 3);
        // Nothing held: the least loaded.
        assert_eq!(r.pick(&[1, 2], &[1, 0, 1]), 1);
        assert_eq!(r.pick(&[7, 8, 9], &[0, 1, 1]), 0);
        // The longest held prefix wins over a shorter one and over load within the slack.
        assert_eq!(r.pick(&[1, 2, 3], &[0, 2, 0]), 1);
        assert_eq!(r.pick(&[7, 5], &[0, 0, 0]), 0);
        // Past the slack, the least loaded, which then holds the prefix too.
        assert_eq!(r.pick(&[1, 2, 3], &[0, 3, 1]), 0);
        assert_eq!(r.pick(&[1, 2, 3, 4], &[1, 1, 0]), 0);
    }
}
