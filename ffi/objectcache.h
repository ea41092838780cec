/*
 * objectcache.h: the C ABI of ObjectCache (layerwise object-storage retrieval of prefix KV
 * cache for LLM serving). Link with -lobjectcache (see objectcache.pc).
 *
 * This header is the contract: the Rust exports (crates/objectcache-capi/src/) are checked against it at build
 * time (build.rs), so a mismatch of a function signature, struct layout or constant fails
 * the build.
 *
 * Conventions (see docs/c-abi.md):
 *  - Versioning. OBJECTCACHE_ABI_VERSION changes whenever a signature, a struct or the
 *    meaning of a constant changes. objectcache_engine_create() takes the version the caller
 *    was compiled with and refuses another one. Every struct passed across the boundary
 *    starts with `uint32_t struct_size` that the caller sets to sizeof(the struct); the
 *    library refuses any other size with OBJECTCACHE_ERR_ABI_MISMATCH (except the earlier
 *    size of objectcache_geometry, which grew at its end within version 1: see there).
 *  - Handles (objectcache_engine, objectcache_region, objectcache_transfer) are opaque
 *    tokens, never dereferenced by the caller. A handle that was destroyed or released is
 *    detected and refused with OBJECTCACHE_ERR_INVALID_HANDLE (tokens are never reused),
 *    so a double release is an error, not a crash.
 *  - Errors. Every function that can fail returns an objectcache_status: 0 is success,
 *    OBJECTCACHE_PENDING (1) means "not yet" (not an error), anything else is an error code
 *    below. objectcache_last_error() then gives a message naming what was wrong.
 *  - Pointers. Unless stated otherwise, pointer arguments are borrowed for the duration of
 *    the call only, and the library copies what it keeps. NULL is refused with
 *    OBJECTCACHE_ERR_INVALID_ARGUMENT wherever a pointer is required.
 *  - Threads. Every function is safe to call from any thread, concurrently, unless its
 *    comment says otherwise. Blocking functions block only the calling thread.
 *  - No Rust panic crosses this boundary: an internal failure is reported as
 *    OBJECTCACHE_ERR_INTERNAL.
 */
#ifndef OBJECTCACHE_H
#define OBJECTCACHE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- Version ------------------------------------------------------------------------ */

/** ABI version of this header. */
#define OBJECTCACHE_ABI_VERSION 1

/* ---- Status codes (stable integers; never renumbered within an ABI version) --------- */

/** Success. */
#define OBJECTCACHE_OK 0
/** Not an error: the layer or transfer is not ready yet (poll, or a wait that timed out). */
#define OBJECTCACHE_PENDING 1
/** A NULL pointer, a zero or inconsistent size, an out-of-range index or value. */
#define OBJECTCACHE_ERR_INVALID_ARGUMENT 2
/** The caller's ABI version or a struct_size does not match this library. */
#define OBJECTCACHE_ERR_ABI_MISMATCH 3
/** A handle that is NULL, of the wrong kind, destroyed or released. */
#define OBJECTCACHE_ERR_INVALID_HANDLE 4
/** Not supported by this build (e.g. device memory without the cuda feature). */
#define OBJECTCACHE_ERR_UNSUPPORTED 5
/** The object is in use (an engine with live transfers, a region used by a transfer). */
#define OBJECTCACHE_ERR_BUSY 6
/** An output buffer is too small; the needed count is written where the function says. */
#define OBJECTCACHE_ERR_BUFFER_TOO_SMALL 7
/** A configuration key is unknown or its value does not parse (Rust Error::Config). */
#define OBJECTCACHE_ERR_CONFIG 8
/** Bytes are not a valid KV object of the expected format (Rust Error::Format). */
#define OBJECTCACHE_ERR_FORMAT 9
/** The object store reports that an object does not exist (StoreError::NotFound). */
#define OBJECTCACHE_ERR_NOT_FOUND 10
/** Any other object store failure (Rust Error::Store). */
#define OBJECTCACHE_ERR_STORE 11
/** An operating-system I/O failure outside the store (Rust Error::Io). */
#define OBJECTCACHE_ERR_IO 12
/** An internal failure (a caught Rust panic); the message says where. */
#define OBJECTCACHE_ERR_INTERNAL 13
/** Layer miss: a chunk object is missing (LayerError::Missing). */
#define OBJECTCACHE_ERR_LAYER_MISSING 20
/** Layer miss: a slice failed its CRC32C (LayerError::ChecksumMismatch). */
#define OBJECTCACHE_ERR_LAYER_CHECKSUM 21
/** Layer miss: an object has another geometry or format (LayerError::GeometryMismatch). */
#define OBJECTCACHE_ERR_LAYER_GEOMETRY 22
/** Layer miss: storage or transport failed (LayerError::Storage). */
#define OBJECTCACHE_ERR_LAYER_STORAGE 23
/** Layer miss: the load's deadline (load_timeout_ms) passed (LayerError::Timeout), or nothing
 *  arrived for the stall limit (stall_timeout_ms; LayerError::Stalled). */
#define OBJECTCACHE_ERR_LAYER_TIMEOUT 24
/** Layer miss: the transfer was cancelled (LayerError::Cancelled). */
#define OBJECTCACHE_ERR_CANCELLED 25
/** Layer miss: verified in host memory, its copy to device memory failed
 *  (LayerError::Device; cuda builds only). */
#define OBJECTCACHE_ERR_LAYER_DEVICE 26

/** A status code (one of the OBJECTCACHE_OK / _PENDING / _ERR_* values). */
typedef int32_t objectcache_status;

/* ---- Enumerations -------------------------------------------------------------------- */

/** Element types of KV tensors (objectcache_geometry.dtype). */
#define OBJECTCACHE_DTYPE_BF16 1
#define OBJECTCACHE_DTYPE_FP16 2
#define OBJECTCACHE_DTYPE_FP8_E4M3 3
#define OBJECTCACHE_DTYPE_FP32 4

/** Memory kinds (objectcache_register_memory). */
#define OBJECTCACHE_MEM_HOST 0
#define OBJECTCACHE_MEM_DEVICE 1

/** Per-chunk status of a transfer (objectcache_transfer_chunk_status). */
#define OBJECTCACHE_CHUNK_PENDING 0
#define OBJECTCACHE_CHUNK_OK 1
#define OBJECTCACHE_CHUNK_MISSING 2
#define OBJECTCACHE_CHUNK_CORRUPT 3
#define OBJECTCACHE_CHUNK_WRONG_GEOMETRY 4
#define OBJECTCACHE_CHUNK_ERROR 5

/** What one block of one layer holds (objectcache_engine_layout::family). */
#define OBJECTCACHE_FAMILY_PAGED_KV 0
#define OBJECTCACHE_FAMILY_MLA 1
#define OBJECTCACHE_FAMILY_RECURRENT 2
#define OBJECTCACHE_FAMILY_OPAQUE 3

/** Kinds of KV cache group (objectcache_engine_layout::group_kind). */
#define OBJECTCACHE_GROUP_FULL 0
#define OBJECTCACHE_GROUP_SLIDING_WINDOW 1

/** Wait forever (timeout_ms argument of the wait functions). */
#define OBJECTCACHE_WAIT_FOREVER (-1)

/* ---- Opaque handles ------------------------------------------------------------------ */

/** An engine: one per process or per TP rank, shared by threads. */
typedef struct objectcache_engine objectcache_engine;
/** A registered memory region of an engine. */
typedef struct objectcache_region objectcache_region;
/** One load in progress into registered memory. */
typedef struct objectcache_transfer objectcache_transfer;

/* ---- Structs (each starts with struct_size = sizeof(the struct), set by the caller) --- */

/** Shape of one model's KV cache as one TP rank stores it. A chunk of tokens_per_chunk
 *  tokens holds, per layer, K then V of shape [tokens, kv_heads / tp_world, head_dim] (or,
 *  with a layout, the engine's blocks of those tokens as the engine holds them); one
 *  chunk's one-layer slice is 2 x tokens_per_chunk x (kv_heads / tp_world) x head_dim
 *  x dtype bytes (objectcache_slice_bytes).
 *
 *  The last three fields (layout, block_size, _reserved) were added within ABI version 1:
 *  a caller built before them passes the smaller struct_size (offsetof(objectcache_geometry,
 *  layout), 40 on LP64), which the library still accepts, reading no further and taking no
 *  layout. Zero-initialise the struct and set struct_size = sizeof, and a NULL layout keeps
 *  the keys geometries always had. */
typedef struct objectcache_geometry {
    uint32_t struct_size;
    /** Transformer layers (1..1024). */
    uint32_t layers;
    /** KV heads of the whole model (before the TP split). */
    uint32_t kv_heads;
    /** Head dimension in elements. */
    uint32_t head_dim;
    /** OBJECTCACHE_DTYPE_*. */
    uint32_t dtype;
    /** Tokens per chunk object (the engine's block size as ObjectCache sees it). */
    uint32_t tokens_per_chunk;
    /** This process's tensor-parallel rank, 0..tp_world-1. */
    uint32_t tp_rank;
    /** Tensor-parallel world size (1 without TP). */
    uint32_t tp_world;
    /** Model identifier, NUL-terminated UTF-8; borrowed for the call. Enters the keys, so
     *  two models of equal shape never share entries. */
    const char *model;
    /** The engine's own KV layout, NUL-terminated (1..64 bytes of [A-Za-z0-9._:/+-], e.g.
     *  "vllm/cpu_attn"), or NULL for ObjectCache's canonical K-then-V layout; borrowed for the
     *  call. With a layout, a chunk's layer slice holds that layer's engine blocks for the
     *  chunk's tokens, in token order, stored byte for byte as the engine holds them. The
     *  layout and block_size enter the keys (with dtype, kv_heads, head_dim and the TP
     *  size/rank already there): an engine whose layout differs, even at the same byte size,
     *  gets misses, never bytes of another meaning. Name a version in it when the engine may
     *  change its layout under the same name. */
    const char *layout;
    /** Tokens per engine block of the layout; must divide tokens_per_chunk. 0 when layout
     *  is NULL. */
    uint32_t block_size;
    /** Reserved, 0. */
    uint32_t _reserved;
} objectcache_geometry;

/** Parameters of vLLM-compatible sha256_cbor prefix hashing. */
typedef struct objectcache_hash_params {
    uint32_t struct_size;
    /** Tokens per hashed block; must equal the geometry's tokens_per_chunk when used with a
     *  geometry (0 = take tokens_per_chunk). */
    uint32_t block_size;
    /** The engine's hash seed (vLLM: PYTHONHASHSEED), NUL-terminated; NULL means "0".
     *  Borrowed for the call. */
    const char *seed;
    /** Cache salt of the first block (vLLM cache_salt), NUL-terminated; NULL for none.
     *  Borrowed for the call. */
    const char *salt;
} objectcache_hash_params;

/** One layer's destination of a load: chunk c's slice lands at addr + c x slice_bytes. */
typedef struct objectcache_layer_dest {
    /** Start of the destination; must lie inside memory registered with the engine. */
    void *addr;
    /** Bytes available at addr; at least n_chunks x slice_bytes. */
    uint64_t len;
} objectcache_layer_dest;

/** One byte range of caller memory, addr .. addr + len: a paged load's destination
 *  (inside registered memory) or a paged save's source. */
typedef struct objectcache_range {
    void *addr;
    /** Bytes, at least 1. */
    uint64_t len;
} objectcache_range;

/** What to load, where to, and scheduling hints. */
typedef struct objectcache_load_params {
    uint32_t struct_size;
    /** Scheduling hint: larger is more urgent (0 = normal). A gather server whose scheduler
     *  is `priority` admits loads in this order (values above 127 count as 127). */
    uint32_t priority;
    /** Caller's request id (e.g. vLLM's request id hashed to 64 bits); appears in error
     *  messages and the transfer's stats. */
    uint64_t request_id;
    /** Scheduling hint: the caller needs layer 0 this many ms after the call (0 = none).
     *  With compute_us_per_layer, layer l is needed at deadline_ms + l x compute time;
     *  alone, every layer is needed by then. The bandwidth schedulers (the engine's on the
     *  ranged-GET path, the server's on the gather path) use it; it never fails a load (the
     *  hard deadline is the engine's load_timeout_ms). At most 4,294,967 ms (u32 us). */
    uint64_t deadline_ms;
    /** Scheduling hint: the caller's compute time per layer in microseconds, i.e. how long
     *  each layer's transfer may take while still hidden (0 = unknown); used by the
     *  bandwidth schedulers as above. At most 4,294,967,295 us; larger values are refused
     *  with OBJECTCACHE_ERR_INVALID_ARGUMENT. */
    uint64_t compute_us_per_layer;
    /** Geometry the objects were saved with; borrowed for the call. */
    const objectcache_geometry *geometry;
    /** n_chunks chunk hashes, each hash_len bytes (32 under hash_algo sha256cbor,
     *  the default; 1..64 under ext; another length is refused), packed;
     *  borrowed for the call. */
    const uint8_t *hashes;
    size_t hash_len;
    size_t n_chunks;
    /** geometry->layers destinations, one per layer; the array is borrowed for the call,
     *  the memory it points to is written until the transfer is released. */
    const objectcache_layer_dest *layers;
    size_t n_layers;
} objectcache_load_params;

/** A paged load (objectcache_load_paged): as objectcache_load_params, except that each
 *  layer's destination is a list of ranges, e.g. one per engine block of the chunks' tokens
 *  in an engine that keeps KV in fixed-size blocks spread through one large buffer. */
typedef struct objectcache_paged_load_params {
    uint32_t struct_size;
    /** As objectcache_load_params.priority. */
    uint32_t priority;
    /** As objectcache_load_params.request_id. */
    uint64_t request_id;
    /** As objectcache_load_params.deadline_ms. */
    uint64_t deadline_ms;
    /** As objectcache_load_params.compute_us_per_layer. */
    uint64_t compute_us_per_layer;
    /** As objectcache_load_params.geometry. */
    const objectcache_geometry *geometry;
    /** As objectcache_load_params.hashes (n_chunks hashes of hash_len bytes, packed). */
    const uint8_t *hashes;
    size_t hash_len;
    size_t n_chunks;
    /** n_layers x ranges_per_layer destination ranges, layer-major: layer l's ranges are
     *  ranges[l x ranges_per_layer .. (l + 1) x ranges_per_layer - 1], taken in order as one
     *  buffer in which chunk c's slice is bytes c x slice_bytes .. (c + 1) x slice_bytes.
     *  Each layer's ranges add up to exactly n_chunks x slice_bytes. The array is borrowed
     *  for the call; the memory it names is written until the transfer is released. */
    const objectcache_range *ranges;
    size_t ranges_per_layer;
    /** = geometry->layers. */
    size_t n_layers;
} objectcache_paged_load_params;

/** Outcome of a save. */
typedef struct objectcache_save_report {
    uint32_t struct_size;
    uint32_t _reserved;
    /** Chunk objects this call wrote. */
    uint64_t written;
    /** Chunk objects already present (another writer won; not an error). */
    uint64_t already_present;
    /** Bytes written (data objects and publish markers). */
    uint64_t bytes;
} objectcache_save_report;

/** Input of objectcache_transfer_stall_advice: the compute model of the caller's prefill and
 *  the request's token counts. */
typedef struct objectcache_stall_params {
    uint32_t struct_size;
    /** Tensor-parallel degree of the prefill (0 counts as 1). */
    uint32_t tp;
    /** Compute-model preset: "llama-3.1-8b", "llama-3.1-70b", "qwen2.5-7b", "smollm2-135m". */
    const char *model;
    /** GPU kind: "a100", "h100", "h200", "gh200". */
    const char *gpu;
    /** Kernel class: "tuned" (engine-class kernels, FA3 on Hopper) or "fa2"; NULL = "tuned". */
    const char *kernels;
    /** Prefix tokens this load carries (chunks x tokens per chunk); at most 2^26. */
    uint64_t load_tokens;
    /** Tokens the prefill computes after the prefix; at most 2^26. */
    uint64_t new_tokens;
    /** Measured compute time per layer in microseconds for new_tokens after load_tokens
     *  (0 = the analytic model alone; at most 4,294,967,295); the analytic model scales it to
     *  other token counts. */
    uint64_t compute_us_per_layer;
} objectcache_stall_params;

/** Output of objectcache_transfer_stall_advice. Times are seconds since objectcache_load,
 *  without the fixed per-prefill time (equal for both choices). */
typedef struct objectcache_stall_advice {
    uint32_t struct_size;
    /** 1: cancel the rest of the load and recompute; 0: keep waiting. */
    uint32_t recompute;
    /** First layer whose loaded KV is abandoned; the layer count when waiting. */
    uint32_t from_layer;
    uint32_t _reserved;
    /** Prefix tokens 0..recompute_tokens to recompute (0 when waiting): through layers
     *  0..from_layer only to rebuild their hidden states (their KV is present), fully from
     *  from_layer on. */
    uint64_t recompute_tokens;
    /** Predicted end of the last layer's compute following this advice. */
    double finish_s;
    /** Predicted end if waiting for the load instead: infinity when a remaining layer has
     *  failed (a miss, or the load was cancelled), since it will never be ready. */
    double wait_finish_s;
} objectcache_stall_advice;

/** Counters of an engine since creation. */
typedef struct objectcache_metrics {
    uint32_t struct_size;
    uint32_t _reserved;
    uint64_t loads;
    uint64_t saves;
    uint64_t lookups;
    uint64_t lookup_hit_chunks;
    uint64_t lookup_probes;
    uint64_t bytes_saved;
    /** Transfers posted and not yet released. */
    uint64_t live_transfers;
    /** Memory regions registered now. */
    uint64_t registered_regions;
} objectcache_metrics;

/** Counters of one transfer. */
typedef struct objectcache_transfer_stats {
    uint32_t struct_size;
    uint32_t layers_ready;
    /** The request id given at load time. */
    uint64_t request_id;
    /** Storage requests issued. */
    uint64_t requests;
    /** Payload bytes received and verified. */
    uint64_t bytes;
    /** Seconds from load to layer 0 ready (time to first layer); negative if not yet. */
    double ttfl_s;
    /** Seconds from load to the last layer ready; negative if not every layer is ready. */
    double ttll_s;
} objectcache_transfer_stats;

/** An engine's KV cache layout for one KV cache group, as a typed value: what one block of
 *  one layer holds and the group the layers belong to. objectcache_engine_layout_resolve
 *  gives the layout name for objectcache_geometry::layout (the same names the vLLM connector
 *  used before this struct: existing keys stay valid), the bytes of one block, and the
 *  geometry's kv_heads and head_dim. Strings are borrowed for the call. */
typedef struct objectcache_engine_layout {
    uint32_t struct_size;
    /** OBJECTCACHE_FAMILY_*: PAGED_KV (K and V of kv_heads heads of head_dim elements per
     *  token, packed as the engine packs them), MLA (one latent of latent_dim elements per
     *  token, the same on every TP rank: stored once), RECURRENT (refused: not stored),
     *  OPAQUE (named by order verbatim, with bytes_per_token). */
    uint32_t family;
    /** The engine, its version and device, e.g. "vllm0.32/cpu-amx"; [A-Za-z0-9._:/+-]. */
    const char *engine;
    /** The engine's name for its block packing (vLLM's KV cache layout: "NHD", "HND",
     *  "LBHNC"), or, for OPAQUE, the layout's whole name after the engine's. */
    const char *order;
    /** PAGED_KV: KV heads on this TP rank and elements per head. */
    uint32_t kv_heads;
    uint32_t head_dim;
    /** MLA: elements per token (even). */
    uint32_t latent_dim;
    /** Tokens per block. */
    uint32_t block_size;
    /** OBJECTCACHE_DTYPE_*. */
    uint32_t dtype;
    /** The model's KV cache groups (1: one group, the fields below unused) and this one's
     *  index. */
    uint32_t group_count;
    uint32_t group_index;
    /** OBJECTCACHE_GROUP_*, and the window in tokens of a SLIDING_WINDOW group. */
    uint32_t group_kind;
    uint32_t window;
    /** Reserved, 0. */
    uint32_t _reserved;
    /** OPAQUE: bytes per token per layer (a whole number of 2 x dtype bytes). */
    uint64_t bytes_per_token;
    /** With several groups: a digest of the model's group structure, 1 to 16 hex digits
     *  (each group's kind, window and layers; a change makes every key another). NULL with
     *  one group. */
    const char *structure;
} objectcache_engine_layout;

/* ---- Library ------------------------------------------------------------------------- */

/** The library's ABI version (compare with OBJECTCACHE_ABI_VERSION). Thread-safe. */
uint32_t objectcache_abi_version(void);

/** The library's version string, e.g. "0.1.0"; static, never freed. Thread-safe. */
const char *objectcache_version(void);

/** sizeof each struct as this library was built, by name ("objectcache_geometry", ...);
 *  0 for an unknown name. Thread-safe. */
size_t objectcache_struct_size(const char *name);

/** Field index (0, 1, ...) of the ABI struct named name ("objectcache_geometry", ...), in
 *  declaration order, as this library was built: its name (static, never freed), and its
 *  offset in bytes in *offset when offset is not NULL. NULL past the last field or for an
 *  unknown struct. Bindings that declare the structs themselves (the Python package) check
 *  every field's name and offset against it when they load the library. Thread-safe. */
const char *objectcache_struct_field(const char *name, size_t index, size_t *offset);

/** Message of the last error on the calling thread ("" if none). The string belongs to the
 *  library and stays valid until the next failing call on the same thread; successful
 *  calls leave it unchanged. Thread-local, so thread-safe. */
const char *objectcache_last_error(void);

/** The settings objectcache_engine_create() accepts, comma-separated without spaces, in
 *  the library's order ("store,namespace,hash_algo,..."; docs/c-abi.md lists their
 *  meanings); static, never freed. Bindings take their list of settings from here rather
 *  than keeping a copy. Thread-safe. */
const char *objectcache_config_keys(void);

/** A static name for a status code ("OBJECTCACHE_ERR_CONFIG", ...; "unknown status" for
 *  others); never freed. Thread-safe. */
const char *objectcache_status_name(objectcache_status status);

/** Bytes of one chunk's one-layer slice (K and V) for a geometry, written to *out.
 *  Thread-safe. */
objectcache_status objectcache_slice_bytes(const objectcache_geometry *geometry, uint64_t *out);

/** Resolves an engine layout (objectcache_engine_layout) for a TP world of tp_world ranks:
 *  its layout name, NUL-terminated, into name (caller-owned, cap bytes; 65 always suffice;
 *  OBJECTCACHE_ERR_BUFFER_TOO_SMALL otherwise), *block_bytes = bytes of one block of one
 *  layer, *kv_heads and *head_dim = the geometry's (whole model, before the TP split; MLA:
 *  1 and latent_dim / 2), *stored_once = 1 when every TP rank holds the same bytes (MLA:
 *  use rank 0 of a world of 1 in the geometry), else 0. Errors: OBJECTCACHE_ERR_UNSUPPORTED
 *  for RECURRENT; OBJECTCACHE_ERR_INVALID_ARGUMENT naming the field (a zero dimension, an
 *  odd latent, a name over 64 bytes or with other characters, a group index out of range,
 *  a structure that is not 1 to 16 hex digits). Thread-safe. */
objectcache_status objectcache_engine_layout_resolve(const objectcache_engine_layout *layout,
                                                     uint32_t tp_world, char *name,
                                                     size_t cap, uint64_t *block_bytes,
                                                     uint32_t *kv_heads, uint32_t *head_dim,
                                                     uint32_t *stored_once);

/** vLLM-compatible sha256_cbor hashes of every full block of tokens (a trailing partial
 *  block gets none). Writes *n_chunks = n_tokens / block_size, and, if out_cap_bytes
 *  >= 32 x *n_chunks, the 32-byte hashes packed into out (caller-owned); otherwise returns
 *  OBJECTCACHE_ERR_BUFFER_TOO_SMALL. out may be NULL when out_cap_bytes is 0. Thread-safe. */
objectcache_status objectcache_chunk_hashes(const objectcache_hash_params *params,
                                            const uint32_t *tokens, size_t n_tokens,
                                            uint8_t *out, size_t out_cap_bytes,
                                            size_t *n_chunks);

/* ---- Engine -------------------------------------------------------------------------- */

/** Creates an engine from n key/value settings (the names of the Rust EngineConfig:
 *  store, namespace, hash_algo, window_bytes, max_requests, coalesce_bytes, lookup_fanout,
 *  lookup_cache_ttl_ms, lookup_deadline_ms, load_timeout_ms, load_min_rate_bytes_per_s, stall_timeout_ms,
 *  save_concurrency, worker_threads, cpus, gather, gather_streams, single_flight, self_check,
 *  transport, scheduler, bandwidth_cap_bytes_per_s, save_format, segment_max_bytes); unset keys keep
 *  their defaults. keys and values are arrays of n NUL-terminated strings, borrowed for the
 *  call (both may be NULL when n is 0). abi_version must be OBJECTCACHE_ABI_VERSION. On
 *  success *out receives an engine the caller owns and frees with objectcache_engine_destroy.
 *  An unknown key fails with OBJECTCACHE_ERR_CONFIG naming it. Thread-safe. */
objectcache_status objectcache_engine_create(uint32_t abi_version, const char *const *keys,
                                             const char *const *values, size_t n,
                                             objectcache_engine **out);

/** Destroys an engine and its region registrations. Fails with OBJECTCACHE_ERR_BUSY while
 *  a transfer of it is not released. Thread-safe; destroying twice is
 *  OBJECTCACHE_ERR_INVALID_HANDLE. */
objectcache_status objectcache_engine_destroy(objectcache_engine *engine);

/** Registers memory that loads may write into. addr/len stay owned by the caller, who keeps
 *  them valid until objectcache_deregister_memory. kind is OBJECTCACHE_MEM_HOST, or
 *  OBJECTCACHE_MEM_DEVICE with device the CUDA ordinal (OBJECTCACHE_ERR_UNSUPPORTED in
 *  builds without the cuda feature). *out receives the region handle. Thread-safe. */
objectcache_status objectcache_register_memory(objectcache_engine *engine, void *addr,
                                               size_t len, int32_t kind, int32_t device,
                                               objectcache_region **out);

/** Deregisters a region. Fails with OBJECTCACHE_ERR_BUSY while an unreleased transfer writes
 *  into it. Thread-safe; deregistering twice is OBJECTCACHE_ERR_INVALID_HANDLE. */
objectcache_status objectcache_deregister_memory(objectcache_engine *engine,
                                                 objectcache_region *region);

/** Counters of the engine; out is caller-owned with out->struct_size set. Thread-safe. */
objectcache_status objectcache_metrics_get(objectcache_engine *engine,
                                           objectcache_metrics *out);

/** What the engine's store self-check found (engine setting self_check; the checks of
 *  `objectcache doctor`): *out receives 0 when the store is not checked (a local store,
 *  self_check off, or the check still running), 1 safe, 2 safe with a shorter idle time for
 *  pooled connections (the log names the store URL setting), 3 refused (saves fail with
 *  OBJECTCACHE_ERR_UNSUPPORTED naming the failed check). Thread-safe. */
objectcache_status objectcache_store_mode(objectcache_engine *engine, uint32_t *out);

/* ---- Lookup, save -------------------------------------------------------------------- */

/** Longest cached prefix: *hit_chunks receives how many leading chunks of hashes (n_chunks
 *  hashes of hash_len bytes, packed) are published. Blocks for at most a few storage round
 *  trips. Thread-safe. */
objectcache_status objectcache_lookup(objectcache_engine *engine,
                                      const objectcache_geometry *geometry,
                                      const uint8_t *hashes, size_t hash_len,
                                      size_t n_chunks, size_t *hit_chunks);

/** As objectcache_lookup, hashing tokens first (objectcache_chunk_hashes with params).
 *  Cached tokens = *hit_chunks x geometry->tokens_per_chunk. Thread-safe. */
objectcache_status objectcache_lookup_tokens(objectcache_engine *engine,
                                             const objectcache_geometry *geometry,
                                             const objectcache_hash_params *params,
                                             const uint32_t *tokens, size_t n_tokens,
                                             size_t *hit_chunks);

/** Bytes of one segment marker record (objectcache_segment_markers): the chunk's prefix
 *  position (uint64_t, little-endian), then its 64-byte format version 2 publish marker. */
#define OBJECTCACHE_SEGMENT_MARKER_RECORD_LEN 72

/** The format version 2 publish markers that this engine's lookup of these chunks (hashes as
 *  for objectcache_lookup) read within lookup_cache_ttl_ms, one per segment object, as
 *  records of OBJECTCACHE_SEGMENT_MARKER_RECORD_LEN bytes; never more than n_chunks. An
 *  engine that loads these chunks elsewhere (vLLM: the scheduler looks up, its workers load)
 *  takes them with objectcache_segment_markers_add, so its load places the chunks without
 *  reading markers itself. *n_records receives the number of records (0 for a prefix of
 *  format version 1 chunk objects, or when nothing was looked up); they are written to
 *  records when cap_records is at least that many (records may be NULL when cap_records is
 *  0: a query), else OBJECTCACHE_ERR_INVALID_ARGUMENT naming both counts. Thread-safe. */
objectcache_status objectcache_segment_markers(objectcache_engine *engine,
                                               const objectcache_geometry *geometry,
                                               const uint8_t *hashes, size_t hash_len,
                                               size_t n_chunks, uint8_t *records,
                                               size_t cap_records, size_t *n_records);

/** Takes n_records segment marker records (objectcache_segment_markers of another engine,
 *  for the same hashes in the same order) as if this engine's lookup had read them: loads of
 *  these chunks posted within lookup_cache_ttl_ms place them from the records. A record
 *  whose position is not below n_chunks, or whose marker does not decode as a version 2
 *  marker, is OBJECTCACHE_ERR_INVALID_ARGUMENT naming its index (and nothing is taken).
 *  Thread-safe. */
objectcache_status objectcache_segment_markers_add(objectcache_engine *engine,
                                                   const objectcache_geometry *geometry,
                                                   const uint8_t *hashes, size_t hash_len,
                                                   size_t n_chunks, const uint8_t *records,
                                                   size_t n_records);

/** Saves a prefix's KV and blocks until it is published. layers is an array of n_layers
 *  (= geometry->layers) pointers, each to bytes_per_layer = n_chunks x slice_bytes bytes
 *  holding chunk c's slice at c x slice_bytes; all borrowed for the call (no registration
 *  needed). Chunks already stored are not rewritten. report may be NULL; otherwise it is
 *  caller-owned with report->struct_size set. Thread-safe. */
objectcache_status objectcache_save(objectcache_engine *engine,
                                    const objectcache_geometry *geometry,
                                    const uint8_t *hashes, size_t hash_len, size_t n_chunks,
                                    const void *const *layers, size_t n_layers,
                                    uint64_t bytes_per_layer,
                                    objectcache_save_report *report);

/** As objectcache_save, from paged memory: ranges holds n_layers (= geometry->layers) x
 *  ranges_per_layer source ranges, layer-major; layer l's ranges, taken in order as one
 *  buffer, hold chunk c's slice at c x slice_bytes and add up to exactly n_chunks x
 *  slice_bytes (for a paged engine: one range per engine block of the chunks' tokens, in
 *  token order). The ranges are only read, borrowed for the call, need no registration and
 *  may lie anywhere (even overlap). A range with a NULL addr or a len of 0, or a layer whose
 *  total differs, is OBJECTCACHE_ERR_INVALID_ARGUMENT naming it. Blocks until published;
 *  chunks already stored are not rewritten (report->already_present). Thread-safe. */
objectcache_status objectcache_save_paged(objectcache_engine *engine,
                                          const objectcache_geometry *geometry,
                                          const uint8_t *hashes, size_t hash_len,
                                          size_t n_chunks, const objectcache_range *ranges,
                                          size_t ranges_per_layer, size_t n_layers,
                                          objectcache_save_report *report);

/* ---- Load (transfers) ---------------------------------------------------------------- */

/** Posts a layer-ordered load and returns at once; *out receives the transfer, which the
 *  caller owns and frees with objectcache_transfer_release. Each destination must lie inside
 *  one region registered with this engine and must not overlap another; the library writes
 *  there until release, and the caller must not touch a layer's bytes before that layer is
 *  ready. Thread-safe. */
objectcache_status objectcache_load(objectcache_engine *engine,
                                    const objectcache_load_params *params,
                                    objectcache_transfer **out);

/** As objectcache_load, into paged destinations (objectcache_paged_load_params): the bytes
 *  of each layer land straight in its ranges on every path (ranged GETs, gather over TCP or
 *  RDMA; device ranges through their staging twin), with no copy in between. Every range
 *  must be non-empty and lie inside one region registered with this engine (register the
 *  engine's whole KV buffer once), and no two ranges of the load (of one layer or of two)
 *  may share a byte; a range outside registered memory, two that overlap (both named), or a
 *  layer whose ranges do not add up to n_chunks x slice_bytes is
 *  OBJECTCACHE_ERR_INVALID_ARGUMENT. The transfer is used as any other: a layer is
 *  OBJECTCACHE_OK only once all of its ranges hold verified KV; a miss code means none of
 *  that layer's ranges may be used. Thread-safe. */
objectcache_status objectcache_load_paged(objectcache_engine *engine,
                                          const objectcache_paged_load_params *params,
                                          objectcache_transfer **out);

/** Non-blocking: OBJECTCACHE_OK if layer is ready (its bytes are verified KV),
 *  OBJECTCACHE_PENDING if not yet, else the layer's miss code (20..25). Thread-safe. */
objectcache_status objectcache_transfer_poll_layer(objectcache_transfer *transfer,
                                                   uint32_t layer);

/** Blocks until layer is ready or failed, or timeout_ms passes (OBJECTCACHE_PENDING; the
 *  load goes on). timeout_ms 0 polls; OBJECTCACHE_WAIT_FOREVER waits without limit.
 *  Thread-safe; any number of threads may wait on one transfer. */
objectcache_status objectcache_transfer_wait_layer(objectcache_transfer *transfer,
                                                   uint32_t layer, int64_t timeout_ms);

/** Blocks until every layer is ready (OBJECTCACHE_OK), one failed (its code), or timeout_ms
 *  passes (OBJECTCACHE_PENDING). Thread-safe. */
objectcache_status objectcache_transfer_wait_all(objectcache_transfer *transfer,
                                                 int64_t timeout_ms);

/** Per-chunk status (OBJECTCACHE_CHUNK_*), one byte per chunk into out (caller-owned, cap
 *  bytes). *n receives the number of chunks; OBJECTCACHE_ERR_BUFFER_TOO_SMALL if cap < *n.
 *  Thread-safe. */
objectcache_status objectcache_transfer_chunk_status(objectcache_transfer *transfer,
                                                     uint8_t *out, size_t cap, size_t *n);

/** Counters of the transfer; out is caller-owned with out->struct_size set. Thread-safe. */
objectcache_status objectcache_transfer_stats_get(objectcache_transfer *transfer,
                                                  objectcache_transfer_stats *out);

/** The planner's deadline fallback, now: call it when a layer the prefill needs is late.
 *  From this load's own progress (the first layer not ready, the bytes each later layer
 *  lacks, the rate so far, when the prefill finishes the ready layers under the compute
 *  model of params), it advises keeping on waiting or cancelling the rest of the load
 *  (objectcache_transfer_cancel) and recomputing from out->from_layer; see
 *  docs/scheduling.md, section 4. Before any byte has arrived the rate counts as 1 byte/s,
 *  so a call right after objectcache_load advises recomputing: call it once a layer is late.
 *  A failed remaining layer always advises recomputing; a tie advises waiting. Model, GPU
 *  and kernel names are matched ignoring case. load_tokens is taken as given (the library
 *  does not know the tokens per chunk of the caller's model). out is caller-owned with
 *  out->struct_size set. An unknown model, GPU or kernel class, a model whose layer count
 *  differs from the load's, or a value above its stated limit is
 *  OBJECTCACHE_ERR_INVALID_ARGUMENT naming it. Thread-safe; does not change the load. */
objectcache_status objectcache_transfer_stall_advice(objectcache_transfer *transfer,
                                                     const objectcache_stall_params *params,
                                                     objectcache_stall_advice *out);

/** Cancels outstanding reads; layers not yet ready fail with OBJECTCACHE_ERR_CANCELLED and
 *  waiters wake. Ready layers stay ready. Returns at once. Thread-safe, idempotent. */
objectcache_status objectcache_transfer_cancel(objectcache_transfer *transfer);

/** Releases the transfer: cancels what is outstanding, wakes waiters, and returns only once
 *  no copy into the destinations is in flight, after which the caller owns that memory
 *  again. Thread-safe; releasing twice is OBJECTCACHE_ERR_INVALID_HANDLE. */
objectcache_status objectcache_transfer_release(objectcache_transfer *transfer);

#ifdef __cplusplus
}
#endif

#endif /* OBJECTCACHE_H */
