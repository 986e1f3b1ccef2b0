#!/usr/bin/env bash
# Build the project's extra packages for the GPU machine (no registry there): speculators and the
# packages it imports that the GPU image lacks (datasets and its small dependencies), and mamba-ssm's
# Triton kernels (this machine's CUDA-less build, pure Python). The image has pyarrow, pandas,
# matplotlib, typer, rich and scikit-learn (docs/device.md); FULL=1 adds them anyway (about 88 MiB).
# Complements the vLLM bundle of ../shared/device/make_vllm_bundle.sh.
# usage: scripts/make_device_extras.sh [OUT_DIR=.devextras]   (PART_MB=N for part size, default 44)
# then carry each OUT_DIR/eNN in its own call after the vLLM bundle and run
#   cat /tmp/devextras/e* | tar x -C /tmp/devextras && bash /tmp/devextras/install_extras.sh
set -euo pipefail
OUT="${1:-.devextras}"
PY="${PYTHON:-.venv/bin/python}"
WORK="$(mktemp -d)"; trap 'rm -rf "$WORK"' EXIT
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64)
mkdir -p "$WORK/whl"
PKGS=(speculators==0.9.0 hs-connectors==0.9.0 datasets==5.1.0 multiprocess==0.70.19 xxhash==4.1.0 dill==0.4.1 fsspec==2026.7.0)
[ "${FULL:-0}" = 1 ] && PKGS+=(pyarrow==26.0.1 "pandas==2.3.3" pytz tzdata matplotlib==3.11.2 contourpy kiwisolver
  fonttools cycler pyparsing python-dateutil typer==0.29.2 shellingham annotated-doc rich markdown-it-py mdurl pygments click)
"$PY" -m pip download -q --no-deps "${PLAT[@]}" -d "$WORK/whl" "${PKGS[@]}"
SITE="$("$PY" -c 'import importlib.util, os; print(os.path.dirname(os.path.dirname(importlib.util.find_spec("mamba_ssm").origin)))')"
tar cf "$WORK/mamba_ssm.tar" -C "$SITE" mamba_ssm
cat > "$WORK/install_extras.sh" <<'INNER'
#!/usr/bin/env bash
# On the GPU machine: wheels into /tmp/extras, placed on sys.path AFTER the image's site-packages
# (a .pth file), so the image's own packages win and the extras only fill gaps.
set -euo pipefail
cd /tmp/devextras
mkdir -p /tmp/extras
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/extras whl/*.whl 2>&1 | grep -v 'already exists' || true
tar xf mamba_ssm.tar -C /tmp/extras
SP="$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo /tmp/extras > "$SP/zz_devextras.pth"
python3 -c "import speculators, datasets, matplotlib, typer; print('extras ok: speculators', speculators.__version__ if hasattr(speculators, '__version__') else '?', 'datasets', datasets.__version__)"
INNER
mkdir -p "$OUT" && rm -f "$OUT"/e[0-9][0-9]
tar cf - -C "$WORK" whl mamba_ssm.tar install_extras.sh | split -b "${PART_MB:-44}M" -d - "$OUT/e"
ls -la "$OUT"
