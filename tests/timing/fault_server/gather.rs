//! Faults on the gather path: the server-to-client stream truncated, flipped, reset
//! (whole loads and striped ones), stalled with the connection open, or dripping.

use super::*;

#[test]
fn gather_truncated_stream_is_a_miss_or_fallback() {
    let _alone = crate::alone();
    each_format("trunc", 1, 1, truncated_cases);
}

fn truncated_cases(r: &Rig, lay: &Layout) {
    let u1 = lay.units[1];
    for (name, at) in [
        ("before the challenge", 0),
        ("inside the challenge", lay.challenge / 2),
        ("inside the hello", (lay.challenge + lay.hello) / 2),
        ("inside a unit header", u1.0 + 10),
        ("mid-payload", u1.0 + 40 + u1.2 / 2),
        ("one byte before the end", lay.total - 1),
    ] {
        raw_case(
            r,
            &format!("gather stream closed {name} (byte {at} of {})", lay.total),
            RawFault::CloseAfter(at),
            false,
            true,
        );
    }
}

#[test]
fn gather_flipped_bytes_never_become_kv() {
    let _alone = crate::alone();
    each_format("flip", 2, 1, flipped_cases);
}

fn flipped_cases(r: &Rig, lay: &Layout) {
    // Unit prefix: frame header (8), layer (4), crc (4), offset (8), len (4), reserved (4).
    let off = FRAME_HEADER_LEN as u64 + 8;
    let (u0, u1) = (lay.units[0], lay.units[1]);
    for (name, at, gather_after) in [
        // A garbled nonce makes the client's MAC wrong: the server refuses this connection;
        // the next load authenticates afresh.
        ("in the challenge's nonce", lay.challenge - 5, true),
        // A garbled hello may read as "not a gather server": the engine then uses ranged GETs.
        ("in the hello", (lay.challenge + lay.hello) / 2, false),
        ("in the accepted frame", lay.hello + 4, true),
        ("in a unit's frame type", u1.0, true),
        ("in a unit's layer", u1.0 + FRAME_HEADER_LEN as u64, true),
        ("in a unit's CRC", u1.0 + FRAME_HEADER_LEN as u64 + 4, true),
        // Offset 0 becomes 0xff00: the unit still fits its layer, at the wrong place.
        (
            "in a unit's destination offset (byte 1)",
            u0.0 + off + 1,
            true,
        ),
        (
            "in a unit's destination offset (byte 2)",
            u1.0 + off + 2,
            true,
        ),
        ("in a unit's length", u1.0 + off + 8, true),
        ("in the first payload byte", u0.0 + 32, true),
        ("mid-payload", u1.0 + 32 + u1.2 / 2, true),
        ("in the end frame", lay.total + 3, true),
    ] {
        raw_case(
            r,
            &format!("gather byte flipped {name} (byte {at})"),
            RawFault::FlipAt(at),
            false,
            gather_after,
        );
    }
    // One bit of a unit's layer field: layer 0's last unit (16 MiB..18 MiB) is addressed to
    // layer 1 instead, with its CRC intact. Layer 1 would then count 18 MiB before its own
    // unit at 16 MiB arrives; units of a layer must come in offset order, so it is refused.
    let u = lay.units[1];
    raw_case(
        r,
        &format!(
            "gather unit of layer 0 re-addressed to layer 1 (bit 0 of byte {})",
            u.0 + 8
        ),
        RawFault::XorAt(u.0 + FRAME_HEADER_LEN as u64, 1),
        false,
        true,
    );
}

#[test]
fn gather_reset_mid_stream_is_a_miss() {
    let _alone = crate::alone();
    each_format("reset", 3, 1, |r, lay| {
        reset_cases(
            r,
            "gather connection reset",
            &[
                ("before the hello", 0),
                ("after the first unit", lay.units[1].0),
                ("mid-payload", lay.total / 2),
                ("before the end frame", lay.total - 1),
            ],
        );
    });
}

/// Resets the engine's first new gather connection at each `(name, byte)` point in turn:
/// misses, never bytes, then a clean reload over gather ([`raw_case`]).
fn reset_cases(r: &Rig, what: &str, points: &[(&str, u64)]) {
    for &(name, at) in points {
        raw_case(
            r,
            &format!("{what} {name} (byte {at})"),
            RawFault::ResetAfter(at),
            false,
            true,
        );
    }
}

/// A load striped over two connections (chunks 0-8 and 9-17), the first reset partway
/// through its own stream: the layers that stripe had not completed are misses (never
/// bytes), the other stripe's connection goes back to the pool, and the next load is
/// byte-exact over gather again.
#[test]
fn gather_striped_reset_is_a_miss() {
    let _alone = crate::alone();
    each_format("stripe-reset", 13, 2, |r, lay| {
        // One stripe's stream is about half the whole load's.
        reset_cases(
            r,
            "striped gather: first connection reset",
            &[
                ("after its first unit", lay.units[1].0),
                ("mid-payload", lay.total / 4),
            ],
        );
    });
}

/// A gather stream that stalls after layer 0 (of 32, Llama-3.1-8B geometry, 2 chunks of 256
/// tokens): once layer 1 is late, `LoadHandle::stall_advice` (the planner's deadline
/// fallback on the load's measured progress) says to recompute from layer 1 the 512 loaded
/// tokens, predicted to finish before waiting would; on the same prefix loaded without a
/// fault it says to wait (nothing is missing).
#[test]
fn stalled_gather_load_advises_recompute() {
    let _alone = crate::alone();
    use objectcache::sched::{ComputeModel, Fallback, GpuKind, KernelClass};
    let server = mem_server();
    let g = KvGeometry::llama31_8b();
    let ns = unique_ns("stall-advice");
    let chunks = 2;
    let tokens = chunks * g.tokens_per_chunk as usize;
    let timeout = Duration::from_secs(20);
    let direct = engine(
        ours(&format!("http://{}", server.local_addr())),
        &ns,
        timeout,
    );
    let (hs, data) = save_prefix(&direct, &g, chunks, 21);
    let model = ComputeModel::preset("llama-3.1-8b", GpuKind::H100, KernelClass::Tuned).unwrap();
    let load = |e: &Engine| start_load(e, &g, hs.clone(), data[0].len());
    // Without a fault: every layer lands, nothing to recompute.
    let h = load(&direct);
    h.wait_all_blocking().unwrap();
    let advice = h.stall_advice(&model, tokens as u64, 16).unwrap();
    assert!(matches!(advice, Fallback::Wait { .. }), "{advice:?}");
    // One stream through a proxy that stalls after 3 MiB: layer 0 (2 MiB) and half of
    // layer 1 arrive, then nothing.
    let proxy = FaultProxy::raw(server.local_addr(), |_| RawFault::StallAfter(3 << 20));
    let e = engine(ours(&proxy.url()), &ns, timeout);
    let h = load(&e);
    h.wait_layer_blocking(0, None).unwrap();
    assert_eq!(h.layer(0).unwrap(), &data[0][..], "layer 0 byte-exact");
    // Layer 1 is late: still pending after half a second (the event, with a bound).
    assert!(
        h.wait_layer_blocking(1, Some(Duration::from_millis(500)))
            .is_err(),
        "layer 1 arrived through a stalled stream"
    );
    let advice = h.stall_advice(&model, tokens as u64, 16).unwrap();
    match advice {
        Fallback::Recompute {
            from_layer,
            tokens: t,
            finish_s,
            wait_finish_s,
        } => {
            assert_eq!((from_layer, t), (1, tokens as u64), "{advice:?}");
            assert!(finish_s < wait_finish_s, "{advice:?}");
        }
        other => panic!("a stalled load should be recomputed: {other:?}"),
    }
    println!("FAULT|server-gather|stream stalled after layer 0 of 32|1|stall_advice: {advice:?}");
    h.cancel();
    drop((h, e, direct, proxy));
    rt().block_on(server.shutdown());
}

#[test]
fn gather_stall_with_connection_open_ends_by_deadline() {
    let _alone = crate::alone();
    let server = mem_server();
    let deadline = Duration::from_secs(3);
    let r = rig(server.local_addr(), "stall", 4, deadline);
    let lay = r.stream_layout(server_info(server.local_addr()));
    for (name, at) in [
        ("before the hello", 0),
        ("after the first unit", lay.units[1].0 + 100),
    ] {
        let t0 = std::time::Instant::now();
        raw_case(
            &r,
            &format!("gather stream stalls {name}, deadline {deadline:?}"),
            RawFault::StallAfter(at),
            false,
            true,
        );
        println!(
            "  stall case took {:?} including the clean reload",
            t0.elapsed()
        );
    }
    drop(r);
    rt().block_on(server.shutdown());
}

#[test]
fn gather_slow_drip_completes_or_misses_by_deadline() {
    let _alone = crate::alone();
    let server = mem_server();
    // 36 MiB at 64 KiB per 2 ms (about 32 MB/s): completes inside a 30 s deadline.
    let r = rig(server.local_addr(), "drip", 5, Duration::from_secs(30));
    raw_case(
        &r,
        "gather slow drip 64 KiB/2 ms, deadline 30 s",
        RawFault::Drip {
            bytes: 64 << 10,
            every: Duration::from_millis(2),
        },
        true,
        true,
    );
    drop(r);
    // The same drip against a 1 s deadline: layers not complete by then are misses.
    let r = rig(server.local_addr(), "drip-late", 6, Duration::from_secs(1));
    raw_case(
        &r,
        "gather slow drip 64 KiB/20 ms, deadline 1 s",
        RawFault::Drip {
            bytes: 64 << 10,
            every: Duration::from_millis(20),
        },
        false,
        true,
    );
    drop(r);
    rt().block_on(server.shutdown());
}
