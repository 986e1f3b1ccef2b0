"""The tool commands (those that start a vLLM engine, and the others) on bad options: exit status 2 and
one line naming the option, the value and what would be valid, before an engine starts or a file is
written. The first two tests walk the whole command line: every number with a declared range, and every
number given as text."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from vllm_hybridspec.cli import app

from ..cli_walk import numeric, ranged

MODELS = Path(__file__).resolve().parents[2] / "models"
DENSE = str(MODELS / "dense")  # a committed model directory with config.json


@pytest.fixture(autouse=True)
def no_engine(monkeypatch):
    """A refusal this file expects must come before any engine or kernel benchmark: the functions that
    would start one fail."""
    import sys

    from vllm_hybridspec.tools import calibrate, checks, compare, costs, evaluate, replay_record, spec_steps
    from vllm_hybridspec.tools.kernels import draft_round, fused_round, gdn_compare, profile, tune

    def started(*args, **kwargs):
        raise AssertionError("an engine or a kernel benchmark was about to start")

    for module, name in ((compare, "run_config"), (costs, "measure_costs"), (evaluate, "evaluate"),
                         (checks, "greedy_outputs"), (replay_record, "record_continuations"),
                         (spec_steps, "measure"), (gdn_compare, "run"), (fused_round, "run"),
                         (tune, "sweep_parts"), (tune, "tune_fused"), (profile, "profile"), (draft_round, "run")):
        monkeypatch.setattr(module, name, started)
    if "vllm" in sys.modules:  # calibrate capture and profile construct vllm.LLM themselves
        monkeypatch.setattr(sys.modules["vllm"], "LLM", started)
    assert calibrate  # imported so that its commands are registered


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def refused_line(result) -> str:
    """The one error line of a refused command, its "hybridspec <command>: error: " or "error: " prefix
    removed (exit 2, no traceback)."""
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = [line for line in result.stderr.strip().splitlines() if line]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.output
    return re.sub(r"^(hybridspec [a-z -]+: )?error: ", "", lines[0])


def _number(value: float, is_int: bool) -> str:
    return str(int(value)) if is_int else repr(float(value))


RANGED = ranged()


@pytest.mark.parametrize("option", RANGED, ids=[f"{o.command} {o.name}" for o in RANGED])
def test_every_declared_range_is_enforced_in_one_line(option):
    """Just outside each declared bound: refused before anything else is read, naming option and value."""
    is_int = option.annotation is int
    step = 1 if is_int else 0.5
    cases = []
    if option.minimum is not None:
        cases.append((option.minimum - step, "greater than or equal to", option.minimum))
    if option.maximum is not None:
        cases.append((option.maximum + step, "less than or equal to", option.maximum))
    for value, relation, bound in cases:
        text = _number(value, is_int)
        line = refused_line(invoke(*option.command.split(), option.name, text))
        match = re.fullmatch(rf"{re.escape(option.name)} '{re.escape(text)}': Input should be {relation} (\S+)", line)
        assert match and math.isclose(float(match.group(1)), bound), line


NUMERIC = numeric()


@pytest.mark.parametrize("option", NUMERIC, ids=[f"{o.command} {o.name}" for o in NUMERIC])
def test_every_number_given_as_text_is_refused_in_one_line(option):
    kind = "a valid integer, unable to parse string as an integer" if option.annotation is int else \
        "a valid number, unable to parse string as a number"
    line = refused_line(invoke(*option.command.split(), option.name, "twelve"))
    assert line == f"{option.name} 'twelve': Input should be {kind}"


# the engine commands: (command, what each needs besides the engine options to get past parsing)
ENGINE_COMMANDS = {
    "compare": ["--config", "plain=none", "--random-prompts", "--out", "{tmp}/c.json"],
    "evaluate": ["--speculative-config", "{}", "--modes", "plain,all", "--random-prompts", "--out-dir", "{tmp}/e"],
    "profile": ["--out", "{tmp}/p"],
    "replay-record": ["--prompts", "{tmp}/none.jsonl", "--out", "{tmp}/r.jsonl"],
    "spec-steps": ["--random-prompts", "--out", "{tmp}/s.json"],
    "calibrate capture": ["--speculative-config", '{"num_speculative_tokens": 3}', "--random-prompts",
                          "--out", "{tmp}/r.jsonl"],
    "calibrate costs": ["--plain", "--batch-sizes", "2", "--random-prompts", "--out", "{tmp}/c.json"],
    "check compiled-vs-eager": ["--random-prompts"],
}

ENGINE_OPTIONS = [
    (["--model", "{tmp}/no-model"], "--model '{tmp}/no-model' does not exist; expected a model directory (with "
                                    "config.json) or a hub id"),
    (["--model", "{tmp}"], "--model '{tmp}' has no config.json; expected a model directory or a hub id"),
    (["--model", DENSE, "--dtype", "fp8"], "--dtype 'fp8' is not one of auto, half, float16, bfloat16, float, "
                                           "float32"),
    (["--model", DENSE, "--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization 1.5 is not valid; expected a "
                                                            "share of the GPU's memory in (0, 1]"),
    (["--model", DENSE, "--gpu-mem", "nan"], "--gpu-memory-utilization nan is not valid; expected a share of the "
                                             "GPU's memory in (0, 1]"),
    (["--model", DENSE, "--engine-args", "{max_num_seqs: 2}"],
     "--engine-args is not valid JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1)): "
     "'{max_num_seqs: 2}'"),
    (["--model", DENSE, "--engine-args", "[2]"], "--engine-args must be a JSON object, got '[2]'"),
]


@pytest.mark.parametrize("command", ENGINE_COMMANDS)
@pytest.mark.parametrize("args, message", ENGINE_OPTIONS, ids=[a[-2] + " " + a[-1] for a, _ in ENGINE_OPTIONS])
def test_engine_options_of_every_engine_command(tmp_path, command, args, message):
    extra = [a.replace("{tmp}", str(tmp_path)) for a in ENGINE_COMMANDS[command]]
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    line = refused_line(invoke(*command.split(), *args, *extra))
    assert line == message.replace("{tmp}", str(tmp_path))
    assert list(tmp_path.iterdir()) == []


def test_engine_args_keys_are_vllm_keyword_arguments(tmp_path):
    line = refused_line(invoke("compare", "--model", DENSE, "--engine-args", '{"max_num_seq": 2}',
                               *[a.replace("{tmp}", str(tmp_path)) for a in ENGINE_COMMANDS["compare"]]))
    assert line == ("--engine-args key 'max_num_seq' (did you mean 'max_num_seqs'?) is not a vllm.LLM keyword "
                    "argument (vllm.engine.arg_utils.EngineArgs fields)")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", ["compare", "evaluate", "spec-steps", "check compiled-vs-eager",
                                     "calibrate capture", "calibrate costs"])
def test_prompt_options_of_the_engine_commands(tmp_path, command):
    extra = [a.replace("{tmp}", str(tmp_path)) for a in ENGINE_COMMANDS[command] if a != "--random-prompts"]
    base = [*command.split(), "--model", DENSE, *extra]
    if not command.startswith("calibrate"):  # the calibration runs take random prompts without --prompts
        assert refused_line(invoke(*base)) == "give --prompts FILE or --random-prompts (one of them)"
    missing = tmp_path / "p.jsonl"
    assert refused_line(invoke(*base, "--prompts", missing)) == f"--prompts '{missing}' does not exist"
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": [1, 2]}\n{"prompt": [3, \n')
    assert refused_line(invoke(*base, "--prompts", rows)) == (
        f"prompt file '{rows}', line 2: not JSON (Expecting value: line 1 column 16 (char 15))")
    rows.write_text('{"prompt": [1, 2]}\n{"text": [3]}\n')
    assert refused_line(invoke(*base, "--prompts", rows)) == (
        f"prompt file '{rows}', row 2: every row needs a 'prompt' text, or every row a token-id list ('prompt' or "
        "'prompt_token_ids'); got 'None'")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rows.jsonl"]


# (command, output option, "file" or "dir", other arguments, whether missing directories above are made)
OUTPUTS = [
    ("demo", "--json", "file", [], False),
    ("compare", "--out", "file", ["--model", DENSE, "--config", "plain=none", "--random-prompts"], False),
    ("evaluate", "--out-dir", "dir", ["--model", DENSE, "--speculative-config", "{}", "--modes", "plain",
                                      "--random-prompts"], True),
    ("profile", "--out", "dir", ["--model", DENSE], True),
    ("replay-record", "--out", "file", ["--model", DENSE, "--prompts", "{tmp}/p.jsonl"], False),
    ("calibrate capture", "--out", "file", ["--model", DENSE, "--speculative-config", '{"num_speculative_tokens": 3}',
                                            "--random-prompts"], True),
    ("calibrate costs", "--out", "file", ["--model", DENSE, "--plain", "--random-prompts"], True),
    ("plot-rounds", "--out", "file", ["{tmp}/evaluate.json"], True),
    ("full-shape", "--out", "dir", [], True),
    ("models", "--out-dir", "dir", [], True),
    ("models", "--work-dir", "dir", [], True),
    ("report", "--out-dir", "dir", ["{tmp}/r.json"], True),
    ("spec-steps", "--out", "file", ["--model", DENSE, "--random-prompts"], True),
    ("spec-steps-table", "--out", "file", ["--ours", "{tmp}/r.json", "--plain", "{tmp}/r.json", "--shape", "s",
                                           "--command", "c"], False),
    ("headline", "--out", "file", ["--plain", "{tmp}/r.json", "--hybridspec", "{tmp}/r.json", "--shape", "s",
                                   "--profile", "p", "--command", "c"], True),
    ("headline", "--plot", "file", ["--plain", "{tmp}/r.json", "--hybridspec", "{tmp}/r.json", "--shape", "s",
                                    "--profile", "p", "--command", "c", "--out", "{tmp}/h.json"], True),
    ("kernels compare", "--out", "file", ["--shape", "tiny"], False),
    ("kernels compare", "--json", "file", ["--shape", "tiny"], False),
    ("kernels render", "--out", "file", ["{tmp}/r.json"], False),
    ("kernels fused", "--json", "file", ["--shape", "tiny"], False),
    ("kernels tune", "--out", "file", ["--shape", "tiny"], False),  # before the CUDA check: testable here
    ("kernels draft-round", "--json", "file", [], False),
    ("kernels spec-conv", "--json", "file", [], False),
]


@pytest.mark.parametrize("command, option, kind, args, makes_parents", OUTPUTS,
                         ids=[f"{c} {o}" for c, o, *_ in OUTPUTS])
def test_output_paths_are_checked_before_any_work(tmp_path, command, option, kind, args, makes_parents):
    taken = tmp_path / "taken"
    taken.mkdir()
    blocker = tmp_path / "file"
    blocker.write_text("")
    (tmp_path / "p.jsonl").write_text('{"prompt": [1, 2, 3]}\n')
    (tmp_path / "evaluate.json").write_text("{}")
    (tmp_path / "r.json").write_text("{}")
    before = sorted(p.name for p in tmp_path.iterdir())
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]

    def refusal(path) -> str:
        return refused_line(invoke(*command.split(), *args, option, path))

    if kind == "file":
        assert refusal(taken) == f"{option} '{taken}' is a directory; give the path of a file to write"
        below = "is a file, so no directory can be made below it" if makes_parents else "is a file, not a directory"
        assert refusal(blocker / "x.png") == f"{option} '{blocker / 'x.png'}': '{blocker}' {below}"
    else:
        assert refusal(blocker) == f"{option} '{blocker}' is a file; give a directory to write into"
        assert refusal(blocker / "sub") == (f"{option} '{blocker / 'sub'}': '{blocker}' is a file, so no directory "
                                            "can be made below it")
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert list(taken.iterdir()) == []


def test_input_files_of_evaluate_and_plot_rounds(tmp_path):
    base = ["evaluate", "--model", DENSE, "--speculative-config", "{}", "--modes", "plain", "--random-prompts",
            "--out-dir", tmp_path / "e"]
    for option, what in (("--records", "round records, JSONL (hybridspec calibrate capture)"),
                         ("--policy", "a policy file (hybridspec calibrate fit)"),
                         ("--reference", "continuations JSONL (hybridspec replay-record)")):
        assert refused_line(invoke(*base, option, tmp_path / "none")) == (
            f"{option} '{tmp_path / 'none'}' does not exist; expected {what}")
        assert refused_line(invoke(*base, option, tmp_path)) == f"{option} '{tmp_path}' is a directory; expected {what}"
    assert refused_line(invoke(*base, "--records", tmp_path / "r", "--policy", tmp_path / "p")) == (
        "give --records (fit a policy) or --policy (use one), not both")
    out = tmp_path / "plot.png"
    assert refused_line(invoke("plot-rounds", tmp_path / "none.json", "--out", out)) == (
        f"EVALUATE '{tmp_path / 'none.json'}' does not exist; expected evaluate.json of hybridspec evaluate")
    (tmp_path / "evaluate.json").write_text('{"modes": []}')
    assert refused_line(invoke("plot-rounds", tmp_path / "evaluate.json", "--compare", tmp_path, "--out", out)) == (
        f"--compare '{tmp_path}' is a directory; expected a hybridspec compare result JSON")
    assert refused_line(invoke("plot-rounds", tmp_path / "evaluate.json", "--out", tmp_path / "plot.jpg")) == (
        f"--out '{tmp_path / 'plot.jpg'}' has suffix '.jpg'; the image format comes from it: use one of .png, .pdf, "
        ".svg")
    assert refused_line(invoke("plot-rounds", tmp_path / "evaluate.json", "--out", out)) == (
        f"{tmp_path / 'evaluate.json'}: not a hybridspec evaluate result: required field 'costs' is missing (and 1 "
        "more problem)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["evaluate.json"]


@pytest.mark.parametrize("args, message", [
    (["demo", "--kind", "moe"], "--kind must be hybrid or dense, got 'moe'"),
    (["models", "--stage", "corpos"], "--stage 'corpos' is not a stage; valid stages are corpus, targets, prompts, "
                                      "drafters, evaluate, accept"),
    (["models", "--stdlib-root", "/"], "--stdlib-root / has no os.py; expected a Python standard library directory "
                                       "such as /usr/lib/python3.12"),
    (["models", "--max-minutes", "0"], "--max-minutes 0 is not valid; expected a positive number of minutes"),
    (["models", "--max-minutes", "inf"], "--max-minutes inf is not valid; expected a positive number of minutes"),
    (["full-shape", "--layers", "42"], "--layers 42 is not a multiple of 4 (full_attention_interval = 4)"),
    (["calibrate", "time-selector", "--device", "gpu"], "--device 'gpu' is not a device here (0 CUDA devices); use "
                                                        "cpu"),
    (["calibrate", "time-selector", "--topk", "9", "--experts", "8"], "--topk 9 exceeds --experts 8"),
    (["calibrate", "capture", "--model", DENSE, "--speculative-config", '{"num_speculative_tokens": 2}',
      "--temperature", "inf", "--random-prompts", "--out", "{tmp}/r.jsonl"],
     "--temperature inf: expected a finite number >= 0"),
    (["calibrate", "capture", "--model", DENSE, "--speculative-config", "{}", "--random-prompts", "--out",
      "{tmp}/r.jsonl"], "--speculative-config needs num_speculative_tokens: '{}'"),
    (["calibrate", "capture", "--model", DENSE, "--speculative-config", '{"num_speculative_tokens": 2, "hybridspec": '
      '{"fixed_length": 2}}', "--random-prompts", "--out", "{tmp}/r.jsonl"],
     "--speculative-config: \"hybridspec.fixed_length\" = 2; a capture run verifies every draft token"),
    (["calibrate", "costs", "--model", DENSE, "--random-prompts", "--out", "{tmp}/c.json"],
     "give --speculative-config (round times) and/or --plain (plain decoding)"),
    (["calibrate", "costs", "--model", DENSE, "--plain", "--batch-sizes", "0,2", "--random-prompts", "--out",
      "{tmp}/c.json"], "--batch-sizes must be positive integers, got '0,2'"),
    (["calibrate", "costs", "--model", DENSE, "--plain", "--plain-gated", "--random-prompts", "--out",
      "{tmp}/c.json"], "--plain-gated times plain steps in the speculative engine: it needs --speculative-config "
                       "and excludes --plain"),
    (["compare", "--model", DENSE, "--config", "plain", "--random-prompts", "--out", "{tmp}/c.json"],
     "--config 'plain': expected NAME=JSON or NAME=none"),
    (["compare", "--model", DENSE, "--config", "a={", "--random-prompts", "--out", "{tmp}/c.json"],
     "--config a: not valid JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1)): '{'"),
    (["compare", "--model", DENSE, "--config", "a=none", "--sweep-lengths", "2,x", "--random-prompts", "--out",
      "{tmp}/c.json"], "--sweep-lengths must be comma-separated positive integers, got '2,x'"),
    (["compare", "--model", DENSE, "--config", "a=none", "--sweep-batches", "0", "--random-prompts", "--out",
      "{tmp}/c.json"], "--sweep-batches must be comma-separated positive integers, got '0'"),
    (["evaluate", "--model", DENSE, "--speculative-config", "[1]", "--modes", "plain", "--random-prompts",
      "--out-dir", "{tmp}/e"], "--speculative-config must be a JSON object, got '[1]'"),
    (["evaluate", "--model", DENSE, "--speculative-config", "{}", "--modes", "plain,fast", "--random-prompts",
      "--out-dir", "{tmp}/e"], "--modes 'plain,fast': unknown modes ['fast']; modes are plain, all, sel, sel-nogate, "
                               "sel-batched"),
    (["evaluate", "--model", DENSE, "--speculative-config", "{}", "--random-prompts", "--out-dir", "{tmp}/e"],
     "--modes 'plain,all,sel,sel-nogate,sel-batched': the 'sel' modes need --records (to fit a policy) or --policy"),
    (["evaluate", "--model", DENSE, "--speculative-config", "{}", "--modes", "plain", "--lengths", "0",
      "--random-prompts", "--out-dir", "{tmp}/e"], "--lengths must be comma-separated positive integers, got '0'"),
    (["evaluate", "--model", DENSE, "--speculative-config", "{}", "--modes", "plain", "--batch-sizes", "x",
      "--random-prompts", "--out-dir", "{tmp}/e"], "--batch-sizes must be comma-separated positive integers, got 'x'"),
    (["spec-steps", "--model", DENSE, "--speculative-config", "[1]", "--random-prompts", "--out", "{tmp}/s.json"],
     "--speculative-config must be a JSON object, got '[1]'"),
    (["spec-steps", "--model", DENSE, "--lengths", "1,0", "--random-prompts", "--out", "{tmp}/s.json"],
     "--lengths must be comma-separated positive integers, got '1,0'"),
    (["spec-steps", "--model", DENSE, "--batch-sizes", "-4", "--random-prompts", "--out", "{tmp}/s.json"],
     "--batch-sizes must be comma-separated positive integers, got '-4'"),
    (["spec-steps", "--model", DENSE, "--speculative-config", '{"method": "hspec"}', "--drafts", "model,random",
      "--random-prompts", "--out", "{tmp}/s.json"],
     "--drafts 'model,random': comma-separated, each once, from model, spread"),
    (["spec-steps", "--model", DENSE, "--drafts", "spread", "--random-prompts", "--out", "{tmp}/s.json"],
     '--drafts spread needs an H-Spec drafter (--speculative-config with "method": "hspec")'),
    (["calibrate", "costs", "--model", DENSE, "--speculative-config", "{}", "--random-prompts", "--out",
      "{tmp}/c.json"], "--speculative-config needs num_speculative_tokens: '{}'"),
    (["calibrate", "costs", "--model", DENSE, "--plain", "--lengths", "2,0", "--random-prompts", "--out",
      "{tmp}/c.json"], "--lengths must be positive integers, got '2,0'"),
    (["replay-record", "--model", DENSE, "--prompts", "{tmp}/none.jsonl", "--out", "{tmp}/r.jsonl"],
     "Prompt file {tmp}/none.jsonl does not exist; expected a JSONL file of prompts."),
    (["kernels", "compare", "--lengths", "17"], "--lengths must be in 1..16, got '17'"),
    (["kernels", "compare", "--batches", "0"], "--batches must be comma-separated positive integers, got '0'"),
    (["kernels", "fused", "--batches", "1,x"], "--batches must be comma-separated positive integers, got '1,x'"),
    (["kernels", "profile", "--shape", "7b"], "--shape must be one of 35b, tiny, got '7b'"),
    (["kernels", "profile", "--BV", "48"], "--BV must be a power of two, got 48"),
    (["kernels", "profile", "--BV", "0"], "--BV must be a power of two, got 0"),
    (["kernels", "profile", "--BK", "8"], "--BK must be a power of two >= 16 (the reduction dimension of tl.dot), "
                                          "got 8"),
    (["kernels", "profile", "--BK", "96"], "--BK must be a power of two >= 16 (the reduction dimension of tl.dot), "
                                           "got 96"),
    (["kernels", "profile", "--num-warps", "3"], "--num-warps must be a power of two in 1..32, got 3"),
    (["kernels", "profile", "--num-warps", "64"], "--num-warps must be a power of two in 1..32, got 64"),
    (["kernels", "profile", "--precision", "fp16"], "--precision must be one of auto, tf32, tf32x3, ieee, got "
                                                    "'fp16'"),
    # before the CUDA check, so that it is answered on this machine too
    (["kernels", "tune", "--shape", "7b", "--out", "{tmp}/t.jsonl"], "--shape must be one of 35b, tiny, got '7b'"),
    (["kernels", "draft-round", "--batches", "4,0"], "--batches must be comma-separated positive integers, got "
                                                     "'4,0'"),
    (["kernels", "draft-round", "--markov-scales", "0.25,-1"], "--markov-scales must be comma-separated positive "
                                                               "numbers, got '0.25,-1'"),
    (["kernels", "draft-round", "--markov-scales", "nan"], "--markov-scales must be comma-separated positive "
                                                           "numbers, got 'nan'"),
    (["kernels", "draft-round", "--batches", "1,4", "--json", "{tmp}/none/d.json"],
     "--json '{tmp}/none/d.json': directory '{tmp}/none' does not exist; create it or write elsewhere"),
    (["kernels", "spec-conv", "--batches", "1,-4"], "--batches must be comma-separated positive integers, got "
                                                    "'1,-4'"),
    (["kernels", "spec-conv", "--lengths", "2,x"], "--lengths must be comma-separated positive integers, got "
                                                   "'2,x'"),
    (["kernels", "spec-conv", "--json", "{tmp}/none/c.json"],
     "--json '{tmp}/none/c.json': directory '{tmp}/none' does not exist; create it or write elsewhere"),
    (["profile", "--model", DENSE, "--engine-args", '{"async_scheduling": true}', "--out", "{tmp}/p"],
     "--engine-args key 'async_scheduling' is set by --async-scheduling here; give that flag (or leave it out) "
     "instead"),
    (["profile", "--model", DENSE, "--speculative-config", "{", "--out", "{tmp}/p"],
     "--speculative-config is not valid JSON (Expecting property name enclosed in double quotes: line 1 column 2 "
     "(char 1)): '{'"),
    (["profile", "--model", DENSE, "--lengths", "0", "--out", "{tmp}/p"],
     "--lengths must be comma-separated positive integers, got '0'"),
    (["replay-record", "--model", DENSE, "--out", "{tmp}/r.jsonl"],
     "Give exactly one prompt source: a JSONL file (--prompts) or a dataset name (--dataset)."),
    (["check", "compiled-vs-eager", "--model", DENSE, "--speculative-config", "3", "--random-prompts"],
     "--speculative-config must be a JSON object, got '3'"),
])
def test_command_specific_values_are_refused_in_one_line(tmp_path, args, message):
    line = refused_line(invoke(*[a.replace("{tmp}", str(tmp_path)) for a in args]))
    assert line == message.replace("{tmp}", str(tmp_path))
    assert list(tmp_path.iterdir()) == []


def test_a_compare_result_that_fails_to_write_keeps_the_earlier_file(tmp_path, monkeypatch):
    """compare rewrites its result after every config, beside the file and renamed: a failing write keeps
    the earlier result whole and leaves no temporary file."""
    import os

    from vllm_hybridspec.tools import compare

    out = tmp_path / "c.json"
    monkeypatch.setattr(compare, "run_config", lambda name, *a: {"name": name, "tokens": [[1, 2]]})
    compare.run_all([("a", None)], compare.EngineOptions(model=DENSE), compare.CompareSettings(), [], out)
    before = out.read_text()
    assert json.loads(before)["results"] == [{"name": "a", "tokens": [[1, 2]]}]
    monkeypatch.setattr(os, "replace", lambda src, dst: (_ for _ in ()).throw(OSError(28, "No space left")))
    with pytest.raises(OSError, match="No space left"):
        compare.run_all([("a", None), ("b", None)], compare.EngineOptions(model=DENSE), compare.CompareSettings(),
                        [], out)
    assert out.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["c.json"]


def test_input_files_of_the_other_commands(tmp_path):
    missing = tmp_path / "none.json"
    assert refused_line(invoke("compare-report", missing)) == (
        f"hybridspec compare result '{missing}' does not exist")
    assert refused_line(invoke("kernels", "render", missing)) == f"run_json: file '{missing}' does not exist."
    assert refused_line(invoke("kernels", "render", tmp_path)) == f"run_json: file '{tmp_path}' is a directory."
    assert refused_line(invoke("calibrate", "time-selector", "--policy", missing)) == (
        f"policy file '{missing}' does not exist")
    assert refused_line(invoke("calibrate", "stats", "--records", missing)) == f"records file '{missing}' does not exist"
    assert refused_line(invoke("calibrate", "stats", "--records", tmp_path)) == (
        f"records file '{tmp_path}' is a directory, not a file")
    assert refused_line(invoke("simulate", "--records", missing, "--policy", missing)) == (
        f"policy file '{missing}' does not exist")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args, message", [
    (["kernels", "compare", "--shape", "40b"], "--shape must be one of 35b, tiny, got '40b'"),
    (["kernels", "fused", "--shape", "tiny", "--lengths", "17"], "--lengths must be in 1..16, got '17'"),
    (["calibrate", "fit", "--records", "r.jsonl", "--costs", "c.json", "--out", "p.json", "--min-length", "3"],
     "--min-length '3': Input should be less than or equal to 2"),
    (["calibrate", "synth", "--out", "r.jsonl", "--profile", "paper-dflash"], None),
    (["train", "--config", "none.yaml"], "recipe 'none.yaml' does not exist"),
])
def test_checks_that_other_modules_own(tmp_path, monkeypatch, args, message):
    """Checks that the kernels tools and the policy commands own (their own modules), through the one-line
    usage errors of the root command."""
    monkeypatch.chdir(tmp_path)
    line = refused_line(invoke(*args))
    if message is None:
        assert line.startswith("unknown profile 'paper-dflash'")
    else:
        assert line == message
    assert list(tmp_path.iterdir()) == []


def test_replay_record_reads_its_prompts_as_the_benchmark_does(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": [1, 2]}\n')
    line = refused_line(invoke("replay-record", "--model", DENSE, "--prompts", prompts, "--prompt-field", "text",
                               "--out", tmp_path / "r.jsonl"))
    assert line == f"{prompts}:1 has no field 'text' (fields: ['prompt']); pick one with --prompt-field."
    assert [p.name for p in tmp_path.iterdir()] == ["p.jsonl"]


def test_a_dataset_that_cannot_be_loaded_is_one_line(tmp_path):
    """--dataset names a `datasets` dataset; offline (as here) or misspelled, it is one line, exit 2."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    for command in (["bench", "--url", "http://127.0.0.1:9"], ["replay-record", "--model", DENSE]):
        run = subprocess.run([sys.executable, "-m", "vllm_hybridspec.cli", *command, "--dataset", "nosuch/thing",
                              "-o", str(tmp_path / "r.json")], capture_output=True, text=True, env=env, timeout=120)
        assert run.returncode == 2, run.stderr
        line = run.stderr.strip().splitlines()[-1]
        assert line.endswith("error: Dataset 'nosuch/thing' (train) could not be loaded (Couldn't reach 'nosuch/thing' "
                             "on the Hub (OfflineModeIsEnabled)); expected a `datasets` name (or use --prompts FILE).")
        assert "Traceback" not in run.stderr
    assert list(tmp_path.iterdir()) == []


SAVED_STEPS = Path(__file__).resolve().parents[2] / "docs" / "benchmarks" / "h200-2026-12-04b" / "slice"


def test_input_files_of_spec_steps_table(tmp_path):
    """--ours, --plain and --vllm: existing files, each a spec-steps result (the fields the table reads,
    typed), with a drafter (--ours, --vllm) or without (--plain); refused before the table is written."""
    ours, plain, vllm = (SAVED_STEPS / f"{name}.json" for name in ("ours_full", "plain", "vllm15"))
    out = tmp_path / "table.json"

    def refusal(*args) -> str:
        return refused_line(invoke("spec-steps-table", *args, "--shape", "s", "--command", "c", "--out", out))

    missing = tmp_path / "none.json"
    assert refusal("--ours", missing, "--plain", plain) == (
        f"--ours '{missing}' does not exist; expected the spec-steps result of our engine")
    assert refusal("--ours", ours, "--plain", tmp_path) == (
        f"--plain '{tmp_path}' is a directory; expected a spec-steps result of plain decoding (no "
        "--speculative-config)")
    assert refusal("--ours", ours, "--plain", plain, "--vllm", vllm, "--vllm", missing) == (
        f"--vllm '{missing}' does not exist; expected a spec-steps result of vLLM's own GDN path")
    bad = tmp_path / "bad.json"
    bad.write_text('{"rows": [')
    assert refusal("--ours", bad, "--plain", plain) == f"{bad}: not valid JSON (Expecting value at line 1, column 11)"
    bad.write_text('{"speculative_config": null}')
    assert refusal("--ours", ours, "--plain", bad) == f"--plain '{bad}': required field 'rows' is missing"
    bad.write_text('{"speculative_config": null, "rows": [{"B": 1, "ms": "3.3"}]}')
    assert refusal("--ours", ours, "--plain", bad) == (
        f"--plain '{bad}': field 'rows[0].ms': Input should be a valid number (got '3.3')")
    bad.write_text('{"speculative_config": {"num_speculative_tokens": 0}, "rows": [{"B": 1, "w": 2, "ms": 3.3}]}')
    assert refusal("--ours", ours, "--plain", plain, "--vllm", bad) == (
        f"--vllm '{bad}': field 'speculative_config.num_speculative_tokens': Input should be greater than or equal "
        "to 1 (got 0)")
    assert refusal("--ours", plain, "--plain", plain) == (
        f"--ours '{plain}' is plain decoding (speculative_config null); expected the spec-steps result of our engine")
    assert refusal("--ours", ours, "--plain", vllm) == (
        f"--plain '{vllm}' is a run with a speculative_config; expected a spec-steps result of plain decoding (no "
        "--speculative-config)")
    # --draft-round: an existing draft-round result with a positive round_grouped_ms per batch size
    assert refusal("--ours", ours, "--plain", plain, "--draft-round", missing) == (
        f"--draft-round '{missing}' does not exist; expected a `hybridspec kernels draft-round --json` result")
    bad.write_text('{"rows": [{"B": 1, "round_grouped_ms": "1.6"}]}')
    assert refusal("--ours", ours, "--plain", plain, "--draft-round", bad) == (
        f"--draft-round '{bad}': field 'rows[0].round_grouped_ms': Input should be a valid number (got '1.6')")
    bad.write_text('{"rows": [{"B": 1, "round_ms": 1.6}]}')
    assert refusal("--ours", ours, "--plain", plain, "--draft-round", bad) == (
        f"--draft-round '{bad}': required field 'rows[0].round_grouped_ms' is missing")
    bad.write_text('{"rows": [{"B": 0, "round_grouped_ms": 1.6}]}')
    assert refusal("--ours", ours, "--plain", plain, "--draft-round", bad).startswith(
        f"--draft-round '{bad}': field 'rows[0].B': Input should be greater than or equal to 1")
    assert refusal("--ours", ours, "--plain", plain, "--layers", "0") == "--layers '0': Input should be greater than or equal to 1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.json"]
    # the saved H200 results pass and make the table the function makes of them
    rounds = tmp_path / "rounds.json"
    rounds.write_text('{"rows": [{"B": 1, "round_grouped_ms": 1.58}, {"B": 4, "round_grouped_ms": 1.7}]}')
    # they were written before spec-steps recorded precision and device: the table needs them named
    assert refusal("--ours", ours, "--plain", plain, "--gpu", "NVIDIA H200") == (
        "precision is not recorded in every input: name it with --precision")
    result = invoke("spec-steps-table", "--ours", ours, "--plain", plain, "--vllm", vllm, "--shape", "s",
                    "--command", "c", "--layers", "12", "--draft-round", rounds, "--precision", "bfloat16",
                    "--gpu", "NVIDIA H200", "--out", out)
    assert result.exit_code == 0, result.output
    from vllm_hybridspec.tools.spec_steps import spec_steps_table

    runs = [json.loads(p.read_text()) for p in (ours, plain, vllm, rounds)]
    assert json.loads(out.read_text()) == spec_steps_table(runs[0], runs[1], [runs[2]], "s", "c", 12, runs[3],
                                                           "bfloat16", "NVIDIA H200")
    assert json.loads(out.read_text())["drafter_round_ms"] == {"1": 1.58, "4": 1.7}


def test_a_spec_steps_table_that_fails_to_write_keeps_the_earlier_file(tmp_path, monkeypatch):
    """spec-steps-table writes its --out beside and renamed: a failing write keeps the earlier table whole
    and leaves no temporary file."""
    import os

    out = tmp_path / "table.json"
    out.write_text('{"rows": []}\n')
    monkeypatch.setattr(os, "replace", lambda src, dst: (_ for _ in ()).throw(OSError(28, "No space left")))
    result = invoke("spec-steps-table", "--ours", SAVED_STEPS / "ours_full.json", "--plain",
                    SAVED_STEPS / "plain.json", "--shape", "s", "--command", "c", "--precision", "bfloat16",
                    "--gpu", "NVIDIA H200", "--out", out)
    assert result.exit_code == 1 and isinstance(result.exception, OSError)
    assert out.read_text() == '{"rows": []}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["table.json"]
