"""The GDN-kernel benchmarks behind ``hybridspec kernels`` (:mod:`.cli`): ours against vLLM 0.26 and
fla (:mod:`.gdn_compare`, its report :mod:`.report`), the fused lazy commit against the unfused round
(:mod:`.fused_round`), launch sweeps (:mod:`.tune`) and a round for Nsight Compute (:mod:`.profile`),
on the shapes and inputs of :mod:`.shapes`, timed by :mod:`.timing`. Timings need CUDA; the accuracy
checks also run on the CPU, through Triton's interpreter."""
