"""The Mamba-2 mixer of an H-Spec layer, started from an injected recurrent state (section 3.3.1).

Same computation as ``mamba_ssm.modules.mamba2.Mamba2`` (input projection to ``[z, x, B, C, dt]``,
causal depthwise convolution over ``[x, B, C]``, SSD scan, gated group RMSNorm, output projection)
with two differences: the scan starts from ``initial_state`` instead of zeros, and the convolution
is a torch depthwise ``conv1d`` (causal-conv1d is a CUDA extension we do not require). The draft
block is the start of the drafter's own sequence, so the convolution starts from zeros; only the
SSM state carries the target's context.

Appendix B.1 sizes it with head dim 64, state dim 4, 4 groups, convolution width 4, expansion 1 and
a per-target number of heads; the SSM width is ``num_heads * head_dim``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from vllm_hybridspec.drafter.ssd import ssd_scan


class GatedGroupRMSNorm(nn.Module):
    """``rmsnorm(y * silu(z))`` normalised per group of ``size // groups`` channels, as
    ``mamba_ssm.ops.triton.layernorm_gated.RMSNorm(norm_before_gate=False, group_size=...)``."""

    def __init__(self, size: int, groups: int, eps: float = 1e-5):
        super().__init__()
        self.groups = groups
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype, compute = y.dtype, torch.promote_types(y.dtype, torch.float32)
        y = y.to(compute) * F.silu(z.to(compute))
        y = y.unflatten(-1, (self.groups, -1))  # [..., G, size // G]
        y = y * torch.rsqrt(y.square().mean(-1, keepdim=True) + self.eps)
        return (y.flatten(-2) * self.weight.to(compute)).to(dtype)


class Mamba2Mixer(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        head_dim: int = 64,
        d_state: int = 4,
        n_groups: int = 4,
        d_conv: int = 4,
        chunk_size: int = 64,
    ):
        super().__init__()
        if num_heads % n_groups != 0:
            raise ValueError(
                f"mamba_num_heads ({num_heads}) must be a multiple of mamba_n_groups ({n_groups})"
            )
        self.num_heads, self.head_dim, self.d_state, self.n_groups = num_heads, head_dim, d_state, n_groups
        self.chunk_size = chunk_size
        self.d_ssm = num_heads * head_dim
        conv_dim = self.d_ssm + 2 * n_groups * d_state
        # [z, x, B, C, dt], the order of mamba_ssm's Mamba2
        self.in_proj = nn.Linear(hidden_size, 2 * self.d_ssm + 2 * n_groups * d_state + num_heads, bias=False)
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, kernel_size=d_conv, groups=conv_dim, padding=d_conv - 1)
        self.dt_bias = nn.Parameter(torch.empty(num_heads))
        self.A_log = nn.Parameter(torch.empty(num_heads))
        self.D = nn.Parameter(torch.empty(num_heads))
        self.norm = GatedGroupRMSNorm(self.d_ssm, n_groups)
        self.out_proj = nn.Linear(self.d_ssm, hidden_size, bias=False)
        # the scan's default (ssd_scan: mamba-ssm's kernel on CUDA); False keeps the torch form, which
        # torch.compile fuses with the layer around it
        self.use_kernel: bool | None = None
        with torch.no_grad():
            self.reset_ssm_parameters()

    @property
    def state_shape(self) -> tuple[int, int, int]:
        """The recurrent state per sequence: ``[heads, head_dim, d_state]``."""
        return (self.num_heads, self.head_dim, self.d_state)

    def ssm_parameter_init(
        self, dt_min: float = 1e-3, dt_max: float = 0.1, A_range: tuple[float, float] = (1.0, 16.0)
    ) -> dict[str, torch.Tensor]:
        """mamba_ssm's initial ``dt_bias`` (softplus^-1 of a log-uniform step), ``A_log`` and ``D``."""
        H = self.num_heads
        dt = torch.exp(torch.rand(H) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)).clamp(
            min=1e-4
        )
        return {
            "dt_bias": dt + torch.log(-torch.expm1(-dt)),
            "A_log": torch.log(torch.empty(H).uniform_(*A_range)),
            "D": torch.ones(H),
        }

    def reset_ssm_parameters(self) -> None:
        for name, value in self.ssm_parameter_init().items():
            getattr(self, name).copy_(value)

    def forward(
        self, hidden: torch.Tensor, initial_state: torch.Tensor, use_kernel: bool | None = None
    ) -> torch.Tensor:
        """``hidden``: ``[N, L, hidden]``; ``initial_state``: ``[N, heads, head_dim, d_state]`` fp32.
        Returns ``[N, L, hidden]``."""
        L = hidden.shape[1]
        H, P, S, G = self.num_heads, self.head_dim, self.d_state, self.n_groups
        use_kernel = self.use_kernel if use_kernel is None else use_kernel
        z, xbc, dt = self.in_proj(hidden).split([self.d_ssm, self.d_ssm + 2 * G * S, H], dim=-1)
        # causal depthwise convolution: pad d_conv - 1 on both sides, keep the first L outputs
        xbc = F.silu(self.conv1d(xbc.transpose(1, 2))[..., :L].transpose(1, 2))
        x, B, C = xbc.split([self.d_ssm, G * S, G * S], dim=-1)
        y, _ = ssd_scan(
            x.unflatten(-1, (H, P)),
            dt,
            -torch.exp(self.A_log.to(torch.promote_types(self.A_log.dtype, torch.float32))),
            B.unflatten(-1, (G, S)),
            C.unflatten(-1, (G, S)),
            self.D,
            self.dt_bias,
            initial_state,
            self.chunk_size,
            use_kernel,
        )  # [N, L, H, P]
        return self.out_proj(self.norm(y.flatten(-2), z))
