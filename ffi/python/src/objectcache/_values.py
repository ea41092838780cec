"""Values passed to and from the C ABI: the KV geometry, an engine's layout, chunk hashes of
token ids, and the reports and statistics the engine returns."""

import ctypes
import enum
from ctypes import byref, c_size_t, c_uint8, c_uint32, c_uint64

from . import _ffi
from ._errors import _check
from ._ffi import lib


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


class EngineLayout:
    """An engine's KV cache layout for one KV cache group, as a typed value
    (``objectcache_engine_layout``): the library derives from it the layout name in the keys,
    the bytes of one block of one layer, and the geometry (:meth:`geometry`). Engines describe
    their blocks with it instead of composing layout names.

    Args:
        engine: the engine, its version and device, e.g. ``"vllm0.32/cpu-amx"``.
        order: the engine's name for its block packing (vLLM's KV cache layout: ``"NHD"``,
            ``"HND"``, ``"LBHNC"``); for ``family="opaque"`` the layout's whole name.
        family: ``"paged_kv"`` (K and V of ``kv_heads`` heads of ``head_dim`` elements per
            token), ``"mla"`` (one latent of ``latent_dim`` elements per token, the same on
            every TP rank: stored once), ``"recurrent"`` (refused by the library: not stored)
            or ``"opaque"`` (``bytes_per_token`` per token per layer).
        kv_heads, head_dim: paged K/V: KV heads on this TP rank, elements per head.
        latent_dim: MLA: elements per token.
        block_size: tokens per block.
        dtype: ``"bf16"``, ``"fp16"``, ``"fp8-e4m3"`` or ``"fp32"``.
        group_count, group_index: the model's KV cache groups (1: one) and this one's index.
        group_kind: ``"full"`` or ``"sliding_window"`` (with ``window`` tokens).
        structure: with several groups, a digest of the model's group structure (1 to 16 hex
            digits): a change of window or layer pattern changes every key.
        bytes_per_token: opaque layouts: bytes per token per layer.
    """

    def __init__(self, engine, order, family="paged_kv", kv_heads=0, head_dim=0,
                 latent_dim=0, block_size=0, dtype="bf16", group_count=1, group_index=0,
                 group_kind="full", window=0, structure=None, bytes_per_token=0):
        for what, v, known in (("family", family, _ffi.FAMILY_CODES),
                               ("group_kind", group_kind, _ffi.GROUP_CODES),
                               ("dtype", dtype, _ffi.DTYPE_CODES)):
            if v not in known:
                raise ValueError(f"{what} {v!r} is not one of {', '.join(known)}")
        self.engine, self.order, self.family = str(engine), str(order), family
        self.kv_heads, self.head_dim, self.latent_dim = int(kv_heads), int(head_dim), int(latent_dim)
        self.block_size, self.dtype = int(block_size), dtype
        self.group_count, self.group_index = int(group_count), int(group_index)
        self.group_kind, self.window = group_kind, int(window)
        self.structure = None if structure is None else str(structure)
        self.bytes_per_token = int(bytes_per_token)

    def __repr__(self):
        return (f"EngineLayout({self.engine!r}, {self.order!r}, family={self.family!r}, "
                f"kv_heads={self.kv_heads}, head_dim={self.head_dim}, "
                f"latent_dim={self.latent_dim}, block_size={self.block_size}, "
                f"dtype={self.dtype!r}, group {self.group_index} of {self.group_count} "
                f"({self.group_kind}{' ' + str(self.window) if self.window else ''}))")

    def _c(self):
        c = _ffi.EngineLayout()
        c.struct_size = ctypes.sizeof(c)
        c.family = _ffi.FAMILY_CODES[self.family]
        self._keep = (self.engine.encode(), self.order.encode(),
                      None if self.structure is None else self.structure.encode())
        c.engine, c.order, c.structure = self._keep
        c.kv_heads, c.head_dim, c.latent_dim = self.kv_heads, self.head_dim, self.latent_dim
        c.block_size, c.dtype = self.block_size, _ffi.DTYPE_CODES[self.dtype]
        c.group_count, c.group_index = self.group_count, self.group_index
        c.group_kind, c.window = _ffi.GROUP_CODES[self.group_kind], self.window
        c.bytes_per_token = self.bytes_per_token
        return c

    def resolve(self, tp_world=1):
        """``objectcache_engine_layout_resolve``: a dict with ``name`` (the layout name in
        the keys), ``block_bytes`` (one block of one layer), ``kv_heads`` and ``head_dim``
        (the geometry's, whole model) and ``stored_once`` (every TP rank holds the same
        bytes). Raises :class:`UnsupportedError` for a recurrent layout and
        :class:`InvalidArgumentError` naming the field for a bad one."""
        c = self._c()
        name = ctypes.create_string_buffer(128)
        bb, kh, hd, once = ctypes.c_uint64(), ctypes.c_uint32(), ctypes.c_uint32(), ctypes.c_uint32()
        _check(lib.objectcache_engine_layout_resolve(
            ctypes.byref(c), int(tp_world), name, len(name), ctypes.byref(bb),
            ctypes.byref(kh), ctypes.byref(hd), ctypes.byref(once)))
        return {"name": name.value.decode(), "block_bytes": bb.value, "kv_heads": kh.value,
                "head_dim": hd.value, "stored_once": bool(once.value)}

    def geometry(self, model, layers, tokens_per_chunk, tp_rank=0, tp_world=1):
        """The :class:`Geometry` of ``layers`` layers of this layout (rank 0 of 1 when every
        rank holds the same bytes)."""
        r = self.resolve(tp_world)
        rank, world = (0, 1) if r["stored_once"] else (tp_rank, tp_world)
        return Geometry(model, layers=layers, kv_heads=r["kv_heads"], head_dim=r["head_dim"],
                        dtype=self.dtype, tokens_per_chunk=tokens_per_chunk, tp_rank=rank,
                        tp_world=world, layout=r["name"], block_size=self.block_size)


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
