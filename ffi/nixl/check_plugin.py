#!/usr/bin/env python3
"""Loads libplugin_OBJECTCACHE.so into NIXL's own Python agent and runs a write, an existence
query, and a layer-by-layer read through it, comparing bytes. See docs/nixl.md.

    NIXL_PLUGIN_DIR=ffi/nixl python3 ffi/nixl/check_plugin.py STORE_DIR
    NIXL_PLUGIN_DIR=ffi/nixl python3 ffi/nixl/check_plugin.py --saved SPEC.json

The second form reads, layer by layer, a chunk set that something else saved (the Rust
API, in `tests/integration/nixl_plugin.rs`): SPEC.json names the store URL, namespace,
geometry, the chunk hashes (hex) and a file holding each chunk's expected layer-major payload,
chunk after chunk. It checks that every layer's notification arrives, in layer order, and
that every byte matches.

Needs the nixl-cu12 wheel (1.5.1; `pip install --no-deps nixl-cu12==1.5.1 numpy` works on a
CPU-only machine). Prints "nixl_plugin: N passed, M failed"; exits non-zero on a failure.
"""
import sys
import time

import numpy as np

try:
    from nixl_cu12 import nixl_agent, nixl_agent_config
except ImportError:  # the CUDA 13 wheel, or a source build
    from nixl import nixl_agent, nixl_agent_config

LAYERS, KV_HEADS, HEAD_DIM, TOKENS = 4, 2, 8, 16
SLICE = 2 * TOKENS * KV_HEADS * HEAD_DIM * 2  # K and V, bf16: bytes of one chunk's one layer
CHUNK = LAYERS * SLICE
passed = failed = 0


def check(cond, what):
    global passed, failed
    if cond:
        passed += 1
    else:
        failed += 1
        print(f"FAIL: {what}", file=sys.stderr)


def wait(agent, handle, what):
    deadline = time.monotonic() + 60
    try:
        state = agent.transfer(handle)
        while state == "PROC" and time.monotonic() < deadline:
            time.sleep(0.001)
            state = agent.check_xfer_state(handle)
    except Exception as e:  # the bindings raise on error statuses
        print(f"{what}: ERR ({type(e).__name__}: {e})")
        return "ERR"
    print(f"{what}: {state}")
    return state


def main():
    store = sys.argv[1]
    agent = nixl_agent("objectcache-check", nixl_agent_config(backends=[]))
    check("OBJECTCACHE" in agent.get_plugin_list(), f"plugin listed: {agent.get_plugin_list()}")
    agent.create_backend(
        "OBJECTCACHE",
        {
            "store": store,
            "namespace": "nixl-check",
            "model": "test/nixl-tiny",
            "layers": str(LAYERS),
            "kv_heads": str(KV_HEADS),
            "head_dim": str(HEAD_DIM),
            "dtype": "bf16",
            "tokens_per_chunk": str(TOKENS),
        },
    )
    mems = agent.get_backend_mem_types("OBJECTCACHE")
    check("DRAM_SEG" in mems and "OBJ_SEG" in mems, f"memory kinds {mems}")

    hashes = [bytes([c + 1]) * 32 for c in range(3)]  # chunk 2 is never written
    rng = np.random.default_rng(7)
    src = rng.integers(0, 256, size=2 * CHUNK, dtype=np.uint8)  # 2 chunks, layer-major each
    dst = np.zeros(LAYERS * 2 * SLICE, dtype=np.uint8)  # per layer: chunk 0, chunk 1
    agent.register_memory([(src.ctypes.data, src.nbytes, 0, ""), (dst.ctypes.data, dst.nbytes, 0, "")], "DRAM")
    agent.register_memory([(0, CHUNK, c + 1, h.hex()) for c, h in enumerate(hashes)], "OBJ")

    # Write: each chunk whole, from its own part of src.
    local = agent.get_xfer_descs([(src.ctypes.data + c * CHUNK, CHUNK, 0) for c in range(2)], "DRAM")
    remote = agent.get_xfer_descs([(0, CHUNK, c + 1) for c in range(2)], "OBJ")
    h = agent.initialize_xfer("WRITE", local, remote, agent.name, b"saved")
    check(wait(agent, h, "write") == "DONE", "write completes")
    agent.release_xfer_handle(h)

    # queryMem: chunks 0 and 1 exist, chunk 2 does not.
    q = agent.query_memory([(0, CHUNK, c + 1, h.hex()) for c, h in enumerate(hashes)], "OBJECTCACHE", "OBJ")
    print(f"queryMem: {q}")
    check(q[0] is not None and q[1] is not None and q[2] is None, f"queryMem {q}")

    # Read layer by layer: descriptor (chunk c, layer l) -> dst[l][c].
    pairs = [(c, l) for l in range(LAYERS) for c in range(2)]
    local = agent.get_xfer_descs([(dst.ctypes.data + (l * 2 + c) * SLICE, SLICE, 0) for c, l in pairs], "DRAM")
    remote = agent.get_xfer_descs([(l * SLICE, SLICE, c + 1) for c, l in pairs], "OBJ")
    h = agent.initialize_xfer("READ", local, remote, agent.name, b"req7")
    check(wait(agent, h, "read") == "DONE", "read completes")
    for c, l in pairs:
        got = dst[(l * 2 + c) * SLICE:(l * 2 + c + 1) * SLICE]
        want = src[c * CHUNK + l * SLICE:c * CHUNK + (l + 1) * SLICE]
        check(np.array_equal(got, want), f"chunk {c} layer {l} bytes")
    # NIXL polls only remote-capable backends for notifications unless one is named.
    notifs = [m.decode() for ms in agent.get_new_notifs(["OBJECTCACHE"]).values() for m in ms]
    print(f"notifications: {notifs}")
    for l in range(LAYERS):
        check(f"req7:layer:{l}" in notifs, f"layer {l} notification")
    check("req7" in notifs and "saved" in notifs, "completion notifications")
    agent.release_xfer_handle(h)

    # Read chunk 1 whole (one descriptor spanning every layer), without a notification.
    whole = np.zeros(CHUNK, dtype=np.uint8)
    agent.register_memory([(whole.ctypes.data, whole.nbytes, 0, "")], "DRAM")
    local = agent.get_xfer_descs([(whole.ctypes.data, CHUNK, 0)], "DRAM")
    remote = agent.get_xfer_descs([(0, CHUNK, 2)], "OBJ")
    h = agent.initialize_xfer("READ", local, remote, agent.name)
    check(wait(agent, h, "whole-chunk read") == "DONE", "whole-chunk read completes")
    check(np.array_equal(whole, src[CHUNK:]), "whole chunk 1 bytes")
    agent.release_xfer_handle(h)

    # A read of a chunk that was never written is an error, not bytes.
    dst[:] = 0
    local = agent.get_xfer_descs([(dst.ctypes.data, CHUNK, 0)], "DRAM")
    remote = agent.get_xfer_descs([(0, CHUNK, 3)], "OBJ")
    h = agent.initialize_xfer("READ", local, remote, agent.name)
    check(wait(agent, h, "read of a missing chunk") == "ERR", "missing chunk fails")
    check(not dst.any(), "no bytes written for a miss")
    agent.release_xfer_handle(h)

    print(f"nixl_plugin: {passed} passed, {failed} failed")
    return 1 if failed else 0


def read_saved(spec_path):
    """The --saved form (see the module documentation)."""
    import json

    spec = json.load(open(spec_path))
    layers, n = int(spec["layers"]), len(spec["hashes"])
    payload = np.fromfile(spec["payload"], dtype=np.uint8)
    chunk = payload.nbytes // n
    slice_len = chunk // layers
    agent = nixl_agent("objectcache-saved", nixl_agent_config(backends=[]))
    params = {k: str(spec[k]) for k in ("store", "namespace", "model", "layers", "kv_heads",
                                        "head_dim", "dtype", "tokens_per_chunk")}
    agent.create_backend("OBJECTCACHE", params)
    dst = np.zeros(layers * n * slice_len, dtype=np.uint8)  # per layer: chunk 0, 1, ...
    agent.register_memory([(dst.ctypes.data, dst.nbytes, 0, "")], "DRAM")
    agent.register_memory([(0, chunk, c + 1, h) for c, h in enumerate(spec["hashes"])], "OBJ")
    pairs = [(c, l) for l in range(layers) for c in range(n)]
    local = agent.get_xfer_descs(
        [(dst.ctypes.data + (l * n + c) * slice_len, slice_len, 0) for c, l in pairs], "DRAM")
    remote = agent.get_xfer_descs([(l * slice_len, slice_len, c + 1) for c, l in pairs], "OBJ")
    h = agent.initialize_xfer("READ", local, remote, agent.name, b"saved-read")
    # Notifications as they arrive, polled while the transfer runs.
    arrived = []
    state = agent.transfer(h)
    deadline = time.monotonic() + 60
    while True:
        for ms in agent.get_new_notifs(["OBJECTCACHE"]).values():
            arrived += [m.decode() for m in ms]
        if state != "PROC" or time.monotonic() > deadline:
            break
        time.sleep(0.0005)
        state = agent.check_xfer_state(h)
    for ms in agent.get_new_notifs(["OBJECTCACHE"]).values():
        arrived += [m.decode() for m in ms]
    check(state == "DONE", f"read of the saved chunks: {state}")
    got = [int(m.rsplit(":", 1)[1]) for m in arrived if m.startswith("saved-read:layer:")]
    print(f"layer notifications in arrival order: {got}")
    check(got == list(range(layers)), f"one notification per layer, in layer order: {got}")
    check("saved-read" in arrived, "completion notification")
    for c, l in pairs:
        have = dst[(l * n + c) * slice_len:(l * n + c + 1) * slice_len]
        want = payload[c * chunk + l * slice_len:c * chunk + (l + 1) * slice_len]
        check(np.array_equal(have, want), f"chunk {c} layer {l} bytes")
    agent.release_xfer_handle(h)
    print(f"nixl_plugin saved-read: {passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--saved":
        sys.exit(read_saved(sys.argv[2]))
    sys.exit(main())
