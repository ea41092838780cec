//! Shared by the RDMA tests (tests/rdma_*.rs): whether this host has an RDMA device, and
//! whether the run demands one (`OBJECTCACHE_REQUIRE_RDMA=1`, set inside CI's soft-RoCE VM,
//! scripts/rxe-vm/run.sh).
#![allow(dead_code)]

use objectcache::transport::rdma;

/// `true` when `OBJECTCACHE_REQUIRE_RDMA=1`: a missing device is then a failure, not a SKIP.
pub fn rdma_required() -> bool {
    std::env::var("OBJECTCACHE_REQUIRE_RDMA").is_ok_and(|v| v == "1")
}

/// `true` when an RDMA device exists; otherwise SKIP, or panic under OBJECTCACHE_REQUIRE_RDMA=1.
pub fn rdma_present(test: &str) -> bool {
    match rdma::devices() {
        Ok(_) => true,
        Err(e) => {
            if rdma_required() {
                panic!("{test}: OBJECTCACHE_REQUIRE_RDMA=1 but {e}");
            }
            eprintln!("SKIP {test}: {e} (run it in the soft-RoCE VM: scripts/rxe-vm/run.sh)");
            false
        }
    }
}
