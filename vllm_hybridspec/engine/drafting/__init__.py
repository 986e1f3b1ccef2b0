"""H-Spec drafting inside vLLM 0.26 (H-Spec paper): the proposer that replaces vLLM's DFlash proposer
in the V1 runner (``proposer``), the drafter as a vLLM model that reads the target's KV cache in
place (``model``), and the CUDA graphs of its round (``graphs``). Its reaches into vLLM (the runner's
``DFlashProposer`` name, the V2 runner's unsupported features, the model and speculators registrations)
are rows of ``engine/patches/table.py``."""
