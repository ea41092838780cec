"""The connector with the model families people serve, in a real vLLM (0.32, CPU), on small
models of each architecture with seeded random weights (scripts/vllm-tiny-models.py; the
model folders are $OBJECTCACHE_VLLM_MODELS/<name>).

For each family that runs: a replica without the connector computes the references (each
prompt in full, and B after A through vLLM's own prefix cache); a replica with the
connector (its own prefix cache off) serves A (a document and a question) and saves its
chunks, then B (the same document, another question), which can only hit the store, and B
under a cache salt nobody saved (its own full computation). Where the saver's layout differs
from the loader's (MLA saved at TP 2, loaded at TP 1), two replicas. Checked: different prompts give different outputs (the weights are
not degenerate), B's external hit tokens, B's output equal to the engine's own full
computation, to vLLM without the connector and to vLLM's own prefix cache, the bytes loaded
equal to what the family's rule predicts (printed), and, after one stored object is
corrupted, B still gives the same output.

Families:
* ``gemma3-tiny``: Gemma 3 style, sliding window (512 tokens) on 5 of 6 layers, through
  vLLM's hybrid KV cache manager: the full-attention groups load every hit chunk, each
  sliding-window group only the chunks inside its window at the end of the hit.
* ``gptoss-tiny``: gpt-oss style, sliding window (128 tokens) and full attention
  alternating, attention sinks, MoE: the same rule, one chunk per sliding-window group.
* ``qwen3next-tiny``: recurrent state (gated DeltaNet): the connector refuses to start,
  naming the model and the reason.
"""

import json
import os
import pathlib
import re

import pytest

from conftest import missing
from kvutil import data_objects, flip_byte
from vllm_util import BLOCK, Replica, _model, assert_same_tokens

MAX_TOKENS = 8


def models_dir():
    _model()  # vLLM importable, else skip/fail
    d = os.environ.get("OBJECTCACHE_VLLM_MODELS")
    if not d:
        d = str(pathlib.Path(os.environ["OBJECTCACHE_VLLM_MODEL"]).parent)
    return pathlib.Path(d)


def tiny_model(name):
    p = models_dir() / name
    if not (p / "config.json").is_file():
        missing(f"no model {name} under {p.parent} (run scripts/vllm-tiny-models.py)")
    return str(p)


@pytest.fixture(scope="module")
def logdir(tmp_path_factory):
    d = os.environ.get("OBJECTCACHE_VLLM_TEST_LOGS")
    if d:
        p = pathlib.Path(d)
        p.mkdir(parents=True, exist_ok=True)
        return p
    return tmp_path_factory.mktemp("vllm-model-logs")


def document(tag, items):
    lines = [f"Inventory {tag}."]
    for i in range(items):
        lines.append(f"Row {i}: crate {(i * 13) % 97} holds {(i * 7) % 50 + 3} kg of "
                     f"{['bolts', 'cable', 'seed', 'paint', 'glass'][i % 5]} from dock "
                     f"{i % 9}, checked by team {chr(65 + i % 7)} on day {2 + i}.")
    return "\n".join(lines)


def ask(doc, q):
    return f"{doc}\n\nQuestion: {q}\nAnswer:"


def _trace(path):
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            i = line.find("{")
            if line.startswith("objectcache-trace") and i >= 0:
                out.append(json.loads(line[i:]))
    return out


def gen(r, prompt, salt=None):
    return r.call({"op": "generate", "max_tokens": MAX_TOKENS, "logprobs": 5,
                   "prompts": [{"prompt": prompt, "cache_salt": salt}]})["outputs"][0]


def connector(store, **extra):
    return {"kv_connector": "ObjectCacheConnector",
            "kv_connector_module_path": "objectcache.vllm", "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"store": store, "namespace": "vllm-models",
                                          # B follows A's save in the same replica, within
                                          # lookup_cache_ttl_ms of A's lookup: the
                                          # scheduler's engine knows the worker's save at
                                          # once (one lookup cache per process and store).
                                          **extra}}


@pytest.mark.parametrize("name", ["gemma3-tiny", "gptoss-tiny"])
def test_sliding_window_loads_only_the_window(name, tmp_path, logdir):
    """Sliding-window hybrids with vLLM's hybrid KV cache manager: Gemma 3 style (window
    512, 5 sliding-window layers to 1 full) and gpt-oss style (window 128, alternating, with
    attention sinks and MoE). B's hit loads every chunk for the full-attention layers and,
    for each sliding-window group, the chunks holding the window at the end of the hit
    (window / 128 of them); the output is the engine's own full computation, vLLM's without
    the connector, and vLLM's own prefix cache's."""
    model = tiny_model(name)
    tag = name.split("-")[0]
    cfg = json.loads((pathlib.Path(model) / "config.json").read_text())
    store = "file://" + str(tmp_path / "store")
    doc = document(tag, 60)
    a, b = ask(doc, "Which dock is busiest?"), ask(doc, "What does crate 12 hold?")
    others = [ask(document("other", 20), "Who checked row 3?"), "List three colours:"]
    extra = {"dtype": "float32", "max_model_len": 8192}

    base = Replica(f"{tag}-base", logdir, model, apc=True, extra=extra)
    try:
        ref_b = gen(base, b, salt="full-b")
        outs = [gen(base, p) for p in others]
        gen(base, a, salt="probe")
        apc_b = gen(base, b, salt="probe")
        assert apc_b["num_cached_tokens"] > 0
    finally:
        base.close()
    texts = {ref_b["text"]} | {o["text"] for o in outs}
    print(f"{name} without the connector: {[ref_b['text']] + [o['text'] for o in outs]}")
    assert len(texts) == 3, f"different prompts gave the same output: {texts}"
    assert_same_tokens(apc_b, ref_b, "vLLM's own prefix cache vs full")

    # One replica with the connector saves A and then loads B (its own prefix cache is off,
    # so B's hit can only come from the store).
    trace_path = logdir / f"{tag}-loader.trace"
    trace_path.unlink(missing_ok=True)
    loader = Replica(f"{tag}-loader", logdir, model, kv_transfer_config=connector(store),
                     extra=extra, env={"OBJECTCACHE_VLLM_TRACE": str(trace_path)})
    try:
        gen(loader, a)
        loader.call({"op": "flush"})
        out = gen(loader, b)
        own = gen(loader, b, salt="computed-here")
        root = tmp_path / "store"
        objs = data_objects(root)
        flip_byte(objs[len(objs) // 2], os.path.getsize(objs[len(objs) // 2]) // 2)
        after = gen(loader, b)
    finally:
        loader.close()
    log = loader.logpath.read_text()
    groups = re.search(r"registered \d+ KV buffer\(s\), (\d+) group\(s\) \(([^)]*)\)", log)
    assert groups, "the worker logged no KV cache groups"
    print(f"{name} groups: {groups.group(2)}")
    assert int(groups.group(1)) > 1, "vLLM's hybrid KV cache manager is off"
    hit = (out["kv_transfer_params"] or {}).get("objectcache_hit_tokens", 0)
    print(f"{name}: B hit {hit} tokens, {out['text']!r}; computed {own['text']!r}")
    assert hit >= 8 * BLOCK
    assert out["num_cached_tokens"] == hit
    assert_same_tokens(out, own, f"{name} B loaded vs computed")
    assert_same_tokens(out, ref_b, f"{name} B loaded vs vLLM without the connector")
    assert_same_tokens(out, apc_b, f"{name} B loaded vs vLLM's own prefix cache")
    assert_same_tokens(after, own, f"{name} B after one object corrupted")

    settled = [e for e in _trace(trace_path) if e["event"] == "load.settled"]
    first = settled[0]
    n = hit // BLOCK
    # tokens x K,V x KV heads x head dim x fp32
    slice_bytes = BLOCK * 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 4
    chunks = first["group_chunks"]
    layers_per_group = [int(m) for m in re.findall(r"(\d+) layers of", groups.group(2))]
    kinds = re.findall(r"(full|swa\d+): \d+ layers", groups.group(2))
    want_chunks = [n if k == "full" else int(k[3:]) // BLOCK for k in kinds]
    predicted = sum(c * l * slice_bytes for c, l in zip(want_chunks, layers_per_group))
    hma_off = n * sum(layers_per_group) * slice_bytes
    print(f"{name}: chunks per group {chunks} (predicted {want_chunks}); bytes loaded "
          f"{first['bytes']} (predicted {predicted}; every layer at full length: "
          f"{hma_off}, {first['bytes'] / hma_off:.2f}x)")
    assert chunks == want_chunks
    assert first["bytes"] == predicted


def test_recurrent_models_are_refused_at_start_up(tmp_path, logdir):
    """Qwen3-Next style (gated DeltaNet): the connector refuses to start, naming the model,
    the layers with recurrent state, the reason and what is supported."""
    model = tiny_model("qwen3next-tiny")
    store = "file://" + str(tmp_path / "store")
    with pytest.raises(pytest.fail.Exception):
        Replica("qwen3next-conn", logdir, model, kv_transfer_config=connector(store),
                extra={"dtype": "bfloat16"})
    log = (logdir / "qwen3next-conn.log").read_text()
    m = re.search(r"ObjectCacheConnector: model \S+ keeps recurrent state[^\n]*", log)
    assert m, "no refusal naming the recurrent state in the log"
    print(f"refused: {m.group(0)[:300]}")
    assert "qwen3next-tiny" in m.group(0) and "Supported:" in m.group(0)


TP2 = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # one core per rank (one NUMA node here)


def test_mla_stored_once_for_every_rank(tmp_path, logdir):
    """DeepSeek-V2 style MLA (latent 576, bfloat16: vLLM's CPU MLA kernels take no float32)
    saved by a replica at tensor parallel 2: one chunk object per chunk (no rank in key or
    object, rank 0 writes it), half the bytes of one object per rank; a fresh replica at TP 1
    loads it and gives the engine's own full computation and vLLM's without the connector."""
    model = tiny_model("mla-tiny")
    store = "file://" + str(tmp_path / "store")
    doc = document("mla", 40)
    a, b = ask(doc, "Which dock is busiest?"), ask(doc, "What does crate 12 hold?")
    others = [ask(document("other", 20), "Who checked row 3?"), "List three colours:"]
    extra = {"dtype": "bfloat16"}

    base = Replica("mla-base", logdir, model, extra=extra)
    try:
        ref_b = gen(base, b, salt="full-b")
        outs = [gen(base, p) for p in others]
    finally:
        base.close()
    texts = {ref_b["text"]} | {o["text"] for o in outs}
    print(f"mla-tiny without the connector: {[ref_b['text']] + [o['text'] for o in outs]}")
    assert len(texts) == 3, f"different prompts gave the same output: {texts}"

    saver = Replica("mla-saver-tp2", logdir, model, kv_transfer_config=connector(store),
                    extra={**extra, "tensor_parallel_size": 2}, env=TP2)
    try:
        gen(saver, a)
        saver.call({"op": "flush"})
    finally:
        saver.close()
    objs = data_objects(tmp_path / "store")
    assert objs and all("/tp0-1/" in p for p in objs), objs[:2]
    stored = sum(os.path.getsize(p) for p in objs)
    loader = Replica("mla-loader-tp1", logdir, model, kv_transfer_config=connector(store),
                     extra=extra)
    try:
        out = gen(loader, b)
        own = gen(loader, b, salt="computed-here")
    finally:
        loader.close()
    hit = (out["kv_transfer_params"] or {}).get("objectcache_hit_tokens", 0)
    per_chunk = os.path.getsize(objs[0])
    # A chunk is one vLLM block, and vLLM's CPU MLA backend takes its block size from the
    # CPU's instruction set (a 2-core EPYC here logged layout "cpu-vec16": 16-token blocks;
    # other CPUs give other sizes): the size the saver's connector logged.
    tpc = int(re.search(r"(\d+) tokens per chunk", saver.logpath.read_text()).group(1))
    print(f"mla-tiny at TP 2: {len(objs)} chunk objects of {per_chunk} bytes (latent 576 x "
          f"bf16 x {tpc} tokens x 4 layers + header), {stored} bytes stored; one object "
          f"per rank would store {2 * stored} (0.50x); at TP 8, {8 * stored} (0.125x). B at "
          f"TP 1 hit {hit} tokens, {out['text']!r}; computed {own['text']!r}")
    assert per_chunk == 64 + 4 * (tpc * 576 * 2 + 4), (per_chunk, tpc)
    assert hit >= 768 and hit % tpc == 0 and len(objs) >= hit // tpc
    assert out["num_cached_tokens"] == hit
    assert_same_tokens(out, own, "mla B loaded vs computed", tol=0.05)
    assert_same_tokens(out, ref_b, "mla B loaded vs vLLM without the connector", tol=0.05)


def test_llama_at_tensor_parallel_2(tmp_path, logdir):
    """A Llama-style model at TP 2: each rank saves and loads its own KV heads (one object
    per chunk and rank); B, loaded from the store by the TP 2 replica (prefix caching off),
    hits every shared chunk and gives the engine's own full computation and vLLM's without
    the connector (TP 1)."""
    model = tiny_model("llama-tiny")
    store = "file://" + str(tmp_path / "store")
    doc = document("llama", 40)
    a, b = ask(doc, "Which dock is busiest?"), ask(doc, "What does crate 12 hold?")
    others = [ask(document("other", 20), "Who checked row 3?"), "List three colours:"]
    extra = {"dtype": "float32"}

    base = Replica("llama-base", logdir, model, extra=extra)
    try:
        ref_b = gen(base, b, salt="full-b")
        outs = [gen(base, p) for p in others]
    finally:
        base.close()
    texts = {ref_b["text"]} | {o["text"] for o in outs}
    print(f"llama-tiny without the connector: {[ref_b['text']] + [o['text'] for o in outs]}")
    assert len(texts) == 3, f"different prompts gave the same output: {texts}"
    tp2 = {**extra, "tensor_parallel_size": 2}
    # One TP 2 replica saves A, then loads B from the store (its own prefix cache is off).
    loader = Replica("llama-tp2", logdir, model, kv_transfer_config=connector(store),
                     extra=tp2, env=TP2)
    try:
        gen(loader, a)
        loader.call({"op": "flush"})
        objs = data_objects(tmp_path / "store")
        ranks = {re.search(r"/tp(\d)-2/", p).group(1) for p in objs}
        assert ranks == {"0", "1"}, objs[:2]
        out = gen(loader, b)
        own = gen(loader, b, salt="computed-here")
    finally:
        loader.close()
    hit = (out["kv_transfer_params"] or {}).get("objectcache_hit_tokens", 0)
    print(f"llama-tiny at TP 2: {len(objs)} chunk objects (2 ranks); B hit {hit} tokens, "
          f"{out['text']!r}; computed {own['text']!r}; without the connector at TP 1 "
          f"{ref_b['text']!r}")
    assert hit >= 6 * BLOCK
    assert out["num_cached_tokens"] == hit
    assert_same_tokens(out, own, "llama TP 2 B loaded vs computed")
    assert out["token_ids"] == ref_b["token_ids"], "llama TP 2 vs vLLM without the connector"
