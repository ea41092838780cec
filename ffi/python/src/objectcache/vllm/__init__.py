"""ObjectCache as a vLLM KV connector (vLLM 0.32, ``KVConnectorBase_V1``).

Enable it with::

    --kv-transfer-config '{"kv_connector": "ObjectCacheConnector",
                           "kv_connector_module_path": "objectcache.vllm",
                           "kv_role": "kv_both",
                           "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"store": "s3://kvcache/prod?endpoint=..."}}'

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

import threading

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

import objectcache as oc

from ._common import CONNECTOR_SETTINGS, FAILURE_REASONS, logger, _settings, _traced
from ._scheduler import _SchedulerSide
from ._worker import _WorkerSide


__all__ = ["ObjectCacheConnector", "ObjectCacheConnectorStats", "CONNECTOR_SETTINGS",
           "flush_saves"]


# ---- Metrics ------------------------------------------------------------------------------


class ObjectCacheConnectorStats(KVConnectorStats):
    """Connector figures of an interval, from both roles (``data``): lookups,
    ``lookup_hit_tokens`` (what lookups found and vLLM accepted to load), ``hit_tokens``
    (what was loaded and used, counted when the request ends), ``lookup_s`` (list), loads,
    ``loaded_bytes``, ``load_s`` (list, post to last layer), ``failed_blocks``,
    ``failed_chunks_<reason>`` per reason of :data:`FAILURE_REASONS`, saves, ``saved_bytes``,
    ``save_s`` (list)."""

    _COUNTERS = ("lookups", "lookup_errors", "lookup_hit_tokens", "hit_tokens", "loads",
                 "loaded_bytes", "failed_blocks", "saves", "saved_bytes",
                 "save_errors") + tuple(f"failed_chunks_{r}" for r in FAILURE_REASONS)
    _LISTS = ("lookup_s", "load_s", "save_s")
    #: Gauges a worker reports when they change (summed over the TP ranks of a step): the
    #: engine's transfers posted and not released, its registered memory regions, and the
    #: worker process's threads. After every request has ended they are back where they
    #: started: nothing leaked.
    GAUGES = ("live_transfers", "registered_regions", "worker_threads")

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
        out.update({k: self.data[k] for k in self.GAUGES if k in self.data})
        for k in self._LISTS:
            v = sorted(self.data.get(k, []))
            if v:
                out[k.replace("_s", "_ms") + "_p50"] = round(1000 * v[len(v) // 2], 3)
        return out

    def is_empty(self):
        return not any(self.data.get(k) for k in self._COUNTERS) and not any(
            k in self.data for k in self.GAUGES)


class _PromMetrics(KVConnectorPromMetrics):
    """Prometheus counters of the connector (``vllm:objectcache_*``)."""

    _NAMES = {
        "lookup_hit_tokens": "Prompt tokens found in ObjectCache by lookups, to load.",
        "hit_tokens": "Prompt tokens loaded from ObjectCache and used (not recomputed).",
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
        f = self._counter_cls(
            name="vllm:objectcache_failed_chunks",
            documentation="Chunks whose load failed, by reason: missing (gone after the "
            "lookup), corrupt (CRC32C, truncated, geometry), stalled (stall limit or "
            "deadline), error (storage or transport), refused (not posted), cancelled "
            "(request ended).",
            labelnames=list(labelnames) + ["reason"],
        )
        self._failed = {(i, r): f.labels(*v, r) for i, v in per_engine_labelvalues.items()
                        for r in FAILURE_REASONS}
        self._gauges = {}
        for key, doc in (("live_transfers", "ObjectCache loads posted and not yet released."),
                         ("registered_regions", "Memory regions registered with ObjectCache."),
                         ("worker_threads", "Threads of the vLLM worker processes.")):
            g = self._gauge_cls(name=f"vllm:objectcache_{key}", documentation=doc,
                                labelnames=labelnames, multiprocess_mode="mostrecent")
            self._gauges[key] = {i: g.labels(*v) for i, v in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data, engine_idx=0):
        for key, per_engine in self._counters.items():
            v = transfer_stats_data.get(key, 0)
            if v:
                per_engine[engine_idx].inc(v)
        for s in transfer_stats_data.get("load_s", []):
            self._load_s[engine_idx].observe(s)
        for r in FAILURE_REASONS:
            v = transfer_stats_data.get(f"failed_chunks_{r}", 0)
            if v:
                self._failed[(engine_idx, r)].inc(v)
        for key, per_engine in self._gauges.items():
            if key in transfer_stats_data:
                per_engine[engine_idx].set(transfer_stats_data[key])


# ---- The connector ------------------------------------------------------------------------


class ObjectCacheConnector(KVConnectorBase_V1, SupportsHMA):
    """ObjectCache as a vLLM v1 KV connector; see the module documentation and docs/vllm.md.

    It supports vLLM's hybrid KV cache manager (``SupportsHMA``): each KV cache group (full
    attention, sliding window, MLA) has chunk objects of its own, and a sliding-window group
    loads only the blocks inside its window at the end of the hit."""

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
        # vLLM publishes KV events (--kv-events-config): chunks saved are announced as
        # BlockStored events with medium STORAGE (take_events).
        ev = getattr(vllm_config, "kv_events_config", None)
        self._events_on = bool(ev is not None and getattr(ev, "enable_kv_cache_events", False))
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

    def get_transfer_results(self, finished_req_ids):
        # Several KV cache groups: a failed load is reported per request (vLLM 0.32 takes
        # block ids of load errors only from single-group models); it is also finished.
        sending, recving = self.get_finished(finished_req_ids)
        failed = self._worker.take_failed_requests()
        return KVConnectorTransferResults(
            finished_sending=set(sending or ()),
            finished_recving=set(recving or ()) | failed,
            failed_recving=failed,
        )

    def build_connector_worker_meta(self):
        return self._worker.take_outcomes()

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

    def request_finished_all_groups(self, request, block_ids):
        return self._scheduler.request_finished(request)

    def update_connector_output(self, connector_output):
        self._scheduler.update_connector_output(connector_output)

    def take_events(self):
        """``BlockStored`` events (medium ``STORAGE``, ownership ``objectcache``) for the
        chunks every saving TP rank has saved since the last call, when vLLM publishes KV
        events; a router that consumes vLLM's KV events then sees what the store holds."""
        if self._scheduler is None:
            return ()
        return self._scheduler.take_events()

    # -- both --

    def get_kv_connector_stats(self):
        if self._worker is not None:
            for k, v in self._worker.gauges_changed().items():
                with self._stats_lock:
                    self._stats.data[k] = v
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
