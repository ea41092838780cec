//! Layer-ordered load over a plain object store (stock S3 path): ranged GETs issued in layer
//! order within a bounded look-ahead window, each body streamed straight into the caller's
//! destination and verified slice by slice.
//!
//! By concern: what a load asks for and reports (`request.rs`), the state a load's handle
//! and tasks share (`shared.rs`), the stall watchdog (`watchdog.rs`), the ranged-GET path
//! (`ranged.rs`) and the caller's handle (`handle.rs`). The gather and RDMA paths
//! (`connector/gather/`, `connector/rdma.rs`) deliver through the same [`Shared`] state.

mod handle;
mod ranged;
mod request;
mod shared;
mod watchdog;

pub use handle::LoadHandle;
pub(crate) use ranged::run_store_load;
pub use request::{LayerTiming, LoadHints, LoadRequest, LoadStats, MAX_ADVICE_TOKENS};
pub(crate) use shared::Shared;
pub(crate) use watchdog::watchdog;
