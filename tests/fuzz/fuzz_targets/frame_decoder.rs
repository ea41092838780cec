//! Fuzz target: the frame decoder and both connection state machines. Its body, and what it checks,
//! is `objectcache_fuzz::frame_decoder` (src/lib.rs), through which the integration test
//! `security_fuzz_regressions` also replays stored crash inputs.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| objectcache_fuzz::frame_decoder(data));
