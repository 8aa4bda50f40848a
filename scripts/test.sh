#!/usr/bin/env bash
# The one command that sets up a fresh machine and runs every test:
#   scripts/test.sh
# Installs what is missing (system packages, models, tools), checks
# formatting, lints and builds everything in release mode (the model is far
# too slow unoptimised) in one configuration, and runs the whole suite with
# cargo-nextest (.config/nextest.toml: which tests may share the machine,
# their order, the per-test time limit that names a hang).
#
# The build lives in $TANDEM_CACHE/target (default ~/.cache/tandem/target),
# outside the checkout: a fresh clone on a machine that ran this before
# rebuilds only what changed. Downloads that need no build run while it
# builds.
set -euo pipefail
cd "$(dirname "$0")/.."

. scripts/lib.sh

# Each step's time, and the slowest tests, printed again at the end whether
# the run passes or fails: a CI log is often read only by its tail, and
# that is where the time went.
steps=() step_starts=()
step() {
  log "$*"
  steps+=("$*")
  step_starts+=("$SECONDS")
}
summary() {
  local rc=$? i end
  {
    printf '\n== step times (exit %d)\n' "$rc"
    for i in "${!steps[@]}"; do
      end=${step_starts[i + 1]:-$SECONDS}
      printf '%6ds  %s\n' $((end - step_starts[i])) "${steps[i]}"
    done
    printf '%6ds  in all\n' "$SECONDS"
    if [[ -f target/nextest/ci/junit.xml ]]; then
      scripts/test-times.py target/nextest/ci/junit.xml || true
    fi
  } >&2
}
trap summary EXIT

# System packages the build and tests need: protoc (gRPC code generation
# for etcd-client and our protos), UCX (the KV transfer engine's transport,
# loaded at run time), etcd (worker discovery; the end-to-end tests start
# their own), haproxy (the load balancer in front of two routers in
# tests/deploy), promtool (Prometheus, to check the alert rules in
# tests/telemetry), iproute2 (`ip` and `tc`: the chaos suite's network
# namespaces, veths and rate limits), Mesa's Vulkan drivers (lavapipe: a
# Vulkan device on the CPU, on which tandem-gpu's tests run its kernels
# where there is no GPU), python3-venv and unzip (the fetch scripts).
step "system packages"
ensure_packages protobuf-compiler pkg-config libucx0 ucx-utils etcd-server etcd-client \
  haproxy prometheus iproute2 mesa-vulkan-drivers python3-venv unzip
# npm (helm comes from an npm package, the Vercel AI SDK from npm): here,
# before the downloads below run side by side, so no two apt runs collide.
command -v npm >/dev/null || ensure_packages nodejs npm
# Mesa's window-system probe complains on every device open without one.
if [[ -z ${XDG_RUNTIME_DIR:-} ]]; then
  XDG_RUNTIME_DIR=$(mktemp -d)
  export XDG_RUNTIME_DIR
fi

ci_build_env
mkdir -p "$TANDEM_CACHE"
# A fresh clone's files all carry the clone's time, which would make cargo
# rebuild every crate of the workspace over the cached build; each file
# gets its last commit's time instead, so only what changed is rebuilt
# (a checkout with changes is left alone).
scripts/restore-mtimes.py || true
# A cold build and its tests write about 8 GB under the target directory
# and 4 GB of models and tools under the cache; say so up front rather than
# fail deep in the build with "No space left on device".
need_gb=14
[[ -d $CARGO_TARGET_DIR/release ]] && need_gb=4
free_gb=$(df -Pk "$TANDEM_CACHE" | awk 'NR == 2 { print int($4 / 1048576) }')
log "disk: ${free_gb} GB free in $TANDEM_CACHE, about ${need_gb} GB needed"
if ((free_gb < need_gb)); then
  echo "error: only ${free_gb} GB free on $(df -P "$TANDEM_CACHE" | awk 'NR == 2 { print $6 }'); the build and tests need about ${need_gb} GB" >&2
  exit 1
fi

# Downloads that need no build: started now, joined before the tests.
# Each prints where it put things; `joined NAME` gives that line, or shows
# the job's log and fails the run.
bg() { # NAME CMD...
  local name=$1
  shift
  "$@" >"$TANDEM_CACHE/.bg-$name.out" 2>"$TANDEM_CACHE/.bg-$name.log" &
  eval "bg_pid_$name=$!"
}
joined() { # NAME
  local pid_var="bg_pid_$1"
  if ! wait "${!pid_var}"; then
    echo "error: background step '$1' failed:" >&2
    sed 's/^/    /' "$TANDEM_CACHE/.bg-$1.log" >&2
    exit 1
  fi
  tail -n 1 "$TANDEM_CACHE/.bg-$1.out"
}
# The deployment tools (helm, kubernetes-validate, hadolint).
bg deploy_tools scripts/deploy-tools.sh --print
# The real OpenAI client libraries (SDK, langchain-openai, Agents SDK,
# instructor, aiperf) that tests/tests/clients.rs drives, pinned in
# tests/clients/requirements.txt.
bg clients scripts/clients-venv.sh "$TANDEM_CACHE/clients-venv"
# pydantic-ai needs openai 3, which the venv above cannot take: a venv of
# its own. The Vercel AI SDK, pinned in tests/clients/package-lock.json.
bg pydantic_ai scripts/clients-venv.sh "$TANDEM_CACHE/pydantic-ai-venv" \
  tests/clients/requirements-pydantic-ai.txt
bg js_clients scripts/js-clients.sh "$TANDEM_CACHE/js-clients"
# llama.cpp's tokenizer test vocabularies with their expected token ids,
# from the llama-cpp-python sdist on PyPI.
bg vocab scripts/fetch-llama-vocab.sh "$TANDEM_CACHE/llama-vocab"
# NVRTC (CUDA's run-time C++ compiler, from PyPI; no GPU or driver needed)
# for tandem-gpu's check that every kernel's CUDA form compiles to PTX.
bg nvrtc scripts/fetch-nvrtc.sh "$TANDEM_CACHE/nvrtc"
# The test runner.
bg nextest scripts/ensure-nextest.sh
# The container engine (podman) and a Debian base image, for
# tests/tests/container.rs; where no engine can run, it says why and those
# tests skip saying so.
bg container scripts/container-tools.sh

step "formatting"
cargo fmt --all -- --check

step "building and linting"
# Every target at once (benches and the fuzz targets' bodies too, so Clippy
# sees them): a build without the test targets would resolve dependency
# features without the dev-dependencies, and the tests would then rebuild
# nearly the whole tree with the unified features. --timings writes
# $CARGO_TARGET_DIR/cargo-timings/: where a slow build's minutes went.
cargo build --workspace --release --all-targets --timings

# Fetch the models through the same code path users hit (cached after the
# first run): the default SmolLM2, then the other families (Qwen2, Gemma 3),
# each split over several PyPI wheels, size- and hash-checked.
step "models"
tandem=$CARGO_TARGET_DIR/release/tandem
"$tandem" generate --model smollm2-135m --prompt "Hello" --max-tokens 4 --temperature 0 >/dev/null
"$tandem" generate --model qwen2.5-coder-0.5b --prompt "def" --max-tokens 2 --temperature 0 >/dev/null
"$tandem" generate --model gemma3-270m --prompt "The" --max-tokens 2 --temperature 0 >/dev/null
export TANDEM_TEST_GGUF=$TANDEM_CACHE/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf
export TANDEM_TEST_QWEN2_GGUF=$TANDEM_CACHE/qwen2.5-coder-0.5b/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
export TANDEM_TEST_GEMMA3_GGUF=$TANDEM_CACHE/gemma3-270m/gemma-3-270m-q4_k_m.gguf
# An HF-style directory converted from the GGUF by an independent Python
# script, for the safetensors loader's tests (cached after the first run).
export TANDEM_TEST_HF_DIR=$TANDEM_CACHE/test-fixtures/smollm2-135m-hf-f32
scripts/make-hf-fixture.sh "$TANDEM_TEST_HF_DIR"

step "downloads started before the build"
TANDEM_TOOLS_BIN=$(joined deploy_tools)
export TANDEM_HELM=$TANDEM_TOOLS_BIN/helm
TANDEM_CLIENTS_PYTHON=$(joined clients)
export TANDEM_CLIENTS_PYTHON
TANDEM_PYDANTIC_AI_PYTHON=$(joined pydantic_ai)
export TANDEM_PYDANTIC_AI_PYTHON
TANDEM_JS_CLIENTS=$(joined js_clients)
export TANDEM_JS_CLIENTS
TANDEM_LLAMA_VOCAB_DIR=$(joined vocab)
export TANDEM_LLAMA_VOCAB_DIR
nvrtc=$(joined nvrtc)
export LD_LIBRARY_PATH=$nvrtc${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
joined nextest >/dev/null
container_state=$(joined container)
if [[ -f $container_state/unavailable ]]; then
  log "the container tests will skip: $(cat "$container_state/unavailable")"
fi

# The chart, values files and Dockerfile: lint and schema checks.
step "deployment files"
scripts/check-deploy.sh

step "doc tests"
cargo test --workspace --release --doc --quiet

# Every test binary, in the order and sharing that .config/nextest.toml
# gives; a test past its slow-timeout is named, then killed, so a hang
# fails the run instead of eating CI's budget.
step "tests"
timeout 2400 cargo nextest run --workspace --release --profile ci
