//! Device destinations (feature `cuda`): a load lands in pinned staging, is verified there,
//! and is copied to device memory layer by layer (`objectcache::connector::DeviceLoad`).
//!
//! Needs an NVIDIA GPU and driver for the round trip; without one the round trip prints
//! SKIP (or fails when `OBJECTCACHE_REQUIRE_CUDA` is set), and the no-driver test checks
//! that the failure is a clear error instead.
#![cfg(feature = "cuda")]

mod common;

use common::*;
use objectcache::connector::DeviceLoad;
use objectcache::connector::{LayerBuffers, LayerStatus, LoadRequest};
use objectcache::cuda::cudarc::driver::DevicePtr;
use objectcache::cuda::{Device, LayerCopy};
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
    let (hs, data) = save_prefix(&e, &g, chunks, 7);

    let per_layer = data[0].len();
    let layers = g.layers as usize;
    let stream = dev.context().default_stream();
    let dst = stream.alloc_zeros::<u8>(per_layer * layers).unwrap();
    let (base, _sync) = dst.device_ptr(&stream);
    dev.check_device_range(base as usize, per_layer * layers)
        .unwrap();
    // Host memory is not device memory.
    let host = [0u8; 64];
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
    let h = e.load(LoadRequest::new(g.clone(), hs), bufs).unwrap();
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

/// Paged KV in device memory through the C ABI (`objectcache_load_paged`): the engine's KV
/// buffer on the GPU is registered once (with its pinned staging twin); a load into one
/// request's scattered blocks lands each block's bytes in the twin at the block's offset,
/// verified there, then copies them block by block to the device. Every block compared byte
/// for byte after a copy back, and the blocks not loaded stay zero.
#[test]
fn paged_load_through_the_c_abi_lands_in_device_blocks() {
    use objectcache::capi::*;
    let Some(dev) = device_or_skip() else { return };
    let g = small();
    let (layers, blocks, block_tokens) = (g.layers as usize, 12usize, 8u32);
    let block = block_tokens as usize * g.bytes_per_token_per_layer() as usize;
    let chunks = 2; // 16-token chunks: 2 blocks each, 4 blocks per layer
    let ids = [9usize, 2, 7, 4];
    let layout = c"test/cuda-blocks";
    let model = std::ffi::CString::new(g.model.clone()).unwrap();
    let geom = objectcache_geometry {
        struct_size: std::mem::size_of::<objectcache_geometry>() as u32,
        layers: g.layers,
        kv_heads: g.kv_heads,
        head_dim: g.head_dim,
        dtype: OBJECTCACHE_DTYPE_BF16 as u32,
        tokens_per_chunk: g.tokens_per_chunk,
        tp_rank: 0,
        tp_world: 1,
        model: model.as_ptr(),
        layout: layout.as_ptr(),
        block_size: block_tokens,
        _reserved: 0,
    };
    let keys = [c"store".as_ptr(), c"namespace".as_ptr()];
    let ns = std::ffi::CString::new(unique_ns("cuda-paged")).unwrap();
    let vals = [c"memory://".as_ptr(), ns.as_ptr()];
    let mut e = std::ptr::null_mut();
    // SAFETY: valid arrays of NUL-terminated strings and an out pointer, as the header says.
    let s = unsafe {
        objectcache_engine_create(
            OBJECTCACHE_ABI_VERSION,
            keys.as_ptr(),
            vals.as_ptr(),
            2,
            &mut e,
        )
    };
    assert_eq!(s, OBJECTCACHE_OK);
    let hs = hashes(&g, chunks * g.tokens_per_chunk as usize, 5);
    let packed: Vec<u8> = hs.iter().flat_map(|h| h.as_bytes().to_vec()).collect();
    // Source blocks in host memory (a save needs no registration).
    let mut host = vec![0u8; layers * ids.len() * block];
    for (i, b) in host.iter_mut().enumerate() {
        *b = (i * 7 + i / 997) as u8;
    }
    let src: Vec<objectcache_range> = (0..layers * ids.len())
        .map(|k| objectcache_range {
            addr: host[k * block..].as_mut_ptr().cast(),
            len: block as u64,
        })
        .collect();
    // SAFETY: the geometry, hashes and ranges are valid for the call.
    let s = unsafe {
        objectcache_save_paged(
            e,
            &geom,
            packed.as_ptr(),
            32,
            chunks,
            src.as_ptr(),
            ids.len(),
            layers,
            std::ptr::null_mut(),
        )
    };
    assert_eq!(s, OBJECTCACHE_OK);

    let stream = dev.context().default_stream();
    let kv = stream.alloc_zeros::<u8>(layers * blocks * block).unwrap();
    let (base, _sync) = kv.device_ptr(&stream);
    let mut region = std::ptr::null_mut();
    // SAFETY: `kv` is device memory of device 0 that outlives the registration.
    let s = unsafe {
        objectcache_register_memory(
            e,
            base as usize as *mut std::ffi::c_void,
            layers * blocks * block,
            OBJECTCACHE_MEM_DEVICE,
            0,
            &mut region,
        )
    };
    assert_eq!(s, OBJECTCACHE_OK);
    let at = |l: usize, b: usize| base as usize + (l * blocks + b) * block;
    let dst: Vec<objectcache_range> = (0..layers)
        .flat_map(|l| ids.iter().map(move |&b| (l, b)))
        .map(|(l, b)| objectcache_range {
            addr: at(l, b) as *mut std::ffi::c_void,
            len: block as u64,
        })
        .collect();
    let p = objectcache_paged_load_params {
        struct_size: std::mem::size_of::<objectcache_paged_load_params>() as u32,
        priority: 0,
        request_id: 3,
        deadline_ms: 0,
        compute_us_per_layer: 0,
        geometry: &geom,
        hashes: packed.as_ptr(),
        hash_len: 32,
        n_chunks: chunks,
        ranges: dst.as_ptr(),
        ranges_per_layer: ids.len(),
        n_layers: layers,
    };
    let mut t = std::ptr::null_mut();
    // SAFETY: parameters valid for the call; the destinations lie in the registered region.
    assert_eq!(
        unsafe { objectcache_load_paged(e, &p, &mut t) },
        OBJECTCACHE_OK
    );
    for l in 0..layers as u32 {
        // SAFETY: a live transfer handle.
        assert_eq!(
            unsafe { objectcache_transfer_wait_layer(t, l, 30_000) },
            OBJECTCACHE_OK
        );
    }
    // SAFETY: a live transfer handle, released once.
    assert_eq!(unsafe { objectcache_transfer_release(t) }, OBJECTCACHE_OK);
    let back: Vec<u8> = stream.clone_dtoh(&kv).unwrap();
    for l in 0..layers {
        for b in 0..blocks {
            let got = &back[(l * blocks + b) * block..][..block];
            match ids.iter().position(|&x| x == b) {
                Some(i) => assert_eq!(
                    got,
                    &host[(l * ids.len() + i) * block..][..block],
                    "layer {l} block {b}"
                ),
                None => assert!(
                    got.iter().all(|&x| x == 0),
                    "block {b} of layer {l} was written"
                ),
            }
        }
    }
    // SAFETY: handles of this test, each released once.
    unsafe {
        assert_eq!(objectcache_deregister_memory(e, region), OBJECTCACHE_OK);
        assert_eq!(objectcache_engine_destroy(e), OBJECTCACHE_OK);
    }
}
