"""The `objectcache` package against the embedded (directory) store: every call is the C
ABI's, the bytes are compared byte for byte, errors carry the C ABI's names and messages."""

import json
import os
import pathlib
import threading
import time

import pytest

import objectcache as oc
from kvutil import data_objects, flip_byte, geometry, kv, split_layers, tokens

VECTORS = pathlib.Path(__file__).resolve().parents[3] / "tests/data/vllm_sha256_cbor_vectors.json"


@pytest.fixture
def eng(tmp_path):
    e = oc.Engine(store=str(tmp_path / "store"), namespace="pytest")
    yield e
    e.close()


def saved_prefix(eng, g, n_chunks, seed):
    hashes = oc.chunk_hashes(tokens(n_chunks * g.tokens_per_chunk, seed), g.tokens_per_chunk)
    layers = kv(g, n_chunks, seed)
    rep = eng.save(g, hashes, layers)
    assert rep.written == n_chunks and rep.already_present == 0
    return hashes, layers


def test_library_and_package_versions():
    assert oc.abi_version() == oc.ABI_VERSION == 1
    assert oc.version() == oc.__version__
    assert oc.library_path().endswith("libobjectcache.so")
    assert oc.status_name(21) == "OBJECTCACHE_ERR_LAYER_CHECKSUM"


def test_chunk_hashes_match_the_vllm_reference_vectors():
    cases = json.loads(VECTORS.read_text())["cases"]
    checked = 0
    for c in cases:
        extra = c.get("extra_keys_first_block")
        if extra is not None and not (len(extra) == 1 and isinstance(extra[0], str)):
            continue  # the C ABI's hash params carry a salt only
        got = oc.chunk_hashes(c["token_ids"], c["block_size"], seed=c["python_hash_seed"],
                              salt=extra[0] if extra else None)
        assert [h.hex() for h in got] == c["block_hashes"]
        checked += 1
    assert checked >= 3


def test_unknown_setting_is_a_config_error_naming_it(tmp_path):
    with pytest.raises(oc.ConfigError) as e:
        oc.Engine(store=str(tmp_path), windw_bytes=1)
    assert e.value.name == "OBJECTCACHE_ERR_CONFIG"
    assert e.value.code == 8
    assert "windw_bytes" in e.value.message and "window_bytes" in e.value.message
    with pytest.raises(oc.ConfigError, match="gather_streams"):
        oc.Engine(store=str(tmp_path), gather_streams=17)
    # Python values are passed as the library's strings.
    oc.Engine(store=str(tmp_path), gather=False, load_timeout_ms=500).close()


def test_config_keys_are_the_librarys(tmp_path):
    """CONFIG_KEYS (which the vLLM connector uses to route kv_connector_extra_config; read
    from the library's objectcache_config_keys) lists exactly the settings the library's
    parser knows: its refusal of an unknown key names them all, in the same order."""
    with pytest.raises(oc.ConfigError) as e:
        oc.Engine(store=str(tmp_path), no_such_setting=1)
    known = e.value.message.split("known settings: ", 1)[1]
    assert [k.strip() for k in known.split(",")] == list(oc.CONFIG_KEYS)
    assert oc.CONFIG_KEYS[:2] == ("store", "namespace") and "gather" in oc.CONFIG_KEYS


def test_cpus_pins_the_engines_threads(tmp_path):
    """``cpus`` pins the engine's own threads (named ``objectcache``) and leaves the caller's
    thread alone; a malformed list is a ConfigError naming ``cpus``.

    Each runtime thread names and pins itself as it starts, which may be just after the
    constructor returns, so the test looks until both workers have done so (10 s at most)."""
    mine = os.sched_getaffinity(0)
    cpu = max(mine)

    def engine_threads():
        found = []
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    name = f.read().strip()
                if name.startswith("objectcache"):
                    found.append(os.sched_getaffinity(int(tid)))
            except OSError:
                continue  # the thread ended meanwhile
        return found

    with oc.Engine(store=str(tmp_path), cpus=str(cpu), worker_threads=2):
        deadline = time.monotonic() + 10
        pinned = engine_threads()
        while time.monotonic() < deadline and not (
            len(pinned) >= 2 and all(p == {cpu} for p in pinned)
        ):
            time.sleep(0.01)
            pinned = engine_threads()
        assert len(pinned) >= 2, "the engine's runtime threads"
        assert all(p == {cpu} for p in pinned), pinned
        assert os.sched_getaffinity(0) == mine
    with pytest.raises(oc.ConfigError, match="cpus"):
        oc.Engine(store=str(tmp_path), cpus="1-x")


def test_bad_geometry_is_refused_by_the_library():
    with pytest.raises(oc.InvalidArgumentError) as e:
        geometry(layers=0).slice_bytes
    assert e.value.name == "OBJECTCACHE_ERR_INVALID_ARGUMENT"
    assert "layers" in e.value.message
    with pytest.raises(ValueError, match="dtype"):
        oc.Geometry("m", 1, 1, 1, dtype="int4")
    assert geometry().slice_bytes == 2 * 32 * 4 * 16 * 2


def test_save_lookup_load_round_trip_byte_for_byte(eng):
    g = geometry()
    hashes, layers = saved_prefix(eng, g, 3, seed=1)
    assert eng.lookup(g, hashes) == 3
    toks = tokens(3 * 32 + 5, 1)  # same first 3 chunks, a partial tail
    assert eng.lookup_tokens(g, toks) == 3
    assert eng.lookup(g, hashes[:2] + [b"\x01" * 32]) == 2
    # Saving again writes nothing new.
    assert eng.save(g, hashes, layers).already_present == 3

    dst = bytearray(g.layers * 3 * g.slice_bytes)
    with eng.register(dst) as region:
        assert region.length == len(dst)
        with eng.load(g, hashes, split_layers(dst, g, 3), request_id=77) as t:
            for l in range(g.layers):
                assert t.wait_layer(l, timeout_s=30)
                per = 3 * g.slice_bytes
                assert bytes(dst[l * per:(l + 1) * per]) == layers[l], f"layer {l}"
            assert t.wait_all(timeout_s=30)
            assert t.chunk_status() == [oc.ChunkStatus.OK] * 3
            st = t.stats()
            assert st.request_id == 77 and st.layers_ready == g.layers
            assert st.bytes == g.layers * 3 * g.slice_bytes
            assert 0 <= st.ttfl_s <= st.ttll_s
            # The compute model's layer count must be the load's (SmolLM2 has 30).
            with pytest.raises(oc.InvalidArgumentError, match="layer"):
                t.stall_advice("smollm2-135m", "h100", load_tokens=96, new_tokens=16)
    m = eng.metrics()
    assert m.loads == 1 and m.saves >= 1 and m.registered_regions == 0
    assert m.live_transfers == 0
    # A local store is not self-checked (only S3 and gateway stores are).
    assert eng.store_mode() == "not_checked"


def test_a_hash_of_the_wrong_length_for_hash_algo_is_refused_by_name(eng, tmp_path):
    g = geometry()
    layers = [bytes(g.slice_bytes)] * g.layers
    # sha256cbor (the default) keys 32-byte hashes; 5 bytes would be stored beside vLLM's.
    for call in (lambda: eng.save(g, [b"x" * 5], layers), lambda: eng.lookup(g, [b"x" * 5])):
        with pytest.raises(oc.InvalidArgumentError, match="chunk hash 0 has 5 bytes.*sha256cbor"):
            call()
    assert data_objects(tmp_path / "store") == []
    dst = bytearray(g.layers * g.slice_bytes)
    with eng.register(dst):
        with pytest.raises(oc.InvalidArgumentError, match="has 5 bytes"):
            eng.load(g, [b"x" * 5], split_layers(dst, g, 1))
    # An engine's own hashes (1 to 64 bytes) go under hash_algo=ext.
    ext = oc.Engine(store=str(tmp_path / "ext"), namespace="pytest", hash_algo="ext")
    try:
        assert ext.save(g, [b"x" * 5], layers).written == 1
        assert ext.lookup(g, [b"x" * 5]) == 1
    finally:
        ext.close()


def test_a_complete_load_advises_waiting(eng):
    g = geometry(layers=30)
    hashes, _ = saved_prefix(eng, g, 1, seed=9)
    dst = bytearray(g.layers * g.slice_bytes)
    with eng.register(dst):
        with eng.load(g, hashes, split_layers(dst, g, 1)) as t:
            assert t.wait_all(timeout_s=30)
            adv = t.stall_advice("smollm2-135m", "h100", load_tokens=32, new_tokens=16)
            assert adv.recompute is False and adv.from_layer == 30
            assert adv.as_dict()["recompute_tokens"] == 0


def test_version_2_saves_load_in_another_engine(tmp_path):
    """save_format=v2 writes segment objects: an engine writing v2 that never looked up (as a
    vLLM worker) reads their markers and loads byte for byte; a v1 engine gets misses."""
    g = geometry()
    store = str(tmp_path / "store")
    hashes = oc.chunk_hashes(tokens(3 * g.tokens_per_chunk, 5), g.tokens_per_chunk)
    layers = kv(g, 3, 5)
    with oc.Engine(store=store, namespace="v2", save_format="v2") as writer:
        rep = writer.save(g, hashes, layers)
        assert (rep.written, rep.already_present) == (3, 0)
    segs = list((tmp_path / "store").rglob("seg/*"))
    assert len(segs) == 1 and not list((tmp_path / "store").rglob("kv/*"))
    for fmt, ok in (("v2", True), ("v1", False)):
        with oc.Engine(store=store, namespace="v2", save_format=fmt,
                       lookup_cache_ttl_ms=0) as e:
            assert e.lookup(g, hashes) == 3
            dst = bytearray(g.layers * 3 * g.slice_bytes)
            with e.register(dst), e.load(g, hashes, split_layers(dst, g, 3)) as t:
                per = 3 * g.slice_bytes
                for l in range(g.layers):
                    if ok:
                        assert t.wait_layer(l, timeout_s=30)
                        assert bytes(dst[l * per:(l + 1) * per]) == layers[l], f"layer {l}"
                    else:
                        with pytest.raises(oc.LayerMissError):
                            t.wait_layer(l, timeout_s=30)
                        assert bytes(dst[l * per:(l + 1) * per]) != layers[l]
    # A lookup in one engine hands its markers to a v1 engine that loads (vLLM's scheduler
    # and worker): one record for the one segment, then the load places the chunks.
    with oc.Engine(store=store, namespace="v2") as sched, \
            oc.Engine(store=store, namespace="v2") as worker:
        assert sched.segment_markers(g, hashes) == b""  # nothing looked up yet
        assert sched.lookup(g, hashes) == 3
        records = sched.segment_markers(g, hashes)
        assert len(records) == 72
        with pytest.raises(oc.InvalidArgumentError, match="record 0"):
            worker.add_segment_markers(g, hashes[:0] + [hashes[0]], records[:8] + b"\0" * 64)
        worker.add_segment_markers(g, hashes, records)
        dst = bytearray(g.layers * 3 * g.slice_bytes)
        with worker.register(dst), worker.load(g, hashes, split_layers(dst, g, 3)) as t:
            assert t.wait_all(timeout_s=30)
            per = 3 * g.slice_bytes
            for l in range(g.layers):
                assert bytes(dst[l * per:(l + 1) * per]) == layers[l], f"layer {l}"


def test_missing_chunk_is_a_miss_for_its_layers_never_bytes(eng):
    g = geometry()
    hashes, layers = saved_prefix(eng, g, 2, seed=2)
    absent = oc.chunk_hashes(tokens(32, 99), 32)
    dst = bytearray(g.layers * 3 * g.slice_bytes)
    with eng.register(dst):
        with eng.load(g, hashes + absent, split_layers(dst, g, 3)) as t:
            with pytest.raises(oc.LayerMissError) as e:
                t.wait_layer(0, timeout_s=30)
            assert isinstance(e.value, oc.LayerMissingError)
            assert e.value.name == "OBJECTCACHE_ERR_LAYER_MISSING"
            # The chunk at fault is named. (Chunks whose slices could not land in the layers
            # that failed are not OK either: a failed layer takes no more writes.)
            assert t.chunk_status()[2] == oc.ChunkStatus.MISSING
            for l in range(g.layers):
                with pytest.raises(oc.LayerMissingError):
                    t.wait_layer(l, timeout_s=30)


def test_corrupt_object_is_a_checksum_miss(eng, tmp_path):
    g = geometry()
    hashes, layers = saved_prefix(eng, g, 2, seed=3)
    objs = data_objects(tmp_path / "store")
    assert len(objs) == 2
    # Layer 1 of one chunk: one byte inside its slice (64-byte header, then slices + CRCs).
    target = [p for p in objs if p.endswith(hashes[1].hex())][0]
    flip_byte(target, 64 + (g.slice_bytes + 4) + 100)
    dst = bytearray(g.layers * 2 * g.slice_bytes)
    with eng.register(dst):
        with eng.load(g, hashes, split_layers(dst, g, 2)) as t:
            with pytest.raises(oc.LayerChecksumError) as e:
                t.wait_layer(1, timeout_s=30)
            assert e.value.code == 21 and "chunk 1" in e.value.message
            assert t.chunk_status()[1] == oc.ChunkStatus.CORRUPT
            # A corrupt slice is a miss for its layer only: the object's other slices were
            # verified one by one, so layers 0 and 2 are ready, byte for byte.
            per = 2 * g.slice_bytes
            for l in (0, 2):
                assert t.wait_layer(l, timeout_s=30)
                assert bytes(dst[l * per:(l + 1) * per]) == layers[l], f"layer {l}"


def test_destinations_must_be_registered_and_disjoint(eng):
    g = geometry()
    hashes, _ = saved_prefix(eng, g, 1, seed=4)
    dst = bytearray(g.layers * g.slice_bytes)
    with pytest.raises(oc.InvalidArgumentError, match="regist"):
        eng.load(g, hashes, split_layers(dst, g, 1))
    with eng.register(dst):
        same = [memoryview(dst)[: g.slice_bytes]] * g.layers
        with pytest.raises(oc.InvalidArgumentError, match="overlap"):
            eng.load(g, hashes, same)
        with pytest.raises(ValueError, match="read-only"):
            eng.load(g, hashes, [bytes(g.slice_bytes)] * g.layers)


def test_handles_close_and_release_once_and_busy_is_reported(eng):
    g = geometry()
    hashes, _ = saved_prefix(eng, g, 1, seed=5)
    dst = bytearray(g.layers * g.slice_bytes)
    region = eng.register(dst)
    t = eng.load(g, hashes, split_layers(dst, g, 1))
    with pytest.raises(oc.BusyError) as e:
        eng.close()
    assert e.value.name == "OBJECTCACHE_ERR_BUSY"
    with pytest.raises(oc.BusyError):
        region.close()
    t.release()
    t.release()  # a second release does nothing
    with pytest.raises(oc.InvalidHandleError):
        t.wait_layer(0)
    region.close()
    region.close()


def test_cancel_wakes_a_waiter_with_a_cancelled_miss(tmp_path):
    # A load from an S3 endpoint nobody answers stays pending until cancelled.
    eng = oc.Engine(store="s3://bkt/p?endpoint=http://127.0.0.1:9&max_attempts=1",
                    load_timeout_ms=60000, namespace="pytest")
    g = geometry()
    dst = bytearray(g.layers * g.slice_bytes)
    with eng.register(dst):
        t = eng.load(g, oc.chunk_hashes(tokens(32, 6), 32), split_layers(dst, g, 1))
        got = []
        th = threading.Thread(target=lambda: got.append(_wait_outcome(t, g.layers - 1)))
        th.start()
        t.cancel()
        th.join(30)
        assert got and got[0] in ("OBJECTCACHE_ERR_CANCELLED", "OBJECTCACHE_ERR_LAYER_STORAGE")
        t.release()
    eng.close()


def _wait_outcome(t, layer):
    try:
        t.wait_layer(layer, timeout_s=30)
        return "ready"
    except oc.LayerMissError as e:
        return e.name


def test_four_threads_load_at_once_on_one_engine(eng):
    g = geometry()
    hashes, layers = saved_prefix(eng, g, 4, seed=7)
    bufs = [bytearray(g.layers * 4 * g.slice_bytes) for _ in range(4)]
    regions = [eng.register(b) for b in bufs]
    errors = []

    def run(i):
        try:
            with eng.load(g, hashes, split_layers(bufs[i], g, 4), request_id=i) as t:
                assert t.wait_all(timeout_s=60)
            per = 4 * g.slice_bytes
            for l in range(g.layers):
                assert bytes(bufs[i][l * per:(l + 1) * per]) == layers[l]
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    for r in regions:
        r.close()


def test_address_pairs_and_tensors_are_memory_too(eng):
    g = geometry()
    hashes, layers = saved_prefix(eng, g, 2, seed=8)
    torch = pytest.importorskip("torch")
    dst = torch.zeros(g.layers, 2 * g.slice_bytes, dtype=torch.uint8)
    with eng.register(dst):
        per = 2 * g.slice_bytes
        base = dst.data_ptr()
        with eng.load(g, hashes, [(base + l * per, per) for l in range(g.layers)]) as t:
            assert t.wait_all(timeout_s=30)
        for l in range(g.layers):
            assert bytes(dst[l].numpy().tobytes()) == layers[l]


# ---- Paged KV and engine layouts (objectcache_load_paged / objectcache_save_paged) ---------

def block_pool(g, n_blocks, blocks_per_chunk):
    """A pool of engine blocks per layer, as an engine keeps KV: one buffer, layer-major,
    blocks of slice_bytes / blocks_per_chunk bytes."""
    per_block = g.slice_bytes // blocks_per_chunk
    return bytearray(g.layers * n_blocks * per_block), per_block


def block_ranges(pool, g, n_blocks, per_block, block_ids):
    """Per layer, the (address, length) ranges of these blocks of the pool, in order."""
    import ctypes
    base = ctypes.addressof((ctypes.c_char * len(pool)).from_buffer(pool))
    return [[(base + (l * n_blocks + b) * per_block, per_block) for b in block_ids]
            for l in range(g.layers)]


def test_paged_save_and_load_between_scattered_blocks(eng):
    # 2 blocks of 16 tokens per 32-token chunk; 3 chunks; an engine pool of 20 blocks.
    g = geometry(layout="pytest/paged", block_size=16)
    hashes = oc.chunk_hashes(tokens(96, 21), 32)
    src, per_block = block_pool(g, 20, 2)
    import random
    random.Random(5).shuffle(ids := list(range(20)))
    src[:] = random.Random(6).randbytes(len(src))
    save_ids = ids[:6]
    rep = eng.save(g, hashes, block_ranges(src, g, 20, per_block, save_ids))
    assert rep.written == 3
    assert eng.lookup(g, hashes) == 3
    dst, _ = block_pool(g, 20, 2)
    load_ids = ids[10:16]
    with eng.register(dst):
        with eng.load(g, hashes, block_ranges(dst, g, 20, per_block, load_ids)) as t:
            assert t.wait_all(timeout_s=30)
    for l in range(g.layers):
        for s_id, d_id in zip(save_ids, load_ids):
            a = (l * 20 + s_id) * per_block
            b = (l * 20 + d_id) * per_block
            assert dst[b:b + per_block] == src[a:a + per_block], (l, s_id, d_id)
    # Blocks outside the load are untouched.
    untouched = [b for b in range(20) if b not in load_ids]
    assert all(not any(dst[(l * 20 + b) * per_block:(l * 20 + b + 1) * per_block])
               for l in range(g.layers) for b in untouched)


def test_another_layout_is_a_miss_never_bytes(eng):
    g = geometry(layout="pytest/layout-a", block_size=16)
    hashes, layers = saved_prefix(eng, g, 2, seed=22)
    assert eng.lookup(g, hashes) == 2
    other = geometry(layout="pytest/layout-b", block_size=16)
    assert eng.lookup(other, hashes) == 0
    assert eng.lookup(geometry(layout="pytest/layout-a", block_size=32), hashes) == 0
    assert eng.lookup(geometry(), hashes) == 0  # no layout: ObjectCache's canonical one


def test_overlapping_paged_destinations_are_refused(eng):
    g = geometry(layout="pytest/paged", block_size=16)
    hashes, _ = saved_prefix(eng, g, 1, seed=23)
    dst, per_block = block_pool(g, 4, 2)
    with eng.register(dst):
        rs = block_ranges(dst, g, 4, per_block, [0, 0])
        with pytest.raises(oc.InvalidArgumentError, match="overlap"):
            eng.load(g, hashes, rs)
        short = block_ranges(dst, g, 4, per_block, [0])
        with pytest.raises(oc.InvalidArgumentError):
            eng.load(g, hashes, short)


def test_tenant_salts_separate_entries_c15(eng, tmp_path):
    # C15 through the Python package: the same 4,096-token prompt under two cache salts.
    g = geometry(tokens_per_chunk=256)
    toks = tokens(4096, 31)
    ha = oc.chunk_hashes(toks, 256, salt="tenant-a")
    hb = oc.chunk_hashes(toks, 256, salt="tenant-b")
    assert len(ha) == len(hb) == 16 and not set(ha) & set(hb)
    eng.save(g, ha, kv(g, 16, 31))
    assert eng.lookup_tokens(g, toks, salt="tenant-b") == 0
    assert eng.lookup(g, hb) == 0
    assert eng.lookup_tokens(g, toks, salt="tenant-a") == 16  # the positive control
    stored = {pathlib.Path(p).name for p in data_objects(tmp_path / "store")}
    assert stored == {h.hex() for h in ha}


def test_engine_layout_is_a_typed_value_the_library_resolves():
    """oc.EngineLayout (objectcache_engine_layout): the library names the layout as the vLLM
    connector named it before (existing keys stay valid), gives the block bytes and the
    geometry, stores MLA once for every rank, and refuses recurrent state by name."""
    el = oc.EngineLayout("vllm0.32/cpu-amx", "LBHNC", "paged_kv", kv_heads=3, head_dim=64,
                         block_size=128, dtype="bf16")
    r = el.resolve(1)
    assert r == {"name": "vllm0.32/cpu-amx/LBHNC", "block_bytes": 2 * 128 * 3 * 64 * 2,
                 "kv_heads": 3, "head_dim": 64, "stored_once": False}
    g = el.geometry("m", layers=30, tokens_per_chunk=128)
    assert g.layout == r["name"] and g.slice_bytes == r["block_bytes"]
    mla = oc.EngineLayout("vllm0.32/cpu-amx", "LBHNC", "mla", latent_dim=576, block_size=128)
    g = mla.geometry("deepseek", layers=4, tokens_per_chunk=256, tp_rank=1, tp_world=2)
    assert (g.tp_rank, g.tp_world, g.layout) == (0, 1, "vllm0.32/cpu-amx/LBHNC/mla576")
    assert g.slice_bytes == 256 * 576 * 2
    swa = oc.EngineLayout("vllm0.32/cpu-amx", "LBHNC", "paged_kv", kv_heads=2, head_dim=64,
                          block_size=128, group_count=6, group_index=0,
                          group_kind="sliding_window", window=512, structure="1a2b3c4d")
    assert swa.resolve()["name"] == "vllm0.32/cpu-amx/LBHNC/g0of6-swa512-1a2b3c4d"
    with pytest.raises(oc.UnsupportedError, match="recurrent"):
        oc.EngineLayout("vllm0.32/cpu-amx", "LBHNC", "recurrent", block_size=128).resolve()
    with pytest.raises(oc.InvalidArgumentError, match="575"):
        oc.EngineLayout("e/x", "o", "mla", latent_dim=575, block_size=16).resolve()
    with pytest.raises(ValueError, match="family"):
        oc.EngineLayout("e", "o", "mamba")
