"""Random GDN round inputs shared by the kernel tests (fresh draws, never zeros)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_hybridspec.kernels.gdn import gdn_gating


@dataclass
class Round:
    q: torch.Tensor  # [T, HK, K]
    k: torch.Tensor  # [T, HK, K]
    v: torch.Tensor  # [T, HV, V]
    a: torch.Tensor  # [T, HV] raw gate inputs
    b: torch.Tensor  # [T, HV]
    A_log: torch.Tensor  # [HV]
    dt_bias: torch.Tensor  # [HV]
    lengths: list[int]

    @property
    def cu_seqlens(self) -> torch.Tensor:
        return torch.tensor([0] + list(torch.tensor(self.lengths).cumsum(0)), dtype=torch.int32)

    def gates(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(g, beta) in fp64 from the (possibly rounded) raw inputs."""
        return gdn_gating(self.A_log.double(), self.a.double(), self.dt_bias.double(), self.b.double())

    def seq(self, i: int, t: torch.Tensor) -> torch.Tensor:
        cu = self.cu_seqlens
        return t[cu[i]:cu[i + 1]]


def random_round(gen: torch.Generator, lengths: list[int], HK: int, HV: int, K: int, V: int,
                 dtype: torch.dtype = torch.float32, strong_decay: bool = False) -> Round:
    T = sum(lengths)

    def randn(*shape, std=1.0):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * std).to(dtype)

    # Qwen3-Next initialises A_log = log(U(1, 16)) and dt_bias around softplus^-1(dt); a wider A_log
    # gives decays down to e^-50 per token (strong_decay) to exercise underflow of e^G.
    hi = 60.0 if strong_decay else 16.0
    A_log = torch.log(1 + (hi - 1) * torch.rand(HV, generator=gen, dtype=torch.float64)).float()
    dt_bias = (torch.randn(HV, generator=gen, dtype=torch.float64) * 0.5 - 2.0).float()
    return Round(q=randn(T, HK, K), k=randn(T, HK, K), v=randn(T, HV, V),
                 a=randn(T, HV), b=randn(T, HV, std=2.0), A_log=A_log, dt_bias=dt_bias,
                 lengths=list(lengths))


def random_states(gen: torch.Generator, slots: int, HV: int, V: int, K: int) -> torch.Tensor:
    """A state pool [slots, HV, V, K] fp32 with states of realistic magnitude."""
    return (torch.randn(slots, HV, V, K, generator=gen, dtype=torch.float64) * 0.2).float()


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error, computed in fp64."""
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm()).item()
