"""Profile one launch of each GDN kernel at the 35B shape (GPU): run under ncu, e.g.

    ncu --kernel-name regex:gdn_ --launch-skip 2 --launch-count 2 --section SpeedOfLight \
        --section LaunchStats --section Occupancy --section WarpStateStats \
        python3 examples/profile_gdn_verify.py --B 1 --w 16
"""

import argparse

import torch

from vllm_hybridspec.kernels.gdn import StatePointers, VerifyFactors, gdn_commit, gdn_verify

HK, HV, K, V = 16, 32, 128, 128

p = argparse.ArgumentParser()
p.add_argument("--B", type=int, default=1)
p.add_argument("--w", type=int, default=16)
p.add_argument("--BV", type=int, default=64)
p.add_argument("--BK", type=int, default=64)
p.add_argument("--num-warps", type=int, default=4)
p.add_argument("--precision", default="tf32x3")
a = p.parse_args()
T = a.B * a.w
dev = "cuda"
q, k = torch.randn(T, HK, K, device=dev, dtype=torch.bfloat16), torch.randn(T, HK, K, device=dev, dtype=torch.bfloat16)
v = torch.randn(T, HV, V, device=dev, dtype=torch.bfloat16)
ga, gb = torch.randn(T, HV, device=dev, dtype=torch.bfloat16), torch.randn(T, HV, device=dev, dtype=torch.bfloat16)
A_log, dt_bias = torch.rand(HV, device=dev), torch.randn(HV, device=dev)
pool = torch.randn(a.B + 1, HV, V, K, device=dev) * 0.2
slots = torch.arange(1, a.B + 1, dtype=torch.int32, device=dev)
cu = torch.arange(0, T + 1, a.w, dtype=torch.int32, device=dev)
f = VerifyFactors.empty(T, HK, HV, K, V, dev, num_layers=1)
cfg = dict(BV=a.BV, BK=a.BK, num_warps=a.num_warps, precision=a.precision)
for _ in range(4):
    gdn_verify(q, k, v, g=ga, beta=gb, A_log=A_log, dt_bias=dt_bias, state=pool, state_indices=slots,
               cu_seqlens=cu, max_len=a.w, factors=f.layer(0), **cfg)
    gdn_commit([pool], f, cu, slots, torch.full((a.B,), a.w, dtype=torch.int32, device=dev))
torch.cuda.synchronize()
try:  # register use and spills, as Triton reports them
    from vllm_hybridspec.kernels.gdn.verify import gdn_verify_kernel

    for cache in gdn_verify_kernel.device_caches.values():
        for kern in cache[0].values():
            print("verify kernel: registers", kern.n_regs, "spills", kern.n_spills)
except Exception as e:  # noqa: BLE001
    print("no Triton kernel metadata:", e)
