"""The connector's scheduler side: lookups, the loads and saves each step hands the
workers, and which requests keep their blocks until their saves end."""

import concurrent.futures
import dataclasses
import time

import objectcache as oc

from ._common import (
    check_chunk_keys,
    chunk_keys,
    logger,
    ObjectCacheMetadata,
    _GroupPart,
    ObjectCacheWorkerMetadata,
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
                 "external_tokens", "used_tokens", "load_hashes", "load_failed",
                 "saved_upto", "save_jobs")

    def __init__(self, req):
        self.req = req
        self.lookup_key = None
        self.lookup_future = None
        self.lookup_started = 0.0
        self.hit = None
        self.first = 0
        # Tokens of the load vLLM accepted, and of those the ones loaded and used (known
        # once the workers report how the load ended; None until then).
        self.external_tokens = 0
        self.used_tokens = None
        self.load_hashes = []
        # A load of this request failed: it never loads from the store again.
        self.load_failed = False
        self.saved_upto = 0
        self.save_jobs = 0


@dataclasses.dataclass
class _Announce:
    """A planned save's ``BlockStored`` event (KV events), sent once every saving rank of every
    KV cache group (``need``: group -> ranks) has confirmed it (``got``)."""

    block_hashes: list
    parent: object
    token_ids: list
    lora_id: object
    lora_name: object
    session_id: object
    need: dict
    got: dict


class _SchedulerSide:
    """Lookups, load and save planning, block holding (scheduler process)."""

    # Hashes known to be stored (saved or found), so chunks are not saved twice; bounded.
    _KNOWN_MAX = 1 << 16
    # Finished requests kept for their load's outcome (``ended``).
    _ENDED_MAX = 1024

    def __init__(self, conn):
        self.c = conn
        self.s = conn._s
        self.g = _geometry(self.s, 0)
        self.geoms = [_geometry(self.s, 0, gr.index) for gr in self.s.groups]
        self.reqs = {}
        # Requests vLLM finished while their load's outcome was still to come (under vLLM's
        # default policy ``fail`` a failed load finishes its request before the workers'
        # report of that step reaches update_connector_output): request id -> state, so that
        # the chunks at fault are still remembered as failed. Bounded (oldest dropped).
        self.ended = {}
        self.loads = {}
        self.known = {}
        # Chunk hash -> monotonic time until which it is a miss: its load failed.
        self.failed = {}
        # KV events (vLLM publishes them): chunk key -> _Announce of a save planned and not yet
        # confirmed by every saving rank (bounded), and the events to hand to vLLM.
        self.announce = {}
        self.events = []
        self.pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=2, thread_name_prefix="objectcache-lookup")
        if self.s.load or self.s.save:
            check_chunk_keys(self.s)

    def shutdown(self):
        self.pool.shutdown(wait=False, cancel_futures=True)

    def _state(self, request):
        st = self.reqs.get(request.request_id)
        if st is None:
            st = self.reqs[request.request_id] = _ReqState(request)
        return st

    def _chunk_hashes(self, request, n_chunks):
        """Keys of the first n_chunks chunks: vLLM's block hash at the token that closes each
        chunk (``chunk_keys``)."""
        return chunk_keys(self.s, request.block_hashes, n_chunks)

    def _usable(self, hashes):
        """How many of these chunks a lookup may hit: those before the first chunk whose load
        failed within ``failed_chunk_ttl_ms`` (expired entries are dropped)."""
        if not self.failed:
            return len(hashes)
        now = time.monotonic()
        for c, h in enumerate(hashes):
            until = self.failed.get(h)
            if until is not None:
                if until > now:
                    return c
                del self.failed[h]
        return len(hashes)

    def _lookup(self, hashes):
        t0 = time.monotonic()
        try:
            # Every group's chunks must be there: the hit is the shortest group's. (A
            # sliding-window group keeps every chunk, so that a hit can end anywhere; a load
            # reads only the window.)
            hit = len(hashes)
            for g in self.geoms:
                hit = min(hit, self.c._engine.lookup(g, hashes[:hit]))
                if hit == 0:
                    break
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
        if st.load_failed:
            # Its load failed once: vLLM recomputes; never a second load of the same chunks.
            return 0, False
        # Full chunks only, leaving at least one prompt token to compute.
        usable = (request.num_tokens - 1) // tpc
        if num_computed_tokens % tpc:
            # The local hit ends inside a chunk: a chunk loads whole, so nothing after it.
            return 0, False
        first = num_computed_tokens // tpc
        hashes = self._chunk_hashes(request, usable)
        hashes = hashes[:self._usable(hashes)]
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
        tpc = self.s.tokens_per_chunk
        n = num_external_tokens // tpc
        first = st.first
        per_group = _blocks(blocks)
        hashes = self._chunk_hashes(request, first + n)[first:]
        parts, fail = [], []
        ok = len(hashes) == n
        for gr, ids in zip(self.s.groups, per_group):
            k, bs = gr.blocks_per_chunk, gr.block_size
            if len(ids) < (first + n) * k:
                ok = False
                break
            chunks, bids = [], []
            for c in range(n):
                cb = ids[(first + c) * k:(first + c + 1) * k]
                if all(b is None for b in cb):
                    continue  # outside the sliding window: vLLM reads none of it
                chunks.append(c)
                bids.extend(cb)
            parts.append(_GroupPart(gr.index, chunks, bids))
            # vLLM may accept fewer tokens than offered (never more): blocks it counts as
            # loaded that no whole chunk covers cannot be loaded, so they are reported as
            # load errors (vLLM recomputes them).
            end_block = first * k + -(-num_external_tokens // bs)
            fail.extend(b for b in ids[(first + n) * k:end_block] if b is not None)
        if not ok:
            logger.error("ObjectCache: request %s: %d hashes and %s blocks for %d chunks; "
                         "its blocks are reported as load errors", request.request_id,
                         len(hashes), [len(i) for i in per_group], n)
            fail = [b for ids in per_group for b in ids if b is not None]
            hashes, parts = [], []
        st.external_tokens = len(hashes) * tpc
        st.used_tokens = None
        st.load_hashes = hashes
        st.saved_upto = max(st.saved_upto, first + len(hashes))
        markers = {}
        if hashes and not self.s.hybrid:
            try:
                for r in range(self.s.tp_world):
                    m = self.c._engine.segment_markers(_geometry(self.s, r), hashes)
                    if m:
                        markers[r] = m
            except oc.ObjectCacheError as e:
                logger.warning("ObjectCache: segment markers of %s not passed on (the "
                               "workers read them): %s", request.request_id, e)
        self.loads[request.request_id] = _LoadSpec(
            request.request_id, hashes, parts, self.s.load_mode == "async", fail, markers)
        self.c._stat("lookup_hit_tokens", st.external_tokens)

    def _plan_announce(self, req, c, h):
        """Remembers what vLLM's ``BlockStored`` event of chunk ``c`` of ``req`` will say once
        its save is confirmed: vLLM's block hashes of the chunk (at its hash granularity),
        the one before as parent, the chunk's tokens."""
        per = self.s.tokens_per_chunk // self.s.hash_block_size
        bh = req.block_hashes
        lora = getattr(req, "lora_request", None)
        need = {gr.index: (1 if gr.replicated else self.s.tp_world) for gr in self.s.groups}
        self.announce[h] = _Announce(
            block_hashes=list(bh[c * per:(c + 1) * per]),
            parent=bh[c * per - 1] if c else None,
            token_ids=list(req.all_token_ids[c * self.s.tokens_per_chunk:
                                             (c + 1) * self.s.tokens_per_chunk]),
            lora_id=lora.adapter_id if lora else None,
            lora_name=lora.name if lora else None,
            session_id=getattr(req, "session_id", None),
            need=need, got={g: set() for g in need})
        if len(self.announce) > self._KNOWN_MAX:  # saves that never ended (failed)
            self.announce.pop(next(iter(self.announce)))

    def _confirm_saved(self, saved):
        """Chunks saved by workers: once every saving rank of every group has, one
        ``BlockStored`` event per group."""
        from vllm.distributed.kv_events import MEDIUM_STORAGE, BlockStored
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        for group, rank, h in saved:
            a = self.announce.get(h)
            if a is None or group not in a.got:
                continue
            a.got[group].add(rank)
            if any(len(a.got[g]) < n for g, n in a.need.items()):
                continue
            del self.announce[h]
            for g in sorted(a.need):
                self.events.append(BlockStored(
                    block_hashes=[maybe_convert_block_hash(x) for x in a.block_hashes],
                    parent_block_hash=(maybe_convert_block_hash(a.parent)
                                       if a.parent is not None else None),
                    token_ids=a.token_ids, block_size=self.s.hash_block_size,
                    lora_id=a.lora_id, medium=MEDIUM_STORAGE, lora_name=a.lora_name,
                    group_idx=g, ownership="objectcache", session_id=a.session_id))

    def take_events(self):
        """The ``BlockStored`` events of the chunks confirmed since the last call."""
        out, self.events = self.events, []
        return out

    def update_connector_output(self, out):
        """How the workers' loads ended (their ObjectCacheWorkerMetadata): the tokens each
        request loaded and uses, the failed chunks by reason, and the failed chunks' hashes,
        which are misses for every request for ``failed_chunk_ttl_ms``. vLLM's own
        ``cached_tokens`` of the request is set to what was used, where vLLM still holds it."""
        meta = getattr(out, "kv_connector_worker_meta", None)
        if not isinstance(meta, ObjectCacheWorkerMetadata):
            return
        if meta.saved:
            self._confirm_saved(meta.saved)
        tpc = self.s.tokens_per_chunk
        for rid, o in meta.outcomes.items():
            for why, n in o.failed.items():
                self.c._stat(f"failed_chunks_{why}", n)
            st = self.reqs.get(rid) or self.ended.pop(rid, None)
            if st is None:
                continue
            used = min(o.ok * tpc, st.external_tokens)
            if st.used_tokens is not None:
                used = min(used, st.used_tokens)
            st.used_tokens = used
            if used >= st.external_tokens:
                continue
            st.load_failed = True
            # The chunks to keep from other requests for a while: those whose object was at
            # fault; when none was (a stall, a store error), every chunk the load did not get.
            bad = o.faulty or (range(o.ok, len(st.load_hashes))
                               if set(o.failed) & {"stalled", "error"} else ())
            until = time.monotonic() + self.s.failed_chunk_ttl_s
            for c in bad:
                if c < len(st.load_hashes):
                    self.failed[st.load_hashes[c]] = until
            logger.info("ObjectCache: %s: %d of %d external hit tokens loaded (%s); vLLM "
                        "recomputes the rest", rid, used, st.external_tokens,
                        ", ".join(f"{n} chunks {w}" for w, n in sorted(o.failed.items())))
            _set_used_external_tokens(st.req, st.external_tokens, used)

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
        tpc = self.s.tokens_per_chunk
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
            per_group = _blocks(kvm.get_blocks(rid))
            todo_h, chunk_blocks = [], []
            for c in range(st.saved_upto, len(hashes)):
                h = hashes[c]
                if h in self.known:
                    continue
                # Every group's blocks of the chunk, all in place (a sliding window's blocks
                # are freed as the window moves on; a chunk that became full this step has
                # its blocks).
                cb = [ids[c * gr.blocks_per_chunk:(c + 1) * gr.blocks_per_chunk]
                      for gr, ids in zip(self.s.groups, per_group)]
                if any(len(b) < gr.blocks_per_chunk or None in b
                       for gr, b in zip(self.s.groups, cb)):
                    continue
                todo_h.append(h)
                chunk_blocks.append(cb)
                self._remember(h)
                if self.c._events_on:
                    self._plan_announce(st.req, c, h)
            st.saved_upto = len(hashes)
            if todo_h:
                st.save_jobs += 1
                parts = [_GroupPart(gr.index, list(range(len(todo_h))),
                                    [b for cb in chunk_blocks for b in cb[gr.index]])
                         for gr in self.s.groups]
                saves.append(_SaveSpec(rid, todo_h, parts))
        return saves

    def request_finished(self, request):
        st = self.reqs.pop(request.request_id, None)
        if st is None:
            return False, None
        if st.load_hashes and st.used_tokens is None:
            self.ended[request.request_id] = st
            while len(self.ended) > self._ENDED_MAX:
                self.ended.pop(next(iter(self.ended)))
        if getattr(getattr(request, "status", None), "name", "") == "FINISHED_ERROR":
            # vLLM failed the request (its load failed, policy ``fail``): nothing was used.
            st.used_tokens = 0
        # Only a request this connector loaded reports (under vLLM's MultiConnector, the
        # sub-connectors' parameters are merged and must not clash): the tokens it loaded and
        # used, not those the lookup found (a failed load uses fewer, an aborted one none).
        used = st.used_tokens
        if used is None:
            # The workers' report of a layerwise load comes with the output of the step that
            # ran it, after vLLM has handled that step's requests: a request that finished
            # in that step had no failed block (vLLM holds back every request with one), so
            # its whole load was used. An asynchronous load not reported yet was aborted.
            used = 0 if self.s.load_mode == "async" else st.external_tokens
        if used:
            self.c._stat("hit_tokens", used)
        params = {"objectcache_hit_tokens": used} if st.external_tokens else None
        # Blocks with a save that may still run are held until the workers report it done
        # (get_finished: finished_sending); others are freed now.
        return st.save_jobs > 0, params


def _set_used_external_tokens(req, offered, used):
    """vLLM 0.32 records a request's external hit tokens when it admits it (its
    ``prefill_stats``, the response's ``cached_tokens``) and never revises them after a failed
    load. Where the request still holds those stats (its first output not yet sent, which is
    the case for a failed load: vLLM reschedules it before any output), they are set to the
    tokens actually used. vLLM's ``external_prefix_cache_hits`` counter is recorded at
    admission and stays as it is."""
    ps = getattr(req, "prefill_stats", None)
    if ps is None or not hasattr(ps, "set"):
        return
    ext = getattr(ps, "num_external_cached_tokens", None)
    if ext is None or ext < offered:
        return
    try:
        ps.set(num_prompt_tokens=ps.num_prompt_tokens,
               num_local_cached_tokens=ps.num_local_cached_tokens,
               num_external_cached_tokens=ext - (offered - used))
    except (AssertionError, TypeError, AttributeError) as e:
        logger.debug("ObjectCache: vLLM's prefill stats of %s not revised: %s",
                     req.request_id, e)


def _blocks(kv_blocks):
    """Per KV cache group, the block ids of a request's ``KVCacheBlocks``, ``None`` for
    vLLM's null block (outside a sliding window)."""
    return [[None if getattr(b, "is_null", False) else b.block_id for b in group]
            for group in kv_blocks.blocks]
