"""What the GDN-kernel benchmarks run on: the model shapes, one round of random inputs for every
layer, the fp32 state pools, and our unfused round (``gdn_verify`` per layer, then one
``gdn_commit`` for all layers), shared by :mod:`.gdn_compare`, :mod:`.fused_round`, :mod:`.tune`
and :mod:`.profile`.

* ``"35b"``: Qwen3.6-35B-A3B's GDN layers: 30 layers, 16 key heads, 32 value heads, 128 x 128 fp32
  states (the shape every published table is measured at);
* ``"tiny"``: 2 layers, 2 key heads, 4 value heads, 32 x 32 states: the CPU runs through Triton's
  interpreter, in seconds.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from vllm_hybridspec.kernels.gdn import (
    MAX_VERIFY_LEN,
    StatePointers,
    VerifyFactors,
    gdn_commit,
    gdn_gating,
    gdn_verify,
    recurrent_gated_delta_rule,
)

from .timing import Timing, graph_ms


@dataclasses.dataclass(frozen=True)
class Shape:
    layers: int
    HK: int
    HV: int
    K: int
    V: int

    @property
    def state_bytes(self) -> int:
        """One layer's fp32 state of one sequence."""
        return self.HV * self.V * self.K * 4

    def with_layers(self, layers: int) -> Shape:
        return dataclasses.replace(self, layers=layers)


SHAPES = {"35b": Shape(layers=30, HK=16, HV=32, K=128, V=128),
          "tiny": Shape(layers=2, HK=2, HV=4, K=32, V=32)}


class Round:
    """Random inputs of one verification round for every layer: q, k ``[T, HK, K]``, v ``[T, HV, V]``,
    raw gates a, b ``[T, HV]`` in ``dtype`` (bf16 projections, as in the model); A_log, dt_bias
    ``[HV]`` fp32 (Qwen3-Next's initial ranges); B sequences of w tokens each. ``gen`` is a generator
    (consecutive rounds draw from it in turn) or the seed of a new one on ``device``."""

    def __init__(self, shape: Shape, B: int, w: int, dtype: torch.dtype = torch.bfloat16,
                 gen: torch.Generator | int = 0, device="cuda"):
        if isinstance(gen, int):
            gen = torch.Generator(device=device).manual_seed(gen)
        dev = self.device = gen.device
        T, L = B * w, shape.layers
        self.shape, self.B, self.w, self.T = shape, B, w, T

        def rn(*size, std=1.0):
            return [(torch.randn(*size, generator=gen, device=dev) * std).to(dtype) for _ in range(L)]

        self.q, self.k = rn(T, shape.HK, shape.K), rn(T, shape.HK, shape.K)
        self.v, self.a, self.b = rn(T, shape.HV, shape.V), rn(T, shape.HV), rn(T, shape.HV, std=2.0)
        self.A_log = [torch.log(1 + 15 * torch.rand(shape.HV, generator=gen, device=dev)) for _ in range(L)]
        self.dt_bias = [torch.randn(shape.HV, generator=gen, device=dev) * 0.5 - 2 for _ in range(L)]
        self.cu = torch.arange(0, T + 1, w, dtype=torch.int32, device=dev)

    def layer(self, i: int) -> dict:
        """Layer ``i``'s arguments of ``gdn_verify`` / ``gdn_commit_verify`` (fused gating)."""
        return dict(q=self.q[i], k=self.k[i], v=self.v[i], g=self.a[i], beta=self.b[i], A_log=self.A_log[i],
                    dt_bias=self.dt_bias[i], cu_seqlens=self.cu, max_len=self.w)

    def reference(self, i: int, seq: int, S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float64 outputs ``[w, HV, V]`` and per-token states of sequence ``seq`` in layer ``i``, from
        the token-by-token recurrence (HybridSpec paper, Eq. 1) started at ``S``."""
        s = slice(seq * self.w, (seq + 1) * self.w)
        g, beta = gdn_gating(self.A_log[i].double(), self.a[i][s].double(), self.dt_bias[i].double(),
                             self.b[i][s].double())
        return recurrent_gated_delta_rule(self.q[i][s].double(), self.k[i][s].double(), self.v[i][s].double(),
                                          g, beta, S)

    def outputs(self) -> list[torch.Tensor]:
        """One output buffer per layer, like ``v``."""
        return [torch.empty_like(v) for v in self.v]


def random_pools(shape: Shape, slots: int, device, seed: int) -> list[torch.Tensor]:
    """Each layer's fp32 state pool ``[slots, HV, V, K]``, entries ~ N(0, 0.2^2)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(slots, shape.HV, shape.V, shape.K, generator=gen, device=device) * 0.2
            for _ in range(shape.layers)]


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error of ``x`` against ``ref``, in float64."""
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


class Unfused:
    """Our round without the lazy commit: ``gdn_verify`` per layer into packed factors, then one
    ``gdn_commit`` for all layers. B sequences in slots 1..B of every layer's pool; ``verify`` and
    ``commit`` are launch settings of ``gdn_verify`` (``method``, ``BV``...) and ``gdn_commit``."""

    def __init__(self, shape: Shape, B: int, device, seed: int, verify: dict | None = None,
                 commit: dict | None = None):
        self.shape = shape
        self.pools = random_pools(shape, B + 1, device, seed)
        self.ptrs = StatePointers(self.pools)
        self.slots = torch.arange(1, B + 1, dtype=torch.int32, device=device)
        self.factors = VerifyFactors.empty(B * MAX_VERIFY_LEN, shape.HK, shape.HV, shape.K, shape.V, device,
                                           num_layers=shape.layers)
        self.verify_cfg, self.commit_cfg = verify or {}, commit or {}

    def verify(self, r: Round, out: list[torch.Tensor]) -> None:
        for i in range(self.shape.layers):
            gdn_verify(**r.layer(i), state=self.pools[i], state_indices=self.slots, out=out[i],
                       factors=self.factors.layer(i), **self.verify_cfg)

    def commit(self, r: Round, m: torch.Tensor) -> None:
        """Advance every layer's states through ``m`` ``[B]`` committed tokens of the verified round."""
        gdn_commit(self.ptrs, self.factors, r.cu, self.slots, m, **self.commit_cfg)

    def round(self, r: Round, out: list[torch.Tensor], m: torch.Tensor) -> None:
        self.verify(r, out)
        self.commit(r, m)

    def timings(self, r: Round, m: int, samples: int, parts=("round",),
                replays: int = 10) -> dict[str, Timing]:
        """Each of ``parts`` ("round", "verify", "commit") of round ``r``, committing ``m`` tokens per
        sequence, captured as one CUDA graph and timed (:func:`.timing.graph_ms`). Verification runs
        once first, so that a commit timed alone folds in real factors."""
        out = r.outputs()
        m_dev = torch.full((r.B,), m, dtype=torch.int32, device=r.device)
        self.verify(r, out)
        fns = dict(round=functools.partial(self.round, r, out, m_dev),
                   verify=functools.partial(self.verify, r, out),
                   commit=functools.partial(self.commit, r, m_dev))
        return {part: graph_ms(fns[part], samples, replays) for part in parts}
