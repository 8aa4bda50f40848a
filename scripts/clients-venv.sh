#!/usr/bin/env bash
# Installs the pinned client libraries of a requirements file (default
# tests/clients/requirements.txt) into a venv (default
# $TANDEM_CACHE/clients-venv) unless it already holds exactly these pins;
# prints the venv's python. Re-running it needs no network.
#   scripts/clients-venv.sh [VENV_DIR [REQUIREMENTS]]
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh

venv=${1:-${TANDEM_CACHE:-$HOME/.cache/tandem}/clients-venv}
req=${2:-tests/clients/requirements.txt}
stamp=$venv/.requirements.sha256
want=$(sha256sum "$req" | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] || [ ! -x "$venv/bin/python" ]; then
  log "installing the client libraries into $venv" >&2
  rm -rf "$venv"
  if ! python3 -m venv "$venv" >/dev/null 2>&1; then
    # Debian's python3 creates venvs only with python3-venv (ensurepip).
    rm -rf "$venv"
    ensure_packages python3-venv
    python3 -m venv "$venv"
  fi
  "$venv/bin/python" -m pip install -q --disable-pip-version-check -r "$req" >&2
  echo "$want" >"$stamp"
fi
echo "$venv/bin/python"
