#!/usr/bin/env bash
# Makes sure cargo-nextest (the test runner of scripts/test.sh) is
# installed: these machines usually have it; otherwise it is built from
# crates.io at a pinned version (a few minutes, once). Prints its version.
set -euo pipefail

version=0.9.143
if ! cargo nextest --version >/dev/null 2>&1; then
  # Its own build, not the workspace's lint flags or target directory.
  env -u RUSTC_WORKSPACE_WRAPPER -u RUSTFLAGS -u CARGO_TARGET_DIR \
    cargo install --locked --quiet cargo-nextest --version "$version" >&2
fi
cargo nextest --version | head -n 1
