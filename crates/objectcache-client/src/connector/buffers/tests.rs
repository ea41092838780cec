//! Tests of the destination buffers and the per-layer progress that guards them: readiness
//! only when fully written and verified, paged layers' logical-to-memory mapping, and the
//! overlap check of buffer ranges.

use super::*;
use crate::error::LayerError;
use crate::transport::LayerSink;

#[test]
fn ready_only_when_fully_written_and_verified() {
    let s = LoadState::new(LayerBuffers::allocate(2, 16), 12);
    s.write(0, 0, &[1; 6]).unwrap();
    assert_eq!(s.status(0), LayerStatus::Pending);
    assert!(s.write(0, 4, &[2; 4]).is_err(), "overlap refused");
    assert!(s.write(0, 10, &[2; 4]).is_err(), "past expected refused");
    s.write(0, 6, &[2; 6]).unwrap();
    assert_eq!(s.status(0), LayerStatus::Pending, "not verified yet");
    s.complete(0, 12);
    assert_eq!(s.status(0), LayerStatus::Ready);
    assert_eq!(
        s.ready_bytes(0).unwrap(),
        &[1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2]
    );
    assert!(s.write(0, 0, &[9]).is_err(), "no write into a ready layer");
    s.fail(1, LayerError::Cancelled);
    assert!(matches!(s.status(1), LayerStatus::Failed(_)));
    assert!(s.ready_bytes(1).is_none());
}

#[test]
fn paged_layers_map_logical_offsets_onto_their_ranges() {
    // Layer 0: pool[20..24] then pool[4..10]; layer 1: pool[12..18]. Gaps stay untouched.
    let b =
        LayerBuffers::paged(vec![0xEE; 24], vec![vec![(20, 4), (4, 6)], vec![(12, 6)]]).unwrap();
    assert_eq!((b.layer_len(0), b.ranges(0).len()), (10, 2));
    let s = LoadState::new(b, 10);
    // Lent across the range boundary: one slice per range.
    let parts = s.dest_parts(0, 2, 4).unwrap().unwrap();
    assert_eq!(
        parts.iter().map(|p| p.len()).collect::<Vec<_>>(),
        vec![2, 2]
    );
    for (p, v) in parts.into_iter().zip([[1u8, 2], [3, 4]]) {
        p.copy_from_slice(&v);
    }
    s.dest_filled(0, 4);
    // Across two ranges it is not lent as one slice (and nothing is reserved) ...
    assert!(s.dest_mut(0, 0, 5).unwrap().is_none());
    // ... inside one it is.
    let d = s.dest_mut(0, 6, 2).unwrap().unwrap();
    d.copy_from_slice(&[5, 6]);
    s.dest_filled(0, 2);
    assert!(s.write(0, 3, &[9]).is_err(), "overlap refused");
    s.write(0, 0, &[7, 8]).unwrap();
    s.write(0, 8, &[9, 10]).unwrap();
    assert_eq!(s.status(0), LayerStatus::Pending, "not verified yet");
    s.complete(0, 10);
    assert_eq!(s.status(0), LayerStatus::Ready);
    let got: Vec<&[u8]> = s.ready_parts(0).unwrap();
    assert_eq!(got, vec![&[7u8, 8, 1, 2][..], &[3, 4, 5, 6, 9, 10][..]]);
    assert!(s.ready_bytes(0).is_none(), "two ranges: no one-slice view");
    // Layer 1: a part spanning nothing but its one range.
    let parts = s.dest_parts(1, 0, 6).unwrap().unwrap();
    assert_eq!(parts.len(), 1);
    parts.into_iter().for_each(|p| p.fill(3));
    s.dest_filled(1, 6);
    assert!(s.write(1, 9, &[0, 0]).is_err(), "past expected refused");
    let mut st = s;
    st.complete(1, 6);
    let pool = match std::mem::replace(&mut st.bufs, LayerBuffers::allocate(0, 0)).into_pool() {
        Some(p) => p,
        None => panic!("a pool"),
    };
    assert_eq!(
        pool,
        [
            0xEE, 0xEE, 0xEE, 0xEE, 3, 4, 5, 6, 9, 10, 0xEE, 0xEE, //
            3, 3, 3, 3, 3, 3, 0xEE, 0xEE, 7, 8, 1, 2
        ]
    );
}

#[test]
fn first_overlap_finds_any_shared_byte() {
    let mut v = vec![(10usize, 5usize, 'a'), (0, 10, 'b'), (15, 1, 'c')];
    assert_eq!(first_overlap(&mut v), None, "adjacent ranges share nothing");
    let mut v = vec![
        (0usize, 100usize, 'a'),
        (30, 0, 'z'),
        (50, 5, 'b'),
        (200, 1, 'c'),
    ];
    assert_eq!(
        first_overlap(&mut v),
        Some(('a', 'b')),
        "contained in a long range"
    );
    let mut v = vec![(0usize, 100usize, 'a'), (10, 2, 'b'), (99, 2, 'c')];
    assert_eq!(first_overlap(&mut v), Some(('a', 'b')));
}
