#!/usr/bin/env bash
# Runs one cargo-fuzz / libFuzzer target, or all of them, for SECONDS each.
#
# Usage: scripts/fuzz.sh [TARGET|all] [SECONDS]      (default: all, 60)
#
# Targets (fuzz/fuzz_targets): gguf_reader, openai_request, proto_messages, dkv_grants,
# dkv_ucx (real UCX in a child process per batch; a dead child is a finding,
# its batch saved in fuzz/artifacts/dkv_ucx/), chat_template (needs TANDEM_TEST_GGUF),
# stop_strings (differential, against the definition), tokenizer (needs
# TANDEM_TEST_GGUF). Needs cargo-fuzz (`cargo install cargo-fuzz`);
# RUSTC_BOOTSTRAP=1 lets a stable toolchain take its nightly flags.
# Corpora live in fuzz/corpus/TARGET (git-ignored), crashes in
# fuzz/artifacts/TARGET; each run ends with libFuzzer's final stats.
set -euo pipefail

target="${1:-all}"
secs="${2:-60}"
case "$secs" in
'' | *[!0-9]*)
    echo "usage: $0 [TARGET|all] [SECONDS]" >&2
    exit 2
    ;;
esac

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root/fuzz"

if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "cargo-fuzz is not installed: run 'cargo install cargo-fuzz'" >&2
    exit 1
fi
export RUSTC_BOOTSTRAP=1
# dkv loads UCX only when a UCX transport starts: in dkv_ucx's children,
# which run it without AddressSanitizer (UCX's memory hooks and ASan's
# interceptors crash each other); its oracle is a child that dies.

if [ "$target" = all ]; then
    targets=$(cargo fuzz list)
else
    targets=$target
fi
cargo fuzz build
for t in $targets; do
    corpus=corpus/$t
    mkdir -p "$corpus"
    if [ "$t" = gguf_reader ]; then
        cp -n seeds/*.gguf "$corpus"/
    fi
    sanitizer=address
    if [ "$t" = dkv_ucx ]; then
        sanitizer=none
    fi
    echo "== $t ($secs s)"
    cargo fuzz run --sanitizer "$sanitizer" "$t" "$corpus" -- \
        -max_total_time="$secs" \
        -max_len=65536 \
        -rss_limit_mb=2048 \
        -timeout=60 \
        -print_final_stats=1
done
