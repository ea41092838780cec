//! Transports: thin drivers that move gather-protocol bytes (TCP; RDMA with feature `rdma`).
