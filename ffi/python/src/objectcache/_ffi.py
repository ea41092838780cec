"""ctypes view of the C ABI (``ffi/objectcache.h``): structs, constants and prototypes.

Nothing here adds behaviour: every function is the library's own export, declared with the
header's exact argument and return types. The library is the ``libobjectcache.so`` bundled in
this package, or the file named by the environment variable ``OBJECTCACHE_LIBRARY``.
"""

import ctypes
import os
from ctypes import (
    POINTER,
    c_char_p,
    c_double,
    c_int32,
    c_int64,
    c_size_t,
    c_uint8,
    c_uint32,
    c_uint64,
    c_void_p,
)

#: The ABI version this module was written for (``OBJECTCACHE_ABI_VERSION`` in the header).
ABI_VERSION = 1

OK = 0
PENDING = 1

#: Status codes by name, exactly as in ``objectcache.h``.
STATUS_CODES = {
    "OBJECTCACHE_OK": 0,
    "OBJECTCACHE_PENDING": 1,
    "OBJECTCACHE_ERR_INVALID_ARGUMENT": 2,
    "OBJECTCACHE_ERR_ABI_MISMATCH": 3,
    "OBJECTCACHE_ERR_INVALID_HANDLE": 4,
    "OBJECTCACHE_ERR_UNSUPPORTED": 5,
    "OBJECTCACHE_ERR_BUSY": 6,
    "OBJECTCACHE_ERR_BUFFER_TOO_SMALL": 7,
    "OBJECTCACHE_ERR_CONFIG": 8,
    "OBJECTCACHE_ERR_FORMAT": 9,
    "OBJECTCACHE_ERR_NOT_FOUND": 10,
    "OBJECTCACHE_ERR_STORE": 11,
    "OBJECTCACHE_ERR_IO": 12,
    "OBJECTCACHE_ERR_INTERNAL": 13,
    "OBJECTCACHE_ERR_LAYER_MISSING": 20,
    "OBJECTCACHE_ERR_LAYER_CHECKSUM": 21,
    "OBJECTCACHE_ERR_LAYER_GEOMETRY": 22,
    "OBJECTCACHE_ERR_LAYER_STORAGE": 23,
    "OBJECTCACHE_ERR_LAYER_TIMEOUT": 24,
    "OBJECTCACHE_ERR_CANCELLED": 25,
    "OBJECTCACHE_ERR_LAYER_DEVICE": 26,
}

DTYPE_CODES = {"bf16": 1, "fp16": 2, "fp8-e4m3": 3, "fp32": 4}
MEM_HOST = 0
MEM_DEVICE = 1
WAIT_FOREVER = -1

status = c_int32


class Geometry(ctypes.Structure):
    """``objectcache_geometry`` (with the engine layout fields)."""

    _fields_ = [
        ("struct_size", c_uint32),
        ("layers", c_uint32),
        ("kv_heads", c_uint32),
        ("head_dim", c_uint32),
        ("dtype", c_uint32),
        ("tokens_per_chunk", c_uint32),
        ("tp_rank", c_uint32),
        ("tp_world", c_uint32),
        ("model", c_char_p),
        ("layout", c_char_p),
        ("block_size", c_uint32),
        ("_reserved", c_uint32),
    ]


class EngineLayout(ctypes.Structure):
    """``objectcache_engine_layout``."""

    _fields_ = [
        ("struct_size", c_uint32),
        ("family", c_uint32),
        ("engine", c_char_p),
        ("order", c_char_p),
        ("kv_heads", c_uint32),
        ("head_dim", c_uint32),
        ("latent_dim", c_uint32),
        ("block_size", c_uint32),
        ("dtype", c_uint32),
        ("group_count", c_uint32),
        ("group_index", c_uint32),
        ("group_kind", c_uint32),
        ("window", c_uint32),
        ("_reserved", c_uint32),
        ("bytes_per_token", c_uint64),
        ("structure", c_char_p),
    ]


#: ``OBJECTCACHE_FAMILY_*`` and ``OBJECTCACHE_GROUP_*``.
FAMILY_CODES = {"paged_kv": 0, "mla": 1, "recurrent": 2, "opaque": 3}
GROUP_CODES = {"full": 0, "sliding_window": 1}


class Range(ctypes.Structure):
    """``objectcache_range``: one byte range of caller memory."""

    _fields_ = [("addr", c_void_p), ("len", c_uint64)]


# The fields both load parameter structs begin with, in the header's order.
_LOAD_PARAMS_HEAD = [
        ("struct_size", c_uint32),
        ("priority", c_uint32),
        ("request_id", c_uint64),
        ("deadline_ms", c_uint64),
        ("compute_us_per_layer", c_uint64),
        ("geometry", POINTER(Geometry)),
        ("hashes", POINTER(c_uint8)),
        ("hash_len", c_size_t),
        ("n_chunks", c_size_t),
]


class PagedLoadParams(ctypes.Structure):
    """``objectcache_paged_load_params``."""

    _fields_ = _LOAD_PARAMS_HEAD + [
        ("ranges", POINTER(Range)),
        ("ranges_per_layer", c_size_t),
        ("n_layers", c_size_t),
    ]


class HashParams(ctypes.Structure):
    """``objectcache_hash_params``."""

    _fields_ = [
        ("struct_size", c_uint32),
        ("block_size", c_uint32),
        ("seed", c_char_p),
        ("salt", c_char_p),
    ]


class LayerDest(ctypes.Structure):
    """``objectcache_layer_dest``."""

    _fields_ = [("addr", c_void_p), ("len", c_uint64)]


class LoadParams(ctypes.Structure):
    """``objectcache_load_params``."""

    _fields_ = _LOAD_PARAMS_HEAD + [
        ("layers", POINTER(LayerDest)),
        ("n_layers", c_size_t),
    ]


class SaveReport(ctypes.Structure):
    """``objectcache_save_report``."""

    _fields_ = [
        ("struct_size", c_uint32),
        ("_reserved", c_uint32),
        ("written", c_uint64),
        ("already_present", c_uint64),
        ("bytes", c_uint64),
    ]


class StallParams(ctypes.Structure):
    """``objectcache_stall_params``."""

    _fields_ = [
        ("struct_size", c_uint32),
        ("tp", c_uint32),
        ("model", c_char_p),
        ("gpu", c_char_p),
        ("kernels", c_char_p),
        ("load_tokens", c_uint64),
        ("new_tokens", c_uint64),
        ("compute_us_per_layer", c_uint64),
    ]


class StallAdvice(ctypes.Structure):
    """``objectcache_stall_advice``."""

    _fields_ = [
        ("struct_size", c_uint32),
        ("recompute", c_uint32),
        ("from_layer", c_uint32),
        ("_reserved", c_uint32),
        ("recompute_tokens", c_uint64),
        ("finish_s", c_double),
        ("wait_finish_s", c_double),
    ]


class Metrics(ctypes.Structure):
    """``objectcache_metrics``."""

    _fields_ = [
        ("struct_size", c_uint32),
        ("_reserved", c_uint32),
        ("loads", c_uint64),
        ("saves", c_uint64),
        ("lookups", c_uint64),
        ("lookup_hit_chunks", c_uint64),
        ("lookup_probes", c_uint64),
        ("bytes_saved", c_uint64),
        ("live_transfers", c_uint64),
        ("registered_regions", c_uint64),
    ]


class TransferStats(ctypes.Structure):
    """``objectcache_transfer_stats``."""

    _fields_ = [
        ("struct_size", c_uint32),
        ("layers_ready", c_uint32),
        ("request_id", c_uint64),
        ("requests", c_uint64),
        ("bytes", c_uint64),
        ("ttfl_s", c_double),
        ("ttll_s", c_double),
    ]


#: Every ABI struct by its C name; each one's size and every field's name and offset are
#: checked against the library at load time (:func:`struct_mismatch`).
STRUCTS = {
    "objectcache_geometry": Geometry,
    "objectcache_engine_layout": EngineLayout,
    "objectcache_hash_params": HashParams,
    "objectcache_layer_dest": LayerDest,
    "objectcache_range": Range,
    "objectcache_paged_load_params": PagedLoadParams,
    "objectcache_load_params": LoadParams,
    "objectcache_save_report": SaveReport,
    "objectcache_stall_params": StallParams,
    "objectcache_stall_advice": StallAdvice,
    "objectcache_metrics": Metrics,
    "objectcache_transfer_stats": TransferStats,
}

_P = POINTER
# The arguments every call about a run of chunks begins with, in the header's order:
# engine, geometry, hashes, hash_len, n_chunks.
_CHUNKS_ARGS = [c_void_p, _P(Geometry), _P(c_uint8), c_size_t, c_size_t]
# name: (restype, argtypes), as declared in objectcache.h.
_PROTOTYPES = {
    "objectcache_abi_version": (c_uint32, []),
    "objectcache_version": (c_char_p, []),
    "objectcache_config_keys": (c_char_p, []),
    "objectcache_struct_size": (c_size_t, [c_char_p]),
    "objectcache_struct_field": (c_char_p, [c_char_p, c_size_t, _P(c_size_t)]),
    "objectcache_last_error": (c_char_p, []),
    "objectcache_status_name": (c_char_p, [status]),
    "objectcache_slice_bytes": (status, [_P(Geometry), _P(c_uint64)]),
    "objectcache_engine_layout_resolve": (
        status,
        [_P(EngineLayout), c_uint32, ctypes.c_char_p, c_size_t, _P(c_uint64), _P(c_uint32),
         _P(c_uint32), _P(c_uint32)],
    ),
    "objectcache_chunk_hashes": (
        status,
        [_P(HashParams), _P(c_uint32), c_size_t, _P(c_uint8), c_size_t, _P(c_size_t)],
    ),
    "objectcache_engine_create": (
        status,
        [c_uint32, _P(c_char_p), _P(c_char_p), c_size_t, _P(c_void_p)],
    ),
    "objectcache_engine_destroy": (status, [c_void_p]),
    "objectcache_register_memory": (
        status,
        [c_void_p, c_void_p, c_size_t, c_int32, c_int32, _P(c_void_p)],
    ),
    "objectcache_deregister_memory": (status, [c_void_p, c_void_p]),
    "objectcache_metrics_get": (status, [c_void_p, _P(Metrics)]),
    "objectcache_store_mode": (status, [c_void_p, _P(c_uint32)]),
    "objectcache_lookup": (status, _CHUNKS_ARGS + [_P(c_size_t)]),
    "objectcache_lookup_tokens": (
        status,
        [c_void_p, _P(Geometry), _P(HashParams), _P(c_uint32), c_size_t, _P(c_size_t)],
    ),
    "objectcache_segment_markers": (
        status,
        _CHUNKS_ARGS + [_P(c_uint8), c_size_t, _P(c_size_t)],
    ),
    "objectcache_segment_markers_add": (status, _CHUNKS_ARGS + [_P(c_uint8), c_size_t]),
    "objectcache_save": (
        status,
        _CHUNKS_ARGS + [_P(c_void_p), c_size_t, c_uint64, _P(SaveReport)],
    ),
    "objectcache_load": (status, [c_void_p, _P(LoadParams), _P(c_void_p)]),
    "objectcache_transfer_poll_layer": (status, [c_void_p, c_uint32]),
    "objectcache_transfer_wait_layer": (status, [c_void_p, c_uint32, c_int64]),
    "objectcache_transfer_wait_all": (status, [c_void_p, c_int64]),
    "objectcache_transfer_chunk_status": (
        status,
        [c_void_p, _P(c_uint8), c_size_t, _P(c_size_t)],
    ),
    "objectcache_transfer_stats_get": (status, [c_void_p, _P(TransferStats)]),
    "objectcache_transfer_stall_advice": (
        status,
        [c_void_p, _P(StallParams), _P(StallAdvice)],
    ),
    "objectcache_transfer_cancel": (status, [c_void_p]),
    "objectcache_transfer_release": (status, [c_void_p]),
    "objectcache_load_paged": (status, [c_void_p, _P(PagedLoadParams), _P(c_void_p)]),
    "objectcache_save_paged": (
        status,
        _CHUNKS_ARGS + [_P(Range), c_size_t, c_size_t, _P(SaveReport)],
    ),
}


def library_path():
    """Path of the shared library this package loads: ``$OBJECTCACHE_LIBRARY`` if set, else
    the ``libobjectcache.so`` bundled next to this file."""
    env = os.environ.get("OBJECTCACHE_LIBRARY")
    if env:
        return env
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "libobjectcache.so")


def _load():
    path = library_path()
    if not os.path.exists(path):
        raise ImportError(
            f"objectcache: the native library {path} is missing; install the package with "
            "`pip install ./ffi/python` (which builds it with cargo), or set "
            "OBJECTCACHE_LIBRARY to a built libobjectcache.so"
        )
    lib = ctypes.CDLL(path)
    for name, (restype, argtypes) in _PROTOTYPES.items():
        try:
            fn = getattr(lib, name)
        except AttributeError as e:
            raise ImportError(
                f"objectcache: {path} has no function {name}; it is older than this package"
            ) from e
        fn.restype = restype
        fn.argtypes = argtypes
    got = lib.objectcache_abi_version()
    if got != ABI_VERSION:
        raise ImportError(
            f"objectcache: {path} has C ABI version {got}, this package needs {ABI_VERSION}"
        )
    for cname, cls in STRUCTS.items():
        why = struct_mismatch(lib, cname, cls)
        if why:
            raise ImportError(f"objectcache: {path} and this package disagree: {why}")
    return lib


def struct_mismatch(lib, cname, cls):
    """How this package's ctypes view ``cls`` of ABI struct ``cname`` differs from the
    library ``lib`` (``objectcache_struct_size``, ``objectcache_struct_field``): its size, a
    field missing on either side, or a field at another offset, named; ``None`` if they
    agree."""
    size = lib.objectcache_struct_size(cname.encode())
    if size != ctypes.sizeof(cls):
        return f"sizeof({cname}) is {size} in the library, {ctypes.sizeof(cls)} here"
    theirs = []
    off = c_size_t(0)
    while True:
        name = lib.objectcache_struct_field(cname.encode(), len(theirs), ctypes.byref(off))
        if name is None:
            break
        theirs.append((name.decode(), off.value))
    ours = [(f[0], getattr(cls, f[0]).offset) for f in cls._fields_]
    for i in range(max(len(theirs), len(ours))):
        t = theirs[i] if i < len(theirs) else None
        o = ours[i] if i < len(ours) else None
        if t != o:
            if o is None:
                return f"{cname}.{t[0]} (field {i}, offset {t[1]}) is missing here"
            if t is None:
                return f"{cname}.{o[0]} (field {i}) is not in the library"
            if t[0] != o[0]:
                return f"{cname} field {i} is {t[0]} in the library, {o[0]} here"
            return f"{cname}.{t[0]} is at offset {t[1]} in the library, {o[1]} here"
    return None


lib = _load()
