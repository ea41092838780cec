//! The pure parts of the RDMA data path (`objectcache_client::transport::rdma` holds the verbs
//! objects and drivers): the 32-bit immediate that names each RDMA_WRITE_WITH_IMM's delivery
//! unit ([`imm`]), and one layer's completion bookkeeping on the client ([`tally`]). No verbs,
//! no locks, no clock; their tests run on every machine, without an RDMA device.

pub mod imm;
pub mod tally;

pub use imm::Imm;
pub use tally::{Landed, LayerState, LayerTally, TallyError};
