//! Fuzz target: the gather and save descriptor parsers (`GatherRequest::decode`,
//! `SaveRequest::decode`) together with the unit planner: any body gives a request or a
//! `ProtocolError`, never a panic, and a request that decodes plans in bounded memory (run
//! with `-rss_limit_mb`, as scripts/fuzz-smoke.sh does).
#![no_main]

use libfuzzer_sys::fuzz_target;
use objectcache_core::protocol::{plan_units, GatherRequest, SaveRequest};

fuzz_target!(|data: &[u8]| {
    if let Ok(req) = GatherRequest::decode(data, 4096) {
        let units = plan_units(&req);
        assert!(units.len() as u64 <= objectcache_core::protocol::MAX_UNITS_PER_REQUEST);
    }
    let _ = SaveRequest::decode(data, 4096);
});
