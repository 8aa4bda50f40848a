#!/usr/bin/env bash
# The long soak: a 1P1D cluster (each process in its own network namespace)
# under steady mixed load with random disconnects for SOAK_SECS (default
# 600 s), printing RSS per process every 10 s, the RSS slope per process
# after warm-up, p99 TTFT/TPOT per minute and the error count. CI runs the
# same test for 120 s (tests/tests/soak.rs). Needs root (namespaces), etcd,
# libucx and the test model (scripts/test.sh's environment).
set -euo pipefail
cd "$(dirname "$0")/.."
: "${TANDEM_TEST_GGUF:=$HOME/.cache/tandem/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf}"
export TANDEM_TEST_GGUF
export TANDEM_SOAK_SECS="${SOAK_SECS:-600}"
cargo build --release -p tandem-cli
exec cargo test --release -p tandem-tests --test soak -- --nocapture --test-threads=1
