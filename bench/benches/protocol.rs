//! Hot paths of the gather protocol, in bytes per second per core (criterion's throughput):
//! unit frame encoding and decoding, CRC32C checksumming, and gathering slices into a unit.

use bytes::{Bytes, BytesMut};
use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use objectcache::protocol::{decode_frame, UnitHeader};
use std::hint::black_box;

const UNIT: usize = 16 << 20; // one 16 MiB unit
const SLICE: usize = 1 << 20; // one Llama-3.1-8B slice (256 tokens x 4 KiB)

fn payload(n: usize) -> Bytes {
    Bytes::from((0..n).map(|i| (i * 31 % 251) as u8).collect::<Vec<_>>())
}

fn frames(c: &mut Criterion) {
    let data = payload(UNIT);
    let crc = objectcache::layout::crc::crc32c(&data);
    let h = UnitHeader {
        layer: 3,
        crc32c: crc,
        offset: 0,
        len: UNIT as u32,
    };
    let mut g = c.benchmark_group("frame");
    g.throughput(Throughput::Bytes(UNIT as u64));
    // Zero-copy encode: a 32-byte prefix; the payload is sent as is.
    g.bench_function("encode_unit_16MiB_zero_copy", |b| {
        b.iter(|| black_box(h.encode_prefix()))
    });
    let mut wire = BytesMut::new();
    wire.extend_from_slice(&h.encode_prefix());
    wire.extend_from_slice(&data);
    let wire = wire.freeze();
    // Decode splits the payload off the receive buffer without copying.
    // (Filling the receive buffer is the socket read's copy; it is set up outside the timing.)
    g.bench_function("decode_unit_16MiB", |b| {
        b.iter_batched(
            || BytesMut::from(&wire[..]),
            |mut buf| black_box(decode_frame(&mut buf, 1 << 20, 4096).unwrap()),
            BatchSize::LargeInput,
        )
    });
    g.finish();
}

fn checksums(c: &mut Criterion) {
    let data = payload(UNIT);
    let mut g = c.benchmark_group("crc32c");
    g.throughput(Throughput::Bytes(UNIT as u64));
    g.bench_function("crc32c_16MiB", |b| {
        b.iter(|| black_box(objectcache::layout::crc::crc32c(black_box(&data))))
    });
    g.finish();
}

fn gather(c: &mut Criterion) {
    let slices: Vec<Bytes> = (0..UNIT / SLICE).map(|_| payload(SLICE)).collect();
    let crcs: Vec<u32> = slices
        .iter()
        .map(|s| objectcache::layout::crc::crc32c(s))
        .collect();
    let mut g = c.benchmark_group("gather_unit");
    g.throughput(Throughput::Bytes(UNIT as u64));
    // The server's path: slices stay where the backend read put them; the unit CRC is the
    // stored slice CRCs combined (pass-through) — no byte is touched.
    g.bench_function("16_slices_pass_through_crc_combine", |b| {
        b.iter(|| {
            let mut crc = crcs[0];
            for (s, &c) in slices.iter().zip(&crcs).skip(1) {
                crc = objectcache::layout::crc::crc32c_combine(crc, c, s.len() as u64);
            }
            black_box((
                UnitHeader {
                    layer: 0,
                    crc32c: crc,
                    offset: 0,
                    len: UNIT as u32,
                }
                .encode_prefix(),
                slices.clone(),
            ))
        })
    });
    // With server-side verification: every slice checksummed once.
    g.bench_function("16_slices_verify_and_combine", |b| {
        b.iter(|| {
            let mut crc = None;
            for s in &slices {
                let c = objectcache::layout::crc::crc32c(s);
                crc = Some(match crc {
                    None => c,
                    Some(a) => objectcache::layout::crc::crc32c_combine(a, c, s.len() as u64),
                });
            }
            black_box(crc)
        })
    });
    // The copying alternative, for comparison: gather into one contiguous buffer.
    g.bench_function("16_slices_copy_into_one_buffer", |b| {
        let mut out = vec![0u8; UNIT];
        b.iter(|| {
            for (i, s) in slices.iter().enumerate() {
                out[i * SLICE..(i + 1) * SLICE].copy_from_slice(s);
            }
            black_box(&out);
        })
    });
    g.finish();
}

criterion_group!(benches, frames, checksums, gather);
criterion_main!(benches);
