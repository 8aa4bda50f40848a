#!/usr/bin/env bash
# What a router costs, next to the routers people use, in one run:
#   (a) `tandem router` over mock decode nodes (`--engine mock
#       --mock-time-scale 0`: real gRPC, etcd and KV events, no forward
#       pass), against `tandem serve --engine mock` for the direct path;
#   (b) sgl-model-gateway (`smg`) and sglang-router over the same number of
#       instant mock OpenAI workers (bench/router/mock_openai_worker.py),
#       against one worker for the direct path;
#   (c) NVIDIA Dynamo's frontend (`python -m dynamo.frontend`, round-robin,
#       file discovery, TCP request plane) over `python -m dynamo.mocker`
#       with as many workers (--speedup-ratio 10000). It tokenizes and
#       detokenizes like tandem's router (the HF tokenizer of SmolLM2-135M),
#       so it is the closest peer. CPU is charged to the frontend's process
#       tree only: the mocker is the engine, not charged, as the mock decode
#       nodes of (a) are not. Its added TTFT is against the same direct path
#       as (b), one mock OpenAI worker (the mocker serves no HTTP).
#   (d) the same routers over a REAL engine, since mock nodes answer at once
#       and a router's per-token cost over them is spread over bursts of
#       tokens: `tandem router` over one `tandem decode --engine model` on
#       the GGUF, against `tandem serve` on the same GGUF for the direct
#       path; and smg (and sglang-router, when in PEERS) in front of that
#       `tandem serve`, a real OpenAI worker on the same model.
# The same `tandem bench` load (keep-alive, chat, 8-word prompts) at c=1 and
# c=$CONCURRENCY, max_tokens 1 and 64 (fewer requests over the real engine).
# Reported per router, in one table for mock nodes and one for the real
# node: CPU per request (max_tokens 1, from /proc of the router and its
# children), CPU per streamed token ((max_tokens 64 - max_tokens 1) / 63),
# both at c=1 and c=$CONCURRENCY, TTFT p50/p99 added at c=1 over the direct
# path, and peak RSS. CPU is the sum of the threads' run time
# (/proc/PID/task/*/schedstat, nanoseconds) when no thread of the tree
# exited during the point, else utime+stime from /proc/PID/stat (10 ms ticks).
#   usage: bench/router.sh
# Environment:
#   WORKERS=2 CONCURRENCY=32 REQUESTS=2000 REQUESTS_C1=300
#   REAL=1          run (d) (0: mock nodes only)
#   REAL_THREADS=1  the real engine's --threads (decode node and serve alike)
#   REQUESTS_REAL=128 REQUESTS_REAL_C1=16   64-token streams over the real
#                   engine at c=$CONCURRENCY and c=1 (max_tokens 1 at c=1:
#                   REQUESTS_C1; at c=$CONCURRENCY: 2 x REQUESTS_REAL)
#   TTFT_ROUNDS=6   paired rounds for the real node's added TTFT (see (d))
#   ROUTER_BIN=     another tandem binary for the `tandem router` processes
#                   only (an A/B of a router change over the same nodes)
#   IO_THREADS=     the router's --io-threads (default: its own default)
#   PEERS="smg sglang-router dynamo"   peers to run ("" for none); installed
#                   into $ROUTERBENCH_VENV (default ~/.cache/tandem/routerbench/venv)
#   DYNAMO_VERSION=1.6.1   the ai-dynamo release installed when it is missing
#   TANDEM_TEST_HF_DIR=dir the HF model directory (config.json, tokenizer.json,
#                   tokenizer_config.json) Dynamo's frontend and mocker load;
#                   default $TANDEM_CACHE/test-fixtures/smollm2-135m-hf-f32,
#                   made with scripts/make-hf-fixture.sh when missing
#   BENCH_OUT=dir   raw outputs (default: a new /tmp/tandem-router-bench.*)
set -euo pipefail

workers=${WORKERS:-2}
conc=${CONCURRENCY:-32}
n_sat=${REQUESTS:-2000}
n_c1=${REQUESTS_C1:-300}
peers=${PEERS-smg sglang-router dynamo}
real=${REAL:-1}
real_threads=${REAL_THREADS:-1}
n_real=${REQUESTS_REAL:-128}
n_real_c1=${REQUESTS_REAL_C1:-16}
dynamo_version=${DYNAMO_VERSION:-1.6.1}
venv=${ROUTERBENCH_VENV:-$HOME/.cache/tandem/routerbench/venv}
repo=$(git -C "$(dirname "${BASH_SOURCE[0]}")" rev-parse --show-toplevel)
out=${BENCH_OUT:-$(mktemp -d /tmp/tandem-router-bench.XXXXXX)}
mkdir -p "$out"
threads=1
# shellcheck source=bench/lib.sh
source "$repo/bench/lib.sh"
bench_build_tandem
bench_resolve_gguf
router_bin=${ROUTER_BIN:-$tandem}
command -v etcd >/dev/null || { echo "etcd not found (apt install etcd-server)" >&2; exit 1; }

has_peer() { [[ " $peers " == *" $1 "* ]]; }
install_peers() {
  [[ -z $peers ]] && return 0
  local py=$venv/bin/python pip=$venv/bin/pip
  [[ -x $py ]] || { say "creating $venv"; python3 -m venv "$venv"; }
  if { has_peer smg || has_peer sglang-router; } &&
    { [[ ! -x $venv/bin/smg ]] || ! "$py" -c 'import sglang_router' 2>/dev/null; }; then
    say "installing smg and sglang-router into $venv"
    "$pip" install -q smg sglang-router aiohttp uvloop >&2
  fi
  if has_peer dynamo && ! "$py" -c 'import dynamo.frontend, dynamo.mocker' 2>/dev/null; then
    # ai-dynamo declares a dependency no public index serves (aisimulate):
    # the two wheels go in without their dependencies, then what the
    # frontend and the mocker import, within the ranges the wheels declare.
    say "installing NVIDIA Dynamo $dynamo_version into $venv"
    rm -rf "$out/dynamo-wheels"
    "$pip" download -q --no-deps -d "$out/dynamo-wheels" \
      "ai-dynamo==$dynamo_version" "ai-dynamo-runtime==$dynamo_version" >&2
    "$pip" install -q --no-deps "$out/dynamo-wheels"/*.whl >&2
    "$pip" install -q 'pydantic>=2.10.6,<=2.13.5' uvloop aiohttp certifi 'kubernetes>=32.0.1,<33' msgspec \
      prometheus-client pyzmq redis tqdm transformers zstandard tokenizers >&2
  fi
  # The mock OpenAI workers, every peer's direct path.
  "$py" -c 'import aiohttp' 2>/dev/null || "$pip" install -q aiohttp uvloop >&2
}
install_peers

# Dynamo's frontend and mocker load a HF model directory (tokenizer, chat
# template, config): the SmolLM2-135M fixture the tests use, made from the
# GGUF when missing.
dynamo_model_dir() {
  local cache src
  cache=$(bench_cache_dir)
  hf_dir=${TANDEM_TEST_HF_DIR:-$cache/test-fixtures/smollm2-135m-hf-f32}
  if [[ ! -f $hf_dir/config.json ]]; then
    src=${TANDEM_TEST_GGUF:-$cache/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf}
    if [[ ! -f $src ]]; then
      say "fetching smollm2-135m"
      "$tandem" generate --model smollm2-135m --prompt hi --max-tokens 1 --temperature 0 >/dev/null
    fi
    say "making $hf_dir (scripts/make-hf-fixture.sh)"
    TANDEM_TEST_GGUF=$src "$repo/scripts/make-hf-fixture.sh" "$hf_dir" >&2
  fi
  local f
  for f in config.json tokenizer.json tokenizer_config.json; do
    [[ -f $hf_dir/$f ]] || { echo "no $f in $hf_dir" >&2; exit 1; }
  done
}
if has_peer dynamo; then dynamo_model_dir; fi

trap stop_all EXIT

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

# CPU seconds of PID and its children: the run time of their live threads
# (nanoseconds), and their utime+stime (10 ms ticks, but counting threads
# that have exited), as "SCHED STAT".
cpu_both() {
  local p sched=0
  for p in $1 $(pgrep -P "$1" 2>/dev/null || true); do
    sched=$((sched + $(cat /proc/"$p"/task/*/schedstat 2>/dev/null | awk '{s += $1} END {printf "%.0f", s}')))
  done
  echo "$sched $(cpu_tree "$1")"
}

# The points measured: "max_tokens concurrency requests", and the warm-up's
# requests per unit of concurrency.
points=("1 1 $n_c1" "64 1 $n_c1" "1 $conc $n_sat" "64 $conc $n_sat")
warm=4

# Runs the load at each of $points against $2 (model $3), charging CPU to
# pid $4; appends one JSON line per point.
measure() { # label url model pid
  local label=$1 url=$2 model=$3 pid=$4 ol c n c0 c1 point
  for point in "${points[@]}"; do
    read -r ol c n <<<"$point"
    # A short warm-up of the same shape, not measured.
    "$tandem" bench --url "$url" --model "$model" --endpoint chat --input-len 8 --output-len "$ol" \
      --concurrency "$c" --num-requests $((c * warm)) --keep-alive --quiet >/dev/null 2>&1 || true
    c0=$(cpu_both "$pid")
    "$tandem" bench --url "$url" --model "$model" --endpoint chat --input-len 8 --output-len "$ol" \
      --concurrency "$c" --num-requests "$n" --keep-alive --quiet --json "$out/$label-$ol-$c.json" >/dev/null
    c1=$(cpu_both "$pid")
    python3 - "$out/$label-$ol-$c.json" "$label" "$ol" "$c" "$n" "$c0" "$c1" "$(rss_tree "$pid")" >>"$results" <<'PY'
import json, sys
f, label, ol, c, n, c0, c1, rss = sys.argv[1:]
r = json.load(open(f))["results"][0]
(s0, t0), (s1, t1) = [(int(a) / 1e9, float(b)) for a, b in (c0.split(), c1.split())]
# Thread run times are exact unless a thread exited mid-point (its time
# then leaves the sum): beyond the ticks' rounding, trust the ticks.
cpu = s1 - s0 if abs((s1 - s0) - (t1 - t0)) <= 0.03 else t1 - t0
print(json.dumps({"label": label, "max_tokens": int(ol), "conc": int(c), "n": r["completed"],
    "errors": r["errors"], "cpu_s": cpu, "cpu_ticks_s": t1 - t0, "rss_kib": int(rss),
    "rps": r["request_throughput"], "ttft_p50": r["ttft"]["p50_ms"], "ttft_p99": r["ttft"]["p99_ms"],
    "load1": float(open("/proc/loadavg").read().split()[0])}))
PY
    say "$label max_tokens=$ol c=$c: $(tail -n1 "$results")"
  done
}

# --- (a) tandem -------------------------------------------------------------
start_etcd
node=(--etcd "$etcd_url" --model "$gguf" --max-length 1024 --kv-cache-blocks 512 --max-batch-size 64 --ucx-tls tcp)
for i in $(seq 0 $((workers - 1))); do
  start "decode$i" "serving gRPC" "$tandem" decode "${node[@]}" "${mock[@]}" --id "d$i"
done
router_port=$(free_port)
start router "router for" "$router_bin" router --etcd "$etcd_url" --model "$gguf" --port "$router_port" \
  --max-length 1024 ${IO_THREADS:+--io-threads "$IO_THREADS"}
router_pid=${pids[-1]}
for _ in $(seq 1 100); do
  [[ $(curl -sf "http://127.0.0.1:$router_port/health" | grep -o '"d[0-9]*"' | wc -l) -ge $workers ]] && break
  sleep 0.1
done
served=$(curl -sf "http://127.0.0.1:$router_port/v1/models" | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
measure tandem-router@mock "http://127.0.0.1:$router_port" "$served" "$router_pid"
serve_port=$(free_port)
start serve "tandem: serving" "$tandem" serve --model "$gguf" --port "$serve_port" --max-length 1024 \
  --kv-cache-blocks 512 --max-batch-size 64 "${mock[@]}"
measure tandem-direct@mock "http://127.0.0.1:$serve_port" "$served" "${pids[-1]}"
stop_all

# --- (b) peers --------------------------------------------------------------
worker_urls=()
if [[ -n $peers ]]; then
  for i in $(seq 0 $((workers - 1))); do
    wp=$(free_port)
    start_bg "worker$i" "$venv/bin/python" "$repo/bench/router/mock_openai_worker.py" "$wp" mock
    wait_http "http://127.0.0.1:$wp/health"
    worker_urls+=("http://127.0.0.1:$wp")
  done
  measure peer-direct@mock "${worker_urls[0]}" mock "${pids[0]}"
fi
for peer in $peers; do
  pp=$(free_port)
  engine_pids=()
  case $peer in
    smg | sglang-router)
      if [[ $peer == smg ]]; then cmd=("$venv/bin/smg" launch)
      else cmd=("$venv/bin/python" -m sglang_router.launch_router); fi
      start_bg "$peer" "${cmd[@]}" --host 127.0.0.1 --port "$pp" --worker-urls "${worker_urls[@]}" \
        --policy round_robin --prometheus-host 127.0.0.1 --prometheus-port "$(free_port)" --log-level warn
      peer_pid=${pids[-1]}
      wait_http "http://127.0.0.1:$pp/health" ;;
    dynamo)
      # Everything on loopback, discovery through files, no NATS or etcd.
      # (1.6.1 still logs one INFO request_span line per request.)
      rm -rf "$out/dyn-kv"
      dyn_env=(DYN_DISCOVERY_BACKEND=file DYN_FILE_KV="$out/dyn-kv" DYN_REQUEST_PLANE=tcp
        DYN_TCP_RPC_HOST=127.0.0.1 DYN_TCP_RESPONSE_STREAM_HOST=127.0.0.1 DYN_EVENT_PLANE_HOST=127.0.0.1
        DYN_SYSTEM_HOST=127.0.0.1 DYN_HTTP_HOST=127.0.0.1 DYN_LOG=warn)
      start_bg dynamo env "${dyn_env[@]}" "$venv/bin/python" -m dynamo.frontend --http-host 127.0.0.1 \
        --http-port "$pp" --router-mode round-robin --kv-cache-block-size 16
      peer_pid=${pids[-1]}
      # --speedup-ratio 0 ("infinite") measured ~5 ms per token on 1.6.1.
      start_bg dynamo-mocker env "${dyn_env[@]}" "$venv/bin/python" -m dynamo.mocker --model-path "$hf_dir" \
        --model-name mock --num-workers "$workers" --speedup-ratio 10000 --block-size 16
      engine_pids=("${pids[-1]}")
      wait_http "http://127.0.0.1:$pp/v1/models" '"id":"mock"'
      # The model is listed once its first worker registers: wait for all.
      for _ in $(seq 1 100); do
        [[ $(curl -sf "http://127.0.0.1:$pp/health" | grep -o '"endpoint":"generate"' | wc -l) -ge $workers ]] && break
        sleep 0.1
      done ;;
    *) echo "unknown peer $peer" >&2; exit 2 ;;
  esac
  sleep 1
  measure "$peer@mock" "http://127.0.0.1:$pp" mock "$peer_pid"
  stop_pids "$peer_pid" "${engine_pids[@]}"
done

stop_all

# --- (d) a real engine ------------------------------------------------------
# One decode node on the GGUF (the CPU engine, REAL_THREADS threads) under
# the router; `tandem serve` on the same GGUF and threads as the direct path,
# and as the OpenAI worker smg and sglang-router route to (with
# --allow-extra-request-fields: they add fields of their own to requests).
# Fewer requests: every token is a forward pass.
# Over a real engine TTFT moves by milliseconds with whatever else the
# machine runs, so the added TTFT is paired: $rounds alternating rounds of
# REQUESTS_C1/$rounds requests (c=1, max_tokens 1) through the router and
# straight to the direct path, one JSON line per round; the table takes the
# median of the rounds' differences.
ttft_pairs() { # label url direct_url
  local label=$1 r side u n=$((n_c1 / rounds))
  # Both paths warm first: a cold direct path's first round is ~15 ms slower.
  for u in "$2" "$3"; do
    "$tandem" bench --url "$u" --model "$served" --endpoint chat --input-len 8 --output-len 1 \
      --concurrency 1 --num-requests 20 --keep-alive --quiet >/dev/null 2>&1 || true
  done
  for r in $(seq 1 "$rounds"); do
    for side in router direct; do
      if [[ $side == router ]]; then u=$2; else u=$3; fi
      "$tandem" bench --url "$u" --model "$served" --endpoint chat --input-len 8 --output-len 1 \
        --concurrency 1 --num-requests "$n" --keep-alive --quiet --json "$out/$label-ttft-$side-$r.json" >/dev/null
    done
    python3 - "$out/$label-ttft-router-$r.json" "$out/$label-ttft-direct-$r.json" "$label" "$r" >>"$results" <<'PY'
import json, sys
fr, fd, label, r = sys.argv[1:]
a, d = (json.load(open(f))["results"][0] for f in (fr, fd))
print(json.dumps({"label": label, "pair": int(r), "errors": a["errors"] + d["errors"],
    "ttft_p50": a["ttft"]["p50_ms"], "direct_p50": d["ttft"]["p50_ms"],
    "ttft_p99": a["ttft"]["p99_ms"], "direct_p99": d["ttft"]["p99_ms"]}))
PY
  done
  say "$label added TTFT, paired rounds: $(grep -c "\"$label\", \"pair\"" "$results")"
}

if [[ $real == 1 ]]; then
  points=("1 1 $n_c1" "64 1 $n_real_c1" "1 $conc $((2 * n_real))" "64 $conc $n_real")
  warm=1
  rounds=${TTFT_ROUNDS:-6}
  engine=(--engine model --threads "$real_threads" --max-length 1024 --kv-cache-blocks 512 --max-batch-size 64)
  start_etcd
  start decode-real "serving gRPC" "$tandem" decode --etcd "$etcd_url" --model "$gguf" --ucx-tls tcp \
    "${engine[@]}" --id r0
  router_port=$(free_port)
  start router-real "router for" "$router_bin" router --etcd "$etcd_url" --model "$gguf" --port "$router_port" \
    --max-length 1024 ${IO_THREADS:+--io-threads "$IO_THREADS"}
  router_pid=${pids[-1]}
  wait_http "http://127.0.0.1:$router_port/health" '"r0"'
  serve_port=$(free_port)
  start serve-real "tandem: serving" "$tandem" serve --model "$gguf" --port "$serve_port" \
    --allow-extra-request-fields "${engine[@]}"
  serve_url=http://127.0.0.1:$serve_port
  measure tandem-router@real "http://127.0.0.1:$router_port" "$served" "$router_pid"
  ttft_pairs tandem-router@real "http://127.0.0.1:$router_port" "$serve_url"
  stop_pids "$router_pid"
  for peer in $peers; do
    [[ $peer == smg || $peer == sglang-router ]] || continue
    pp=$(free_port)
    if [[ $peer == smg ]]; then cmd=("$venv/bin/smg" launch)
    else cmd=("$venv/bin/python" -m sglang_router.launch_router); fi
    start_bg "$peer-real" "${cmd[@]}" --host 127.0.0.1 --port "$pp" --worker-urls "$serve_url" \
      --policy round_robin --prometheus-host 127.0.0.1 --prometheus-port "$(free_port)" --log-level warn
    peer_pid=${pids[-1]}
    wait_http "http://127.0.0.1:$pp/health"
    sleep 1
    measure "$peer@real" "http://127.0.0.1:$pp" "$served" "$peer_pid"
    ttft_pairs "$peer@real" "http://127.0.0.1:$pp" "$serve_url"
    stop_pids "$peer_pid"
  done
  stop_all
fi

python3 - "$results" "$conc" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
conc = int(sys.argv[2])
def get(label, ol, c):
    return next((r for r in rows if r["label"] == label and r.get("max_tokens") == ol and r.get("conc") == c), None)
def paired(label, key):
    d = sorted(r[key] - r[key.replace("ttft", "direct")] for r in rows if r["label"] == label and "pair" in r
               and r[key] is not None and r[key.replace("ttft", "direct")] is not None)
    return (d[len(d) // 2] + d[(len(d) - 1) // 2]) / 2 if d else None
def per_req(r):
    return 1e6 * r["cpu_s"] / r["n"]
def per_tok(a, b):
    return (per_req(b) - per_req(a)) / 63 if a and b else float("nan")
def added(a, d, key):
    return a[key] - d[key] if a[key] is not None and d[key] is not None else float("nan")
def table(kind, title, pairs):
    print(f"\n{title}")
    print(f"{'router':<20} {'us CPU/req':>10} {'us CPU/tok':>10} {'us/req c=1':>10} {'us/tok c=1':>10} {'+TTFT p50 ms':>12} {'+TTFT p99 ms':>12} {'RSS MB':>7} {'req/s':>6} {'errors':>6}")
    for name, direct in pairs:
        label, direct = f"{name}@{kind}", f"{direct}@{kind}"
        a, b = get(label, 1, conc), get(label, 64, conc)
        a1, b1, d1 = get(label, 1, 1), get(label, 64, 1), get(direct, 1, 1)
        if not (a and a1):
            continue
        p50, p99 = paired(label, "ttft_p50"), paired(label, "ttft_p99")
        if p50 is None and d1:
            p50, p99 = added(a1, d1, "ttft_p50"), added(a1, d1, "ttft_p99")
        if p50 is None:
            continue
        rss = max(r.get("rss_kib", 0) for r in rows if r["label"] == label) / 1024
        errs = sum(r["errors"] for r in rows if r["label"] == label)
        print(f"{label:<20} {per_req(a):>10.0f} {per_tok(a, b):>10.1f} {per_req(a1):>10.0f} {per_tok(a1, b1):>10.1f} "
              f"{p50:>12.3f} {p99:>12.3f} {rss:>7.0f} {a['rps']:>6.0f} {errs:>6}")
print(f"CPU from /proc of the router's process tree; us CPU/req and us CPU/tok at c={conc}, then at c=1;")
print("+TTFT: added at c=1 over the direct path (real node: the median of paired, alternating rounds).")
table("mock", "MOCK nodes (instant answers; tokens arrive in bursts): direct path tandem serve --engine mock for "
      "tandem-router, one mock OpenAI worker for smg, sglang-router and dynamo",
      [("tandem-router", "tandem-direct"), ("smg", "peer-direct"), ("sglang-router", "peer-direct"),
       ("dynamo", "peer-direct")])
if get("dynamo@mock", 1, conc):
    print("dynamo: the frontend's CPU only (the mocker is its engine); it tokenizes and detokenizes, as tandem's router does")
table("real", "REAL node (the GGUF on the CPU engine; a token per forward pass): tandem-router over one tandem decode, "
      "smg and sglang-router over tandem serve; direct path tandem serve on the same GGUF",
      [("tandem-router", "tandem-direct"), ("smg", "tandem-direct"), ("sglang-router", "tandem-direct")])
loads = [r["load1"] for r in rows if "load1" in r]
if loads:
    print(f"1-minute load average after each point: {min(loads):.2f} to {max(loads):.2f} "
          "(the bench's own processes count; a router's CPU per token rises with the load beside it)")
print("targets (issues 17, 42): <= 100 us/req, <= 5 us/token, +0.2 ms p50 and +1 ms p99 TTFT at c=1, RSS <= 50 MB")
PY
say "raw results: $results"
