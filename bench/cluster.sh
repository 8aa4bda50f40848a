#!/usr/bin/env bash
# Disaggregated serving vs one process, in one run on this machine:
#   1. KV handoff latency of a ~1k-token prompt (prefill node -> decode node
#      over UCX): the transfer alone (dkv) and the whole remote prefill,
#      against TTFT of the same prompt on `tandem serve`;
#   2. `tandem bench` against a 1P1D cluster (etcd + prefill + decode +
#      router processes) and against `tandem serve`, same GGUF, same
#      prompts, at each concurrency level: TTFT/TPOT p50/p99, output tok/s.
#   usage: bench/cluster.sh            (bench/dkv.sh runs it after the transfer benchmarks)
# Environment:
#   GGUF=path  CONCURRENCY="8 32"  INPUT_LEN=256 OUTPUT_LEN=64  SEED=0
#   UCX_TLS_BENCH=tcp   the UCX transports of the cluster's KV transfers
#   BENCH_OUT=dir       raw outputs (default: a new /tmp/tandem-cluster-bench.*)
# Threads: the cluster's two nodes get one kernel thread each and
# `tandem serve` gets two, so both use the machine's two cores.
set -euo pipefail

levels=${CONCURRENCY:-8 32}
input_len=${INPUT_LEN:-256}
output_len=${OUTPUT_LEN:-64}
seed=${SEED:-0}
tls=${UCX_TLS_BENCH:-tcp}
repo=$(git -C "$(dirname "${BASH_SOURCE[0]}")" rev-parse --show-toplevel)
out=${BENCH_OUT:-$(mktemp -d /tmp/tandem-cluster-bench.XXXXXX)}
mkdir -p "$out"
threads=2
# shellcheck source=bench/lib.sh
source "$repo/bench/lib.sh"
bench_build_tandem
bench_resolve_gguf
command -v etcd >/dev/null || { echo "etcd not found (apt install etcd-server)" >&2; exit 1; }

trap stop_all EXIT

start_cluster() {
  start_etcd
  local common=(--etcd "$etcd_url" --model "$gguf" --threads 1 --max-batch-size 32 --ucx-tls "$tls")
  start prefill "serving gRPC" "$tandem" prefill "${common[@]}" --id p0
  start decode "serving gRPC" "$tandem" decode "${common[@]}" --id d0 ${decode_extra:-}
  router_port=$(free_port)
  start router "router for" "$tandem" router --etcd "$etcd_url" --model "$gguf" --port "$router_port" \
    --allow-extra-request-fields
  for _ in $(seq 1 100); do
    curl -sf "http://127.0.0.1:$router_port/health" | grep -q '"decode_workers":\["d0"\]' && break
    sleep 0.1
  done
  prefill_metrics=$(port_of prefill "metrics on")
  decode_metrics=$(port_of decode "metrics on")
}

start_serve() {
  serve_port=$(free_port)
  start serve "tandem: serving" "$tandem" serve --model "$gguf" --port "$serve_port" --threads "$threads" \
    --max-batch-size 32 --allow-extra-request-fields
}

# A ~1000-token prompt, distinct per round so no prefix cache helps.
long_prompt() { python3 -c "import sys; print(f'Round {sys.argv[1]}. ' + 'The quick brown fox jumps over the lazy dog near the river bank. ' * 77)" "$1"; }
ttft_ms() { # port prompt -> ms for a max_tokens=1 request
  local body
  body=$(python3 -c 'import json,sys; print(json.dumps({"prompt": sys.argv[1], "max_tokens": 1, "temperature": 0}))' "$2")
  curl -s -o /dev/null -w '%{time_total}' -H 'content-type: application/json' \
    -d "$body" "http://127.0.0.1:$1/v1/completions" | awk '{printf "%.1f", $1 * 1000}'
}
metric_sum() { curl -s "http://127.0.0.1:$1/metrics" | awk -v n="$2" '$1 ~ "^"n"({|$)" {s += $2} END {printf "%.3f", s}'; }

say "handoff latency: ~1k-token prompt, 1P1D over UCX ($tls) vs tandem serve ($threads threads)"
start_cluster
rounds=5
cluster_ttft=(); serve_ttft=()
for r in $(seq 1 $rounds); do cluster_ttft+=("$(ttft_ms "$router_port" "$(long_prompt "c$r")")"); done
xfer_sum=$(metric_sum "$prefill_metrics" tandem_dkv_transfer_latency_milliseconds_sum)
xfer_n=$(metric_sum "$prefill_metrics" tandem_dkv_transfer_latency_milliseconds_count)
bytes=$(metric_sum "$prefill_metrics" tandem_dkv_bytes_transferred_bytes_total)
remote=$(metric_sum "$decode_metrics" tandem_decode_prefills_total)
stop_all
# The same cluster with every prompt prefilled on the decode node: the same
# one-thread compute without the handoff, so the difference is its cost.
decode_extra="--remote-prefill-min-tokens 1000000000"
start_cluster
local_ttft=()
for r in $(seq 1 $rounds); do local_ttft+=("$(ttft_ms "$router_port" "$(long_prompt "l$r")")"); done
stop_all
decode_extra=""
start_serve
for r in $(seq 1 $rounds); do serve_ttft+=("$(ttft_ms "$serve_port" "$(long_prompt "s$r")")"); done
stop_all
python3 - "$out" "$xfer_sum" "$xfer_n" "$bytes" "$remote" "${cluster_ttft[*]}" "${local_ttft[*]}" "${serve_ttft[*]}" <<'PY'
import json, statistics, sys
out, xs, xn, b, remote, ct, lt, st = sys.argv[1:]
med = lambda v: statistics.median(float(x) for x in v.split())
xs, xn, b, remote = float(xs), float(xn), float(b), float(remote)
res = {"handoffs": remote, "mb_per_handoff": b / remote / 1e6 if remote else None,
       "puts_per_handoff": xn / remote if remote else None,
       "put_ms_per_handoff": xs / remote if remote else None,
       "ttft_remote_prefill_ms": med(ct), "ttft_local_prefill_ms": med(lt), "ttft_serve_ms": med(st)}
res["handoff_overhead_ms"] = res["ttft_remote_prefill_ms"] - res["ttft_local_prefill_ms"]
json.dump(res, open(f"{out}/handoff.json", "w"), indent=2)
f = lambda x, d=1: "-" if x is None else f"{x:.{d}f}"
print()
print("# KV handoff, ~1k-token prompt (medians of one-at-a-time max_tokens=1 requests)")
print("| handoffs | MB each | write calls each | ms inside writes each | TTFT remote prefill | TTFT same node, local prefill | handoff overhead | TTFT serve (2 threads) |")
print("|---|---|---|---|---|---|---|---|")
print(f"| {remote:.0f} | {f(res['mb_per_handoff'])} | {f(res['puts_per_handoff'], 0)} | {f(res['put_ms_per_handoff'], 1)} | "
      f"{res['ttft_remote_prefill_ms']:.1f} | {res['ttft_local_prefill_ms']:.1f} | {res['handoff_overhead_ms']:+.1f} ms | {res['ttft_serve_ms']:.1f} |")
print("Writes run layer by layer while later layers compute, so their time mostly overlaps the prefill.")
PY

bench() { # name port concurrency
  local n=$((2 * $3 + 8))
  say "$1 C=$3: $n requests"
  "$tandem" bench --url "http://127.0.0.1:$2" --num-requests "$n" --concurrency "$3" \
    --input-len "$input_len" --output-len "$output_len" --seed "$seed" --ignore-eos --quiet \
    --json "$out/$1.c$3.json" >"$out/$1.c$3.txt"
}
for c in $levels; do
  start_cluster
  bench cluster "$router_port" "$c"
  stop_all
  start_serve
  bench serve "$serve_port" "$c"
  stop_all
done
python3 - "$out" $levels <<'PY'
import json, sys
out, levels = sys.argv[1], sys.argv[2:]
load = lambda n, c: json.load(open(f"{out}/{n}.c{c}.json"))["results"][0]
print()
print("# 1P1D (router + prefill + decode, 1 thread per node) vs tandem serve (2 threads)")
fmt = "| {:>3} | {:<13} | {:>9} | {:>9} | {:>9} | {:>9} | {:>9} | {:>6} |"
print(fmt.format("C", "setup", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "errors"))
print(fmt.format(*["-" * 3, "-" * 13] + ["-" * 9] * 5 + ["-" * 6]))
f = lambda x: "-" if x is None else f"{x:.1f}"
r = lambda a, b: "-" if not a or not b else f"{a / b:.2f}x"
for c in levels:
    a, b = load("cluster", c), load("serve", c)
    for name, x in (("1P1D", a), ("serve", b)):
        print(fmt.format(c, name, f(x["output_throughput"]), f(x["ttft"]["p50_ms"]), f(x["ttft"]["p99_ms"]),
                         f(x["tpot"]["p50_ms"]), f(x["tpot"]["p99_ms"]), x["errors"]))
    print(fmt.format(c, "1P1D/serve", r(a["output_throughput"], b["output_throughput"]),
                     r(a["ttft"]["p50_ms"], b["ttft"]["p50_ms"]), r(a["ttft"]["p99_ms"], b["ttft"]["p99_ms"]),
                     r(a["tpot"]["p50_ms"], b["tpot"]["p50_ms"]), r(a["tpot"]["p99_ms"], b["tpot"]["p99_ms"]), ""))
print()
print(f"raw outputs: {out}")
PY
