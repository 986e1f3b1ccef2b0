#!/usr/bin/env bash
# On the GPU machine (see ../shared/device/README.md): make this checkout importable as
# vllm_hybridspec (kernels/, drafter/, train/ map to vllm_hybridspec.* as in pyproject.toml)
# without building it.  Usage: `source examples/device_setup.sh` after the vLLM bundle is installed.
set -e
rm -rf /tmp/hybridspec_pkgs && mkdir -p /tmp/hybridspec_pkgs
cp -r vllm_hybridspec /tmp/hybridspec_pkgs/
for d in kernels drafter train; do cp -r "$d" "/tmp/hybridspec_pkgs/vllm_hybridspec/$d"; done
export PYTHONPATH=/tmp/site:/tmp/hybridspec_pkgs:$PWD
export PYTHONUNBUFFERED=1
set +e
