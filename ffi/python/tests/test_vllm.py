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

import json
import os
import pathlib
import queue
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from conftest import missing
from kvutil import data_objects, flip_byte

HERE = pathlib.Path(__file__).resolve().parent
BLOCK = 128  # vLLM's CPU block size = tokens per chunk here
MAX_TOKENS = 16
STARTUP_S = 900


def _dtype():
    """The model's dtype: bfloat16 where the CPU computes it natively (AMX or AVX-512 BF16),
    float32 elsewhere: on AVX2 alone vLLM's bfloat16 prefill is about 4x slower than float32
    (measured: 126 s vs 34 s for the same three prompts). $OBJECTCACHE_VLLM_DTYPE overrides."""
    d = os.environ.get("OBJECTCACHE_VLLM_DTYPE")
    if d:
        return d
    try:
        flags = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        flags = ""
    return "bfloat16" if ("amx_bf16" in flags or "avx512_bf16" in flags) else "float32"


DTYPE = _dtype()


def _model():
    try:
        import vllm  # noqa: F401
    except Exception as e:  # ImportError, or a broken install
        missing(f"vLLM is not importable by {sys.executable} ({e}); see scripts/vllm-setup.sh")
    m = os.environ.get("OBJECTCACHE_VLLM_MODEL")
    if not m or not pathlib.Path(m, "config.json").is_file():
        missing(f"no model folder at OBJECTCACHE_VLLM_MODEL={m!r}")
    return m


def document():
    """A deterministic field report of about 1,000 tokens."""
    ships = ["Aster", "Boreal", "Cygnet", "Dunlin", "Egret", "Fulmar", "Gannet", "Heron"]
    ports = ["Tromso", "Valparaiso", "Hobart", "Reykjavik", "Cork", "Halifax", "Nome", "Ushuaia"]
    cargo = ["sensor buoys", "rope", "diesel", "core samples", "spare radios", "tinned fish"]
    people = ["Ines Moreau", "Tomas Berg", "Aiko Tanaka", "Ravi Menon", "Lena Fischer"]
    paras = []
    for i in range(15):
        paras.append(
            f"Entry {i + 1}. The survey vessel {ships[i % 8]} left {ports[(3 * i) % 8]} on day "
            f"{7 + 3 * i} with {12 + 5 * i} crates of {cargo[i % 6]}. Captain "
            f"{people[i % 5]} logged winds of {9 + (7 * i) % 30} knots and a water "
            f"temperature of {2 + (5 * i) % 11} degrees. The crew repaired the "
            f"{['winch', 'radar', 'hull', 'galley'][i % 4]} and reached "
            f"{ports[(3 * i + 2) % 8]} {1 + i % 4} days later."
        )
    return "Field report of the northern survey fleet.\n\n" + "\n".join(paras)


QUESTIONS = [
    "Which vessel carried core samples first?",
    "Who was the captain in entry 7?",
    "What was repaired in entry 10?",
    "Which port did the Heron leave from?",
    "How many crates were loaded in entry 3?",
    "What wind speed was logged in entry 12?",
    "Which entry mentions spare radios first?",
    "Where did the Aster arrive in entry 1?",
]


def prompt(q):
    return f"{document()}\n\nQuestion: {q}\nAnswer:"


A, B = prompt("Summarise the report in one sentence."), prompt(QUESTIONS[0])


def _env():
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_TARGET_DEVICE="cpu",
               TOKENIZERS_PARALLELISM="false")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # vllm_replica.py's "flush" op sends a function to the workers (collective_rpc).
    env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    return env


class _Proc:
    """A child process whose stdout lines are read on a thread: protocol lines go to a queue,
    the rest to a log file."""

    def __init__(self, name, argv, logdir, protocol=("READY", "RESULT ")):
        self.name = name
        self.logpath = logdir / f"{name}.log"
        self.log = open(self.logpath, "w")
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, env=_env(), text=True)
        self.q = queue.Queue()
        self.protocol = protocol
        self.t = threading.Thread(target=self._read, daemon=True)
        self.t.start()

    def _read(self):
        for line in self.proc.stdout:
            if line.startswith(self.protocol):
                self.q.put(line.rstrip("\n"))
            self.log.write(line)
            self.log.flush()
        self.q.put(None)

    def fail(self, what):
        self.log.flush()
        tail = self.logpath.read_text()[-6000:]
        pytest.fail(f"{self.name}: {what}\n--- last lines of {self.logpath} ---\n{tail}")

    def next_line(self, timeout):
        try:
            line = self.q.get(timeout=timeout)
        except queue.Empty:
            self.fail(f"no answer in {timeout} s")
        if line is None:
            self.fail(f"exited with status {self.proc.wait()}")
        return line

    def close(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except Exception:
                self.proc.kill()
                self.proc.wait()
        self.t.join(timeout=60)  # the reader ends at the child's end of output
        self.log.close()


class Replica(_Proc):
    """An offline `vllm.LLM` replica (vllm_replica.py)."""

    def __init__(self, name, logdir, model, kv_transfer_config=None, apc=False):
        cfg = {"model": model, "max_model_len": 4096, "apc": apc,
               "kv_transfer_config": kv_transfer_config, "extra": {"dtype": DTYPE}}
        t0 = time.monotonic()
        super().__init__(name, [sys.executable, str(HERE / "vllm_replica.py"), json.dumps(cfg)],
                         logdir)
        self.next_line(STARTUP_S)
        self.startup_s = time.monotonic() - t0
        print(f"{name}: vLLM up in {self.startup_s:.1f} s")

    def call(self, cmd, timeout=600):
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.next_line(timeout)
        out = json.loads(line[len("RESULT "):])
        if "error" in out:
            self.fail(out["error"])
        return out

    def generate(self, prompts, salts=None):
        ps = [{"prompt": p, "cache_salt": (salts or [None] * len(prompts))[i]}
              for i, p in enumerate(prompts)]
        return self.call({"op": "generate", "prompts": ps, "max_tokens": MAX_TOKENS,
                          "logprobs": 5})["outputs"]

    def tokenize(self, texts):
        return self.call({"op": "tokenize", "texts": texts})["token_ids"]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ApiServer(_Proc):
    """vLLM's OpenAI-compatible server (python -m vllm.entrypoints.openai.api_server)."""

    def __init__(self, name, logdir, model, kv_transfer_config):
        self.port = _free_port()
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                "--dtype", DTYPE, "--enforce-eager", "--max-model-len", "4096",
                "--host", "127.0.0.1", "--port", str(self.port), "--no-enable-prefix-caching",
                "--prefix-caching-hash-algo", "sha256_cbor", "--seed", "0",
                "--enable-prompt-tokens-details",
                "--kv-transfer-config", json.dumps(kv_transfer_config)]
        t0 = time.monotonic()
        super().__init__(name, argv, logdir, protocol=("\0",))
        deadline = t0 + STARTUP_S
        while True:  # poll readiness: /health answers 200 once the engine is up
            if self.proc.poll() is not None:
                self.fail(f"exited with status {self.proc.returncode}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health",
                                            timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.fail("not ready in time")
            time.sleep(0.5)
        self.startup_s = time.monotonic() - t0
        print(f"{name}: OpenAI server up in {self.startup_s:.1f} s")

    def complete(self, p, salt=None):
        body = {"model": _model(), "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0,
                "logprobs": 5}
        if salt:
            body["cache_salt"] = salt
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            out = json.loads(r.read())
        ch = out["choices"][0]
        lp = ch["logprobs"]
        details = (out.get("usage") or {}).get("prompt_tokens_details") or {}
        return {
            "text": ch["text"],
            "tokens": lp["tokens"],
            "first_logprobs": lp["top_logprobs"][0],
            "cached_tokens": details.get("cached_tokens"),
            "kv_transfer_params": out.get("kv_transfer_params"),
        }

    def metric(self, name):
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=30) as r:
            text = r.read().decode()
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def close(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.t.join(timeout=60)
        self.log.close()


def connector(store, **extra):
    return {"kv_connector": "ObjectCacheConnector", "kv_connector_module_path": "objectcache.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"store": store, "namespace": "vllm-test", **extra}}


# ---- Fixtures: one process per role, shared by the tests --------------------------------


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


def top_logprobs(out, k=3):
    return [round(v, 6) for v in sorted(out["first_logprobs"].values(), reverse=True)[:k]]


def logprob_distance(a, b):
    """The largest difference between two outputs' first-token top log-probabilities, rank by
    rank."""
    x = sorted(a["first_logprobs"].values(), reverse=True)
    y = sorted(b["first_logprobs"].values(), reverse=True)
    return max(abs(p - q) for p, q in zip(x, y))


# Without a bit-exact prefix cache, a load may move the first token's top log-probabilities by
# at most 3x what vLLM's own prefix cache moves them in the probe, and by at least this much.
TOLERANCE_FLOOR = 1e-3


TOLERANCE = 0.05  # first-token log-probability, when outputs differ from the baseline


def compare_baseline(text, first_lp, ref, what):
    """Compares an output with the run without a connector. Equal texts pass. vLLM itself can
    change a greedy output when any KV connector is configured (its ExampleConnector loading
    nothing does the same here): then the difference is printed and the first token's
    log-probability must be within TOLERANCE of the reference's."""
    if text == ref["text"]:
        return True
    got, want = max(first_lp.values()), max(ref["first_logprobs"].values())
    print(f"  {what}: output differs from vLLM without a connector: {text!r} vs "
          f"{ref['text']!r}; first-token logprob {got:.6f} vs {want:.6f} "
          f"(tolerance {TOLERANCE})")
    assert abs(got - want) <= TOLERANCE, what
    return False


def expected_hit(tokens_a, tokens_b):
    """Tokens of B's full chunks shared with A, leaving one token of B to compute."""
    common = 0
    for x, y in zip(tokens_a, tokens_b):
        if x != y:
            break
        common += 1
    return min(common // BLOCK, (len(tokens_b) - 1) // BLOCK) * BLOCK


# Settings the saver uses per store beyond the URL: the "v2" store gets segment objects.
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
    r = Replica("saver", logdir, model, kv_transfer_config=cfg)
    try:
        out = r.generate([A])[0]
        assert out["num_cached_tokens"] == 0
        r.generate([A], salts=["tenant-x"])
        flushed = r.call({"op": "flush"})["saves"]
        assert flushed >= 2 * len(stores), f"{flushed} saves for 2 prompts on {len(stores)} stores"
    finally:
        r.close()
    return out


def assert_same_output(got, want, what, ref):
    """A load's output against the same engine's full computation. Where vLLM's own prefix
    cache is bit-exact (`ref["exact"]`, from the baseline's probe), the texts (and token ids)
    and the first token's top log-probabilities are equal to the last bit: the loaded KV was
    the computed KV. Where it is not, the first token is the same and its top log-probabilities
    are within `ref["tol"]` rank by rank (3x the probe's own distance): KV of another layout, or
    bytes of other blocks, move them far more."""
    if ref["exact"]:
        assert got["text"] == want["text"] and got.get("token_ids") == want.get("token_ids"), (
            f"{what}: output differs from the engine's own full computation:\n"
            f"  loaded:   {got['text']!r}\n  computed: {want['text']!r}")
        assert_logprobs_equal(got["first_logprobs"], want["first_logprobs"], what)
        return
    g, w = got["first_logprobs"], want["first_logprobs"]
    g_top, w_top = max(g, key=g.get), max(w, key=w.get)
    dist = logprob_distance(got, want)
    print(f"  {what}: loaded {got['text']!r}, top log-probabilities {top_logprobs(got)}; "
          f"computed {want['text']!r}, {top_logprobs(want)}: {dist:.2e} apart")
    assert g_top == w_top, f"{what}: first token {g_top} after a load, {w_top} computed"
    assert dist <= ref["tol"], (
        f"{what}: first-token top log-probabilities {top_logprobs(got, 5)} after a load, "
        f"{top_logprobs(want, 5)} computed: {dist:.2e} apart (tolerance {ref['tol']:.2e})")


def assert_logprobs_equal(got, want, what):
    """The first token's top log-probabilities, equal to the last bit: the KV was the same."""
    g = sorted(got.values(), reverse=True)
    w = sorted(want.values(), reverse=True)
    assert g == w, f"{what}: first-token log-probabilities {g} != {w}"


# ---- Tests ---------------------------------------------------------------------------------


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
