//! Placement: which of several gateways (endpoints serving the same objects) serves a load.
//!
//! ObjectCache gateways in front of one object store are stateless: any of them can serve
//! any load, and they differ only in how busy they are and whether they answer. A client
//! orders the gateways for each load and tries them in that order (the first that answers
//! serves it; the next ones are where the load fails over). The order is built from:
//!
//! - a **route key** ([`route_key`]): a hash of what identifies the prefix (the first chunk's
//!   block hash for a load, the object key for a single request);
//! - **rendezvous hashing** (highest random weight, Thaler and Ravishankar 1998): gateway `i`
//!   scores `mix(route ^ seed_i)`; the prefix's preferred gateway is the top score. Adding
//!   or losing a gateway moves only the prefixes whose top gateway changed, and a gateway
//!   that comes back gets its prefixes back;
//! - each gateway's **load** (loads in flight: what its last health check reported plus
//!   what this client has started on it since) and whether it is **up**.
//!
//! Policies ([`Placement`]):
//! - `hash`: rendezvous order alone. A prefix always meets the same gateway (useful if the
//!   gateways kept a cache), but a hot prefix piles onto one gateway.
//! - `least-loaded`: the gateway with the fewest loads first (ties in rendezvous order).
//!   With load figures that are a health interval old, every client sees the same minimum
//!   and many pick it at once (herding).
//! - `two-choice`: the less loaded of the prefix's two top rendezvous gateways
//!   ("the power of two choices", Mitzenmacher 2001): the maximum load stays within
//!   O(log log n) of the mean even with stale figures, and a prefix stays on one of two
//!   gateways. The default (`docs/deployment.md`, "Sizing", has the simulation behind it).
//!
//! Gateways that are down come after every gateway that is up, in the same order, as a last
//! resort. Pure and deterministic: no clock, no randomness beyond the hashes.
#![forbid(unsafe_code)]

use crate::error::Error;

/// A placement policy (module documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Placement {
    /// Rendezvous hashing by route key.
    Hash,
    /// Fewest loads in flight first.
    LeastLoaded,
    /// The less loaded of the two top rendezvous gateways.
    #[default]
    TwoChoice,
}

impl Placement {
    /// Every policy, in report order.
    pub const ALL: [Placement; 3] = [
        Placement::Hash,
        Placement::LeastLoaded,
        Placement::TwoChoice,
    ];

    /// The policy's name in store URLs and reports: `hash`, `least-loaded`, `two-choice`.
    pub fn name(self) -> &'static str {
        match self {
            Placement::Hash => "hash",
            Placement::LeastLoaded => "least-loaded",
            Placement::TwoChoice => "two-choice",
        }
    }

    /// Parses a name of [`Placement::name`].
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the known policies.
    pub fn parse(s: &str) -> Result<Self, Error> {
        Placement::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "placement {s:?} is not hash, least-loaded or two-choice"
                ))
            })
    }
}

impl std::fmt::Display for Placement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// FNV-1a (64-bit) of `bytes`: the route key of a prefix or an object key. Stable across
/// platforms and releases.
pub fn route_key(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// The rendezvous seed of a gateway, from its name (e.g. `http://10.0.0.1:9000`).
pub fn endpoint_seed(name: &str) -> u64 {
    mix(route_key(name.as_bytes()))
}

/// SplitMix64's finaliser: a bijection that spreads every input bit over the output.
fn mix(mut x: u64) -> u64 {
    x ^= x >> 30;
    x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x ^= x >> 27;
    x = x.wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Rendezvous score of a gateway with seed `seed` for `route` (higher first).
pub fn score(route: u64, seed: u64) -> u64 {
    mix(route ^ seed)
}

/// What placement needs to know about one gateway.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Candidate {
    /// Its rendezvous seed ([`endpoint_seed`]).
    pub seed: u64,
    /// Whether it is believed to answer.
    pub up: bool,
    /// Loads in flight on it, as far as this client knows.
    pub load: f64,
}

/// The order in which to try the gateways `c` for a load routed by `route` (indices into
/// `c`; every index once): the policy's choice first, then the other gateways that are up in
/// rendezvous order (for `least-loaded`, by load), then the gateways that are down.
pub fn order(p: Placement, route: u64, c: &[Candidate]) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..c.len()).collect();
    idx.sort_by_key(|&i| (!c[i].up, std::cmp::Reverse(score(route, c[i].seed)), i));
    let up = c.iter().filter(|x| x.up).count();
    match p {
        Placement::Hash => {}
        Placement::LeastLoaded => {
            idx[..up].sort_by(|&a, &b| c[a].load.total_cmp(&c[b].load));
        }
        Placement::TwoChoice => {
            if up >= 2 && c[idx[1]].load < c[idx[0]].load {
                idx.swap(0, 1);
            }
        }
    }
    idx
}

/// The first gateway of [`order`], without ordering the rest (for simulations placing
/// millions of loads). `None` if `c` is empty.
pub fn first(p: Placement, route: u64, c: &[Candidate]) -> Option<usize> {
    // The rendezvous key of `order`: up before down, higher score, lower index.
    let key = |i: usize| (c[i].up, score(route, c[i].seed), std::cmp::Reverse(i));
    // Least-loaded: among gateways that are up, the lower load first (loads are counts, so
    // never NaN: `total_cmp` orders them as numbers).
    let better = |i: usize, b: usize| -> bool {
        if p == Placement::LeastLoaded && c[i].up && c[b].up {
            match c[i].load.total_cmp(&c[b].load) {
                std::cmp::Ordering::Less => return true,
                std::cmp::Ordering::Greater => return false,
                std::cmp::Ordering::Equal => {}
            }
        }
        key(i) > key(b)
    };
    let (mut best, mut second): (Option<usize>, Option<usize>) = (None, None);
    for i in 0..c.len() {
        if best.is_none_or(|b| better(i, b)) {
            second = best;
            best = Some(i);
        } else if second.is_none_or(|s| better(i, s)) {
            second = Some(i);
        }
    }
    if p == Placement::TwoChoice {
        if let (Some(b), Some(s)) = (best, second) {
            if c[b].up && c[s].up && c[s].load < c[b].load {
                return Some(s);
            }
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gws(n: usize) -> Vec<Candidate> {
        (0..n)
            .map(|i| Candidate {
                seed: endpoint_seed(&format!("http://10.0.0.{i}:9000")),
                up: true,
                load: 0.0,
            })
            .collect()
    }

    #[test]
    fn names_round_trip() {
        for p in Placement::ALL {
            assert_eq!(Placement::parse(p.name()).unwrap(), p);
        }
        let e = Placement::parse("random").unwrap_err().to_string();
        assert!(e.contains("two-choice"), "{e}");
    }

    #[test]
    fn first_agrees_with_order() {
        let mut c = gws(7);
        for (i, x) in c.iter_mut().enumerate() {
            x.load = ((i * 5) % 4) as f64;
            x.up = i != 3;
        }
        for p in Placement::ALL {
            for r in 0..500u64 {
                let route = route_key(&r.to_le_bytes());
                let o = order(p, route, &c);
                assert_eq!(Some(o[0]), first(p, route, &c), "{p} route {r}");
                let mut sorted = o.clone();
                sorted.sort_unstable();
                assert_eq!(sorted, (0..7).collect::<Vec<_>>());
                assert_eq!(*o.last().unwrap(), 3, "the down gateway comes last");
            }
        }
    }

    #[test]
    fn rendezvous_moves_only_the_lost_gateways_prefixes() {
        let mut c = gws(8);
        let routes: Vec<u64> = (0..4000u64).map(|r| route_key(&r.to_be_bytes())).collect();
        let before: Vec<usize> = routes
            .iter()
            .map(|&r| first(Placement::Hash, r, &c).unwrap())
            .collect();
        // Spread: every gateway gets between half and twice its fair share.
        for g in 0..8 {
            let n = before.iter().filter(|&&b| b == g).count();
            assert!(
                (250..1000).contains(&n),
                "gateway {g} has {n} of 4000 prefixes"
            );
        }
        c[5].up = false;
        let during: Vec<usize> = routes
            .iter()
            .map(|&r| first(Placement::Hash, r, &c).unwrap())
            .collect();
        for (b, d) in before.iter().zip(&during) {
            if *b != 5 {
                assert_eq!(b, d, "a prefix of a live gateway moved");
            } else {
                assert_ne!(*d, 5);
            }
        }
        // It comes back: every prefix returns to where it was.
        c[5].up = true;
        let after: Vec<usize> = routes
            .iter()
            .map(|&r| first(Placement::Hash, r, &c).unwrap())
            .collect();
        assert_eq!(before, after);
    }

    #[test]
    fn two_choice_takes_the_less_loaded_of_the_top_two() {
        let mut c = gws(5);
        let route = route_key(b"prefix");
        let o = order(Placement::Hash, route, &c);
        assert_eq!(
            order(Placement::TwoChoice, route, &c),
            o,
            "equal loads: rendezvous order"
        );
        c[o[0]].load = 3.0;
        c[o[1]].load = 1.0;
        let t = order(Placement::TwoChoice, route, &c);
        assert_eq!((t[0], t[1]), (o[1], o[0]));
        // Only the top two are compared: an idle third gateway is not chosen.
        c[o[2]].load = 0.0;
        assert_eq!(first(Placement::TwoChoice, route, &c), Some(o[1]));
        assert_eq!(first(Placement::LeastLoaded, route, &c), Some(o[2]));
    }
}
