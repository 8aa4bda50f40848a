#!/usr/bin/env bash
# One router over many mock nodes: 10, 50 and 100 decode nodes (and a fifth
# as many prefill nodes), each a real `tandem decode|prefill --engine mock`
# process (gRPC, etcd lease, KV events, UCX handoffs of real bytes; steps
# timed from a bench-engine profile). Poisson load with shared prefixes, so
# KV events flow and prefix routing has work. Reported per size, from the
# router's /metrics and /proc: routing decision time p99 (hashing + index
# lookup + choice), KV event lag p99 (worker emit -> router applied), prefix
# index blocks and bytes, router RSS and CPU, TTFT p50/p99.
#   usage: bench/router-scale.sh
# Environment:
#   SIZES="10 50 100"  RATE=30 (requests/s)  REQUESTS=600  INPUT_LEN=200
#   OUTPUT_LEN=16  PROFILE=file (default: measured now with bench-engine)
#   TIME_SCALE=0.1  the nodes' --mock-time-scale (0.1: ten times this
#                   machine's single-thread speed, so 20 prefill nodes are
#                   not what limits the load)
#   BENCH_OUT=dir
set -euo pipefail

sizes=${SIZES:-10 50 100}
rate=${RATE:-30}
requests=${REQUESTS:-600}
input_len=${INPUT_LEN:-200}
output_len=${OUTPUT_LEN:-16}
time_scale=${TIME_SCALE:-0.1}
repo=$(git -C "$(dirname "${BASH_SOURCE[0]}")" rev-parse --show-toplevel)
out=${BENCH_OUT:-$(mktemp -d /tmp/tandem-router-scale.XXXXXX)}
mkdir -p "$out"
threads=1
# shellcheck source=bench/lib.sh
source "$repo/bench/lib.sh"
bench_build_tandem
bench_resolve_gguf
command -v etcd >/dev/null || { echo "etcd not found (apt install etcd-server)" >&2; exit 1; }

profile=${PROFILE:-$out/profile.json}
if [[ ! -f $profile ]]; then
  say "measuring the engine profile (one kernel thread: the nodes share the machine)"
  "$tandem" bench-engine --model "$gguf" --threads 1 --pp 0 --tg 0 --batch "" --reps 2 \
    --profile "$profile" >"$out/profile.log" 2>&1
fi

trap stop_all EXIT

results=$out/results.jsonl
: >"$results"
for n in $sizes; do
  np=$(((n + 4) / 5))
  say "$n decode + $np prefill mock nodes"
  start_etcd
  node=(--etcd "$etcd_url" --model "$gguf" --engine mock --engine-profile "$profile" --mock-time-scale "$time_scale"
    --kv-cache-blocks 64 --max-length 1024 --max-batch-size 16 --ucx-tls tcp --threads 1)
  logs=()
  # All nodes start at once, then each is waited for.
  for i in $(seq 0 $((np - 1))); do
    start_bg "p$i" "$tandem" prefill "${node[@]}" --id "p$i"
    logs+=("p$i:${pids[-1]}")
  done
  for i in $(seq 0 $((n - 1))); do
    start_bg "d$i" "$tandem" decode "${node[@]}" --id "d$i"
    logs+=("d$i:${pids[-1]}")
  done
  for l in "${logs[@]}"; do wait_log "${l%:*}" "serving gRPC" "${l##*:}"; done
  router_port=$(free_port)
  start "router-$n" "router for" "$tandem" router --etcd "$etcd_url" --model "$gguf" --port "$router_port" \
    --max-length 1024
  router_pid=${pids[-1]}
  for _ in $(seq 1 200); do
    h=$(curl -sf "http://127.0.0.1:$router_port/health" || true)
    [[ $(grep -o '"d[0-9]*"' <<<"$h" | wc -l) -eq $n && $(grep -o '"p[0-9]*"' <<<"$h" | wc -l) -eq $np ]] && break
    sleep 0.2
  done
  rss0=$(rss_tree "$router_pid")
  c0=$(cpu_tree "$router_pid")
  "$tandem" bench --url "http://127.0.0.1:$router_port" --endpoint completions --keep-alive --quiet \
    --request-rate "$rate" --num-requests "$requests" --input-len "$input_len" --output-len "$output_len" \
    --shared-prefix-groups 8 --shared-prefix-len 128 --json "$out/bench-$n.json" >"$out/bench-$n.log" 2>&1
  c1=$(cpu_tree "$router_pid")
  rss1=$(rss_tree "$router_pid")
  curl -sf "http://127.0.0.1:$router_port/metrics" >"$out/metrics-$n.txt"
  python3 - "$out/metrics-$n.txt" "$out/bench-$n.json" "$n" "$np" "$rss0" "$rss1" "$c0" "$c1" >>"$results" <<'PY'
import json, re, sys
metrics, bench, n, np_, rss0, rss1, c0, c1 = sys.argv[1:]
text = open(metrics).read()
def hist(prefix):
    # Cumulative buckets summed over label sets -> p50/p99 (upper bounds).
    b = {}
    for m in re.finditer(rf'^{prefix}\w*_bucket\{{(.*?)\}} ([0-9.e+]+)$', text, re.M):
        le = re.search(r'le="([^"]+)"', m.group(1)).group(1)
        b[float("inf") if le == "+Inf" else float(le)] = b.get(float("inf") if le == "+Inf" else float(le), 0) + float(m.group(2))
    if not b: return None, None, 0
    ks = sorted(b); total = b[ks[-1]]
    q = lambda p: next((k for k in ks if b[k] >= p * total), ks[-1]) if total else None
    return q(0.5), q(0.99), total
def gauge(name):
    m = re.search(rf'^{name}\w*(?:\{{[^}}]*\}})? ([0-9.e+-]+)$', text, re.M)
    return float(m.group(1)) if m else None
r = json.load(open(bench))["results"][0]
sched = hist("tandem_router_scheduling_time")
lag = hist("tandem_router_event_lag")
print(json.dumps({"decode": int(n), "prefill": int(np_), "completed": r["completed"], "errors": r["errors"],
    "sched_p50_us": sched[0], "sched_p99_us": sched[1], "decisions": sched[2],
    "lag_p50_ms": lag[0], "lag_p99_ms": lag[1], "events": lag[2],
    "index_blocks": gauge("tandem_router_prefix_index_blocks"), "index_bytes": gauge("tandem_router_prefix_index_bytes"),
    "rss_idle_mb": int(rss0) / 1024, "rss_mb": int(rss1) / 1024,
    "router_cpu_us_per_req": 1e6 * (float(c1) - float(c0)) / max(1, r["completed"]),
    "ttft_p50_ms": r["ttft"]["p50_ms"], "ttft_p99_ms": r["ttft"]["p99_ms"]}))
PY
  say "$(tail -n1 "$results")"
  stop_all
done

python3 - "$results" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print("\nOne router over N mock decode + N/5 mock prefill nodes (processes), Poisson load, shared prefixes")
print(f"{'nodes':>9} {'done':>5} {'err':>4} {'route p50/p99 us':>17} {'event lag p50/p99 ms':>21} {'index blocks':>12} {'index KiB':>9} {'RSS MB':>7} {'CPU us/req':>10} {'TTFT p50/p99 ms':>16}")
for r in rows:
    f = lambda v: "-" if v is None else (f"{v:g}")
    print(f"{str(r['decode'])+'D+'+str(r['prefill'])+'P':>9} {r['completed']:>5} {r['errors']:>4} {f(r['sched_p50_us'])+'/'+f(r['sched_p99_us']):>17} "
          f"{f(r['lag_p50_ms'])+'/'+f(r['lag_p99_ms']):>21} {f(r['index_blocks']):>12} {(r['index_bytes'] or 0)/1024:>9.0f} "
          f"{r['rss_mb']:>7.0f} {r['router_cpu_us_per_req']:>10.0f} {r['ttft_p50_ms']:>7.1f}/{r['ttft_p99_ms']:<8.1f}")
print("route: the router's tandem.router.scheduling_time histogram (bucket upper bounds); event lag: tandem.router.event_lag")
PY
