//! ObjectCache's tests that hold wall-clock deadlines or count what happens within them, one
//! test binary whose tests run one at a time.
//!
//! Each checks a promise with a clock in it: a stalled store gives up within the stall limit
//! (`traffic_stall`), a striped load keeps to the server's cap and its policy's share
//! (`traffic_striped`), concurrent loads overlap to share one fetch (`traffic_flight`), the
//! server closes hostile connections at its deadlines and stays within its memory
//! (`hostile_server`, `gather_front`), a faulty server is a miss by the load's deadline
//! (`fault_server`), a gateway that fails is failed over within its health interval
//! (`gateways`). None asserts a speed goal (those are benchmarks that print figures), but
//! each can miss a deadline when it shares the two cores of a CI machine with another test's
//! servers: `cargo test` runs a binary's tests two at a time there, and the `integration`
//! binary ran these beside 32 MiB gathers and 1 GiB PUT floods (a CI run failed in
//! `hostile_server` so). Here every test first takes [`alone`], so they run one after
//! another, and `cargo test` runs this binary after or before the others, never beside them.
//!
//! `cargo test --release --test timing traffic_stall::` runs one file's tests.

#[path = "../common/mod.rs"]
mod common;
#[path = "../common/fault_proxy/mod.rs"]
mod fault_proxy;
#[path = "../gather_util/mod.rs"]
mod gather_util;
#[path = "../hostile_util/mod.rs"]
mod hostile_util;
#[path = "../common/s3_faults.rs"]
mod s3_faults;
#[path = "../s3_support/mod.rs"]
mod s3_support;

mod fault_server;
mod gateways;
// Their async tests hold [`alone`]'s guard across awaits: it is the test's own, held by the
// future its runtime blocks on, and another test waits for it on its own thread, never on
// this runtime, so holding it cannot deadlock.
#[allow(clippy::await_holding_lock)]
mod gather_front;
#[allow(clippy::await_holding_lock)]
mod hostile_server;
mod traffic_flight;
mod traffic_stall;
mod traffic_striped;

/// Held for the whole of each test in this binary, so that no two run at once (a test that
/// panicked poisons nothing: the next one takes the lock all the same).
fn alone() -> std::sync::MutexGuard<'static, ()> {
    static M: std::sync::Mutex<()> = std::sync::Mutex::new(());
    M.lock().unwrap_or_else(|e| e.into_inner())
}
