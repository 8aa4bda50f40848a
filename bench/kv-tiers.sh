#!/usr/bin/env bash
# KV tiers (`--kv-connector-config`) on a multi-turn workload whose working
# set is five times the KV pool, in one run, three servers on the same GGUF:
#   none   the pool alone (evicted prefixes are recomputed);
#   host   a host tier holding the whole working set;
#   disk   a small host tier over a disk tier holding the working set (files
#          under a fresh directory in /var/tmp), so most prefixes come back
#          from disk;
#   tight  the same with a disk limit far below the working set: the limit
#          kept under load (its directory's size is printed against it).
# The same `tandem bench --multi-turn-sessions` load against each; reported
# per server: mean and p50 TTFT of turns 2+, prompt tokens computed (the
# prefix-cache misses: what the tiers did not bring back), tokens cached,
# tier hits, peak RSS, and for the disk run the directory's size against
# its limit (the limits under load: RSS growth over the pool-only server and
# bytes on disk).
#   usage: bench/kv-tiers.sh
# Environment:
#   SESSIONS=24 TURNS=4 INPUT_LEN=96 OUTPUT_LEN=24 CONCURRENCY=4
#   POOL_FRACTION=5   the pool holds 1/POOL_FRACTION of the working set
#   DISK_MAX_GB=1     the disk tier's limit in the disk run
#   TIGHT_GB=0.05     ... and in the tight run
#   MODEL / GGUF      as bench/lib.sh (default SmolLM2-135M)
#   BENCH_OUT=dir     raw outputs (default: a new /tmp/tandem-kv-tiers.*)
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
threads=${THREADS:-}
out=${BENCH_OUT:-$(mktemp -d /tmp/tandem-kv-tiers.XXXXXX)}
mkdir -p "$out"
source "$repo/bench/lib.sh"
bench_build_tandem
bench_resolve_gguf

sessions=${SESSIONS:-24}
turns=${TURNS:-4}
input=${INPUT_LEN:-96}
output=${OUTPUT_LEN:-24}
conc=${CONCURRENCY:-4}
fraction=${POOL_FRACTION:-5}
disk_max=${DISK_MAX_GB:-1}
tight=${TIGHT_GB:-0.05}
block=16

# A session's last turn carries every earlier turn (about 1.3 tokens per
# random word with the chat template's tokens) plus its answers.
per_session=$(( turns * (input * 13 / 10 + output + 16) ))
working_blocks=$(( sessions * per_session / block ))
max_length=$(( (per_session + 128 + block - 1) / block * block ))
pool=$(( working_blocks / fraction ))
(( pool >= max_length / block + 1 )) || pool=$(( max_length / block + 1 ))
say "working set ~$working_blocks blocks of $block tokens; pool $pool blocks; max length $max_length"

trap stop_all EXIT
metric() { # metric PORT NAME [LABELS]: sum of the samples of NAME matching LABELS
  curl -sf "http://127.0.0.1:$1/metrics" | awk -v n="$2" -v l="${3:-}" \
    '$1 ~ "^"n"(\\{|$)" && index($1, l) { s += $NF } END { printf "%.0f\n", s + 0 }'
}

run() { # run NAME [serve flags...]
  local name=$1; shift
  local port; port=$(free_port)
  local args=(serve --model "$gguf" --host 127.0.0.1 --port "$port"
    --max-length "$max_length" --kv-cache-blocks "$pool" --max-batch-size "$conc")
  [[ -n $threads ]] && args+=(--threads "$threads")
  start_bg "serve-$name" "$tandem" "${args[@]}" "$@"
  local pid=${pids[-1]}
  wait_http "http://127.0.0.1:$port/health"
  local rss_peak=0 sampler
  ( while kill -0 "$pid" 2>/dev/null; do rss_tree "$pid"; sleep 0.5; done ) > "$out/rss-$name.txt" &
  sampler=$!
  "$tandem" bench --url "http://127.0.0.1:$port" --multi-turn-sessions "$sessions" \
    --turns "$turns" --input-len "$input" --output-len "$output" --ignore-eos \
    --concurrency "$conc" --seed 7 --json "$out/bench-$name.json" --quiet > "$out/bench-$name.txt"
  local computed cached host_hits disk_hits lost disk_bytes=-
  computed=$(metric "$port" tandem_prefix_cache_misses_total)
  cached=$(metric "$port" tandem_prefix_cache_hits_total)
  host_hits=$(metric "$port" tandem_kv_tier_hits_total 'tier="host"')
  disk_hits=$(metric "$port" tandem_kv_tier_hits_total 'tier="disk"')
  lost=$(metric "$port" tandem_kv_tier_errors_total)
  if [[ $name == disk || $name == tight ]]; then
    disk_bytes=$(du -sb "$disk_dir" | cut -f1)
  fi
  stop_pids "$pid"
  kill "$sampler" 2>/dev/null || true; wait "$sampler" 2>/dev/null || true
  rss_peak=$(sort -n "$out/rss-$name.txt" | tail -n1)
  python3 - "$out/bench-$name.json" "$name" "$computed" "$cached" "$host_hits" "$disk_hits" \
    "$rss_peak" "$disk_bytes" "$lost" >> "$out/rows.txt" <<'PY'
import json, sys
path, name, computed, cached, host, disk, rss, disk_bytes, lost = sys.argv[1:]
def find(v):
    if isinstance(v, dict):
        if v.get("multi_turn"):
            return v["multi_turn"]
        v = list(v.values())
    if isinstance(v, list):
        for x in v:
            if (m := find(x)) is not None:
                return m
    return None
mt = find(json.load(open(path)))
later = [t for t in mt["per_turn"] if t["turn"] > 1]
n = sum(t["completed"] for t in later)
mean = sum(t["ttft"]["mean_ms"] * t["completed"] for t in later) / n
p50 = sorted(t["ttft"]["p50_ms"] for t in later)[len(later) // 2]
print(f"{name:<5} {mean:>11.1f} {p50:>10.1f} {int(computed):>10} {int(cached):>9} "
      f"{int(host):>9} {int(disk):>9} {int(lost):>6} {int(rss) / 1024:>9.0f} {disk_bytes:>12}")
PY
}

: > "$out/rows.txt"
run none
run host --kv-connector-config '{"host_kvcache_swap_space_gb": 2}'
disk_dir=$(mktemp -d /var/tmp/tandem-kv-tiers.XXXXXX)
trap 'stop_all; rm -rf "$disk_dir"' EXIT
disk_config() { # disk_config GB
  echo "{\"host_kvcache_swap_space_gb\": 0.01, \"disk_offload_dir\": \"$disk_dir\", \"disk_offload_max_gb\": $1}"
}
run disk --kv-connector-config "$(disk_config "$disk_max")"
rm -rf "${disk_dir:?}"/*
run tight --kv-connector-config "$(disk_config "$tight")"

echo "model $(basename "$gguf"); $sessions sessions x $turns turns, $input words in and $output tokens out per turn, c=$conc"
echo "pool $pool blocks of $block tokens = 1/$fraction of the working set (~$working_blocks blocks); host tier 0.01 GB in the disk runs; disk limit $disk_max GB, tight $tight GB = $(python3 -c "print(int($tight * 2**30))") bytes"
printf '%-5s %11s %10s %10s %9s %9s %9s %6s %9s %12s\n' tiers "TTFT2+ ms" "p50 ms" computed cached \
  "host hit" "disk hit" lost "RSS MiB" "disk bytes"
cat "$out/rows.txt"
echo "raw outputs: $out"
