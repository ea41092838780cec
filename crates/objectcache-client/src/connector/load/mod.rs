//! A layer-ordered load, by concern: what a load asks for and reports (`request.rs`), its
//! start by [`Engine::load`](crate::connector::Engine::load) (`start.rs`), the state its
//! handle and tasks share (`shared.rs`), the stall watchdog (`watchdog.rs`), the caller's
//! handle (`handle.rs`), and the stock-S3 path (`ranged.rs`, chunk objects; `segment.rs`,
//! format version 2 segment objects): ranged GETs issued in layer order within a bounded
//! look-ahead window (`window.rs`), each body cut into slices, put in the caller's destination
//! and verified slice by slice (`body.rs`: read from the connection straight into place where
//! the store allows, else copied from the store's stream); objects that are local files (the filesystem store) are read
//! with `pread(2)` straight into the destination instead (`local.rs`). The gather and RDMA
//! paths (`connector/gather/`, `connector/rdma.rs`) deliver through the same [`LoadShared`] state.

mod body;
mod handle;
mod local;
mod ranged;
mod request;
mod segment;
mod shared;
mod start;
mod watchdog;
mod window;

pub use handle::LoadHandle;
pub(crate) use ranged::run_store_load;
pub use request::{LayerTiming, LoadHints, LoadRequest, LoadStats, MAX_ADVICE_TOKENS};
pub(crate) use shared::LoadShared;
pub(crate) use watchdog::watchdog;
