"""ObjectCacheConnector inside a real vLLM (0.32, CPU) with a real model (SmolLM2-135M).

Replica processes (each a fresh vLLM; prefix caching off in the replicas that load, so every
hit is an external one):
  baseline   no connector: the reference greedy outputs, each computed in full (a cache salt
             of its own), and a probe of vLLM's own prefix cache: is a prefix hit bit-exact
             with a full computation on this CPU? With the AMX kernels it is; with the AVX2
             ones (ISA "vec") it is not, and then outputs are compared by tolerance
  saver      MultiConnector of ObjectCacheConnectors on every store: serves request A (a
             document of about 1K tokens and a question) and A under cache salt "tenant-x",
             saving their full chunks to each store
  api        the OpenAI-compatible server with --kv-transfer-config on the file store:
             request B (same document, another question), the two salts, 8 concurrent
             requests sharing the document, then B again after every stored object was
             corrupted
  server     a fresh replica on our server (gather), layerwise loads: request B, and B
             computed in that replica itself (under a salt nobody saved) for comparison
  rgw        the same on Ceph RGW (ranged GETs), with asynchronous loads

Needs the vLLM venv of scripts/vllm-setup.sh (this file runs under its Python); the model
folder is $OBJECTCACHE_VLLM_MODEL. Skipped without them, failed under
OBJECTCACHE_REQUIRE_ALL.
"""

import os
import pathlib
import re
import time

import pytest

from conftest import missing
from kvutil import data_objects, flip_byte
from vllm_util import (
    A,
    ApiServer,
    B,
    KvEvents,
    BLOCK,
    DTYPE,
    QUESTIONS,
    Replica,
    TOLERANCE_FLOOR,
    _model,
    assert_same_output,
    compare_baseline,
    connector,
    expected_hit,
    logprob_distance,
    prompt,
    top_logprobs,
)


@pytest.fixture(scope="module")
def model():
    return _model()


@pytest.fixture(scope="module")
def logdir(tmp_path_factory):
    d = os.environ.get("OBJECTCACHE_VLLM_TEST_LOGS")
    if d:
        p = pathlib.Path(d)
        p.mkdir(parents=True, exist_ok=True)
        return p
    return tmp_path_factory.mktemp("vllm-logs")


@pytest.fixture(scope="module")
def stores(tmp_path_factory, server):
    """Store URLs: the embedded file store, our server, Ceph RGW when configured, and a file
    store that the saver writes in format version 2 (segment objects; see SAVE_EXTRA)."""
    s = {"file": "file://" + str(tmp_path_factory.mktemp("vllm-file-store")),
         "server": server.url("vllm"),
         "v2": "file://" + str(tmp_path_factory.mktemp("vllm-v2-store"))}
    rgw = os.environ.get("OBJECTCACHE_VLLM_RGW_URL")
    if rgw:
        s["rgw"] = rgw
    return s


@pytest.fixture(scope="module")
def baseline(model, logdir):
    """References from a vLLM without any KV connector: B and the 8 questions computed one by
    one, and the 8 in one batch, each in full (prefix caching is on, for the probe, but every
    reference has a cache salt of its own, so none hits). Then the probe: A and B under one
    salt, so B hits vLLM's own prefix cache for the shared document; `exact` says whether that
    hit gives the full computation's output to the last bit. It does where vLLM's CPU attention
    computes a cached prefix and a fresh one alike (the AMX kernels); with the AVX2 ones a
    prefix hit moves log-probabilities by a few hundredths, with vLLM's own KV bytes, and the
    tests can only ask the same of ours."""
    r = Replica("baseline", logdir, model, apc=True)
    try:
        tok = r.tokenize([A, B])
        qs = [prompt(q) for q in QUESTIONS]
        single = {p: r.generate([p], salts=[f"single-{i}"])[0] for i, p in enumerate(qs)}
        batch = dict(zip(qs, r.generate(qs, salts=[f"batch-{i}" for i in range(len(qs))])))
        r.generate([A], salts=["probe"])
        hit = r.generate([B], salts=["probe"])[0]
        assert hit["num_cached_tokens"] >= 7 * BLOCK, hit["num_cached_tokens"]
        full = single[B]
        dev = logprob_distance(hit, full)
        exact = hit["token_ids"] == full["token_ids"] and dev == 0.0
        tol = max(TOLERANCE_FLOOR, 3 * dev)
        print(f"vLLM's own prefix cache on this CPU ({DTYPE}): B with {hit['num_cached_tokens']} cached "
              f"tokens {'equals' if exact else 'differs from'} B computed in full "
              f"({hit['text']!r}, top log-probabilities {top_logprobs(hit)} vs "
              f"{full['text']!r}, {top_logprobs(full)}: {dev:.2e} apart); outputs are compared "
              f"{'to the last bit' if exact else f'by first token and log-probabilities within {tol:.2e}'}")
        yield {"tokens": tok, "single": single, "batch": batch, "exact": exact, "tol": tol}
    finally:
        r.close()


SAVE_EXTRA = {"v2": {"save_format": "v2"}}


@pytest.fixture(scope="module")
def saved(model, logdir, stores, baseline):
    """A saver replica writes A (and A under salt tenant-x) to every store at once through
    vLLM's MultiConnector."""
    subs = [{"kv_connector": "ObjectCacheConnector",
             "kv_connector_module_path": "objectcache.vllm", "kv_role": "kv_both",
             "kv_connector_extra_config": {"store": url, "namespace": "vllm-test",
                                           **SAVE_EXTRA.get(name, {})}}
            for name, url in stores.items()]
    cfg = {"kv_connector": "MultiConnector", "kv_role": "kv_both",
           "kv_load_failure_policy": "recompute",
           "kv_connector_extra_config": {"connectors": subs}}
    # vLLM publishes its KV events: the connectors announce the chunks they saved.
    ev = KvEvents()
    r = Replica("saver", logdir, model, kv_transfer_config=cfg,
                extra={"kv_events_config": ev.config})
    try:
        out = r.generate([A])[0]
        assert out["num_cached_tokens"] == 0
        r.generate([A], salts=["tenant-x"])
        flushed = r.call({"op": "flush"})["saves"]
        assert flushed >= 2 * len(stores), f"{flushed} saves for 2 prompts on {len(stores)} stores"
        # The last save's confirmation reaches the scheduler with a step's output: one more
        # step publishes it.
        r.generate(["Hello"], salts=["events"])
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not ev.stored("STORAGE"):
            time.sleep(0.2)
        SAVER_EVENTS.extend(ev.stored("STORAGE"))
        SAVER_EVENTS_GPU.extend(ev.stored("GPU"))
    finally:
        r.close()
        ev.close()
    return out


# What the saver replica published: BlockStored events of the connectors (medium STORAGE)
# and of vLLM's own prefix cache (GPU).
SAVER_EVENTS = []
SAVER_EVENTS_GPU = []


def test_saved_chunks_are_announced_as_vllm_kv_events(baseline, saved, stores):
    """A router that consumes vLLM's KV events sees the chunks the connectors stored: one
    ``BlockStored`` event per chunk and store (medium STORAGE, ownership objectcache), whose
    last block hash is the chunk's key (as stored) and whose tokens are the chunk's, chained
    to the chunk before it by its parent hash."""
    import objectcache as oc

    ev = SAVER_EVENTS
    assert ev, "no BlockStored event with medium STORAGE"
    assert all(e.ownership == "objectcache" for e in ev), ev[:2]

    def hex64(h):  # vLLM publishes the low 64 bits of a hash as an int by default
        return format(h, "016x") if isinstance(h, int) else bytes(h).hex()[-16:]

    tokens_a = baseline["tokens"][0]
    full = (len(tokens_a) - 1) // BLOCK
    want = [h.hex() for h in oc.chunk_hashes(
        tokens_a, BLOCK, seed=os.environ.get("PYTHONHASHSEED", "vllm-none-hash"))[:full]]
    by_key = {}
    for e in ev:
        by_key.setdefault(hex64(e.block_hashes[-1]), []).append(e)
    root = stores["file"][len("file://"):]
    stored = {pathlib.Path(p).name[-16:] for p in data_objects(root)}
    # Every announced chunk is stored, and every stored chunk (A and A under tenant-x) is
    # announced once per store.
    assert set(by_key) == stored, (sorted(by_key), sorted(stored))
    assert all(len(v) == len(stores) for v in by_key.values()), \
        {k: len(v) for k, v in by_key.items()}
    for c, h in enumerate(want):
        e = by_key[h[-16:]][0]
        assert list(e.token_ids) == tokens_a[c * BLOCK:(c + 1) * BLOCK], c
        assert (e.parent_block_hash is None) == (c == 0), c
        if c:
            prev = by_key[want[c - 1][-16:]][0]
            assert hex64(e.parent_block_hash) == hex64(prev.block_hashes[-1]), c
    print(f"KV events: {len(ev)} BlockStored (STORAGE) for {len(by_key)} chunks on "
          f"{len(stores)} stores; vLLM's own (GPU): {len(SAVER_EVENTS_GPU)}")



def test_chunk_keys_are_vllm_block_hashes(baseline, saved, stores):
    """With sha256_cbor, the keys the connector stored under are the hashes vLLM computes for
    the blocks, which objectcache.chunk_hashes reproduces from the token ids (vLLM 0.32's
    seed for SHA-256 hashing without PYTHONHASHSEED is "vllm-none-hash")."""
    import objectcache as oc

    tokens_a = baseline["tokens"][0]
    full = (len(tokens_a) - 1) // BLOCK
    want = oc.chunk_hashes(tokens_a, BLOCK, seed=os.environ.get("PYTHONHASHSEED", "vllm-none-hash"))
    want = [h.hex() for h in want[:full]]
    root = stores["file"][len("file://"):]
    names = {pathlib.Path(p).name for p in data_objects(root)}
    assert set(want) <= names, f"stored {sorted(names)}; expected keys {want}"


def test_api_server_cross_replica_salts_concurrency_and_corruption(model, logdir, stores,
                                                                   baseline, saved):
    tok_a, tok_b = baseline["tokens"]
    hit_b = expected_hit(tok_a, tok_b)
    assert hit_b >= 7 * BLOCK, f"the shared document spans {hit_b} tokens of full chunks"
    srv = ApiServer("api", logdir, model, connector(stores["file"]))
    try:
        # 1. Cross-replica: B in a fresh process gets every shared full chunk from the store.
        # The same server computing B itself (under a cache salt nobody saved: a miss) gives
        # the same output and the same first-token log-probabilities: the loaded KV is the
        # computed KV. And vs vLLM without a connector (see compare_baseline).
        b = srv.complete(B)
        print(f"B: {b['cached_tokens']} cached tokens (expected {hit_b}), text {b['text']!r}")
        assert b["cached_tokens"] == hit_b
        assert b["kv_transfer_params"] == {"objectcache_hit_tokens": hit_b}
        assert srv.metric("vllm:external_prefix_cache_hits_total") >= hit_b
        y = srv.complete(B, salt="tenant-y")
        assert y["cached_tokens"] == 0 and y["kv_transfer_params"] is None
        assert_same_output(b, y, "B", baseline)
        compare_baseline(b["text"], b["first_logprobs"], baseline["single"][B], "B")

        # 2. Two cache salts (C15): tenant-x saved A under its salt and hits; tenant-y never
        # saved A, so it missed above.
        x = srv.complete(B, salt="tenant-x")
        print(f"salt tenant-x: {x['cached_tokens']} cached; tenant-y: {y['cached_tokens']}")
        assert x["cached_tokens"] == hit_b
        assert x["kv_transfer_params"] == {"objectcache_hit_tokens": hit_b}
        assert_same_output(x, y, "B, salt tenant-x", baseline)

        # 3. Eight concurrent requests sharing the document.
        import concurrent.futures as cf

        ps = [prompt(q) for q in QUESTIONS]
        with cf.ThreadPoolExecutor(8) as ex:
            outs = list(ex.map(srv.complete, ps))
        single, batch = baseline["single"], baseline["batch"]
        stable = [p for p in ps if single[p]["text"] == batch[p]["text"]]
        print(f"8 concurrent: without a connector, {len(stable)} of 8 outputs are the same "
              f"computed one by one and in one batch")
        same = 0
        for p, o in zip(ps, outs):
            params = o["kv_transfer_params"] or {}
            assert params.get("objectcache_hit_tokens", 0) >= hit_b - BLOCK, o
            assert o["cached_tokens"] == params["objectcache_hit_tokens"]
            same += compare_baseline(o["text"], o["first_logprobs"], single[p],
                                     QUESTIONS[ps.index(p)])
        print(f"8 concurrent: {same} of 8 outputs identical to vLLM without a connector")

        # 4. Every stored object corrupted (one byte flipped in each): B is recomputed, the
        # connector reports the misses, the output is the same.
        root = stores["file"][len("file://"):]
        objs = data_objects(root)
        assert objs
        for path in objs:
            flip_byte(path, os.path.getsize(path) // 2)
        failed_before = srv.metric("vllm:objectcache_failed_blocks_total")
        c = srv.complete(B)
        failed = srv.metric("vllm:objectcache_failed_blocks_total") - failed_before
        print(f"corrupted store: {failed} blocks reported failed, text {c['text']!r}")
        assert failed >= hit_b // BLOCK
        # Recomputed in full: the output is this server's own full computation of B.
        assert_same_output(c, y, "B, store corrupted", baseline)
    finally:
        srv.close()


@pytest.mark.parametrize("store", ["server", "rgw", "v2"])
def test_cross_replica_on_each_store(model, logdir, stores, baseline, saved, store):
    """B in a fresh replica loads the document's chunks that the saver wrote. On "v2" the
    saver wrote segment objects and the loading replica keeps the default format (version 1,
    which reads no segment markers itself): it places the chunks only from the markers its
    scheduler's lookup read and handed to the worker (objectcache_segment_markers, then
    objectcache_segment_markers_add). Without the hand-over vLLM still reports the hit
    tokens and the output is the same (it recomputes the failed blocks); the worker's log
    then names the failed layer, which the test checks is absent."""
    if store not in stores:
        missing(f"no {store} store (set OBJECTCACHE_VLLM_RGW_URL; scripts/ceph-rgw/start.sh)")
    tok_a, tok_b = baseline["tokens"]
    hit_b = expected_hit(tok_a, tok_b)
    # The RGW replica loads asynchronously (vLLM waits for the whole load between steps), the
    # server replica layer by layer inside the forward pass: both load paths run.
    mode = "async" if store == "rgw" else "layerwise"
    if store == "v2":
        root = pathlib.Path(stores["v2"][len("file://"):])
        assert list(root.rglob("seg/*")) and not data_objects(root), \
            "the v2 saver wrote chunk objects, or no segment"
    r = Replica(f"replica-{store}", logdir, model,
                kv_transfer_config=connector(stores[store], load_mode=mode))
    try:
        out = r.generate([B])[0]
        # The same replica computing B itself (a salt nobody saved: a miss).
        own = r.generate([B], salts=["recompute-here"])[0]
    finally:
        r.close()
    print(f"{store}: B got {out['num_cached_tokens']} external hit tokens (expected {hit_b})")
    assert out["num_cached_tokens"] == hit_b
    assert out["kv_transfer_params"] == {"objectcache_hit_tokens": hit_b}
    assert own["num_cached_tokens"] == 0
    assert_same_output(out, own, store, baseline)
    compare_baseline(out["text"], out["first_logprobs"], baseline["single"][B], store)
    # The layout in the keys names vLLM's CPU attention ISA (blocks are packed for it).
    log = r.logpath.read_text()
    # Every hit loaded: a failed load is recomputed by vLLM, which still counts the tokens
    # as external hits and gives the same output, so only the worker's warning tells.
    failed = re.findall(r"ObjectCache: load for \S+: layer \d+ failed[^\n]*", log)
    assert not failed, f"{store}: loads failed and vLLM recomputed them: {failed[:2]}"
    assert re.search(r"layout vllm\d+\.\d+/cpu-\w+/", log), "no CPU attention ISA in the layout"
