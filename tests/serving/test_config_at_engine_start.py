"""The plugin loads and registers; bad H-Spec configurations fail at engine start with errors that
name the bad value (in the main process, before any worker starts: nothing hangs)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from transformers import Qwen3NextConfig

from vllm_hybridspec.engine import plugin
from vllm_hybridspec.engine.config import resolve_speculative_config
from vllm_hybridspec.engine.compat import check_vllm_version

from .conftest import make_llm

pytestmark = pytest.mark.timeout(120)


def test_plugin_is_an_entry_point_and_registers_everything():
    from importlib.metadata import entry_points

    from vllm import ModelRegistry
    from vllm.engine.arg_utils import EngineArgs
    from vllm.plugins import load_general_plugins
    from vllm.transformers_utils.configs.speculators.algos import SUPPORTED_SPECULATORS_TYPES
    from vllm.v1.worker import gpu_model_runner

    from vllm_hybridspec.engine.drafting.proposer import RunnerDFlashProposer

    assert "vllm_hybridspec.engine.plugin:register" in [e.value for e in entry_points(group="vllm.general_plugins")]
    load_general_plugins()
    plugin.register()  # idempotent
    assert "HSpecDraftModel" in ModelRegistry.get_supported_archs()
    assert "hspec" in SUPPORTED_SPECULATORS_TYPES
    assert gpu_model_runner.DFlashProposer is RunnerDFlashProposer
    assert EngineArgs.create_speculative_config.__hspec_wrapped__


def test_other_vllm_versions_are_refused():
    check_vllm_version("0.26.3")
    with pytest.raises(RuntimeError, match=r"vLLM 0\.26\.x, but vLLM 0\.25\.1 is installed"):
        check_vllm_version("0.25.1")


def _edit(src, dst, **changes):
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    for key, value in changes.items():
        if key.startswith("layer_"):
            config["transformer_layer_config"][key[len("layer_"):]] = value
        else:
            config[key] = value
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"method": "hspek", "model": "x", "num_speculative_tokens": 7}, r"unknown speculative method 'hspek'.*'hspec'"),
        ({"method": "hspec", "num_speculative_tokens": 7}, r'"hspec" needs "model"'),
        ({"method": "hspec", "model": "/nonexistent/hspec", "num_speculative_tokens": 7},
         r"H-Spec checkpoint '/nonexistent/hspec' not found"),
    ],
)
def test_bad_method_or_missing_checkpoint(target_dir, spec, message):
    with pytest.raises(ValueError, match=message):
        make_llm(target_dir, spec)


def test_attention_shape_mismatch(target_dir, hspec_dir, tmp_path):
    bad = _edit(hspec_dir, tmp_path / "bad", layer_num_key_value_heads=4)
    with pytest.raises(ValueError, match=r"num_key_value_heads: drafter 4 vs target 2"):
        make_llm(target_dir, {"method": "hspec", "model": str(bad), "num_speculative_tokens": 7})


def test_kv_reuse_layer_that_is_not_full_attention(target_dir, hspec_dir, tmp_path):
    bad = _edit(hspec_dir, tmp_path / "bad", kv_reuse_layer_ids=[2, 3, 9])
    with pytest.raises(ValueError, match=r"target layers \[9\] are not full-attention layers"):
        make_llm(target_dir, {"method": "hspec", "model": str(bad), "num_speculative_tokens": 7})


def test_too_many_speculative_tokens(target_dir, hspec_dir):
    with pytest.raises(ValueError, match=r"num_speculative_tokens=9 is not valid .* use an integer in 1\.\.7"):
        make_llm(target_dir, {"method": "hspec", "model": str(hspec_dir), "num_speculative_tokens": 9})


def test_kv_reuse_of_a_gated_deltanet_layer_of_a_hybrid_target(hspec_dir, tmp_path):
    """On Qwen3-Next (full attention every 4th layer) a drafter reading layer 2 is refused."""
    hybrid = Qwen3NextConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=8,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=32, full_attention_interval=4,
                             partial_rotary_factor=1.0)
    good = _edit(hspec_dir, tmp_path / "good", kv_reuse_layer_ids=[3, 7], num_layers=4)
    _edit(hspec_dir, tmp_path / "bad", kv_reuse_layer_ids=[2, 3])
    target = SimpleNamespace(hf_config=hybrid)
    with pytest.raises(ValueError, match=r"target layers \[2\] are not full-attention layers; the target's "
                                         r"full-attention layers are \[3, 7\]"):
        resolve_speculative_config({"method": "hspec", "model": str(tmp_path / "bad")}, target)
    resolved, extra = resolve_speculative_config({"method": "hspec", "model": str(good)}, target)
    assert resolved["method"] == "dflash" and resolved["num_speculative_tokens"] == 7 and extra == {}


def start_llm_in_a_subprocess(script: str) -> subprocess.CompletedProcess:
    """Run ``script`` (an ``LLM(...)`` start) as a user would: its own process, vLLM's engine core in
    another, this checkout's plugin (vLLM loads it by entry point, which may name another checkout's
    copy)."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_TARGET_DEVICE": "cpu",
           "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=root,
                          timeout=110, check=False)


def test_truncated_drafter_weights_fail_engine_start_with_one_line(tmp_path):
    """The whole user path, with vLLM's engine-core process as a user gets it: ``LLM(...)`` on the
    reference drafter with a truncated ``model.safetensors`` ends with one ``ValueError`` line and one
    traceback (the main process's); no engine core or worker starts, so none dies with its own."""
    root = Path(__file__).resolve().parents[2]
    models = root / "models"
    drafter = Path(shutil.copytree(models / "dense-hspec", tmp_path / "drafter"))
    weights = drafter / "model.safetensors"
    size = weights.stat().st_size
    weights.write_bytes(weights.read_bytes()[: size // 2])
    script = (
        "from vllm import LLM\n"
        f"LLM(model={str(models / 'dense')!r}, skip_tokenizer_init=True, enforce_eager=True, dtype='float32', "
        f"max_model_len=256, speculative_config={{'method': 'hspec', 'model': {str(drafter)!r}}})\n"
    )
    run = start_llm_in_a_subprocess(script)
    assert run.returncode == 1
    assert run.stderr.count("Traceback (most recent call last)") == 1, run.stderr[-4000:]
    assert run.stderr.rstrip().splitlines()[-1] == (
        f"ValueError: drafter weights {weights} are damaged: its header describes {size} bytes but the file has "
        f"{size // 2} (the file is truncated); re-save or re-download the checkpoint"
    )
    assert "EngineCore" not in run.stderr + run.stdout


def test_length_selection_with_vllms_own_gdn_path_fails_engine_start_with_one_line():
    """A hybrid target whose GDN layers would run vLLM's own spec path (``"gdn_kernel": false``) with
    length selection: ``LLM(...)`` ends with one ``ValueError`` line naming both options and the way
    out, in the main process (no engine core starts)."""
    root = Path(__file__).resolve().parents[2]
    models = root / "models"
    policy = models / "hybrid-hspec" / "policy_cpu.json"
    spec = {"method": "hspec", "model": str(models / "hybrid-hspec"),
            "hybridspec": {"policy": str(policy), "gdn_kernel": False}}
    script = (
        "from vllm import LLM\n"
        f"LLM(model={str(models / 'hybrid')!r}, skip_tokenizer_init=True, enforce_eager=True, dtype='float32', "
        f"max_model_len=256, mamba_ssm_cache_dtype='float32', speculative_config={spec!r})\n"
    )
    run = start_llm_in_a_subprocess(script)
    assert run.returncode == 1
    last = run.stderr.rstrip().splitlines()[-1]
    assert last.startswith(f'ValueError: "hybridspec": {{"gdn_kernel": false}} with "policy": {str(policy)!r} '
                           "(length selection): vLLM's own GDN spec-decode path is not exact"), run.stderr[-4000:]
    assert last.endswith('drop "gdn_kernel": false (the one-slot GDN layer) or "policy"')
    assert "EngineCore" not in run.stderr + run.stdout


def test_length_selection_with_vllms_own_gdn_path_is_refused_for_gdn_targets_only(target_dir, hspec_dir, tmp_path):
    """In the main process, before vLLM sees the config: a policy or a fixed length below K + 1 with
    ``"gdn_kernel": false`` on a Qwen3-Next target is a ValueError naming both; the same options on a
    dense target, or verifying every draft on the hybrid, pass."""
    from vllm_hybridspec.policy.policy_file import load_policy

    hybrid = Qwen3NextConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=8,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=32, full_attention_interval=4,
                             partial_rotary_factor=1.0)
    drafter = _edit(hspec_dir, tmp_path / "drafter", kv_reuse_layer_ids=[3, 7], num_layers=4)
    policy = Path(__file__).resolve().parents[2] / "models" / "hybrid-hspec" / "policy_cpu.json"
    k = load_policy(str(policy)).draft_len
    spec = {"method": "hspec", "model": str(drafter), "num_speculative_tokens": k}
    for options, key in [({"gdn_kernel": False, "policy": str(policy)}, "policy"),
                         ({"gdn_kernel": False, "fixed_length": 2}, "fixed_length")]:
        with pytest.raises(ValueError, match=rf"with \"{key}\": .*: vLLM's own GDN spec-decode path is not exact.*"
                                             rf'or "{key}"$'):
            resolve_speculative_config({**spec, "hybridspec": options}, SimpleNamespace(hf_config=hybrid))
    resolve_speculative_config({**spec, "hybridspec": {"gdn_kernel": False, "fixed_length": k + 1}},
                               SimpleNamespace(hf_config=hybrid))
    resolve_speculative_config({**spec, "hybridspec": {"policy": str(policy)}}, SimpleNamespace(hf_config=hybrid))
    from transformers import AutoConfig

    dense = {**spec, "model": str(hspec_dir), "hybridspec": {"gdn_kernel": False, "policy": str(policy)}}
    resolve_speculative_config(dense, SimpleNamespace(hf_config=AutoConfig.from_pretrained(target_dir)))
