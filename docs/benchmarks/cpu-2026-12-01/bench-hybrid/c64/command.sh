set -euo pipefail
PY=.venv/bin/python
export VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=2 VLLM_ENABLE_V1_MULTIPROCESSING=1
SERVE="$PY -m vllm.entrypoints.openai.api_server --model models/hybrid --port 8000 --dtype float32 --max-model-len 1024 --mamba-ssm-cache-dtype float32"
SPEC='{"method": "hspec", "model": "models/hybrid-hspec", "num_speculative_tokens": 7, "hybridspec": {"gdn_kernel": true}}'
$PY -m vllm_hybridspec.cli bench --prompts models/prompts/heldout.jsonl --concurrency 64 --output-len 64 --repeats 3 \
  --serve "$SERVE --speculative-config '$SPEC'" --label hspec -o /tmp/cpubench/h64/hspec.json \
  --switch 'off={"drafting": false}' --switch 'all={}' --switch 'sel={"policy": "models/hybrid-hspec/policy_cpu.json"}'
