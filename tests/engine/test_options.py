"""The "hybridspec" sub-dict of --speculative-config: popped, validated with errors naming the bad
value, and carried to the workers in additional_config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_hybridspec.engine.options import HybridSpecOptions, hybridspec_options, parse_options
from vllm_hybridspec.engine.config import resolve_speculative_config


def test_defaults_and_select_follows_policy(tmp_path):
    assert parse_options({}, 7).select is False
    policy = tmp_path / "p.json"
    policy.write_text((__import__("pathlib").Path("examples/policy_synth.json")).read_text())
    k = json.loads(policy.read_text())["draft_len"]
    options = parse_options({"policy": str(policy)}, k)
    assert options.select is True and options.gdn_kernel is None and options.batched is False


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"selct": True}, r"selct: unknown key \(did you mean 'select'\?\), valid keys are policy, select, batched, .* \(got True\)"),
        ({"select": True}, r'"select": true needs "policy"'),
        ({"fixed_length": 0}, r"fixed_length: Input should be greater than or equal to 1 \(got 0\)"),
        ({"fixed_length": 9}, r"fixed_length=9 exceeds num_speculative_tokens \+ 1 = 8"),
        ({"policy": "/nonexistent/policy.json"}, r"policy file '/nonexistent/policy.json' does not exist"),
        ({"capture": "/nonexistent/dir/records.jsonl"}, r"directory '/nonexistent/dir' does not exist"),
        ({"gdn_kernel": "maybe"}, r"gdn_kernel: Input should be a valid boolean \(got 'maybe'\)"),
        ({"gdn_kernel": "true"}, r"gdn_kernel: Input should be a valid boolean \(got 'true'\)"),
        ({"full_graph_lengths": [2, "3"]}, (r"full_graph_lengths: Input should be a valid boolean or a valid "
                                             r"integer at item 1 \(got \[2, '3'\]\)")),
        ("on", r'"hybridspec" in --speculative-config must be a JSON object'),
    ],
)
def test_bad_options_name_the_value(raw, message):
    with pytest.raises(ValueError, match=message) as error:
        parse_options(raw, 7)
    assert "\n" not in str(error.value)


def test_policy_for_another_draft_length(tmp_path):
    k = json.loads(open("examples/policy_synth.json").read())["draft_len"]
    with pytest.raises(ValueError, match=rf"draft_len={k} but num_speculative_tokens={k + 1}"):
        parse_options({"policy": "examples/policy_synth.json"}, k + 1)


def test_resolve_pops_options_into_additional_config():
    class Target:
        hf_config = None

    spec, extra = resolve_speculative_config(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2,
         "hybridspec": {"gdn_kernel": False}}, Target())
    assert "hybridspec" not in spec and spec["num_speculative_tokens"] == 3
    assert extra["hybridspec"]["gdn_kernel"] is False

    class Config:
        additional_config = extra

    assert hybridspec_options(Config()) == HybridSpecOptions(gdn_kernel=False)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        resolve_speculative_config({"method": "ngram", "hybridspec": {}}, Target())


def test_capture_is_accepted_with_an_existing_directory(tmp_path):
    options = parse_options({"capture": str(tmp_path / "records.jsonl")}, 7)
    assert options.capture == str(tmp_path / "records.jsonl")
    assert not options.select and options.fixed_length is None

def test_capture_paths_that_cannot_be_written_are_refused_at_config_time(tmp_path, monkeypatch):
    """The workers open the capture file at start-up; what would fail there is refused here, in one line
    (on main 8c095d8 an existing directory passed this check and crashed the engine at start-up)."""
    def refusal(capture) -> str:
        with pytest.raises(ValueError) as error:
            parse_options({"capture": str(capture)}, 7)
        assert "\n" not in str(error.value)
        return str(error.value)

    assert refusal(tmp_path) == f"hybridspec.capture '{tmp_path}' is a directory; give the path of a file to write"
    missing = tmp_path / "no-dir" / "r.jsonl"
    assert refusal(missing) == (f"hybridspec.capture '{missing}': directory '{missing.parent}' does not exist; "
                                "create it or write elsewhere")
    (tmp_path / "file").write_text("")
    below_file = tmp_path / "file" / "r.jsonl"
    assert refusal(below_file) == f"hybridspec.capture '{below_file}': '{tmp_path / 'file'}' is a file, not a directory"
    import os

    # root may write anywhere (chmod cannot make a directory unwritable for it): the permission check is
    # os.access, so that is what this part of the test answers for
    locked = tmp_path / "locked"
    locked.mkdir()
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != locked)
    assert refusal(locked / "r.jsonl") == (f"hybridspec.capture '{locked / 'r.jsonl'}': directory '{locked}' is not "
                                           "writable")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "locked"]


@pytest.mark.parametrize("raw, message", [
    ({"captur": "r.jsonl"}, "captur: unknown key (did you mean 'capture'?), valid keys are policy, "),
    ({"capture": 3}, "capture: Input should be a valid string (got 3)"),
    ({"batched": True}, '"batched": true needs length selection ("select": true and a "policy")'),
    ({"full_graph_lengths": [0, 3]}, "hybridspec.full_graph_lengths=[0, 3]: give lengths in "
                                     "1..num_speculative_tokens + 1 = 8, or true / false"),
    ({"full_graph_lengths": []}, "hybridspec.full_graph_lengths=[]: give lengths in 1..num_speculative_tokens + 1"),
    ({"tp_broadcast": 1}, "tp_broadcast: Input should be a valid boolean (got 1)"),
    ({"drafter_cudagraphs": None}, "drafter_cudagraphs: Input should be a valid boolean (got None)"),
    ({"drafter_compile": "yes"}, "drafter_compile: Input should be a valid boolean (got 'yes')"),
    ({"drafter_fused_norms": 1}, "drafter_fused_norms: Input should be a valid boolean (got 1)"),
    ({"drafter_grouped_attention": "on"}, "drafter_grouped_attention: Input should be a valid boolean (got 'on')"),
    ({"drafter_candidate_heads": -1}, "drafter_candidate_heads: Input should be greater than or equal to 0 (got -1)"),
    ({"full_graph_spec_steps": "no"}, "full_graph_spec_steps: Input should be a valid boolean (got 'no')"),
    ({"gdn_fused_conv": "yes"}, "gdn_fused_conv: Input should be a valid boolean (got 'yes')"),
    ({"gate": 0}, "gate: Input should be a valid boolean (got 0)"),
    ({"routing": "yes"}, "routing: Input should be a valid boolean (got 'yes')"),
    ({"fixed_length": 3, "capture": "r.jsonl"}, '"capture" verifies every draft token; drop "select"/"fixed_length"'),
])
def test_each_option_refuses_a_bad_value_in_one_line(raw, message):
    with pytest.raises(ValueError) as error:
        parse_options(raw, 7)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_policy_that_is_a_directory_is_refused(tmp_path):
    with pytest.raises(ValueError) as error:
        parse_options({"policy": str(tmp_path)}, 7)
    assert str(error.value) == f"policy file '{tmp_path}' is a directory, not a file"
