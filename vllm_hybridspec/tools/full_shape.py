"""``hybridspec full-shape``: config-only checkpoints at the Qwen3.6-35B-A3B shape, for measurements
with dummy weights (``load_format="dummy"``: vLLM initialises random weights from ``config.json``;
nothing is downloaded).

Writes ``<out>/target`` (a ``Qwen3NextForCausalLM`` with the 35B-A3B hybrid shape: 40 layers, 30 GDN
+ 10 full attention, 256 experts top-8; ``--layers`` keeps the widths, heads and experts with fewer
layers, a slice that starts in a fraction of the time and has the same per-layer costs),
``<out>/hspec`` (an H-Spec drafter config for it: 4 layers, blocks of ``--block-size`` tokens, K/V read
in place from the target's last full-attention layers) and ``<out>/dflash`` (speculators' DFlash
drafter config, 5 layers). Dummy weights give random acceptance; realistic acceptance at this shape
comes from the replay proposer (docs/bench.md).

    hybridspec full-shape --out out/full-shape [--layers 8] [--block-size 16]
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import typer

# Qwen3.5/3.6-35B-A3B (text part) as a Qwen3-Next config: vLLM runs both through the same GDN layer.
QWEN36_35B_A3B = dict(
    vocab_size=248320, hidden_size=2048, num_hidden_layers=40, full_attention_interval=4,
    num_attention_heads=16, num_key_value_heads=2, head_dim=256, partial_rotary_factor=0.25,
    linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_conv_kernel_dim=4, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
    shared_expert_intermediate_size=512, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
    intermediate_size=5120, max_position_embeddings=262144, rope_theta=10_000_000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=False, bos_token_id=248044, eos_token_id=248044,
)
MASK_TOKEN_ID = 248045


def write_target(out: Path, overrides: dict | None = None) -> Path:
    from transformers import Qwen3NextConfig

    config = Qwen3NextConfig(**{**QWEN36_35B_A3B, **(overrides or {})})
    config.architectures = ["Qwen3NextForCausalLM"]
    config.torch_dtype = "bfloat16"
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    return out


def write_hspec(target: Path, out: Path, num_layers: int = 4, block_size: int = 16) -> Path:
    """The drafter is built on the meta device (no memory) and only its config is saved."""
    from transformers import AutoConfig

    from vllm_hybridspec.drafter import HSpecDraftModel, default_layer_selection

    config = AutoConfig.from_pretrained(target)
    selected, kv = default_layer_selection(config)
    with torch.device("meta"):
        model = HSpecDraftModel.from_training_args(
            config, None, None, verifier_name_or_path=None, target_layer_ids=selected,
            kv_reuse_layer_ids=kv, mask_token_id=MASK_TOKEN_ID, num_layers=num_layers, block_size=block_size)
    # no verifier weights exist to load (dummy weights); record which target it drafts for
    model.config.speculators_config.verifier.name_or_path = str(target)
    model.config.save_pretrained(out)
    return out


def write_dflash(target: Path, out: Path, num_layers: int = 5) -> Path:
    """A DFlash config as vLLM reads it (the form ../shared/device/README.md measured)."""
    from transformers import AutoConfig

    from vllm_hybridspec.drafter import default_layer_selection

    t = AutoConfig.from_pretrained(target)
    selected, _ = default_layer_selection(t)
    config = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": t.hidden_size,
        "num_hidden_layers": num_layers, "num_attention_heads": t.num_attention_heads,
        "num_key_value_heads": t.num_key_value_heads, "head_dim": t.head_dim,
        "intermediate_size": 3 * t.hidden_size, "vocab_size": t.vocab_size, "rms_norm_eps": t.rms_norm_eps,
        "max_position_embeddings": t.max_position_embeddings,
        "rope_theta": getattr(t, "rope_theta", None) or t.rope_parameters["rope_theta"],
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "block_size": 8,
        "dflash_config": {"mask_token_id": MASK_TOKEN_ID, "target_layer_ids": selected},
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


def full_shape(
    out: Path = typer.Option(Path("out/full-shape"), help="folder for target/, hspec/ and dflash/"),
    layers: int = typer.Option(40, min=4, help="decoder layers (a multiple of 4: every 4th is full attention)"),
    block_size: int = typer.Option(16, min=2, max=16, help="H-Spec draft block: the anchor and block_size - 1 "
                                   "drafts (num_speculative_tokens <= block_size - 1)"),
    hspec_layers: int = typer.Option(4, min=1),
    dflash_layers: int = typer.Option(5, min=1),
) -> None:
    """Write config-only target, H-Spec and DFlash checkpoints at the Qwen3.6-35B-A3B shape."""
    if layers % 4:
        raise typer.BadParameter(f"--layers {layers} is not a multiple of 4 (full_attention_interval = 4)")
    from vllm_hybridspec.tools.engine_args import output_path

    output_path(out, "--out", directory=True)
    target = write_target(out / "target", {"num_hidden_layers": layers})
    write_hspec(target, out / "hspec", hspec_layers, block_size)
    write_dflash(target, out / "dflash", dflash_layers)
    typer.echo(f"wrote {target}, {out / 'hspec'}, {out / 'dflash'} ({layers} layers)")
