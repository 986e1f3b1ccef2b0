#!/usr/bin/env bash
# Build the reference models on the GPU machine, resumably, in calls of at most 10 minutes.
# usage (after the vLLM bundle, the extras and `source scripts/device_setup.sh`):
#   bash scripts/gpu_models.sh corpus targets        # then, in the next call of the same lease:
#   bash scripts/gpu_models.sh prompts drafters evaluate accept
# Outputs live in /tmp/hs-models (kept between calls of one lease) and come back as $OUT/models-<dir>.tar.
set -uo pipefail
M=/tmp/hs-models; W=/tmp/hs-work
# a fresh machine resumes from the models that travel with the tree (./models, from an earlier call)
[ -d "$M" ] || { [ -d models ] && cp -r models "$M"; }
args=(); for s in "$@"; do args+=(--stage "$s"); done
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
python3 -m vllm_hybridspec.cli models --out-dir "$M" --work-dir "$W" --max-minutes "${MAX_MINUTES:-3.5}" "${args[@]}" 2>&1 \
  | tr '\r' '\n' | grep -v '^\s*$' | awk 'NR % 20 == 1 || /loss|done|Error|error|Traceback|saved|accept/' 
rc=${PIPESTATUS[0]}
# checkpoints name their target by the build path: make it the repository's models/ before shipping
grep -rl --include=*.json --include=*.yaml -e "$M/" -e "$W/" "$M" | xargs -r sed -i -e "s|$M/|models/|g" -e "s|$W/|out/models-work/|g"
# few files come back per call, each of limited size: one tar per model directory
for d in "$M"/*; do tar cf "$OUT/models-$(basename "$d").tar" -C "$M" "$(basename "$d")"; done
du -sh "$M"/* 2>/dev/null
exit $rc
