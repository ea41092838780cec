"""The Python API: thin wrappers over the C ABI (``objectcache.h``), one call each.

Every method here calls exactly one C function (or, for a convenience, a fixed short sequence
of them) and turns its status into a return value or an exception carrying the C ABI's error
name and message. No storage, hashing or transfer logic lives in Python.
"""

import ctypes
import threading
from ctypes import byref, c_size_t, c_uint8, c_void_p

from . import _ffi
from ._errors import (
    ObjectCacheError,
    InvalidArgumentError,
    AbiMismatchError,
    InvalidHandleError,
    UnsupportedError,
    BusyError,
    BufferTooSmallError,
    ConfigError,
    FormatError,
    NotFoundError,
    StoreError,
    IoError,
    InternalError,
    LayerMissError,
    LayerMissingError,
    LayerChecksumError,
    LayerGeometryError,
    LayerStorageError,
    LayerTimeoutError,
    LayerCancelledError,
    LayerDeviceError,
    status_name,
    _check,
    version,
    abi_version,
)
from ._ffi import lib
from ._values import (
    ChunkStatus,
    EngineLayout,
    Geometry,
    _hash_params,
    _tokens_array,
    chunk_hashes,
    SaveReport,
    Metrics,
    TransferStats,
    StallAdvice,
)

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
    "EngineLayout",
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
#: ABI's ``objectcache_engine_create``), as the library lists them
#: (``objectcache_config_keys``). Unknown names are refused by the library with
#: :class:`ConfigError`, so this list is documentation, not a second check.
CONFIG_KEYS = tuple(lib.objectcache_config_keys().decode().split(","))


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


class _Owned:
    """A C handle (``self._h``, ``None`` once ended) that a ``with`` block ends through
    ``self._end()`` on exit, and that garbage collection frees with ``self._free(h)`` (errors
    ignored: the interpreter may be shutting down) if it was never ended."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._end()

    def __del__(self):
        try:
            if getattr(self, "_h", None) is not None:
                self._free(self._h)
        except Exception:
            pass


# ---- Engine ----------------------------------------------------------------------------------


class Engine(_Owned):
    """An ObjectCache engine (``objectcache_engine``): one per process or TP rank, shared by
    threads.

    Keyword arguments are the ``EngineConfig`` settings, by their names (see
    :data:`CONFIG_KEYS` and docs/c-abi.md): ``store`` (a directory, ``file:///path``,
    ``memory://`` or ``s3://bucket/prefix?endpoint=...``), ``namespace``, ``hash_algo``,
    ``window_bytes``, ``max_requests``, ``coalesce_bytes``, ``lookup_fanout``,
    ``lookup_cache_ttl_ms``, ``load_timeout_ms``, ``load_min_rate_bytes_per_s``,
    ``stall_timeout_ms``, ``save_concurrency``, ``worker_threads``, ``cpus``, ``gather``,
    ``gather_streams``, ``single_flight``, ``self_check``, ``transport``, ``scheduler``,
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

    def _end(self):
        self.close()

    @staticmethod
    def _free(h):
        lib.objectcache_engine_destroy(h)

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

    #: ``store_mode()``'s answers, by the C ABI's number.
    STORE_MODES = ("not_checked", "safe", "short_idle", "refused")

    def store_mode(self):
        """What the store's self-check found (``objectcache_store_mode``; engine setting
        ``self_check``): ``"not_checked"`` (a local store, ``self_check`` off, or the check
        still running), ``"safe"``, ``"short_idle"`` (safe with a shorter idle time for
        pooled connections; the log names the store URL setting) or ``"refused"`` (saves
        fail, naming the failed check)."""
        v = ctypes.c_uint32()
        _check(lib.objectcache_store_mode(self._handle(), byref(v)))
        return self.STORE_MODES[v.value] if v.value < len(self.STORE_MODES) else str(v.value)

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

    def segment_markers(self, geometry, hashes):
        """The format version 2 publish markers this engine's lookup of ``hashes`` read, one
        per segment object, as ``bytes`` of 72-byte records (``objectcache_segment_markers``;
        empty for chunk objects of version 1 or when nothing was looked up). Hand them to
        :meth:`add_segment_markers` of the engine that loads these chunks elsewhere."""
        arr, hl, n = _packed_hashes(hashes)
        g = geometry._c()
        count = c_size_t()
        _check(lib.objectcache_segment_markers(self._handle(), byref(g), arr, hl, n, None, 0,
                                               byref(count)))
        if count.value == 0:
            return b""
        buf = (c_uint8 * (72 * n))()
        _check(lib.objectcache_segment_markers(self._handle(), byref(g), arr, hl, n, buf, n,
                                               byref(count)))
        return bytes(buf[:72 * count.value])

    def add_segment_markers(self, geometry, hashes, records):
        """Takes ``records`` (:meth:`segment_markers` of another engine, for the same
        ``hashes``) as if this engine had looked them up, so its next loads of these chunks
        place them without reading markers (``objectcache_segment_markers_add``). A bad
        record raises :class:`InvalidArgumentError` naming it."""
        if not records:
            return
        if len(records) % 72:
            raise ValueError(f"records: {len(records)} bytes is not a whole number of "
                             "72-byte records")
        arr, hl, n = _packed_hashes(hashes)
        g = geometry._c()
        buf = (c_uint8 * len(records)).from_buffer_copy(records)
        _check(lib.objectcache_segment_markers_add(self._handle(), byref(g), arr, hl, n, buf,
                                                   len(records) // 72))

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
        # The fields both load parameter structs begin with (_ffi._LOAD_PARAMS_HEAD), after
        # struct_size.
        head = (
            int(priority),
            int(request_id) & 0xFFFFFFFFFFFFFFFF,
            int(deadline_ms),
            int(compute_us_per_layer),
            ctypes.pointer(g),
            arr,
            hl,
            n,
        )
        if _is_paged(layers):
            ranges, per, keep = _paged_ranges(layers, writable=True)
            p = _ffi.PagedLoadParams(
                ctypes.sizeof(_ffi.PagedLoadParams), *head, ranges, per, len(layers)
            )
            load = lib.objectcache_load_paged
        else:
            spans = [_span(layer, writable=True) for layer in layers]
            dests = (_ffi.LayerDest * max(1, len(spans)))(
                *[_ffi.LayerDest(s[0], s[1]) for s in spans]
            )
            keep = [s[2] for s in spans]
            p = _ffi.LoadParams(ctypes.sizeof(_ffi.LoadParams), *head, dests, len(spans))
            load = lib.objectcache_load
        t = c_void_p()
        _check(load(self._handle(), byref(p), byref(t)))
        return Transfer(self, t, geometry.layers, n, keep)


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


class Transfer(_Owned):
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

    def _end(self):
        self.release()

    @staticmethod
    def _free(h):
        lib.objectcache_transfer_release(h)
