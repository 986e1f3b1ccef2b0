#!/usr/bin/env bash
# On the GPU machine (see ../shared/device/README.md): make this checkout importable as
# vllm_hybridspec without building it (kernels/, drafter/, train/ map to vllm_hybridspec.* as in
# pyproject.toml).  The links are made in the device's copy of the tree only.
# Usage: `source examples/device_setup.sh` after the vLLM bundle is installed in /tmp/site.
for d in kernels drafter train; do ln -sfn "../$d" "vllm_hybridspec/$d"; done
export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1
