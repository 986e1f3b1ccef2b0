"""``hybridspec evaluate`` (``vllm_hybridspec/tools/evaluate.py``) on the CPU: one engine of the
reference hybrid target with its trained H-Spec drafter and the one-slot GDN layer measures the costs
(fixed lengths, and plain steps with drafting off), fits a policy to the drafter's committed round
records, and decodes in every mode; the modes' greedy outputs, vLLM's counters and the selector's
lengths must agree with each other, and every mode's greedy output must pass the shared identity check
(``identity.py``) against a separate plain engine.

The engine runs in a child process with ``OMP_NUM_THREADS=1`` (see test_costs_engine.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_hybridspec.tools.evaluate import identical_prompts
from vllm_hybridspec.policy.cost import load_costs
from vllm_hybridspec.policy.policy_file import load_policy

from .identity import TIES, GreedyRun, check_identity
from ..seeds import fresh_seed

pytestmark = pytest.mark.timeout(900)

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "models"
K = 7
SPEC = {"method": "hspec", "model": str(MODELS / "hybrid-hspec"), "num_speculative_tokens": K,
        "hybridspec": {"gdn_kernel": True}}
ENGINE = {"enforce_eager": True, "max_model_len": 512, "max_num_batched_tokens": 1024, "dtype": "float32",
          "mamba_ssm_cache_dtype": "float32"}
LENGTHS, BATCHES, PROMPTS, STEPS, MAX_TOKENS = [1, 2, 4, 8], [1, 2], 6, 6, 24


RECORDS = MODELS / "hybrid-hspec" / "records.jsonl.gz"


def run_child(args: list[str]) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_TARGET_DEVICE": "cpu", "TRITON_INTERPRET": "1",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=800, check=False)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    print(proc.stdout[-3000:])
    return proc.stdout


def evaluate_args(spec: dict, prompts: Path, out: Path, lengths=LENGTHS, modes=None) -> list[str]:
    return ["-m", "vllm_hybridspec.cli", "evaluate", "--model", str(MODELS / "hybrid"), "--prompts", str(prompts),
            "--num-prompts", str(PROMPTS), "--speculative-config", json.dumps(spec),
            "--engine-args", json.dumps(ENGINE), "--records", str(RECORDS),
            "--lengths", ",".join(map(str, lengths)), "--batch-sizes", ",".join(map(str, BATCHES)),
            "--steps", str(STEPS), "--warmup", "3", "--max-tokens", str(MAX_TOKENS), "--out-dir", str(out),
            *(["--modes", modes] if modes else [])]


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    out = tmp_path_factory.mktemp("evaluate")
    stdout = run_child([*evaluate_args(SPEC, MODELS / "prompts" / "heldout.jsonl", out), "--logprobs"])
    return out, json.loads((out / "evaluate.json").read_text()), stdout


@pytest.fixture(scope="module")
def plain_engine(tmp_path_factory):
    """Greedy decoding of the same prompts by a separate plain engine with the same settings
    (``hybridspec compare`` with plain decoding only), with the top-2 log-probabilities."""
    out = tmp_path_factory.mktemp("plain") / "plain.json"
    run_child(["-m", "vllm_hybridspec.cli", "compare", "--model", str(MODELS / "hybrid"),
               "--prompts", str(MODELS / "prompts" / "heldout.jsonl"), "--num-prompts", str(PROMPTS),
               "--config", "plain=none", "--max-tokens", str(MAX_TOKENS), "--bs1-prompts", "0", "--logprobs",
               "--engine-args", json.dumps({**ENGINE, "max_num_seqs": PROMPTS}), "--out", str(out)])
    raw = json.loads(out.read_text())
    return GreedyRun.from_compare(raw["results"][0], raw["prompts"])


def test_costs_and_policy_from_one_engine(evaluated):
    """The cost file has every length at every batch size, with plain step times (drafting off) for the
    gate at B = 1 and 2; the fitted policy loads and has a gate entry for both batch sizes."""
    out, result, _ = evaluated
    costs = load_costs(out / "costs.json")
    assert sorted(costs.round_ms) == LENGTHS and sorted(costs.batched) == BATCHES
    for b in BATCHES:
        assert sorted(costs.batched[b].round_ms) == LENGTHS
        assert costs.batched[b].plain_ms is not None and costs.batched[b].plain_ms > 0
    gated = [r for r in result["costs"] if r.get("plain") == "gated"]
    assert sorted(r["batch"] for r in gated) == BATCHES
    for r in gated:  # drafting off: exactly one token per request per step
        assert r["tokens_per_step"] == r["batch"]
    policy = load_policy(out / "policy.json")
    assert policy.draft_len == K and sorted(policy.gate) == BATCHES
    assert result["policy_gate"] == {str(b): policy.gate[b] for b in BATCHES}


def test_every_mode_gives_plain_decodings_greedy_output(evaluated):
    """Greedy outputs of all prompts are token-for-token those of the plain mode in every mode, and the
    engine's KV capacity is reported."""
    _, result, stdout = evaluated
    modes = result["modes"]
    assert list(modes) == ["plain", "all", "sel", "sel-nogate", "sel-batched"]
    plain = modes["plain"]["outputs"]
    assert len(plain) == PROMPTS and all(len(t) == MAX_TOKENS for t in plain)
    assert len({tuple(t) for t in plain}) > 1  # the prompts give different continuations
    for mode, r in modes.items():
        assert identical_prompts(r["outputs"], plain) == PROMPTS, mode
    assert result["kv_capacity_tokens"] > 0
    assert "| sel-nogate |" in stdout


def test_every_mode_passes_the_identity_check_against_a_separate_plain_engine(evaluated, plain_engine):
    """Every mode (``plain`` too: vLLM's own path inside the speculative engine) against a plain engine
    of its own: all prompts identical, and the log-probabilities at every position within the reference
    hybrid's reordering noise."""
    _, result, _ = evaluated
    assert result["prompts"] == plain_engine.prompts
    for mode, r in result["modes"].items():
        check_identity(GreedyRun.from_compare(r, result["prompts"]), plain_engine, f"evaluate, mode {mode}",
                       tie=TIES["reference-hybrid"], min_identical=PROMPTS)


def test_modes_verify_what_they_say(evaluated):
    """plain: no draft verified, every step gated, one token per request per step. all: every row that
    has the budget verifies K + 1 tokens. sel-nogate and sel-batched: the lengths the selector chose are
    what the target verified (the drafts the cut let the rejection sampler see equal the sum over rows
    of w - 1; vLLM schedules and counts K per drafted row) and, for sel-nogate, some rows verify fewer
    than K + 1 tokens; accepted drafts never exceed verified ones."""
    _, result, _ = evaluated
    modes = result["modes"]
    plain = modes["plain"]
    assert plain["spec_counters"].get("num_draft_tokens", 0) == 0 and plain["gated_steps"] > 0
    for b, s in plain["steps"].items():
        assert s["tokens_per_step"] == int(b)
    for name in ("all", "sel-nogate", "sel-batched"):  # sel-batched: the batch gate may turn steps off
        r = modes[name]
        lengths = {int(w): n for w, n in r["rows_at_length"].items()}
        verified = sum((w - 1) * n for w, n in lengths.items())
        assert r["verified_drafts"] == verified, (name, lengths, r["verified_drafts"])
        counters = r["spec_counters"]
        assert counters.get("num_draft_tokens", 0) == K * counters.get("num_drafts", 0), (name, counters)
        assert 0 <= counters.get("num_accepted_tokens", 0) <= verified
        assert name == "sel-batched" or r["gated_steps"] == 0
        for b, s in r["steps"].items():
            assert int(b) <= s["tokens_per_step"] <= int(b) * (K + 1)
    all_lengths = {int(w): n for w, n in modes["all"]["rows_at_length"].items()}
    assert max(all_lengths, key=all_lengths.get) == K + 1  # short rounds only where the budget ends
    sel_lengths = {int(w): n for w, n in modes["sel-nogate"]["rows_at_length"].items()}
    assert sum(n for w, n in sel_lengths.items() if w < K + 1) > 0


def test_replayed_acceptance_against_a_separate_plain_engine(tmp_path):
    """The 35B-shape recipe on the CPU: a plain engine records greedy continuations
    (``hybridspec replay-record``), then one engine with the replay proposer (the H-Spec drafter runs,
    its drafts are replaced by replayed ones at its recorded acceptance) and the one-slot GDN layer
    evaluates. Every mode gives the plain engine's greedy output
    on every prompt, no request leaves its recording, and verify-all accepts what the records say on
    average (the replay corrupts each draft at a recorded rejection point)."""
    import random

    rng = random.Random(fresh_seed("evaluate_engine_replayed_acceptance_agai"))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": [rng.randrange(8192) for _ in range(rng.randrange(24, 49))]})
                               + "\n" for _ in range(PROMPTS)))
    cont = tmp_path / "continuations.jsonl"
    run_child(["-m", "vllm_hybridspec.cli", "replay-record", "--model", str(MODELS / "hybrid"), "--prompts",
               str(prompts), "--output-len", "96", "--num-speculative-tokens", str(K), "--max-model-len", "512",
               "-o", str(cont), "--engine-args", json.dumps({"skip_tokenizer_init": True, **ENGINE})])
    spec = {**SPEC, "method": "replay_bench",  # the trained drafter runs every round, its drafts replaced
            "replay_bench": {"records": str(RECORDS), "continuations": str(cont), "seed": 0}}
    out = tmp_path / "evaluate"
    run_child([*evaluate_args(spec, cont, out, lengths=[1, 4, 8], modes="plain,all,sel-nogate"),
               "--reference", str(cont)])
    result = json.loads((out / "evaluate.json").read_text())
    for mode, r in result["modes"].items():
        assert r["identical_to_plain_engine"] == PROMPTS, mode
    stats = result["drafter_stats"]
    assert stats["unrecorded_requests"] == stats["left_requests"] == 0 and stats["rounds"] > 0
    acc = result["modes"]["all"]["mean_acceptance_length"]
    assert 1.0 < acc < K + 1
    assert abs(acc - (1 + stats["records_mean_accepted"])) < 0.6, (acc, stats)


@pytest.mark.parametrize("change, message", [
    ({"modes": ["plain", "fast"]}, r"unknown modes \['fast'\]"),
    ({"records": None}, "the 'sel' modes need --records"),
    ({"lengths": [1, 9]}, r"--lengths \[9\] outside 1..num_speculative_tokens \+ 1 = 8"),
    ({"spec": {**SPEC, "hybridspec": {"fixed_length": 3}}}, r"may not set \['fixed_length'\]"),
    ({"prompts": []}, "no prompts"),
    ({"policy": "/nonexistent/policy.json", "records": None}, "policy file '/nonexistent/policy.json' does not exist"),
], ids=["unknown-mode", "sel-without-policy", "length-past-K+1", "fixed-length-given", "no-prompts", "missing-policy"])
def test_bad_settings_fail_before_an_engine_starts(monkeypatch, tmp_path, change, message):
    """Each bad setting is a ValueError naming it, raised before ``vllm.LLM`` is constructed."""
    import vllm

    from vllm_hybridspec.tools.evaluate import evaluate

    def no_engine(*args, **kwargs):
        raise AssertionError("an engine was started for bad input")

    monkeypatch.setattr(vllm, "LLM", no_engine)
    args = {"spec": SPEC, "prompts": [{"prompt_token_ids": [1, 2, 3]}], "records": str(RECORDS),
            "lengths": LENGTHS, "modes": None, "policy": None, **change}
    with pytest.raises(ValueError, match=message):
        evaluate(str(MODELS / "hybrid"), args["spec"], ENGINE, args["prompts"], tmp_path / "out",
                 records=args["records"], policy=args["policy"], lengths=args["lengths"],
                 **({"modes": args["modes"]} if args["modes"] else {}))
