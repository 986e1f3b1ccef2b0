"""How often the Markov heads' candidate pass (``kernels.markov.markov_heads(..., candidates=M)``) leaves
a draft position to a per-position pass, on the trained reference drafters.

Position ``k`` (1 .. K-1) of a round needs a pass when the token drafted at ``k - 1`` is none of the
``M`` best tokens of the LM head's logits at ``k - 1`` (the position's candidates). The rounds are the
PyTorch walk's (``train.reference.evaluate.draft_hspec``: one round anchored at every response token
of the held-out prompts, float32 on the CPU). Per M: the fraction of positions that need a pass, and
per round the passes when every position from a request's first miss on runs one (the kernels before
2026-12-05) and when only the missed positions do (after).

    python docs/benchmarks/cpu-2026-12-05/markov_candidates.py hybrid 64   # from the repository root
"""
import json
import sys
import time

import speculators
import torch

import vllm_hybridspec.drafter  # noqa: F401  (registers hspec)
from vllm_hybridspec.train.reference.evaluate import draft_hspec, heldout_responses
from vllm_hybridspec.train.reference.pipeline import BuildSpec
from vllm_hybridspec.train.target import load_target

kind, n_prompts = sys.argv[1], int(sys.argv[2])
spec = BuildSpec(out_dir="models", work_dir="out/models-work", num_eval_prompts=n_prompts)
target, tok = load_target(f"models/{kind}", dtype=torch.float32, device=torch.device("cpu"))
drafter = speculators.SpeculatorModel.from_pretrained(f"models/{kind}-hspec").float().eval()
seen = []
draft_heads = drafter.draft_heads


def recording_heads(hidden, anchor_ids):
    block = draft_heads(hidden, anchor_ids)
    seen.append((drafter.lm_head(drafter.norm(hidden[:, 1:])).float(), block.tokens))
    return block


drafter.draft_heads = recording_heads
prompts, responses = heldout_responses(spec, kind, target, tok)
t0 = time.time()
for p, r in zip(prompts, responses):
    ids = torch.tensor(p + r)
    draft_hspec(drafter, target, ids, torch.arange(len(p), len(ids)))
logits = torch.cat([x[0] for x in seen])
tokens = torch.cat([x[1] for x in seen])
N, K, V = logits.shape
order = logits[:, :K - 1].argsort(dim=-1, descending=True)
rank = (order == tokens[:, :K - 1, None]).float().argmax(-1)  # [N, K-1]: the drafted token's rank at k - 1
out = {"kind": kind, "rounds": N, "K": K, "vocab": V, "rank_hist": torch.bincount(rank.flatten().clamp(max=16)).tolist()}
for M in (1, 2, 4, 8, 16):
    miss = rank >= M  # [N, K-1]: position k = j + 1 needs a pass
    first = torch.where(miss.any(1), miss.float().argmax(1) + 1, torch.full((N,), K))
    out[f"M{M}"] = {"resolved_prefix": round(float((first - 1).sum()) / (N * (K - 1)), 4),
                    "all_resolved": round(float((first == K).float().mean()), 4),
                    "positions_missed": round(float(miss.float().mean()), 4),
                    "full_kernels_after_first_miss": round(float((K - first).float().mean()), 3),
                    "full_kernels_misses_only": round(float(miss.float().sum(1).mean()), 3)}
print(json.dumps(out), flush=True)
print(f"{time.time() - t0:.0f} s", file=sys.stderr)
