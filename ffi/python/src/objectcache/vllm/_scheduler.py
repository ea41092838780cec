"""The connector's scheduler side: lookups, the loads and saves each step hands the
workers, and which requests keep their blocks until their saves end."""

import concurrent.futures
import time

import objectcache as oc

from ._common import (
    logger,
    ObjectCacheMetadata,
    _geometry,
    _LoadSpec,
    _ms,
    _SaveSpec,
    _TRACE,
    _trace,
)


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
        markers = {}
        if hashes:
            try:
                for r in range(self.s.tp_world):
                    m = self.c._engine.segment_markers(_geometry(self.s, r), hashes)
                    if m:
                        markers[r] = m
            except oc.ObjectCacheError as e:
                logger.warning("ObjectCache: segment markers of %s not passed on (the "
                               "workers read them): %s", request.request_id, e)
        self.loads[request.request_id] = _LoadSpec(
            request.request_id, hashes, block_ids, self.s.load_mode == "async", fail,
            markers)
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
