"""The calibration capture's expert counts (``n_new_l0``, ``n_new_later``) from the routers' expert ids,
without an engine: fresh random routings of a batch of rounds laid out as vLLM lays out a verifying
step (each request's anchor and drafts at its ``query_start_loc`` offset), against the counts made
with Python sets. A planted bug (each round's tokens read one row too late) is caught by the same
check."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_hybridspec.engine.length import capture as capture_module
from vllm_hybridspec.engine.length.capture import RoundCapture, new_expert_fields

from ...seeds import fresh_seed


def by_sets(ids: torch.Tensor) -> dict[str, list[int]]:
    """``ids`` ``[layers, 1 + D, k]``: per draft token, the experts (first layer) and (layer, expert)
    pairs (later layers) that no earlier token of the round chose."""
    layers, T, _ = ids.shape
    l0, later = [], []
    for t in range(1, T):
        new = [len(set(ids[layer, t].tolist()) - {e for s in range(t) for e in ids[layer, s].tolist()})
               for layer in range(layers)]
        l0.append(new[0])
        later.append(sum(new[1:]))
    return {"n_new_l0": l0, "n_new_later": later}


def random_routing(gen, layers: int, tokens: int, experts: int, k: int) -> torch.Tensor:
    """``[layers, tokens, k]`` distinct experts per token (a softmax router's top-k), few experts so
    that tokens share many."""
    logits = torch.randn(layers, tokens, experts, generator=gen)
    return logits.topk(k, dim=-1).indices


def test_new_expert_fields_count_what_each_draft_adds():
    gen = torch.Generator().manual_seed(fresh_seed("capture experts"))
    for layers, D, E, k in ((1, 7, 8, 2), (4, 7, 16, 4), (3, 15, 32, 8), (2, 1, 4, 4)):
        ids = random_routing(gen, layers, 1 + D, E, k)
        got = new_expert_fields(ids)
        want = by_sets(ids)
        if layers == 1:
            want["n_new_later"] = [0] * D
        assert got == want
        assert all(0 <= n <= k for n in got["n_new_l0"])
    ids = random_routing(gen, 2, 8, 8, 2)
    ids[1, 3, 0] = -1  # a router that did not run through the hook this step
    assert new_expert_fields(ids) == {}


def fake_runner(req_ids: list[str], starts: list[int]):
    return SimpleNamespace(input_batch=SimpleNamespace(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)}),
                           query_start_loc=SimpleNamespace(np=np.array(starts)))


@pytest.mark.parametrize("planted", [False, True])
def test_each_record_carries_its_own_rounds_counts(tmp_path, monkeypatch, planted):
    """Three requests verify K = 4 drafts each at offsets 0, 5, 10 of a 15-token step; the routers'
    ids go through ``routed`` as vLLM's MoE layers call it; each record's counts are its own round's."""
    monkeypatch.setattr("vllm.distributed.get_tensor_model_parallel_rank", lambda: 0)
    gen = torch.Generator().manual_seed(fresh_seed("capture experts"))
    K, E, k, names = 4, 12, 3, ["model.layers.0.mlp", "model.layers.1.mlp", "model.layers.2.mlp"]
    cap = RoundCapture(str(tmp_path / "r.jsonl"), K)
    cap.bind_routers(names, max_tokens=32)
    req_ids, starts = ["a", "b", "c"], [0, 5, 10, 15]
    runner = fake_runner(req_ids, starts)
    signals = torch.rand(3, K, generator=gen)
    cap.drafted(runner, signals, signals, torch.full((3,), K + 1))
    ids = random_routing(gen, len(names), 15, E, k)
    for layer, name in enumerate(names):  # the layers' router logits, whose top-k are these ids
        logits = torch.zeros(15, E).scatter_(1, ids[layer], torch.arange(k, 0, -1, dtype=torch.float).expand(15, k))
        cap.routed(name, logits, k)
    if planted:
        monkeypatch.setattr(capture_module, "new_expert_fields",
                            lambda x, original=new_expert_fields: original(torch.roll(x, -1, dims=1)))
    output = torch.full((3, K + 1), -1)
    output[:, :2] = 7  # one accepted draft each
    cap.sampled(runner, output, SimpleNamespace(scheduled_spec_decode_tokens={r: [0] * K for r in req_ids}))
    cap.close()
    records = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert [r["accepted"] for r in records] == [1, 1, 1]
    matches = [{f: r[f] for f in ("n_new_l0", "n_new_later")} == by_sets(ids[:, starts[i]:starts[i] + K + 1])
               for i, r in enumerate(records)]
    assert all(matches) != planted, matches
    # the buffer is marked unwritten for the next step: a step whose routers do not run records no counts
    assert bool((cap._expert_ids < 0).all())
