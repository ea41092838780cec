#!/usr/bin/env python3
"""Writes small models of each architecture family the vLLM tests and benchmark run, with
seeded random weights of a realistic scale (transformers' `from_config` and its default
initialisation, std 0.02) saved as bf16 safetensors, and the SmolLM2 tokenizer that
`scripts/vllm-setup.sh` made. No download. Run with the vLLM venv's Python:

    target/vllm/venv/bin/python scripts/vllm-tiny-models.py [DIR]   (default target/vllm)

Writes DIR/models/<name> for each model below and prints one line per model. Models that
exist are kept. Deterministic: the same seed gives the same weights.

Families (`--list` prints them):
  gemma3-tiny   Gemma 3 style: sliding-window attention on 5 of every 6 layers (window
                512), full attention on the 6th; 12 layers, hidden 256, 4 heads, 2 KV heads
  gptoss-tiny   gpt-oss style: sliding-window attention (window 128) and full attention
                alternating, attention sinks, MoE of 4 experts (2 per token); 4 layers,
                hidden 256, 4 heads, 2 KV heads; untied output embedding
  mla-tiny      DeepSeek-V2 style: multi-head latent attention (kv_lora_rank 512,
                qk_rope_head_dim 64: a latent of 576, as DeepSeek V2/V3), 16 heads,
                4 layers, dense MLP, untied output embedding (vLLM's DeepSeek-V2 loads
                no tied one)
  llama-tiny    Llama style dense attention for tensor parallel 2: 8 layers, hidden 256,
                4 heads, 4 KV heads (2 per rank)
  qwen3next-tiny  Qwen3-Next style: gated DeltaNet (linear attention, recurrent state) on 3
                of every 4 layers, full attention on the 4th; MoE of 4 experts; untied
                output embedding; runs in bfloat16 only on the CPU (vLLM's GDN kernel)
"""

import json
import pathlib
import sys

MODELS = {
    "gemma3-tiny": ("sliding-window hybrid (5:1)", "Gemma3ForCausalLM"),
    "gptoss-tiny": ("sliding-window hybrid (1:1, attention sinks)", "GptOssForCausalLM"),
    "mla-tiny": ("MLA (DeepSeek-V2 style)", "DeepseekV2ForCausalLM"),
    "llama-tiny": ("dense attention (TP 2)", "LlamaForCausalLM"),
    "qwen3next-tiny": ("recurrent hybrid (gated DeltaNet)", "Qwen3NextForCausalLM"),
}


def config(name, vocab, bos, eos):
    import transformers as tf

    common = dict(vocab_size=vocab, bos_token_id=bos, eos_token_id=eos, pad_token_id=eos,
                  tie_word_embeddings=True, max_position_embeddings=16384,
                  torch_dtype="bfloat16")
    if name == "gemma3-tiny":
        return tf.Gemma3TextConfig(
            hidden_size=256, intermediate_size=768, num_hidden_layers=12,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=512,
            layer_types=["sliding_attention" if (i + 1) % 6 else "full_attention"
                         for i in range(12)],
            query_pre_attn_scalar=64, **common)
    if name == "gptoss-tiny":
        return tf.GptOssConfig(
            hidden_size=256, intermediate_size=256, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=128,
            layer_types=["sliding_attention", "full_attention"] * 2, num_local_experts=4,
            num_experts_per_tok=2,
            # gpt-oss's YaRN, its factor matching the 16K context (transformers warns when the
            # factor and the context disagree)
            rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                             "beta_slow": 1.0, "rope_theta": 150000.0, "truncate": False,
                             "original_max_position_embeddings": 4096},
            **{**common, "tie_word_embeddings": False})
    if name == "mla-tiny":
        return tf.DeepseekV2Config(
            hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
            num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512,
            q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
            first_k_dense_replace=4, n_routed_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=128, n_shared_experts=1, moe_layer_freq=1,
            rope_scaling=None, **{**common, "tie_word_embeddings": False})
    if name == "llama-tiny":
        # initializer_range 0.05 (transformers' default 0.02 makes this small model answer
        # two long documents alike).
        return tf.LlamaConfig(
            hidden_size=256, intermediate_size=768, num_hidden_layers=8,
            num_attention_heads=4, num_key_value_heads=4, head_dim=64,
            initializer_range=0.05, **common)
    if name == "qwen3next-tiny":
        return tf.Qwen3NextConfig(
            hidden_size=256, intermediate_size=768, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            layer_types=["linear_attention", "linear_attention", "linear_attention",
                         "full_attention"],
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=128,
            linear_value_head_dim=128, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=128, shared_expert_intermediate_size=128,
            decoder_sparse_step=1, **{**common, "tie_word_embeddings": False})
    raise KeyError(name)


def main():
    if "--list" in sys.argv:
        for n, (family, arch) in MODELS.items():
            print(f"{n}\t{family}\t{arch}")
        return
    base = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "target/vllm")
    tok_dir = base / "models" / "smollm2-135m-hf"
    if not (tok_dir / "tokenizer.json").is_file():
        sys.exit(f"no SmolLM2 tokenizer at {tok_dir} (run scripts/vllm-setup.sh first)")
    import torch
    import transformers as tf

    tok = tf.AutoTokenizer.from_pretrained(tok_dir)
    for name in MODELS:
        out = base / "models" / name
        if (out / "config.json").is_file():
            print(f"{name}: kept {out}")
            continue
        cfg = config(name, len(tok), tok.bos_token_id or 1, tok.eos_token_id or 2)
        torch.manual_seed(20261206)
        model = tf.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16)
        model.save_pretrained(out)
        tok.save_pretrained(out)
        n = sum(p.numel() for p in model.parameters())
        print(f"{name}: {MODELS[name][0]}, {n / 1e6:.1f} M parameters -> {out}")
        (out / "objectcache-model.json").write_text(json.dumps(
            {"name": name, "family": MODELS[name][0], "architecture": MODELS[name][1]}))


if __name__ == "__main__":
    main()
