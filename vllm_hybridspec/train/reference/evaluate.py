"""Acceptance of a drafter + target pair outside vLLM: target and drafter in plain PyTorch, greedy,
full-length verification (every round checks all ``D = block_size - 1`` draft tokens), and the
rounds written as the length policy's capture records (``vllm_hybridspec.policy.records``).

With greedy verification the committed text is the target's greedy output whatever the drafter
proposes, so one greedy target pass over prompt + response gives, at every response position ``p``,
the prefix a round anchored there would see (the models are causal: the hidden states and K/V of
``[0, p)`` in the full pass are those of a prefix-only pass, up to floating-point summation order).
The drafter drafts a block at every response position in one batch, and :func:`walk_rounds` then
follows the decoding loop: a round at ``p`` accepts ``A`` tokens, the next is anchored at
``p + A + 1``.

Reported per pair: the acceptance rate per block position, ``alpha_k = P(A >= k)`` for k = 1..D,
and the mean accepted length ``tau = 1 + E[A]`` (tokens per round, bonus token included), each with
a 95% bootstrap interval that resamples prompts (rounds of one prompt are not independent).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch


def accepted_length(draft: torch.Tensor, truth: torch.Tensor) -> torch.Tensor:
    """Leading matches of ``draft`` and ``truth`` (``[N, D]`` each, ``truth`` -1 where unknown): ``[N]``."""
    match = ((draft == truth) & (truth >= 0)).long()  # [N, D]
    return match.cumprod(dim=1).sum(dim=1)


def walk_rounds(accepted: list[int] | torch.Tensor, start: int = 0) -> list[int]:
    """Anchor offsets the decoding loop visits: ``start``, then ``p + accepted[p] + 1`` while inside."""
    accepted = [int(a) for a in accepted]
    visited, p = [], start
    while p < len(accepted):
        visited.append(p)
        p += accepted[p] + 1
    return visited


@dataclass
class Round:
    """One round of one prompt; ``accepted`` is ``A_D``."""

    prompt: int
    accepted: int
    conf: list[float]
    ent: list[float]
    truncated: bool
    remaining: int


def position_acceptance(accepted: torch.Tensor, draft_len: int) -> torch.Tensor:
    """``alpha_k = P(A >= k)`` for k = 1..D from ``accepted`` ``[R]``: ``[D]`` float64."""
    k = torch.arange(1, draft_len + 1)
    return (accepted.double()[:, None] >= k).double().mean(dim=0)


def bootstrap_ci(
    accepted: torch.Tensor, prompt_ids: torch.Tensor, draft_len: int, n: int = 2000, seed: int = 0
) -> dict:
    """Point estimates and 95% percentile intervals of ``tau`` and ``alpha_1..D``, resampling prompts.

    ``accepted``, ``prompt_ids``: ``[R]`` over untruncated rounds. A resample draws prompts with
    replacement and pools their rounds, so long and short prompts weigh by their number of rounds."""
    prompts = torch.unique(prompt_ids)
    k = torch.arange(1, draft_len + 1)
    onehot = (prompt_ids[:, None] == prompts[None]).double()  # [R, P]
    ge = (accepted.double()[:, None] >= k).double()  # [R, D]
    return bootstrap_counts(onehot.sum(0), onehot.T @ ge, n, seed)


def bootstrap_counts(rounds: torch.Tensor, ge_sum: torch.Tensor, n: int = 2000, seed: int = 0) -> dict:
    """:func:`bootstrap_ci` from per-prompt counts: ``rounds`` ``[P]`` (rounds of each prompt) and
    ``ge_sum`` ``[P, D]`` (its rounds with ``A >= k``, k = 1..D), which is what vLLM's spec-decode
    counters give per request (``num_drafts`` and ``num_accepted_tokens_per_pos``)."""
    rounds, ge_sum = rounds.double(), ge_sum.double()
    if rounds.ndim != 1 or ge_sum.shape[0] != rounds.shape[0] or not bool((rounds > 0).all()):
        raise ValueError(f"expected rounds [P] > 0 and ge_sum [P, D]; got {tuple(rounds.shape)}, {tuple(ge_sum.shape)}")
    gen = torch.Generator().manual_seed(seed)
    P, D = ge_sum.shape
    draws = torch.randint(0, P, (n, P), generator=gen)  # [n, P]
    w = torch.zeros(n, P, dtype=torch.float64).scatter_add_(1, draws, torch.ones_like(draws, dtype=torch.float64))
    tot = w @ rounds  # [n]
    alpha = (w @ ge_sum) / tot[:, None]  # [n, D]
    tau = 1 + alpha.sum(dim=1)  # E[A] = sum_k P(A >= k)

    def interval(x):
        return [float(torch.quantile(x, 0.025)), float(torch.quantile(x, 0.975))]

    alpha_point = ge_sum.sum(0) / rounds.sum()
    return {
        "tau": float(1 + alpha_point.sum()),
        "tau_ci95": interval(tau),
        "alpha": alpha_point.tolist(),
        "alpha_ci95": [interval(alpha[:, j]) for j in range(D)],
        "rounds": int(rounds.sum()),
        "prompts": int(P),
        "bootstrap": n,
    }


def rounds_from_drafts(
    prompt: int,
    draft: torch.Tensor,
    conf: torch.Tensor,
    ent: torch.Tensor,
    truth: torch.Tensor,
    max_new_tokens: int,
) -> list[Round]:
    """The decoding loop over one response.

    ``draft``, ``conf``, ``ent``: ``[R, D]`` for anchors at response offsets ``0..R-1`` (the anchor at
    offset ``j`` is response token ``j``); ``truth``: ``[R + D]`` response tokens (the target's greedy
    output), -1 past its end. A round whose block reaches past the known response is truncated."""
    R, D = draft.shape
    idx = torch.arange(R)[:, None] + torch.arange(1, D + 1)  # [R, D] offsets of the drafted tokens
    known = truth[idx]
    accepted = accepted_length(draft, known)
    truncated = (known < 0).any(dim=1)
    rounds = []
    for p in walk_rounds(accepted):
        rounds.append(
            Round(prompt, int(accepted[p]), conf[p].tolist(), ent[p].tolist(), bool(truncated[p]),
                  max(1, max_new_tokens - p))
        )
    return rounds


SIGNAL_DECIMALS = 4  # the records' signals are kept to 1e-4: the policy's bins are far coarser


def to_records(rounds: list[Round]):
    from vllm_hybridspec.policy.records import RoundRecord

    return [
        RoundRecord(
            conf=[round(min(1.0, max(0.0, c)), SIGNAL_DECIMALS) for c in r.conf],
            ent=[round(max(0.0, e), SIGNAL_DECIMALS) for e in r.ent],
            accepted=r.accepted,
            truncated=r.truncated,
            remaining=r.remaining,
            request=r.prompt,
        )
        for r in rounds
    ]


def summarize(rounds: list[Round], draft_len: int, n_bootstrap: int = 2000, seed: int = 0) -> dict:
    full = [r for r in rounds if not r.truncated]
    if not full:
        raise ValueError("no untruncated rounds to measure; use longer responses")
    accepted = torch.tensor([r.accepted for r in full])
    prompt_ids = torch.tensor([r.prompt for r in full])
    return bootstrap_ci(accepted, prompt_ids, draft_len, n_bootstrap, seed)


# --- drafting every response position of one sequence ---------------------------------------------


def _probs_stats(logits: torch.Tensor):
    """Greedy tokens, their probabilities and the entropies (nats) of ``logits`` ``[..., V]``, fp32."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    top, tokens = logp.max(dim=-1)
    return tokens, top.exp(), -(logp.exp() * logp).sum(-1)


@torch.no_grad()
def draft_hspec(drafter, target, ids: torch.Tensor, anchors: torch.Tensor):
    """H-Spec blocks anchored at ``anchors`` (positions in ``ids`` ``[T]``), through ``propose``:
    ``(tokens, conf, ent)``, each ``[N, D]``."""
    from vllm_hybridspec.train.target import TargetKV, capture_hidden_states

    sel, kv_ids = drafter.target_layer_ids, drafter.kv_reuse_layer_ids
    hidden = capture_hidden_states(target, ids, sel)[:, :-1]  # [T, n_sel, hidden]
    device = next(drafter.parameters()).device
    dtype = next(drafter.parameters()).dtype
    positions = torch.arange(len(ids))
    kv = TargetKV(target, kv_ids, sel).to(device)(hidden[:, [sel.index(i) for i in kv_ids]].to(device),
                                                    positions.to(device))  # [T, n_kv, 2, kvh, D]
    N = len(anchors)
    prefix_kv = [
        (kv[:, i, 0].transpose(0, 1)[None].expand(N, -1, -1, -1).to(dtype),
         kv[:, i, 1].transpose(0, 1)[None].expand(N, -1, -1, -1).to(dtype))
        for i in range(len(kv_ids))
    ]  # [N, kvh, T, D] each
    last_hidden = hidden[anchors - 1].flatten(1).to(device, dtype)  # [N, n_sel * hidden]
    block = drafter.propose(last_hidden, ids[anchors].to(device), prefix_kv, anchors.to(device))
    return block.tokens.cpu(), block.top1_prob.float().cpu(), block.entropy.float().cpu()


@torch.no_grad()
def draft_dflash(drafter, target, ids: torch.Tensor, anchors: torch.Tensor):
    """speculators' DFlash blocks anchored at ``anchors``, through its training backbone with exactly
    these anchors (its inference lives in vLLM): ``(tokens, conf, ent)``, each ``[N, D]``."""
    from vllm_hybridspec.train.target import capture_hidden_states

    L = drafter.block_size
    sel = drafter.target_layer_ids
    captured = capture_hidden_states(target, ids, sel)  # [T, n_sel + 1, hidden]
    T = len(ids)
    pad = L  # select_anchors never anchors in the last block_size positions; nothing attends to these
    device = next(drafter.parameters()).device
    dtype = next(drafter.parameters()).dtype
    hidden = torch.zeros(T + pad, *captured.shape[1:])
    hidden[:T] = captured
    input_ids = torch.cat([ids, ids.new_full((pad,), int(ids[-1]))])
    loss_mask = torch.zeros(1, T + pad, dtype=torch.long)
    loss_mask[0, anchors] = 1
    _, logits, _, _, _ = drafter._backbone_forward(
        hidden[None, :, :-1].flatten(2).to(device, dtype),
        input_ids[None].to(device),
        loss_mask.to(device),
        hidden[None, :, -1].to(device, dtype),
        torch.zeros(1, T + pad, dtype=torch.long, device=device),
        max_anchors=len(anchors),
    )  # logits [1, N * L, V]
    logits = logits.view(len(anchors), L, -1)[:, 1:]  # slot k >= 1 drafts token p + k
    tokens, conf, ent = _probs_stats(logits)
    d2t = getattr(drafter, "d2t", None)
    if d2t is not None:
        tokens = tokens + d2t.to(tokens.device)[tokens]
    return tokens.cpu(), conf.cpu(), ent.cpu()


@torch.no_grad()
def greedy_responses(target, prompts: list[list[int]], max_new_tokens: int, eos_token_id: int,
                     batch_size: int = 16) -> list[list[int]]:
    """The target's greedy continuation of every prompt, cut after the first eos. Prompts of equal
    length are generated together (no padding, so each equals its unbatched greedy output up to
    floating-point summation order)."""
    from tqdm import tqdm

    device = target.device
    by_length: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_length.setdefault(len(p), []).append(i)
    batches = [idx[s : s + batch_size] for idx in by_length.values() for s in range(0, len(idx), batch_size)]
    responses: list[list[int]] = [[] for _ in prompts]
    for idx in tqdm(batches, desc="greedy target responses"):
        ids = torch.tensor([prompts[i] for i in idx], device=device)
        out = target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                              do_sample=False, pad_token_id=eos_token_id, eos_token_id=eos_token_id)
        for row, i in zip(out[:, ids.shape[1]:].tolist(), idx):
            responses[i] = row[: row.index(eos_token_id) + 1] if eos_token_id in row else row
    return responses


def evaluate_pair(target, drafter, kind: str, prompts: list[list[int]], responses: list[list[int]],
                  max_new_tokens: int) -> list[Round]:
    """Rounds of ``drafter`` (``"hspec"`` or ``"dflash"``) with ``target`` over token-id ``prompts`` and
    the target's greedy ``responses`` to them."""
    from tqdm import tqdm

    draft_fn = draft_hspec if kind == "hspec" else draft_dflash
    D = drafter.block_size - 1
    rounds: list[Round] = []
    for i, (prompt, response) in enumerate(tqdm(list(zip(prompts, responses)), desc=f"evaluating {kind}")):
        ids = torch.tensor(prompt + response)
        anchors = torch.arange(len(prompt), len(ids))  # anchor = response token j, prefix [0, P + j)
        tokens, conf, ent = draft_fn(drafter, target, ids, anchors)
        truth = torch.cat([torch.tensor(response), torch.full((D,), -1)])
        rounds += rounds_from_drafts(i, tokens, conf, ent, truth, max_new_tokens)
    return rounds


def heldout_responses(spec, kind: str, target, tokenizer) -> tuple[list[list[int]], list[list[int]]]:
    """Held-out prompts (token ids) and the target's greedy responses, cached in the work directory
    (both drafters of a target are evaluated on the same responses)."""
    cache = Path(spec.work_dir) / f"{kind}-heldout-responses.json"
    texts = [json.loads(line)["prompt"] for line in (Path(spec.out_dir) / "prompts" / "heldout.jsonl").open()]
    texts = texts[: spec.num_eval_prompts]
    prompts = [tokenizer(t, add_special_tokens=False).input_ids[-spec.prompt_tokens :] for t in texts]
    if cache.exists():
        saved = json.loads(cache.read_text())
        if saved["prompts"] == prompts and saved["max_new_tokens"] == spec.response_tokens:
            return prompts, saved["responses"]
    responses = greedy_responses(target, prompts, spec.response_tokens, tokenizer.eos_token_id)
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps({"prompts": prompts, "max_new_tokens": spec.response_tokens, "responses": responses}))
    return prompts, responses


def stage_evaluate(spec, kind: str, drafter_type: str, force: bool = False) -> Path:
    """``<out_dir>/<kind>-<drafter>/eval.json`` and ``records.jsonl.gz`` on the held-out prompts."""
    import speculators

    import vllm_hybridspec.drafter  # noqa: F401  (registers hspec)
    from vllm_hybridspec.policy.records import load_records, save_records
    from vllm_hybridspec.train.reference.pretrain import device_auto
    from vllm_hybridspec.train.target import load_target

    out = Path(spec.out_dir) / f"{kind}-{drafter_type}"
    if (out / "eval.json").exists() and not force:
        return out
    device = device_auto()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target, tokenizer = load_target(Path(spec.out_dir) / kind, dtype=dtype, device=device)
    drafter = speculators.SpeculatorModel.from_pretrained(str(out)).to(device, dtype).eval()
    prompts, responses = heldout_responses(spec, kind, target, tokenizer)
    rounds = evaluate_pair(target, drafter, drafter_type, prompts, responses, spec.response_tokens)
    result = summarize(rounds, drafter.block_size - 1, spec.bootstrap, spec.seed)
    result.update(drafter=drafter_type, target=kind, block_size=drafter.block_size, device=str(device))
    save_records(to_records(rounds), out / "records.jsonl.gz")
    load_records(out / "records.jsonl.gz")  # the policy's own validation
    (out / "eval.json").write_text(json.dumps(result, indent=2))
    from vllm_hybridspec.train.reference.cards import drafter_card

    (out / "README.md").write_text(drafter_card(out))
    return out


def format_result(r: dict) -> str:
    alpha = ", ".join(f"{a:.3f}" for a in r["alpha"])
    return (f"tau = {r['tau']:.3f} [{r['tau_ci95'][0]:.3f}, {r['tau_ci95'][1]:.3f}] over {r['rounds']} rounds "
            f"of {r['prompts']} prompts; alpha_1..{len(r['alpha'])} = {alpha}")


