#!/usr/bin/env bash
# The chaos suite's full form: the 1P2D cluster in network namespaces
# (tests/tests/chaos.rs) with every fault also held for the duration in its
# name (partitions 10 s, SIGSTOP 6-8 s, slow clients at 1 token/s for 15 s,
# ...) and recovery measured over 4 s windows. CI runs the short form, which
# holds each fault only until enough requests started during it have ended.
# TANDEM_CHAOS_ONLY=TEXT runs only the scenarios whose name contains TEXT.
# Needs root (namespaces), etcd, libucx and the test model (scripts/test.sh's
# environment).
set -euo pipefail
cd "$(dirname "$0")/.."
: "${TANDEM_TEST_GGUF:=$HOME/.cache/tandem/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf}"
export TANDEM_TEST_GGUF
export TANDEM_CHAOS_FULL=1
cargo build --release -p tandem-cli
exec cargo test --release -p tandem-tests --test chaos -- --nocapture --test-threads=1
