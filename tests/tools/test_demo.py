"""``hybridspec demo``'s table without an engine: each row's line is computed from its numbers (a row
slower than plain says so, a gate that never fired says so), the JSON rows carry the ratios, and
vLLM's output goes to the log file, not between the table's lines."""

import json
import os
import subprocess
import sys

import pytest

from vllm_hybridspec.tools.demo import Row, explain, output_to, rows_json, table


def rows(policy_all=75.0, policy_one=30.0, gated=0, verified=None, load=0.5):
    plain = Row("plain", 100.0, 20.0, 8, 2, 8, None, identical_one_at_a_time=2, load=load)
    policy = Row("policy", policy_all, policy_one, 8, 2, 8, 2.79, 7, verified or {1: 10, 3: 30, 8: 60}, 120, gated,
                 identical_one_at_a_time=2, load=load)
    verify_all = Row("verify_all", 64.0, 21.0, 8, 2, 7, 3.10, 7, {}, 0, 0, identical_one_at_a_time=1, load=load)
    return [plain, policy, verify_all]


def test_each_line_says_what_its_row_measured():
    plain, policy, verify_all = rows()
    line = explain(policy, plain)
    # mean w = (1*10 + 3*30 + 8*60) / 100 = 5.8 tokens, so 4.8 drafts of 7
    assert "the policy verified 4.8 of the 7 drafts on average (lengths 1..8 tokens)" in line
    assert "its batch gate kept drafting on in every step" in line and "2.79 tokens per round" in line
    assert "slower than plain decoding all at once (0.75x)" in line
    assert "faster than plain decoding one at a time (1.50x)" in line
    line = explain(verify_all, plain)
    assert line.startswith("H-Spec drafts 7 tokens a round and the target verifies all 7; 3.10 tokens per round")
    assert "slower than plain decoding all at once (0.64x)" in line and "faster than plain decoding one at a time (1.05x)" in line
    gated = explain(rows(policy_all=100.2, gated=40)[1], plain)
    assert "its batch gate turned drafting off in 40 of 120 steps" in gated
    assert "as fast as plain decoding all at once (1.00x)" in gated


def test_the_table_puts_each_line_under_its_row_and_the_json_has_the_ratios():
    rs = rows()
    lines = table(rs).splitlines()
    at = {r.config: next(i for i, s in enumerate(lines) if s.strip().startswith(r.config + " ")) for r in rs}
    for r in rs:
        assert lines[at[r.config] + 1].strip() == explain(r, rs[0])
    assert "7/8" in lines[at["verify_all"]] and "0.64x" in lines[at["verify_all"]]
    assert "8 together, 2 one at a time" in lines[at["policy"]]
    out = json.loads(json.dumps(rows_json(rs)))
    by = {r["config"]: r for r in out["rows"]}
    assert [r["config"] for r in out["rows"]] == ["plain", "policy", "verify_all"]
    assert by["policy"]["ratio_all_at_once"] == pytest.approx(0.75)
    assert by["policy"]["ratio_one_at_a_time"] == pytest.approx(1.5)
    assert by["verify_all"]["identical"] == "7/8" and by["plain"]["ratio_all_at_once"] == 1.0
    assert by["policy"]["verified_at_length"] == {"1": 10, "3": 30, "8": 60}
    assert by["verify_all"]["identical_one_at_a_time"] == "1/2"
    assert "the machine was busy" not in table(rs)


def test_a_busy_machine_is_said_under_the_table():
    cores = os.cpu_count()
    busy = table(rows(load=cores + 1.5)).splitlines()[-1]
    assert busy == (f"  the machine was busy while these ran (1-minute load average up to {cores + 1.5:.1f} on {cores} "
                    "cores): the ratios compare runs that other work slowed unevenly")


def test_output_to_sends_c_level_and_python_output_to_the_log(tmp_path):
    log = tmp_path / "vllm.log"
    code = ("import os, sys; from pathlib import Path; from vllm_hybridspec.tools.demo import output_to\n"
            f"with output_to(Path({str(log)!r})):\n"
            "    os.write(1, b'c-level stdout\\n'); os.write(2, b'c-level stderr\\n')\n"
            "    print('python stdout'); print('python stderr', file=sys.stderr)\n"
            "print('after the block')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "after the block\n" and result.stderr == ""
    assert log.read_text().splitlines() == ["c-level stdout", "c-level stderr", "python stdout", "python stderr"]
