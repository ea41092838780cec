//! The gather wire protocol (sans-IO): descriptors, frames, and the client and server state
//! machines. Specified byte by byte in `docs/protocol.md`.
#![forbid(unsafe_code)]
