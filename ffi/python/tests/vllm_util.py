"""What the vLLM tests share: replica processes (offline `vllm.LLM` over stdin/stdout, and
vLLM's OpenAI-compatible server), the prompts (a deterministic document and questions), the
connector's settings, and the comparisons of outputs against a full computation."""

import json
import os
import pathlib
import queue
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from conftest import missing

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


#: The tests of failures and keys run the model in float32: a prefix hit, vLLM's own as
#: well as ours, computes the new tokens in other kernel splits than a full prefill, which
#: moves bfloat16 log-probabilities by up to 0.25 on this model (measured with vLLM's own
#: prefix cache) and can change a greedy token; in float32 by about 1e-5.
EXACT_DTYPE = "float32"


def assert_same_tokens(got, want, what, tol=1e-3):
    """Greedy outputs equal token for token, and the first token's top log-probabilities
    within `tol` rank by rank (float32: see EXACT_DTYPE)."""
    assert got["token_ids"] == want["token_ids"], (
        f"{what}: output differs from the engine's own full computation:\n"
        f"  loaded:   {got['text']!r}\n  computed: {want['text']!r}")
    dist = logprob_distance(got, want)
    assert dist <= tol, (f"{what}: first-token top log-probabilities {top_logprobs(got, 5)} "
                         f"vs {top_logprobs(want, 5)}: {dist:.2e} apart")


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

    def __init__(self, name, argv, logdir, protocol=("READY", "RESULT "), env=None):
        self.name = name
        self.logpath = logdir / f"{name}.log"
        self.log = open(self.logpath, "w")
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, env={**_env(), **(env or {})},
                                     text=True)
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
    """An offline `vllm.LLM` replica (vllm_replica.py).

    By default its engine core runs in the replica's own process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and, at tensor-parallel size 1, its worker too: the
    connector's scheduler and worker sides share one process, as in vLLM's own layout for one
    GPU (whose engine core process runs the worker in-process). Such a replica starts in about
    10 s instead of 24 (one Python process importing vLLM instead of three) and stops in 3 s
    instead of 7 (vLLM's CPU engine core, a process of its own, is killed after a 5 s wait).
    ``engine_process=True`` keeps vLLM's default CPU layout (engine core and worker each a
    process of their own), which the failure tests use: there the scheduler steps beside the
    worker's forward pass (vLLM's async scheduling) and the connector's metadata crosses
    processes. So do the OpenAI-server replicas (:class:`ApiServer`) and tensor-parallel size
    2 (a worker per rank)."""

    def __init__(self, name, logdir, model, kv_transfer_config=None, apc=False, extra=None,
                 env=None, engine_process=False):
        """``extra``: more ``vllm.LLM`` arguments (e.g. ``async_scheduling``); ``env``: more
        environment variables for the replica's processes; ``engine_process``: the engine
        core in a process of its own (see the class)."""
        env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1" if engine_process else "0", **(env or {})}
        cfg = {"model": model, "max_model_len": 4096, "apc": apc,
               "kv_transfer_config": kv_transfer_config,
               "extra": {"dtype": DTYPE, **(extra or {})}}
        t0 = time.monotonic()
        super().__init__(name, [sys.executable, str(HERE / "vllm_replica.py"), json.dumps(cfg)],
                         logdir, env=env)
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


class KvEvents:
    """A subscriber to a vLLM replica's KV events (its ZMQ publisher, ``kv_events_config``):
    collects every event of every ``KVEventBatch`` on a thread. The subscriber binds a
    loopback port and vLLM's publisher connects to it (vLLM binds only wildcard endpoints),
    so nothing published after the replica starts is missed. ``config`` is what to pass to
    the replica."""

    def __init__(self):
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.setsockopt(zmq.RCVTIMEO, 200)
        port = self._sub.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.config = {"enable_kv_cache_events": True, "publisher": "zmq",
                       "endpoint": self.endpoint, "topic": ""}
        self.events = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        dec = msgspec.msgpack.Decoder(type=KVEventBatch)

        def run():
            while not self._stop.is_set():
                try:
                    _topic, _seq, payload = self._sub.recv_multipart()
                except zmq.Again:
                    continue
                batch = dec.decode(payload)
                with self._lock:
                    self.events.extend(batch.events)

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def stored(self, medium):
        """The ``BlockStored`` events received so far with this ``medium``."""
        with self._lock:
            return [e for e in self.events
                    if type(e).__name__ == "BlockStored" and e.medium == medium]

    def close(self):
        self._stop.set()
        self._thread.join(timeout=5)
        self._sub.close(linger=0)
        self._ctx.term()


class ApiServer(_Proc):
    """vLLM's OpenAI-compatible server (python -m vllm.entrypoints.openai.api_server)."""

    def __init__(self, name, logdir, model, kv_transfer_config, args=()):
        """``args``: more command-line arguments of vLLM's server (e.g. ``--dtype``)."""
        self.port = _free_port()
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                "--dtype", DTYPE, "--enforce-eager", "--max-model-len", "4096",
                "--host", "127.0.0.1", "--port", str(self.port), "--no-enable-prefix-caching",
                "--prefix-caching-hash-algo", "sha256_cbor", "--seed", "0",
                "--enable-prompt-tokens-details",
                "--kv-transfer-config", json.dumps(kv_transfer_config), *args]
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

    def metric(self, name, label=None):
        """The sum of a metric's samples, of those with `label` (e.g. 'reason="cancelled"')
        when given."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=30) as r:
            text = r.read().decode()
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                if label is None or label in line.rsplit(" ", 1)[0]:
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

