#!/usr/bin/env bash
# One GPU session's measurements (issues 5 and 6), in calls of at most 10 minutes; see docs/device.md.
# usage on the GPU machine, after the vLLM bundle (../shared/device/README.md):
#   bash examples/gpu_session.sh extras     # installs .devextras/e00 (carried) + checks the plugin imports
#   bash examples/gpu_session.sh ref        # reference hybrid (bf16): plain / H-Spec on vLLM's GDN path /
#                                           # one-slot GDN / + length selection; identity, KV, step sweep
#   bash examples/gpu_session.sh ref32      # the same in float32 (exact identity: no bf16 ties)
#   bash examples/gpu_session.sh dense      # reference dense: plain / H-Spec / DFlash
#   bash examples/gpu_session.sh big1       # Qwen3.6-35B-A3B shape, dummy weights: plain, H-Spec + one-slot GDN
#   bash examples/gpu_session.sh big2       # same shape: H-Spec on vLLM's GDN path, DFlash
#   bash examples/gpu_session.sh profile    # 35B shape: torch.profiler of plain steps and H-Spec w = 1 rounds
#   bash examples/gpu_session.sh bench-dense / bench-hybrid
#                                           # issue 7 (a): `hybridspec bench` against `vllm serve` of a
#                                           # reference model, C = 1,4,16,64, each config, + report
# (DFlash on the reference hybrid: vLLM 0.26 refuses it at engine start, see
#  docs/benchmarks/h200-2026-11-29/README.md.) Every config runs in its own process (--isolate).
# Every stage writes $OUT/<stage>.tar (JSON results, logs); a stage stops its engines before the
# call's 10 minutes (DEADLINE seconds, default 560) and still packs what it has.
set -uo pipefail
STAGE="$1"
DEADLINE="${DEADLINE:-560}"
T0=$SECONDS
source examples/device_setup.sh
R="/tmp/hs-results/$STAGE"; mkdir -p "$R"
left() { echo $(( DEADLINE - (SECONDS - T0) - 15 )); }
run() {  # run NAME CMD...: with the time left, output to $R/NAME.log (filtered copy on stdout)
  local name="$1"; shift
  local t; t=$(left)
  if [ "$t" -lt 30 ]; then echo "[$name] skipped: ${t}s left"; return; fi
  echo "[$name] start ($t s left)"
  timeout "$t" "$@" > "$R/$name.log" 2>&1; echo "[$name] exit $? after $((SECONDS - T0)) s"
  grep -E "^(config|plain|hspec|dflash|one_slot|sel|B=)|identical|rror|Traceback" "$R/$name.log" | grep -v "^INFO" | tail -25
}
pack() { tar cf "$OUT/$STAGE.tar" -C /tmp/hs-results "$STAGE"; ls -la "$R"; }
trap pack EXIT
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader

H7='"num_speculative_tokens": 7'
COMMON=(--prompts models/prompts/heldout.jsonl --num-prompts 24 --max-tokens 128 --bs1-prompts 0 --enforce-eager --isolate
        --logprobs --sweep-lengths 1,2,4,8 --sweep-batches 1,4 --sweep-steps 48 --sweep-warmup 8 --gpu-mem 0.25)
case "$STAGE" in
extras)
  mkdir -p /tmp/devextras && cp .devextras/e00 /tmp/devextras/ && (cd /tmp/devextras && tar xf e00 && bash install_extras.sh)
  python3 -c "import vllm, vllm_hybridspec.plugin, vllm_hybridspec.models.hspec, vllm_hybridspec.kernels.gdn as g; print('plugin ok, vllm', vllm.__version__)" 2>&1 | tail -3
  ;;
ref|ref32)
  DT=bfloat16; [ "$STAGE" = ref32 ] && DT=float32
  HH='"method": "hspec", "model": "models/hybrid-hspec"'
  run hybrid python3 examples/vllm_compare.py --target models/hybrid "${COMMON[@]}" --dtype "$DT" \
    --additional-config '{"gdn_prefill_backend": "triton"}' --llm-kwargs '{"mamba_ssm_cache_dtype": "float32"}' \
    --config plain=none \
    --config hspec="{$HH, $H7, \"hybridspec\": {\"gdn_kernel\": false, \"fixed_length\": 8}}" \
    --config hspec_gdn="{$HH, $H7, \"hybridspec\": {\"gdn_kernel\": true, \"fixed_length\": 8}}" \
    --config hspec_sel="{$HH, $H7, \"hybridspec\": {\"gdn_kernel\": true, \"policy\": \"models/hybrid-hspec/policy_cpu.json\", \"gate\": false}}" \
    --out "$R/compare-hybrid-$DT.json"
  ;;
dense)
  run dense python3 examples/vllm_compare.py --target models/dense "${COMMON[@]}" \
    --config plain=none \
    --config hspec="{\"method\": \"hspec\", \"model\": \"models/dense-hspec\", $H7, \"hybridspec\": {\"fixed_length\": 8}}" \
    --config dflash="{\"method\": \"dflash\", \"model\": \"models/dense-dflash\", $H7}" \
    --out "$R/compare-dense.json"
  ;;
big1|big2)
  [ -d /tmp/full-shape ] || python3 examples/full_shape_models.py --out /tmp/full-shape > "$R/full_shape.log" 2>&1
  SIZES='"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 64]'
  PIECEWISE="\"engine\": {\"compilation_config\": {\"cudagraph_mode\": \"PIECEWISE\", $SIZES}}"
  BIG=(--target /tmp/full-shape/target --load-format dummy --random-prompts --vocab 248000 --prompt-len 128
       --num-prompts 8 --max-tokens 64 --bs1-prompts 0 --max-model-len 2048 --max-num-seqs 8 --gpu-mem 0.9
       --logprobs --isolate --sweep-lengths 1,2,4,8 --sweep-batches 1,4 --sweep-steps 48 --sweep-warmup 8
       --additional-config '{"gdn_prefill_backend": "triton"}'
       --llm-kwargs "{\"mamba_ssm_cache_dtype\": \"float32\", \"compilation_config\": {$SIZES}}")
  HS="\"method\": \"hspec\", \"model\": \"/tmp/full-shape/hspec\", $H7"
  if [ "$STAGE" = big1 ]; then
    run big1 python3 examples/vllm_compare.py "${BIG[@]}" --config plain=none \
      --config hspec_gdn="{$HS, \"hybridspec\": {\"gdn_kernel\": true, \"fixed_length\": 8}}" \
      --out "$R/compare-35b-1.json"
  else
    run big2 python3 examples/vllm_compare.py "${BIG[@]}" \
      --config hspec="{$HS, \"hybridspec\": {\"gdn_kernel\": false, \"fixed_length\": 8}, $PIECEWISE}" \
      --config dflash="{\"method\": \"dflash\", \"model\": \"/tmp/full-shape/dflash\", $H7}" \
      --out "$R/compare-35b-2.json"
  fi
  ;;
profile)
  # where a round's time goes at the 35B shape: plain step vs an H-Spec round verifying no draft (w = 1)
  [ -d /tmp/full-shape ] || python3 examples/full_shape_models.py --out /tmp/full-shape > "$R/full_shape.log" 2>&1
  SIZES='"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 64]'
  EA="{\"mamba_ssm_cache_dtype\": \"float32\", \"max_model_len\": 2048, \"gpu_memory_utilization\": 0.9, \"additional_config\": {\"gdn_prefill_backend\": \"triton\"}, \"compilation_config\": {\"cudagraph_mode\": \"PIECEWISE\", $SIZES}}"
  # 1) the one-slot path at w = 1, 4 and 8 on one engine (vLLM's default FULL_AND_PIECEWISE: full graphs
  #    for plain decode steps, piecewise for spec steps), 2) vLLM's GDN spec path with vLLM's default
  #    graphs (full graphs for uniform 1+K batches) at w = 8, 3) plain decoding, piecewise
  EF="{\"mamba_ssm_cache_dtype\": \"float32\", \"max_model_len\": 2048, \"gpu_memory_utilization\": 0.9, \"additional_config\": {\"gdn_prefill_backend\": \"triton\"}, \"compilation_config\": {$SIZES}}"
  run prof-hspec python3 examples/profile_round.py --target /tmp/full-shape/target --load-format dummy --vocab 248000 \
    --speculative-config "{\"method\": \"hspec\", \"model\": \"/tmp/full-shape/hspec\", $H7, \"hybridspec\": {\"gdn_kernel\": true, \"fixed_length\": 1}}" \
    --lengths 1,4,8 --engine-args "$EF" --out "$R/hspec-one-slot"
  run prof-hspec-full python3 examples/profile_round.py --target /tmp/full-shape/target --load-format dummy --vocab 248000 \
    --speculative-config "{\"method\": \"hspec\", \"model\": \"/tmp/full-shape/hspec\", $H7, \"hybridspec\": {\"gdn_kernel\": false, \"fixed_length\": 8}}" \
    --engine-args "$EF" --out "$R/hspec-vllm-full-w8"
  run prof-plain python3 examples/profile_round.py --target /tmp/full-shape/target --load-format dummy --vocab 248000 \
    --engine-args "$EA" --out "$R/plain-piecewise"
  ;;
bench-dense|bench-hybrid)
  KIND="${STAGE#bench-}"
  SERVE="python3 -m vllm.entrypoints.openai.api_server --model models/$KIND --port 8000 --gpu-memory-utilization 0.3 --max-model-len 1024"
  [ "$KIND" = hybrid ] && SERVE="$SERVE --mamba-ssm-cache-dtype float32 --additional-config '{\"gdn_prefill_backend\": \"triton\"}'"
  declare -A SPEC=(
    [plain]=""
    [hspec]="{\"method\": \"hspec\", \"model\": \"models/$KIND-hspec\", $H7}"
    [hspec_sel]="{\"method\": \"hspec\", \"model\": \"models/$KIND-hspec\", $H7, \"hybridspec\": {\"policy\": \"models/hybrid-hspec/policy_cpu.json\"}}"
  )
  [ "$KIND" = dense ] && SPEC[dflash]="{\"method\": \"dflash\", \"model\": \"models/dense-dflash\", $H7}"
  [ "$KIND" = hybrid ] && SPEC[hspec_sel]="{\"method\": \"hspec\", \"model\": \"models/hybrid-hspec\", $H7, \"hybridspec\": {\"policy\": \"models/hybrid-hspec/policy_cpu.json\", \"gdn_kernel\": true}}"
  [ "$KIND" = dense ] && unset "SPEC[hspec_sel]"   # the committed policy is the hybrid drafter's
  for cfg in plain hspec hspec_sel dflash; do
    [ -n "${SPEC[$cfg]+x}" ] || continue
    cmd="$SERVE"; [ -n "${SPEC[$cfg]}" ] && cmd="$cmd --speculative-config '${SPEC[$cfg]}'"
    run "bench-$cfg" python3 -m vllm_hybridspec.cli bench --serve "$cmd" --prompts models/prompts/heldout.jsonl \
      --concurrency 1,4,16,64 --output-len 128 --label "$cfg" --no-progress -o "$R/$cfg.json"
  done
  python3 -m vllm_hybridspec.cli report "$R"/*.json --out-dir "$R/report" > "$R/report.log" 2>&1; tail -20 "$R/report/report.md"
  ;;
*) echo "unknown stage $STAGE"; exit 2 ;;
esac
