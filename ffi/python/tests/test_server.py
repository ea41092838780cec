"""The `objectcache` package against our server (`objectcache serve`, a real process): loads
through gather and through ranged GETs (gather off) land the same bytes; corruption in the
server's store is a checksum miss; a stopped server is a storage miss, never bytes."""

import subprocess

import pytest

import objectcache as oc
from conftest import ACCESS, BUCKET, SECRET, _server_binary
from kvutil import data_objects, flip_byte, geometry, kv, split_layers, tokens


def round_trip(eng, g, n_chunks, seed):
    hashes = oc.chunk_hashes(tokens(n_chunks * g.tokens_per_chunk, seed), g.tokens_per_chunk)
    layers = kv(g, n_chunks, seed)
    assert eng.save(g, hashes, layers).written == n_chunks
    assert eng.lookup(g, hashes) == n_chunks
    dst = bytearray(g.layers * n_chunks * g.slice_bytes)
    with eng.register(dst):
        with eng.load(g, hashes, split_layers(dst, g, n_chunks)) as t:
            assert t.wait_all(timeout_s=60)
            stats = t.stats()
    per = n_chunks * g.slice_bytes
    for l in range(g.layers):
        assert bytes(dst[l * per:(l + 1) * per]) == layers[l], f"layer {l}"
    return hashes, stats


@pytest.mark.parametrize("gather", ["auto", "off"])
def test_round_trip_through_the_server(server, gather):
    g = geometry(model=f"pytest/server-{gather}")
    with oc.Engine(store=server.url(f"rt-{gather}"), namespace="pytest", gather=gather) as eng:
        _, stats = round_trip(eng, g, 4, seed=11)
        if gather == "off":
            # Ranged GETs: at least one request per chunk (layer 0 with the header).
            assert stats.requests >= 4
        else:
            # Gather: the load's chunks in one request per stream (2 by default).
            assert 1 <= stats.requests <= 2


def test_corruption_on_the_server_is_a_checksum_miss(server):
    g = geometry(model="pytest/server-corrupt")
    with oc.Engine(store=server.url("corrupt"), namespace="pytest") as eng:
        hashes, _ = round_trip(eng, g, 2, seed=12)
        target = [p for p in data_objects(server.store_dir) if p.endswith(hashes[0].hex())]
        assert len(target) == 1
        flip_byte(target[0], 64 + 2 * (g.slice_bytes + 4) + 7)  # layer 2 of chunk 0
        dst = bytearray(g.layers * 2 * g.slice_bytes)
        with eng.register(dst):
            with eng.load(g, hashes, split_layers(dst, g, 2)) as t:
                assert t.wait_layer(0, timeout_s=30) and t.wait_layer(1, timeout_s=30)
                with pytest.raises(oc.LayerChecksumError):
                    t.wait_layer(2, timeout_s=30)
                assert t.chunk_status()[0] == oc.ChunkStatus.CORRUPT


def test_a_stopped_server_is_a_miss_never_bytes(tmp_path):
    binary = _server_binary()
    if not binary.is_file():
        pytest.skip("no server binary")
    proc = subprocess.Popen(
        [str(binary), "serve", "--listen", "127.0.0.1:0", "--bucket", BUCKET,
         "--store", str(tmp_path), "--access-key", f"{ACCESS}:{SECRET}",
         "--shutdown-grace-secs", "0"],
        stdout=subprocess.PIPE,
    )
    addr = proc.stdout.readline().decode().strip().rsplit(" ", 1)[-1]
    url = (f"s3://{BUCKET}/stop?endpoint=http://{addr}&region=us-east-1&addressing=path"
           "&max_attempts=1")
    g = geometry(model="pytest/server-stop")
    import os
    os.environ.update(AWS_ACCESS_KEY_ID=ACCESS, AWS_SECRET_ACCESS_KEY=SECRET,
                      AWS_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true")
    with oc.Engine(store=url, namespace="pytest", load_timeout_ms=10000,
                   lookup_cache_ttl_ms=0) as eng:
        hashes = oc.chunk_hashes(tokens(64, 13), 32)
        eng.save(g, hashes, kv(g, 2, 13))
        proc.terminate()
        proc.wait(timeout=30)
        # A lookup against a dead server fails (the caller treats it as no hit) ...
        with pytest.raises(oc.ObjectCacheError):
            eng.lookup(g, hashes)
        # ... and a load is a miss for every layer.
        dst = bytearray(g.layers * 2 * g.slice_bytes)
        with eng.register(dst):
            with eng.load(g, hashes, split_layers(dst, g, 2)) as t:
                with pytest.raises(oc.LayerMissError) as e:
                    t.wait_layer(0, timeout_s=30)
                assert e.value.name in ("OBJECTCACHE_ERR_LAYER_STORAGE",
                                        "OBJECTCACHE_ERR_LAYER_TIMEOUT")
        assert not any(dst)
