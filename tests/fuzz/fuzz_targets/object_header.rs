//! Fuzz target: the chunk object parser. Its body, and what it checks, is
//! `objectcache_fuzz::object_header` (src/lib.rs), through which the integration test
//! `security_fuzz_regressions` also replays stored crash inputs.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| objectcache_fuzz::object_header(data));
