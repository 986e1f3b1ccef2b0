"""The one-slot layer's GDN metadata builder (``engine/gdn/metadata.py``) returns vLLM's own metadata, field
by field, on random batches: pure spec batches on its short path (with and without full graphs, several
KV-cache groups per step, padding rows), everything else through vLLM's ``build``; a planted bug in the
short path fails the same comparison."""

from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata, GDNAttentionMetadataBuilder
from vllm.v1.kv_cache_interface import MambaSpec

from vllm_hybridspec.engine.gdn import metadata as md_module
from vllm_hybridspec.engine.gdn.metadata import OneSlotGDNMetadataBuilder

from ...seeds import fresh_seed


class _Mode:
    def __init__(self, full):
        self.full = full

    def has_full_cudagraphs(self):
        return self.full


def _config(k: int, max_num_seqs: int, full: bool, tag: str):
    return SimpleNamespace(
        compilation_config=SimpleNamespace(cudagraph_mode=_Mode(full), max_cudagraph_capture_size=None),
        speculative_config=SimpleNamespace(num_speculative_tokens=k, parallel_drafting=True),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1),
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs),
        cache_config=SimpleNamespace(mamba_cache_mode="none"), instance_id=tag)


@pytest.fixture(autouse=True)
def _triton_prefill(monkeypatch):
    from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn

    monkeypatch.setattr(qwen_gdn_linear_attn, "_resolve_gdn_prefill_backend", lambda config: (None, "triton"))


def _spec():
    return MambaSpec(block_size=16, shapes=((4, 4),), dtypes=(torch.float32,))


def _builders(cls, groups, k, seqs, full, tag):
    config = _config(k, seqs, full, tag)
    return [cls(_spec(), [f"layer.{g}"], config, torch.device("cpu")) for g in range(groups)]


def _batch(rng: random.Random, k: int, seqs: int, kind: str):
    """A step's common metadata and the runner's extra arguments. ``kind``: "spec" (every row verifies
    drafts, 0..2 padding rows after them), "mixed" (a prefill or a decode row among them) or "plain" (no
    drafts at all)."""
    n = rng.randint(1, seqs)
    pad = rng.randint(0, 2) if kind == "spec" else 0
    lens, counts = [], []
    for i in range(n):
        d = rng.randint(0, k)
        lens.append(d + 1)
        counts.append(d)
    if kind == "mixed":
        i = rng.randrange(n)
        lens[i] = rng.choice([1, rng.randint(2, 9)])
        counts[i] = -1
    if kind == "spec" and sum(counts) == 0:  # vLLM reads a batch without any draft as plain decoding
        lens[0], counts[0] = 2, 1
    if kind == "plain":
        lens, counts = [1] * n, [-1] * n
    lens += [0] * pad
    counts += [-1] * pad
    rows = n + pad
    qsl = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32)
    seq_lens = torch.tensor([rng.randint(l, 300) if l else 0 for l in lens], dtype=torch.int32)
    width = k + 1
    gen = torch.Generator().manual_seed(rng.getrandbits(63))
    tables = [torch.randint(1, 10_000, (rows, width), dtype=torch.int32, generator=gen) for _ in range(3)]
    accepted = torch.randint(1, k + 2, (rows,), dtype=torch.int32, generator=gen)
    cm = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=seq_lens, num_reqs=rows,
        num_actual_tokens=int(qsl[-1]), max_query_len=max(lens), max_seq_len=int(seq_lens.max()),
        block_table_tensor=tables[0], slot_mapping=torch.arange(int(qsl[-1]), dtype=torch.int64))
    return cm, tables, accepted, torch.tensor(counts, dtype=torch.int32)


def _equal(x, y) -> bool:
    """Tensors by shape, dtype and value; dicts and sequences item by item; the rest by ==."""
    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        return (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.shape == y.shape
                and x.dtype == y.dtype and torch.equal(x, y))
    if isinstance(x, dict) and isinstance(y, dict):
        return x.keys() == y.keys() and all(_equal(x[key], y[key]) for key in x)
    if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
        return len(x) == len(y) and all(_equal(a, b) for a, b in zip(x, y))
    return x == y


def _same(a: GDNAttentionMetadata, b: GDNAttentionMetadata) -> list[str]:
    """The fields where two metadata differ."""
    return [f.name for f in dataclasses.fields(GDNAttentionMetadata)
            if not _equal(getattr(a, f.name), getattr(b, f.name))]


def _compare(seed: int, full: bool, kind: str, steps: int = 6):
    """``steps`` random steps built by vLLM's builders and by ours, three groups each; returns the
    differing fields of every group and step, and how many builds took the short path."""
    rng = random.Random(seed)
    k, seqs = rng.choice([3, 7, 15]), rng.choice([4, 8])
    theirs = _builders(GDNAttentionMetadataBuilder, 3, k, seqs, full, f"vllm-{seed}-{full}-{kind}")
    ours = _builders(OneSlotGDNMetadataBuilder, 3, k, seqs, full, f"ours-{seed}-{full}-{kind}")
    diffs = []
    for _ in range(steps):
        cm, tables, accepted, counts = _batch(rng, k, seqs, kind)
        for g in range(3):
            group = dataclasses.replace(cm, block_table_tensor=tables[g])
            group.query_start_loc = cm.query_start_loc  # one tensor object per step, as vLLM's shallow copies
            expected = theirs[g].build(0, group, num_accepted_tokens=accepted, num_decode_draft_tokens_cpu=counts)
            expected = dataclasses.replace(expected, **{  # snapshot: vLLM's buffers are rewritten next step
                f.name: getattr(expected, f.name).clone() for f in dataclasses.fields(GDNAttentionMetadata)
                if isinstance(getattr(expected, f.name), torch.Tensor)})
            got = ours[g].build(0, group, num_accepted_tokens=accepted, num_decode_draft_tokens_cpu=counts)
            diffs += [(g, name) for name in _same(expected, got)]
    return diffs, sum(b.fast_builds for b in ours)


@pytest.mark.parametrize("full", [True, False])
def test_pure_spec_batches_take_the_short_path_and_match_vllm(full):
    for seed in random.Random(fresh_seed(f"gdn_metadata_spec_{full}")).sample(range(10**6), 4):
        diffs, fast = _compare(seed, full, "spec")
        assert diffs == [], (seed, diffs)
        assert fast == 6 * 3, seed  # every group of every step


@pytest.mark.parametrize("kind", ["mixed", "plain"])
def test_other_batches_are_vllms_own_build(kind):
    for seed in random.Random(fresh_seed(f"gdn_metadata_{kind}")).sample(range(10**6), 3):
        diffs, fast = _compare(seed, True, kind)
        assert diffs == [] and fast == 0, (seed, diffs, fast)


def test_a_later_group_reuses_the_first_groups_parts_of_the_same_step_only():
    """Groups of one step share the step's parts; the next step (a new query_start_loc) builds its own."""
    rng = random.Random(fresh_seed("gdn_metadata_reuse"))
    ours = _builders(OneSlotGDNMetadataBuilder, 2, 7, 8, True, "reuse")
    cm, tables, accepted, counts = _batch(rng, 7, 8, "spec")
    first = ours[0].build(0, cm, num_accepted_tokens=accepted, num_decode_draft_tokens_cpu=counts)
    second = ours[1].build(0, dataclasses.replace(cm, block_table_tensor=tables[1]),
                           num_accepted_tokens=accepted, num_decode_draft_tokens_cpu=counts)
    assert second.spec_query_start_loc is first.spec_query_start_loc
    assert not torch.equal(second.spec_state_indices_tensor, first.spec_state_indices_tensor)
    cm2, _, accepted2, counts2 = _batch(rng, 7, 8, "spec")
    third = ours[1].build(0, cm2, num_accepted_tokens=accepted2, num_decode_draft_tokens_cpu=counts2)
    n = third.num_spec_decodes
    assert torch.equal(third.spec_query_start_loc[: n + 1], cm2.query_start_loc[: n + 1])


def test_a_planted_bug_in_the_short_path_is_caught(monkeypatch):
    """Negative control: the short path's state slots taken one row late (a wrong row of the block table)
    must differ from vLLM's build."""
    original = md_module.mamba_get_block_table_tensor

    def shifted(block_table, *args):
        return torch.roll(original(block_table, *args), 1, dims=0)

    monkeypatch.setattr(md_module, "mamba_get_block_table_tensor", shifted)
    caught = 0
    # a seed escapes only if all six steps have one row and no padding (the roll is then the identity):
    # at most (1/4 * 1/3) ** 6 = 3e-7 a seed
    for seed in random.Random(fresh_seed("gdn_metadata_planted")).sample(range(10**6), 4):
        diffs, _ = _compare(seed, True, "spec")
        caught += any(name == "spec_state_indices_tensor" for _, name in diffs)
    assert caught == 4


def _repeat_counts(seed: int, full: bool, builders=OneSlotGDNMetadataBuilder):
    """Two consecutive steps with equal counts and equal token offsets (new tensors, as every step of
    vLLM's runner makes) but different accepted tokens, three groups each, built by vLLM's builders and
    by ``builders``: the differing fields of each step and group."""
    rng = random.Random(seed)
    k, seqs = rng.choice([3, 7, 15]), rng.choice([4, 8])
    theirs = _builders(GDNAttentionMetadataBuilder, 3, k, seqs, full, f"vllm-repeat-{seed}-{full}")
    ours = _builders(builders, 3, k, seqs, full, f"ours-repeat-{seed}-{full}")
    cm, tables, accepted, counts = _batch(rng, k, seqs, "spec")
    gen = torch.Generator().manual_seed(rng.getrandbits(63))
    later, spec = accepted.clone(), counts >= 0  # the metadata holds the spec rows' counts (padding rows: 1)
    while torch.equal(later[spec], accepted[spec]):
        later = torch.randint(1, k + 2, accepted.shape, dtype=torch.int32, generator=gen)
    diffs = []
    for step, step_accepted in enumerate([accepted, later]):
        qsl = cm.query_start_loc.clone()  # equal values, a new tensor object
        step_cm = dataclasses.replace(cm, query_start_loc=qsl, query_start_loc_cpu=qsl.clone())
        step_counts = counts.clone()
        for g in range(3):
            group = dataclasses.replace(step_cm, block_table_tensor=tables[g])
            group.query_start_loc = qsl
            expected = theirs[g].build(0, group, num_accepted_tokens=step_accepted,
                                       num_decode_draft_tokens_cpu=step_counts)
            got = ours[g].build(0, group, num_accepted_tokens=step_accepted,
                                num_decode_draft_tokens_cpu=step_counts)
            diffs += [(step, g, name) for name in _same(expected, got)]
    return diffs


@pytest.mark.parametrize("full", [True, False])
def test_consecutive_steps_with_equal_counts_take_each_steps_accepted_tokens(full):
    """The parts a step's first group makes are reused by that step's later groups only: the next step,
    with the same counts and token offsets but other accepted tokens, gives vLLM's values."""
    for seed in random.Random(fresh_seed(f"gdn_metadata_repeat_{full}")).sample(range(10**6), 4):
        assert _repeat_counts(seed, full) == [], seed


class _CountsOnlyReuse(OneSlotGDNMetadataBuilder):
    """Planted bug: the reuse guard without its step check (any step with equal counts reuses the parts)."""

    def _step_of_other_group(self, m, counts_cpu):
        step = self._shared.get("step")
        if step is None or step.num_rows != m.num_reqs:
            return None
        return step if np.array_equal(step.counts.numpy(), counts_cpu.numpy()) else None


@pytest.mark.parametrize("full", [True, False])
def test_the_repeat_check_catches_reuse_across_steps(full):
    """Negative control: without the step check, the second step keeps the first step's accepted tokens."""
    for seed in random.Random(fresh_seed(f"gdn_metadata_repeat_planted_{full}")).sample(range(10**6), 4):
        assert (1, 0, "num_accepted_tokens") in _repeat_counts(seed, full, _CountsOnlyReuse), seed
