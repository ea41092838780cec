#!/usr/bin/env python3
"""NIXL OBJ peer of `objectcache-bench ttft --mode modeled`.

Reads KV chunk objects from an S3 endpoint (the ObjectCache server) with NIXL's own OBJ
backend plugin, as an inference engine's NIXL storage backend would: host (DRAM) buffers, one
OBJ descriptor per whole chunk object, one READ transfer, polled until done.

Input (JSON on stdin):
  {"endpoint": "http://127.0.0.1:PORT", "bucket": "...", "access_key": "...",
   "secret_key": "...", "region": "us-east-1", "keys": ["obj key", ...],
   "object_bytes": N, "runs": R, "timeout_s": T}
(R timed READ transfers after one untimed warm-up transfer.)
Output (one JSON object on stdout):
  {"ok": true, "load_s": [seconds per run], "bytes": total bytes per run,
   "objects": count, "sha256_first": hex digest of the first object as read,
   "nixl_version": "..."}
or {"ok": false, "why": "..."} when NIXL or its OBJ plugin cannot run here (exit code 0; the
benchmark then skips the method and prints the reason). Exit code 2 on bad input.

Needs the nixl-cu12 wheel and numpy in the interpreter's environment:
  python3 -m venv V && V/bin/pip install --no-deps nixl-cu12 && V/bin/pip install numpy
"""
import hashlib
import json
import sys
import time


def out(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main():
    try:
        req = json.load(sys.stdin)
        keys = list(req["keys"])
        size = int(req["object_bytes"])
        runs = max(1, int(req.get("runs", 1)))
        timeout_s = float(req.get("timeout_s", 120))
    except (ValueError, KeyError, TypeError) as e:
        sys.stderr.write(f"nixl_obj_load: bad input: {e}\n")
        return 2
    if not keys or size <= 0:
        sys.stderr.write("nixl_obj_load: no keys or object_bytes <= 0\n")
        return 2
    try:
        import numpy as np
    except ImportError as e:
        out({"ok": False, "why": f"numpy is not importable: {e}"})
        return 0
    try:
        from nixl_cu12 import nixl_agent, nixl_agent_config
    except ImportError:
        try:
            from nixl import nixl_agent, nixl_agent_config
        except ImportError as e:
            out({"ok": False, "why": f"NIXL's Python agent is not importable: {e}"})
            return 0
    version = "unknown"
    try:
        from importlib.metadata import version as _v
        for name in ("nixl-cu12", "nixl"):
            try:
                version = f"{name} {_v(name)}"
                break
            except Exception:
                pass
    except ImportError:
        pass
    try:
        agent = nixl_agent("objectcache-bench-nixl", nixl_agent_config(backends=[]))
        plugins = agent.get_plugin_list()
        if "OBJ" not in plugins:
            out({"ok": False, "why": f"NIXL has no OBJ plugin here (plugins: {plugins})"})
            return 0
        endpoint = req["endpoint"]
        scheme, _, hostport = endpoint.partition("://")
        agent.create_backend(
            "OBJ",
            {
                "bucket": req["bucket"],
                "endpoint_override": hostport if hostport else endpoint,
                "scheme": scheme if hostport else "http",
                "access_key": req["access_key"],
                "secret_key": req["secret_key"],
                "region": req.get("region", "us-east-1"),
                "use_virtual_addressing": "false",
            },
        )
    except Exception as e:
        out({"ok": False, "why": f"creating NIXL's OBJ backend failed: {type(e).__name__}: {e}"})
        return 0
    n = len(keys)
    buf = np.zeros(n * size, dtype=np.uint8)
    buf[::4096] = 1  # touch every page before timing
    base = buf.ctypes.data
    try:
        local_reg = agent.register_memory([(base, n * size, 0, "")], "DRAM")
        obj_reg = agent.register_memory([(0, size, i, k) for i, k in enumerate(keys)], "OBJ")
        local = agent.get_xfer_descs([(base + i * size, size, 0) for i in range(n)], "DRAM")
        remote = agent.get_xfer_descs([(0, size, i) for i in range(n)], "OBJ")
    except Exception as e:
        out({"ok": False, "why": f"registering memory with NIXL failed: {type(e).__name__}: {e}"})
        return 0
    times = []
    # Run 0 is a warm-up (connection set-up of the plugin's S3 client), not reported.
    for r in range(runs + 1):
        try:
            h = agent.initialize_xfer("READ", local, remote, agent.name)
            t0 = time.perf_counter()
            state = agent.transfer(h)
            deadline = t0 + timeout_s
            while state == "PROC" and time.perf_counter() < deadline:
                state = agent.check_xfer_state(h)
            dt = time.perf_counter() - t0
            agent.release_xfer_handle(h)
        except Exception as e:
            out({"ok": False, "why": f"NIXL OBJ READ failed: {type(e).__name__}: {e}"})
            return 0
        if state != "DONE":
            out({"ok": False, "why": f"NIXL OBJ READ ended in state {state} (run {r})"})
            return 0
        if r > 0:
            times.append(dt)
    digest = hashlib.sha256(buf[:size].tobytes()).hexdigest()
    try:
        agent.deregister_memory(obj_reg)
        agent.deregister_memory(local_reg)
    except Exception:
        pass
    out({"ok": True, "load_s": times, "bytes": n * size, "objects": n,
         "sha256_first": digest, "nixl_version": version})
    return 0


if __name__ == "__main__":
    sys.exit(main())
