#!/usr/bin/env bash
# Build the reference models on the GPU machine, resumably, in calls of at most 10 minutes.
# usage (after the vLLM bundle, the extras and `source examples/device_setup.sh`):
#   bash examples/gpu_models.sh corpus targets        # then, in the next call of the same lease:
#   bash examples/gpu_models.sh prompts drafters evaluate
# Outputs live in /tmp/hs-models (kept between calls of one lease) and are copied to $OUT/models.
set -uo pipefail
M=/tmp/hs-models; W=/tmp/hs-work
args=(); for s in "$@"; do args+=(--stage "$s"); done
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
python3 -m vllm_hybridspec.cli models --out-dir "$M" --work-dir "$W" --max-minutes "${MAX_MINUTES:-3.5}" "${args[@]}" 2>&1 \
  | tr '\r' '\n' | grep -v '^\s*$' | awk 'NR % 20 == 1 || /loss|done|Error|error|Traceback|saved|accept/' 
rc=${PIPESTATUS[0]}
mkdir -p "$OUT/models" && cp -r "$M"/. "$OUT/models/"
du -sh "$M"/* 2>/dev/null
exit $rc
