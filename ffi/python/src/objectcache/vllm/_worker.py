"""The connector's worker side: the KV buffer registered once, one paged load per request
posted before the forward pass and waited for layer by layer, saves on a background thread
after it, and the blocks of failed chunks reported to vLLM."""

import concurrent.futures
import os
import threading
import time

import objectcache as oc

from ._common import (
    logger,
    LoadOutcome,
    ObjectCacheWorkerMetadata,
    _geometry,
    _ms,
    _request_id,
    _TRACE,
    _trace,
)


# ---- Worker side --------------------------------------------------------------------------


# Chunk status -> failure reason (FAILURE_REASONS); ERROR is "stalled" when the load's layers
# failed by its deadline or stall limit, "cancelled" when it was cancelled.
_REASONS = {
    oc.ChunkStatus.MISSING: "missing",
    oc.ChunkStatus.CORRUPT: "corrupt",
    oc.ChunkStatus.WRONG_GEOMETRY: "corrupt",
    oc.ChunkStatus.ERROR: "error",
    oc.ChunkStatus.PENDING: "error",
}


class _Load:
    __slots__ = ("spec", "transfer", "posted", "failed", "settled", "waited", "why")

    def __init__(self, spec, transfer, posted):
        self.spec = spec
        self.transfer = transfer
        self.posted = posted
        self.failed = False
        self.settled = False
        self.waited = 0.0  # seconds the forward pass spent in wait_for_layer_load
        self.why = None  # "stalled" / "cancelled" when a layer failed by time or cancel

    def layer_failed(self, e):
        self.failed = True
        if isinstance(e, oc.LayerTimeoutError):
            self.why = self.why or "stalled"
        elif isinstance(e, oc.LayerCancelledError):
            self.why = self.why or "cancelled"


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
        self.outcomes = {}  # req_id -> LoadOutcome, loads that ended since the last step
        self.gauges = {}  # the engine gauges last reported (gauges_changed)
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
                if spec.markers.get(self.g.tp_rank):
                    try:
                        self.c._engine.add_segment_markers(self.g, spec.hashes,
                                                           spec.markers[self.g.tp_rank])
                    except oc.ObjectCacheError as e:
                        logger.warning("ObjectCache: segment markers for %s not taken (the "
                                       "load reads them): %s", spec.req_id, e)
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
                n = len(spec.hashes)
                self.outcomes[spec.req_id] = LoadOutcome(n, 0, {"refused": n})
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
                ld.layer_failed(e)

    def _settle(self, ld):
        """Called once every layer of ld is ready or failed (never waits: the engine's chunk
        status is final then): records the outcome and stats, the blocks of failed chunks, and
        releases the transfer (which returns once no copy into the blocks is in flight)."""
        tr = ld.transfer
        st = tr.stats()
        n = len(ld.spec.hashes)
        outcome = LoadOutcome(n, n)
        if ld.failed or st.layers_ready < tr.layers:
            # Per-chunk status, final once every layer has ended: the chunks at fault. A
            # chunk still open (a layer never waited for) is counted as failed too (never
            # used as KV); release() below stops its copies.
            statuses = tr.chunk_status()
            k = self.s.blocks_per_chunk
            bad = [c for c, s in enumerate(statuses) if s != oc.ChunkStatus.OK]
            if not bad:  # a layer failed without naming a chunk: every chunk
                bad = list(range(n))
            for c in bad:
                self.failed_blocks.update(ld.spec.block_ids[c * k:(c + 1) * k])
                why = _REASONS.get(statuses[c] if c < len(statuses) else None, "error")
                if why == "error" and ld.why:
                    why = ld.why
                outcome.failed[why] = outcome.failed.get(why, 0) + 1
                if why in ("missing", "corrupt"):
                    outcome.faulty.append(c)
            outcome.ok = min(bad)
            self.c._stat("failed_blocks", len(bad) * k)
        self.outcomes[ld.spec.req_id] = outcome
        self.c._stat("loaded_bytes", st.bytes)
        logger.debug("ObjectCache: %s: load settled %.1f ms after posting: %d bytes, %d "
                     "requests, layer 0 at %.1f ms, last at %.1f ms; the forward pass "
                     "waited %.1f ms; %d of %d chunks loaded", ld.spec.req_id,
                     1000 * (time.monotonic() - ld.posted), st.bytes, st.requests,
                     1000 * st.ttfl_s, 1000 * st.ttll_s, 1000 * ld.waited, outcome.ok, n)
        if _TRACE:
            _trace("load.settled", req=ld.spec.req_id, since_post_ms=_ms(ld.posted),
                   bytes=st.bytes, requests=st.requests, ttfl_ms=round(1000 * st.ttfl_s, 3),
                   ttll_ms=round(1000 * st.ttll_s, 3), waited_ms=round(1000 * ld.waited, 3),
                   failed=ld.failed, ok_chunks=outcome.ok, reasons=outcome.failed)
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
            except oc.LayerMissError as e:
                ld.layer_failed(e)
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
        """Never waits: settles the step's layerwise loads (every layer was waited for in the
        forward pass), the asynchronous loads whose every layer has ended, and cancels the
        asynchronous loads of requests vLLM finished (aborted) meanwhile, reporting them once
        no write into their blocks can still happen (vLLM holds those blocks until then)."""
        for ld in self.sync_loads:
            self._poll_settled(ld)
            self._settle(ld)
        self.sync_loads = []
        recving = set()
        for rid, ld in list(self.async_loads.items()):
            if ld is not None:
                if rid in finished_req_ids:
                    ld.transfer.cancel()
                    ld.why = ld.why or "cancelled"
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

    def gauges_changed(self):
        """The engine's live transfers and registered regions and this process's threads,
        when any changed since the last call (else an empty dict)."""
        m = self.c._engine.metrics()
        try:
            threads = len(os.listdir("/proc/self/task"))
        except OSError:
            threads = threading.active_count()
        now = {"live_transfers": m.live_transfers, "registered_regions": m.registered_regions,
               "worker_threads": threads}
        if now == self.gauges:
            return {}
        self.gauges = now
        return now

    def take_outcomes(self):
        """The loads that ended since the last call, for the scheduler (None if none)."""
        if not self.outcomes:
            return None
        out, self.outcomes = self.outcomes, {}
        return ObjectCacheWorkerMetadata(out)

    def take_failed_blocks(self):
        out, self.failed_blocks = self.failed_blocks, set()
        return out


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
