# The two commands a user needs: `make demo` and `make test`.
# Both create .venv when it is missing and install the project into it, pinned by constraints.txt.
# CPU-only machine: `make install CPU=1` takes PyTorch's CPU wheels (about 4 GB less than the CUDA ones).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
REPO   ?= model_repo
CPU    ?=
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu

.PHONY: demo test test-unit test-process test-cluster test-cuda install export bench clean constraints gpu-check gpu-wheels \
	observability-tools

$(PY):
	@echo "==> creating the virtual environment $(VENV) with $(PYTHON)"
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml constraints.txt
	@echo "==> upgrading pip"
	$(PY) -m pip install --upgrade --progress-bar on pip
ifneq ($(CPU),)
	@echo "==> installing PyTorch's CPU wheels from $(TORCH_CPU_INDEX) (their dependencies come next, from the usual index)"
	$(PY) -m pip install --progress-bar on --no-deps --index-url $(TORCH_CPU_INDEX) \
		torch==$$(sed -n 's/^torch==//p' constraints.txt) torchvision==$$(sed -n 's/^torchvision==//p' constraints.txt)
endif
	@echo "==> installing blockflow and its test, bench and cluster extras (several GB with CUDA wheels: minutes)"
	$(PY) -m pip install --progress-bar on -c constraints.txt -e '.[test,bench,cluster]'
	touch $(STAMP)
	@echo "==> installed: $(VENV)/bin/blockflow"

# The output-in-slot extension (tensormq/outalloc.py): compiled against the installed PyTorch, about
# 30 s; without a C++ compiler it warns and blocks copy their outputs into slots instead.
EXT_STAMP := $(VENV)/.outalloc
$(EXT_STAMP): $(STAMP) tensormq/outalloc.cpp
	@echo "==> building the output-in-slot extension (C++, against the installed PyTorch)"
	$(VENV)/bin/blockflow build-ext
	touch $(EXT_STAMP)

install: $(STAMP) $(EXT_STAMP)

$(REPO)/resnet50/manifest.json: $(STAMP) $(EXT_STAMP)
	@echo "==> exporting ResNet50 blocks (seeded weights) into $(REPO)"
	$(VENV)/bin/blockflow export --model resnet50 --blocks 4 --method script --out $(REPO) --variant x --variant-blocks block4,head

export: $(REPO)/resnet50/manifest.json

demo: export
	@echo "==> running the end-to-end demo"
	$(VENV)/bin/blockflow demo --repo $(REPO)

# The tests are in four tiers, one folder each (CONTRIBUTING.md, "Where a test goes"): tests/unit
# (in the test process alone), tests/process (real processes, sockets, servers), tests/cluster
# (Ray), tests/cuda (a GPU; skipped without one). `make test` runs all of them, as CI does, in
# three phases: most tests on JOBS pytest-xdist workers (each with its own temporary and /dev/shm
# directories, tests/conftest.py); then the `exclusive` ones (load, rates, deadlines, Ray) with
# nothing else running, a file per worker (the Ray cluster's beside chaos); then the `alone` ones
# (soak measures the machine's capacity) by themselves. Every phase runs; the target fails when
# any did. JOBS=1 runs the phases serially. The parallel phase ends with its 25 slowest tests
# (--durations): where the suite's time goes.
# `make test-unit` (seconds), `test-process`, `test-cluster` and `test-cuda` run one tier alone.
JOBS ?= 2
# $(call phases,PATHS): a phase that selects no test (pytest's exit code 5) is no failure.
define phases
	@status=0; \
	$(PY) -m pytest -q -n $(JOBS) --dist loadfile --durations=25 -m "not exclusive" $(1) || { rc=$$?; [ $$rc -eq 5 ] || status=$$rc; }; \
	echo "==> the exclusive tests, a file per worker, nothing else running"; \
	$(PY) -m pytest -q -n $(JOBS) --dist loadfile -m "exclusive and not alone" $(1) || { rc=$$?; [ $$rc -eq 5 ] || status=$$rc; }; \
	echo "==> the tests that measure the machine's capacity, alone"; \
	$(PY) -m pytest -q -m alone $(1) || { rc=$$?; [ $$rc -eq 5 ] || status=$$rc; }; \
	exit $$status
endef

test: $(STAMP) $(EXT_STAMP)
	@echo "==> running the test suite (pytest): the parallel phase on $(JOBS) workers, then the exclusive tests, then those that run alone"
	$(call phases,tests)

test-unit: $(STAMP) $(EXT_STAMP)
	@echo "==> the unit tests (tests/unit): no process, no server"
	$(PY) -m pytest -q tests/unit

test-process: $(STAMP) $(EXT_STAMP)
	@echo "==> the process tests (tests/process): the parallel phase on $(JOBS) workers, then the exclusive tests, then those that run alone"
	$(call phases,tests/process)

test-cluster: $(STAMP) $(EXT_STAMP)
	@echo "==> the cluster tests (tests/cluster): a real multi-node Ray cluster on this machine"
	$(PY) -m pytest -q tests/cluster

test-cuda: $(STAMP) $(EXT_STAMP)
	@echo "==> the tests that need a GPU (-m cuda: tests/cuda and the GPU cases of process tests); skipped without one"
	$(PY) -m pytest -q -rs -m cuda tests

# Debian's Prometheus and Chromium, the real parts tests/process/test_dashboard.py checks the
# Grafana dashboard's queries against and tests/process/test_live_page.py loads the live page in (each skipped,
# saying so, without them). Needs root (CI runs it before `make test`, .ci/run).
OBSERVABILITY_PACKAGES := prometheus chromium
observability-tools:
	@if command -v prometheus >/dev/null && command -v chromium >/dev/null; then echo "==> prometheus and chromium are installed"; \
	elif [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then \
		echo "==> run as root on Debian: apt-get install --no-install-recommends $(OBSERVABILITY_PACKAGES)"; exit 1; \
	else echo "==> installing $(OBSERVABILITY_PACKAGES) with apt-get"; \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $(OBSERVABILITY_PACKAGES) >/dev/null \
		|| { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
		     --no-install-recommends $(OBSERVABILITY_PACKAGES) >/dev/null; }; fi

bench: export
	@echo "==> running every experiment in quick mode"
	$(VENV)/bin/blockflow bench all --quick

# GPU machine only (offline, its own python3 with torch): the cuda tests and the GPU experiments,
# each step under 10 minutes; STEPS="tests-ipc hop_overhead" runs some of them. Fails with one
# line where there is no GPU. Results: experiments/results/<machine>/ (see experiments/gpu_check.sh).
SHARED ?= /work/shared
gpu-check:
	bash experiments/gpu_check.sh $(STEPS)

# On a machine with network, before carrying the checkout (and .whl/) to the GPU machine.
# transformers (and its tokenizers, safetensors, ...): the transformers step (issue 43's GPU goal).
# (.gitignore already ignores .whl/; the script's own .git/info/exclude edit fails in a worktree.)
gpu-wheels:
	sed '/info\/exclude/d' $(SHARED)/gpu/wheelhouse.sh | bash -s -- pytest matplotlib msgspec prometheus_client tqdm \
		transformers

# After a green `make test`: pin what was installed (blockflow itself left out).
constraints: $(STAMP)
	@echo "==> writing constraints.txt from $(VENV)"
	{ echo "# Versions the test suite was last green with (Python $$($(PY) -c 'import platform; print(platform.python_version())'), $$(uname -sm), $$(date -u +%Y-%m-%d))."; \
	  echo "# 'make install' installs with -c constraints.txt. Regenerate after a green 'make test' with:"; \
	  echo "#   make constraints"; \
	  $(PY) -m pip freeze --exclude-editable | grep -iv '^blockflow'; } > constraints.txt.tmp
	mv constraints.txt.tmp constraints.txt

clean:
	@echo "==> removing $(VENV), $(REPO) and the pytest cache"
	rm -rf $(VENV) $(REPO) .pytest_cache
