# The two commands a user needs: `make demo` and `make test`.
# Both create .venv when it is missing and install the project into it.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
REPO   ?= model_repo

.PHONY: demo test install export bench clean gpu-check gpu-wheels

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,bench]'
	touch $(STAMP)

install: $(STAMP)

$(REPO)/resnet50/manifest.json: $(STAMP)
	$(VENV)/bin/blockflow export --model resnet50 --blocks 4 --method script --out $(REPO) --variant x --variant-blocks block4,head

export: $(REPO)/resnet50/manifest.json

demo: export
	$(VENV)/bin/blockflow demo --repo $(REPO)

test: $(STAMP)
	$(PY) -m pytest -q

bench: export
	$(VENV)/bin/blockflow bench all --quick

# GPU machine only (offline, its own python3 with torch): the cuda tests and the GPU experiments,
# each step under 10 minutes; STEPS="tests-ipc hop_overhead" runs some of them. Fails with one
# line where there is no GPU. Results: experiments/results/<machine>/ (see experiments/gpu_check.sh).
SHARED ?= /work/shared
gpu-check:
	bash experiments/gpu_check.sh $(STEPS)

# On a machine with network, before carrying the checkout (and .whl/) to the GPU machine.
# (.gitignore already ignores .whl/; the script's own .git/info/exclude edit fails in a worktree.)
gpu-wheels:
	sed '/info\/exclude/d' $(SHARED)/gpu/wheelhouse.sh | bash -s -- pytest matplotlib

clean:
	rm -rf $(VENV) $(REPO) .pytest_cache
