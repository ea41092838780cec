"""One vLLM replica (`vllm.LLM`, offline) driven over stdin/stdout, for the vLLM tests.

Usage: python vllm_replica.py '<config JSON>'

Config: {"model": DIR, "max_model_len": N, "apc": bool, "kv_transfer_config": {...} | null,
         "hash_algo": "sha256_cbor"}
Prints `READY` once the engine is up, then reads one JSON command per line from stdin and
answers each with one line `RESULT <json>` on stdout:
  {"op": "generate", "prompts": [{"prompt": TEXT | "prompt_token_ids": [...],
                                   "cache_salt": S?}, ...],
   "max_tokens": N, "logprobs": K}
     -> {"outputs": [{"token_ids": [...], "text": ..., "first_logprobs": {id: lp},
                      "prompt_tokens": n, "num_cached_tokens": n,
                      "kv_transfer_params": {...}, "request_id": id}]}
  {"op": "tokenize", "texts": [...]} -> {"token_ids": [[...], ...]}
  {"op": "flush"} -> {"saves": n}   (waits for the connector's background saves)
  {"op": "quit"}
"""

import json
import sys


def main():
    cfg = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams

    kw = dict(
        model=cfg["model"],
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=cfg.get("max_model_len", 4096),
        enable_prefix_caching=cfg.get("apc", False),
        prefix_caching_hash_algo=cfg.get("hash_algo", "sha256_cbor"),
        seed=0,
    )
    kw.update(cfg.get("extra") or {})
    if cfg.get("kv_transfer_config"):
        kw["kv_transfer_config"] = cfg["kv_transfer_config"]
    llm = LLM(**kw)
    tok = llm.get_tokenizer()
    print("READY", flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "quit":
            break
        if op == "flush":
            from objectcache.vllm import flush_saves

            out = {"saves": sum(llm.collective_rpc(flush_saves))}
        elif op == "tokenize":
            out = {"token_ids": [tok.encode(t) for t in cmd["texts"]]}
        elif op == "generate":
            sp = SamplingParams(max_tokens=cmd.get("max_tokens", 16), temperature=0.0,
                                logprobs=cmd.get("logprobs", 5))
            prompts = []
            for p in cmd["prompts"]:
                d = ({"prompt_token_ids": p["prompt_token_ids"]} if "prompt_token_ids" in p
                     else {"prompt": p["prompt"]})
                if p.get("cache_salt"):
                    d["cache_salt"] = p["cache_salt"]
                prompts.append(d)
            res = llm.generate(prompts, sp, use_tqdm=False)
            out = {"outputs": []}
            for r in res:
                o = r.outputs[0]
                lp0 = {}
                if o.logprobs:
                    lp0 = {str(k): v.logprob for k, v in o.logprobs[0].items()}
                out["outputs"].append({
                    "token_ids": list(o.token_ids),
                    "text": o.text,
                    "first_logprobs": lp0,
                    "prompt_tokens": len(r.prompt_token_ids or []),
                    "num_cached_tokens": r.num_cached_tokens,
                    "kv_transfer_params": r.kv_transfer_params,
                    "request_id": r.request_id,
                    "finish_reason": o.finish_reason,
                })
        else:
            out = {"error": f"unknown op {op!r}"}
        print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
