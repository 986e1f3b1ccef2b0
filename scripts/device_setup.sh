#!/usr/bin/env bash
# On the GPU machine (see ../shared/device/README.md and docs/device.md): make this checkout importable
# as vllm_hybridspec without building it, and let vLLM find the plugin's entry point.
# Usage: `source scripts/device_setup.sh` after the vLLM bundle is installed in /tmp/site.
export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1
# vLLM loads general plugins through entry points; without a pip install there is no dist-info, so
# write a minimal one next to the bundle (PYTHONPATH directories are searched for metadata too).
mkdir -p /tmp/site/vllm_hybridspec-0.0.0.dist-info
printf 'Metadata-Version: 2.1\nName: vllm-hybridspec\nVersion: 0.0.0\n' > /tmp/site/vllm_hybridspec-0.0.0.dist-info/METADATA
printf '[vllm.general_plugins]\nhspec = vllm_hybridspec.engine.plugin:register\n\n[console_scripts]\nhybridspec = vllm_hybridspec.cli:app\n' \
  > /tmp/site/vllm_hybridspec-0.0.0.dist-info/entry_points.txt
hybridspec() { python3 -m vllm_hybridspec.cli "$@"; }
# compile and autotune caches in one place, packed with the results (gpu_session.sh) and carried to the
# next lease as .devcache/cNN parts: vLLM's torch.compile cache, Inductor's and Triton's
export HS_CACHE=/tmp/hs-cache
export VLLM_CACHE_ROOT=$HS_CACHE/vllm TORCHINDUCTOR_CACHE_DIR=$HS_CACHE/inductor TRITON_CACHE_DIR=$HS_CACHE/triton
mkdir -p $HS_CACHE
if ls .devcache/c[0-9][0-9] >/dev/null 2>&1 && [ ! -e $HS_CACHE/.restored ]; then
  cat .devcache/c[0-9][0-9] | tar xJ -C $HS_CACHE && touch $HS_CACHE/.restored \
    && echo "caches restored: $(du -sh $HS_CACHE | cut -f1)"
fi
