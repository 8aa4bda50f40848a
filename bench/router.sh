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
# The same `tandem bench` load (keep-alive, chat, 8-word prompts) at c=1 and
# c=$CONCURRENCY, max_tokens 1 and 64. Reported per router: CPU per request
# (max_tokens 1, from /proc of the router and its children), CPU per
# streamed token ((max_tokens 64 - max_tokens 1) / 63), TTFT p50/p99 added at
# c=1 over the direct path, and peak RSS.
#   usage: bench/router.sh
# Environment:
#   WORKERS=2 CONCURRENCY=32 REQUESTS=2000 REQUESTS_C1=300
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
start_etcd
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
    start_bg "worker$i" "$venv/bin/python" "$repo/bench/router/mock_openai_worker.py" "$wp" mock
    wait_http "http://127.0.0.1:$wp/health"
    worker_urls+=("http://127.0.0.1:$wp")
  done
  measure peer-direct "${worker_urls[0]}" mock "${pids[0]}"
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
  measure "$peer" "http://127.0.0.1:$pp" mock "$peer_pid"
  stop_pids "$peer_pid" "${engine_pids[@]}"
done

python3 - "$results" "$conc" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
conc = int(sys.argv[2])
def get(label, ol, c):
    return next((r for r in rows if r["label"] == label and r["max_tokens"] == ol and r["conc"] == c), None)
print(f"\nRouter cost (CPU from /proc of the router process tree; c={conc} for CPU; added TTFT at c=1 over the direct path:")
print("tandem serve --engine mock for tandem-router, one mock OpenAI worker for smg, sglang-router and dynamo)")
print(f"{'router':<15} {'us CPU/req':>11} {'us CPU/token':>13} {'us/req c=1':>11} {'+TTFT p50 ms':>13} {'+TTFT p99 ms':>13} {'RSS MB':>7} {'req/s':>7} {'errors':>6}")
for label, direct in [("tandem-router", "tandem-direct"), ("smg", "peer-direct"), ("sglang-router", "peer-direct"),
                      ("dynamo", "peer-direct")]:
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
if get("dynamo", 1, conc):
    print("dynamo: the frontend's CPU only (the mocker is its engine); it tokenizes and detokenizes, as tandem's router does")
print("targets (issue 17): <= 100 us/req, <= 5 us/token, +0.2 ms p50 and +1 ms p99 TTFT at c=1, RSS <= 50 MB")
PY
say "raw results: $results"
