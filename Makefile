# The two commands a user needs: `make demo` and `make test`.
# Both create .venv when it is missing and install the project into it.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
REPO   ?= model_repo

.PHONY: demo test install export bench clean

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

clean:
	rm -rf $(VENV) $(REPO) .pytest_cache
