"""The drafter allocates no per-token state of its own: what it keeps per request does not grow
with the context length (H-Spec's point: no drafter-side KV cache, paper section 3.2).

Every tensor that ``propose`` creates is tracked (a ``TorchDispatchMode`` sees each op's outputs);
after the call, the storages still alive are what the drafter retains. They must be exactly the
returned draft (tokens, top-1 probabilities, entropies) and nothing else, whatever the context
length. The transient working set (attention over the target's prefix K/V) does grow with the
context, as the target's own decode attention does; it is reported, not asserted.
"""

from __future__ import annotations

import gc
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .conftest import VOCAB, target_context


class StorageTracker(TorchDispatchMode):
    """Weak references to every tensor produced inside the mode, and the peak of live bytes."""

    def __init__(self):
        super().__init__()
        self.tensors: list[weakref.ref] = []
        self.peak = 0

    def live(self, exclude: set[int] = frozenset()) -> dict[int, int]:
        storages = {}
        for ref in self.tensors:
            t = ref()
            if t is not None and t.untyped_storage().data_ptr() not in exclude:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return storages

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self.tensors.append(weakref.ref(t))
        self.peak = max(self.peak, sum(self.live().values()))
        return out


def measure(drafter, target, context_len: int) -> tuple[int, int, int]:
    """(bytes retained beyond the returned draft, bytes of the returned draft, peak transient bytes)
    for one request with ``context_len`` tokens of target context."""
    ids = torch.randint(
        0, VOCAB - 1, (1, context_len + 1), generator=torch.Generator().manual_seed(context_len)
    )
    hidden, kv = target_context(target, drafter, ids[:, :context_len])
    last, anchor, lens = hidden[-1:].clone(), ids[0, -1:].clone(), torch.tensor([context_len])
    param_bytes = sum(t.nbytes for t in drafter.state_dict().values())
    gc.collect()
    tracker = StorageTracker()
    with tracker:
        block = drafter.propose(last, anchor, kv, lens)
    gc.collect()
    returned = {t.untyped_storage().data_ptr() for t in (block.tokens, block.top1_prob, block.entropy)}
    retained = sum(tracker.live(exclude=returned).values())
    output = sum(tracker.live().values()) - retained
    assert sum(t.nbytes for t in drafter.state_dict().values()) == param_bytes  # no buffer grew either
    return retained, output, tracker.peak


def test_memory_per_request_does_not_grow_with_context(target, drafter):
    lengths = [32, 512, 4096]
    results = {n: measure(drafter, target, n) for n in lengths}
    retained, output, peak = zip(*(results[n] for n in lengths))
    assert retained == (0, 0, 0), (
        f"drafter kept tensors alive after propose: {dict(zip(lengths, retained))} bytes"
    )
    assert len(set(output)) == 1, (
        f"the returned draft's size depends on the context: {dict(zip(lengths, output))}"
    )
    k = len(drafter.kv_reuse_layer_ids)
    kv_heads, head_dim = (
        drafter.config.attention_geometry.num_key_value_heads,
        drafter.config.attention_geometry.head_dim,
    )
    # for scale: a DFlash-style drafter-side cache for these attention layers would hold per token
    dflash_per_token = k * 2 * kv_heads * head_dim * 4
    print(
        f"\nretained beyond the draft: {dict(zip(lengths, retained))} B; draft: {output[0]} B; "
        f"transient peak: {dict(zip(lengths, peak))} B; a drafter-side fp32 KV cache for {k} layers would be "
        f"{dict((n, n * dflash_per_token) for n in lengths)} B"
    )


def test_tracker_sees_a_drafter_side_cache(target, drafter):
    """Negative control: a drafter that copied the prefix K/V into its own cache is caught."""
    cache = []
    attn = next(layer.self_attn for layer in drafter.layers if layer.self_attn is not None)
    handle = attn.register_forward_pre_hook(lambda module, args: cache.append(args[3] * 1))
    try:
        retained = [measure(drafter, target, n)[0] for n in (32, 256)]
    finally:
        handle.remove()
    assert 0 < retained[0] < retained[1]
