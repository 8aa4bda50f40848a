#!/usr/bin/env bash
# The long soak: a 1P1D cluster (each process in its own network namespace)
# under steady mixed load with random disconnects for SOAK_SECS (default
# 600 s) in three stretches: after the first (the warm-up), the heap in
# use of every tandem process must grow by under 512 B per request over
# one of the other two, and RSS (sampled every 10 s) must not grow steadily;
# p99 TTFT/TPOT per minute and the error count are printed. CI runs the
# short form (tests/tests/soak.rs: 200 requests, then twice 150). Needs
# root (namespaces), etcd, libucx and the test model (scripts/test.sh's
# environment).
set -euo pipefail
cd "$(dirname "$0")/.."
: "${TANDEM_TEST_GGUF:=$HOME/.cache/tandem/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf}"
export TANDEM_TEST_GGUF
export TANDEM_SOAK_SECS="${SOAK_SECS:-600}"
cargo build --release -p tandem-cli
exec cargo test --release -p tandem-tests --test soak -- --nocapture --test-threads=1
