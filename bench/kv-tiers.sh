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
# Then across nodes: etcd, two `tandem decode` nodes (no prefill pool, so
# each computes its prompts; 1 thread, the same pool and a host tier
# each) and a router, the same load through the router:
#   fetch     `--routing-policy round-robin` (a session's turns land on
#             either node), prefix fetch on: a turn landing on the node
#             without its session's latest history fetches those blocks
#             from the other over UCX;
#   nofetch   the same with `--no-prefix-fetch`: that turn recomputes;
#   affinity  the default cost policy (turns mostly follow their prefix),
#             prefix fetch on, for comparison.
# reported per cluster: TTFT of turns 2+, prompt tokens computed and cached
# (both nodes), prefix sources the router named, peer-tier hits (blocks
# fetched), fetches by outcome; each node's and the router's /metrics are
# kept in the raw outputs.
#   usage: bench/kv-tiers.sh
# Environment:
#   SESSIONS=24 TURNS=4 INPUT_LEN=96 OUTPUT_LEN=24 CONCURRENCY=4
#   POOL_FRACTION=5   the pool holds 1/POOL_FRACTION of the working set
#   DISK_MAX_GB=1     the disk tier's limit in the disk run
#   TIGHT_GB=0.05     ... and in the tight run
#   PARTS="single cross"   which of the two sections run
#   UCX_TLS_BENCH=tcp      the decode nodes' UCX transports
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

parts=${PARTS:-single cross}
tls=${UCX_TLS_BENCH:-tcp}
trap stop_all EXIT
metric() { # metric PORT NAME [LABELS]: sum of the samples of NAME matching LABELS
  curl -sf "http://127.0.0.1:$1/metrics" | awk -v n="$2" -v l="${3:-}" \
    '$1 ~ "^"n"(\\{|$)" && index($1, l) { s += $NF } END { printf "%.0f\n", s + 0 }'
}
metrics() { # metrics "PORT..." NAME [LABELS]: metric summed over several nodes
  local port total=0
  for port in $1; do total=$((total + $(metric "$port" "$2" "${3:-}"))); done
  echo "$total"
}
load() { # load NAME PORT: the multi-turn load against the OpenAI server on PORT
  "$tandem" bench --url "http://127.0.0.1:$2" --multi-turn-sessions "$sessions" \
    --turns "$turns" --input-len "$input" --output-len "$output" --ignore-eos \
    --concurrency "$conc" --seed 7 --json "$out/bench-$1.json" --quiet > "$out/bench-$1.txt"
}
later_ttft() { # later_ttft NAME: mean and p50 TTFT (ms) of turns 2+ of NAME's load
  python3 - "$out/bench-$1.json" <<'PY'
import json, sys
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
mt = find(json.load(open(sys.argv[1])))
later = [t for t in mt["per_turn"] if t["turn"] > 1]
n = sum(t["completed"] for t in later)
mean = sum(t["ttft"]["mean_ms"] * t["completed"] for t in later) / n
p50 = sorted(t["ttft"]["p50_ms"] for t in later)[len(later) // 2]
print(f"{mean:.1f} {p50:.1f}")
PY
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
  local sampler
  ( while kill -0 "$pid" 2>/dev/null; do rss_tree "$pid"; sleep 0.5; done ) > "$out/rss-$name.txt" &
  sampler=$!
  load "$name" "$port"
  local computed cached host_hits disk_hits lost disk_bytes=- rss_peak
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
  printf '%-5s %11s %10s %10s %9s %9s %9s %6s %9s %12s\n' "$name" $(later_ttft "$name") \
    "$computed" "$cached" "$host_hits" "$disk_hits" "$lost" "$((rss_peak / 1024))" "$disk_bytes" \
    >> "$out/rows.txt"
}

single() {
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
}

cluster_run() { # cluster_run NAME "ROUTER FLAGS" "DECODE FLAGS"
  local name=$1 router_flags=$2 decode_flags=$3 id ports=""
  start_etcd
  for id in d0 d1; do
    # shellcheck disable=SC2086 # the flags are words
    start "$id-$name" "serving gRPC" "$tandem" decode --etcd "$etcd_url" --model "$gguf" --id "$id" \
      --threads 1 --ucx-tls "$tls" --max-length "$max_length" --kv-cache-blocks "$pool" \
      --max-batch-size "$conc" --kv-connector-config '{"host_kvcache_swap_space_gb": 2}' $decode_flags
    ports+=" $(port_of "$id-$name" "metrics on")"
  done
  local port; port=$(free_port)
  # shellcheck disable=SC2086
  start "router-$name" "router for" "$tandem" router --etcd "$etcd_url" --model "$gguf" \
    --port "$port" $router_flags
  wait_http "http://127.0.0.1:$port/health" '"decode_workers":\["d0","d1"\]'
  load "$name" "$port"
  for id in d0 d1 router; do
    curl -sf "http://127.0.0.1:$(port_of "$id-$name" "metrics on" || echo "$port")/metrics" \
      > "$out/metrics-$id-$name.txt" || true
  done
  printf '%-8s %11s %10s %10s %9s %7s %9s %8s %9s %7s\n' "$name" $(later_ttft "$name") \
    "$(metrics "$ports" tandem_prefix_cache_misses_total)" \
    "$(metrics "$ports" tandem_prefix_cache_hits_total)" \
    "$(metric "$port" tandem_router_prefix_sources_total)" \
    "$(metrics "$ports" tandem_kv_tier_hits_total 'tier="peer"')" \
    "$(metrics "$ports" tandem_decode_prefix_fetches_total 'outcome="fetched"')" \
    "$(metrics "$ports" tandem_decode_prefix_fetches_total 'outcome="not_worth"')" \
    "$(metrics "$ports" tandem_decode_prefix_fetches_total 'outcome="failed"')" \
    >> "$out/cross.txt"
  stop_all
}

cross() {
  command -v etcd >/dev/null || { echo "etcd not found (apt install etcd-server)" >&2; exit 1; }
  : > "$out/cross.txt"
  cluster_run fetch "--routing-policy round-robin" ""
  cluster_run nofetch "--routing-policy round-robin" "--no-prefix-fetch"
  cluster_run affinity "" ""
  echo "two decode nodes (1 thread, pool $pool blocks and a 2 GB host tier each, UCX $tls) behind a router; the same load"
  printf '%-8s %11s %10s %10s %9s %7s %9s %8s %9s %7s\n' cluster "TTFT2+ ms" "p50 ms" computed cached \
    named "peer hit" fetched "not worth" failed
  cat "$out/cross.txt"
}

for part in $parts; do
  case $part in
    single) single ;;
    cross) cross ;;
    *) echo "unknown part '$part' (single, cross)" >&2; exit 2 ;;
  esac
done
echo "raw outputs: $out"
