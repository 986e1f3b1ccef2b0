"""Bad inputs to ``--speculative-config`` with ``"method": "hspec"`` are refused by
``resolve_speculative_config`` (the main process, before vLLM builds its own config objects) with one
line naming the file, field or value and what would be valid. The checkpoints are damaged copies of
the reference drafter ``models/dense-hspec``; the target is ``models/dense``'s config."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from transformers import AutoConfig

from vllm_hybridspec.engine.config import resolve_speculative_config

MODELS = Path(__file__).resolve().parents[2] / "models"
BLOCK = json.loads((MODELS / "dense-hspec" / "config.json").read_text())["block_size"]


@pytest.fixture(scope="module")
def target():
    return SimpleNamespace(hf_config=AutoConfig.from_pretrained(MODELS / "dense"))


@pytest.fixture
def drafter(tmp_path) -> Path:
    """A fresh copy of the reference H-Spec drafter, to damage."""
    return Path(shutil.copytree(MODELS / "dense-hspec", tmp_path / "drafter"))


def refusal(target, spec: dict, load_format: str = "auto") -> str:
    """The one-line message ``resolve_speculative_config`` refuses ``spec`` with."""
    with pytest.raises(ValueError) as error:
        resolve_speculative_config(spec, target, load_format)
    message = str(error.value)
    assert "\n" not in message
    return message


def test_the_reference_drafter_resolves_to_vllm_dflash(target, drafter):
    spec, extra = resolve_speculative_config({"method": "hspec", "model": str(drafter)}, target)
    assert spec == {"method": "dflash", "model": str(drafter), "num_speculative_tokens": BLOCK - 1}
    assert extra == {}


@pytest.mark.parametrize("k, expected", [(None, BLOCK - 1), (1, 1), (BLOCK - 1, BLOCK - 1)])
def test_num_speculative_tokens_absent_or_in_range(target, drafter, k, expected):
    spec = {"method": "hspec", "model": str(drafter), **({} if k is None else {"num_speculative_tokens": k})}
    assert resolve_speculative_config(spec, target)[0]["num_speculative_tokens"] == expected
    spec["num_speculative_tokens"] = None  # an explicit null is vLLM's default, i.e. absent
    assert resolve_speculative_config(spec, target)[0]["num_speculative_tokens"] == BLOCK - 1


@pytest.mark.parametrize("k", [0, -3, "7", True, 7.0, BLOCK, [7]])
def test_num_speculative_tokens_out_of_range_or_not_an_integer(target, drafter, k):
    message = refusal(target, {"method": "hspec", "model": str(drafter), "num_speculative_tokens": k})
    assert message == (
        f"num_speculative_tokens={k!r} is not valid for the H-Spec drafter {str(drafter)!r} (block_size={BLOCK}): "
        f"use an integer in 1..{BLOCK - 1}, or leave it out to draft all {BLOCK - 1}"
    )


def test_truncated_config_json_names_the_file_and_the_position(target, drafter):
    config = drafter / "config.json"
    text = config.read_text()
    cut = len(text) // 2
    config.write_text(text[:cut])
    try:
        json.loads(text[:cut])
    except json.JSONDecodeError as e:
        position = f"line {e.lineno} column {e.colno} (char {e.pos})"
    message = refusal(target, {"method": "hspec", "model": str(drafter)})
    assert message.startswith(f"drafter config {config} is not valid JSON: ")
    assert position in message and "truncated" in message and message.endswith("expected a JSON object")


@pytest.mark.parametrize(
    "content, problem",
    [
        (b"", r"is not valid JSON: Expecting value: line 1 column 1 \(char 0\) \(the text ends before"),
        (b'{"block_size": 8,,}', (r"is not valid JSON: Expecting property name enclosed in double quotes: "
                                  r"line 1 column 18 \(char 17\); expected a JSON object")),
        (b"\xff\xfe{}", r"is not UTF-8 text \('utf-8' codec can't decode byte 0xff in position 0"),
        (b"[1, 2]", r"holds a JSON list, expected a JSON object"),
    ],
)
def test_config_json_that_is_not_a_json_object(target, drafter, content, problem):
    (drafter / "config.json").write_bytes(content)
    message = refusal(target, {"method": "hspec", "model": str(drafter)})
    assert re.match(rf"drafter config {re.escape(str(drafter / 'config.json'))} {problem}", message)


def test_config_field_of_the_wrong_type_is_one_line(target, drafter):
    config = json.loads((drafter / "config.json").read_text())
    (drafter / "config.json").write_text(json.dumps({**config, "block_size": "eight", "num_layers": [4]}))
    assert refusal(target, {"method": "hspec", "model": str(drafter)}) == (
        f"H-Spec drafter {str(drafter)!r} has an invalid config.json: block_size: Input should be a valid integer, "
        "unable to parse string as an integer (got 'eight'); num_layers: Input should be a valid integer (got [4])"
    )


def _header_length(weights: Path) -> int:
    return int.from_bytes(weights.read_bytes()[:8], "little")


def test_flipped_bytes_in_the_safetensors_header(target, drafter):
    weights = drafter / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[8] ^= 0xFF  # the header's opening brace: no longer UTF-8
    weights.write_bytes(data)
    assert refusal(target, {"method": "hspec", "model": str(drafter)}) == (
        f"drafter weights {weights} are damaged: invalid UTF-8 in header: invalid utf-8 sequence of 1 bytes "
        "from index 0; re-save or re-download the checkpoint"
    )


def test_invalid_json_in_the_safetensors_header_names_the_column(target, drafter):
    weights = drafter / "model.safetensors"
    data = bytearray(weights.read_bytes())
    at = data.index(b"[", 8)  # the first shape list
    data[at] = ord("#")
    weights.write_bytes(data)
    assert refusal(target, {"method": "hspec", "model": str(drafter)}) == (
        f"drafter weights {weights} are damaged: invalid JSON in header: expected value at line 1 column "
        f"{at - 8 + 1}; re-save or re-download the checkpoint"
    )


@pytest.mark.parametrize("keep", [0.5, 0.999])
def test_truncated_safetensors_names_both_sizes(target, drafter, keep):
    weights = drafter / "model.safetensors"
    data = weights.read_bytes()
    assert len(data) > 8 + _header_length(weights)
    weights.write_bytes(data[: int(len(data) * keep)])
    assert refusal(target, {"method": "hspec", "model": str(drafter)}) == (
        f"drafter weights {weights} are damaged: its header describes {len(data)} bytes but the file has "
        f"{int(len(data) * keep)} (the file is truncated); re-save or re-download the checkpoint"
    )


def test_safetensors_with_extra_bytes(target, drafter):
    weights = drafter / "model.safetensors"
    size = weights.stat().st_size
    with weights.open("ab") as f:
        f.write(bytes(64))
    assert f"its header describes {size} bytes but the file has {size + 64} (the file has extra bytes at its end)" in (
        refusal(target, {"method": "hspec", "model": str(drafter)}))


@pytest.mark.parametrize("keep", [0, 5, 100])
def test_safetensors_truncated_inside_its_header(target, drafter, keep):
    weights = drafter / "model.safetensors"
    length = _header_length(weights)
    weights.write_bytes(weights.read_bytes()[:keep])
    problem = (f"it has {keep} bytes, fewer than the 8 of a safetensors header length (the file is truncated)"
               if keep < 8 else f"its header length field says {length} bytes but only {keep - 8} follow it (the "
               "file is truncated, or its first 8 bytes are damaged)")
    assert refusal(target, {"method": "hspec", "model": str(drafter)}) == (
        f"drafter weights {weights} are damaged: {problem}; re-save or re-download the checkpoint")


def test_a_tensor_past_the_end_of_the_file(target, drafter):
    """A header rewritten (same length) so that one tensor's range reaches past the data."""
    weights = drafter / "model.safetensors"
    data = weights.read_bytes()
    length = _header_length(weights)
    header = json.loads(data[8 : 8 + length])
    name = max((n for n in header if n != "__metadata__"), key=lambda n: header[n]["data_offsets"][1])
    header[name]["data_offsets"][1] += 2
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= length
    weights.write_bytes(data[:8] + text.ljust(length) + data[8 + length :])
    assert f"its header describes {len(data) + 2} bytes but the file has {len(data)} (the file is truncated)" in (
        refusal(target, {"method": "hspec", "model": str(drafter)}))


def test_missing_weights(target, drafter):
    (drafter / "model.safetensors").unlink()
    assert refusal(target, {"method": "hspec", "model": str(drafter)}) == (
        f"drafter checkpoint {drafter} has no weights: no model.safetensors (nor any *.safetensors / *.bin / *.pt "
        "file) with load_format='auto'; copy the checkpoint's model.safetensors there, or use "
        "load_format='dummy' for random weights"
    )


def test_missing_or_damaged_weights_are_fine_with_dummy_weights(target, drafter):
    """``load_format="dummy"`` (the engine's, or the drafter's own ``draft_load_config``) reads no file."""
    (drafter / "model.safetensors").write_bytes(b"\0")
    spec = {"method": "hspec", "model": str(drafter)}
    assert resolve_speculative_config(spec, target, "dummy")[0]["method"] == "dflash"
    assert resolve_speculative_config({**spec, "draft_load_config": {"load_format": "dummy"}}, target)[0]
    assert "are damaged" in refusal(target, {**spec, "draft_load_config": {"load_format": "auto"}}, "dummy")


@pytest.mark.parametrize(
    "options, problem",
    [
        ({"gdn_kernel": "false"}, "gdn_kernel: Input should be a valid boolean (got 'false')"),
        ({"fixed_length": "8"}, "fixed_length: Input should be a valid integer (got '8')"),
        ({"fixed_length": 2.0}, "fixed_length: Input should be a valid integer (got 2.0)"),
        ({"gdn_kernal": False}, ("gdn_kernal: unknown key (did you mean 'gdn_kernel'?), valid keys are policy, select, batched, routing, gate, "
                                 "gdn_kernel, capture, fixed_length, drafter_cudagraphs, drafter_compile, drafter_fused_norms, drafter_grouped_attention, drafter_candidate_heads, "
                                 "full_graph_lengths, tp_broadcast, full_graph_spec_steps, gdn_fused_conv (got False)")),
    ],
)
def test_hybridspec_options_of_the_wrong_type_or_unknown(target, drafter, options, problem):
    spec = {"method": "hspec", "model": str(drafter), "hybridspec": options}
    assert refusal(target, spec) == f'invalid "hybridspec" options: {problem}'


def test_routing_tables_must_fit_the_targets_router(tmp_path):
    """HybridSpec's routing correction counts new experts among the router's top-k choices: a policy with
    routing tables needs a target that routes each token to as many experts by a softmax top-k; the
    refusal names the file and the numbers, and ``"routing": false`` keeps the nominal lengths."""
    from .length.test_selector import policy_file

    hybrid = SimpleNamespace(hf_config=AutoConfig.from_pretrained(MODELS / "hybrid"))  # 4 of 32 experts
    dense = SimpleNamespace(hf_config=AutoConfig.from_pretrained(MODELS / "dense"))
    spec = {"method": "hspec", "model": str(MODELS / "hybrid-hspec"), "num_speculative_tokens": 7}
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    fits = policy_file(tmp_path / "a", routing_topk=4)
    spec_out, extra = resolve_speculative_config({**spec, "hybridspec": {"policy": fits}}, hybrid)
    assert extra["hybridspec"]["routing"] is None and spec_out["method"] == "dflash"
    other = policy_file(tmp_path / "b", routing_topk=8)
    assert refusal(hybrid, {**spec, "hybridspec": {"policy": other}}) == (
        f"policy file {other!r} has routing tables for 8 experts per token, but the target routes each token to "
        'num_experts_per_tok=4; fit the policy for this target, or give "routing": false')
    resolve_speculative_config({**spec, "hybridspec": {"policy": other, "routing": False}}, hybrid)
    dense_spec = {"method": "hspec", "model": str(MODELS / "dense-hspec"), "num_speculative_tokens": 7}
    assert "the target has no mixture-of-experts router" in refusal(dense, {**dense_spec, "hybridspec": {"policy": fits}})


def test_the_engine_log_names_an_hspec_configuration_by_the_method_asked_for():
    """vLLM's start-up line prints ``speculative_config={...!r}`` (``VllmConfig.__str__``); the wrapped
    ``SpeculativeConfig.__repr__`` names "hspec" for an H-Spec drafter and leaves other methods alone."""
    import inspect

    from vllm.config.speculative import SpeculativeConfig
    from vllm.config.vllm import VllmConfig

    from vllm_hybridspec.engine import patches
    from vllm_hybridspec.engine.compat import HSPEC_ARCHITECTURE

    assert "speculative_config={self.speculative_config!r}" in inspect.getsource(VllmConfig.__str__)
    row = next(r for r in patches.PATCHES if r.owner.endswith(":SpeculativeConfig") and r.attr == "__repr__")
    patches.apply_row(row)
    patches.apply_row(row)  # idempotent: one wrapper in the chain

    def config(method, architectures):
        draft = SimpleNamespace(model="models/hybrid-hspec", hf_config=SimpleNamespace(architectures=architectures))
        return SimpleNamespace(method=method, draft_model_config=draft, num_speculative_tokens=7)

    assert SpeculativeConfig.__repr__(config("dflash", [HSPEC_ARCHITECTURE])) == (
        "SpeculativeConfig(method='hspec' (vLLM path 'dflash'), model='models/hybrid-hspec', num_spec_tokens=7)")
    assert SpeculativeConfig.__repr__(config("dflash", ["DFlashDraftModel"])) == (
        "SpeculativeConfig(method='dflash', model='models/hybrid-hspec', num_spec_tokens=7)")
    assert SpeculativeConfig.__repr__(config("ngram", None)) == (
        "SpeculativeConfig(method='ngram', model=None, num_spec_tokens=7)")
    assert SpeculativeConfig.__repr__.__wrapped__.__qualname__ == "SpeculativeConfig.__repr__"


def test_a_policy_file_with_a_number_as_text_is_refused_at_engine_start(tmp_path):
    """The engine reads the policy file with the same strict reader as the commands: one line naming the
    file, the field and the value, before any worker starts."""
    hybrid = SimpleNamespace(hf_config=AutoConfig.from_pretrained(MODELS / "hybrid"))
    policy = json.loads((MODELS / "hybrid-hspec" / "policy_cpu.json").read_text())
    policy["gate"] = {"4": "true"}
    bad = tmp_path / "policy.json"
    bad.write_text(json.dumps(policy))
    spec = {"method": "hspec", "model": str(MODELS / "hybrid-hspec"), "num_speculative_tokens": 7,
            "hybridspec": {"policy": str(bad)}}
    message = refusal(hybrid, spec)
    assert len(message.splitlines()) == 1
    assert str(bad) in message and "'gate.4'" in message and "'true'" in message and "valid boolean" in message
