#!/usr/bin/env bash
# The one command that sets up a fresh machine and runs every test:
#   scripts/test.sh
# Installs what is missing (system packages, the default model), checks
# formatting and lints, builds in release mode (the model is far too slow
# unoptimised), and runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."

. scripts/lib.sh

# Each step's minutes, and the slowest test binaries, printed again at the
# end whether the run passes or fails: a CI log is often read only by its
# tail, and that is where the time went.
steps=() step_starts=()
step() {
  log "$*"
  steps+=("$*")
  step_starts+=("$SECONDS")
}
test_log=$(mktemp)
summary() {
  local rc=$? i end
  {
    printf '\n== step times (exit %d)\n' "$rc"
    for i in "${!steps[@]}"; do
      end=${step_starts[i + 1]:-$SECONDS}
      printf '%6ds  %s\n' $((end - step_starts[i])) "${steps[i]}"
    done
    printf '%6ds  in all\n' "$SECONDS"
    if [[ -s $test_log ]]; then
      printf '\n== slowest test binaries\n'
      awk '/^ *Running /{src = $2 == "unittests" ? $3 : $2; crate = $NF
          sub(/.*deps\//, "", crate); sub(/-[0-9a-f]+\)$/, "", crate); bin = crate " " src}
        /finished in/{t = $NF; sub(/s$/, "", t); printf "%6.0fs  %s\n", t, bin}' \
        "$test_log" | sort -rn | head -12
    fi
  } >&2
  rm -f "$test_log"
}
trap summary EXIT

# System packages the build and tests need: UCX (the KV transfer engine's
# transport, bound with bindgen, hence clang), etcd (worker discovery; the
# end-to-end tests start their own), protoc (gRPC code generation), haproxy
# (the load balancer in front of two routers in tests/deploy), promtool
# (Prometheus, to check the alert rules in tests/telemetry), iproute2 (`ip`
# and `tc`: the chaos suite's network namespaces, veths and rate limits),
# Mesa's Vulkan drivers (lavapipe: a Vulkan device on the CPU, on which
# tandem-gpu's tests run its kernels where there is no GPU).
ensure_packages libucx-dev ucx-utils etcd-server etcd-client protobuf-compiler clang \
  libclang-dev pkg-config haproxy prometheus iproute2 mesa-vulkan-drivers
# Mesa's window-system probe complains on every device open without one.
if [[ -z ${XDG_RUNTIME_DIR:-} ]]; then
  XDG_RUNTIME_DIR=$(mktemp -d)
  export XDG_RUNTIME_DIR
fi

# A cold build and its tests write about 6 GB under target/ and 4 GB of
# models and tools under the cache; say so up front rather than fail deep
# in the build with "No space left on device".
need_gb=12
[[ -d target/release ]] && need_gb=3
free_gb=$(df -Pk . | awk 'NR == 2 { print int($4 / 1048576) }')
log "disk: ${free_gb} GB free here, about ${need_gb} GB needed"
if ((free_gb < need_gb)); then
  echo "error: only ${free_gb} GB free on $(df -P . | awk 'NR == 2 { print $6 }'); the build and tests need about ${need_gb} GB" >&2
  exit 1
fi

step "formatting"
cargo fmt --all -- --check

# One compilation serves lints, binaries and tests. Clippy runs as the
# workspace crates' compiler (clippy-driver compiles as rustc does, and
# lints on the way), so the dependencies are not compiled a second time in
# check mode; -D warnings makes rustc's and Clippy's warnings errors
# (dependencies are capped by cargo). Exported: every cargo command below
# must see the same flags, or it rebuilds everything.
export RUSTC_WORKSPACE_WRAPPER
RUSTC_WORKSPACE_WRAPPER=$(rustc --print sysroot)/bin/clippy-driver
export RUSTFLAGS="${RUSTFLAGS:+$RUSTFLAGS }-D warnings"

# The chart, values files and Dockerfile: lint and schema checks (installs
# helm, kubernetes-validate and hadolint into ~/.cache/tandem/tools once).
step "deployment files"
scripts/check-deploy.sh
export TANDEM_HELM=${TANDEM_HELM:-${TANDEM_TOOLS:-$HOME/.cache/tandem/tools}/bin/helm}

step "building and linting"
# Every target at once (benches too, so Clippy sees them): a build without
# the test targets would resolve dependency features without the
# dev-dependencies, and `cargo test` would then rebuild nearly the whole
# tree with the unified features. --timings writes target/cargo-timings/:
# where a slow build's minutes went.
cargo build --workspace --release --all-targets --timings

# Fetch the default model through the same code path users hit (cached after
# the first run), and smoke-test the binary on it.
step "default model"
export TANDEM_CACHE=${TANDEM_CACHE:-$HOME/.cache/tandem}
./target/release/tandem generate --model smollm2-135m --prompt "Hello" --max-tokens 4 --temperature 0 >/dev/null
export TANDEM_TEST_GGUF=$TANDEM_CACHE/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf

# The other model families (Qwen2, Gemma 3), each split over several PyPI
# wheels; fetched, size- and hash-checked once by the same code path.
step "Qwen2.5-Coder-0.5B and Gemma 3 270M"
./target/release/tandem generate --model qwen2.5-coder-0.5b --prompt "def" --max-tokens 2 --temperature 0 >/dev/null
./target/release/tandem generate --model gemma3-270m --prompt "The" --max-tokens 2 --temperature 0 >/dev/null
export TANDEM_TEST_QWEN2_GGUF=$TANDEM_CACHE/qwen2.5-coder-0.5b/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
export TANDEM_TEST_GEMMA3_GGUF=$TANDEM_CACHE/gemma3-270m/gemma-3-270m-q4_k_m.gguf

# An HF-style directory converted from the GGUF by an independent Python
# script, for the safetensors loader's tests (cached after the first run).
step "HF fixture"
export TANDEM_TEST_HF_DIR=$TANDEM_CACHE/test-fixtures/smollm2-135m-hf-f32
scripts/make-hf-fixture.sh "$TANDEM_TEST_HF_DIR"

# llama.cpp's tokenizer test vocabularies with their expected token ids,
# from the llama-cpp-python sdist on PyPI (cached after the first run).
step "llama.cpp vocab tests"
export TANDEM_LLAMA_VOCAB_DIR=$(scripts/fetch-llama-vocab.sh "$TANDEM_CACHE/llama-vocab")

# The real OpenAI client libraries (SDK, langchain-openai, Agents SDK,
# instructor, aiperf) that tests/tests/clients.rs drives, pinned in
# tests/clients/requirements.txt (installed once into the cache).
step "client libraries"
export TANDEM_CLIENTS_PYTHON=$(scripts/clients-venv.sh "$TANDEM_CACHE/clients-venv")

# NVRTC (CUDA's run-time C++ compiler, from PyPI; no GPU or driver needed)
# for tandem-gpu's check that every kernel's CUDA form compiles to PTX.
step "NVRTC"
nvrtc=$(scripts/fetch-nvrtc.sh "$TANDEM_CACHE/nvrtc")
export LD_LIBRARY_PATH=$nvrtc${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}

# Built above (this only checks they are fresh), so the time limit below
# is the tests' own: a hang must fail the run, not eat CI's whole budget.
cargo test --workspace --release --no-run
step "tests"
timeout 1800 cargo test --workspace --release --no-fail-fast 2>&1 | tee "$test_log"

# dkv without UCX (a laptop without libucx-dev): it must build and report
# UCX as unavailable cleanly. In the main target dir, so only dkv rebuilds
# (its build script watches TANDEM_DKV_NO_UCX; the next build restores it).
step "dkv without UCX"
TANDEM_DKV_NO_UCX=1 timeout 600 cargo test --release -p tandem-dkv

# The fuzz targets (run with scripts/fuzz.sh) live outside the workspace:
# check that they still compile against today's APIs.
step "fuzz targets compile"
# libfuzzer-sys builds libFuzzer's C++: use clang++ (installed above) where
# the machine has no default C++ compiler.
command -v c++ >/dev/null || export CXX=clang++
# The main target dir (its build scripts' outputs are reused), without
# the lint flags: a type check of the targets, not a lint of them.
CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$PWD/target} RUSTFLAGS= RUSTC_WORKSPACE_WRAPPER= \
  timeout 900 cargo check --release --quiet --manifest-path fuzz/Cargo.toml --bins

# The NCCL communicator is behind a feature (no GPU here): it must still
# build, lint clean, and pass its host-side tests (clean "not available"
# errors without a GPU, device-list validation).
step "NCCL backend (feature nccl, host side)"
# Linted as it builds (the workspace wrapper above); its host-side tests
# are an integration test, linked to that one build of the library.
cargo build --release -p tandem-engine --features nccl --lib --test nccl
timeout 600 cargo test --release -p tandem-engine --features nccl --test nccl
