#!/usr/bin/env bash
# The one command that sets up a fresh machine and runs every test:
#   scripts/test.sh
# Installs what is missing (system packages, the default model), checks
# formatting and lints, builds in release mode (the model is far too slow
# unoptimised), and runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf '\n== %s\n' "$*" >&2; }

# System packages the build and tests need: UCX (the KV transfer engine's
# transport, bound with bindgen, hence clang), etcd (worker discovery; the
# end-to-end tests start their own), protoc (gRPC code generation).
apt_packages=(libucx-dev ucx-utils etcd-server etcd-client protobuf-compiler clang libclang-dev pkg-config)
missing=()
for p in "${apt_packages[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if ((${#missing[@]})); then
  log "installing ${missing[*]}"
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo=sudo
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}"
fi

log "formatting and lints"
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --release -- -D warnings

log "building"
cargo build --workspace --release

# Fetch the default model through the same code path users hit (cached after
# the first run), and smoke-test the binary on it.
log "default model"
export TANDEM_CACHE=${TANDEM_CACHE:-$HOME/.cache/tandem}
./target/release/tandem generate --model smollm2-135m --prompt "Hello" --max-tokens 4 --temperature 0 >/dev/null
export TANDEM_TEST_GGUF=$TANDEM_CACHE/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf

# An HF-style directory converted from the GGUF by an independent Python
# script, for the safetensors loader's tests (cached after the first run).
log "HF fixture"
export TANDEM_TEST_HF_DIR=$TANDEM_CACHE/test-fixtures/smollm2-135m-hf-f32
scripts/make-hf-fixture.sh "$TANDEM_TEST_HF_DIR"

# A hang must fail the run, not eat CI's whole time budget.
log "tests"
timeout 1800 cargo test --workspace --release
