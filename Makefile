# tritonllm: `make train` trains void_tiny on the embedded corpus, `make test` runs the CPU suite.
# Whichever target runs first creates the virtual environment (.venv) with tritonllm and what training
# needs; each target then adds the extras it needs (one stamp file per set): `make train` only the
# training dependencies, `make test` the test and sweep extras, `make lint` the lint extra, `make
# typecheck` the lint and test extras (mypy checks against the packages the tests import).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU build of PyTorch for the test and train environments; override on a CUDA machine,
# e.g. `make train TORCH_SPEC=torch`.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
STAMP_TEST := $(VENV)/.installed-test
STAMP_LINT := $(VENV)/.installed-lint

.PHONY: train test test-gpu smoke-gpu lint typecheck bench bench-train install clean
# the stamps' pip installs share one environment: never two at once
.NOTPARALLEL:

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e .
	touch $(STAMP)

$(STAMP_TEST): $(STAMP)
	$(PY) -m pip install -q -e ".[test,sweep]"
	touch $(STAMP_TEST)

$(STAMP_LINT): $(STAMP)
	$(PY) -m pip install -q -e ".[lint]"
	touch $(STAMP_LINT)

install: $(STAMP) $(STAMP_TEST) $(STAMP_LINT)

# Trains void_tiny on the corpus built from the Python standard library, checkpoints it and
# prints a generated sample; on a machine without a GPU the kernels run in Triton's interpreter.
train: $(STAMP)
	$(PY) -m tritonllm.train +model=void_tiny experiment=cpu_smoke

# CPU suite (Triton interpreter, small shapes): about 16 minutes on 2 cores (15.5 measured on 2026-12-02).
test: $(STAMP_TEST)
	$(PY) -m pytest -q -n 2 --dist loadfile tests

# ruff's lint rules (pyproject.toml [tool.ruff]) over the whole tree; .ci/run runs it before the tests.
lint: $(STAMP_LINT)
	$(PY) -m ruff check .

# mypy over kernels/ and tritonllm/ (pyproject.toml [tool.mypy]); clean, and .ci/run runs it after the lint
# (about a minute on 2 cores without a cache).
typecheck: $(STAMP_LINT) $(STAMP_TEST)
	$(PY) -m mypy

# The same tests on CUDA, adding bfloat16 and the large shapes marked `gpu`.
# Uses the Python that has CUDA PyTorch: `make test-gpu PY=python3` on a prepared machine.
test-gpu:
	$(PY) -m pytest -q -x tests

# Every command the README documents, at the smallest GPU sizes, each under a deadline (scripts/smoke_gpu.py):
# docs/perf/smoke-<gpu>.json. Run it in every session that changes a command's code path.
smoke-gpu:
	$(PY) scripts/smoke_gpu.py

bench:
	$(PY) -m tritonllm.bench kernels

bench-train:
	$(PY) -m tritonllm.bench train +model=void125m

clean:
	rm -rf $(VENV) build *.egg-info outputs multirun
