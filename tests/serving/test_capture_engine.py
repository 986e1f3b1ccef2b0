"""`hybridspec calibrate capture`: round records written from inside vLLM.

The reference dense target with its trained H-Spec and DFlash drafters (models/, committed) runs on
the CPU engine verifying every draft token; the records must account for exactly the rounds and
accepted tokens vLLM's own spec-decode counters report, carry the drafter's signals, and fit a policy.
The reference hybrid (an MoE target) adds each draft token's new experts, from which a policy with
the routing correction is fitted.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from vllm_hybridspec.tools.calibrate import calibrate_app
from vllm_hybridspec.policy.records import Rounds, load_records

MODELS = Path(__file__).resolve().parents[2] / "models"
ENGINE = json.dumps({"enforce_eager": True, "max_model_len": 512, "max_num_seqs": 8, "dtype": "float32"})


def capture(tmp_path, drafter: str, num_prompts: int = 6, output_len: int = 40,
            target: str = "dense") -> tuple[Rounds, str]:
    """The command line in a subprocess (vLLM's engine start needs real stdout/stderr file handles)."""
    out = tmp_path / f"{drafter}.jsonl"
    method = "hspec" if drafter.endswith("hspec") else "dflash"
    spec = json.dumps({"method": method, "model": str(MODELS / drafter), "num_speculative_tokens": 7})
    engine = ENGINE if target == "dense" else json.dumps({**json.loads(ENGINE), "mamba_ssm_cache_dtype": "float32"})
    result = subprocess.run([
        sys.executable, "-m", "vllm_hybridspec.cli", "calibrate", "capture", "--model", str(MODELS / target),
        "--speculative-config", spec, "--out", str(out), "--prompts", str(MODELS / "prompts" / "heldout.jsonl"),
        "--num-prompts", str(num_prompts), "--output-len", str(output_len), "--engine-args", engine],
        capture_output=True, text=True, timeout=900, check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    return Rounds.from_records(load_records(out)), result.stdout


def counters(output: str) -> tuple[int, int]:
    m = re.search(r"vLLM's counters: (\d+) drafts, (\d+) accepted tokens", output)
    assert m, output
    return int(m.group(1)), int(m.group(2))


@pytest.fixture(scope="module")
def hspec_capture(tmp_path_factory):
    return capture(tmp_path_factory.mktemp("capture"), "dense-hspec", num_prompts=8, output_len=48)


def test_hspec_records_account_for_every_verified_round(hspec_capture):
    rounds, output = hspec_capture
    drafts, accepted = counters(output)
    assert len(rounds) == drafts > 8 * 48 / 8  # one record per verified round; rounds emit at most 8 tokens
    assert int(rounds.accepted.sum()) == accepted
    assert rounds.draft_len == 7
    assert ((rounds.conf >= 0) & (rounds.conf <= 1)).all() and (rounds.ent >= 0).all()
    assert (rounds.accepted <= 7).all()
    # 48 tokens per request: the last rounds of each request are cut by the output limit
    assert rounds.truncated.any() and not rounds.truncated.all()
    assert ((rounds.remaining >= 1) & (rounds.remaining <= 8)).all()
    assert (rounds.remaining[~rounds.truncated] == 8).all()
    assert (rounds.n_new_l0 == -1).all() and (rounds.n_new_later == -1).all()  # a dense target has no experts


def test_moe_records_carry_each_draft_tokens_new_experts_and_fit_the_routing_correction(tmp_path):
    """The reference hybrid (8 MoE layers, top-4 of 32 experts): every round that verified all 7 drafts
    carries ``n_new_l0`` (0..4 new Layer-0 experts per draft token) and ``n_new_later`` (0..28 new
    (layer, expert) pairs in the 7 later layers); with Stage-0 and expert costs the records fit a policy
    with the routing correction."""
    rounds, output = capture(tmp_path, "hybrid-hspec", num_prompts=4, output_len=40, target="hybrid")
    drafts, accepted = counters(output)
    assert len(rounds) == drafts and int(rounds.accepted.sum()) == accepted
    full = ~rounds.truncated
    l0, later = rounds.n_new_l0[full], rounds.n_new_later[full]
    assert len(l0) >= 8 and l0.shape[1] == 7
    assert ((l0 >= 0) & (l0 <= 4)).all() and ((later >= 0) & (later <= 28)).all()
    assert 0 < float(l0.float().mean()) < 4 and 0 < float(later.float().mean()) < 28  # tokens share some experts
    assert (later >= l0).float().mean() > 0.5  # seven later layers bring more new pairs than the first
    records = tmp_path / "hybrid-hspec.jsonl"
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"version": 1, "round_ms": {"1": 4.1, "2": 4.6, "4": 5.3, "8": 7.0},
                                 "s_ms": 0.01, "eta_ms": 0.004, "experts_per_token": 4}))
    out = tmp_path / "policy.json"
    result = CliRunner().invoke(calibrate_app, ["fit", "--records", str(records), "--costs", str(costs),
                                                "--out", str(out), "--min-length", "1"])
    assert result.exit_code == 0, result.output
    routing = json.loads(out.read_text())["routing"]
    assert routing is not None and routing["experts_per_token"] == 4 and routing["later_layers"]


def test_hspec_confidence_predicts_acceptance(hspec_capture):
    """The trained drafter's first-token confidence separates accepted from rejected first drafts: the
    signals the selector needs are the right tokens' signals, in the right rows."""
    rounds, _ = hspec_capture
    first_ok = (rounds.accepted >= 1).double()
    conf = rounds.conf[:, 0]
    high = conf > conf.median()
    assert first_ok[high].mean() > first_ok[~high].mean() + 0.2


def test_dflash_adapter_records_match_vllm_counters(tmp_path):
    rounds, output = capture(tmp_path, "dense-dflash", num_prompts=4, output_len=24)
    drafts, accepted = counters(output)
    assert len(rounds) == drafts and int(rounds.accepted.sum()) == accepted
    assert ((rounds.conf >= 0) & (rounds.conf <= 1)).all()


def test_records_fit_a_policy(hspec_capture, tmp_path):
    rounds, _ = hspec_capture
    records = tmp_path / "records.jsonl"
    with open(records, "w") as f:
        for i in range(len(rounds)):
            f.write(json.dumps({"conf": rounds.conf[i].tolist(), "ent": rounds.ent[i].tolist(),
                                "accepted": int(rounds.accepted[i]), "truncated": bool(rounds.truncated[i]),
                                "remaining": int(rounds.remaining[i])}) + "\n")
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"version": 1, "round_ms": {"1": 4.1, "2": 4.6, "4": 5.3, "8": 7.0}}))
    out = tmp_path / "policy.json"
    result = CliRunner().invoke(calibrate_app, ["fit", "--records", str(records), "--costs", str(costs),
                                                "--out", str(out), "--min-length", "1"])
    assert result.exit_code == 0, result.output
    policy = json.loads(out.read_text())
    assert policy["draft_len"] == 7
    assert policy["fit"]["untruncated_rounds"] == int((~rounds.truncated).sum())


@pytest.mark.parametrize("spec, message", [
    ('{"method": "hspec", "model": "m", "num_speculative_tokens": 7, "hybridspec": {"fixed_length": 3}}',
     r"hybridspec.fixed_length.*= 3.*verifies every draft token"),
    ('{"method": "hspec", "model": "m"}', r"needs num_speculative_tokens"),
    ('{"method": ', r"--speculative-config is not valid JSON"),
])
def test_bad_capture_settings_fail_before_any_engine_starts(tmp_path, spec, message):
    result = CliRunner().invoke(calibrate_app, ["capture", "--model", str(MODELS / "dense"),
                                                "--speculative-config", spec, "--out", str(tmp_path / "r.jsonl")])
    assert result.exit_code == 2
    assert re.search(message, result.output), result.output
    assert not (tmp_path / "r.jsonl").exists()
