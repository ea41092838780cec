//! Fuzz target: the frame decoder (`decode_frame`) and both connection state machines fed the
//! same bytes: any stream gives frames, "need more" or a `ProtocolError`, never a panic.
#![no_main]

use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;
use objectcache_core::protocol::{decode_frame, ClientConnection, ServerConnection, ServerLimits};

fuzz_target!(|data: &[u8]| {
    let mut buf = BytesMut::from(data);
    while let Ok(Some(_)) = decode_frame(&mut buf, 1 << 20, 4096) {}
    let mut s = ServerConnection::new(ServerLimits::default());
    let _ = s.handle_bytes(&mut BytesMut::from(data));
    let mut c = ClientConnection::new();
    let _ = c.handle_bytes(&mut BytesMut::from(data));
});
