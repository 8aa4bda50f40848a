#!/usr/bin/env bash
# Installs the pinned JavaScript clients of tests/clients/js (the Vercel AI
# SDK, from npm: package.json and its package-lock.json) into DIR (default
# $TANDEM_CACHE/js-clients) unless DIR already holds exactly that lock;
# prints DIR/node_modules, for NODE_PATH. Re-running it needs no network.
#   scripts/js-clients.sh [DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh

src=tests/clients/js
dir=${1:-${TANDEM_CACHE:-$HOME/.cache/tandem}/js-clients}
stamp=$dir/.package-lock.sha256
want=$(cat "$src/package.json" "$src/package-lock.json" | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] || [ ! -d "$dir/node_modules" ]; then
  command -v npm >/dev/null || ensure_packages nodejs npm
  log "installing the JavaScript clients into $dir" >&2
  rm -rf "$dir"
  mkdir -p "$dir"
  cp "$src/package.json" "$src/package-lock.json" "$dir/"
  # Exactly the lock's versions and hashes; no install scripts run.
  (cd "$dir" && npm ci --ignore-scripts --no-audit --no-fund --loglevel=error) >&2
  echo "$want" >"$stamp"
fi
echo "$dir/node_modules"
