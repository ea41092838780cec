//! The C ABI's constants and `#[repr(C)]` structs, one for one with `ffi/objectcache.h`
//! (which documents each field; `build.rs` checks names, types, layouts and values).

use std::ffi::{c_char, c_void, CStr};

/// ABI version (`OBJECTCACHE_ABI_VERSION`): bumped whenever a signature, a struct or the
/// meaning of a constant changes.
pub const OBJECTCACHE_ABI_VERSION: u32 = 1;

/// A status code: [`OBJECTCACHE_OK`], [`OBJECTCACHE_PENDING`] or an `OBJECTCACHE_ERR_*`.
pub type objectcache_status = i32;

/// Success.
pub const OBJECTCACHE_OK: i32 = 0;
/// Not ready yet (not an error).
pub const OBJECTCACHE_PENDING: i32 = 1;
/// NULL pointer, bad size, out-of-range index or value ([`objectcache_client::Error::InvalidArgument`]).
pub const OBJECTCACHE_ERR_INVALID_ARGUMENT: i32 = 2;
/// ABI version or `struct_size` mismatch.
pub const OBJECTCACHE_ERR_ABI_MISMATCH: i32 = 3;
/// NULL, wrong-kind, destroyed or released handle.
pub const OBJECTCACHE_ERR_INVALID_HANDLE: i32 = 4;
/// Not supported by this build.
pub const OBJECTCACHE_ERR_UNSUPPORTED: i32 = 5;
/// In use (engine with live transfers, region used by a transfer).
pub const OBJECTCACHE_ERR_BUSY: i32 = 6;
/// Output buffer too small.
pub const OBJECTCACHE_ERR_BUFFER_TOO_SMALL: i32 = 7;
/// [`objectcache_client::Error::Config`].
pub const OBJECTCACHE_ERR_CONFIG: i32 = 8;
/// [`objectcache_client::Error::Format`].
pub const OBJECTCACHE_ERR_FORMAT: i32 = 9;
/// [`objectcache_client::StoreError::NotFound`].
pub const OBJECTCACHE_ERR_NOT_FOUND: i32 = 10;
/// Any other [`objectcache_client::Error::Store`].
pub const OBJECTCACHE_ERR_STORE: i32 = 11;
/// [`objectcache_client::Error::Io`].
pub const OBJECTCACHE_ERR_IO: i32 = 12;
/// A caught panic.
pub const OBJECTCACHE_ERR_INTERNAL: i32 = 13;
/// [`objectcache_client::LayerError::Missing`].
pub const OBJECTCACHE_ERR_LAYER_MISSING: i32 = 20;
/// [`objectcache_client::LayerError::ChecksumMismatch`].
pub const OBJECTCACHE_ERR_LAYER_CHECKSUM: i32 = 21;
/// [`objectcache_client::LayerError::GeometryMismatch`].
pub const OBJECTCACHE_ERR_LAYER_GEOMETRY: i32 = 22;
/// [`objectcache_client::LayerError::Storage`].
pub const OBJECTCACHE_ERR_LAYER_STORAGE: i32 = 23;
/// [`objectcache_client::LayerError::Timeout`].
pub const OBJECTCACHE_ERR_LAYER_TIMEOUT: i32 = 24;
/// [`objectcache_client::LayerError::Cancelled`].
pub const OBJECTCACHE_ERR_CANCELLED: i32 = 25;
/// [`objectcache_client::LayerError::Device`]: verified in host memory, the copy to the device failed.
pub const OBJECTCACHE_ERR_LAYER_DEVICE: i32 = 26;

/// bfloat16 ([`objectcache_client::Dtype::Bf16`], header code 1).
pub const OBJECTCACHE_DTYPE_BF16: i32 = 1;
/// IEEE half ([`objectcache_client::Dtype::Fp16`]).
pub const OBJECTCACHE_DTYPE_FP16: i32 = 2;
/// FP8 E4M3 ([`objectcache_client::Dtype::Fp8E4m3`]).
pub const OBJECTCACHE_DTYPE_FP8_E4M3: i32 = 3;
/// IEEE single ([`objectcache_client::Dtype::Fp32`]).
pub const OBJECTCACHE_DTYPE_FP32: i32 = 4;

/// Host memory.
pub const OBJECTCACHE_MEM_HOST: i32 = 0;
/// CUDA device memory (cuda feature).
pub const OBJECTCACHE_MEM_DEVICE: i32 = 1;

/// [`objectcache_client::layout::LayoutFamily::PagedKv`].
pub const OBJECTCACHE_FAMILY_PAGED_KV: i32 = 0;
/// [`objectcache_client::layout::LayoutFamily::MlaLatent`].
pub const OBJECTCACHE_FAMILY_MLA: i32 = 1;
/// [`objectcache_client::layout::LayoutFamily::Recurrent`] (refused).
pub const OBJECTCACHE_FAMILY_RECURRENT: i32 = 2;
/// [`objectcache_client::layout::LayoutFamily::Opaque`].
pub const OBJECTCACHE_FAMILY_OPAQUE: i32 = 3;
/// [`objectcache_client::layout::GroupKind::Full`].
pub const OBJECTCACHE_GROUP_FULL: i32 = 0;
/// [`objectcache_client::layout::GroupKind::SlidingWindow`].
pub const OBJECTCACHE_GROUP_SLIDING_WINDOW: i32 = 1;

/// [`objectcache_client::connector::ChunkStatus::Pending`].
pub const OBJECTCACHE_CHUNK_PENDING: i32 = 0;
/// [`objectcache_client::connector::ChunkStatus::Ok`].
pub const OBJECTCACHE_CHUNK_OK: i32 = 1;
/// [`objectcache_client::connector::ChunkStatus::Missing`].
pub const OBJECTCACHE_CHUNK_MISSING: i32 = 2;
/// [`objectcache_client::connector::ChunkStatus::Corrupt`].
pub const OBJECTCACHE_CHUNK_CORRUPT: i32 = 3;
/// [`objectcache_client::connector::ChunkStatus::WrongGeometry`].
pub const OBJECTCACHE_CHUNK_WRONG_GEOMETRY: i32 = 4;
/// [`objectcache_client::connector::ChunkStatus::Error`].
pub const OBJECTCACHE_CHUNK_ERROR: i32 = 5;

/// Wait without limit (`timeout_ms`).
pub const OBJECTCACHE_WAIT_FOREVER: i32 = -1;

/// Bytes of one segment marker record (`objectcache_segment_markers`): the chunk's prefix
/// position (u64, little-endian), then its 64-byte format version 2 publish marker.
pub const OBJECTCACHE_SEGMENT_MARKER_RECORD_LEN: u32 =
    8 + objectcache_client::layout::SEGMENT_MARKER_LEN as u32;

/// Opaque engine handle (a token, never dereferenced).
#[repr(C)]
pub struct objectcache_engine {
    _unused: [u8; 0],
}

/// Opaque memory-region handle (a token, never dereferenced).
#[repr(C)]
pub struct objectcache_region {
    _unused: [u8; 0],
}

/// Opaque transfer handle (a token, never dereferenced).
#[repr(C)]
pub struct objectcache_transfer {
    _unused: [u8; 0],
}

/// KV geometry (see the header and [`objectcache_client::KvGeometry`]).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct objectcache_geometry {
    /// `sizeof(objectcache_geometry)`.
    pub struct_size: u32,
    /// Layers.
    pub layers: u32,
    /// KV heads before the TP split.
    pub kv_heads: u32,
    /// Head dimension (elements).
    pub head_dim: u32,
    /// `OBJECTCACHE_DTYPE_*`.
    pub dtype: u32,
    /// Tokens per chunk.
    pub tokens_per_chunk: u32,
    /// TP rank.
    pub tp_rank: u32,
    /// TP world size.
    pub tp_world: u32,
    /// Model identifier (NUL-terminated).
    pub model: *const c_char,
    /// The engine's KV layout name (NUL-terminated), or NULL for ObjectCache's canonical
    /// layout. Added in ABI version 1: a caller whose `struct_size` is
    /// [`GEOMETRY_SIZE_NO_LAYOUT`] has neither this nor the next two fields.
    pub layout: *const c_char,
    /// Tokens per engine block of `layout` (0 without a layout).
    pub block_size: u32,
    /// Reserved (0).
    pub _reserved: u32,
}

/// An engine's KV cache layout for one group (see the header and
/// [`objectcache_client::layout::EngineLayout`]).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct objectcache_engine_layout {
    /// `sizeof(objectcache_engine_layout)`.
    pub struct_size: u32,
    /// `OBJECTCACHE_FAMILY_*`.
    pub family: u32,
    /// The engine, its version and device (NUL-terminated).
    pub engine: *const c_char,
    /// The engine's name for its block packing, or an opaque layout's name (NUL-terminated).
    pub order: *const c_char,
    /// Paged K/V: KV heads on this TP rank.
    pub kv_heads: u32,
    /// Paged K/V: elements per head.
    pub head_dim: u32,
    /// MLA: elements per token.
    pub latent_dim: u32,
    /// Tokens per block.
    pub block_size: u32,
    /// `OBJECTCACHE_DTYPE_*`.
    pub dtype: u32,
    /// KV cache groups of the model (1: one).
    pub group_count: u32,
    /// This group's index.
    pub group_index: u32,
    /// `OBJECTCACHE_GROUP_*`.
    pub group_kind: u32,
    /// Sliding window, tokens.
    pub window: u32,
    /// Reserved (0).
    pub _reserved: u32,
    /// Opaque: bytes per token per layer.
    pub bytes_per_token: u64,
    /// The model's group structure digest (NUL-terminated hex), or NULL with one group.
    pub structure: *const c_char,
}

/// `sizeof(objectcache_geometry)` before the layout fields were added to it (40 bytes on
/// LP64): still accepted as `struct_size`, meaning "no layout".
pub const GEOMETRY_SIZE_NO_LAYOUT: usize = std::mem::offset_of!(objectcache_geometry, layout);

/// Hashing parameters (see [`objectcache_client::hash::HashParams`]).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct objectcache_hash_params {
    /// `sizeof(objectcache_hash_params)`.
    pub struct_size: u32,
    /// Tokens per block (0 = the geometry's tokens_per_chunk).
    pub block_size: u32,
    /// Seed (NULL = "0").
    pub seed: *const c_char,
    /// Cache salt (NULL = none).
    pub salt: *const c_char,
}

/// One layer's destination.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct objectcache_layer_dest {
    /// Start address (inside registered memory).
    pub addr: *mut c_void,
    /// Bytes available.
    pub len: u64,
}

/// One byte range of caller memory (`objectcache_range`): a paged destination or source.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct objectcache_range {
    /// First byte.
    pub addr: *mut c_void,
    /// Length in bytes.
    pub len: u64,
}

/// Parameters of a paged load (`objectcache_load_paged`): as [`objectcache_load_params`],
/// with each layer's destination a list of ranges.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct objectcache_paged_load_params {
    /// `sizeof(objectcache_paged_load_params)`.
    pub struct_size: u32,
    /// Scheduling hint (advisory).
    pub priority: u32,
    /// Caller's request id.
    pub request_id: u64,
    /// Scheduling hint: wanted layer-0 time in ms (advisory).
    pub deadline_ms: u64,
    /// Scheduling hint: compute time per layer in µs (advisory).
    pub compute_us_per_layer: u64,
    /// Geometry.
    pub geometry: *const objectcache_geometry,
    /// Packed chunk hashes.
    pub hashes: *const u8,
    /// Bytes per hash.
    pub hash_len: usize,
    /// Number of chunks.
    pub n_chunks: usize,
    /// `n_layers x ranges_per_layer` destination ranges, layer-major.
    pub ranges: *const objectcache_range,
    /// Ranges of each layer.
    pub ranges_per_layer: usize,
    /// Number of layers (= geometry layers).
    pub n_layers: usize,
}

/// Load parameters.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct objectcache_load_params {
    /// `sizeof(objectcache_load_params)`.
    pub struct_size: u32,
    /// Scheduling hint (advisory).
    pub priority: u32,
    /// Caller's request id.
    pub request_id: u64,
    /// Scheduling hint: wanted layer-0 time in ms (advisory).
    pub deadline_ms: u64,
    /// Scheduling hint: compute time per layer in µs (advisory).
    pub compute_us_per_layer: u64,
    /// Geometry.
    pub geometry: *const objectcache_geometry,
    /// Packed chunk hashes.
    pub hashes: *const u8,
    /// Bytes per hash.
    pub hash_len: usize,
    /// Number of chunks.
    pub n_chunks: usize,
    /// Per-layer destinations.
    pub layers: *const objectcache_layer_dest,
    /// Number of destinations (= layers).
    pub n_layers: usize,
}

/// Save outcome.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct objectcache_save_report {
    /// `sizeof(objectcache_save_report)`.
    pub struct_size: u32,
    /// Reserved (0).
    pub _reserved: u32,
    /// Objects written.
    pub written: u64,
    /// Objects already present.
    pub already_present: u64,
    /// Bytes written.
    pub bytes: u64,
}

/// Engine counters (see [`objectcache_client::connector::EngineMetrics`]).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct objectcache_metrics {
    /// `sizeof(objectcache_metrics)`.
    pub struct_size: u32,
    /// Reserved (0).
    pub _reserved: u32,
    /// Loads started.
    pub loads: u64,
    /// Saves completed.
    pub saves: u64,
    /// Lookups answered.
    pub lookups: u64,
    /// Chunks reported as hits.
    pub lookup_hit_chunks: u64,
    /// Marker probes.
    pub lookup_probes: u64,
    /// Bytes written by saves.
    pub bytes_saved: u64,
    /// Unreleased transfers.
    pub live_transfers: u64,
    /// Registered regions.
    pub registered_regions: u64,
}

/// Transfer counters (see [`objectcache_client::connector::LoadStats`]).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct objectcache_transfer_stats {
    /// `sizeof(objectcache_transfer_stats)`.
    pub struct_size: u32,
    /// Layers ready now.
    pub layers_ready: u32,
    /// The load's request id.
    pub request_id: u64,
    /// Storage requests issued.
    pub requests: u64,
    /// Payload bytes received.
    pub bytes: u64,
    /// Time to first layer in seconds (negative if not yet).
    pub ttfl_s: f64,
    /// Time to last layer in seconds (negative if not yet).
    pub ttll_s: f64,
}

/// Input of `objectcache_transfer_stall_advice`: the compute model of the caller's prefill
/// and the request's token counts (see [`objectcache_client::connector::LoadHandle::stall_advice`]).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct objectcache_stall_params {
    /// `sizeof(objectcache_stall_params)`.
    pub struct_size: u32,
    /// Tensor-parallel degree of the prefill (0 counts as 1).
    pub tp: u32,
    /// Compute-model preset (`llama-3.1-8b`, `llama-3.1-70b`, `qwen2.5-7b`, `smollm2-135m`),
    /// NUL-terminated; borrowed for the call.
    pub model: *const c_char,
    /// GPU kind (`a100`, `h100`, `h200`, `gh200`), NUL-terminated; borrowed for the call.
    pub gpu: *const c_char,
    /// Kernel class (`tuned` or `fa2`); NULL means `tuned`.
    pub kernels: *const c_char,
    /// Prefix tokens this load carries (chunks x tokens per chunk).
    pub load_tokens: u64,
    /// Tokens the prefill computes after the prefix.
    pub new_tokens: u64,
    /// Measured compute time per layer in microseconds for `new_tokens` after `load_tokens`
    /// (0: use the analytic model alone); the analytic model scales it to other token counts.
    pub compute_us_per_layer: u64,
}

/// Output of `objectcache_transfer_stall_advice` (see [`objectcache_client::sched::Fallback`]).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct objectcache_stall_advice {
    /// `sizeof(objectcache_stall_advice)`.
    pub struct_size: u32,
    /// 1: cancel the rest of the load and recompute; 0: keep waiting.
    pub recompute: u32,
    /// First layer whose loaded KV is abandoned (recompute); the layer count when waiting.
    pub from_layer: u32,
    /// Reserved (0).
    pub _reserved: u32,
    /// Prefix tokens `0..recompute_tokens` to recompute (0 when waiting): through layers
    /// `0..from_layer` only to rebuild their hidden states, fully from `from_layer` on.
    pub recompute_tokens: u64,
    /// Predicted end of the last layer's compute following this advice, seconds since the
    /// load call (the fixed per-prefill time excluded).
    pub finish_s: f64,
    /// Predicted end if waiting for the load, seconds since the load call.
    pub wait_finish_s: f64,
}

/// A struct of the ABI that starts with `struct_size`.
pub(crate) trait AbiStruct: Sized {
    /// Its C name.
    const NAME: &'static str;
    /// Sets `struct_size` to `size_of::<Self>()`.
    fn set_size(&mut self);
}

macro_rules! abi_struct {
    ($($t:ident),*) => {
        $(impl AbiStruct for $t {
            const NAME: &'static str = stringify!($t);
            fn set_size(&mut self) {
                self.struct_size = std::mem::size_of::<Self>() as u32;
            }
        })*
        /// `sizeof` of an ABI struct by C name, 0 for an unknown name.
        pub(crate) fn struct_size_by_name(name: &[u8]) -> usize {
            $(if name == stringify!($t).as_bytes() {
                return std::mem::size_of::<$t>();
            })*
            if name == b"objectcache_layer_dest" {
                return std::mem::size_of::<objectcache_layer_dest>();
            }
            if name == b"objectcache_range" {
                return std::mem::size_of::<objectcache_range>();
            }
            0
        }
    };
}

abi_struct!(
    objectcache_geometry,
    objectcache_engine_layout,
    objectcache_hash_params,
    objectcache_load_params,
    objectcache_paged_load_params,
    objectcache_save_report,
    objectcache_metrics,
    objectcache_transfer_stats,
    objectcache_stall_params,
    objectcache_stall_advice
);

/// Defines [`struct_field`] over the ABI structs and their fields, in declaration order.
macro_rules! abi_fields {
    ($($t:ident { $($f:ident),* $(,)? })*) => {
        /// Field `index` of the ABI struct with C name `name`, in declaration order: its name
        /// and its offset in bytes; `None` past the last field or for an unknown struct.
        /// Bindings check their view of each struct against it (`objectcache_struct_field`).
        pub(crate) fn struct_field(name: &[u8], index: usize) -> Option<(&'static CStr, usize)> {
            $(if name == stringify!($t).as_bytes() {
                let fields: &[(&'static str, usize)] = &[
                    $((concat!(stringify!($f), "\0"), std::mem::offset_of!($t, $f))),*
                ];
                return fields.get(index).map(|&(f, off)| {
                    (
                        CStr::from_bytes_with_nul(f.as_bytes()).expect("a NUL-terminated literal"),
                        off,
                    )
                });
            })*
            None
        }
    };
}

abi_fields!(
    objectcache_geometry { struct_size, layers, kv_heads, head_dim, dtype, tokens_per_chunk, tp_rank, tp_world, model, layout, block_size, _reserved }
    objectcache_engine_layout { struct_size, family, engine, order, kv_heads, head_dim, latent_dim, block_size, dtype, group_count, group_index, group_kind, window, _reserved, bytes_per_token, structure }
    objectcache_hash_params { struct_size, block_size, seed, salt }
    objectcache_layer_dest { addr, len }
    objectcache_range { addr, len }
    objectcache_paged_load_params { struct_size, priority, request_id, deadline_ms, compute_us_per_layer, geometry, hashes, hash_len, n_chunks, ranges, ranges_per_layer, n_layers }
    objectcache_load_params { struct_size, priority, request_id, deadline_ms, compute_us_per_layer, geometry, hashes, hash_len, n_chunks, layers, n_layers }
    objectcache_save_report { struct_size, _reserved, written, already_present, bytes }
    objectcache_metrics { struct_size, _reserved, loads, saves, lookups, lookup_hit_chunks, lookup_probes, bytes_saved, live_transfers, registered_regions }
    objectcache_transfer_stats { struct_size, layers_ready, request_id, requests, bytes, ttfl_s, ttll_s }
    objectcache_stall_params { struct_size, tp, model, gpu, kernels, load_tokens, new_tokens, compute_us_per_layer }
    objectcache_stall_advice { struct_size, recompute, from_layer, _reserved, recompute_tokens, finish_s, wait_finish_s }
);

/// Static name of a status code.
pub(crate) fn status_name(s: i32) -> &'static CStr {
    match s {
        OBJECTCACHE_OK => c"OBJECTCACHE_OK",
        OBJECTCACHE_PENDING => c"OBJECTCACHE_PENDING",
        OBJECTCACHE_ERR_INVALID_ARGUMENT => c"OBJECTCACHE_ERR_INVALID_ARGUMENT",
        OBJECTCACHE_ERR_ABI_MISMATCH => c"OBJECTCACHE_ERR_ABI_MISMATCH",
        OBJECTCACHE_ERR_INVALID_HANDLE => c"OBJECTCACHE_ERR_INVALID_HANDLE",
        OBJECTCACHE_ERR_UNSUPPORTED => c"OBJECTCACHE_ERR_UNSUPPORTED",
        OBJECTCACHE_ERR_BUSY => c"OBJECTCACHE_ERR_BUSY",
        OBJECTCACHE_ERR_BUFFER_TOO_SMALL => c"OBJECTCACHE_ERR_BUFFER_TOO_SMALL",
        OBJECTCACHE_ERR_CONFIG => c"OBJECTCACHE_ERR_CONFIG",
        OBJECTCACHE_ERR_FORMAT => c"OBJECTCACHE_ERR_FORMAT",
        OBJECTCACHE_ERR_NOT_FOUND => c"OBJECTCACHE_ERR_NOT_FOUND",
        OBJECTCACHE_ERR_STORE => c"OBJECTCACHE_ERR_STORE",
        OBJECTCACHE_ERR_IO => c"OBJECTCACHE_ERR_IO",
        OBJECTCACHE_ERR_INTERNAL => c"OBJECTCACHE_ERR_INTERNAL",
        OBJECTCACHE_ERR_LAYER_MISSING => c"OBJECTCACHE_ERR_LAYER_MISSING",
        OBJECTCACHE_ERR_LAYER_CHECKSUM => c"OBJECTCACHE_ERR_LAYER_CHECKSUM",
        OBJECTCACHE_ERR_LAYER_GEOMETRY => c"OBJECTCACHE_ERR_LAYER_GEOMETRY",
        OBJECTCACHE_ERR_LAYER_STORAGE => c"OBJECTCACHE_ERR_LAYER_STORAGE",
        OBJECTCACHE_ERR_LAYER_TIMEOUT => c"OBJECTCACHE_ERR_LAYER_TIMEOUT",
        OBJECTCACHE_ERR_CANCELLED => c"OBJECTCACHE_ERR_CANCELLED",
        OBJECTCACHE_ERR_LAYER_DEVICE => c"OBJECTCACHE_ERR_LAYER_DEVICE",
        _ => c"unknown status",
    }
}
