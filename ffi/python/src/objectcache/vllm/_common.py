"""What the connector's two sides share: its settings and the geometry they give, the
metadata the scheduler sends the workers, the timing trace, and vLLM's logger."""

import dataclasses
import functools
import hashlib
import json
import logging
import os
import sys
import threading
import time

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

import objectcache as oc


# Under vLLM's logger hierarchy, so the messages appear in vLLM's log format and level.
logger = logging.getLogger("vllm.objectcache")

#: The connector's own settings in ``kv_connector_extra_config`` (every other key must be an
#: engine setting, :data:`objectcache.CONFIG_KEYS`), with their defaults.
CONNECTOR_SETTINGS = {
    # Tokens per chunk object: a multiple of vLLM's block size (default: the block size).
    "tokens_per_chunk": None,
    # Model identifier in the keys (default: vLLM's model name or path). Set the same value on
    # every replica that should share entries.
    "model_id": None,
    # KV layout name in the geometry (default: vllm<major.minor>/<device>/<KV cache layout>).
    "layout": None,
    # "layerwise": the load runs inside the forward pass, layer l computes while later
    # layers arrive; "async": vLLM waits for the whole load between steps (other requests
    # keep running meanwhile).
    "load_mode": "layerwise",
    # Whether to save newly computed full chunks (default: on for kv_both/kv_producer).
    "save": None,
    # Whether to load (default: on for kv_both/kv_consumer).
    "load": None,
    # How long get_num_new_matched_tokens waits for a lookup before letting vLLM ask again
    # later (ms), and after how long a lookup that has not answered counts as a miss (ms).
    "lookup_wait_ms": 20,
    "lookup_timeout_ms": 2000,
    # How long a chunk whose load failed (missing, corrupt, stalled, storage error) is a miss
    # for every request of this replica (ms): the request that saw it fail never loads it
    # again, and other requests do not retry it at once (no load-fail-recompute loop).
    "failed_chunk_ttl_ms": 30000,
}

# ---- Timing trace (OBJECTCACHE_VLLM_TRACE) -------------------------------------------------

#: ``OBJECTCACHE_VLLM_TRACE``: unset, empty or ``0``: no trace. ``1``: one JSON line per
#: connector call to stderr, prefixed ``objectcache-trace``. Anything else: a file path the
#: lines are appended to (one ``write`` per line, so several processes may share it).
_TRACE = os.environ.get("OBJECTCACHE_VLLM_TRACE", "")
_TRACE = "" if _TRACE in ("", "0") else _TRACE
_TRACE_LOCK = threading.Lock()


def _trace(event, **fields):
    """Writes one trace line: ``t`` (Unix time, s; comparable across processes), ``pid``,
    ``thread``, ``event`` and ``fields`` (durations in ms, named ``*_ms``)."""
    rec = {"t": round(time.time(), 6), "pid": os.getpid(),
           "thread": threading.current_thread().name, "event": event}
    rec.update(fields)
    line = "objectcache-trace " + json.dumps(rec, default=str) + "\n"
    with _TRACE_LOCK:
        if _TRACE == "1":
            sys.stderr.write(line)
            sys.stderr.flush()
        else:
            with open(_TRACE, "a") as f:
                f.write(line)


def _ms(t0):
    return round(1000 * (time.monotonic() - t0), 3)


def _traced(fields=None):
    """Decorator of a connector method: with the trace on, each call writes one trace line
    named after the method, with ``call_ms`` and ``fields(self, result, *args)``; with it
    off, the method itself is returned (nothing added to the call)."""
    def wrap(fn):
        if not _TRACE:
            return fn

        @functools.wraps(fn)
        def traced(self, *args, **kwargs):
            t0 = time.monotonic()
            out = fn(self, *args, **kwargs)
            _trace(fn.__name__, call_ms=_ms(t0),
                   **(fields(self, out, *args) if fields else {}))
            return out
        return traced
    return wrap


# The connector's default for the engine's load deadline (a stalled store never holds a
# request longer than this; layers not in place by then are recomputed).
_DEFAULT_LOAD_TIMEOUT_MS = 10000

_DTYPES = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
}
if hasattr(torch, "float8_e4m3fn"):
    _DTYPES[torch.float8_e4m3fn] = "fp8-e4m3"


def _bool(v):
    if isinstance(v, bool):
        return v
    s = str(v).strip().lower()
    if s in ("1", "true", "on", "yes"):
        return True
    if s in ("0", "false", "off", "no"):
        return False
    raise ValueError(f"{v!r} is not a boolean")


@dataclasses.dataclass
class _Group:
    """One vLLM KV cache group as the connector stores it: its own chunk objects (its own
    geometry and keys), its own block table.

    ``kind``: ``full`` (full attention), ``swa`` (sliding window of ``window`` tokens: a load
    moves only the blocks inside the window at the end of the hit) or ``mla`` (multi-head
    latent attention: one latent of ``head_dim x 2`` elements per token, the same on every TP
    rank, so stored once, by rank 0, and loaded by every rank). ``kv_heads`` and
    ``head_dim`` are the geometry's (``bytes per token per layer = 2 x kv_heads x head_dim x
    dtype``; for MLA ``kv_heads = 1`` and ``head_dim`` half the latent). ``layout`` names the
    engine layout, the group's kind and window, and the model's group structure, so chunks
    of different groups, windows or layer patterns never answer for each other; the library
    derives it, and the dimensions, from the typed ``engine_layout``
    (:class:`objectcache.EngineLayout`)."""

    index: int
    kind: str
    window: int
    layer_names: list
    block_size: int
    blocks_per_chunk: int
    kv_heads: int
    head_dim: int
    dtype: str
    layout: str
    # The typed layout the library resolved ``layout``, ``kv_heads`` and ``head_dim`` from,
    # and the bytes of one block of one layer it gives.
    engine_layout: object
    block_bytes: int

    @property
    def replicated(self):
        """Whether every TP rank holds the same bytes (MLA): stored once, saved by rank 0."""
        return self.kind == "mla"


@dataclasses.dataclass
class _Settings:
    """Settings shared by the scheduler and worker roles, derived identically in both."""

    engine: dict
    tokens_per_chunk: int
    model_id: str
    load_mode: str
    save: bool
    load: bool
    lookup_wait_s: float
    lookup_timeout_s: float
    failed_chunk_ttl_s: float
    hash_algo: str
    # Tokens per vLLM block hash (``request.block_hashes``): vLLM's ``hash_block_size``, which
    # may be finer than the block size (its prefix match unit). A chunk's key is the hash at
    # the token that closes it: ``block_hashes[(c + 1) * tokens_per_chunk // hash_block_size
    # - 1]``.
    hash_block_size: int
    tp_world: int
    groups: list  # of _Group, in vLLM's group order

    # The first group's figures, as the single-group code paths and logs name them.
    @property
    def block_size(self):
        return self.groups[0].block_size

    @property
    def blocks_per_chunk(self):
        return self.groups[0].blocks_per_chunk

    @property
    def layout(self):
        return self.groups[0].layout

    @property
    def layer_names(self):
        return [n for g in self.groups for n in g.layer_names]

    @property
    def hybrid(self):
        """More than one KV cache group (vLLM's hybrid KV cache manager)."""
        return len(self.groups) > 1


def _cpu_list(text):
    """Parses a Linux CPU list (``0,2-3``) into a set of ints."""
    out = set()
    for part in text.strip().split(","):
        if part:
            a, _, b = part.partition("-")
            out.update(range(int(a), int(b or a) + 1))
    return out


def _spare_cpus():
    """The CPUs this process may use that its calling thread is not bound to, sorted; empty
    when the thread may use them all. vLLM on the CPU binds each worker's OpenMP threads,
    the worker's main thread among them, to its compute cores and leaves the reserved cores
    (``VLLM_CPU_NUM_OF_RESERVED_CPU``) to other work; threads started later inherit the
    binding. Without a ``cpus`` setting the engine's threads, which copy and check the KV
    of loads, would run on the compute cores and slow the forward pass they feed."""
    try:
        mine = os.sched_getaffinity(0)
        with open("/sys/devices/system/cpu/online") as f:
            usable = _cpu_list(f.read())
        try:
            with open("/sys/fs/cgroup/cpuset.cpus.effective") as f:
                usable &= _cpu_list(f.read()) or usable
        except OSError:
            pass
    except (AttributeError, OSError, ValueError):
        return []
    return sorted(usable - mine)


def _settings(vllm_config, kv_cache_config):
    ktc = vllm_config.kv_transfer_config
    extra = dict(ktc.kv_connector_extra_config or {})
    engine = {}
    own = dict(CONNECTOR_SETTINGS)
    for k, v in extra.items():
        if k in CONNECTOR_SETTINGS:
            own[k] = v
        elif k in oc.CONFIG_KEYS:
            engine[k] = v
        else:
            raise ValueError(
                f"ObjectCacheConnector: unknown setting {k!r} in kv_connector_extra_config; "
                f"connector settings: {', '.join(CONNECTOR_SETTINGS)}; engine settings: "
                f"{', '.join(oc.CONFIG_KEYS)}"
            )
    engine.setdefault("load_timeout_ms", _DEFAULT_LOAD_TIMEOUT_MS)
    # A lookup still waiting on the store when the connector would count it a miss answers
    # with the prefix its answers so far confirmed instead (a node tier that holds the prefix
    # answers at once; the remote store behind it, asked about the chunk after it, may not).
    lookup_timeout_ms = float(own["lookup_timeout_ms"])
    engine.setdefault("lookup_deadline_ms", int(max(
        1.0, lookup_timeout_ms - 2 * float(own["lookup_wait_ms"]))))
    if "cpus" not in engine:
        spare = _spare_cpus()
        if spare:
            engine["cpus"] = ",".join(str(c) for c in spare)
            logger.info(
                "ObjectCacheConnector: the engine's threads run on CPUs %s (this thread, "
                "vLLM's compute, is bound to %s)", engine["cpus"],
                sorted(os.sched_getaffinity(0)),
            )

    mc = vllm_config.model_config
    pc = vllm_config.parallel_config
    tp = int(pc.tensor_parallel_size)
    vgroups = kv_cache_config.kv_cache_groups
    if not vgroups:
        raise ValueError("ObjectCacheConnector: the model has no KV cache")
    _refuse_recurrent(vgroups, mc)
    block_sizes = [int(g.kv_cache_spec.block_size) for g in vgroups]
    tpc = int(own["tokens_per_chunk"] or max(block_sizes))
    for bs in block_sizes:
        if tpc <= 0 or tpc % bs:
            raise ValueError(
                f"ObjectCacheConnector: tokens_per_chunk {tpc} is not a positive multiple of "
                f"vLLM's block size {bs} (block sizes of the KV cache groups: {block_sizes})"
            )
    hbs = int(getattr(kv_cache_config, "hash_block_size", None) or block_sizes[0])
    if hbs <= 0 or tpc % hbs:
        raise ValueError(
            f"ObjectCacheConnector: vLLM hashes blocks every {hbs} tokens (its hash block "
            f"size, from --prefix-match-unit or the KV cache groups' block sizes), which does "
            f"not divide tokens_per_chunk {tpc}: a chunk would end between two block hashes "
            "and have no key of its own. Set tokens_per_chunk to a multiple of "
            f"{hbs} (and of the block sizes {block_sizes}), or prefix_match_unit to a "
            "divisor of it"
        )
    base_layout = str(own["layout"] or _default_layout(vllm_config, kv_cache_config,
                                                       vgroups[0].kv_cache_spec))
    groups = _groups(vgroups, tpc, base_layout, mc, pc, tp)
    load_mode = str(own["load_mode"])
    if load_mode not in ("layerwise", "async"):
        raise ValueError(
            f"ObjectCacheConnector: load_mode {load_mode!r} is not layerwise or async"
        )
    if len(groups) > 1 and load_mode == "layerwise":
        # vLLM 0.32 takes block-level load errors only from single-group models; with several
        # groups a failed load is reported per request, which it accepts for asynchronous
        # loads only.
        logger.info("ObjectCacheConnector: %d KV cache groups: loads are asynchronous "
                    "(load_mode async)", len(groups))
        load_mode = "async"
    role = ktc.kv_role
    save = _bool(own["save"]) if own["save"] is not None else role in ("kv_both", "kv_producer")
    load = _bool(own["load"]) if own["load"] is not None else role in ("kv_both", "kv_consumer")
    algo = vllm_config.cache_config.prefix_caching_hash_algo
    engine["hash_algo"] = "sha256cbor" if algo == "sha256_cbor" else "ext"
    return _Settings(
        engine=engine,
        tokens_per_chunk=tpc,
        model_id=str(own["model_id"] or mc.model),
        load_mode=load_mode,
        save=save,
        load=load,
        lookup_wait_s=float(own["lookup_wait_ms"]) / 1000.0,
        lookup_timeout_s=float(own["lookup_timeout_ms"]) / 1000.0,
        failed_chunk_ttl_s=float(own["failed_chunk_ttl_ms"]) / 1000.0,
        hash_algo=algo,
        hash_block_size=hbs,
        tp_world=tp,
        groups=groups,
    )


def _refuse_recurrent(vgroups, mc):
    """``ValueError`` naming the model and its layers when it keeps recurrent state (Mamba,
    linear attention: vLLM's ``MambaSpec`` and its kinds), which ObjectCache does not store."""
    from vllm.v1.kv_cache_interface import MambaSpec

    recurrent = [g for g in vgroups if isinstance(g.kv_cache_spec, MambaSpec)]
    if recurrent:
        layers = [n for g in recurrent for n in g.layer_names]
        raise ValueError(
            f"ObjectCacheConnector: model {mc.model} keeps recurrent state (Mamba or linear "
            f"attention) in {len(layers)} layers ({', '.join(layers[:3])}"
            f"{', ...' if len(layers) > 3 else ''}); ObjectCache stores attention KV only, "
            "and a prefix loaded without its recurrent state would give wrong output. "
            "Supported: full attention, sliding window attention (with vLLM's hybrid KV "
            "cache manager) and MLA models. Run this model without the connector."
        )


def _groups(vgroups, tpc, base_layout, mc, pc, tp):
    """The connector's view of vLLM's KV cache groups (:class:`_Group`), or ``ValueError``
    naming what is not supported: recurrent state (Mamba, linear attention), and attention
    kinds other than full, sliding window and MLA."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    hybrid = len(vgroups) > 1
    shape = json.dumps([[type(g.kv_cache_spec).__name__,
                         int(getattr(g.kv_cache_spec, "sliding_window", None) or 0),
                         list(g.layer_names)] for g in vgroups])
    digest = hashlib.sha256(shape.encode()).hexdigest()[:8]
    engine, slash, order = base_layout.rpartition("/")
    if not slash or not engine or not order:
        raise ValueError(
            f"ObjectCacheConnector: layout {base_layout!r} must be ENGINE/ORDER, e.g. "
            "vllm0.32/cuda/NHD (the engine, its version and device; the block packing)")
    out = []
    for i, vg in enumerate(vgroups):
        spec = vg.kv_cache_spec
        dtype = _DTYPES.get(spec.dtype)
        if dtype is None:
            raise ValueError(
                f"ObjectCacheConnector: KV cache dtype {spec.dtype} is not supported")
        bs = int(spec.block_size)
        window, group_kind = 0, "full"
        if isinstance(spec, MLAAttentionSpec):
            kind = "mla"
            if int(getattr(spec, "head_size_v", 0) or 0):
                raise ValueError("ObjectCacheConnector: MLA with a separate V is not supported")
            el = oc.EngineLayout(engine, order, "mla", latent_dim=int(spec.head_size),
                                 block_size=bs, dtype=dtype)
        elif isinstance(spec, (SlidingWindowSpec, FullAttentionSpec)):
            kind = "full"
            if isinstance(spec, SlidingWindowSpec) or (hybrid and
                                                       getattr(spec, "sliding_window", None)):
                kind, window, group_kind = "swa", int(spec.sliding_window), "sliding_window"
            el = oc.EngineLayout(engine, order, "paged_kv", kv_heads=int(spec.num_kv_heads),
                                 head_dim=int(spec.head_size), block_size=bs, dtype=dtype)
        else:
            raise ValueError(
                f"ObjectCacheConnector: KV cache group {i} ({type(spec).__name__}: layers "
                f"{', '.join(vg.layer_names[:3])}) is of a kind ObjectCache does not store; "
                "supported: full attention, sliding window, MLA")
        if hybrid:
            el.group_count, el.group_index = len(vgroups), i
            el.group_kind, el.window, el.structure = group_kind, window, digest
        r = el.resolve(tp)  # the library names the layout and checks its dimensions
        out.append(_Group(index=i, kind=kind, window=window, layer_names=list(vg.layer_names),
                          block_size=bs, blocks_per_chunk=tpc // bs, kv_heads=r["kv_heads"],
                          head_dim=r["head_dim"], dtype=dtype, layout=r["name"],
                          engine_layout=el, block_bytes=r["block_bytes"]))
    return out


def _default_layout(vllm_config, kv_cache_config, spec):
    """``vllm<major.minor>/<device>/<KV cache layout>``, e.g. ``vllm0.32/cuda/NHD``; on the CPU
    the device part names vLLM's CPU attention ISA too, e.g. ``vllm0.32/cpu-vec/LBHNC``: the
    CPU backend packs each block's bytes for its attention kernel (its
    ``cpu_attn_reshape_and_cache`` takes the ISA: ``amx``, ``vec``, ``vec16``, ``neon``, ...),
    so an AMX machine and an AVX2 machine at the same block size write blocks of different
    meaning and must not share entries. The vLLM version is part of the name, since an engine
    may change the meaning of its blocks between versions. The KV cache layout is the one vLLM
    resolved for this model (the same in the scheduler and the workers)."""
    import vllm
    from vllm.platforms import current_platform

    ver = ".".join(str(vllm.__version__).split(".")[:2])
    kv_layout = (getattr(kv_cache_config, "kv_cache_layout", None)
                 or getattr(vllm_config.cache_config, "kv_cache_layout", None))
    if not kv_layout:
        raise ValueError(
            "ObjectCacheConnector: vLLM has not resolved its KV cache layout; set "
            "\"layout\" in kv_connector_extra_config"
        )
    device = str(current_platform.device_type)
    if device == "cpu":
        device = f"cpu-{_cpu_attn_isa(vllm_config, spec)}"
    return f"vllm{ver}/{device}/{kv_layout}"


def _cpu_attn_isa(vllm_config, spec):
    """The ISA vLLM's CPU attention backend packs KV blocks for (``amx``, ``vec``, ``vec16``,
    ``neon``, ...), asked of the backend itself; where this vLLM has no such function, the
    machine's architecture and its x86 matrix/vector extensions, which decide the ISA."""
    head_size = int(vllm_config.model_config.get_head_size())
    kv_dtype = getattr(vllm_config.cache_config, "cache_dtype", None)
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        return str(_get_attn_isa(spec.dtype, int(spec.block_size), head_size, kv_dtype))
    except (ImportError, AttributeError, TypeError):
        import platform

        import torch

        ext = [n for n, has in (("amx", torch.cpu._is_amx_tile_supported),
                                ("avx512", torch.cpu._is_avx512_supported)) if has()]
        return "-".join([platform.machine()] + ext)


def _geometry(s, tp_rank, group=0):
    """The geometry of KV cache group ``group`` as TP rank ``tp_rank`` stores it; a
    replicated group (MLA) is one object for all ranks (rank 0 of a world of 1)."""
    gr = s.groups[group]
    rank, world = (0, 1) if gr.replicated else (tp_rank, s.tp_world)
    g = oc.Geometry(
        s.model_id,
        layers=len(gr.layer_names),
        kv_heads=gr.kv_heads,
        head_dim=gr.head_dim,
        dtype=gr.dtype,
        tokens_per_chunk=s.tokens_per_chunk,
        tp_rank=rank,
        tp_world=world,
    )
    g.layout = gr.layout
    g.block_size = gr.block_size
    return g


# ---- Chunk keys ----------------------------------------------------------------------------


def chunk_key_index(s, c):
    """Index in ``request.block_hashes`` of chunk ``c``'s key: the block hash at the token that
    closes the chunk. vLLM chains each hash over every token before it, so that hash names
    exactly the chunk's prefix, at whatever granularity vLLM hashes (``hash_block_size``)."""
    return (c + 1) * s.tokens_per_chunk // s.hash_block_size - 1


def chunk_keys(s, block_hashes, n_chunks):
    """Keys of the first ``n_chunks`` chunks (fewer when the hashes do not reach that far)."""
    n = min(n_chunks, len(block_hashes) * s.hash_block_size // s.tokens_per_chunk)
    return [bytes(block_hashes[chunk_key_index(s, c)]) for c in range(n)]


def check_chunk_keys(s):
    """Start-up check that a chunk's key is vLLM's block hash at the token that closes the
    chunk, for the hash function and the hash granularity this vLLM runs with: over a
    synthetic prompt of three chunks hashed by vLLM's own ``hash_block_tokens`` at
    ``hash_block_size``, changing the last token of chunk ``c`` must change key ``c``, and
    changing the first token after it must not. With ``sha256_cbor`` the keys must also be
    ``objectcache.chunk_hashes`` of the tokens (vLLM's algorithm, computed by the library).
    Raises ``ValueError`` naming what differs; a connector whose keys could name another
    prefix must not start."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import hash_block_tokens

    hbs, tpc = s.hash_block_size, s.tokens_per_chunk
    fn = get_hash_fn_by_name(s.hash_algo)
    seed_text = "objectcache-key-check"
    seed = fn(seed_text)  # vLLM's NONE_HASH for this seed: the parent of the first block

    def vllm_hashes(tokens):
        out, parent = [], seed
        for i in range(0, len(tokens) - len(tokens) % hbs, hbs):
            parent = hash_block_tokens(fn, parent, tokens[i:i + hbs], None)
            out.append(parent)
        return out

    chunks = 3
    base = [(7 * i + 3) % 1000 for i in range(chunks * tpc + 1)]
    keys = chunk_keys(s, vllm_hashes(base), chunks)
    if len(keys) != chunks:
        raise ValueError(f"ObjectCacheConnector: {len(keys)} chunk keys for {chunks} chunks "
                         f"of {tpc} tokens hashed every {hbs} tokens")
    for c in range(chunks):
        for pos, must_change in (((c + 1) * tpc - 1, True), ((c + 1) * tpc, False)):
            t = list(base)
            t[pos] += 1
            changed = chunk_keys(s, vllm_hashes(t), chunks)[c] != keys[c]
            if changed != must_change:
                raise ValueError(
                    f"ObjectCacheConnector: chunk {c}'s key {'ignores' if must_change else 'covers'} "
                    f"token {pos} ({tpc} tokens per chunk, vLLM hashing every {hbs}): the keys "
                    "do not name exactly each chunk's prefix")
    if s.hash_algo == "sha256_cbor":
        ours = oc.chunk_hashes(base, hbs, seed=seed_text)
        if chunk_keys(s, ours, chunks) != keys:
            raise ValueError(
                "ObjectCacheConnector: objectcache.chunk_hashes differs from vLLM's sha256_cbor "
                "block hashes; this vLLM hashes blocks another way (set prefix_caching_hash_algo "
                "to another algorithm to use its hashes as opaque keys)")


# ---- Metadata (scheduler -> workers) -------------------------------------------------------


@dataclasses.dataclass
class _GroupPart:
    """One KV cache group's share of a load or save: the chunks it moves (indices into the
    load's or save's hashes; a sliding-window group moves only those inside its window) and
    their vLLM block ids, ``blocks_per_chunk`` per chunk (``None``: vLLM's null block, a
    block outside the window that a chunk object still holds)."""

    group: int
    chunks: list
    block_ids: list


@dataclasses.dataclass
class _LoadSpec:
    req_id: str
    hashes: list  # chunk hashes, prefix order
    parts: list  # _GroupPart per KV cache group
    is_async: bool
    # Blocks vLLM counts as loaded that no whole chunk covers: reported as load errors.
    fail_block_ids: list = dataclasses.field(default_factory=list)
    # The lookup's segment markers (format version 2; Engine.segment_markers) per TP rank
    # (each rank's chunks live in its own segments), so the workers place the chunks
    # without reading markers themselves.
    markers: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class _SaveSpec:
    req_id: str
    hashes: list
    parts: list  # _GroupPart per KV cache group


@dataclasses.dataclass
class ObjectCacheMetadata(KVConnectorMetadata):
    """What the workers do this step: loads to post, saves to start, requests whose saves
    vLLM waits for (their blocks are held), preempted requests."""

    loads: list = dataclasses.field(default_factory=list)
    saves: list = dataclasses.field(default_factory=list)
    preempted: set = dataclasses.field(default_factory=set)


def _request_id(req_id):
    """vLLM's request id as the 64-bit id the engine logs and reports."""
    return int.from_bytes(hashlib.blake2b(req_id.encode(), digest_size=8).digest(), "little")


#: Why a chunk of a load did not load, as counted (``vllm:objectcache_failed_chunks``) and
#: reported by the workers: the object was gone after its lookup said hit; a slice failed its
#: CRC32C, the object was truncated or of another geometry; nothing arrived within the stall
#: limit or the load's deadline; the store or transport failed after bounded retries; the
#: engine refused to post the load; the request ended (aborted) while it loaded.
FAILURE_REASONS = ("missing", "corrupt", "stalled", "error", "refused", "cancelled")


@dataclasses.dataclass
class LoadOutcome:
    """How one request's load ended on a worker: ``chunks`` chunks were asked, the leading
    ``ok`` loaded and verified (vLLM uses exactly those; it recomputes from the first failed
    block on), ``failed`` counts the failed chunks by reason (:data:`FAILURE_REASONS`), and
    ``faulty`` lists the chunks whose own object was at fault (missing or corrupt), as
    opposed to chunks that failed with the store or the load (stalled, error)."""

    chunks: int
    ok: int
    failed: dict = dataclasses.field(default_factory=dict)
    faulty: list = dataclasses.field(default_factory=list)

    def merge(self, other):
        """Both ranks' view of one load: the chunks every rank loaded, each reason's largest
        count, the faulty chunks of either."""
        failed = dict(self.failed)
        for r, n in other.failed.items():
            failed[r] = max(failed.get(r, 0), n)
        return LoadOutcome(max(self.chunks, other.chunks), min(self.ok, other.ok), failed,
                           sorted(set(self.faulty) | set(other.faulty)))


@dataclasses.dataclass
class ObjectCacheWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler, once per step: the loads that ended this step
    (``outcomes``: request id -> :class:`LoadOutcome`) and, when vLLM publishes KV events, the
    chunks saved (``saved``), merged over TP ranks by :meth:`aggregate`."""

    outcomes: dict = dataclasses.field(default_factory=dict)
    # Saves that ended well this step, when vLLM publishes KV events: (KV cache group, TP
    # rank, chunk key) per chunk, every rank's.
    saved: list = dataclasses.field(default_factory=list)

    def aggregate(self, other):
        merged = dict(self.outcomes)
        for rid, o in getattr(other, "outcomes", {}).items():
            merged[rid] = merged[rid].merge(o) if rid in merged else o
        return ObjectCacheWorkerMetadata(merged, self.saved + list(getattr(other, "saved", ())))
