//! Deterministic discrete-event simulator of loads sharing a storage link.
#![forbid(unsafe_code)]
