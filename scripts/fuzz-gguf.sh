#!/usr/bin/env bash
# Fuzzes the GGUF reader: scripts/fuzz.sh gguf_reader [SECONDS].
exec "$(dirname "$0")/fuzz.sh" gguf_reader "${1:-60}"
