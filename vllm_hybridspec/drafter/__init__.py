"""The H-Spec drafter, usable without vLLM.

Importing this package registers speculator type ``hspec`` with speculators, so
``speculators.SpeculatorModel.from_pretrained(path)`` resolves saved H-Spec checkpoints.
"""

from speculators.config import reload_schemas
from vllm_hybridspec.drafter.config import HSpecSpeculatorConfig
from vllm_hybridspec.drafter.model import DraftBlock, HSpecDraftModel
from vllm_hybridspec.drafter.target import (
    AttentionGeometry,
    check_kv_reuse,
    default_layer_selection,
    full_attention_layers,
)

# speculators builds its config union from the registry at import; rebuild it so "hspec" is in it.
reload_schemas()

__all__ = [
    "AttentionGeometry",
    "DraftBlock",
    "HSpecDraftModel",
    "HSpecSpeculatorConfig",
    "check_kv_reuse",
    "default_layer_selection",
    "full_attention_layers",
]
