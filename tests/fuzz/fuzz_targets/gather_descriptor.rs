//! Fuzz target: the gather and save descriptor parsers (`GatherRequest::decode`,
//! `SaveRequest::decode`): any body gives a request or a `ProtocolError`, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use objectcache::protocol::{GatherRequest, SaveRequest};

fuzz_target!(|data: &[u8]| {
    let _ = GatherRequest::decode(data, 4096);
    let _ = SaveRequest::decode(data, 4096);
});
