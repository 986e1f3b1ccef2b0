"""Every command that reads a policy, cost, records, ``compare`` or ``evaluate`` file answers any file its
model accepts without a traceback: files are generated inside each model (a valid file whose numbers, nulls
and optional fields are redrawn from the model's own JSON schema: its ranges' ends, values inside them, null
where the model allows it), and each command must exit 0, or 2 with one line."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
from pydantic import BaseModel, ValidationError
from typer.testing import CliRunner

from vllm_hybridspec.cli import app
from vllm_hybridspec.policy.cost import CostFile
from vllm_hybridspec.policy.policy_file import PolicyFile
from vllm_hybridspec.policy.records import RoundRecord
from vllm_hybridspec.policy.synthetic import synthesize, synthetic_costs
from vllm_hybridspec.tools.result_files import CompareResult, EvaluateResult

from ..seeds import fresh_seed

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "docs/benchmarks/h200-2026-12-01"
runner = CliRunner()


def _options(root: dict, node: dict) -> list[dict]:
    """``node``'s alternatives with every ``$ref`` followed."""
    if "$ref" in node:
        return _options(root, root["$defs"][node["$ref"].split("/")[-1]])
    if "anyOf" in node:
        return [o for alt in node["anyOf"] for o in _options(root, alt)]
    return [node]


def _child(root: dict, nodes: list[dict], key) -> list[dict]:
    """The schemas of the value under ``key`` (a property name, a map key or a list index)."""
    out = []
    for n in nodes:
        if isinstance(key, int) and n.get("type") == "array":
            items = n.get("prefixItems")
            out += _options(root, items[key] if items and key < len(items) else n.get("items", {}))
        elif isinstance(key, str) and n.get("type") == "object":
            if key in n.get("properties", {}):
                out += _options(root, n["properties"][key])
            elif isinstance(n.get("additionalProperties"), dict):
                out += _options(root, n["additionalProperties"])
    return out


def _number(rng: random.Random, n: dict, integer: bool):
    lo = n.get("minimum", n.get("exclusiveMinimum", -1e6 if not integer else -10**6))
    hi = n.get("maximum", n.get("exclusiveMaximum", 1e6 if not integer else 10**6))
    if integer:
        lo, hi = math.ceil(lo) + ("exclusiveMinimum" in n), math.floor(hi) - ("exclusiveMaximum" in n)
        return rng.choice([lo, hi, rng.randint(lo, hi), rng.randint(lo, min(hi, lo + 20))])
    tiny = 1e-9 * max(1.0, abs(lo))
    ends = [lo + tiny if "exclusiveMinimum" in n else lo, hi - tiny if "exclusiveMaximum" in n else hi]
    inside = rng.uniform(lo, hi)
    if lo > 0:  # log-uniform: small values as often as large ones
        inside = math.exp(rng.uniform(math.log(ends[0]), math.log(ends[1])))
    return float(rng.choice(ends + [inside, inside, min(max(0.0, lo), hi) if lo <= 0 <= hi else inside]))


def _draw(rng: random.Random, nodes: list[dict], old):
    """A new leaf value from one of ``nodes`` (numbers, null, booleans, text); ``old`` where none is a leaf."""
    leaves = [n for n in nodes if n.get("type") in ("number", "integer", "null", "boolean", "string")]
    if not leaves:
        return old
    n = rng.choice(leaves)
    kind = n["type"]
    if kind == "null":
        return None
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "string":
        if "enum" in n or "const" in n:
            return old
        return rng.choice([old if isinstance(old, str) else "x", "", "error text"])
    return _number(rng, n, kind == "integer")


def mutate(rng: random.Random, root: dict, nodes: list[dict], value, p: float):
    """``value`` with each leaf redrawn from its schema with probability ``p``; optional properties the
    value leaves out are added now and then (as null where allowed)."""
    if isinstance(value, dict):
        out = {k: mutate(rng, root, _child(root, nodes, k), v, p) for k, v in value.items()}
        for n in nodes:
            for name, prop in n.get("properties", {}).items():
                if name not in out and name not in n.get("required", []) and rng.random() < p:
                    drawn = _draw(rng, _options(root, prop), None)
                    if drawn is not None or any(o.get("type") == "null" for o in _options(root, prop)):
                        out[name] = drawn
        return out
    if isinstance(value, list):
        return [mutate(rng, root, _child(root, nodes, i), v, p) for i, v in enumerate(value)]
    return _draw(rng, nodes, value) if rng.random() < p else value


def accepted(model: type[BaseModel], obj) -> bool:
    try:
        model.model_validate_json(json.dumps(obj), strict=True)
        return True
    except ValidationError:
        return False


def answers(args: list[str]) -> tuple[int, str]:
    """Exit status and output of one command; a traceback (any exit but 0 or 2) fails the caller."""
    result = runner.invoke(app, args)
    if result.exit_code not in (0, 2):
        import traceback

        tb = "".join(traceback.format_exception(*result.exc_info)) if result.exc_info else ""
        raise AssertionError(f"{args[0]} exited {result.exit_code}: {result.output}\n{tb}")
    if result.exit_code == 2:
        lines = result.output.strip().splitlines()
        assert len(lines) == 1, (args[0], result.output)
    return result.exit_code, result.output


def _leaves(value) -> int:
    if isinstance(value, dict):
        return sum(map(_leaves, value.values()))
    if isinstance(value, list):
        return sum(map(_leaves, value))
    return 1


def _files(name: str, model: type[BaseModel], base, draws: int):
    """``draws`` mutations of ``base`` that ``model`` accepts (a record file: each line a ``model``), each
    redrawing 1, 2, 4 or 8 leaves on average.  The model accepts 7 % of the policies drawn (a redrawn
    curve point or isotonic threshold breaks its consistency), 14 % of the cost files, 17 % of the
    evaluate results, 45 % of the record files and 80 % of the compare results (150 draws each), so 80
    tries per file leave a shortfall a chance far below 1e-9."""
    rng = random.Random(fresh_seed(f"file_models_{name}"))
    root = model.model_json_schema()
    nodes = _options(root, root)
    kept, tried = [], 0
    while len(kept) < draws and tried < 80 * draws:
        tried += 1
        p = rng.choice([1, 2, 4, 8]) / _leaves(base)
        if isinstance(base, list):  # JSONL: every line mutated alike
            obj = [mutate(rng, root, nodes, line, p) for line in base]
            ok = all(accepted(model, line) for line in obj)
        else:
            obj = mutate(rng, root, nodes, base, p)
            ok = accepted(model, obj)
        if ok and obj != base:
            kept.append(obj)
    assert len(kept) == draws, f"only {len(kept)} of {tried} draws of {name} were accepted"
    return kept


def _write(path: Path, obj) -> Path:
    path.write_text("\n".join(json.dumps(x) for x in obj) + "\n" if isinstance(obj, list) else json.dumps(obj))
    return path


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A valid file of each kind: records, costs, a fitted policy, a compare and an evaluate result."""
    d = tmp_path_factory.mktemp("good")
    records = _write(d / "r.jsonl", [json.loads(r.model_dump_json(exclude_none=True)) for r in synthesize(300)])
    costs = _write(d / "c.json", synthetic_costs())
    assert answers(["calibrate", "fit", "--records", str(records), "--costs", str(costs), "--out", str(d / "p.json")])[0] == 0
    return {"records": records, "costs": costs, "policy": d / "p.json",
            "compare": BENCH / "compare-35b-vllm-gdn.json", "evaluate": BENCH / "eval-35b/evaluate.json"}


def test_compare_results_the_model_accepts_are_answered(tmp_path, good):
    base = json.loads(good["compare"].read_text())
    for i, obj in enumerate(_files("compare", CompareResult, base, 30)):
        path = _write(tmp_path / f"c{i}.json", obj)
        answers(["compare-report", str(path)])
        answers(["compare-report", str(good["compare"]), str(path)])
        if i % 6 == 0:
            answers(["plot-rounds", str(good["evaluate"]), "--compare", str(path), "--out", str(tmp_path / "x.png")])


def test_evaluate_results_the_model_accepts_are_answered(tmp_path, good):
    base = json.loads(good["evaluate"].read_text())
    for i, obj in enumerate(_files("evaluate", EvaluateResult, base, 6)):
        answers(["plot-rounds", str(_write(tmp_path / f"e{i}.json", obj)), "--out", str(tmp_path / "x.png")])


def test_policies_the_model_accepts_are_answered(tmp_path, good):
    base = json.loads(good["policy"].read_text())
    for i, obj in enumerate(_files("policy", PolicyFile, base, 12)):
        answers(["simulate", "--records", str(good["records"]), "--policy", str(_write(tmp_path / f"p{i}.json", obj)),
                 "--batch", "4"])


def test_cost_files_the_model_accepts_are_answered(tmp_path, good):
    base = json.loads(good["costs"].read_text())
    for i, obj in enumerate(_files("costs", CostFile, base, 12)):
        answers(["calibrate", "fit", "--records", str(good["records"]), "--costs",
                 str(_write(tmp_path / f"c{i}.json", obj)), "--out", str(tmp_path / "p.json")])


def test_records_the_model_accepts_are_answered(tmp_path, good):
    base = [json.loads(line) for line in good["records"].read_text().splitlines()[:60]]
    for i, obj in enumerate(_files("records", RoundRecord, base, 8)):
        path = _write(tmp_path / f"r{i}.jsonl", obj)
        answers(["calibrate", "stats", "--records", str(path)])
        answers(["calibrate", "fit", "--records", str(path), "--costs", str(good["costs"]), "--out", str(tmp_path / "p.json")])
        answers(["simulate", "--records", str(path), "--policy", str(good["policy"])])
