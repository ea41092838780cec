"""Failed loads inside a real vLLM (0.32, CPU, SmolLM2-135M): the right output, one load at
most per request, and exactly the failed blocks reported.

One replica per load mode (``layerwise``, ``async``) and vLLM scheduling (with and without
``async_scheduling``), each with ``kv_load_failure_policy: recompute``, on our server behind a
fault proxy (faultproxy.py). For every fault the replica first serves a document (A: it
computes and saves its chunks), then the fault is made, then it serves B (the same document,
another question), and then B again under a cache salt nobody saved (B computed in full by the
same engine). Faults (every one without async scheduling; with it, one of each reason the
load reports, ``ASYNC_SCHED_FAULTS``):

* ``missing``: chunk 2's object deleted after the save (its publish marker stays, so the
  lookup says hit);
* ``corrupt``: one byte of layer 7 of chunk 3 flipped;
* ``truncated``: chunk 4's object cut to half its length;
* ``stalled``: the server stops sending gather data (lookups still answer); stall limit 1 s;
* ``killed``: every connection to the server closed 256 KiB into the load, new ones refused;
* ``down``: the server unreachable from the moment the load starts (after the lookup).

For each, from the replica's output and the connector's trace (OBJECTCACHE_VLLM_TRACE):
* B's output equals, token for token and in its first-token log-probabilities, the same
  engine's full computation of B;
* B's load was posted once (the request never loads again; for other requests of the
  replica, the faulty chunk, or after a store fault every chunk B did not get, is a miss for
  ``failed_chunk_ttl_ms``: C, a third question on the same document, hits at most the chunks
  before it);
* the tokens vLLM reports recomputing ("Recovered from KV load failure ... N tokens
  affected") are the load's tokens from the first failed chunk on, and the chunks the worker
  reported loaded are exactly those before the faulty one (for the object faults);
* ``objectcache_hit_tokens`` and vLLM's ``cached_tokens`` of B are the tokens loaded and
  used, not those the lookup found.
"""

import json
import os
import pathlib
import re
import time

import pytest

from faultproxy import FaultProxy
from kvutil import data_objects, flip_byte
from vllm_util import BLOCK, EXACT_DTYPE, Replica, _model, assert_same_tokens

FAULTS = ["missing", "corrupt", "truncated", "stalled", "killed", "down"]
# The faults' documents: 7 full chunks (the faulty ones are chunks 2-4, so every object fault
# has chunks before and after it). 24 fault rounds run on them, each computing the document 4
# times: 12 chunks took 4 x 120 s in CI, about 470 s.
FAULT_ITEMS = 24
# Under vLLM's async scheduling, one fault of each reason the load reports (missing, corrupt,
# stalled, error): truncated reports as corrupt and down as error, through the same code.
ASYNC_SCHED_FAULTS = ["missing", "corrupt", "stalled", "killed"]
# SmolLM2-135M in float32: 30 layers; one layer of a 128-token chunk (one vLLM block) is
# 2 x 128 tokens x 3 KV heads x 64 x 4 bytes = 192 KiB.
LAYERS, SLICE = 30, 192 * 1024


def document(tag, items=40):
    """Deterministic text that begins with `tag`, so that every case has chunk keys of its
    own: ``items`` lines of about 40 tokens (40 items: about 1,590 tokens with a question,
    12 full chunks; 24: about 960, 7 chunks)."""
    lines = [f"Maintenance log {tag}."]
    for i in range(items):
        lines.append(f"Item {i}: pump {(i * 7) % 13} at station {tag}-{i % 5} was checked on "
                     f"day {3 + 2 * i}; pressure {40 + (i * 11) % 37} bar, valve "
                     f"{['open', 'closed', 'half open'][i % 3]}.")
    return "\n".join(lines)


def ask(doc, q):
    return f"{doc}\n\nQuestion: {q}\nAnswer:"


QA, QB, QC = ("List the stations.", "Which pump had the highest pressure?",
              "When was item 9 checked?")


@pytest.fixture(scope="module")
def logdir(tmp_path_factory):
    d = os.environ.get("OBJECTCACHE_VLLM_TEST_LOGS")
    if d:
        p = pathlib.Path(d)
        p.mkdir(parents=True, exist_ok=True)
        return p
    return tmp_path_factory.mktemp("vllm-failure-logs")


def _trace(path):
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            i = line.find("{")
            if line.startswith("objectcache-trace") and i >= 0:
                out.append(json.loads(line[i:]))
    return out


def _events(trace, event, rid):
    """Trace events of one request: vLLM's internal request id extends the offline one."""
    return [e for e in trace if e["event"] == event and str(e.get("req", "")).startswith(rid)]


def _chunk_path(objs_before, objs_after, chunk, tokens):
    """The object file of chunk `chunk` of a save: the files it added, in chunk order (the
    keys are vLLM's block hashes of the prompt, whose order the tokens give)."""
    import objectcache as oc

    new = {pathlib.Path(p).name: p for p in set(objs_after) - set(objs_before)}
    keys = [h.hex() for h in oc.chunk_hashes(tokens, BLOCK, seed="vllm-none-hash")]
    return new[keys[chunk]]


def _connector(prefix, addr, namespace="vllm-failures", policy="recompute", **extra):
    """The connector's ``kv_transfer_config`` on the server at ``addr`` (bucket
    ``kv-pytest``, key prefix ``prefix``), with vLLM's ``kv_load_failure_policy`` ``policy``
    (``None``: vLLM's default, ``fail``) and more connector settings ``extra``."""
    store = (f"s3://kv-pytest/{prefix}?endpoint=http://{addr}&region=us-east-1"
             "&addressing=path")
    # No reuse of lookup answers (the engine's default keeps them 2 s): a request served right
    # after the save of its prefix in the same replica would otherwise get the miss the
    # engine's lookup cached when the prefix was first computed, and what these tests read
    # would depend on how fast the machine serves the requests in between.
    cfg = {"kv_connector": "ObjectCacheConnector",
           "kv_connector_module_path": "objectcache.vllm", "kv_role": "kv_both",
           "kv_connector_extra_config": {"store": store, "namespace": namespace,
                                         "lookup_cache_ttl_ms": 0, **extra}}
    if policy:
        cfg["kv_load_failure_policy"] = policy
    return cfg


def _save(replica, root, prompts, max_tokens=None):
    """Serves ``prompts`` (texts, or token id lists with ``max_tokens``) and waits for their
    saves; returns the outputs and the chunk data objects under ``root`` before and after."""
    before = data_objects(root)
    if max_tokens is None:
        out = replica.generate(prompts)
    else:
        out = _generate_ids(replica, prompts, max_tokens)
    replica.call({"op": "flush"})
    return out, before, data_objects(root)


@pytest.mark.parametrize("mode,async_sched", [("layerwise", False), ("async", False),
                                              ("layerwise", True), ("async", True)])
def test_failed_loads_recompute_once_with_the_right_output(server, logdir, mode, async_sched):
    model = _model()
    name = f"fail-{mode}-{'async' if async_sched else 'sync'}sched"
    proxy = FaultProxy(server.addr)
    trace_path = logdir / f"{name}.trace"
    trace_path.unlink(missing_ok=True)
    cfg = _connector(f"failures-{name}-{int(time.time())}", proxy.addr, load_mode=mode,
                     stall_timeout_ms=1000, gather_streams=1)
    r = Replica(name, logdir, model, kv_transfer_config=cfg,
                extra={"async_scheduling": async_sched, "dtype": EXACT_DTYPE},
                env={"OBJECTCACHE_VLLM_TRACE": str(trace_path)}, engine_process=True)
    root = pathlib.Path(server.store_dir)
    report = []
    recomputed = []  # per failed load: the tokens from its first failed chunk on
    try:
        for fault in ASYNC_SCHED_FAULTS if async_sched else FAULTS:
            doc = document(f"{fault}/{name}", FAULT_ITEMS)
            a_prompt, b_prompt, c_prompt = ask(doc, QA), ask(doc, QB), ask(doc, QC)
            _, before, after = _save(r, root, [a_prompt])
            tokens = r.tokenize([a_prompt])[0]
            saved = len(set(after) - set(before))
            assert saved >= 6, f"{fault}: A saved {saved} chunk objects"
            faulty = {"missing": 2, "corrupt": 3, "truncated": 4}.get(fault)
            if fault == "missing":
                os.remove(_chunk_path(before, after, 2, tokens))
            elif fault == "corrupt":
                path = _chunk_path(before, after, 3, tokens)
                # Layer 7's slice (docs/object-format.md: a 64-byte header, then per layer
                # the slice and its CRC32C).
                assert os.path.getsize(path) == 64 + LAYERS * (SLICE + 4)
                flip_byte(path, 64 + 7 * (SLICE + 4) + 1000)
            elif fault == "truncated":
                path = _chunk_path(before, after, 4, tokens)
                with open(path, "r+b") as f:
                    f.truncate(os.path.getsize(path) // 2)
            elif fault == "stalled":
                proxy.set_mode("stall")
            elif fault == "killed":
                proxy.set_mode("kill")
            elif fault == "down":
                proxy.set_mode("down")
            t0 = time.monotonic()
            b = r.generate([b_prompt])[0]
            b_s = time.monotonic() - t0
            proxy.set_mode("pass")
            c = r.generate([c_prompt])[0]
            own = r.generate([b_prompt], salts=["computed-here"])[0]
            assert own["num_cached_tokens"] == 0
            assert_same_tokens(b, own, f"{name}: B after fault {fault}")

            trace = _trace(trace_path)
            rid = b["request_id"]
            offered = sum(e.get("external_tokens", 0)
                          for e in _events(trace, "update_state_after_alloc", rid))
            posted = _events(trace, "load.posted", rid)
            settled = _events(trace, "load.settled", rid)
            assert offered > 0, f"{fault}: B's lookup found nothing to load"
            assert len(posted) == 1, f"{fault}: B's load was posted {len(posted)} times"
            assert len(settled) == 1, settled
            ok = settled[0]["ok_chunks"]
            used = ok * BLOCK
            if faulty is not None:
                # Never more than the chunks before the faulty one; exactly those in layerwise
                # mode. (A miss fails its layers at once, and the server can report it before
                # the earlier chunks' slices of those layers landed; an asynchronous load then
                # gets one more step while bytes still land, but a step without any reports
                # the chunks still open as failed too.)
                assert ok <= faulty, f"{fault}: {ok} chunks loaded, chunk {faulty} was faulty"
                if mode == "layerwise":
                    assert ok == faulty, f"{fault}: {ok} chunks loaded, chunk {faulty} faulty"
                want = "missing" if fault == "missing" else "corrupt"
                assert settled[0]["reasons"].get(want), (fault, settled[0]["reasons"])
            got = (b["kv_transfer_params"] or {}).get("objectcache_hit_tokens")
            assert got == used, f"{fault}: objectcache_hit_tokens {got}, {used} loaded and used"
            assert b["num_cached_tokens"] == used, (
                f"{fault}: vLLM's cached_tokens {b['num_cached_tokens']}, {used} used")
            # Other requests of the replica do not load the failed chunks again at once.
            c_hit = (c["kv_transfer_params"] or {}).get("objectcache_hit_tokens", 0)
            if used < offered:
                # The faulty chunk (or, after a store fault, every chunk B did not get) is a
                # miss for C: it loads at most the chunks before it.
                limit = faulty * BLOCK if faulty is not None else used
                assert c_hit <= limit, f"{fault}: C loaded {c_hit} tokens, at most {limit}"
                recomputed.append(offered - used)
            report.append(f"{fault}: B {b_s:.2f} s, offered {offered} tokens, used {used} "
                          f"({settled[0]['reasons'] or 'no failure'}), C hit {c_hit}")
        log = r.logpath.read_text()
    finally:
        r.close()
        proxy.close()
    affected = [int(n) for n in
                re.findall(r"Recovered from KV load failure: \d+ request\(s\) rescheduled "
                           r"\((\d+) tokens affected\)", log)]
    print(f"{name}:\n  " + "\n  ".join(report) + f"\n  vLLM recomputed: {affected}")
    # Exactly the failed loads, once each (no loop), and for each exactly the tokens from its
    # first failed block on.
    assert affected == recomputed, f"vLLM recomputed {affected}; the failed loads {recomputed}"


@pytest.fixture(scope="module")
def plain(server, logdir):
    """A replica with vLLM's default ``kv_load_failure_policy`` (``fail``), layerwise loads
    straight from our server, float32, a KV cache with room for every test here: the default
    policy's test, the clean run of the preemption test, and the 256-token boundary test."""
    name = "fail-policy-default"
    cfg = _connector(f"failures-{name}-{int(time.time())}", server.addr, policy=None,
                     load_mode="layerwise")
    r = Replica(name, logdir, _model(), kv_transfer_config=cfg, extra={"dtype": EXACT_DTYPE},
                engine_process=True)
    try:
        yield r
    finally:
        r.close()


def test_vllms_default_policy_fails_only_the_request_whose_load_failed(server, plain):
    """vLLM's default ``kv_load_failure_policy: fail``: a load that fails (here a corrupt
    chunk) makes vLLM finish that request with an error and no output, never wrong tokens; a
    request of the same batch goes on; the connector warned at start-up; and the next request
    on the same document treats the faulty chunk as a miss, so it succeeds with the output of
    a full computation."""
    r, name = plain, "fail-policy-default"
    root = pathlib.Path(server.store_dir)
    doc = document(f"corrupt/{name}")
    other = document(f"bystander/{name}")
    a_prompt, b_prompt, c_prompt = ask(doc, QA), ask(doc, QB), ask(doc, QC)
    _, before, after = _save(r, root, [a_prompt])
    path = _chunk_path(before, after, 3, r.tokenize([a_prompt])[0])
    flip_byte(path, 64 + 7 * (SLICE + 4) + 1000)
    b, bystander = r.generate([b_prompt, ask(other, QB)])
    c = r.generate([c_prompt])[0]
    own_c, own_bystander = r.generate([c_prompt, ask(other, QB)],
                                      salts=["computed-here", "computed-here"])
    log = r.logpath.read_text()
    print(f"{name}: B finished {b['finish_reason']!r} with {len(b['token_ids'])} tokens; "
          f"the bystander {bystander['finish_reason']!r}; C hit "
          f"{(c['kv_transfer_params'] or {}).get('objectcache_hit_tokens', 0)} tokens")
    assert "kv_load_failure_policy is 'fail'" in log, "the start-up warning"
    assert b["finish_reason"] == "error", b
    assert b["token_ids"] == [], "a failed request returns no tokens"
    assert bystander["finish_reason"] != "error", bystander
    assert_same_tokens(bystander, own_bystander, f"{name}: the bystander")
    assert c["finish_reason"] != "error", c
    c_hit = (c["kv_transfer_params"] or {}).get("objectcache_hit_tokens", 0)
    assert c_hit == 3 * BLOCK, f"C loaded {c_hit} tokens: the 3 chunks before the faulty one"
    assert_same_tokens(c, own_c, f"{name}: C after the failed load")


def _generate_ids(replica, ids, max_tokens):
    """Greedy outputs of prompts given as token ids."""
    ps = [{"prompt_token_ids": t} for t in ids]
    return replica.call({"op": "generate", "prompts": ps, "max_tokens": max_tokens,
                         "logprobs": 5})["outputs"]


def _kv_of(path):
    """Every layer's K|V slice of a chunk object (float32), concatenated."""
    import numpy as np

    b = pathlib.Path(path).read_bytes()
    assert len(b) == 64 + LAYERS * (SLICE + 4), path
    return np.concatenate([np.frombuffer(b, dtype=np.float32, count=SLICE // 4,
                                         offset=64 + layer * (SLICE + 4))
                           for layer in range(LAYERS)])


PREEMPT_PROMPTS, PREEMPT_TOKENS, PREEMPT_NEW = 32, 2 * BLOCK + 100, 40


def test_preempted_requests_never_save_another_requests_kv(server, logdir, plain):
    """32 requests of 356 tokens, 40 tokens generated (3 full chunks each), in a KV cache of
    36 blocks: vLLM preempts while the requests grow into their 4th block, and gives the
    preempted requests' blocks to others. Saves are slowed (the store takes PUTs at 25 MB/s,
    and the worker saves one request at a time), so a preempted request's save is still
    queued when vLLM reuses its blocks: the hold (``handle_preemptions`` waits for it) is what
    keeps it from reading another request's KV. Every chunk stored must hold what a clean
    run (a fresh replica with room for everything) computes for it, and every output must
    equal the clean run's. The clean run is the ``plain`` replica's (one vLLM start less)."""
    import numpy as np

    model = _model()
    root = pathlib.Path(server.store_dir)
    proxy = FaultProxy(server.addr)
    proxy.rate = 25e6
    trace_path = logdir / "preempt.trace"
    trace_path.unlink(missing_ok=True)
    t = int(time.time())

    def run(replica):
        out, before, after = _save(replica, root, ids, PREEMPT_NEW)
        return out, {pathlib.Path(x).name: x for x in set(after) - set(before)}

    squeezed = Replica("preempt", logdir, model,
                       kv_transfer_config=_connector(f"preempt-{t}", proxy.addr,
                                                     namespace="vllm-preempt"),
                       extra={"dtype": EXACT_DTYPE, "num_gpu_blocks_override": 36},
                       env={"OBJECTCACHE_VLLM_TRACE": str(trace_path)}, engine_process=True)
    try:
        docs = [document(f"preempt/{i}") for i in range(PREEMPT_PROMPTS)]
        ids = [tokens[:PREEMPT_TOKENS] for tokens in squeezed.tokenize(docs)]
        proxy.set_mode("slow_saves")
        t0 = time.monotonic()
        got, stored = run(squeezed)
        squeezed_s = time.monotonic() - t0
        proxy.set_mode("pass")
    finally:
        squeezed.close()
        proxy.close()
    holds = [e for e in _trace(trace_path) if e["event"] == "preempted"]
    assert holds, "vLLM preempted nothing: the cache is not small enough to test anything"
    pending = sum(e["pending"] for e in holds)
    assert pending > 0, "no preempted request had a save in flight: saves are not slow enough"

    want, reference = run(plain)
    # Every full chunk of prompt and output is saved (the output's when the request ends).
    chunks = (PREEMPT_TOKENS + PREEMPT_NEW - 1) // BLOCK
    assert len(reference) == chunks * PREEMPT_PROMPTS, len(reference)
    assert set(stored) == set(reference), (
        f"{len(set(reference) - set(stored))} chunks not stored under preemption, "
        f"{len(set(stored) - set(reference))} stored that a clean run does not compute")
    worst, identical = 0.0, 0
    for name in sorted(reference):
        a, b = _kv_of(stored[name]), _kv_of(reference[name])
        d = float(np.max(np.abs(a - b)))
        identical += d == 0.0
        worst = max(worst, d)
        assert np.allclose(a, b, rtol=1e-3, atol=1e-3), (
            f"chunk {name}: stored KV differs from the clean run's by up to {d:.3g}")
    for i, (g, w) in enumerate(zip(got, want)):
        assert_same_tokens(g, w, f"prompt {i} under preemption")
    print(f"preemption: {len(holds)} preemptions in {squeezed_s:.1f} s, {pending} saves "
          f"waited for before their blocks went to others "
          f"({sum(e['wait_ms'] for e in holds):.0f} ms held in all); {len(reference)} chunks "
          f"stored, {identical} byte-identical to a clean run's, the rest within "
          f"{worst:.2g}; {len(got)} outputs equal")


def test_chunk_keys_at_every_hash_granularity():
    """A chunk's key is vLLM's block hash at the token that closes the chunk, whatever the
    granularity vLLM hashes at (its hash block size: the block size, or a finer prefix match
    unit with several KV cache groups). The start-up check (check_chunk_keys) passes for each,
    and the keys equal vLLM's own hashes of a request at that granularity. The rule of earlier
    versions, "the hash of the chunk's last block" indexed by blocks, names a shorter prefix
    when vLLM hashes finer than the block size: the check refuses it."""
    _model()
    import types

    import objectcache as oc
    from objectcache.vllm import _common

    tokens = [(31 * i + 7) % 5000 for i in range(3 * 128 + 5)]
    for hbs in (16, 32, 64, 128):
        s = types.SimpleNamespace(tokens_per_chunk=128, hash_block_size=hbs, block_size=128,
                                  hash_algo="sha256_cbor")
        _common.check_chunk_keys(s)
        vllm_hashes = oc.chunk_hashes(tokens, hbs, seed="vllm-none-hash")
        keys = _common.chunk_keys(s, vllm_hashes, 3)
        whole = oc.chunk_hashes(tokens, 128, seed="vllm-none-hash")
        # Each key is the hash at the chunk's last token: at hbs = 128 the chunk hashes
        # themselves; finer, the same prefixes hashed in finer steps.
        assert len(keys) == 3
        if hbs == 128:
            assert keys == whole[:3]
        assert [vllm_hashes.index(k) for k in keys] == [(c + 1) * 128 // hbs - 1
                                                        for c in range(3)]

    # The earlier rule at a finer granularity: chunk c keyed by hash (c + 1) * k - 1, k = 1
    # block per chunk. Chunk 0's key would then cover only the first 16 tokens.
    s = types.SimpleNamespace(tokens_per_chunk=128, hash_block_size=16, block_size=128,
                              hash_algo="sha256_cbor")
    real = _common.chunk_key_index
    try:
        _common.chunk_key_index = lambda s, c: c
        with pytest.raises(ValueError, match="does not name exactly|ignores"):
            _common.check_chunk_keys(s)
    finally:
        _common.chunk_key_index = real


def test_prompts_sharing_exactly_256_tokens_hit_at_most_the_shared_chunks(plain):
    """Prompt P (about 700 tokens) is saved; Q shares exactly its first 256 tokens (2 chunks),
    R its first 255: Q hits 256 tokens, R 128, never more, and both outputs equal the
    engine's own full computation. On the ``plain`` replica (one vLLM start less): no load
    fails here, so its failure policy does not matter."""
    r = plain
    p = r.tokenize([document("exact-256")])[0][:700]
    assert len(p) == 700
    gen = lambda toks, salt=None: r.call({  # noqa: E731
        "op": "generate", "max_tokens": 8, "logprobs": 5,
        "prompts": [{"prompt_token_ids": toks, "cache_salt": salt}]})["outputs"][0]
    gen(p)
    r.call({"op": "flush"})
    q = p[:256] + [(t + 1) % 5000 + 10 for t in p[256:]]
    rr = p[:255] + [(t + 1) % 5000 + 10 for t in p[255:]]
    for name, toks, want in (("Q", q, 256), ("R", rr, 128)):
        out = gen(toks)
        own = gen(toks, salt="computed-here")
        hit = (out["kv_transfer_params"] or {}).get("objectcache_hit_tokens", 0)
        print(f"{name}: shares {want if name == 'Q' else 255} tokens with P, hit {hit}")
        assert hit == want, f"{name}: hit {hit} tokens, expected {want}"
        assert out["num_cached_tokens"] == want
        assert_same_tokens(out, own, name)


def _stream_and_abort(port, model, prompt_text, after_s):
    """Starts a streaming completion and closes the connection after `after_s` seconds (vLLM
    aborts the request); returns the bytes of answer seen before (no token is expected: the
    request waits for its load)."""
    import http.client

    body = json.dumps({"model": model, "prompt": prompt_text, "max_tokens": 16,
                       "temperature": 0, "stream": True})
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=after_s)
    c.request("POST", "/v1/completions", body=body,
              headers={"Content-Type": "application/json"})
    seen = b""
    try:
        r = c.getresponse()
        seen = r.read1(65536)
    except (TimeoutError, OSError):
        pass
    c.sock.close()
    c.close()
    return seen


def test_aborted_requests_cancel_their_loads_and_leak_nothing(server, logdir):
    """100 streaming requests through vLLM's OpenAI server (async loads), each aborted by its
    client while its load is in flight (the store slowed to 5 MB/s for a 70 MB load, so a load
    takes about 14 s and the client gives up after 1.5 s). Afterwards vLLM's KV cache usage,
    the engine's live transfers and registered regions, and the worker's threads are back
    where they were, and the next request on the same prefix loads it and gives the engine's
    own full computation."""
    import concurrent.futures as cf

    from kvutil import data_objects
    from vllm_util import ApiServer

    model = _model()
    proxy = FaultProxy(server.addr)
    prefix = f"aborts-{int(time.time())}"
    store = (f"s3://kv-pytest/{prefix}?endpoint=http://{proxy.addr}&region=us-east-1"
             "&addressing=path")
    cfg = {"kv_connector": "ObjectCacheConnector",
           "kv_connector_module_path": "objectcache.vllm", "kv_role": "kv_both",
           "kv_load_failure_policy": "recompute",
           "kv_connector_extra_config": {"store": store, "namespace": "vllm-aborts",
                                         "load_mode": "async", "load_timeout_ms": 60000}}
    srv = ApiServer("aborts", logdir, model, cfg, args=["--dtype", EXACT_DTYPE])
    doc = document("aborts")
    root = pathlib.Path(server.store_dir)
    try:
        srv.complete(ask(doc, QA))
        # The saves run in the background: wait for the document's chunk objects (at least
        # 8, and no new one for a second).
        deadline, last = time.monotonic() + 120, -1
        while True:
            n = len([p for p in data_objects(root) if prefix in p])
            if n >= 8 and n == last:
                break
            assert time.monotonic() < deadline, f"A's chunks were not saved ({n} objects)"
            last = n
            time.sleep(1)
        # One load that completes, so every thread the engine starts for loads exists.
        warm = srv.complete(ask(doc, "Summarise the log."))
        hit = (warm["kv_transfer_params"] or {}).get("objectcache_hit_tokens", 0)
        assert hit >= 8 * BLOCK, warm

        def gauges():
            return {k: srv.metric(f"vllm:objectcache_{k}")
                    for k in ("live_transfers", "registered_regions", "worker_threads")}

        usage0, g0 = srv.metric("vllm:kv_cache_usage_perc"), gauges()
        loads0 = srv.metric("vllm:objectcache_loads_total")
        cancelled0 = srv.metric("vllm:objectcache_failed_chunks_total", 'reason="cancelled"')
        proxy.set_mode("slow")
        t0 = time.monotonic()
        with cf.ThreadPoolExecutor(25) as ex:
            seen = list(ex.map(lambda i: _stream_and_abort(
                srv.port, model, ask(doc, f"What happened at item {i}?"), 1.5), range(100)))
        aborted_s = time.monotonic() - t0
        proxy.set_mode("pass")
        assert not any(b"\"text\"" in s for s in seen), "a request streamed tokens before abort"
        deadline = time.monotonic() + 60
        while True:
            usage, g = srv.metric("vllm:kv_cache_usage_perc"), gauges()
            if (usage <= usage0 and g == g0) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        loads = srv.metric("vllm:objectcache_loads_total") - loads0
        cancelled = (srv.metric("vllm:objectcache_failed_chunks_total", 'reason="cancelled"')
                     - cancelled0)
        print(f"aborts: 100 requests aborted in {aborted_s:.1f} s; {loads:.0f} loads posted, "
              f"{cancelled:.0f} chunks cancelled; KV cache usage {usage0:.4f} -> {usage:.4f}; "
              f"engine gauges {g0} -> {g}")
        assert loads > 0, "no load was posted for the aborted requests"
        # Every posted load was cancelled when vLLM finished its request (none ran to its
        # end, which at 5 MB/s would take about 14 s).
        assert cancelled == loads * (hit // BLOCK), (
            f"{cancelled} chunks cancelled for {loads} loads of {hit // BLOCK} chunks")
        assert usage <= usage0, f"KV cache usage {usage} after the aborts, {usage0} before"
        assert g == g0, f"engine gauges {g} after the aborts, {g0} before"
        b = srv.complete(ask(doc, QB))
        own = srv.complete(ask(doc, QB), salt="computed-here")
        assert (b["kv_transfer_params"] or {}).get("objectcache_hit_tokens", 0) == hit, b
        assert b["tokens"] == own["tokens"], (b["text"], own["text"])
    finally:
        srv.close()
        proxy.close()
