//! Tests of the lifecycle: key classification into entries, explicit and soft leases.

use super::inventory::{data_key, marker_key};
use super::*;
use std::time::Duration;

#[test]
fn keys_classify_to_one_entry() {
    let d = "ns/v1/00ff/tp0-1/sha256cbor/kv/abcd";
    let m = "ns/v1/00ff/tp0-1/sha256cbor/pub/abcd";
    assert_eq!(classify_key(d).0, ObjectKind::Data);
    assert_eq!(classify_key(m).0, ObjectKind::Marker);
    assert_eq!(classify_key(d).1, classify_key(m).1);
    assert_eq!(data_key(&classify_key(m).1), d);
    assert_eq!(marker_key(&classify_key(d).1), m);
    assert_eq!(classify_key("ns/kv/zz").0, ObjectKind::Other);
    assert_eq!(classify_key("kv/ab").0, ObjectKind::Other);
    assert_eq!(classify_key("a/b/lease/ab").0, ObjectKind::Other);
}

#[test]
fn explicit_and_soft_leases() {
    let t = LeaseTable::new();
    let k = "n/v1/f/tp0-1/a/kv/01";
    assert!(!t.is_leased(k));
    let g = t.acquire([k.to_string()]);
    assert!(t.is_leased("n/v1/f/tp0-1/a/pub/01"));
    drop(g);
    assert!(!t.is_leased(k));
    t.touch(k, Duration::from_secs(60));
    assert!(t.is_leased(k));
    t.touch(k, Duration::ZERO);
    assert!(t.is_leased(k), "a shorter touch never shortens a lease");
}
