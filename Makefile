# The two commands a newcomer needs: `make demo` and `make test`. Both set everything up first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
# Loopback only: Ray keeps 127.0.0.1 and Gloo stays on lo (docs/design.md, "Real components"),
# and torch's store names its loopback peers from /etc/hosts, not the DNS (scripts/loopback-names).
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export GLOO_SOCKET_IFNAME := lo
LOOPBACK := scripts/loopback-names

.PHONY: install demo test test-slow bench bench-install services clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	# torch first, from the 2.13.0 CPU build on disk, so nothing pulls a CUDA build.
	$(PIP) install --quiet --find-links /opt/wheels "torch==2.13.0"
	$(PIP) install --quiet --find-links /opt/wheels -c constraints.txt -e ".[dev]"
	touch $(STAMP)

services:
	@bash scripts/ensure-services.sh

demo: install
	$(LOOPBACK) $(PY) -m examples.demo

# `make test` leaves the suites marked `slow` (real Ray jobs end to end, fault injection on a
# Ray cluster, the schemathesis fuzz of the whole API) to `make test-slow`, so that it stays
# under 25 minutes on two cores; CI (.ci/run) runs both.
test: install services
	$(LOOPBACK) $(PY) -m pytest -q -p no:cacheprovider --durations=60 -m "not slow" $(PYTEST_ARGS)

test-slow: install services
	$(LOOPBACK) $(PY) -m pytest -q -p no:cacheprovider --durations=25 -m slow $(PYTEST_ARGS)

# The engine benchmark's DeepSpeed rows need DeepSpeed, which zerotrain itself does not: installed
# here only, beside the CPU torch (the constraints keep pip from replacing it and pin what it pulls
# in; DS_BUILD_OPS=0: no ops compiled at install, the rows use a torch optimizer). The benchmark
# runs every row interleaved in one world, 5 repeats in rotated order (benchmarks/engine.py);
# e.g. BENCH_ARGS="--steps 3 --warmup 1" for a shorter run. Three tables, each one run:
# gpt-mini fp32, gpt-mini bf16 (autocast for DDP/DeepSpeed, the engine's bf16 for ours) and gpt-small
# (124M, fp32, a shorter shape so that it ends in minutes on a CPU; each row in a world of its own,
# the rows rotated per repeat: twelve 124M rows in one world do not fit a 23 GiB machine); then the
# ZeRO++ table.
BENCH_SMALL_ARGS := --seq-len 64 --micro-batch 1 --steps 3 --warmup 1
BENCH_DEPS  := deepspeed==0.19.8
BENCH_STAMP := $(VENV)/.installed-bench

bench-install: $(BENCH_STAMP)

$(BENCH_STAMP): $(STAMP) constraints.txt
	DS_BUILD_OPS=0 $(PIP) install --quiet --find-links /opt/wheels -c constraints.txt "$(BENCH_DEPS)"
	$(PY) -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $(BENCH_STAMP)

bench: install bench-install services
	$(PY) -m benchmarks.engine --interleave --repeats 5 $(BENCH_ARGS) --json bench-results/engine.json
	$(PY) -m benchmarks.engine --interleave --repeats 5 --precision bf16 $(BENCH_ARGS) --json bench-results/engine-bf16.json
	$(PY) -m benchmarks.engine --repeats 3 --preset gpt-small $(BENCH_SMALL_ARGS) $(BENCH_ARGS) --json bench-results/engine-gpt-small.json
	$(PY) -m benchmarks.zeropp --json bench-results/zeropp.json
	$(PY) -m benchmarks.service --json bench-results/service.json

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache bench-results

.PHONY: gpu-check
# The CUDA checks of issue 20 in one prepared script (benchmarks/gpu_check.py): on a machine with CUDA,
# under 8 minutes, a JSON file and a table; without CUDA (or with a CPU build of torch) one line saying
# so, after a self-test of the script's own logic, and exit 0.
gpu-check: install
	$(PY) -m benchmarks.gpu_check --json bench-results/gpu_check.json
