"""``hybridspec models``: the reference models from scratch, stage by stage.

1. corpus split (``split.json``) and tokenizer (``tokenizer/``);
2. each target pretrained (``<kind>/``: checkpoint, loss curve, model card);
3. drafter prompts from the train split, held-out prompts for evaluation (``prompts/``);
4. per target, an H-Spec and a DFlash drafter trained with ``train/``'s recipe (``<kind>-hspec/``,
   ``<kind>-dflash/``: the ``final/`` checkpoint, metrics, model card);
5. per pair, acceptance per block position on the held-out prompts with bootstrap intervals and
   capture records (``<kind>-<drafter>/eval.json``, ``records.jsonl.gz``);
6. per pair, acceptance through vLLM on the held-out prompts and on prompts from outside the corpus
   (``<kind>-<drafter>/acceptance_vllm.json``, ``accept.py``).

Every stage writes its own outputs and is skipped when they exist (``--force`` redoes it), so an
interrupted build resumes. Work files (captured hidden states, optimizer checkpoints) go to
``<work_dir>``, outside the committed tree.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict

from vllm_hybridspec.train.reference.pretrain import PretrainSpec, device_auto
from vllm_hybridspec.train.reference.targets import DENSE, HYBRID, TargetSize

SPLIT_FILE = "split.json"


class BuildSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    out_dir: str = "models"
    work_dir: str = "out/models-work"
    seed: int = 0
    vocab_size: int = 8192
    heldout_percent: int = 5
    targets: dict[str, TargetSize] = {"hybrid": HYBRID, "dense": DENSE}
    pretrain: PretrainSpec = PretrainSpec()
    drafters: list[str] = ["hspec", "dflash"]
    stdlib_root: str | None = None  # the corpus's Python standard library (default: this interpreter's)
    num_train_prompts: int = 4096
    num_eval_prompts: int = 64
    num_outside_prompts: int = 32
    generation_batch_size: int = 128
    prompt_tokens: int = 96
    response_tokens: int = 128
    drafter_epochs: int = 4
    bootstrap: int = 2000


def stage_corpus(spec: BuildSpec, force: bool = False):
    """Split and tokenizer. Reuses a recorded ``split.json`` (reporting files missing here)."""
    from transformers import AutoTokenizer

    from vllm_hybridspec.train.reference.corpus import build_split, load_split, save_split
    from vllm_hybridspec.train.reference.tokenizer import train_tokenizer

    out = Path(spec.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    split_path, tok_dir = out / SPLIT_FILE, out / "tokenizer"
    root = Path(spec.stdlib_root) if spec.stdlib_root else None
    if split_path.exists() and not force:
        split, bad = load_split(split_path, root)
        if bad:
            print(f"{len(bad)} files of {split_path} are missing or differ under {split.root}; prompts come "
                  f"from the other {len(split.train)} + {len(split.heldout)}: {bad[:5]} ...")
    else:
        split = build_split(root, heldout_percent=spec.heldout_percent)
        save_split(split, split_path)
    if (tok_dir / "tokenizer.json").exists() and not force:
        tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    else:
        torch.manual_seed(spec.seed)
        tokenizer = train_tokenizer(split.texts("train"), vocab_size=spec.vocab_size)
        tokenizer.save_pretrained(tok_dir)
    return split, tokenizer


def stage_target(spec: BuildSpec, kind: str, split, tokenizer, force: bool = False) -> Path:
    """Pretrain target ``kind`` into ``<out_dir>/<kind>``; returns the checkpoint directory."""
    from vllm_hybridspec.train.reference.cards import target_card
    from vllm_hybridspec.train.reference.pretrain import pretrain, save_curve, save_target, token_stream
    from vllm_hybridspec.train.reference.targets import build_target
    from vllm_hybridspec.train.reference.tokenizer import encode_documents
    from vllm_hybridspec.train.target import use_torch_gated_delta_rule

    out = Path(spec.out_dir) / kind
    if (out / "pretrain.json").exists() and not force:
        return out
    device = device_auto()
    # fla's Triton backward of the gated chunk kernel refuses Hopper GPUs with Triton < 3.7.1 (fla
    # issue #640, wrong results), and on the CPU fla's kernels need a GPU: train with the torch rule
    use_torch_gated_delta_rule()
    train_tokens = token_stream(encode_documents(tokenizer, split.texts("train")))
    heldout_tokens = token_stream(encode_documents(tokenizer, split.texts("heldout")))
    model = build_target(spec.targets[kind], len(tokenizer), tokenizer.eos_token_id, seed=spec.seed)
    record = pretrain(model, train_tokens, heldout_tokens, spec.pretrain, device)
    record.update(
        kind=kind,
        size=spec.targets[kind].model_dump(),
        train_tokens_total=len(train_tokens),
        sample=greedy_sample(model, tokenizer, device),
        corpus={k: v for k, v in split.meta.items() if k != "file_digests"},
    )
    out.mkdir(parents=True, exist_ok=True)
    save_target(model, tokenizer, out)
    save_curve(record, out)
    curve = record.pop("curve")
    (out / "pretrain.json").write_text(json.dumps(record, indent=2))
    record["curve"] = curve
    (out / "README.md").write_text(target_card(record, out))
    return out


GREEDY_PROMPT = "def read_config(path):\n    "


@torch.no_grad()
def greedy_sample(model, tokenizer, device, prompt: str = GREEDY_PROMPT, max_new_tokens: int = 64) -> str:
    model.eval()
    ids = tokenizer(prompt, return_tensors="pt").input_ids.to(device)
    out = model.generate(input_ids=ids, max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=tokenizer.pad_token_id)
    model.train()
    return tokenizer.decode(out[0], skip_special_tokens=False)


def build_all(spec: BuildSpec, stages: list[str] | None = None, force: bool = False) -> None:
    """Run the stages (default: all) in order."""
    stages = stages or ["corpus", "targets", "prompts", "drafters", "evaluate", "accept"]
    t0 = time.perf_counter()
    split, tokenizer = stage_corpus(spec, force and "corpus" in stages)
    if "targets" in stages:
        for kind in spec.targets:
            stage_target(spec, kind, split, tokenizer, force)
    if "prompts" in stages:
        from vllm_hybridspec.train.reference.generate import stage_prompts

        stage_prompts(spec, split, tokenizer, force)
    if "drafters" in stages:
        from vllm_hybridspec.train.reference.drafters import stage_drafter

        for kind in spec.targets:
            for drafter in spec.drafters:
                stage_drafter(spec, kind, drafter, force)
    if "evaluate" in stages:
        from vllm_hybridspec.train.reference.evaluate import stage_evaluate

        for kind in spec.targets:
            for drafter in spec.drafters:
                stage_evaluate(spec, kind, drafter, force)
    if "accept" in stages:
        from vllm_hybridspec.train.reference.accept import stage_accept

        for kind in spec.targets:
            for drafter in spec.drafters:
                stage_accept(spec, kind, drafter, force)
    print(f"done in {time.perf_counter() - t0:.0f} s; outputs in {spec.out_dir}")


def clean_work(spec: BuildSpec) -> None:
    shutil.rmtree(spec.work_dir, ignore_errors=True)
