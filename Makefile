# The two commands a newcomer needs: `make dev` and `make test`. Everything else is a step of those.
SHELL := /bin/bash
.DEFAULT_GOAL := help
NATIVE_CRATES := --workspace --exclude llm-gateway --exclude gateway-durable-objects

.PHONY: help setup build sim dev test test-real lint test-native test-worker test-python deploy-check check-bundle clean docs

help:
	@echo "make dev    - set up if needed, build, run the gateway on 127.0.0.1:8787 with 3 simulated vLLM backends"
	@echo "make test   - set up if needed, run every test (native crates, Worker under Miniflare, OpenAI client)"
	@echo "make test-real VLLM_URL=http://host:8000 - check a real vLLM server through the gateway before it takes traffic"
	@echo "make setup  - install the toolchain (idempotent)"
	@echo "make build  - build the Worker into build/"
	@echo "make bench  - the tail-latency routing benchmark and the trace replays (under 45 min); make bench-quick: under 8 min"
	@echo "make bench-traces - only the production-trace replays (Mooncake traces, every policy; under 15 min)"
	@echo "make bench-goodput - each router's highest trace replay speed-up within the SLO, smg included (~1.5 h); ARGS=--quick: a smoke run (<3 min)"
	@echo "make bench-compare-smg - the trace replays through the SGLang/Shepherd gateway (smg 1.9.0, cache_aware) and ours, same run (~6 min)"
	@echo "make bench-regions  - three regions, a skewed load: nearest-first against time routing; a burst between probe rounds with and without lease evidence (~4 min)"
	@echo "make bench-admission - admission control under 1.5x overload, with and without the queue (~3 min)"
	@echo "make bench-round-trips - TTFB with modelled 50/150 ms round trips, without and with the regional hop and rate limits (~6 min)"
	@echo "make bench-profile   - a CPU profile of the Worker's isolate over streamed requests, top functions (~1 min)"
	@echo "make bench-overhead  - one pool Durable Object's pairs/s, the Worker's CPU per request and token, added TTFB (~4 min)"
	@echo "make soak   - 5,000 requests at 200 concurrent with random backend faults"
	@echo "make deploy-check - wrangler deploy --dry-run (offline) and the bundle size against the platform limit"
	@echo "make docs   - build the book (docs/, mdBook) into docs/book/; installs mdbook once if missing"

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
	@$(MAKE) --no-print-directory lint test-native
	@$(MAKE) --no-print-directory sim build
	@$(MAKE) --no-print-directory check-bundle test-worker test-python

# Formatting and lints over every crate (the Worker's too, checked for the host target).
lint:
	@echo "== lint: cargo fmt --check, cargo clippy -D warnings"
	@cargo fmt --all --check
	@cargo clippy -q --workspace --all-targets -- -D warnings

test-native:
	@echo "== native crates: cargo test"
	@cargo test -q $(NATIVE_CRATES)

test-worker:
	@echo "== Worker under Miniflare: node --test"
	@source scripts/env.sh && node --test --test-concurrency=1 tests/*.test.mjs

test-python:
	@echo "== OpenAI client: pytest"
	@source scripts/env.sh && .venv/bin/pytest -q tests/python

# The check of a real vLLM server through the gateway before it takes traffic
# (tests/real-backend.test.mjs, the part of the suite that needs no faults):
#   make test-real VLLM_URL=http://gpu-1.internal:8000 [VLLM_MODEL=...] [VLLM_API_KEY=...]
# Without VLLM_URL it runs against a vllm-sim with vLLM 0.34's defaults, as `make test` does.
test-real: setup sim build
	@echo "== a vLLM server through the gateway: $(if $(VLLM_URL),$(VLLM_URL),vllm-sim with vLLM 0.34 defaults)"
	@source scripts/env.sh && VLLM_URL="$(VLLM_URL)" VLLM_MODEL="$(VLLM_MODEL)" VLLM_API_KEY="$(VLLM_API_KEY)" \
		node --test --test-concurrency=1 tests/real-backend.test.mjs

# What `wrangler deploy` would upload, built offline (no login), and its size against the limit.
deploy-check: setup
	@$(MAKE) --no-print-directory check-bundle

check-bundle:
	@echo "== deploy: wrangler deploy --dry-run"
	@scripts/deploy-check.sh

clean:
	rm -rf build target/wasm32-unknown-unknown docs/book

# The documentation as a book (docs/book.toml, docs/src/SUMMARY.md) into docs/book/. Not part of
# `make test` (protocol/tests/reference_docs.rs, which is, keeps the reference pages true).
docs:
	@command -v mdbook >/dev/null 2>&1 || { echo "== docs: installing mdbook (cargo install, once)"; cargo install mdbook --locked; }
	@mdbook build docs

.PHONY: bench bench-quick bench-traces bench-goodput bench-compare-smg bench-regions bench-admission bench-overhead bench-round-trips bench-profile

# The routing benchmark (bench/README.md): 8 vllm-sim backends behind the gateway under wrangler dev,
# every policy on every workload; writes bench/results/<date>.{json,md} and charts (under 30 minutes).
bench: setup
	@cargo build --release -q -p loadgen -p vllm-sim
	@scripts/bench.sh full
	@scripts/bench.sh traces
	@$(MAKE) --no-print-directory bench-regions
	@$(MAKE) --no-print-directory bench-admission
	@$(MAKE) --no-print-directory bench-overhead
	@$(MAKE) --no-print-directory bench-round-trips

# The same, smaller (5 policies, 3 modes, fewer requests): under 8 minutes.
bench-quick: setup
	@cargo build --release -q -p loadgen -p vllm-sim
	@scripts/bench.sh quick

# Only the production-trace replays (bench/traces/: Mooncake's conversation and synthetic traces, two
# speed-ups each, every policy on 8 backends); writes bench/results/<date>-traces.{json,md} and a TTFT
# CDF chart per trace and speed-up. Extra flags: ARGS="--only mooncake-conversation --policies ...".
bench-traces: setup
	@cargo build --release -q -p loadgen -p vllm-sim
	@scripts/bench.sh traces $(ARGS)

# Goodput (issue 44, bench/README.md "Goodput"): on both production traces, for every policy and for
# smg (installed on demand by bench/smg-install.sh), the highest replay speed-up at which TTFT p99 and
# e2e p99 stay within the SLO of bench/config/goodput.json (median of 3 windows per load, at most 5
# probes); writes bench/results/<date>-goodput.{json,md} and a chart per trace (~1.5 h on 2 cores).
# ARGS=--quick: the smoke run (2 policies, 2 probes, 2 windows of 120 requests; under 3 min, written
# to bench/tmp/goodput-quick). Other flags: ARGS="--routers predicted_latency,smg --windows 5 --steps 6".
bench-goodput: setup
	@cargo build --release -q -p loadgen -p vllm-sim
	@scripts/bench.sh goodput $(ARGS)

# Our gateway against the SGLang/Shepherd model gateway (bench/compare-smg.sh, issue 26): the trace
# replays of bench-traces (same windows, speed-ups, fleet) through smg 1.9.0's cache_aware policy
# (installed on demand into bench/tmp/smg-venv) and through our default policy, every cell on a fresh
# fleet; writes bench/results/<date>-compare-smg.{md,json} (~6 min). Not part of `make bench`.
# Extra flags: ARGS="--only mooncake-conversation:16" (a cell), ARGS="--requests 100" (a smoke run).
bench-compare-smg: setup sim build
	@cargo build --release -q -p loadgen -p vllm-sim
	@bench/compare-smg.sh --with-gateway $(ARGS)

.PHONY: soak
# Soak: 5,000 requests, 200 at a time, 4 vllm-sim backends with random faults, bounded to 240 s.
# Against the Worker under Miniflare, or against a running gateway with SOAK_URL and SOAK_TOKEN.
soak: setup sim build
	@source scripts/env.sh && node tests/soak.mjs --requests 5000 --concurrency 200 --sims 4 --seconds-limit 240 $(if $(SOAK_URL),--url $(SOAK_URL) --admin-token $(SOAK_TOKEN))

# Routing across regions (bench/regions.mjs, issue 25): three regions of vllm-sim pools with modelled round
# trips and a skewed load, nearest-first against routing on predicted time, then a light phase; writes
# bench/results/regions-<date>.{json,md} (~3 min).
bench-regions: setup sim build
	@source scripts/env.sh && node bench/regions.mjs $(ARGS)

# Admission control under overload (bench/admission.mjs): a batch and an interactive tenant at 1.5x the
# fleet's capacity, with and without the gateway's queue; writes bench/results/admission-<date>.json (~3 min).
bench-admission: setup sim build
	@source scripts/env.sh && node bench/admission.mjs

# The gateway's own cost (bench/overhead.mjs, issue 15): one pool Durable Object's acquire+release pairs
# per second (64 backends, 2k/16k-token prompts, 1M affinity entries), the Worker's CPU per request and per
# streamed token, and rate and added TTFB against vllm-sim directly at 1/16/64 concurrent; writes
# bench/results/overhead-<date>.{json,md} (~4 min). Parts: ARGS="--only coordinator,worker-cpu,latency".
bench-overhead: setup sim build
	@source scripts/env.sh && node bench/overhead.mjs $(ARGS)

# The gateway's own round trips on the platform (bench/round-trips.mjs, issue 27): TTFB at one request at a
# time with a modelled 50 and 150 ms client-to-pool round trip, without and with the regional hop, against
# the unavoidable path (direct vllm-sim + one round trip); writes bench/results/round-trips-<date>.{json,md} (~2 min).
bench-round-trips: setup sim build
	@source scripts/env.sh && node bench/round-trips.mjs $(ARGS)

# Where the Worker's CPU goes (bench/profile.mjs): a V8 CPU profile of the built Worker's isolate through
# workerd's inspector over a closed loop of streamed requests; prints the top functions (~1 min).
bench-profile: setup sim build
	@source scripts/env.sh && node bench/profile.mjs $(ARGS)
