#!/usr/bin/env bash
# Fuzzes the GGUF reader (tandem_engine::gguf) with cargo-fuzz / libFuzzer.
#
# Usage: scripts/fuzz-gguf.sh [SECONDS]        (default 60)
#
# Needs cargo-fuzz (`cargo install cargo-fuzz`).  cargo-fuzz passes nightly
# flags (-Zsanitizer=address); RUSTC_BOOTSTRAP=1 lets a stable toolchain
# accept them.  The corpus lives in fuzz/corpus/gguf_reader (git-ignored) and
# is seeded from fuzz/seeds/; crashes land in fuzz/artifacts/gguf_reader.
set -euo pipefail

secs="${1:-60}"
case "$secs" in
'' | *[!0-9]*)
    echo "usage: $0 [SECONDS]" >&2
    exit 2
    ;;
esac

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root/fuzz"

if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "cargo-fuzz is not installed: run 'cargo install cargo-fuzz'" >&2
    exit 1
fi

corpus=corpus/gguf_reader
mkdir -p "$corpus"
cp -n seeds/*.gguf "$corpus"/

export RUSTC_BOOTSTRAP=1
cargo fuzz build gguf_reader
exec cargo fuzz run gguf_reader "$corpus" -- \
    -max_total_time="$secs" \
    -max_len=65536 \
    -rss_limit_mb=2048 \
    -timeout=10 \
    -print_final_stats=1
