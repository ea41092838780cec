"""The Python API: thin wrappers over the C ABI (``objectcache.h``), one call each.

Every method here calls exactly one C function (or, for a convenience, a fixed short sequence
of them) and turns its status into a return value or an exception carrying the C ABI's error
name and message. No storage, hashing or transfer logic lives in Python.
"""

import ctypes
import enum
import threading
from ctypes import byref, c_size_t, c_uint8, c_uint32, c_uint64, c_void_p

from . import _ffi
from ._ffi import lib

__all__ = [
    "ObjectCacheError",
    "InvalidArgumentError",
    "AbiMismatchError",
    "InvalidHandleError",
    "UnsupportedError",
    "BusyError",
    "BufferTooSmallError",
    "ConfigError",
    "FormatError",
    "NotFoundError",
    "StoreError",
    "IoError",
    "InternalError",
    "LayerMissError",
    "LayerMissingError",
    "LayerChecksumError",
    "LayerGeometryError",
    "LayerStorageError",
    "LayerTimeoutError",
    "LayerCancelledError",
    "LayerDeviceError",
    "ChunkStatus",
    "Geometry",
    "Engine",
    "Region",
    "Transfer",
    "SaveReport",
    "Metrics",
    "TransferStats",
    "StallAdvice",
    "chunk_hashes",
    "status_name",
    "version",
    "abi_version",
    "CONFIG_KEYS",
]

#: The settings ``Engine`` accepts: the names of the Rust ``EngineConfig`` (and of the C
#: ABI's ``objectcache_engine_create``). Unknown names are refused by the library with
#: :class:`ConfigError`, so this list is documentation, not a second check.
CONFIG_KEYS = (
    "store",
    "namespace",
    "hash_algo",
    "window_bytes",
    "max_requests",
    "coalesce_bytes",
    "lookup_fanout",
    "lookup_cache_ttl_ms",
    "load_timeout_ms",
    "load_min_rate_bytes_per_s",
    "stall_timeout_ms",
    "save_concurrency",
    "worker_threads",
    "cpus",
    "gather",
    "gather_streams",
    "single_flight",
    "transport",
    "scheduler",
    "bandwidth_cap_bytes_per_s",
    "save_format",
    "segment_max_bytes",
)


# ---- Errors ----------------------------------------------------------------------------------


class ObjectCacheError(Exception):
    """A failed C ABI call.

    Attributes:
        code: the status code (an ``OBJECTCACHE_ERR_*`` integer).
        name: its C name, e.g. ``"OBJECTCACHE_ERR_CONFIG"``.
        message: ``objectcache_last_error()`` of the failing call: the function, the argument,
            the sizes, the key or layer concerned.
    """

    def __init__(self, code, name, message):
        super().__init__(f"{name}: {message}")
        self.code = code
        self.name = name
        self.message = message


class InvalidArgumentError(ObjectCacheError, ValueError):
    """``OBJECTCACHE_ERR_INVALID_ARGUMENT``: a bad pointer, size, count or value."""


class AbiMismatchError(ObjectCacheError):
    """``OBJECTCACHE_ERR_ABI_MISMATCH``: this package and the library disagree on the ABI."""


class InvalidHandleError(ObjectCacheError):
    """``OBJECTCACHE_ERR_INVALID_HANDLE``: a destroyed, released or wrong-kind handle."""


class UnsupportedError(ObjectCacheError):
    """``OBJECTCACHE_ERR_UNSUPPORTED``: not in this build (e.g. device memory without CUDA)."""


class BusyError(ObjectCacheError):
    """``OBJECTCACHE_ERR_BUSY``: an engine with live transfers, a region in use."""


class BufferTooSmallError(ObjectCacheError):
    """``OBJECTCACHE_ERR_BUFFER_TOO_SMALL``."""


class ConfigError(ObjectCacheError, ValueError):
    """``OBJECTCACHE_ERR_CONFIG``: an unknown setting or a value that does not parse."""


class FormatError(ObjectCacheError):
    """``OBJECTCACHE_ERR_FORMAT``: bytes that are not a valid KV object."""


class NotFoundError(ObjectCacheError):
    """``OBJECTCACHE_ERR_NOT_FOUND``: the store has no such object."""


class StoreError(ObjectCacheError):
    """``OBJECTCACHE_ERR_STORE``: any other object-store failure."""


class IoError(ObjectCacheError):
    """``OBJECTCACHE_ERR_IO``: an operating-system I/O failure outside the store."""


class InternalError(ObjectCacheError):
    """``OBJECTCACHE_ERR_INTERNAL``: a caught panic inside the library."""


class LayerMissError(ObjectCacheError):
    """A layer miss (codes 20 to 26): the layer's destination holds no KV; recompute it."""


class LayerMissingError(LayerMissError):
    """``OBJECTCACHE_ERR_LAYER_MISSING``: a chunk object is missing."""


class LayerChecksumError(LayerMissError):
    """``OBJECTCACHE_ERR_LAYER_CHECKSUM``: a slice failed its CRC32C (corrupt object)."""


class LayerGeometryError(LayerMissError):
    """``OBJECTCACHE_ERR_LAYER_GEOMETRY``: an object of another geometry, layout or format."""


class LayerStorageError(LayerMissError):
    """``OBJECTCACHE_ERR_LAYER_STORAGE``: storage or transport failed."""


class LayerTimeoutError(LayerMissError):
    """``OBJECTCACHE_ERR_LAYER_TIMEOUT``: the engine's ``load_timeout_ms`` passed."""


class LayerCancelledError(LayerMissError):
    """``OBJECTCACHE_ERR_CANCELLED``: the transfer was cancelled."""


class LayerDeviceError(LayerMissError):
    """``OBJECTCACHE_ERR_LAYER_DEVICE``: the copy to device memory failed (CUDA builds)."""


_ERROR_CLASSES = {
    2: InvalidArgumentError,
    3: AbiMismatchError,
    4: InvalidHandleError,
    5: UnsupportedError,
    6: BusyError,
    7: BufferTooSmallError,
    8: ConfigError,
    9: FormatError,
    10: NotFoundError,
    11: StoreError,
    12: IoError,
    13: InternalError,
    20: LayerMissingError,
    21: LayerChecksumError,
    22: LayerGeometryError,
    23: LayerStorageError,
    24: LayerTimeoutError,
    25: LayerCancelledError,
    26: LayerDeviceError,
}


def status_name(code):
    """The C name of a status code (``objectcache_status_name``), e.g.
    ``"OBJECTCACHE_ERR_LAYER_CHECKSUM"``; ``"unknown status"`` for others."""
    return lib.objectcache_status_name(code).decode()


def _error(code, message=None):
    if message is None:
        message = lib.objectcache_last_error().decode(errors="replace")
    cls = _ERROR_CLASSES.get(code, ObjectCacheError)
    return cls(code, status_name(code), message)


def _check(code):
    """Raises the error of a failed call; returns OK or PENDING unchanged."""
    if code in (_ffi.OK, _ffi.PENDING):
        return code
    raise _error(code)


def version():
    """The library's version string (``objectcache_version``), e.g. ``"0.1.0"``."""
    return lib.objectcache_version().decode()


def abi_version():
    """The library's C ABI version (``objectcache_abi_version``)."""
    return lib.objectcache_abi_version()


# ---- Memory ----------------------------------------------------------------------------------


def _span(obj, writable):
    """``(address, nbytes, keepalive)`` of a memory argument.

    Accepts ``(address, nbytes)`` integer pairs, objects with ``data_ptr()`` (torch tensors,
    which must be contiguous) and C-contiguous buffer-protocol objects (``bytes`` only where
    the library reads). ``keepalive`` must be held while the library may touch the memory.
    """
    if isinstance(obj, tuple) and len(obj) == 2 and all(isinstance(x, int) for x in obj):
        addr, n = obj
        if addr < 0 or n < 0:
            raise ValueError(f"memory range {obj!r}: address and length must be >= 0")
        return addr, n, None
    if hasattr(obj, "data_ptr") and hasattr(obj, "element_size"):
        if not obj.is_contiguous():
            raise ValueError("a tensor used as memory must be contiguous")
        return obj.data_ptr(), obj.numel() * obj.element_size(), obj
    mv = memoryview(obj)
    if not mv.c_contiguous:
        raise ValueError("a buffer used as memory must be C-contiguous")
    n = mv.nbytes
    if mv.readonly:
        if writable:
            raise ValueError("a read-only buffer cannot receive a load")
        if isinstance(obj, bytes):
            return ctypes.cast(ctypes.c_char_p(obj), c_void_p).value or 0, n, obj
        copy = bytearray(mv)
        obj = copy
        mv = memoryview(copy)
    if n == 0:
        return 0, 0, obj
    arr = (ctypes.c_char * n).from_buffer(mv.cast("B"))
    return ctypes.addressof(arr), n, (arr, mv, obj)


def _is_paged(layers):
    """Whether per-layer memory is given as lists of ranges (paged) rather than one span."""
    return bool(layers) and isinstance(layers[0], list)


def _paged_ranges(layers, writable):
    """``(ctypes Range array, ranges_per_layer, keepalive)`` of per-layer range lists, flattened
    layer-major. Every layer must have the same number of ranges."""
    counts = {len(rs) for rs in layers}
    if len(counts) != 1:
        raise ValueError(
            f"every layer must have the same number of ranges, got {sorted(counts)}")
    per = counts.pop()
    spans = [_span(r, writable) for rs in layers for r in rs]
    arr = (_ffi.Range * max(1, len(spans)))(*[_ffi.Range(a, n) for a, n, _ in spans])
    return arr, per, [k for _, _, k in spans if k is not None]


def _packed_hashes(hashes):
    """``(ctypes array, hash_len, n)`` of a sequence of equal-length ``bytes`` hashes."""
    hashes = [bytes(h) for h in hashes]
    if not hashes:
        return (c_uint8 * 1)(), 32, 0
    hl = len(hashes[0])
    if any(len(h) != hl for h in hashes):
        raise ValueError("every chunk hash must have the same length")
    buf = b"".join(hashes)
    return (c_uint8 * len(buf)).from_buffer_copy(buf), hl, len(hashes)


# ---- Values ----------------------------------------------------------------------------------


class ChunkStatus(enum.IntEnum):
    """Per-chunk status of a transfer (``OBJECTCACHE_CHUNK_*``)."""

    PENDING = 0
    OK = 1
    MISSING = 2
    CORRUPT = 3
    WRONG_GEOMETRY = 4
    ERROR = 5


class Geometry:
    """Shape of one model's KV cache as one TP rank stores it (``objectcache_geometry``).

    A chunk of ``tokens_per_chunk`` tokens holds, per layer, one slice of
    :attr:`slice_bytes` bytes (``2 x tokens_per_chunk x kv_heads / tp_world x head_dim x
    dtype size``).

    Args:
        model: model identifier; enters the keys, so two models never share entries.
        layers: transformer layers (1..1024).
        kv_heads: KV heads of the whole model (before the TP split).
        head_dim: head dimension in elements.
        dtype: ``"bf16"``, ``"fp16"``, ``"fp8-e4m3"`` or ``"fp32"``.
        tokens_per_chunk: tokens per chunk object.
        tp_rank: this process's tensor-parallel rank.
        tp_world: tensor-parallel world size.
        layout: the engine's own KV layout name (1 to 64 bytes of ``[A-Za-z0-9._:/+-]``), or
            ``None`` for ObjectCache's canonical K-then-V layout. With a layout, a chunk's
            layer slice is the engine's blocks for the chunk's tokens, byte for byte; the
            layout and ``block_size`` are part of the key, so another layout is a miss.
        block_size: tokens per engine block of ``layout`` (divides ``tokens_per_chunk``).

    Validation is the library's: a bad value raises :class:`InvalidArgumentError` when the
    geometry is first used (e.g. by :attr:`slice_bytes`).
    """

    def __init__(
        self,
        model,
        layers,
        kv_heads,
        head_dim,
        dtype="bf16",
        tokens_per_chunk=256,
        tp_rank=0,
        tp_world=1,
        layout=None,
        block_size=0,
    ):
        if dtype not in _ffi.DTYPE_CODES:
            raise ValueError(
                f"dtype {dtype!r} is not one of {', '.join(_ffi.DTYPE_CODES)}"
            )
        self.model = str(model)
        self.layers = int(layers)
        self.kv_heads = int(kv_heads)
        self.head_dim = int(head_dim)
        self.dtype = dtype
        self.tokens_per_chunk = int(tokens_per_chunk)
        self.tp_rank = int(tp_rank)
        self.tp_world = int(tp_world)
        self.layout = None if layout is None else str(layout)
        self.block_size = int(block_size)

    def __repr__(self):
        return (
            f"Geometry(model={self.model!r}, layers={self.layers}, kv_heads={self.kv_heads}, "
            f"head_dim={self.head_dim}, dtype={self.dtype!r}, "
            f"tokens_per_chunk={self.tokens_per_chunk}, tp_rank={self.tp_rank}, "
            f"tp_world={self.tp_world}, layout={self.layout!r}, block_size={self.block_size})"
        )

    def _c(self):
        """The C struct; it borrows ``self``'s strings (keep ``self`` alive)."""
        self._model_b = self.model.encode()
        self._layout_b = None if self.layout is None else self.layout.encode()
        g = _ffi.Geometry(
            ctypes.sizeof(_ffi.Geometry),
            self.layers,
            self.kv_heads,
            self.head_dim,
            _ffi.DTYPE_CODES[self.dtype],
            self.tokens_per_chunk,
            self.tp_rank,
            self.tp_world,
            self._model_b,
            self._layout_b,
            self.block_size if self._layout_b is not None else 0,
            0,
        )
        return g

    @property
    def slice_bytes(self):
        """Bytes of one chunk's one-layer slice, K and V (``objectcache_slice_bytes``)."""
        out = c_uint64()
        g = self._c()
        _check(lib.objectcache_slice_bytes(byref(g), byref(out)))
        return out.value


def _hash_params(block_size, seed, salt):
    p = _ffi.HashParams(
        ctypes.sizeof(_ffi.HashParams),
        int(block_size),
        None if seed is None else str(seed).encode(),
        None if salt is None else str(salt).encode(),
    )
    return p


def _tokens_array(tokens):
    tokens = list(tokens)
    return (c_uint32 * max(1, len(tokens)))(*tokens), len(tokens)


def chunk_hashes(tokens, block_size, seed="0", salt=None):
    """vLLM-compatible ``sha256_cbor`` hashes of every full block of ``tokens``
    (``objectcache_chunk_hashes``).

    Args:
        tokens: token ids (a trailing partial block gets no hash).
        block_size: tokens per hashed block.
        seed: the engine's hash seed (vLLM: ``PYTHONHASHSEED``; vLLM 0.32 uses
            ``"vllm-none-hash"`` when it is unset with a SHA-256 algorithm).
        salt: a cache salt for the first block (see docs/vllm.md for vLLM 0.32's salts), or
            ``None``.

    Returns:
        A list of 32-byte ``bytes``, one per full block.
    """
    arr, n = _tokens_array(tokens)
    p = _hash_params(block_size, seed, salt)
    n_chunks = c_size_t()
    cap = 32 * (n // max(1, int(block_size)) + 1)
    out = (c_uint8 * cap)()
    _check(lib.objectcache_chunk_hashes(byref(p), arr, n, out, cap, byref(n_chunks)))
    raw = bytes(out)
    return [raw[32 * i : 32 * (i + 1)] for i in range(n_chunks.value)]


class _Record:
    """A read-only record of named figures."""

    _fields = ()

    def __init__(self, c):
        for f in self._fields:
            setattr(self, f, getattr(c, f))

    def __repr__(self):
        body = ", ".join(f"{f}={getattr(self, f)!r}" for f in self._fields)
        return f"{type(self).__name__}({body})"

    def as_dict(self):
        """The figures as a dict."""
        return {f: getattr(self, f) for f in self._fields}


class SaveReport(_Record):
    """Outcome of :meth:`Engine.save`: ``written`` chunk objects, ``already_present`` ones
    (another writer won; not an error) and ``bytes`` written (data and publish markers)."""

    _fields = ("written", "already_present", "bytes")


class Metrics(_Record):
    """Counters of an engine since creation (``objectcache_metrics``): ``loads``, ``saves``,
    ``lookups``, ``lookup_hit_chunks``, ``lookup_probes``, ``bytes_saved``,
    ``live_transfers`` (posted, not released) and ``registered_regions``."""

    _fields = (
        "loads",
        "saves",
        "lookups",
        "lookup_hit_chunks",
        "lookup_probes",
        "bytes_saved",
        "live_transfers",
        "registered_regions",
    )


class TransferStats(_Record):
    """Counters of one transfer: ``layers_ready``, ``request_id``, storage ``requests``,
    verified payload ``bytes``, ``ttfl_s`` (seconds from load to layer 0 ready; negative if
    not yet) and ``ttll_s`` (to the last layer; negative if not every layer is ready)."""

    _fields = ("layers_ready", "request_id", "requests", "bytes", "ttfl_s", "ttll_s")


class StallAdvice(_Record):
    """Output of :meth:`Transfer.stall_advice`: ``recompute`` (bool), ``from_layer``,
    ``recompute_tokens``, and the predicted finish either way (``finish_s``,
    ``wait_finish_s``; seconds since the load was posted)."""

    _fields = ("recompute", "from_layer", "recompute_tokens", "finish_s", "wait_finish_s")

    def __init__(self, c):
        super().__init__(c)
        self.recompute = bool(self.recompute)


# ---- Engine ----------------------------------------------------------------------------------


class Engine:
    """An ObjectCache engine (``objectcache_engine``): one per process or TP rank, shared by
    threads.

    Keyword arguments are the ``EngineConfig`` settings, by their names (see
    :data:`CONFIG_KEYS` and docs/c-abi.md): ``store`` (a directory, ``file:///path``,
    ``memory://`` or ``s3://bucket/prefix?endpoint=...``), ``namespace``, ``hash_algo``,
    ``window_bytes``, ``max_requests``, ``coalesce_bytes``, ``lookup_fanout``,
    ``lookup_cache_ttl_ms``, ``load_timeout_ms``, ``load_min_rate_bytes_per_s``,
    ``stall_timeout_ms``, ``save_concurrency``, ``worker_threads``, ``cpus``, ``gather``,
    ``gather_streams``, ``single_flight``, ``transport``, ``scheduler``,
    ``bandwidth_cap_bytes_per_s``, ``save_format`` (``v1`` or ``v2``: segment objects, see
    docs/object-format.md), ``segment_max_bytes``. Values may be ``str``, ``int`` or ``bool``; unset keys keep
    the library's defaults. An unknown key or a bad value raises :class:`ConfigError` naming
    it.

    Use as a context manager, or call :meth:`close`.
    """

    def __init__(self, **settings):
        keys, vals = [], []
        for k, v in settings.items():
            if isinstance(v, bool):
                v = "true" if v else "false"
            keys.append(str(k).encode())
            vals.append(str(v).encode())
        n = len(keys)
        ka = (ctypes.c_char_p * max(1, n))(*keys)
        va = (ctypes.c_char_p * max(1, n))(*vals)
        h = c_void_p()
        _check(lib.objectcache_engine_create(_ffi.ABI_VERSION, ka, va, n, byref(h)))
        self._h = h
        self._lock = threading.Lock()
        self.settings = dict(settings)

    def _handle(self):
        if self._h is None:
            raise InvalidHandleError(4, "OBJECTCACHE_ERR_INVALID_HANDLE", "engine is closed")
        return self._h

    def close(self):
        """Destroys the engine (``objectcache_engine_destroy``). Raises :class:`BusyError`
        while a transfer is not released. Closing twice does nothing."""
        with self._lock:
            if self._h is None:
                return
            _check(lib.objectcache_engine_destroy(self._h))
            self._h = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            if getattr(self, "_h", None) is not None:
                lib.objectcache_engine_destroy(self._h)
        except Exception:
            pass

    # -- memory --

    def register(self, memory, length=None, device=None):
        """Registers memory that loads may write into (``objectcache_register_memory``).

        Args:
            memory: a writable buffer (``bytearray``, ``memoryview``, NumPy array), a
                contiguous torch tensor, or an integer address (then ``length`` is required).
                The caller keeps it valid until the region is deregistered.
            length: bytes, for an integer address.
            device: ``None`` for host memory, or a CUDA ordinal for device memory (CUDA
                builds only; :class:`UnsupportedError` otherwise).

        Returns:
            A :class:`Region`.
        """
        if isinstance(memory, int):
            if length is None:
                raise ValueError("register(address, length): length is required")
            addr, n, keep = memory, int(length), None
        else:
            addr, n, keep = _span(memory, writable=True)
            if length is not None:
                n = int(length)
        kind = _ffi.MEM_HOST if device is None else _ffi.MEM_DEVICE
        r = c_void_p()
        _check(
            lib.objectcache_register_memory(
                self._handle(), c_void_p(addr), n, kind, int(device or 0), byref(r)
            )
        )
        return Region(self, r, addr, n, keep)

    def metrics(self):
        """Counters since creation (``objectcache_metrics_get``), a :class:`Metrics`."""
        m = _ffi.Metrics()
        m.struct_size = ctypes.sizeof(m)
        _check(lib.objectcache_metrics_get(self._handle(), byref(m)))
        return Metrics(m)

    # -- lookup, save --

    def lookup(self, geometry, hashes):
        """How many leading chunks of ``hashes`` are published (``objectcache_lookup``).
        Costs at most a few storage round trips; answers are cached for
        ``lookup_cache_ttl_ms``."""
        arr, hl, n = _packed_hashes(hashes)
        g = geometry._c()
        hit = c_size_t()
        _check(lib.objectcache_lookup(self._handle(), byref(g), arr, hl, n, byref(hit)))
        return hit.value

    def lookup_tokens(self, geometry, tokens, seed="0", salt=None):
        """As :meth:`lookup`, hashing ``tokens`` first with the geometry's
        ``tokens_per_chunk`` (``objectcache_lookup_tokens``). Returns cached chunks."""
        arr, n = _tokens_array(tokens)
        g = geometry._c()
        p = _hash_params(geometry.tokens_per_chunk, seed, salt)
        hit = c_size_t()
        _check(lib.objectcache_lookup_tokens(self._handle(), byref(g), byref(p), arr, n, byref(hit)))
        return hit.value

    def save(self, geometry, hashes, layers):
        """Saves a prefix's KV and returns once it is published (``objectcache_save``).

        Args:
            geometry: the :class:`Geometry`.
            hashes: the chunks' hashes (``bytes`` of equal length).
            layers: one entry per layer, each ``len(hashes) x slice_bytes`` bytes holding
                chunk ``c``'s slice at ``c x slice_bytes``: a buffer, a contiguous tensor or
                an ``(address, nbytes)`` pair; or, paged (``objectcache_save_paged``), a
                list of such ranges per layer (the same count for every layer), whose
                concatenation holds the layer's slices, e.g. one range per engine block.
                Read during the call only; ranges need no registration.

        Returns:
            A :class:`SaveReport`. Chunks already stored are not rewritten.
        """
        arr, hl, n = _packed_hashes(hashes)
        g = geometry._c()
        if _is_paged(layers):
            ranges, per, _keep = _paged_ranges(layers, writable=False)
            rep = _ffi.SaveReport()
            rep.struct_size = ctypes.sizeof(rep)
            _check(
                lib.objectcache_save_paged(
                    self._handle(), byref(g), arr, hl, n, ranges, per, len(layers), byref(rep)
                )
            )
            return SaveReport(rep)
        spans = [_span(layer, writable=False) for layer in layers]
        sizes = {s[1] for s in spans}
        if len(sizes) > 1:
            raise ValueError(f"every layer must have the same size, got {sorted(sizes)}")
        per_layer = spans[0][1] if spans else 0
        ptrs = (c_void_p * max(1, len(spans)))(*[s[0] for s in spans])
        rep = _ffi.SaveReport()
        rep.struct_size = ctypes.sizeof(rep)
        _check(
            lib.objectcache_save(
                self._handle(), byref(g), arr, hl, n, ptrs, len(spans), per_layer, byref(rep)
            )
        )
        return SaveReport(rep)

    # -- load --

    def load(
        self,
        geometry,
        hashes,
        layers,
        request_id=0,
        priority=0,
        deadline_ms=0,
        compute_us_per_layer=0,
    ):
        """Posts a layer-ordered load and returns at once (``objectcache_load``).

        Args:
            geometry: the :class:`Geometry` the objects were saved with.
            hashes: the chunks to load, in prefix order.
            layers: one destination per layer, inside memory registered with this engine
                (:meth:`register`): chunk ``c``'s slice lands at ``start + c x slice_bytes``.
                Each is a writable buffer, a contiguous tensor or an ``(address, nbytes)``
                pair of at least ``len(hashes) x slice_bytes`` bytes. Paged
                (``objectcache_load_paged``): a list of such ranges per layer (the same
                count for every layer) adding up to exactly ``len(hashes) x slice_bytes``,
                taken in order as one buffer, e.g. one range per engine block; each inside
                one registered region, none overlapping. The library writes there until the
                transfer is released; read a layer only once it is ready.
            request_id: the caller's request id (64 bits); appears in messages and stats.
            priority: scheduling hint, larger is more urgent.
            deadline_ms: scheduling hint: layer 0 is needed this many ms from now (0: none).
            compute_us_per_layer: scheduling hint: the caller's compute time per layer.

        Returns:
            A :class:`Transfer`.
        """
        arr, hl, n = _packed_hashes(hashes)
        g = geometry._c()
        if _is_paged(layers):
            ranges, per, keep = _paged_ranges(layers, writable=True)
            p = _ffi.PagedLoadParams(
                ctypes.sizeof(_ffi.PagedLoadParams),
                int(priority),
                int(request_id) & 0xFFFFFFFFFFFFFFFF,
                int(deadline_ms),
                int(compute_us_per_layer),
                ctypes.pointer(g),
                arr,
                hl,
                n,
                ranges,
                per,
                len(layers),
            )
            t = c_void_p()
            _check(lib.objectcache_load_paged(self._handle(), byref(p), byref(t)))
            return Transfer(self, t, geometry.layers, n, keep)
        spans = [_span(layer, writable=True) for layer in layers]
        dests = (_ffi.LayerDest * max(1, len(spans)))(
            *[_ffi.LayerDest(s[0], s[1]) for s in spans]
        )
        p = _ffi.LoadParams(
            ctypes.sizeof(_ffi.LoadParams),
            int(priority),
            int(request_id) & 0xFFFFFFFFFFFFFFFF,
            int(deadline_ms),
            int(compute_us_per_layer),
            ctypes.pointer(g),
            arr,
            hl,
            n,
            dests,
            len(spans),
        )
        t = c_void_p()
        _check(lib.objectcache_load(self._handle(), byref(p), byref(t)))
        return Transfer(self, t, geometry.layers, n, [s[2] for s in spans])


class Region:
    """Memory registered with an :class:`Engine` (``objectcache_region``). Loads may write
    only inside registered memory. :meth:`close` deregisters it."""

    def __init__(self, engine, handle, addr, length, keepalive):
        self._engine = engine
        self._h = handle
        #: Start address of the region.
        self.address = addr
        #: Length in bytes.
        self.length = length
        self._keep = keepalive

    def close(self):
        """Deregisters (``objectcache_deregister_memory``); :class:`BusyError` while an
        unreleased transfer writes into it. Closing twice does nothing."""
        if self._h is None:
            return
        _check(lib.objectcache_deregister_memory(self._engine._handle(), self._h))
        self._h = None
        self._keep = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Transfer:
    """A load in progress (``objectcache_transfer``). Layers become ready in order; a layer
    that fails is a miss (:class:`LayerMissError`) and never turns ready. :meth:`release`
    (or leaving a ``with`` block) cancels what is outstanding and waits for in-flight copies,
    after which the destination memory is the caller's again."""

    def __init__(self, engine, handle, layers, n_chunks, keepalive):
        self._engine = engine
        self._h = handle
        self._keep = keepalive
        self._lock = threading.Lock()
        #: Layers of the load.
        self.layers = layers
        #: Chunks of the load.
        self.n_chunks = n_chunks

    def _handle(self):
        if self._h is None:
            raise InvalidHandleError(4, "OBJECTCACHE_ERR_INVALID_HANDLE", "transfer is released")
        return self._h

    def poll_layer(self, layer):
        """Non-blocking: ``True`` if ``layer`` is ready (verified KV), ``False`` if not yet;
        raises the layer's :class:`LayerMissError` if it failed."""
        return _check(lib.objectcache_transfer_poll_layer(self._handle(), layer)) == _ffi.OK

    def wait_layer(self, layer, timeout_s=None):
        """Blocks until ``layer`` is ready (returns ``True``), ``timeout_s`` passes (returns
        ``False``; the load goes on) or it fails (raises its :class:`LayerMissError`).
        ``None`` waits without limit (the engine's ``load_timeout_ms`` still ends a load)."""
        ms = _ffi.WAIT_FOREVER if timeout_s is None else max(0, int(timeout_s * 1000))
        return _check(lib.objectcache_transfer_wait_layer(self._handle(), layer, ms)) == _ffi.OK

    def wait_all(self, timeout_s=None):
        """Blocks until every layer is ready (``True``), one failed (raises), or
        ``timeout_s`` passes (``False``)."""
        ms = _ffi.WAIT_FOREVER if timeout_s is None else max(0, int(timeout_s * 1000))
        return _check(lib.objectcache_transfer_wait_all(self._handle(), ms)) == _ffi.OK

    def chunk_status(self):
        """Per-chunk status, a list of :class:`ChunkStatus` in chunk order."""
        cap = max(1, self.n_chunks)
        out = (c_uint8 * cap)()
        n = c_size_t()
        _check(lib.objectcache_transfer_chunk_status(self._handle(), out, cap, byref(n)))
        return [ChunkStatus(out[i]) for i in range(n.value)]

    def stats(self):
        """Counters of the transfer, a :class:`TransferStats`."""
        s = _ffi.TransferStats()
        s.struct_size = ctypes.sizeof(s)
        _check(lib.objectcache_transfer_stats_get(self._handle(), byref(s)))
        return TransferStats(s)

    def stall_advice(
        self, model, gpu, load_tokens, new_tokens, kernels="tuned", tp=1, compute_us_per_layer=0
    ):
        """The planner's deadline fallback now (``objectcache_transfer_stall_advice``): keep
        waiting, or cancel and recompute from ``from_layer``. See docs/c-abi.md. Returns a
        :class:`StallAdvice`."""
        p = _ffi.StallParams(
            ctypes.sizeof(_ffi.StallParams),
            int(tp),
            str(model).encode(),
            str(gpu).encode(),
            None if kernels is None else str(kernels).encode(),
            int(load_tokens),
            int(new_tokens),
            int(compute_us_per_layer),
        )
        out = _ffi.StallAdvice()
        out.struct_size = ctypes.sizeof(out)
        _check(lib.objectcache_transfer_stall_advice(self._handle(), byref(p), byref(out)))
        return StallAdvice(out)

    def cancel(self):
        """Cancels outstanding reads; layers not yet ready fail with
        :class:`LayerCancelledError`. Idempotent."""
        _check(lib.objectcache_transfer_cancel(self._handle()))

    def release(self):
        """Releases the transfer (``objectcache_transfer_release``): cancels what is
        outstanding and returns once no copy into the destinations is in flight. Releasing
        twice does nothing."""
        with self._lock:
            if self._h is None:
                return
            h, self._h = self._h, None
        _check(lib.objectcache_transfer_release(h))
        self._keep = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()

    def __del__(self):
        try:
            if getattr(self, "_h", None) is not None:
                lib.objectcache_transfer_release(self._h)
        except Exception:
            pass
