"""``hybridspec demo``: H-Spec speculative decoding served by vLLM on the committed reference models,
checked token for token against plain decoding (:func:`run_serving_demo`), and one speculative round
through several GDN layers with the project's kernels, checked end to end (:func:`run_gdn_round_demo`).

Each sequence of a batch verifies ``u`` target-input tokens in every layer with the block-parallel
verify kernel, a random number of them is accepted, and one commit launch rebuilds the accepted
state of every layer.  Outputs and committed states are compared with the token-by-token float64
recurrence, and the memory of per-token states (what vLLM 0.26 keeps) is compared with the compact
factors that replace them.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from vllm_hybridspec.kernels.gdn import (
    StatePointers,
    VerifyFactors,
    gdn_commit,
    gdn_gating,
    gdn_verify,
    recurrent_gated_delta_rule,
)

TOLERANCE = 1e-4  # relative Frobenius error with fp32 inputs


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


def run_gdn_round_demo(max_len: int = 16, batch: int = 3, layers: int = 3, seed: int = 0,
                       HK: int = 2, HV: int = 4, K: int = 64, V: int = 64) -> bool:
    """Run the round, print what was checked, and return whether every check passed."""
    if not 2 <= max_len <= 16:
        raise ValueError(f"max_len must be in 2..16, got {max_len}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(seed)
    lengths = [max_len] + [int(x) for x in torch.randint(2, max_len + 1, (batch - 1,), generator=gen)]
    # m = accepted draft tokens + 1, at most the verified length
    commits = [int(torch.randint(1, n + 1, (1,), generator=gen)) for n in lengths]
    T = sum(lengths)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    slots = torch.arange(1, batch + 1, dtype=torch.int32)  # slot 0 is vLLM's null block

    def randn(*shape, std=1.0):
        return torch.randn(*shape, generator=gen) * std

    pools = [randn(batch + 1, HV, V, K, std=0.2) for _ in range(layers)]
    before = [p.clone() for p in pools]
    factors = VerifyFactors.empty(T, HK, HV, K, V, device, num_layers=layers)
    on = lambda t: t.to(device)  # noqa: E731
    dev_pools = [on(p) for p in pools]
    worst_out, worst_state = 0.0, 0.0
    refs = []
    for layer in range(layers):
        q, k, v = randn(T, HK, K), randn(T, HK, K), randn(T, HV, V)
        a, b = randn(T, HV), randn(T, HV, std=2.0)
        A_log, dt_bias = torch.log(1 + 15 * torch.rand(HV, generator=gen)), randn(HV, std=0.5) - 2
        o, _ = gdn_verify(on(q), on(k), on(v), g=on(a), beta=on(b), A_log=on(A_log),
                          dt_bias=on(dt_bias), state=dev_pools[layer], state_indices=on(slots),
                          cu_seqlens=on(cu), max_len=max_len, factors=factors.layer(layer))
        g, beta = gdn_gating(A_log.double(), a.double(), dt_bias.double(), b.double())
        for i in range(batch):
            s, e = int(cu[i]), int(cu[i + 1])
            o_ref, states = recurrent_gated_delta_rule(
                q[s:e].double(), k[s:e].double(), v[s:e].double(), g[s:e], beta[s:e],
                before[layer][int(slots[i])].double())
            worst_out = max(worst_out, _rel(o[s:e].cpu(), o_ref))
            refs.append((layer, i, states[commits[i] - 1]))
    gdn_commit(StatePointers(dev_pools), factors, on(cu), on(slots),
               on(torch.tensor(commits, dtype=torch.int32)))
    for layer, i, expect in refs:
        worst_state = max(worst_state, _rel(dev_pools[layer][int(slots[i])].cpu(), expect))

    state_bytes = HV * V * K * 4
    per_token_states = layers * sum(lengths) * state_bytes
    compact = layers * T * (HV * V + HK * K + HV) * 4
    print(f"GDN round on {device}: {batch} sequences, lengths {lengths}, committed m={commits}, "
          f"{layers} layers (HK={HK}, HV={HV}, K={K}, V={V})")
    print(f"  verify (all tokens in parallel from S0) vs token-by-token fp64 recurrence: "
          f"max relative error {worst_out:.2e}")
    print(f"  commit (all layers in one launch) vs fp64 state after m tokens:            "
          f"max relative error {worst_state:.2e}")
    print(f"  per-token states a per-token verifier writes: {per_token_states / 2**20:.2f} MiB; "
          f"compact factors kept instead: {compact / 2**20:.2f} MiB")
    ok = worst_out <= TOLERANCE and worst_state <= TOLERANCE
    print("  PASS" if ok else f"  FAIL (tolerance {TOLERANCE:g})")
    return ok


MODELS_DIR = Path(__file__).resolve().parents[2] / "models"  # the committed reference models


def run_serving_demo(kind: str = "hybrid", num_prompts: int = 8, max_tokens: int = 48,
                     num_speculative_tokens: int = 7, models_dir: Path = MODELS_DIR, bs1_prompts: int = 2) -> bool:
    """Serve the reference ``kind`` target through vLLM with its H-Spec drafter and without
    speculation (one after the other), greedy, on held-out prompts; print tokens/s side by side (all
    prompts at once, and ``bs1_prompts`` one at a time), their ratio and the acceptance length, and
    return whether every output is identical to plain decoding."""
    from vllm_hybridspec.tools.compare import CompareSettings, run_all
    from vllm_hybridspec.tools.engine_args import PromptOptions

    target, drafter = models_dir / kind, models_dir / f"{kind}-hspec"
    missing = [str(p) for p in (target, drafter, models_dir / "prompts" / "heldout.jsonl") if not p.exists()]
    if missing:
        raise FileNotFoundError(f"reference models not found: {missing}; they are committed under models/ "
                                "(or rebuild them with `make models`)")
    from vllm_hybridspec.train.reference.accept import engine_options

    on_gpu = torch.cuda.is_available()
    engine = engine_options(models_dir, kind, max_num_seqs=8)
    prompts = PromptOptions(prompts=models_dir / "prompts" / "heldout.jsonl", num_prompts=num_prompts).load(str(target))
    settings = CompareSettings(max_tokens=max_tokens, bs1_prompts=min(bs1_prompts, len(prompts)))
    spec = {"method": "hspec", "model": str(drafter), "num_speculative_tokens": num_speculative_tokens}
    where = "the GPU, with CUDA graphs" if on_gpu else f"the CPU ({os.cpu_count()} cores, eager)"
    print(f"vLLM on {where}: reference {kind} target {target}, H-Spec drafter {drafter}, {len(prompts)} held-out "
          f"prompts, {max_tokens} greedy tokens each")
    plain, hspec = run_all([("plain", None), ("hspec", spec)], engine, settings, prompts)
    failed = [r for r in (plain, hspec) if "error" in r]
    if failed:
        for r in failed:
            print(f"  FAIL: {r['name']}: {r['error']}")
        return False
    same = sum(a == b for a, b in zip(hspec["outputs"], plain["outputs"]))
    print(speed_table(plain, hspec, len(prompts)))
    ratio = hspec["batch_tokens_per_s"] / plain["batch_tokens_per_s"]
    if ratio < 1:
        print(f"  H-Spec is slower than plain decoding here ({ratio:.2f}x): at an acceptance length of "
              f"{hspec['mean_acceptance_length']:.2f} tokens per round a round must cost less than "
              f"{hspec['mean_acceptance_length']:.2f} plain steps to pay, and "
              + ("on a CPU verifying u tokens costs about u times one token's compute"
                 if not on_gpu else "this round costs more than that"))
    ok = same == len(prompts)
    print(f"  {'PASS' if ok else 'FAIL'}: H-Spec output identical to plain decoding on {same}/{len(prompts)} prompts")
    return ok


def speed_table(plain: dict, hspec: dict, num_prompts: int) -> str:
    """Tokens/s of both runs side by side, with the ratio, and H-Spec's acceptance length."""
    rows = [("all prompts at once", "batch_tokens_per_s"), ("one prompt at a time", "bs1_tokens_per_s")]
    lines = [f"  {'':<22} {'plain tok/s':>12} {'H-Spec tok/s':>13} {'ratio':>7}"]
    for label, key in rows:
        if plain.get(key) and hspec.get(key):
            lines.append(f"  {label:<22} {plain[key]:>12.1f} {hspec[key]:>13.1f} {hspec[key] / plain[key]:>6.2f}x")
    lines.append(f"  acceptance length {hspec['mean_acceptance_length']:.2f} tokens per round "
                 f"({num_prompts} prompts)")
    return "\n".join(lines)
