//! ObjectCache's integration tests, one test binary.
//!
//! Each file here is one area's tests (`cargo test --release --test integration paged_kv::`
//! runs one file's; any test name or module path works as a filter). They share one binary so
//! that the dependencies' generic code (tokio, hyper, the AWS SDK, s3s) is compiled and linked
//! once, not once per file: on a 2-core machine that is most of the test build.
//!
//! Some tests stay binaries of their own in `tests/`, each with a reason:
//! - they change process-wide state: the AWS credential and addressing tests (`AWS_*`
//!   environment variables), the RDMA tests (`OBJECTCACHE_RDMA`, a tracing subscriber);
//! - they need a feature: RDMA (`scripts/ci-rdma.sh` builds them with `--features rdma`) and
//!   CUDA (`--features cuda`);
//! - they compare measured times with a model or ride out a storage failure on a deadline, so
//!   they must not share the two cores with the rest: the scheduler accuracy tests
//!   (`sched_loopback`, `sched_client_loopback`), the multi-host bed (`bed`), the tests
//!   that hold deadlines (`timing`: stall limits, the server's cap and its closing of hostile
//!   connections, single-flight loads that must overlap, gateway failover; one at a time),
//!   and the vLLM connector tests (each runs whole vLLM engines).
//!
//! Helpers shared with those binaries live in `tests/` beside them.

#[path = "../common/mod.rs"]
mod common;
#[path = "../common/fault_proxy/mod.rs"]
mod fault_proxy;
#[path = "../gather_util/mod.rs"]
mod gather_util;
#[path = "../hostile_util/mod.rs"]
mod hostile_util;
#[path = "../py_support/mod.rs"]
mod py_support;
#[path = "../common/s3_faults.rs"]
mod s3_faults;
#[path = "../s3_support/mod.rs"]
mod s3_support;

mod c_abi;
mod connector_gather;
mod delay_s3;
mod fault_fs_writes;
mod fault_markers;
mod fault_s3;
mod fault_s3_retry;
mod fault_soak;
mod gather_cases;
mod gather_tcp;
mod layerwise_load;
mod lifecycle_gc;
mod nixl_plugin;
mod node_tier;
mod paged_kv;
mod python_package;
mod s3_retry;
mod sched_c1;
mod sched_policies;
mod security_fuzz_regressions;
mod security_server_tenants;
mod security_server_tls;
mod security_tenants;
mod segment_load;
mod server_errors;
mod server_partial_writes;
mod server_process;
mod server_s3;
mod sim_determinism;
mod store_conformance;
mod store_doctor;
mod traffic_misses;
mod traffic_promises;
