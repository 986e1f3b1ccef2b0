"""The Markov heads through candidate previous tokens (``markov_heads(..., candidates=M)``, Triton's
interpreter on the CPU) against the float64 reference on fresh random inputs, with the check of
``markov_check.mismatches``: where a small bias keeps every greedy token among the ``M`` best of its
position's logits the candidates resolve every position; where a large bias often moves it out of
them the per-position kernels finish those positions, exactly, and a request runs a pass at exactly
the positions whose previous token is none of their candidates. Three planted bugs of the scheme
are caught by the same check: a resolution reading the neighbouring candidate's column, a fallback
taking its first position's previous token from summaries never computed instead of the resolved
token, and a chain picked up again after a pass from the wrong candidate's column."""

from __future__ import annotations

import pytest
import torch
import vllm_hybridspec.kernels.markov.heads as heads
from vllm_hybridspec.kernels.markov import (
    candidate_tokens,
    markov_heads,
    markov_heads_reference,
    top2_margins,
)

from ..seeds import fresh_seed
from .markov_check import TIE_GAP, mismatches


def random_case(gen, N, K, V, R, dtype, bias, scale=3.0):
    """Logits of std ``scale`` and a Markov bias of std about ``bias`` (``W1`` rows of std 1, ``W2``
    of std ``bias / sqrt(R)``)."""
    logits = (scale * torch.randn(N, K, V, generator=gen)).to(dtype)
    anchors = torch.randint(0, V, (N,), generator=gen)
    if R == 0:
        return logits, anchors, None, None
    w1 = torch.randn(V, R, generator=gen).to(dtype)
    w2 = (bias * torch.randn(V, R, generator=gen) / R**0.5).to(dtype)
    return logits, anchors, w1, w2


def run(logits, anchors, w1, w2, M, passes=None, heads_fn=markov_heads, **launch):
    first = torch.full((logits.shape[0],), -1, dtype=torch.int32)
    got = heads_fn(logits, anchors, w1, w2, candidates=M, first_unresolved=first, passes=passes, **launch)
    ref = markov_heads_reference(logits, anchors, w1, w2)
    margins = top2_margins(logits, ref.tokens, anchors, w1, w2)
    assert got.tokens.dtype == torch.int64 and got.top1_prob.dtype == got.entropy.dtype == torch.float32
    return got, ref, margins, first


def expected_passes(logits, anchors, ref_tokens, M):
    """``[N, K]`` bool: position ``k`` of a row needs a pass where the reference's token at ``k - 1``
    is none of the position's ``M`` candidates (the same ``candidate_tokens``)."""
    N, K, _ = logits.shape
    cand = candidate_tokens(logits, anchors, M)
    need = torch.zeros(N, K, dtype=torch.bool)
    for k in range(1, K):
        block = cand[:, 1 + (k - 1) * M:1 + k * M]
        need[:, k] = ~(block == ref_tokens[:, k - 1:k]).any(dim=1)
    return need


def untied_rows(margins):
    """Rows without a near-tie at any position (their chains are the reference's all the way)."""
    return [n for n in range(margins.shape[0]) if bool((margins[n] >= TIE_GAP).all())]


@pytest.mark.parametrize(("N", "K", "V", "R", "dtype", "M", "launch"), [
    (1, 7, 500, 16, torch.bfloat16, 8, dict(BV=32, programs=3)),
    (3, 5, 1000, 32, torch.float32, 8, dict(BV=32, programs=7, columns_per_program=16)),  # 3 column blocks
    (17, 3, 300, 8, torch.bfloat16, 4, dict(BV=16, programs=4)),  # R below a dot's minimum of 16
    (4, 15, 256, 64, torch.float16, 8, dict(BV=64, programs=2)),
])
def test_a_small_bias_resolves_every_position_through_the_candidates(N, K, V, R, dtype, M, launch):
    gen = torch.Generator().manual_seed(fresh_seed("markov candidates"))
    logits, anchors, w1, w2 = random_case(gen, N, K, V, R, dtype, bias=0.05)
    got, ref, margins, first = run(logits, anchors, w1, w2, M, **launch)
    assert first.tolist() == [K] * N  # positions 1 .. K - 1 of every row from the candidates
    assert mismatches(got, ref, margins) == []
    compared = int((margins >= TIE_GAP).sum())
    assert compared >= 0.9 * N * K, f"only {compared} of {N * K} positions compared (too many near-ties)"


@pytest.mark.parametrize(("N", "K", "V", "R", "dtype", "M", "launch"), [
    (1, 9, 400, 16, torch.float32, 8, dict(BV=32, programs=3)),
    (3, 6, 700, 32, torch.bfloat16, 8, dict(BV=32, programs=5)),
    (17, 4, 300, 16, torch.float16, 2, dict(BV=32, programs=4, columns_per_program=32)),
    (5, 8, 333, 8, torch.float32, 1, dict(BV=16, programs=6)),  # M = 1: most rows fall back early
])
def test_rows_past_the_candidates_fall_back_exactly(N, K, V, R, dtype, M, launch):
    """A bias as large as the logits: the greedy token is often not among the previous position's
    best, so rows leave the candidates and finish in the per-position kernels."""
    gen = torch.Generator().manual_seed(fresh_seed("markov candidates"))
    logits, anchors, w1, w2 = random_case(gen, N, K, V, R, dtype, bias=4.0, scale=1.0)
    passes = torch.full((N, K), -1, dtype=torch.int32)
    got, ref, margins, first = run(logits, anchors, w1, w2, M, passes=passes, **launch)
    assert bool(((first >= 1) & (first <= K)).all())
    assert int((first < K).sum()) >= 1, f"no row fell back (first unresolved {first.tolist()})"
    assert mismatches(got, ref, margins) == []
    need = expected_passes(logits, anchors, ref.tokens, M)
    rows = untied_rows(margins)
    assert len(rows) >= N // 2
    assert passes[rows].bool().tolist() == need[rows].tolist()  # a pass exactly where a row misses
    assert set(passes.flatten().tolist()) <= {0, 1}


@pytest.mark.parametrize(("N", "K", "V", "R", "dtype", "M", "launch"), [
    (1, 15, 400, 16, torch.float32, 8, dict(BV=32, programs=3)),
    (6, 12, 500, 32, torch.bfloat16, 4, dict(BV=32, programs=5)),
])
def test_a_row_picks_the_candidates_up_again_after_a_pass(N, K, V, R, dtype, M, launch):
    """A bias that moves the greedy token out of the candidates at some positions only: after a
    pass the next positions resolve from the candidates again, and the outputs are exact."""
    gen = torch.Generator().manual_seed(fresh_seed("markov candidates"))
    logits, anchors, w1, w2 = random_case(gen, N, K, V, R, dtype, bias=1.2, scale=1.0)
    passes = torch.full((N, K), -1, dtype=torch.int32)
    got, ref, margins, first = run(logits, anchors, w1, w2, M, passes=passes, **launch)
    assert mismatches(got, ref, margins) == []
    picked_up = [(n, k) for n in range(N) for k in range(int(first[n]) + 1, K) if int(passes[n, k]) == 0]
    assert picked_up, f"no row resolved a position after a pass (passes {passes.tolist()})"
    rows = untied_rows(margins)
    need = expected_passes(logits, anchors, ref.tokens, M)
    assert passes[rows].bool().tolist() == need[rows].tolist()
    after = int(sum(K - int(first[n]) for n in range(N)))  # the passes of a fallback from the first miss on
    assert int(passes.sum()) < after, (int(passes.sum()), after)


def test_no_markov_head_and_a_single_position():
    """Without the head the positions are independent (the per-position kernels, ``first_unresolved``
    at ``K``); with ``K = 1`` the anchor's column is the whole answer."""
    gen = torch.Generator().manual_seed(fresh_seed("markov candidates"))
    for N, K, R in ((3, 5, 0), (17, 1, 16), (1, 1, 32)):
        logits, anchors, w1, w2 = random_case(gen, N, K, 300, R, torch.float32, bias=1.0)
        got, ref, margins, first = run(logits, anchors, w1, w2, 8, BV=32, programs=3)
        assert first.tolist() == [K] * N
        assert mismatches(got, ref, margins) == []


def test_candidate_columns_and_arguments():
    gen = torch.Generator().manual_seed(fresh_seed("markov candidates"))
    N, K, V, M = 2, 4, 50, 3
    logits = torch.randn(N, K, V, generator=gen)
    anchors = torch.randint(0, V, (N,), generator=gen)
    cand = candidate_tokens(logits, anchors, M)
    assert cand.shape == (N, 1 + (K - 1) * M) and torch.equal(cand[:, 0], anchors)
    for k in range(1, K):
        want = logits[:, k - 1].topk(M, dim=-1).indices.sort(dim=-1).values
        assert torch.equal(cand[:, 1 + (k - 1) * M:1 + k * M].sort(dim=-1).values, want)
    w1, w2 = torch.randn(V, 16, generator=gen), torch.randn(V, 16, generator=gen)
    first = torch.full((0,), -1, dtype=torch.int32)
    empty = markov_heads(logits[:0], anchors[:0], w1, w2, candidates=M, first_unresolved=first)
    assert empty.tokens.shape == (0, K) and first.shape == (0,)
    with pytest.raises(ValueError, match="candidates must be 0"):
        markov_heads(logits, anchors, w1, w2, candidates=-1)
    with pytest.raises(ValueError, match="at most the vocabulary's 50"):
        markov_heads(logits, anchors, w1, w2, candidates=51)
    with pytest.raises(ValueError, match=r"first_unresolved must be \[N=2\] int32"):
        markov_heads(logits, anchors, w1, w2, candidates=2, first_unresolved=torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"passes must be \[N=2, K=4\] int32"):
        markov_heads(logits, anchors, w1, w2, candidates=2, passes=torch.zeros(2, 3, dtype=torch.int32))
    passes = torch.zeros(N, K, dtype=torch.int32)
    markov_heads(logits, anchors, w1, w2, passes=passes, BV=16, programs=2)
    assert passes.tolist() == [[1] * K] * N  # without candidates every position is a pass


# The negative controls' bugs, planted in a copy of kernels/markov/heads.py: (text in the kernels, its
# replacement). 1 resolves a position from the neighbouring candidate's column; 2 takes the first
# unresolved position's previous token from the per-position summaries (never computed for it; zeroed,
# so the token read is 0, in bounds) instead of the token the candidates resolved; 3 picks the chain up
# again after a pass from the first column of the position's candidates, whichever one matched.
PLANTED_BUGS = {
    1: [("        alive = found\n", "        alive = found\n        j = j + 1\n")],
    2: [("        later = m_n & (first < k)\n",
         "        later = m_n & (first < k)\n        carried = carried | at_first\n"),
        ("    parts = torch.empty(3, K, N, NB,", "    parts = torch.zeros(3, K, N, NB,"),
        ("    part_i = torch.empty(K, N, NB,", "    part_i = torch.zeros(K, N, NB,")],
    3: [("            col = block + tl.where(found, j, 0)\n", "            col = block\n")],
}


def planted_heads(tmp_path, bug: int):
    """``markov_heads`` of a copy of ``kernels/markov/heads.py`` with bug ``bug`` of :data:`PLANTED_BUGS`
    (each replaced text found exactly once), imported beside the real module (Triton reads the kernels'
    source from the file)."""
    import importlib.util
    from pathlib import Path

    source = Path(heads.__file__).read_text()
    for old, new in PLANTED_BUGS[bug]:
        assert source.count(old) == 1, (bug, old)
        source = source.replace(old, new)
    path = tmp_path / f"heads_planted_{bug}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"vllm_hybridspec.kernels.markov.heads_planted_{bug}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.markov_heads


# the planted bug 2 merges zeroed summaries (Z = 0): its signals are inf / nan, as a wrong head's may be
@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning", "ignore:invalid value:RuntimeWarning")
def test_the_check_catches_planted_candidate_bugs(tmp_path):
    """Negative controls: copies of the kernels with a planted bug (:func:`planted_heads`), each rejected
    by the check the real kernels pass on the same inputs."""
    gen = torch.Generator().manual_seed(fresh_seed("markov candidates"))
    N, K, V, R = 6, 6, 400, 16
    launch = dict(BV=32, programs=3)

    # 1. resolution from the neighbouring candidate's column: every row resolves through candidates
    logits, anchors, w1, w2 = random_case(gen, N, K, V, R, torch.float32, bias=0.5)
    got, ref, margins, first = run(logits, anchors, w1, w2, 8, **launch)
    assert mismatches(got, ref, margins) == [] and int((first > 1).sum()) >= N // 2
    got, *_ = run(logits, anchors, w1, w2, 8, heads_fn=planted_heads(tmp_path, 1), **launch)
    assert len(mismatches(got, ref, margins)) >= N // 2

    # 2. the first unresolved position's previous token from the (never computed) per-position
    # summaries of the position before instead of the token the candidates resolved
    logits, anchors, w1, w2 = random_case(gen, N, K, V, R, torch.float32, bias=4.0, scale=1.0)
    got, ref, margins, first = run(logits, anchors, w1, w2, 2, **launch)
    fell_back = int((first < K).sum())
    assert mismatches(got, ref, margins) == [] and fell_back >= N // 2
    got, *_ = run(logits, anchors, w1, w2, 2, heads_fn=planted_heads(tmp_path, 2), **launch)
    assert len(mismatches(got, ref, margins)) >= fell_back // 2

    # 3. after a pass, the chain picked up again from the first column of the position's candidates,
    # whichever matched
    N, K = 6, 12
    logits, anchors, w1, w2 = random_case(gen, N, K, V, R, torch.float32, bias=1.2, scale=1.0)
    passes = torch.zeros(N, K, dtype=torch.int32)
    got, ref, margins, first = run(logits, anchors, w1, w2, 4, passes=passes, **launch)
    picked_up = sum(1 for n in range(N) for k in range(int(first[n]) + 1, K) if int(passes[n, k]) == 0)
    assert mismatches(got, ref, margins) == [] and picked_up >= N
    got, *_ = run(logits, anchors, w1, w2, 4, heads_fn=planted_heads(tmp_path, 3), **launch)
    assert len(mismatches(got, ref, margins)) >= N // 2
