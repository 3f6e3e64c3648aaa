# The two commands a newcomer needs: `make dev` and `make test`. Everything else is a step of those.
SHELL := /bin/bash
.DEFAULT_GOAL := help
NATIVE_CRATES := --workspace --exclude llm-gateway --exclude gateway-durable-objects

.PHONY: help setup build sim dev test test-native test-worker test-python clean

help:
	@echo "make dev    - set up if needed, build, run the gateway on 127.0.0.1:8787 with 3 simulated vLLM backends"
	@echo "make test   - set up if needed, run every test (native crates, Worker under Miniflare, OpenAI client)"
	@echo "make setup  - install the toolchain (idempotent)"
	@echo "make build  - build the Worker into build/"
	@echo "make bench  - the routing benchmark (~16 min); make bench-quick: under 5 min"
	@echo "make bench-admission - admission control under 1.5x overload, with and without the queue (~3 min)"
	@echo "make soak   - 5,000 requests at 200 concurrent with random backend faults"

setup:
	@scripts/setup.sh

build:
	@scripts/build.sh

# The native tools (vllm-sim), built in release mode for tests, benchmarks and `make dev`.
sim:
	@cargo build --release -q -p vllm-sim

dev: setup sim
	@scripts/dev.sh

test: setup
	@$(MAKE) --no-print-directory test-native
	@$(MAKE) --no-print-directory sim build
	@$(MAKE) --no-print-directory test-worker test-python

test-native:
	@echo "== native crates: cargo test"
	@cargo test -q $(NATIVE_CRATES)

test-worker:
	@echo "== Worker under Miniflare: node --test"
	@source scripts/env.sh && node --test --test-concurrency=1 tests/*.test.mjs

test-python:
	@echo "== OpenAI client: pytest"
	@source scripts/env.sh && .venv/bin/pytest -q tests/python

clean:
	rm -rf build target/wasm32-unknown-unknown

.PHONY: bench bench-quick bench-admission

# The routing benchmark (bench/README.md): 8 vllm-sim backends behind the gateway under wrangler dev,
# every policy on every workload; writes bench/results/<date>.{json,md} and charts (~16 minutes).
bench: setup
	@cargo build --release -q -p loadgen -p vllm-sim
	@scripts/bench.sh full
	@$(MAKE) --no-print-directory bench-admission

# The same, smaller (4 policies, shorter runs): under 5 minutes.
bench-quick: setup
	@cargo build --release -q -p loadgen -p vllm-sim
	@scripts/bench.sh quick

.PHONY: soak
# Soak: 5,000 requests, 200 at a time, 4 vllm-sim backends with random faults, bounded to 240 s.
# Against the Worker under Miniflare, or against a running gateway with SOAK_URL and SOAK_TOKEN.
soak: setup sim build
	@source scripts/env.sh && node tests/soak.mjs --requests 5000 --concurrency 200 --sims 4 --seconds-limit 240 $(if $(SOAK_URL),--url $(SOAK_URL) --admin-token $(SOAK_TOKEN))

# Admission control under overload (bench/admission.mjs): a batch and an interactive tenant at 1.5x the
# fleet's capacity, with and without the gateway's queue; writes bench/results/admission-<date>.json (~3 min).
bench-admission: setup sim build
	@source scripts/env.sh && node bench/admission.mjs
