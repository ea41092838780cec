"""ObjectCache as a vLLM KV connector (vLLM 0.32, ``KVConnectorBase_V1``).

Enable it with::

    --kv-transfer-config '{"kv_connector": "ObjectCacheConnector",
                           "kv_connector_module_path": "objectcache.vllm",
                           "kv_role": "kv_both",
                           "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"store": "s3://kv/prod?endpoint=..."}}'

(the same dict as ``kv_transfer_config=`` of ``vllm.LLM``). docs/vllm.md describes every
setting, the keys and the layout, and what happens on a miss, corruption or a stall.

How it works, in vLLM's two roles:

* Scheduler (``get_num_new_matched_tokens`` ... ``request_finished``): a request's chunk keys
  are vLLM's own block hashes (``request.block_hashes``; with ``sha256_cbor`` they are
  ObjectCache's ``sha256cbor`` hashes, so other engines and tools compute the same keys). A
  lookup finds how many leading full chunks are stored (at most a few store round trips,
  answers cached), leaving at least one prompt token to compute. Blocks the lookup hit are
  loaded; newly computed full chunks are saved.
* Worker (``register_kv_caches`` ... ``get_finished``): the whole KV buffer is registered with
  the engine once. Each request to load gets one load straight into its paged blocks;
  ``wait_for_layer_load(layer)`` returns when that layer is in place, so layer ``l``
  computes while later layers still arrive. Saves read the blocks where they are, on a
  background thread, after the forward pass. A layer that fails (missing, corrupt, timed out)
  is reported to vLLM as a load error for exactly the blocks of the chunks concerned; vLLM
  recomputes them (``kv_load_failure_policy: recompute``).

The chunk bytes are the engine's block bytes as they are (no conversion): the geometry names
the layout (vLLM version, device, KV cache layout, block size), so another layout gets
misses, never bytes of another meaning.
"""

import concurrent.futures
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
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

import objectcache as oc

# Under vLLM's logger hierarchy, so the messages appear in vLLM's log format and level.
logger = logging.getLogger("vllm.objectcache")

__all__ = ["ObjectCacheConnector", "ObjectCacheConnectorStats", "CONNECTOR_SETTINGS",
           "flush_saves"]

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
class _Settings:
    """Settings shared by the scheduler and worker roles, derived identically in both."""

    engine: dict
    tokens_per_chunk: int
    block_size: int
    blocks_per_chunk: int
    model_id: str
    layout: str
    load_mode: str
    save: bool
    load: bool
    lookup_wait_s: float
    lookup_timeout_s: float
    hash_algo: str
    layer_names: list
    kv_heads: int
    head_dim: int
    dtype: str
    tp_world: int


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
    if "cpus" not in engine:
        spare = _spare_cpus()
        if spare:
            engine["cpus"] = ",".join(str(c) for c in spare)
            logger.info(
                "ObjectCacheConnector: the engine's threads run on CPUs %s (this thread, "
                "vLLM's compute, is bound to %s)", engine["cpus"],
                sorted(os.sched_getaffinity(0)),
            )

    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ValueError(
            f"ObjectCacheConnector: {len(groups)} KV cache groups; only models with one "
            "(full attention) group are supported"
        )
    spec = groups[0].kv_cache_spec
    block_size = int(spec.block_size)
    tpc = int(own["tokens_per_chunk"] or block_size)
    if tpc <= 0 or tpc % block_size:
        raise ValueError(
            f"ObjectCacheConnector: tokens_per_chunk {tpc} is not a positive multiple of "
            f"vLLM's block size {block_size}"
        )
    dtype = _DTYPES.get(spec.dtype)
    if dtype is None:
        raise ValueError(f"ObjectCacheConnector: KV cache dtype {spec.dtype} is not supported")
    mc = vllm_config.model_config
    pc = vllm_config.parallel_config
    tp = int(pc.tensor_parallel_size)
    heads_per_rank = int(mc.get_num_kv_heads(pc))
    load_mode = str(own["load_mode"])
    if load_mode not in ("layerwise", "async"):
        raise ValueError(
            f"ObjectCacheConnector: load_mode {load_mode!r} is not layerwise or async"
        )
    role = ktc.kv_role
    save = _bool(own["save"]) if own["save"] is not None else role in ("kv_both", "kv_producer")
    load = _bool(own["load"]) if own["load"] is not None else role in ("kv_both", "kv_consumer")
    algo = vllm_config.cache_config.prefix_caching_hash_algo
    engine["hash_algo"] = "sha256cbor" if algo == "sha256_cbor" else "ext"
    return _Settings(
        engine=engine,
        tokens_per_chunk=tpc,
        block_size=block_size,
        blocks_per_chunk=tpc // block_size,
        model_id=str(own["model_id"] or mc.model),
        layout=str(own["layout"] or _default_layout(vllm_config, kv_cache_config, spec)),
        load_mode=load_mode,
        save=save,
        load=load,
        lookup_wait_s=float(own["lookup_wait_ms"]) / 1000.0,
        lookup_timeout_s=float(own["lookup_timeout_ms"]) / 1000.0,
        hash_algo=algo,
        layer_names=list(groups[0].layer_names),
        kv_heads=heads_per_rank * tp,
        head_dim=int(mc.get_head_size()),
        dtype=dtype,
        tp_world=tp,
    )


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


def _geometry(s, tp_rank):
    g = oc.Geometry(
        s.model_id,
        layers=len(s.layer_names),
        kv_heads=s.kv_heads,
        head_dim=s.head_dim,
        dtype=s.dtype,
        tokens_per_chunk=s.tokens_per_chunk,
        tp_rank=tp_rank,
        tp_world=s.tp_world,
    )
    g.layout = s.layout
    g.block_size = s.block_size
    return g


# ---- Metadata (scheduler -> workers) -------------------------------------------------------


@dataclasses.dataclass
class _LoadSpec:
    req_id: str
    hashes: list  # chunk hashes, prefix order
    block_ids: list  # vLLM block ids, blocks_per_chunk per chunk
    is_async: bool
    # Blocks vLLM counts as loaded that no whole chunk covers: reported as load errors.
    fail_block_ids: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _SaveSpec:
    req_id: str
    hashes: list
    block_ids: list


@dataclasses.dataclass
class ObjectCacheMetadata(KVConnectorMetadata):
    """What the workers do this step: loads to post, saves to start, requests whose saves
    vLLM waits for (their blocks are held), preempted requests."""

    loads: list = dataclasses.field(default_factory=list)
    saves: list = dataclasses.field(default_factory=list)
    preempted: set = dataclasses.field(default_factory=set)


# ---- Metrics ------------------------------------------------------------------------------


class ObjectCacheConnectorStats(KVConnectorStats):
    """Connector figures of an interval, from both roles (``data``): lookups, ``hit_tokens``,
    ``lookup_s`` (list), loads, ``loaded_bytes``, ``load_s`` (list, post to last layer),
    ``failed_blocks``, saves, ``saved_bytes``, ``save_s`` (list)."""

    _COUNTERS = ("lookups", "lookup_errors", "hit_tokens", "loads", "loaded_bytes",
                 "failed_blocks", "saves", "saved_bytes", "save_errors")
    _LISTS = ("lookup_s", "load_s", "save_s")

    def reset(self):
        self.data = {k: 0 for k in self._COUNTERS}
        self.data.update({k: [] for k in self._LISTS})

    def add(self, key, value):
        if key in self._LISTS:
            self.data.setdefault(key, []).append(value)
        else:
            self.data[key] = self.data.get(key, 0) + value

    def aggregate(self, other):
        for k, v in other.data.items():
            if k in self._LISTS:
                self.data.setdefault(k, []).extend(v)
            else:
                self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self):
        out = {k: self.data.get(k, 0) for k in self._COUNTERS}
        for k in self._LISTS:
            v = sorted(self.data.get(k, []))
            if v:
                out[k.replace("_s", "_ms") + "_p50"] = round(1000 * v[len(v) // 2], 3)
        return out

    def is_empty(self):
        return not any(self.data.get(k) for k in self._COUNTERS)


class _PromMetrics(KVConnectorPromMetrics):
    """Prometheus counters of the connector (``vllm:objectcache_*``)."""

    _NAMES = {
        "hit_tokens": "Prompt tokens found in ObjectCache by lookups.",
        "lookups": "ObjectCache lookups.",
        "lookup_errors": "ObjectCache lookups that failed or timed out (counted as misses).",
        "loads": "ObjectCache loads posted.",
        "loaded_bytes": "KV bytes loaded from ObjectCache.",
        "failed_blocks": "vLLM blocks whose load failed (recomputed).",
        "saves": "ObjectCache saves.",
        "saved_bytes": "KV bytes saved to ObjectCache.",
        "save_errors": "ObjectCache saves that failed.",
    }

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {}
        for key, doc in self._NAMES.items():
            c = self._counter_cls(name=f"vllm:objectcache_{key}", documentation=doc,
                                  labelnames=labelnames)
            self._counters[key] = {i: c.labels(*v) for i, v in per_engine_labelvalues.items()}
        h = self._histogram_cls(
            name="vllm:objectcache_load_seconds",
            documentation="Seconds from posting an ObjectCache load to its last layer in place.",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            labelnames=labelnames,
        )
        self._load_s = {i: h.labels(*v) for i, v in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data, engine_idx=0):
        for key, per_engine in self._counters.items():
            v = transfer_stats_data.get(key, 0)
            if v:
                per_engine[engine_idx].inc(v)
        for s in transfer_stats_data.get("load_s", []):
            self._load_s[engine_idx].observe(s)


# ---- The connector ------------------------------------------------------------------------


class ObjectCacheConnector(KVConnectorBase_V1):
    """ObjectCache as a vLLM v1 KV connector; see the module documentation and docs/vllm.md."""

    def __init__(self, vllm_config, role, kv_cache_config):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._s = _settings(vllm_config, kv_cache_config)
        if self._kv_transfer_config.kv_load_failure_policy != "recompute" and self._s.load:
            logger.warning(
                "ObjectCacheConnector: kv_load_failure_policy is %r; a failed or corrupt "
                "load then fails the request. Set \"kv_load_failure_policy\": \"recompute\" "
                "to have vLLM recompute the blocks instead.",
                self._kv_transfer_config.kv_load_failure_policy,
            )
        self._engine = oc.Engine(**self._s.engine)
        self._stats = ObjectCacheConnectorStats()
        self._stats_lock = threading.Lock()
        self._scheduler = None
        self._worker = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = _SchedulerSide(self)
        else:
            self._worker = _WorkerSide(self)
        logger.info(
            "ObjectCacheConnector (%s): store %s, %d tokens per chunk (%d blocks), layout %s, "
            "model id %s, load %s (%s), save %s",
            "scheduler" if role == KVConnectorRole.SCHEDULER else "worker",
            self._s.engine.get("store", "(default)"), self._s.tokens_per_chunk,
            self._s.blocks_per_chunk, self._s.layout, self._s.model_id,
            "on" if self._s.load else "off", self._s.load_mode,
            "on" if self._s.save else "off",
        )

    def _stat(self, key, value):
        with self._stats_lock:
            self._stats.add(key, value)

    @property
    def requires_kv_delivery(self):
        # A best-effort cache: a dropped save is a future miss, never a wrong answer.
        return False

    # -- worker role --

    def register_kv_caches(self, kv_caches):
        self._worker.register(kv_caches)

    def handle_preemptions(self, kv_connector_metadata):
        self._worker.handle_preemptions(kv_connector_metadata)

    @_traced(lambda self, out, *a: {"loads": len(self._get_connector_metadata().loads),
                                    "saves": len(self._get_connector_metadata().saves)})
    def start_load_kv(self, forward_context, **kwargs):
        self._worker.start_load(self._get_connector_metadata())

    @_traced(lambda self, out, layer_name: {"layer": self._worker.layer_idx.get(layer_name),
                                            "loads": len(self._worker.sync_loads)})
    def wait_for_layer_load(self, layer_name):
        self._worker.wait_layer(layer_name)

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        # Saves read whole chunks after the forward pass (wait_for_save): a layer's blocks
        # are complete only once its attention ran, and a chunk object holds every layer.
        return

    @_traced()
    def wait_for_save(self):
        self._worker.start_saves(self._get_connector_metadata())

    @_traced(lambda self, out, *a: {"sending": sorted(out[0] or ()),
                                    "recving": sorted(out[1] or ())})
    def get_finished(self, finished_req_ids):
        return self._worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self):
        return self._worker.take_failed_blocks()

    def shutdown(self):
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()

    # -- scheduler role --

    @_traced(lambda self, out, request, computed: {
        "req": request.request_id, "prompt_tokens": request.num_tokens,
        "computed": computed, "result": out[0], "is_async": out[1]})
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    @_traced(lambda self, out, request, blocks, external: {
        "req": request.request_id, "external_tokens": external})
    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    @_traced(lambda self, meta, scheduler_output: {
        "loads": [x.req_id for x in meta.loads], "saves": [x.req_id for x in meta.saves],
        "scheduled_tokens": dict(scheduler_output.num_scheduled_tokens)})
    def build_connector_meta(self, scheduler_output):
        return self._scheduler.build_meta(scheduler_output)

    def request_finished(self, request, block_ids):
        return self._scheduler.request_finished(request)

    # -- both --

    def get_kv_connector_stats(self):
        with self._stats_lock:
            if self._stats.is_empty():
                return None
            out, self._stats = self._stats, ObjectCacheConnectorStats()
        return out

    @classmethod
    def build_kv_connector_stats(cls, data=None):
        return ObjectCacheConnectorStats(data=data) if data else ObjectCacheConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return _PromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


# ---- Scheduler side -----------------------------------------------------------------------


class _ReqState:
    __slots__ = ("req", "lookup_key", "lookup_future", "lookup_started", "hit", "first",
                 "external_tokens", "saved_upto", "save_jobs", "load")

    def __init__(self, req):
        self.req = req
        self.lookup_key = None
        self.lookup_future = None
        self.lookup_started = 0.0
        self.hit = None
        self.first = 0
        self.external_tokens = 0
        self.saved_upto = 0
        self.save_jobs = 0
        self.load = None


class _SchedulerSide:
    """Lookups, load and save planning, block holding (scheduler process)."""

    # Hashes known to be stored (saved or found), so chunks are not saved twice; bounded.
    _KNOWN_MAX = 1 << 16

    def __init__(self, conn):
        self.c = conn
        self.s = conn._s
        self.g = _geometry(self.s, 0)
        self.reqs = {}
        self.loads = {}
        self.known = {}
        self.pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=2, thread_name_prefix="objectcache-lookup")

    def shutdown(self):
        self.pool.shutdown(wait=False, cancel_futures=True)

    def _state(self, request):
        st = self.reqs.get(request.request_id)
        if st is None:
            st = self.reqs[request.request_id] = _ReqState(request)
        return st

    def _chunk_hashes(self, request, n_chunks):
        """Keys of the first n_chunks chunks: the block hash of each chunk's last block."""
        k = self.s.blocks_per_chunk
        bh = request.block_hashes
        n = min(n_chunks, len(bh) // k)
        return [bytes(bh[(c + 1) * k - 1]) for c in range(n)]

    def _lookup(self, hashes):
        t0 = time.monotonic()
        try:
            hit = self.c._engine.lookup(self.g, hashes)
        except oc.ObjectCacheError as e:
            logger.warning("ObjectCache lookup failed (counted as a miss): %s", e)
            self.c._stat("lookup_errors", 1)
            hit = 0
        self.c._stat("lookups", 1)
        self.c._stat("lookup_s", time.monotonic() - t0)
        if _TRACE:
            _trace("lookup", chunks=len(hashes), hit=hit, lookup_ms=_ms(t0))
        return hit

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if not self.s.load:
            return 0, False
        tpc = self.s.tokens_per_chunk
        st = self._state(request)
        # Full chunks only, leaving at least one prompt token to compute.
        usable = (request.num_tokens - 1) // tpc
        if num_computed_tokens % tpc:
            # The local hit ends inside a chunk: a chunk loads whole, so nothing after it.
            return 0, False
        first = num_computed_tokens // tpc
        hashes = self._chunk_hashes(request, usable)
        if first >= len(hashes):
            return 0, False
        key = (first, len(hashes))
        if st.lookup_key != key:
            st.lookup_key, st.hit = key, None
            st.lookup_started = time.monotonic()
            st.lookup_future = self.pool.submit(self._lookup, hashes[first:])
        if st.hit is None:
            fut = st.lookup_future
            waited = time.monotonic() - st.lookup_started
            try:
                st.hit = fut.result(timeout=max(0.0, self.s.lookup_wait_s - waited))
            except concurrent.futures.TimeoutError:
                if time.monotonic() - st.lookup_started < self.s.lookup_timeout_s:
                    return None, False  # vLLM asks again on a later step
                logger.warning("ObjectCache lookup did not answer in %.1f s: counted as a "
                               "miss", self.s.lookup_timeout_s)
                self.c._stat("lookup_errors", 1)
                st.hit = 0
        st.first = first
        tokens = st.hit * tpc
        logger.debug("ObjectCache: %s: lookup of %d chunks: %d hit after %.1f ms",
                     request.request_id, len(hashes) - first, st.hit,
                     1000 * (time.monotonic() - st.lookup_started))
        for h in hashes[first:first + st.hit]:
            self._remember(h)
        if tokens == 0:
            return 0, False
        return tokens, self.s.load_mode == "async"

    def _remember(self, h):
        self.known[h] = None
        if len(self.known) > self._KNOWN_MAX:
            self.known.pop(next(iter(self.known)))

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        st = self._state(request)
        if num_external_tokens <= 0:
            return
        tpc, k, bs = self.s.tokens_per_chunk, self.s.blocks_per_chunk, self.s.block_size
        n = num_external_tokens // tpc
        first = st.first
        all_ids = list(blocks.get_block_ids()[0])
        hashes = self._chunk_hashes(request, first + n)[first:]
        block_ids = all_ids[first * k:(first + n) * k]
        # vLLM may accept fewer tokens than offered (never more): blocks it counts as loaded
        # that no whole chunk covers cannot be loaded, so they are reported as load errors
        # (vLLM recomputes them).
        end_block = first * k + -(-num_external_tokens // bs)
        fail = all_ids[(first + n) * k:end_block]
        if len(hashes) != n or len(block_ids) != n * k:
            logger.error("ObjectCache: request %s: %d hashes and %d blocks for %d chunks; "
                         "its blocks are reported as load errors", request.request_id,
                         len(hashes), len(block_ids), n)
            hashes, block_ids, fail = [], [], all_ids[first * k:end_block]
        st.external_tokens = len(hashes) * tpc
        st.saved_upto = max(st.saved_upto, first + len(hashes))
        self.loads[request.request_id] = _LoadSpec(
            request.request_id, hashes, block_ids, self.s.load_mode == "async", fail)
        self.c._stat("hit_tokens", st.external_tokens)

    def build_meta(self, so):
        meta = ObjectCacheMetadata()
        meta.loads = list(self.loads.values())
        self.loads.clear()
        if self.s.save:
            meta.saves = self._plan_saves(so)
        if so.preempted_req_ids:
            meta.preempted = set(so.preempted_req_ids)
        return meta

    def _plan_saves(self, so):
        kvm = self.c._kv_cache_manager
        tpc, k = self.s.tokens_per_chunk, self.s.blocks_per_chunk
        spec = so.scheduled_spec_decode_tokens or {}
        after = {}
        for r in so.scheduled_new_reqs:
            after[r.req_id] = r.num_computed_tokens + so.num_scheduled_tokens.get(r.req_id, 0)
        cr = so.scheduled_cached_reqs
        for i, rid in enumerate(cr.req_ids):
            after[rid] = (cr.num_computed_tokens[i] + so.num_scheduled_tokens.get(rid, 0)
                          - len(spec.get(rid, ())))
        saves = []
        for rid, done_tokens in after.items():
            st = self.reqs.get(rid)
            if st is None or kvm is None:
                continue
            full = min(done_tokens, st.req.num_tokens) // tpc
            if full <= st.saved_upto:
                continue
            hashes = self._chunk_hashes(st.req, full)
            block_ids = list(kvm.get_block_ids(rid)[0])
            todo_h, todo_b = [], []
            for c in range(st.saved_upto, len(hashes)):
                h = hashes[c]
                if h in self.known or len(block_ids) < (c + 1) * k:
                    continue
                todo_h.append(h)
                todo_b.extend(block_ids[c * k:(c + 1) * k])
                self._remember(h)
            st.saved_upto = len(hashes)
            if todo_h:
                st.save_jobs += 1
                saves.append(_SaveSpec(rid, todo_h, todo_b))
        return saves

    def request_finished(self, request):
        st = self.reqs.pop(request.request_id, None)
        if st is None:
            return False, None
        # Only a request this connector loaded reports (under vLLM's MultiConnector, the
        # sub-connectors' parameters are merged and must not clash).
        params = ({"objectcache_hit_tokens": st.external_tokens}
                  if st.external_tokens else None)
        # Blocks with a save that may still run are held until the workers report it done
        # (get_finished: finished_sending); others are freed now.
        return st.save_jobs > 0, params


# ---- Worker side --------------------------------------------------------------------------


class _Load:
    __slots__ = ("spec", "transfer", "posted", "failed", "settled", "waited")

    def __init__(self, spec, transfer, posted):
        self.spec = spec
        self.transfer = transfer
        self.posted = posted
        self.failed = False
        self.settled = False
        self.waited = 0.0  # seconds the forward pass spent in wait_for_layer_load


class _WorkerSide:
    """Registration, loads into paged blocks, saves from them (worker process)."""

    def __init__(self, conn):
        self.c = conn
        self.s = conn._s
        self.layer_idx = {}
        self.layers = []  # per layer: (base address, bytes per block step, runs)
        self.regions = []
        self.g = None
        self.sync_loads = []
        self.async_loads = {}
        self.failed_blocks = set()
        self.saves = {}  # req_id -> list of futures
        self.saves_started = 0
        self.outstanding = []  # save futures not known to be done
        self.finished = set()  # finished requests whose saves we still wait for
        self.saver = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="objectcache-save")

    def shutdown(self):
        self.saver.shutdown(wait=True)
        for ld in self.sync_loads + list(self.async_loads.values()):
            ld.transfer.release()

    # -- registration --

    def register(self, kv_caches):
        from vllm.distributed import get_tensor_model_parallel_rank

        try:
            rank = get_tensor_model_parallel_rank()
        except Exception:
            rank = 0
        self.g = _geometry(self.s, rank)
        per_chunk = self.g.slice_bytes
        per_block = per_chunk // self.s.blocks_per_chunk
        names = [n for n in self.s.layer_names if n in kv_caches]
        if len(names) != len(self.s.layer_names):
            raise ValueError(
                f"ObjectCacheConnector: vLLM registered {len(kv_caches)} KV caches but the "
                f"KV cache config names {len(self.s.layer_names)} layers"
            )
        num_blocks = self.c._kv_cache_config.num_blocks
        storages = {}
        for i, name in enumerate(names):
            t = kv_caches[name]
            self.layer_idx[name] = i
            bdim = next((d for d, n in enumerate(t.shape) if n == num_blocks), None)
            if bdim is None:
                raise ValueError(
                    f"ObjectCacheConnector: layer {name} KV cache of shape {tuple(t.shape)} "
                    f"has no dimension of {num_blocks} blocks"
                )
            es = t.element_size()
            runs = _runs(t.select(bdim, 0), t.data_ptr(), es)
            got = sum(n for _, n in runs)
            if got != per_block:
                raise ValueError(
                    f"ObjectCacheConnector: one block of layer {name} is {got} bytes but the "
                    f"geometry {self.g} gives {per_block} bytes per block; the layout is not "
                    "one this connector knows"
                )
            self.layers.append((t.data_ptr(), t.stride(bdim) * es, runs))
            st = t.untyped_storage()
            storages[st.data_ptr()] = (st.nbytes(), t.device)
        for ptr, (nbytes, dev) in storages.items():
            device = None if dev.type == "cpu" else (dev.index or 0)
            self.regions.append(self.c._engine.register(ptr, nbytes, device=device))
        logger.info("ObjectCache: registered %d KV buffer(s), %d layers, %d bytes per block "
                    "and layer in %d run(s)", len(storages), len(names), per_block,
                    len(self.layers[0][2]))

    def _ranges(self, block_ids):
        """Per layer, the (address, length) ranges of these blocks, in block order."""
        out = []
        for base, step, runs in self.layers:
            rs = []
            for b in block_ids:
                a = base + b * step
                rs.extend((a + off, n) for off, n in runs)
            out.append(rs)
        return out

    # -- loads --

    def start_load(self, meta):
        for spec in meta.loads:
            self.failed_blocks.update(spec.fail_block_ids)
            if not spec.hashes:
                if spec.is_async:
                    self.async_loads[spec.req_id] = None
                continue
            t0 = time.monotonic()
            try:
                ranges = self._ranges(spec.block_ids)
                if _TRACE:
                    _trace("load.ranges", req=spec.req_id, chunks=len(spec.hashes),
                           ranges=sum(len(r) for r in ranges), ranges_ms=_ms(t0))
                tr = self.c._engine.load(self.g, spec.hashes, ranges,
                                         request_id=_request_id(spec.req_id))
                if _TRACE:
                    _trace("load.posted", req=spec.req_id, post_ms=_ms(t0))
            except oc.ObjectCacheError as e:
                logger.warning("ObjectCache: load for %s not posted: %s", spec.req_id, e)
                self.failed_blocks.update(spec.block_ids)
                if spec.is_async:
                    self.async_loads[spec.req_id] = None
                continue
            self.c._stat("loads", 1)
            logger.debug("ObjectCache: %s: load of %d chunks posted in %.2f ms", spec.req_id,
                         len(spec.hashes), 1000 * (time.monotonic() - t0))
            ld = _Load(spec, tr, t0)
            if spec.is_async:
                self.async_loads[spec.req_id] = ld
            else:
                self.sync_loads.append(ld)

    def wait_layer(self, layer_name):
        if not self.sync_loads:
            return
        li = self.layer_idx.get(layer_name)
        if li is None:
            return
        for ld in self.sync_loads:
            t0 = time.monotonic()
            try:
                ld.transfer.wait_layer(li)
                ld.waited += time.monotonic() - t0
            except oc.LayerMissError as e:
                if not ld.failed:
                    logger.warning("ObjectCache: load for %s: layer %d failed (%s); its "
                                   "blocks are recomputed", ld.spec.req_id, li, e)
                ld.failed = True

    def _settle(self, ld):
        """Called once every layer of ld is ready or failed: records stats and the blocks of
        failed chunks, and releases the transfer."""
        tr = ld.transfer
        st = tr.stats()
        if ld.failed or st.layers_ready < tr.layers:
            # Per-chunk status: the chunks at fault; chunks whose status is still open when
            # the load has ended are counted as failed too (never used as KV).
            deadline = time.monotonic() + 2.0
            statuses = tr.chunk_status()
            while oc.ChunkStatus.PENDING in statuses and time.monotonic() < deadline:
                time.sleep(0.002)
                statuses = tr.chunk_status()
            k = self.s.blocks_per_chunk
            bad = [c for c, s in enumerate(statuses) if s != oc.ChunkStatus.OK]
            if not bad:  # a layer failed without naming a chunk: every chunk
                bad = list(range(len(ld.spec.hashes)))
            for c in bad:
                self.failed_blocks.update(ld.spec.block_ids[c * k:(c + 1) * k])
            self.c._stat("failed_blocks", len(bad) * k)
        self.c._stat("loaded_bytes", st.bytes)
        logger.debug("ObjectCache: %s: load settled %.1f ms after posting: %d bytes, %d "
                     "requests, layer 0 at %.1f ms, last at %.1f ms; the forward pass "
                     "waited %.1f ms", ld.spec.req_id,
                     1000 * (time.monotonic() - ld.posted), st.bytes, st.requests,
                     1000 * st.ttfl_s, 1000 * st.ttll_s, 1000 * ld.waited)
        if _TRACE:
            _trace("load.settled", req=ld.spec.req_id, since_post_ms=_ms(ld.posted),
                   bytes=st.bytes, requests=st.requests, ttfl_ms=round(1000 * st.ttfl_s, 3),
                   ttll_ms=round(1000 * st.ttll_s, 3), waited_ms=round(1000 * ld.waited, 3),
                   failed=ld.failed)
        if st.ttll_s >= 0:
            self.c._stat("load_s", st.ttll_s)
        tr.release()
        ld.settled = True

    def _poll_settled(self, ld):
        """Whether every layer of ld is ready or failed (without waiting)."""
        tr = ld.transfer
        for l in range(tr.layers):
            try:
                if not tr.poll_layer(l):
                    return False
            except oc.LayerMissError:
                ld.failed = True
        return True

    # -- saves --

    def start_saves(self, meta):
        for spec in meta.saves:
            ranges = self._ranges(spec.block_ids)
            fut = self.saver.submit(self._save, spec, ranges)
            self.saves.setdefault(spec.req_id, []).append(fut)
            self.saves_started += 1
            self.outstanding = [f for f in self.outstanding if not f.done()] + [fut]

    def _save(self, spec, ranges):
        t0 = time.monotonic()
        try:
            rep = self.c._engine.save(self.g, spec.hashes, ranges)
        except oc.ObjectCacheError as e:
            logger.warning("ObjectCache: save of %d chunks for %s failed: %s",
                           len(spec.hashes), spec.req_id, e)
            self.c._stat("save_errors", 1)
            return
        self.c._stat("saves", 1)
        self.c._stat("saved_bytes", rep.bytes)
        self.c._stat("save_s", time.monotonic() - t0)
        if _TRACE:
            _trace("save.done", req=spec.req_id, chunks=len(spec.hashes), bytes=rep.bytes,
                   save_ms=_ms(t0))

    def flush(self, timeout_s=None):
        """Waits for every save started so far; returns how many saves this worker has
        started since it began."""
        concurrent.futures.wait(list(self.outstanding), timeout=timeout_s)
        return self.saves_started

    def handle_preemptions(self, meta):
        # A preempted request's blocks are reused from this step on: its saves finish first.
        for rid in getattr(meta, "preempted", ()) or ():
            for fut in self.saves.get(rid, ()):
                fut.result()

    # -- completion --

    def get_finished(self, finished_req_ids):
        # Layerwise loads: every layer was waited for during the forward pass.
        for ld in self.sync_loads:
            self._poll_settled(ld)
            self._settle(ld)
        self.sync_loads = []
        recving = set()
        for rid, ld in list(self.async_loads.items()):
            if ld is not None:
                if not self._poll_settled(ld):
                    continue
                self._settle(ld)
            recving.add(rid)
            del self.async_loads[rid]
        self.finished |= set(finished_req_ids) & set(self.saves)
        sending = set()
        for rid in list(self.finished):
            futs = self.saves.get(rid, [])
            if all(f.done() for f in futs):
                sending.add(rid)
                self.finished.discard(rid)
                self.saves.pop(rid, None)
        return sending or None, recving or None

    def take_failed_blocks(self):
        out, self.failed_blocks = self.failed_blocks, set()
        return out


def _request_id(req_id):
    """vLLM's request id as the 64-bit id the engine logs and reports."""
    return int.from_bytes(hashlib.blake2b(req_id.encode(), digest_size=8).digest(), "little")


def _connectors(conn):
    if isinstance(conn, ObjectCacheConnector):
        return [conn]
    return [c for sub in getattr(conn, "_connectors", ()) for c in _connectors(sub)]


def flush_saves(worker=None, timeout_s=None):
    """Waits until every save that this worker process's ObjectCache connectors (also inside
    vLLM's MultiConnector) have started has ended, and returns how many saves they have
    started since they began. Saves run
    in the background after each forward pass; call this before stopping a replica whose saves
    must be complete, e.g. ``llm.collective_rpc(objectcache.vllm.flush_saves)`` (callables
    need ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``). ``worker`` is the vLLM worker (unused)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return 0
    return sum(c._worker.flush(timeout_s) for c in _connectors(get_kv_transfer_group())
               if c._worker is not None)


def _runs(view, base, es):
    """Contiguous byte runs ``(offset from base, length)`` of a strided tensor view, in
    address order."""
    shape, stride = list(view.shape), list(view.stride())
    start = (view.data_ptr() - base)
    # Merge trailing dimensions while they are contiguous.
    inner = 1
    d = len(shape)
    while d > 0 and stride[d - 1] == inner:
        inner *= shape[d - 1]
        d -= 1
    runs = [(start, inner * es)]
    for dim in range(d - 1, -1, -1):
        runs = [(off + i * stride[dim] * es, n) for i in range(shape[dim]) for off, n in runs]
    runs.sort()
    merged = []
    for off, n in runs:
        if merged and merged[-1][0] + merged[-1][1] == off:
            merged[-1] = (merged[-1][0], merged[-1][1] + n)
        else:
            merged.append((off, n))
    return merged
