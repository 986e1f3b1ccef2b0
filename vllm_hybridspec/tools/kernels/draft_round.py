"""One H-Spec drafting round at the Qwen3.6-35B-A3B shape, without vLLM: its parts and the whole,
each as one CUDA graph, against the round's weight-read floor.

The drafter is ``HSpecDraftModel`` with ``hybridspec full-shape``'s configuration (4 layers, blocks of
16: K = 15 drafts, the target's 248,320-token LM head and a rank-256 Markov head), random bf16
weights; the prefix K/V are random tensors of ``--capacity`` slots per request (the engine gathers
them from the target's paged cache, a read of the same size). For each batch size B:

* ``layers``: the initial state and the block through the drafter's layers (``block_forward``);
* ``lm_head``: the final norm and the LM head over the K draft positions (bf16 logits);
* ``heads_torch``: the Markov head as torch ops per position over float32 logits (what
  ``HSpecForVLLM.draft_heads`` runs on the CPU, and ran on CUDA before the kernel);
* ``heads_fused``: ``kernels.markov.markov_heads`` over the bf16 logits;
* ``heads_candidates``: the same with ``candidates = M`` (``--candidates``, 8 by default): one pass
  over ``W2`` for every position through the top-M previous tokens, a per-position pass only where a
  request's previous token is none of the position's candidates; kept with it: the fraction of
  positions 1 .. K-1 before each request's first such position (``resolved``), the fraction of
  positions 1 .. K-1 a request ran a pass at (``missed``) and the per-position kernels per round
  that read ``W2`` (``w2_passes``: positions where any request ran one);
* ``round_torch`` / ``round_fused`` / ``round_candidates``: layers, LM head and heads together, as the
  engine's round graph replays them; ``round_grouped_candidates``: the grouped-attention layers with
  the candidate heads;
* ``layers_fused_norms`` / ``round_fused_norms``: the layers with every RMS norm as one kernel
  (``drafter.fused.fuse_norms``; what ``"drafter_fused_norms": true`` runs in the engine), alone and
  with the LM head and the fused heads;
* ``layers_grouped`` / ``round_grouped``: the fused-norm layers with the attention as grouped matmuls
  (``drafter.attention.grouped_attention``; ``"drafter_grouped_attention": true``), alone and with the
  LM head and the fused heads;
* ``layers_compiled`` / ``round_compiled``: the layers through torch.compile (dynamic shapes, the SSD
  scan in its torch form; what ``"drafter_compile": true`` runs in the engine), alone and with the LM
  head and the fused heads; ``round_compiled_candidates``: with the candidate heads instead;
  ``layers_compiled_grouped`` / ``round_compiled_grouped_candidates``: compiled with the grouped
  attention (the engine's ``drafter_compile`` with its default ``drafter_grouped_attention``), alone
  and with the LM head and the candidate heads;
* ``--markov-scales``: the candidate heads and ``round_grouped_candidates`` again with the Markov
  bias scaled down (random weights make it as large as the logits, so few positions resolve; a
  trained head's bias is smaller: on the reference drafters 7.5-14 % of positions miss with M = 8,
  ``docs/benchmarks/cpu-2026-12-05``), each with ``resolved``, ``missed`` and ``w2_passes`` (``scaled``);
* ``floor``: the bytes a round must read (the drafter's own weights, the LM head once, the Markov
  ``W2`` once per position, the prefix K/V) over the read bandwidth measured in the same run
  (:func:`.timing.read_bandwidth`).

Before timing, at B = 4 the fused heads are checked against the float64 reference on the round's own
logits (same tokens up to near-ties; signals within 2e-6 / 2e-5), the candidate heads and the torch
heads likewise, and the
compiled layers' hidden states against the eager ones (relative error below 2e-2 in bf16); a failure
stops the run. ``--tune`` also times the fused heads at every launch candidate and uses the
fastest per B for the round.

    hybridspec kernels draft-round --batches 1,4,16,64 --json draft_round.json
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable

import torch

from vllm_hybridspec.kernels.markov import markov_heads, markov_heads_reference, markov_heads_torch, top2_margins

from .timing import graph_ms, log, read_bandwidth

TIE_GAP, TOP1_ATOL, ENTROPY_ATOL = 1e-4, 2e-6, 2e-5
DEFAULT_CANDIDATES = 8  # candidate previous tokens per position of the candidate heads (--candidates)
# launch candidates of the fused heads for --tune: (BV, programs per SM, warps, pipeline stages or
# None for Triton's default); 2 programs of 15 tiles of 64 rows per SM cover the 248,320-row W2
TUNE_GRID = [(64, 2, 4, stages) for stages in (None, 2, 4)] + [(128, 1, 8, None), (32, 4, 4, None)]


def build_drafter(device: torch.device, layers: int = 4, block_size: int = 16, markov_rank: int = 256,
                  target_overrides: dict | None = None):
    """``HSpecDraftModel`` at the 35B shape with random bf16 weights: std 0.02 (logits of std ~0.9),
    norms at one, the Markov embedding at std 1 (a bias of std ~0.3), the Mamba parameters from their
    own initialisation. ``target_overrides`` changes the target's shape (the tests' tiny one)."""
    from transformers import Qwen3NextConfig

    from vllm_hybridspec.drafter import HSpecDraftModel, HSpecSpeculatorConfig, default_layer_selection
    from vllm_hybridspec.drafter.mamba2 import Mamba2Mixer
    from vllm_hybridspec.tools.full_shape import MASK_TOKEN_ID, QWEN36_35B_A3B

    target = Qwen3NextConfig(**{**QWEN36_35B_A3B, **(target_overrides or {})})
    selected, kv = default_layer_selection(target)
    config = HSpecSpeculatorConfig.from_target(target, None, selected, kv, num_layers=layers, block_size=block_size,
                                               markov_rank=markov_rank,
                                               mask_token_id=min(MASK_TOKEN_ID, target.vocab_size - 1))
    with torch.device(device):
        model = HSpecDraftModel(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 1.0 if name.endswith("markov_w1.weight") else 0.02)
        for module in model.modules():
            if isinstance(module, Mamba2Mixer):
                for name, value in module.ssm_parameter_init().items():
                    getattr(module, name).copy_(value)
    return model.to(torch.bfloat16).eval()


@contextlib.contextmanager
def torch_ssd(model):
    """The Mamba-2 mixers' SSD scan in its torch form (``use_kernel = False``) for the duration, as
    ``HSpecForVLLM.compile_layers`` sets it for good."""
    mixers = [layer.mamba for layer in model.layers]
    before = [m.use_kernel for m in mixers]
    for m in mixers:
        m.use_kernel = False
    try:
        yield
    finally:
        for m, b in zip(mixers, before, strict=True):
            m.use_kernel = b


class Round:
    """Static inputs and the parts of one round of B requests."""

    compiled = None  # torch.compile(model.block_forward, dynamic=True), made once by compile_block_forward

    def __init__(self, model, B: int, capacity: int, device, seed: int):
        cfg = model.config
        gen = torch.Generator(device=device).manual_seed(seed)
        g = cfg.attention_geometry
        hidden = cfg.transformer_layer_config.hidden_size
        L = cfg.block_size
        self.model, self.B, self.L = model, B, L
        n_sel = len(cfg.aux_hidden_state_layer_ids)
        self.last_hidden = torch.randn(B, n_sel * hidden, generator=gen, device=device).to(torch.bfloat16)
        self.anchors = torch.randint(0, cfg.transformer_layer_config.vocab_size, (B,), generator=gen, device=device)
        self.prefix_lens = torch.full((B,), capacity, dtype=torch.long, device=device)
        self.prefix_kv = [tuple(torch.randn(B, g.num_key_value_heads, capacity, g.head_dim, generator=gen,
                                            device=device).to(torch.bfloat16) for _ in range(2))
                          for _ in cfg.kv_reuse_layer_ids]
        from vllm_hybridspec.drafter.attention import request_block_mask

        self.positions = self.prefix_lens[:, None] + torch.arange(L, device=device)
        self.block_ids = torch.full((B, L), cfg.mask_token_id, dtype=torch.long, device=device)
        self.block_ids[:, 0] = self.anchors
        self.mask = request_block_mask(self.prefix_lens, capacity, L, cfg.sliding_window)
        self.hidden = self.logits = None
        self.launch: dict = {}
        self.candidates = DEFAULT_CANDIDATES
        self.first_unresolved = torch.empty(B, dtype=torch.int32, device=device)  # written in the graph
        self.passes = torch.empty(B, L - 1, dtype=torch.int32, device=device)  # likewise

    def layers(self):
        m = self.model
        self.hidden = m.block_forward(self.block_ids, self.positions, m.initial_state(self.last_hidden),
                                      self.prefix_kv, self.mask)

    def layers_fused_norms(self):
        from vllm_hybridspec.drafter.fused import fuse_norms, unfuse_norms

        fuse_norms(self.model)
        try:
            self.layers()
        finally:
            unfuse_norms(self.model)

    def layers_grouped(self):
        from vllm_hybridspec.drafter.attention import use_grouped_attention
        from vllm_hybridspec.drafter.fused import fuse_norms, unfuse_norms

        fuse_norms(self.model)
        use_grouped_attention(self.model)
        try:
            self.layers()
        finally:
            use_grouped_attention(self.model, False)
            unfuse_norms(self.model)

    def layers_compiled(self):
        m = self.model
        with torch_ssd(m):
            self.hidden = Round.compiled(self.block_ids, self.positions, m.initial_state(self.last_hidden),
                                         self.prefix_kv, self.mask)

    def layers_compiled_grouped(self):
        from vllm_hybridspec.drafter.attention import use_grouped_attention

        use_grouped_attention(self.model)
        try:
            self.layers_compiled()
        finally:
            use_grouped_attention(self.model, False)

    def lm_head(self):
        self.logits = self.model.lm_head(self.model.norm(self.hidden[:, 1:]))  # [B, K, V] bf16

    def heads_torch(self):
        mh = self.model.markov_head
        return markov_heads_torch(self.logits, self.anchors, mh.markov_w1.weight, mh.markov_w2.weight)

    def heads_fused(self, **launch):
        mh = self.model.markov_head
        return markov_heads(self.logits, self.anchors, mh.markov_w1.weight, mh.markov_w2.weight,
                            **(launch or self.launch))

    def heads_candidates(self, **launch):
        mh = self.model.markov_head
        return markov_heads(self.logits, self.anchors, mh.markov_w1.weight, mh.markov_w2.weight,
                            candidates=self.candidates, first_unresolved=self.first_unresolved,
                            passes=self.passes, **(launch or self.launch))

    def resolved(self) -> float:
        """The fraction of positions 1 .. K-1 before each request's first unresolved position in the
        last candidate heads (a host read)."""
        K = self.L - 1
        return float((self.first_unresolved.long() - 1).sum()) / max(1, self.B * (K - 1))

    def pass_stats(self) -> dict[str, float]:
        """Of the last candidate heads: ``resolved``, ``missed`` (the fraction of positions 1 .. K-1 a
        request ran a per-position pass at) and ``w2_passes`` (positions where any request did: the
        per-position kernels that read ``W2``)."""
        K = self.L - 1
        ran = self.passes[:, 1:].bool()
        return {"resolved": self.resolved(), "missed": float(ran.float().sum()) / max(1, self.B * (K - 1)),
                "w2_passes": int(ran.any(dim=0).sum())}

    def round_torch(self):
        self.layers()
        self.lm_head()
        return self.heads_torch()

    def round_fused(self):
        self.layers()
        self.lm_head()
        return self.heads_fused()

    def round_fused_norms(self):
        self.layers_fused_norms()
        self.lm_head()
        return self.heads_fused()

    def round_grouped(self):
        self.layers_grouped()
        self.lm_head()
        return self.heads_fused()

    def round_candidates(self):
        self.layers()
        self.lm_head()
        return self.heads_candidates()

    def round_compiled(self):
        self.layers_compiled()
        self.lm_head()
        return self.heads_fused()

    def round_compiled_candidates(self):
        self.layers_compiled()
        self.lm_head()
        return self.heads_candidates()

    def round_grouped_candidates(self):
        self.layers_grouped()
        self.lm_head()
        return self.heads_candidates()

    def round_compiled_grouped_candidates(self):
        self.layers_compiled_grouped()
        self.lm_head()
        return self.heads_candidates()


def compile_block_forward(model) -> None:
    Round.compiled = torch.compile(model.block_forward, dynamic=True)


def check_compiled(r: Round, tol: float = 2e-2) -> list[str]:
    """The compiled layers', the fused-norm layers' and the grouped-attention layers' hidden states
    against the eager layers'
    (relative Frobenius error)."""
    r.layers()
    eager = r.hidden.float()
    problems = []
    for name in ("layers_compiled", "layers_fused_norms", "layers_grouped", "layers_compiled_grouped"):
        getattr(r, name)()
        err = float((r.hidden.float() - eager).norm() / eager.norm().clamp(min=1e-30))
        if err > tol:
            problems.append(f"{name}: relative error {err:.2e} above {tol:.0e}")
    return problems


def round_bytes(model, B: int, capacity: int) -> dict[str, int]:
    """The bytes a round reads at least: weights once (``W2`` once per draft position) and the
    prefix K/V."""
    mh = model.markov_head
    K = model.config.block_size - 1
    skip = {id(model.embed_tokens.weight), id(model.lm_head.weight), id(model.verifier_lm_head.weight),
            id(model.verifier_norm.weight)}
    if mh is not None:
        skip |= {id(p) for p in mh.parameters()}
    own = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in skip)
    g = model.config.attention_geometry
    w = model.lm_head.weight  # the K/V are in the model's dtype
    kv = 2 * B * capacity * g.num_key_value_heads * g.head_dim * w.element_size() * len(model.config.kv_reuse_layer_ids)
    return {"drafter_layers": own, "lm_head": w.numel() * w.element_size(),
            "markov_w2": K * mh.markov_w2.weight.numel() * mh.markov_w2.weight.element_size() if mh else 0,
            "prefix_kv": kv}


def check(r: Round) -> list[str]:
    """The torch, fused and candidate heads on the round's own logits against the float64 reference."""
    mh = r.model.markov_head
    r.layers()
    r.lm_head()
    weights = (mh.markov_w1.weight, mh.markov_w2.weight)
    ref = markov_heads_reference(r.logits, r.anchors, *weights)
    margins = top2_margins(r.logits, ref.tokens, r.anchors, *weights)
    problems = []
    if int((margins >= TIE_GAP).sum()) < margins.numel() // 2:
        problems.append(f"only {int((margins >= TIE_GAP).sum())} of {margins.numel()} positions have a top-2 gap "
                        f"above {TIE_GAP}: the check would compare too little")
    heads = (("torch", tuple(r.heads_torch())), ("fused", tuple(r.heads_fused())),
             ("candidates", tuple(r.heads_candidates())))
    log(f"check B={r.B}: candidates (M = {r.candidates}) resolved {r.resolved():.3f} of positions 1..K-1")
    for name, (tokens, top1, ent) in heads:
        for n, k in itertools.product(range(r.B), range(r.L - 1)):
            if margins[n, k] < TIE_GAP:
                break
            if tokens[n, k] != ref.tokens[n, k]:
                problems.append(f"{name}: row {n} position {k} token {int(tokens[n, k])} != {int(ref.tokens[n, k])}")
                break
            dp, dh = abs(float(top1[n, k] - ref.top1_prob[n, k])), abs(float(ent[n, k] - ref.entropy[n, k]))
            if dp > TOP1_ATOL or dh > ENTROPY_ATOL:
                problems.append(f"{name}: row {n} position {k} top-1 off by {dp:.1e}, entropy by {dh:.1e}")
    return problems


def tune_heads(r: Round, samples: int, replays: int) -> tuple[dict, list[dict]]:
    sms = torch.cuda.get_device_properties(r.last_hidden.device).multi_processor_count
    rows = []
    for BV, pps, warps, stages in TUNE_GRID:
        launch = dict(BV=BV, programs=pps * sms, num_warps=warps, num_stages=stages)
        t = graph_ms(lambda launch=launch: r.heads_fused(**launch), samples, replays)
        rows.append(dict(B=r.B, BV=BV, programs_per_sm=pps, num_warps=warps, num_stages=stages,
                         ms=t.ms, iqr=t.iqr))
        log(f"  tune B={r.B} BV={BV} programs/SM={pps} warps={warps} stages={stages}: {t.ms:.4f} ms")
    best = min(rows, key=lambda row: row["ms"])
    return dict(BV=best["BV"], programs=best["programs_per_sm"] * sms, num_warps=best["num_warps"],
                num_stages=best["num_stages"]), rows


def kernel_table(fn, top: int = 25) -> list[dict]:
    """The kernels of one eager call of ``fn`` under torch.profiler: name, launches, total device us."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = [{"kernel": e.key[:100], "calls": e.count, "us": getattr(e, "device_time_total", 0)}
            for e in prof.key_averages() if getattr(e, "device_time_total", 0) > 0]
    return sorted(rows, key=lambda r: -r["us"])[:top]


def run(batches: list[int], capacity: int, samples: int, replays: int, tune: bool, seed: int = 0,
        candidates: int = DEFAULT_CANDIDATES, markov_scales: tuple[float, ...] = ()) -> dict:
    t0 = time.time()
    device = torch.device("cuda")
    model = build_drafter(device)
    compile_block_forward(model)
    with torch.inference_mode():
        r = Round(model, 4, capacity, device, seed)
        r.candidates = candidates
        problems = check(r) + check_compiled(r)
    meta = {"device": torch.cuda.get_device_name(), "capacity": capacity, "samples": samples, "replays": replays,
            "K": model.config.block_size - 1, "vocab": model.config.transformer_layer_config.vocab_size,
            "markov_rank": model.config.markov_rank, "layers": model.config.num_layers, "candidates": candidates,
            "markov_scales": list(markov_scales)}
    if problems:
        return {"meta": meta, "failed": problems, "rows": [], "tune": []}
    bw = read_bandwidth(samples)
    meta["read_bandwidth_TBps"] = bw / 1e12
    log(f"{meta['device']}: read bandwidth {bw / 1e12:.2f} TB/s; heads checked against float64")
    rows, tune_rows = [], []
    with torch.inference_mode():
        for B in batches:
            r = Round(model, B, capacity, device, seed + B)
            r.candidates = candidates
            r.layers()
            r.lm_head()
            if tune:
                r.launch, part = tune_heads(r, samples, replays)
                tune_rows += part
            row = {"B": B, "launch": {k: v for k, v in r.launch.items()}}
            for part in ("layers", "layers_fused_norms", "layers_grouped", "layers_compiled", "layers_compiled_grouped",
                         "lm_head", "heads_torch", "heads_fused", "heads_candidates", "round_torch", "round_fused",
                         "round_fused_norms", "round_grouped", "round_candidates", "round_compiled",
                         "round_compiled_candidates", "round_compiled_grouped_candidates", "round_grouped_candidates"):
                row[f"{part}_ms"] = graph_ms(getattr(r, part), samples, replays).ms
            row.update(r.pass_stats())  # of the last replay of round_grouped_candidates
            row["scaled"] = scaled_markov(r, markov_scales, lambda fn: graph_ms(fn, samples, replays).ms)
            nbytes = round_bytes(model, B, capacity)
            row["bytes"] = nbytes
            row["floor_ms"] = sum(nbytes.values()) / bw * 1e3
            row["round_over_floor"] = min(row["round_fused_ms"], row["round_fused_norms_ms"], row["round_grouped_ms"],
                                          row["round_candidates_ms"], row["round_compiled_ms"],
                                          row["round_compiled_candidates_ms"], row["round_compiled_grouped_candidates_ms"],
                                          row["round_grouped_candidates_ms"]) / row["floor_ms"]
            log(f"B={B}: " + ", ".join(f"{k[:-3]} {v:.3f}" for k, v in row.items() if k.endswith("_ms"))
                + f" ms; best round / floor {row['round_over_floor']:.2f}; candidates (M = {candidates}) "
                f"resolved {row['resolved']:.3f}, missed {row['missed']:.3f}, W2 passes {row['w2_passes']}")
            for x in row["scaled"]:
                log(f"B={B}: Markov bias x{x['scale']}: heads (candidates) {x['heads_candidates_ms']:.3f} ms, round "
                    f"(grouped layers, candidates) {x['round_grouped_candidates_ms']:.3f} ms, resolved "
                    f"{x['resolved']:.3f}, missed {x['missed']:.3f}, W2 passes {x['w2_passes']}")
            if B in (1, 4):
                for key, fn in (("kernels", r.round_fused), ("kernels_fused_norms", r.round_fused_norms),
                                ("kernels_grouped", r.round_grouped),
                                ("kernels_compiled", r.round_compiled), ("kernels_candidates", r.round_candidates),
                                ("kernels_compiled_grouped_candidates", r.round_compiled_grouped_candidates)):
                    row[key] = kernel_table(fn)
                    log(f"  {key} (B={B}):")
                    for k in row[key][:12]:
                        log(f"    {k['us']:9.1f} us  {k['calls']:4d}x  {k['kernel']}")
            rows.append(row)
    meta["seconds"] = time.time() - t0
    return {"meta": meta, "failed": [], "rows": rows, "tune": tune_rows}


def scaled_markov(r: Round, scales, time_ms: Callable[[Callable[[], object]], float]) -> list[dict]:
    """The candidate heads with the Markov bias scaled by each of ``scales`` (``W1`` multiplied in place,
    then restored): random weights make the bias as large as the LM head's logits, so the candidates
    resolve few positions; a trained head's bias is a correction, which a smaller scale stands in
    for. ``time_ms(fn)``: one call's time (CUDA graphs in :func:`run`); with :meth:`Round.pass_stats`."""
    w1 = r.model.markov_head.markov_w1.weight
    original = w1.detach().clone()
    out = []
    try:
        for s in scales:
            w1.copy_(original * s)
            row = {"scale": s}
            for part in ("heads_candidates", "round_grouped_candidates"):
                row[f"{part}_ms"] = time_ms(getattr(r, part))
            row.update(r.pass_stats())
            out.append(row)
    finally:
        w1.copy_(original)
    return out


def format_table(rows: list[dict]) -> str:
    head = ("| B | layers | layers (fused norms) | layers (grouped attention) | layers (compiled) | "
            "layers (compiled, grouped) | LM head | "
            "heads (torch) | heads (fused) | heads (candidates) | resolved | round (torch) | round (fused) | "
            "round (fused norms) | round (grouped attention) | round (candidates) | round (compiled layers) | "
            "round (grouped, candidates) | round (compiled grouped, candidates) | W2 passes | floor | best / floor |")
    lines = [head, "|" + "---|" * 22]
    for r in rows:
        lines.append(f"| {r['B']} | {r['layers_ms']:.3f} | {r['layers_fused_norms_ms']:.3f} | "
                     f"{r['layers_grouped_ms']:.3f} | {r['layers_compiled_ms']:.3f} | {r['layers_compiled_grouped_ms']:.3f} | "
                     f"{r['lm_head_ms']:.3f} | {r['heads_torch_ms']:.3f} | "
                     f"{r['heads_fused_ms']:.3f} | {r['heads_candidates_ms']:.3f} | {r['resolved']:.3f} | "
                     f"{r['round_torch_ms']:.3f} | {r['round_fused_ms']:.3f} | {r['round_fused_norms_ms']:.3f} | "
                     f"{r['round_grouped_ms']:.3f} | "
                     f"{r['round_candidates_ms']:.3f} | {r['round_compiled_ms']:.3f} | "
                     f"{r['round_grouped_candidates_ms']:.3f} | {r['round_compiled_grouped_candidates_ms']:.3f} | "
                     f"{r['w2_passes']} | {r['floor_ms']:.3f} | "
                     f"{r['round_over_floor']:.2f} |")
    return "\n".join(lines)
