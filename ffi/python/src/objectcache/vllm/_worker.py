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


class _Part:
    """One KV cache group's share of a request's load: its transfer, and the scratch region
    that takes the bytes of the blocks vLLM left out (outside a sliding window)."""

    __slots__ = ("group", "chunks", "block_ids", "transfer", "scratch")

    def __init__(self, group, chunks, block_ids, transfer, scratch):
        self.group = group
        self.chunks = chunks
        self.block_ids = block_ids
        self.transfer = transfer
        self.scratch = scratch


class _Load:
    __slots__ = ("spec", "parts", "posted", "failed", "settled", "waited", "why", "seen")

    def __init__(self, spec, parts, posted):
        self.spec = spec
        self.parts = parts
        self.posted = posted
        self.failed = False
        self.settled = False
        self.waited = 0.0  # seconds the forward pass spent in wait_for_layer_load
        self.why = None  # "stalled" / "cancelled" when a layer failed by time or cancel
        self.seen = -1  # bytes landed at the previous poll (asynchronous loads)

    def quiet(self):
        """Whether the outcome of a load whose every layer has ended is final: no chunk's
        status is still open, or the load was given up (stalled, cancelled), or nothing
        landed since the previous poll. A miss fails its layers at once, while the earlier
        chunks' slices of those layers may still be landing: one more step lets them, so
        vLLM keeps those chunks. Never waits."""
        if self.why in ("stalled", "cancelled"):
            return True
        if all(oc.ChunkStatus.PENDING not in p.transfer.chunk_status() for p in self.parts):
            return True
        landed = sum(p.transfer.stats().bytes for p in self.parts)
        if landed == self.seen:
            return True
        self.seen = landed
        return False

    def layer_failed(self, e):
        self.failed = True
        if isinstance(e, oc.LayerTimeoutError):
            self.why = self.why or "stalled"
        elif isinstance(e, oc.LayerCancelledError):
            self.why = self.why or "cancelled"

    def release(self):
        for p in self.parts:
            p.transfer.release()
            if p.scratch is not None:
                p.scratch[0].close()
                p.scratch = None


class _WorkerSide:
    """Registration, loads into paged blocks, saves from them (worker process)."""

    def __init__(self, conn):
        self.c = conn
        self.s = conn._s
        self.layer_idx = {}  # layer name -> (group, index of the layer in its group)
        self.layers = []  # per group, per layer: (base address, bytes per block step, runs)
        self.per_block = []  # per group: bytes of one block of one layer
        self.regions = []
        self.geoms = []  # per group: this rank's geometry
        self.rank = 0
        self.sync_loads = []
        self.async_loads = {}
        self.failed_blocks = set()
        self.failed_requests = set()  # multi-group loads that failed: whole requests
        self.saves = {}  # req_id -> list of futures
        self.saves_started = 0
        self.outstanding = []  # save futures not known to be done
        self.finished = set()  # finished requests whose saves we still wait for
        self.outcomes = {}  # req_id -> LoadOutcome, loads that ended since the last step
        self.gauges = {}  # the engine gauges last reported (gauges_changed)
        # Chunks saved since the last step, for KV events: (group, rank, key); appended by the
        # saver thread, taken by the step (take_outcomes).
        self.saved = []
        self.saved_lock = threading.Lock()
        self.saver = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="objectcache-save")

    @property
    def g(self):
        """The first group's geometry (single-group models: the geometry)."""
        return self.geoms[0] if self.geoms else None

    def shutdown(self):
        self.saver.shutdown(wait=True)
        for ld in self.sync_loads + [x for x in self.async_loads.values() if x is not None]:
            ld.release()

    # -- registration --

    def register(self, kv_caches):
        from vllm.distributed import get_tensor_model_parallel_rank

        try:
            self.rank = get_tensor_model_parallel_rank()
        except Exception:
            self.rank = 0
        missing = [n for n in self.s.layer_names if n not in kv_caches]
        if missing:
            raise ValueError(
                f"ObjectCacheConnector: vLLM registered {len(kv_caches)} KV caches but the "
                f"KV cache config also names {', '.join(missing[:3])}"
            )
        num_blocks = self.c._kv_cache_config.num_blocks
        storages = {}
        for gr in self.s.groups:
            g = _geometry(self.s, self.rank, gr.index)
            # One block of one layer, as the library derives it from the typed layout.
            per_block = gr.block_bytes
            self.geoms.append(g)
            self.per_block.append(per_block)
            layers = []
            for i, name in enumerate(gr.layer_names):
                t = kv_caches[name]
                self.layer_idx[name] = (gr.index, i)
                bdim = next((d for d, n in enumerate(t.shape) if n == num_blocks), None)
                if bdim is None:
                    raise ValueError(
                        f"ObjectCacheConnector: layer {name} KV cache of shape "
                        f"{tuple(t.shape)} has no dimension of {num_blocks} blocks"
                    )
                es = t.element_size()
                runs = _runs(t.select(bdim, 0), t.data_ptr(), es)
                got = sum(n for _, n in runs)
                if got != per_block:
                    raise ValueError(
                        f"ObjectCacheConnector: one block of layer {name} is {got} bytes but "
                        f"the layout {gr.engine_layout} gives {per_block} bytes per block; "
                        "the layout is not one this connector knows"
                    )
                layers.append((t.data_ptr(), t.stride(bdim) * es, runs))
                st = t.untyped_storage()
                storages[st.data_ptr()] = (st.nbytes(), t.device)
            self.layers.append(layers)
        for ptr, (nbytes, dev) in storages.items():
            device = None if dev.type == "cpu" else (dev.index or 0)
            self.regions.append(self.c._engine.register(ptr, nbytes, device=device))
        logger.info("ObjectCache: registered %d KV buffer(s), %d group(s) (%s), %d layers",
                    len(storages), len(self.s.groups),
                    ", ".join(f"{gr.kind}{gr.window or ''}: {len(gr.layer_names)} layers of "
                              f"{self.per_block[gr.index]} bytes per block"
                              for gr in self.s.groups), len(self.layer_idx))

    def _ranges(self, group, block_ids, scratch=None):
        """Per layer of ``group``, the (address, length) ranges of these blocks, in block
        order; a block id of ``None`` (vLLM's null block, outside a sliding window) takes the
        next free bytes of ``scratch`` (address, length) instead."""
        out = []
        nxt = scratch[0] if scratch else 0
        for base, step, runs in self.layers[group]:
            rs = []
            for b in block_ids:
                if b is None:
                    for _, n in runs:
                        rs.append((nxt, n))
                        nxt += n
                    continue
                a = base + b * step
                rs.extend((a + off, n) for off, n in runs)
            out.append(rs)
        return out

    # -- loads --

    def _post(self, spec, part):
        """Posts one group's share of a load; returns its _Part."""
        gr = self.s.groups[part.group]
        g = self.geoms[part.group]
        hashes = [spec.hashes[c] for c in part.chunks]
        scratch = None
        nulls = sum(1 for b in part.block_ids if b is None)
        if nulls:
            # Blocks vLLM left out inside a chunk that the window needs part of: their bytes
            # go to scratch memory, registered for this load.
            buf = bytearray(nulls * self.per_block[part.group] * len(gr.layer_names))
            region = self.c._engine.register(buf)
            import ctypes

            addr = ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))
            scratch = (region, addr, buf)
        ranges = self._ranges(part.group, part.block_ids,
                              (scratch[1], len(scratch[2])) if scratch else None)
        if spec.markers.get(g.tp_rank) and part.group == 0:
            try:
                self.c._engine.add_segment_markers(g, hashes, spec.markers[g.tp_rank])
            except oc.ObjectCacheError as e:
                logger.warning("ObjectCache: segment markers for %s not taken (the "
                               "load reads them): %s", spec.req_id, e)
        tr = self.c._engine.load(g, hashes, ranges, request_id=_request_id(spec.req_id))
        return _Part(part.group, part.chunks, part.block_ids, tr, scratch)

    def start_load(self, meta):
        for spec in meta.loads:
            if spec.fail_block_ids:
                if self.s.hybrid:
                    self.failed_requests.add(spec.req_id)
                else:
                    self.failed_blocks.update(spec.fail_block_ids)
            if not spec.hashes:
                if spec.is_async:
                    self.async_loads[spec.req_id] = None
                continue
            t0 = time.monotonic()
            parts = []
            try:
                for part in spec.parts:
                    parts.append(self._post(spec, part))
                if _TRACE:
                    _trace("load.posted", req=spec.req_id, chunks=len(spec.hashes),
                           groups=len(parts), post_ms=_ms(t0))
            except oc.ObjectCacheError as e:
                logger.warning("ObjectCache: load for %s not posted: %s", spec.req_id, e)
                _Load(spec, parts, t0).release()  # the groups posted before the refusal
                self._fail_all(spec)
                n = len(spec.hashes)
                self.outcomes[spec.req_id] = LoadOutcome(n, 0, {"refused": n})
                if spec.is_async:
                    self.async_loads[spec.req_id] = None
                continue
            self.c._stat("loads", 1)
            logger.debug("ObjectCache: %s: load of %d chunks posted in %.2f ms", spec.req_id,
                         len(spec.hashes), 1000 * (time.monotonic() - t0))
            ld = _Load(spec, parts, t0)
            if spec.is_async:
                self.async_loads[spec.req_id] = ld
            else:
                self.sync_loads.append(ld)

    def _fail_all(self, spec):
        """Reports a whole load failed: its blocks (one group), or its request (several)."""
        if self.s.hybrid:
            self.failed_requests.add(spec.req_id)
        else:
            for part in spec.parts:
                self.failed_blocks.update(b for b in part.block_ids if b is not None)

    def wait_layer(self, layer_name):
        if not self.sync_loads:
            return
        gi = self.layer_idx.get(layer_name)
        if gi is None:
            return
        group, li = gi
        for ld in self.sync_loads:
            t0 = time.monotonic()
            for p in ld.parts:
                if p.group != group:
                    continue
                try:
                    p.transfer.wait_layer(li)
                except oc.LayerMissError as e:
                    if not ld.failed:
                        logger.warning("ObjectCache: load for %s: layer %s failed (%s); its "
                                       "blocks are recomputed", ld.spec.req_id, layer_name, e)
                    ld.layer_failed(e)
            ld.waited += time.monotonic() - t0

    def _settle(self, ld):
        """Called once every layer of every part of ld is ready or failed (never waits):
        records the outcome and stats, the blocks of failed chunks (or, with several groups,
        the failed request), and releases the transfers (which return once no copy into the
        blocks is in flight). A chunk whose status is still open then counts as failed."""
        n = len(ld.spec.hashes)
        outcome = LoadOutcome(n, n)
        nbytes, ttll = 0, 0.0
        bad_chunks = {}  # global chunk index -> reason
        for p in ld.parts:
            tr = p.transfer
            st = tr.stats()
            nbytes += st.bytes
            ttll = max(ttll, st.ttll_s)
            if not (ld.failed or st.layers_ready < tr.layers):
                continue
            # Per-chunk status, final once every layer has ended: the chunks at fault. A
            # chunk still open (a layer never waited for) is counted as failed too (never
            # used as KV); release() below stops its copies.
            statuses = tr.chunk_status()
            bad = [j for j, x in enumerate(statuses) if x != oc.ChunkStatus.OK]
            if not bad:  # a layer failed without naming a chunk: every chunk
                bad = list(range(len(p.chunks)))
            for j in bad:
                why = _REASONS.get(statuses[j] if j < len(statuses) else None, "error")
                if why == "error" and ld.why:
                    why = ld.why
                c = p.chunks[j]
                bad_chunks.setdefault(c, why)
                k = self.s.groups[p.group].blocks_per_chunk
                if not self.s.hybrid:
                    self.failed_blocks.update(
                        b for b in p.block_ids[j * k:(j + 1) * k] if b is not None)
        if bad_chunks:
            for c, why in bad_chunks.items():
                outcome.failed[why] = outcome.failed.get(why, 0) + 1
                if why in ("missing", "corrupt"):
                    outcome.faulty.append(c)
            # One group: vLLM keeps the blocks before the first failed one. Several: the
            # request is reported failed and recomputed from its start.
            outcome.ok = 0 if self.s.hybrid else min(bad_chunks)
            if self.s.hybrid:
                self.failed_requests.add(ld.spec.req_id)
            self.c._stat("failed_blocks", len(bad_chunks) * self.s.blocks_per_chunk)
        self.outcomes[ld.spec.req_id] = outcome
        self.c._stat("loaded_bytes", nbytes)
        logger.debug("ObjectCache: %s: load settled %.1f ms after posting: %d bytes in %d "
                     "group(s); the forward pass waited %.1f ms; %d of %d chunks loaded",
                     ld.spec.req_id, 1000 * (time.monotonic() - ld.posted), nbytes,
                     len(ld.parts), 1000 * ld.waited, outcome.ok, n)
        if _TRACE:
            st0 = ld.parts[0].transfer.stats()
            _trace("load.settled", req=ld.spec.req_id, since_post_ms=_ms(ld.posted),
                   bytes=nbytes, requests=sum(p.transfer.stats().requests for p in ld.parts),
                   ttfl_ms=round(1000 * st0.ttfl_s, 3), ttll_ms=round(1000 * ttll, 3),
                   waited_ms=round(1000 * ld.waited, 3), failed=ld.failed,
                   ok_chunks=outcome.ok, reasons=outcome.failed,
                   group_bytes=[p.transfer.stats().bytes for p in ld.parts],
                   group_chunks=[len(p.chunks) for p in ld.parts])
        if ttll >= 0 and not bad_chunks:
            self.c._stat("load_s", ttll)
        ld.release()
        ld.settled = True

    def _poll_settled(self, ld):
        """Whether every layer of ld is ready or failed (without waiting)."""
        for p in ld.parts:
            tr = p.transfer
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
            jobs = []
            for part in spec.parts:
                gr = self.s.groups[part.group]
                if gr.replicated and self.rank != 0:
                    continue  # the same bytes on every rank: rank 0 saves them
                ranges = self._ranges(part.group, part.block_ids)
                hashes = [spec.hashes[c] for c in part.chunks]
                if gr.kind == "swa":
                    # vLLM frees a sliding window's blocks as the window moves on, at the next
                    # step: the save copies them now, after the forward pass wrote them.
                    ranges = [_copy(rs) for rs in ranges]
                jobs.append((part.group, hashes, ranges))
            if not jobs:
                continue
            fut = self.saver.submit(self._save, spec, jobs)
            self.saves.setdefault(spec.req_id, []).append(fut)
            self.saves_started += 1
            self.outstanding = [f for f in self.outstanding if not f.done()] + [fut]

    def _save(self, spec, jobs):
        t0 = time.monotonic()
        total = 0
        for group, hashes, layers in jobs:
            try:
                rep = self.c._engine.save(self.geoms[group], hashes, layers)
            except oc.ObjectCacheError as e:
                logger.warning("ObjectCache: save of %d chunks (group %d) for %s failed: %s",
                               len(hashes), group, spec.req_id, e)
                self.c._stat("save_errors", 1)
                return
            total += rep.bytes
            if self.c._events_on:
                with self.saved_lock:
                    self.saved.extend((group, self.rank, bytes(h)) for h in hashes)
        self.c._stat("saves", 1)
        self.c._stat("saved_bytes", total)
        self.c._stat("save_s", time.monotonic() - t0)
        if _TRACE:
            _trace("save.done", req=spec.req_id, chunks=len(spec.hashes), bytes=total,
                   save_ms=_ms(t0))

    def flush(self, timeout_s=None):
        """Waits for every save started so far; returns how many saves this worker has
        started since it began."""
        concurrent.futures.wait(list(self.outstanding), timeout=timeout_s)
        return self.saves_started

    def handle_preemptions(self, meta):
        """The hold: vLLM gives a preempted request's blocks to other requests from this step
        on, and a save reads its blocks when the saver thread gets to it (saves run one at a
        time, behind slower ones). So every save of a preempted request ends here, before the
        step's forward pass can write into those blocks."""
        for rid in getattr(meta, "preempted", ()) or ():
            futs = self.saves.get(rid, ())
            t0 = time.monotonic()
            pending = sum(not f.done() for f in futs)
            for fut in futs:
                fut.result()
            if _TRACE:
                _trace("preempted", req=rid, saves=len(futs), pending=pending, wait_ms=_ms(t0))

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
                    for p in ld.parts:
                        p.transfer.cancel()
                    ld.why = ld.why or "cancelled"
                if not self._poll_settled(ld) or not ld.quiet():
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

    def take_failed_requests(self):
        out, self.failed_requests = self.failed_requests, set()
        return out

    def take_failed_blocks(self):
        out, self.failed_blocks = self.failed_blocks, set()
        return out

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
        """The loads that ended and the chunks saved since the last call, for the scheduler
        (None if none)."""
        with self.saved_lock:
            saved, self.saved = self.saved, []
        if not self.outcomes and not saved:
            return None
        out, self.outcomes = self.outcomes, {}
        return ObjectCacheWorkerMetadata(out, saved)


def _copy(ranges):
    """The bytes of these (address, length) ranges, in order, copied into one buffer."""
    import ctypes

    return b"".join(ctypes.string_at(a, n) for a, n in ranges)


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
