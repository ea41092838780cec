//! Device destinations (feature `cuda`): a load lands in pinned staging, is verified there,
//! and is copied to device memory layer by layer (`objectcache::cuda::DeviceLoad`).
//!
//! Needs an NVIDIA GPU and driver for the round trip; without one the round trip prints
//! SKIP (or fails when `OBJECTCACHE_REQUIRE_CUDA` is set), and the no-driver test checks
//! that the failure is a clear error instead.
#![cfg(feature = "cuda")]

mod common;

use common::*;
use objectcache::connector::{LayerBuffers, LayerStatus, LoadRequest};
use objectcache::cuda::cudarc::driver::DevicePtr;
use objectcache::cuda::{Device, DeviceLoad, LayerCopy};
use objectcache::store::MemoryStore;
use objectcache::{Dtype, KvGeometry};
use std::sync::Arc;

fn small() -> KvGeometry {
    let mut g = KvGeometry::new("test/cuda", 4, 2, 32, Dtype::Bf16).unwrap();
    g.tokens_per_chunk = 16;
    g
}

fn device_or_skip() -> Option<Device> {
    match Device::open(0) {
        Ok(d) => Some(d),
        Err(e) => {
            assert!(
                std::env::var_os("OBJECTCACHE_REQUIRE_CUDA").is_none(),
                "OBJECTCACHE_REQUIRE_CUDA is set but device 0 does not open: {e}"
            );
            eprintln!("SKIP cuda round trip: {e}");
            None
        }
    }
}

#[test]
fn device_open_fails_clearly_or_succeeds() {
    match Device::open(0) {
        Ok(d) => assert_eq!(d.ordinal(), 0),
        Err(e) => {
            let m = e.to_string();
            assert!(
                m.contains("libcuda") || m.contains("does not exist"),
                "unclear error: {m}"
            );
        }
    }
    // A negative ordinal is never a device.
    assert!(Device::open(-1).is_err());
}

#[test]
fn load_lands_in_device_memory_byte_exact() {
    let Some(dev) = device_or_skip() else { return };
    let g = small();
    let chunks = 5;
    let e = engine(Arc::new(MemoryStore::new()), &unique_ns("cuda"));
    let hs = hashes(&g, chunks * g.tokens_per_chunk as usize, 7);
    let data = kv(&g, chunks, 7);
    let refs: Vec<&[u8]> = data.iter().map(|v| v.as_slice()).collect();
    e.save_blocking(&g, &hs, &refs).unwrap();

    let per_layer = data[0].len();
    let layers = g.layers as usize;
    let stream = dev.context().default_stream();
    let dst = stream.alloc_zeros::<u8>(per_layer * layers).unwrap();
    let (base, _sync) = dst.device_ptr(&stream);
    dev.check_device_range(base as usize, per_layer * layers)
        .unwrap();
    // Host memory is not device memory.
    let host = vec![0u8; 64];
    assert!(dev.check_device_range(host.as_ptr() as usize, 64).is_err());

    let staging = dev.staging(per_layer * layers).unwrap();
    let s0 = staging.as_mut_ptr().unwrap();
    let raw: Vec<(*mut u8, usize)> = (0..layers)
        .map(|l| (s0.wrapping_add(l * per_layer), per_layer))
        .collect();
    let copies: Vec<Vec<LayerCopy>> = (0..layers)
        .map(|l| {
            vec![LayerCopy {
                dst: base + (l * per_layer) as u64,
                src: s0.addr() + l * per_layer,
                len: per_layer,
            }]
        })
        .collect();
    // SAFETY: staging outlives the load (dropped after `dl`), every range is in it, and no
    // one else touches it.
    let bufs = unsafe { LayerBuffers::from_raw(&raw) };
    let h = e
        .load(
            LoadRequest {
                geometry: g.clone(),
                hashes: hs,
                hints: Default::default(),
            },
            bufs,
        )
        .unwrap();
    // SAFETY: sources in `staging`, destinations in `dst`, both alive until `dl` drops.
    let dl = unsafe { DeviceLoad::start(&dev, Arc::new(h), copies) }.unwrap();
    for l in 0..layers {
        dl.wait_layer_blocking(l, None).unwrap();
        assert_eq!(dl.poll_layer(l), LayerStatus::Ready);
    }
    drop(dl);
    let back: Vec<u8> = stream.clone_dtoh(&dst).unwrap();
    for l in 0..layers {
        assert_eq!(
            &back[l * per_layer..(l + 1) * per_layer],
            &data[l][..],
            "layer {l}"
        );
    }
}
