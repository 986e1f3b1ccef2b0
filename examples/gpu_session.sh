#!/usr/bin/env bash
# One GPU session's measurements (issues 5 and 6), in calls of at most 10 minutes; see docs/device.md.
# usage on the GPU machine, after the vLLM bundle (../shared/device/README.md):
#   bash examples/gpu_session.sh extras     # installs .devextras/e00 (carried) + checks the plugin imports
#   bash examples/gpu_session.sh ref        # reference hybrid (bf16): plain / H-Spec on vLLM's GDN path /
#                                           # one-slot GDN / + length selection; identity, KV, step sweep
#   bash examples/gpu_session.sh ref32      # the same in float32 (exact identity: no bf16 ties), identity only,
#                                           # + the reference dense with length selection (identity)
#   bash examples/gpu_session.sh dense      # reference dense: plain / H-Spec / DFlash (eager)
#   bash examples/gpu_session.sh dense-graphs  # the same with vLLM's default CUDA graphs (the drafter's too)
#                                           # and H-Spec + length selection, step sweeps
#   bash examples/gpu_session.sh record-35b, then eval-35b
#                                           # 35B shape, replayed acceptance: continuations from a plain
#                                           # engine, then costs, policy fit and plain / verify-all /
#                                           # selected lengths in one engine (evaluate_one_engine.py)
#   bash examples/gpu_session.sh vllm-35b   # same shape and replay on vLLM's own GDN spec path: step sweep
#   bash examples/gpu_session.sh gdn-graphs # reference hybrid, default graphs: the one-slot verification from
#                                           # CUDA graphs against the same engine without them
#   bash examples/gpu_session.sh tp2-35b    # two-GPU machine (nvidia-h200-x2): greedy identity at TP = 2, 35B
#                                           # shape, H-Spec + one-slot GDN + selection against plain TP = 2
#   bash examples/gpu_session.sh big1       # Qwen3.6-35B-A3B shape, dummy weights: plain, H-Spec + one-slot GDN
#   bash examples/gpu_session.sh big2       # same shape: H-Spec on vLLM's GDN path, DFlash
#   bash examples/gpu_session.sh profile    # 35B shape: torch.profiler of plain steps and H-Spec w = 1 rounds
#   bash examples/gpu_session.sh graphs     # the drafter's CUDA graphs vs eager rounds, no engine (seconds)
#   bash examples/gpu_session.sh calib-35b  # 35B-shape cost file + policy (issue 6)
#   bash examples/gpu_session.sh bench-35b-switch / bench-35b-plain (or -all, -sel, -dyn)
#                                           # (env: LEVELS, REPEATS, SWITCHES="off all sel sel-nogate",
#                                           #  BENCH_ARGS: more `hybridspec bench` options)
#                                           # issue 7 (b, c): 35B shape, replayed acceptance, C = 1..128;
#                                           # -switch: one server, four settings of its length selector
#   bash examples/gpu_session.sh bench-gdn  # issue 2: the kernel table (examples/bench_gdn_kernels.py)
#   bash examples/gpu_session.sh tune-gdn   # issue 2: launch sweep where the targets are missed (tune_gdn_round.py)
#   bash examples/gpu_session.sh calib-hybrid  # issue 7 (a): the reference hybrid's policy fitted to this GPU's costs
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
  ARGS=("${COMMON[@]}")
  # float32 is for exact identity: no step sweeps (the bf16 run times the steps)
  [ "$STAGE" = ref32 ] && ARGS=(--prompts models/prompts/heldout.jsonl --num-prompts 24 --max-tokens 128 --bs1-prompts 0
                                --enforce-eager --isolate --logprobs --gpu-mem 0.25)
  run hybrid python3 examples/vllm_compare.py --target models/hybrid "${ARGS[@]}" --dtype "$DT" \
    --additional-config '{"gdn_prefill_backend": "triton"}' --llm-kwargs '{"mamba_ssm_cache_dtype": "float32"}' \
    --config plain=none \
    --config hspec="{$HH, $H7, \"hybridspec\": {\"gdn_kernel\": false, \"fixed_length\": 8}}" \
    --config hspec_gdn="{$HH, $H7, \"hybridspec\": {\"gdn_kernel\": true, \"fixed_length\": 8}}" \
    --config hspec_sel="{$HH, $H7, \"hybridspec\": {\"gdn_kernel\": true, \"policy\": \"models/hybrid-hspec/policy_cpu.json\", \"gate\": false}}" \
    --out "$R/compare-hybrid-$DT.json"
  if [ "$STAGE" = ref32 ]; then
    # the dense reference with length selection (the hybrid drafter's CPU policy only picks the lengths here;
    # identity must hold for any policy), gate off so every step speculates
    run dense-sel python3 examples/vllm_compare.py --target models/dense "${ARGS[@]}" --dtype float32 \
      --config plain=none \
      --config hspec_sel="{\"method\": \"hspec\", \"model\": \"models/dense-hspec\", $H7, \"hybridspec\": {\"policy\": \"models/hybrid-hspec/policy_cpu.json\", \"gate\": false}}" \
      --out "$R/compare-dense-sel-float32.json"
  fi
  ;;
dense-graphs)
  # the reference dense with vLLM's default CUDA graphs, the H-Spec drafter's own graphs included
  run dense-graphs python3 examples/vllm_compare.py --target models/dense --prompts models/prompts/heldout.jsonl \
    --num-prompts 24 --max-tokens 128 --bs1-prompts 0 --isolate --logprobs --gpu-mem 0.25 \
    --sweep-lengths 1,2,4,8 --sweep-batches 1,4 --sweep-steps 48 --sweep-warmup 8 \
    --config plain=none \
    --config hspec="{\"method\": \"hspec\", \"model\": \"models/dense-hspec\", $H7, \"hybridspec\": {\"fixed_length\": 8}}" \
    --config dflash="{\"method\": \"dflash\", \"model\": \"models/dense-dflash\", $H7, \"hybridspec\": {\"fixed_length\": 8}}" \
    --out "$R/compare-dense-graphs.json"
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
graphs)
  # the drafter's CUDA graphs against eager rounds, no engine (seconds; needs the bundle + extras)
  python3 examples/check_draft_graphs.py --out "$R/draft_graphs.json" 2>&1 | grep -v "^INFO\|^WARNING" | tail -40
  ;;
calib-35b)
  # issue 6: the 35B-shape policy. Per-round costs of the dummy H-Spec drafter + one-slot GDN at fixed
  # lengths (and plain decoding) at the 35B shape, fitted with the reference drafter's round records
  # (acceptance behaviour of a real drafter; its signals are what the policy reads). Two engine starts.
  [ -d /tmp/full-shape ] || python3 examples/full_shape_models.py --out /tmp/full-shape > "$R/full_shape.log" 2>&1
  run costs python3 -m vllm_hybridspec.cli calibrate costs --model /tmp/full-shape/target \
    --speculative-config "{\"method\": \"hspec\", \"model\": \"/tmp/full-shape/hspec\", $H7, \"hybridspec\": {\"gdn_kernel\": true}}" \
    --lengths 1,2,3,4,6,8 --batch-sizes 1,4 --plain --vocab 248000 --prompt-len 128 --out "$R/costs_35b.json" \
    --engine-args '{"load_format": "dummy", "max_model_len": 2048, "max_num_seqs": 8, "mamba_ssm_cache_dtype": "float32", "additional_config": {"gdn_prefill_backend": "triton"}}'
  run fit python3 -m vllm_hybridspec.cli calibrate fit --records models/hybrid-hspec/records.jsonl.gz \
    --costs "$R/costs_35b.json" --out "$R/policy_35b.json" --min-length 1
  ;;
calib-hybrid)
  # issue 7 (a): the reference hybrid's GPU policy. Per-round costs of its H-Spec drafter + one-slot GDN at
  # fixed lengths and plain decoding on this GPU (the committed policy_cpu.json was fitted to CPU costs),
  # fitted with the drafter's own round records. Writes $R/policy_hybrid.json, which bench-hybrid uses.
  run costs python3 -m vllm_hybridspec.cli calibrate costs --model models/hybrid \
    --speculative-config "{\"method\": \"hspec\", \"model\": \"models/hybrid-hspec\", $H7, \"hybridspec\": {\"gdn_kernel\": true}}" \
    --lengths 1,2,3,4,6,8 --batch-sizes 1,4,16,64 --plain --prompts models/prompts/heldout.jsonl --out "$R/costs_hybrid.json" \
    --engine-args '{"max_model_len": 1024, "gpu_memory_utilization": 0.3, "mamba_ssm_cache_dtype": "float32", "additional_config": {"gdn_prefill_backend": "triton"}}'
  run fit python3 -m vllm_hybridspec.cli calibrate fit --records models/hybrid-hspec/records.jsonl.gz \
    --costs "$R/costs_hybrid.json" --out "$R/policy_hybrid.json" --min-length 1
  ;;
record-35b)
  # issues 6 and 7 (b): the greedy continuations the replay proposer drafts from, by a plain engine (eager:
  # a shorter start; eval-35b checks its outputs against them); token-id prompts, since the 35B-shape
  # directory has no tokenizer (the servers run --skip-tokenizer-init)
  [ -d /tmp/full-shape ] || python3 examples/full_shape_models.py --out /tmp/full-shape > "$R/full_shape.log" 2>&1
  python3 -c "import json, random; r = random.Random(0); print(''.join(json.dumps({'prompt': [r.randrange(248000) for _ in range(r.randrange(64, 129))]}) + '\n' for _ in range(${NPROMPTS:-32})), end='')" > /tmp/prompts_35b.jsonl
  run record python3 -m vllm_hybridspec.cli replay-record --model /tmp/full-shape/target --load-format dummy \
    --prompts /tmp/prompts_35b.jsonl --output-len "${OUTLEN:-128}" --num-speculative-tokens 7 --max-model-len 2048 -o /tmp/cont_35b.jsonl \
    --engine-args "{\"skip_tokenizer_init\": true, \"enforce_eager\": ${EAGER:-false}, \"mamba_ssm_cache_dtype\": \"float32\", \"additional_config\": {\"gdn_prefill_backend\": \"triton\"}}"
  cp /tmp/prompts_35b.jsonl /tmp/cont_35b.jsonl "$R/" 2>/dev/null
  ;;
eval-35b|vllm-35b)
  # after record-35b: the 35B shape with the replay proposer (acceptance as the reference hybrid drafter's
  # recorded rounds, which the policy is fitted to as well). eval-35b: one engine with the one-slot GDN
  # layer for costs, policy and plain / verify-all / selected lengths (evaluate_one_engine.py); vllm-35b: vLLM's
  # own GDN spec path (a state slot per draft token), default graphs, step sweep at fixed lengths
  [ -d /tmp/full-shape ] || python3 examples/full_shape_models.py --out /tmp/full-shape > "$R/full_shape.log" 2>&1
  SIZES='"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 64]'
  REPLAY="\"method\": \"replay_bench\", $H7, \"replay_bench\": {\"records\": \"models/hybrid-hspec/records.jsonl.gz\", \"continuations\": \"/tmp/cont_35b.jsonl\", \"seed\": 0}"
  if [ "$STAGE" = eval-35b ]; then
    run eval python3 examples/evaluate_one_engine.py --target /tmp/full-shape/target --prompts /tmp/cont_35b.jsonl \
      --num-prompts 8 --speculative-config "{$REPLAY, \"hybridspec\": {\"gdn_kernel\": true}}" \
      --engine-args "{\"load_format\": \"dummy\", \"max_model_len\": 2048, \"gpu_memory_utilization\": 0.9, \"mamba_ssm_cache_dtype\": \"float32\", \"additional_config\": {\"gdn_prefill_backend\": \"triton\"}, \"compilation_config\": {$SIZES}}" \
      --records models/hybrid-hspec/records.jsonl.gz --lengths 1,2,3,4,6,8 --batch-sizes 1,4 --steps 40 --warmup 6 \
      --max-tokens 64 --reference /tmp/cont_35b.jsonl --out-dir "$R/eval-35b"
  else
    run vllm-gdn python3 examples/vllm_compare.py --target /tmp/full-shape/target --load-format dummy \
      --prompts /tmp/cont_35b.jsonl --num-prompts 8 --max-tokens 64 --bs1-prompts 0 --max-model-len 2048 --max-num-seqs 8 \
      --gpu-mem 0.9 --sweep-lengths 1,2,4,8 --sweep-batches 1,4 --sweep-steps 40 --sweep-warmup 6 \
      --additional-config '{"gdn_prefill_backend": "triton"}' \
      --llm-kwargs "{\"mamba_ssm_cache_dtype\": \"float32\", \"compilation_config\": {$SIZES}}" \
      --config replay_vllm_gdn="{$REPLAY, \"hybridspec\": {\"gdn_kernel\": false, \"fixed_length\": 8}}" \
      --out "$R/compare-35b-vllm-gdn.json"
  fi
  ;;
gdn-graphs)
  run gdn-graphs python3 examples/check_gdn_graphs.py --target models/hybrid --prompts models/prompts/heldout.jsonl \
    --num-prompts 16 --max-tokens 64 --steps 40 --warmup 6 \
    --speculative-config "{\"method\": \"hspec\", \"model\": \"models/hybrid-hspec\", $H7, \"hybridspec\": {\"fixed_length\": 8, \"gdn_cudagraphs\": true}}" \
    --engine-args '{"mamba_ssm_cache_dtype": "float32", "max_model_len": 1024, "gpu_memory_utilization": 0.3, "additional_config": {"gdn_prefill_backend": "triton"}}' \
    --out "$R/gdn_graphs.json"
  grep -E "^(graphs|eager)" "$R/gdn-graphs.log"
  ;;
tp2-35b)
  # issue 6: greedy identity at tensor parallel size 2 (needs two GPUs). The GDN heads are sharded, the
  # verify and commit run on each rank's shard, the replicated drafter all-gathers the KV heads, and the
  # selected lengths are broadcast from rank 0. Policy: the 35B one of 2026-12-01, gate off so every step
  # speculates. The proposer lives in the worker processes, so there is no step sweep.
  [ -d /tmp/full-shape ] || python3 examples/full_shape_models.py --out /tmp/full-shape > "$R/full_shape.log" 2>&1
  SIZES='"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 64]'
  HS="\"method\": \"hspec\", \"model\": \"/tmp/full-shape/hspec\", $H7"
  run tp2 python3 examples/vllm_compare.py --target /tmp/full-shape/target --load-format dummy --random-prompts \
    --vocab 248000 --prompt-len 128 --num-prompts 8 --max-tokens 64 --bs1-prompts 0 --max-model-len 2048 \
    --max-num-seqs 8 --gpu-mem 0.9 --logprobs --isolate --additional-config '{"gdn_prefill_backend": "triton"}' \
    --llm-kwargs "{\"mamba_ssm_cache_dtype\": \"float32\", \"tensor_parallel_size\": 2, \"distributed_executor_backend\": \"mp\", \"compilation_config\": {$SIZES}}" \
    --config plain=none \
    --config hspec_sel="{$HS, \"hybridspec\": {\"gdn_kernel\": true, \"policy\": \"docs/benchmarks/h200-2026-12-01/eval-35b/policy.json\", \"gate\": false}}" \
    --out "$R/compare-35b-tp2.json"
  ;;
bench-gdn)
  # issue 2: the kernel table (ours: chunkwise and recurrent verify + the one-launch commit; vLLM's
  # per-token-state path; fla), accuracy checked first, launch and bandwidth floors measured in the run
  run bench-gdn python3 examples/bench_gdn_kernels.py --no-tune --tune-recurrent \
    --out "$R/gdn_kernels.md" --json "$R/gdn_kernels.json"
  grep -E "^(w=|tune recurrent: best|launch floor|device|ACCURACY|done)" "$R/bench-gdn.log"
  ;;
tune-gdn)
  # issue 2: launch sweep of the commit / chunkwise / recurrent kernels where the targets are missed (no
  # vLLM needed: can run before the bundle, on a fresh machine)
  run tune-gdn python3 examples/tune_gdn_round.py --out "$R/tune.jsonl"
  grep -E "^best" "$R/tune-gdn.log"
  ;;
bench-35b-switch|bench-35b-plain|bench-35b-all|bench-35b-sel|bench-35b-dyn)
  # issue 7 (b, c): closed loop against `vllm serve` of the 35B shape (dummy weights), replayed acceptance
  # (replay_bench: the reference drafter's round records, the greedy continuations committed by eval-35b on
  # 2026-12-01). -switch: ONE speculative server, its length selector switched in place between sweeps
  # (vllm_hybridspec.engine.length.control): drafting off, every draft verified, the committed 35B policy with and without
  # its batch gate. -plain: the same server without speculation. -all/-sel/-dyn: one server per setting.
  [ -d /tmp/full-shape ] || python3 examples/full_shape_models.py --out /tmp/full-shape > "$R/full_shape.log" 2>&1
  CFG="${STAGE#bench-35b-}"
  CONT=docs/benchmarks/h200-2026-12-01/eval-35b/continuations.jsonl
  python3 -c "import json, sys; [print(json.dumps({'prompt': json.loads(l)['prompt_token_ids']})) for l in open(sys.argv[1])]" "$CONT" > /tmp/prompts_35b.jsonl
  POLICY="${POLICY:-docs/benchmarks/h200-2026-12-01/eval-35b/policy.json}"
  # vLLM's own GDN path (dyn) keeps 1 + K states per request slot (63 MB each at this shape): 128 slots
  # would not fit next to the weights, and (b) only asks for C = 1 and 4 there
  if [ "$CFG" = dyn ]; then SEQS="${MAX_SEQS:-8}"; LEVELS="${LEVELS:-1,4}"; SIZES="1, 2, 4, 8, 16, 32, 64"
  else SEQS="${MAX_SEQS:-128}"; SIZES="1, 2, 4, 8, 16, 32, 64, 128"; fi
  LEVELS="${LEVELS:-1,4,16,64,128}"
  REPLAY="\"method\": \"replay_bench\", $H7, \"replay_bench\": {\"records\": \"models/hybrid-hspec/records.jsonl.gz\", \"continuations\": \"$CONT\", \"seed\": 0}"
  SERVE="python3 -m vllm.entrypoints.openai.api_server --model /tmp/full-shape/target --load-format dummy --skip-tokenizer-init --port 8000 --max-model-len 2048 --max-num-seqs $SEQS --mamba-ssm-cache-dtype float32 --additional-config '{\"gdn_prefill_backend\": \"triton\"}' --compilation-config '{\"cudagraph_capture_sizes\": [$SIZES]}'"
  SWITCH=()
  case "$CFG" in
    plain) SPEC="" ;;
    switch) SPEC="{$REPLAY, \"hybridspec\": {\"gdn_kernel\": true}}"
            declare -A OPT=([off]='{"drafting": false}' [all]='{}' [sel]="{\"policy\": \"$POLICY\"}"
                            [sel-nogate]="{\"policy\": \"$POLICY\", \"gate\": false}")
            for name in ${SWITCHES:-off all sel sel-nogate}; do SWITCH+=(--switch "$name=${OPT[$name]}"); done ;;
    all) SPEC="{$REPLAY, \"hybridspec\": {\"gdn_kernel\": true}}" ;;
    sel) SPEC="{$REPLAY, \"hybridspec\": {\"gdn_kernel\": true, \"policy\": \"$POLICY\"}}" ;;
    dyn) SPEC="{$REPLAY, \"num_speculative_tokens_per_batch_size\": [[1, 2, 7], [3, 8, 3]]}" ;;
  esac
  cmd="$SERVE"; [ -n "$SPEC" ] && cmd="$cmd --speculative-config '$SPEC'"
  run "bench-$CFG" python3 -m vllm_hybridspec.cli bench --serve "$cmd" --prompts /tmp/prompts_35b.jsonl \
    --concurrency "$LEVELS" --output-len 128 --label "35b-$CFG" --repeats "${REPEATS:-1}" --no-progress ${BENCH_ARGS:-} \
    -o "$R/35b-$CFG.json" "${SWITCH[@]}"
  grep -E "^(C=|[a-z-]+:$)|switched|error" "$R/bench-$CFG.log" | head -40
  grep -hE "GPU KV cache size|Maximum concurrency|left its recorded" "$R"/*.server.log | head -8
  ;;
bench-dense|bench-hybrid)
  KIND="${STAGE#bench-}"
  SERVE="python3 -m vllm.entrypoints.openai.api_server --model models/$KIND --port 8000 --gpu-memory-utilization 0.3 --max-model-len 1024"
  [ "$KIND" = hybrid ] && SERVE="$SERVE --mamba-ssm-cache-dtype float32 --additional-config '{\"gdn_prefill_backend\": \"triton\"}'"
  declare -A SPEC=(
    [plain]=""
    [hspec]="{\"method\": \"hspec\", \"model\": \"models/$KIND-hspec\", $H7}"
  )
  [ "$KIND" = dense ] && SPEC[dflash]="{\"method\": \"dflash\", \"model\": \"models/dense-dflash\", $H7}"
  # hybrid: H-Spec (one-slot GDN, every draft verified) and H-Spec + HybridSpec verification are two
  # settings of ONE server (--switch), so the pair costs one start; the policy is calib-hybrid's GPU fit
  # when this machine has it (POLICY overrides), else the committed CPU fit
  HPOL="${POLICY:-/tmp/hs-results/calib-hybrid/policy_hybrid.json}"; [ -f "$HPOL" ] || HPOL=models/hybrid-hspec/policy_cpu.json
  [ "$KIND" = hybrid ] && SPEC[hspec]="{\"method\": \"hspec\", \"model\": \"models/hybrid-hspec\", $H7, \"hybridspec\": {\"gdn_kernel\": true}}"
  for cfg in ${CONFIGS:-plain hspec dflash}; do
    [ -n "${SPEC[$cfg]+x}" ] || continue
    cmd="$SERVE"; [ -n "${SPEC[$cfg]}" ] && cmd="$cmd --speculative-config '${SPEC[$cfg]}'"
    SW=(); [ "$KIND" = hybrid ] && [ "$cfg" = hspec ] && SW=(--switch 'all={}' --switch "sel={\"policy\": \"$HPOL\"}")
    run "bench-$cfg" python3 -m vllm_hybridspec.cli bench --serve "$cmd" --prompts models/prompts/heldout.jsonl \
      --concurrency "${LEVELS:-1,4,16,64}" --output-len 128 --label "$cfg" --repeats "${REPEATS:-3}" --no-progress \
      -o "$R/$cfg.json" "${SW[@]}"
  done
  echo "policy of the hybrid's sel setting: $HPOL"
  python3 -m vllm_hybridspec.cli report "$R"/*.json --out-dir "$R/report" > "$R/report.log" 2>&1; tail -20 "$R/report/report.md"
  ;;
*) echo "unknown stage $STAGE"; exit 2 ;;
esac
