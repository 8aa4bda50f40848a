#!/usr/bin/env bash
# What a router costs, next to the routers people use, in one run:
#   (a) `tandem router` over mock decode nodes (`--engine mock
#       --mock-time-scale 0`: real gRPC, etcd and KV events, no forward
#       pass), against `tandem serve --engine mock` for the direct path;
#   (b) sgl-model-gateway (`smg`) and sglang-router over the same number of
#       instant mock OpenAI workers (bench/router/mock_openai_worker.py),
#       against one worker for the direct path.
# The same `tandem bench` load (keep-alive, chat, 8-word prompts) at c=1 and
# c=$CONCURRENCY, max_tokens 1 and 64. Reported per router: CPU per request
# (max_tokens 1, from /proc of the router and its children), CPU per
# streamed token ((max_tokens 64 - max_tokens 1) / 63), TTFT p50/p99 added at
# c=1 over the direct path, and peak RSS.
#   usage: bench/router.sh
# Environment:
#   WORKERS=2 CONCURRENCY=32 REQUESTS=2000 REQUESTS_C1=300
#   IO_THREADS=     the router's --io-threads (default: its own default)
#   PEERS="smg sglang-router"   peers to run ("" for none); installed into
#                   $ROUTERBENCH_VENV (default ~/.cache/tandem/routerbench/venv)
#   BENCH_OUT=dir   raw outputs (default: a new /tmp/tandem-router-bench.*)
set -euo pipefail

workers=${WORKERS:-2}
conc=${CONCURRENCY:-32}
n_sat=${REQUESTS:-2000}
n_c1=${REQUESTS_C1:-300}
peers=${PEERS-smg sglang-router}
venv=${ROUTERBENCH_VENV:-$HOME/.cache/tandem/routerbench/venv}
repo=$(git -C "$(dirname "${BASH_SOURCE[0]}")" rev-parse --show-toplevel)
out=${BENCH_OUT:-$(mktemp -d /tmp/tandem-router-bench.XXXXXX)}
mkdir -p "$out"
threads=1
# shellcheck source=bench/lib.sh
source "$repo/bench/lib.sh"
bench_build_tandem
bench_resolve_gguf
command -v etcd >/dev/null || { echo "etcd not found (apt install etcd-server)" >&2; exit 1; }

install_peers() {
  [[ -z $peers ]] && return 0
  if [[ ! -x $venv/bin/smg || ! -x $venv/bin/python ]] ||
    ! "$venv/bin/python" -c 'import sglang_router, aiohttp' 2>/dev/null; then
    say "installing the peer routers into $venv"
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q smg sglang-router aiohttp uvloop >&2
  fi
}
install_peers

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
pids=()
stop_all() {
  for p in "${pids[@]}"; do pkill -P "$p" 2>/dev/null || true; kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  pids=()
}
trap 'stop_all; rm -rf "$out/etcd-data"' EXIT
start() { # name marker cmd...
  local name=$1 marker=$2; shift 2
  "$@" >"$out/$name.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 1 300); do
    grep -q "$marker" "$out/$name.log" && return 0
    kill -0 "${pids[-1]}" 2>/dev/null || { echo "$name died:" >&2; tail -n 20 "$out/$name.log" >&2; exit 1; }
    sleep 0.2
  done
  echo "$name not ready" >&2; exit 1
}
wait_http() { # url
  for _ in $(seq 1 150); do curl -sf "$1" >/dev/null 2>&1 && return 0; sleep 0.2; done
  echo "no answer from $1" >&2; exit 1
}
# CPU seconds of a process and all its descendants.
cpu_tree() {
  local total=0 p
  for p in $1 $(pgrep -P "$1" 2>/dev/null || true); do
    [[ -r /proc/$p/stat ]] || continue
    total=$(awk -v t="$total" -v hz="$(getconf CLK_TCK)" '{ sub(/^.*\) /, ""); print t + ($12 + $13) / hz }' "/proc/$p/stat")
  done
  echo "$total"
}
rss_tree() { # KiB
  local total=0 p
  for p in $1 $(pgrep -P "$1" 2>/dev/null || true); do
    total=$((total + $(awk '/VmRSS/ {print $2}' "/proc/$p/status" 2>/dev/null || echo 0)))
  done
  echo "$total"
}

# The mock engine's profile: only its shape matters at time scale 0.
profile=$out/profile.json
cat >"$profile" <<'JSON'
{"version": 1, "model": "instant", "isa": "none", "threads": 1, "tp": 1,
 "prefill": [{"tokens": 1, "seconds": 1e-6}],
 "decode": [{"batch": 1, "context": 1, "seconds": 1e-6}]}
JSON
mock=(--engine mock --engine-profile "$profile" --mock-time-scale 0)
results=$out/results.jsonl
: >"$results"

# Runs the load against $2 (model $3), charging CPU to pid $4; appends one
# JSON line per point.
measure() { # label url model pid
  local label=$1 url=$2 model=$3 pid=$4 ol c n c0 c1
  for point in "1 1 $n_c1" "64 1 $n_c1" "1 $conc $n_sat" "64 $conc $n_sat"; do
    read -r ol c n <<<"$point"
    # A short warm-up of the same shape, not measured.
    "$tandem" bench --url "$url" --model "$model" --endpoint chat --input-len 8 --output-len "$ol" \
      --concurrency "$c" --num-requests $((c * 4)) --keep-alive --quiet >/dev/null 2>&1 || true
    c0=$(cpu_tree "$pid")
    "$tandem" bench --url "$url" --model "$model" --endpoint chat --input-len 8 --output-len "$ol" \
      --concurrency "$c" --num-requests "$n" --keep-alive --quiet --json "$out/$label-$ol-$c.json" >/dev/null
    c1=$(cpu_tree "$pid")
    python3 - "$out/$label-$ol-$c.json" "$label" "$ol" "$c" "$n" "$c0" "$c1" "$(rss_tree "$pid")" >>"$results" <<'PY'
import json, sys
f, label, ol, c, n, c0, c1, rss = sys.argv[1:]
r = json.load(open(f))["results"][0]
print(json.dumps({"label": label, "max_tokens": int(ol), "conc": int(c), "n": r["completed"],
    "errors": r["errors"], "cpu_s": float(c1) - float(c0), "rss_kib": int(rss),
    "rps": r["request_throughput"], "ttft_p50": r["ttft"]["p50_ms"], "ttft_p99": r["ttft"]["p99_ms"]}))
PY
    say "$label max_tokens=$ol c=$c: $(tail -n1 "$results")"
  done
}

# --- (a) tandem -------------------------------------------------------------
ec=$(free_port); ep=$(free_port)
etcd_url=http://127.0.0.1:$ec
start etcd "ready to serve client requests" etcd --data-dir "$out/etcd-data" \
  --listen-client-urls "$etcd_url" --advertise-client-urls "$etcd_url" \
  --listen-peer-urls "http://127.0.0.1:$ep" --initial-advertise-peer-urls "http://127.0.0.1:$ep" \
  --initial-cluster "default=http://127.0.0.1:$ep"
node=(--etcd "$etcd_url" --model "$gguf" --max-length 1024 --kv-cache-blocks 512 --max-batch-size 64 --ucx-tls tcp)
for i in $(seq 0 $((workers - 1))); do
  start "decode$i" "serving gRPC" "$tandem" decode "${node[@]}" "${mock[@]}" --id "d$i"
done
router_port=$(free_port)
start router "router for" "$tandem" router --etcd "$etcd_url" --model "$gguf" --port "$router_port" \
  --max-length 1024 ${IO_THREADS:+--io-threads "$IO_THREADS"}
router_pid=${pids[-1]}
for _ in $(seq 1 100); do
  [[ $(curl -sf "http://127.0.0.1:$router_port/health" | grep -o '"d[0-9]*"' | wc -l) -ge $workers ]] && break
  sleep 0.1
done
served=$(curl -sf "http://127.0.0.1:$router_port/v1/models" | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
measure tandem-router "http://127.0.0.1:$router_port" "$served" "$router_pid"
serve_port=$(free_port)
start serve "tandem: serving" "$tandem" serve --model "$gguf" --port "$serve_port" --max-length 1024 \
  --kv-cache-blocks 512 --max-batch-size 64 "${mock[@]}"
measure tandem-direct "http://127.0.0.1:$serve_port" "$served" "${pids[-1]}"
stop_all

# --- (b) peers --------------------------------------------------------------
worker_urls=()
if [[ -n $peers ]]; then
  for i in $(seq 0 $((workers - 1))); do
    wp=$(free_port)
    "$venv/bin/python" "$repo/bench/router/mock_openai_worker.py" "$wp" mock >"$out/worker$i.log" 2>&1 &
    pids+=($!)
    wait_http "http://127.0.0.1:$wp/health"
    worker_urls+=("http://127.0.0.1:$wp")
  done
  measure peer-direct "${worker_urls[0]}" mock "${pids[0]}"
fi
for peer in $peers; do
  pp=$(free_port); mp=$(free_port)
  case $peer in
    smg) cmd=("$venv/bin/smg" launch) ;;
    sglang-router) cmd=("$venv/bin/python" -m sglang_router.launch_router) ;;
    *) echo "unknown peer $peer" >&2; exit 2 ;;
  esac
  "${cmd[@]}" --host 127.0.0.1 --port "$pp" --worker-urls "${worker_urls[@]}" --policy round_robin \
    --prometheus-host 127.0.0.1 --prometheus-port "$mp" --log-level warn >"$out/$peer.log" 2>&1 &
  pids+=($!)
  peer_pid=${pids[-1]}
  wait_http "http://127.0.0.1:$pp/health"
  sleep 1
  measure "$peer" "http://127.0.0.1:$pp" mock "$peer_pid"
  pkill -P "$peer_pid" 2>/dev/null || true; kill "$peer_pid" 2>/dev/null || true; wait "$peer_pid" 2>/dev/null || true
done

python3 - "$results" "$conc" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
conc = int(sys.argv[2])
def get(label, ol, c):
    return next((r for r in rows if r["label"] == label and r["max_tokens"] == ol and r["conc"] == c), None)
print(f"\nRouter cost (CPU from /proc of the router process tree; c={conc} for CPU; added TTFT at c=1 over the direct path)")
print(f"{'router':<15} {'us CPU/req':>11} {'us CPU/token':>13} {'us/req c=1':>11} {'+TTFT p50 ms':>13} {'+TTFT p99 ms':>13} {'RSS MB':>7} {'req/s':>7} {'errors':>6}")
for label, direct in [("tandem-router", "tandem-direct"), ("smg", "peer-direct"), ("sglang-router", "peer-direct")]:
    a, b = get(label, 1, conc), get(label, 64, conc)
    a1, b1, d1 = get(label, 1, 1), get(label, 64, 1), get(direct, 1, 1)
    if not (a and b and a1 and d1):
        continue
    per_req = 1e6 * a["cpu_s"] / a["n"]
    per_tok = 1e6 * (b["cpu_s"] / b["n"] - a["cpu_s"] / a["n"]) / 63
    per_req1 = 1e6 * a1["cpu_s"] / a1["n"]
    rss = max(r["rss_kib"] for r in rows if r["label"] == label) / 1024
    errs = sum(r["errors"] for r in rows if r["label"] == label)
    print(f"{label:<15} {per_req:>11.0f} {per_tok:>13.1f} {per_req1:>11.0f} {a1['ttft_p50'] - d1['ttft_p50']:>13.3f} {a1['ttft_p99'] - d1['ttft_p99']:>13.3f} {rss:>7.0f} {a['rps']:>7.0f} {errs:>6}")
print("targets (issue 17): <= 100 us/req, <= 5 us/token, +0.2 ms p50 and +1 ms p99 TTFT at c=1, RSS <= 50 MB")
PY
say "raw results: $results"
