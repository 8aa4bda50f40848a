#!/usr/bin/env bash
# `tandem plan` against measured runs, in one run on this machine: for each
# of three topologies, measure the engine profile the nodes run with
# (`tandem bench-engine --profile`), then drive the topology with `tandem
# bench` (Poisson arrivals, fixed prompt and output lengths), then ask
# `tandem plan --topology` for the same workload, and print predicted next
# to measured TTFT / TPOT p50 and p99 and throughput, with the ratio.
#   usage: bench/plan.sh
# Topologies:
#   agg:1  `tandem serve --threads 2`              profile: 2 threads
#   1p1d   router + prefill + decode, 1 thread each profile: 1 thread
#   agg:2  router + 2 decode nodes prefilling locally, 1 thread each
#   agg:1:tp2  `tandem serve --tp 2 --threads 1` on $TP_MODEL (its heads
#          must split in two: SmolLM2's nine do not), at $TP_RATE req/s;
#          profile: `bench-engine --tp 2 --threads 1`
# A local cluster's nodes share the machine's two cores, one kernel thread
# each, so their profile is measured with one thread. It is measured alone:
# at a moderate rate the two nodes are seldom busy at once (a decode node
# at batch 1-2 is idle most of the time), and a profile measured beside a
# busy twin (PROFILE_PAIRED=1) predicted a 1.8x too slow prefill. Each
# profile is measured just before its topology's load, so both see the same
# background load of this shared machine (its load average is printed).
# Environment:
#   GGUF=path  RATE=1.0  REQUESTS=90  INPUT_LEN=128  OUTPUT_LEN=64  SEED=0
#   TOPOLOGIES="agg:1 1p1d agg:2 agg:1:tp2"  PLAN_FLAGS="..." (extra `tandem plan` flags)
#   TP_MODEL=qwen2.5-coder-0.5b (alias; or TP_GGUF=path)  TP_RATE=0.3  TP_REQUESTS=60
#   PROFILE_PAIRED=1 (cluster profiles measured beside a busy twin)
#   UCX_TLS_BENCH=tcp  BENCH_OUT=dir (default: a new /tmp/tandem-plan-bench.*)
set -euo pipefail

rate=${RATE:-1.0}
requests=${REQUESTS:-90}
input_len=${INPUT_LEN:-128}
output_len=${OUTPUT_LEN:-64}
seed=${SEED:-0}
topologies=${TOPOLOGIES:-agg:1 1p1d agg:2 agg:1:tp2}
tp_rate=${TP_RATE:-0.3}
tp_requests=${TP_REQUESTS:-60}
paired=${PROFILE_PAIRED:-0}
tls=${UCX_TLS_BENCH:-tcp}
repo=$(git -C "$(dirname "${BASH_SOURCE[0]}")" rev-parse --show-toplevel)
out=${BENCH_OUT:-$(mktemp -d /tmp/tandem-plan-bench.XXXXXX)}
mkdir -p "$out"
threads=2
# shellcheck source=bench/lib.sh
source "$repo/bench/lib.sh"
bench_build_tandem
bench_resolve_gguf
command -v etcd >/dev/null || { echo "etcd not found (apt install etcd-server)" >&2; exit 1; }

trap stop_all EXIT

# profile NAME THREADS [PAIRED [MODEL [TP]]]: writes $out/profile-NAME.json.
profile() {
  local name=$1 t=$2 twin=${3:-0} model=${4:-$gguf} tp=${5:-1} args
  args=(bench-engine --model "$model" --threads "$t" --tp "$tp" --pp 0 --tg 0 --batch "" --reps 3)
  say "profile $name: $t thread(s)$( ((twin)) && echo ', measured beside a twin')"
  if ((twin)); then
    "$tandem" "${args[@]}" --seed 99 --profile "$out/profile-$name-twin.json" >"$out/profile-$name-twin.log" 2>&1 &
    local twin_pid=$!
  fi
  "$tandem" "${args[@]}" --profile "$out/profile-$name.json" >"$out/profile-$name.log" 2>&1
  if ((twin)); then wait "$twin_pid"; fi
}

node_common() { echo --etcd "$etcd_url" --model "$gguf" --threads 1 --max-batch-size 32 --ucx-tls "$tls"; }
start_router() { # decode workers expected, as the health JSON lists them
  port=$(free_port)
  start router "router for" "$tandem" router --etcd "$etcd_url" --model "$gguf" --port "$port" \
    --allow-extra-request-fields
  wait_http "http://127.0.0.1:$port/health" "\"decode_workers\":\[$1\]"
}

# up TOPOLOGY: starts it, sets $port, $profile_file, and the load's
# $t_rate and $t_requests.
up() {
  t_rate=$rate t_requests=$requests
  case $1 in
    agg:1)
      profile t2 "$threads"
      profile_file=$out/profile-t2.json
      port=$(free_port)
      start serve "tandem: serving" "$tandem" serve --model "$gguf" --port "$port" --threads "$threads" \
        --max-batch-size 32 --allow-extra-request-fields ;;
    1p1d)
      profile t1 1 "$paired"
      profile_file=$out/profile-t1.json
      start_etcd
      # shellcheck disable=SC2046
      start prefill "serving gRPC" "$tandem" prefill $(node_common) --id p0
      # shellcheck disable=SC2046
      start decode "serving gRPC" "$tandem" decode $(node_common) --id d0
      start_router '"d0"' ;;
    agg:2)
      profile t1 1 "$paired"
      profile_file=$out/profile-t1.json
      start_etcd
      # Decode nodes that prefill every prompt themselves: two aggregated
      # replicas behind the router.
      # shellcheck disable=SC2046
      start decode0 "serving gRPC" "$tandem" decode $(node_common) --id d0 --remote-prefill-min-tokens 1000000000
      # shellcheck disable=SC2046
      start decode1 "serving gRPC" "$tandem" decode $(node_common) --id d1 --remote-prefill-min-tokens 1000000000
      start_router '"d0","d1"' ;;
    agg:1:tp2)
      t_rate=$tp_rate t_requests=$tp_requests
      profile tp2 1 0 "$tp_gguf" 2
      profile_file=$out/profile-tp2.json
      port=$(free_port)
      start serve "tandem: serving" "$tandem" serve --model "$tp_gguf" --port "$port" --tp 2 --threads 1 \
        --max-batch-size 32 --allow-extra-request-fields ;;
    *) echo "unknown topology $1" >&2; exit 2 ;;
  esac
}

if [[ " $topologies " == *" agg:1:tp2 "* ]]; then
  main_gguf=$gguf
  GGUF=${TP_GGUF:-} MODEL=${TP_MODEL:-qwen2.5-coder-0.5b} bench_resolve_gguf
  tp_gguf=$gguf gguf=$main_gguf
fi

for t in $topologies; do
  name=${t//:/}
  up "$t"
  say "$t: $t_requests requests at $t_rate req/s, input $input_len, output $output_len"
  # This machine is shared: the load average says how quiet it was.
  cut -d' ' -f1 /proc/loadavg >"$out/load-$name.txt"
  "$tandem" bench --url "http://127.0.0.1:$port" --endpoint completions --num-requests "$t_requests" \
    --request-rate "$t_rate" --input-len "$input_len" --output-len "$output_len" --seed "$seed" \
    --ignore-eos --quiet --json "$out/measured-$name.json" >"$out/measured-$name.txt"
  # Every process's metrics, for looking into a miss afterwards.
  # (`serve` and the router on their API port, nodes on their own.)
  curl -s "http://127.0.0.1:$port/metrics" >"$out/metrics-$name-front.txt" || true
  for log in prefill decode decode0 decode1; do
    [[ -f $out/$log.log ]] || continue
    mp=$(port_of "$log" "metrics on" || true)
    [[ -n $mp ]] && curl -s "http://127.0.0.1:$mp/metrics" >"$out/metrics-$name-$log.txt" || true
  done
  if [[ $t == 1p1d ]]; then
    # What the KV handoffs cost, from the prefill node's counters.
    grep -E '^tandem_dkv_(bytes|transfer_latency_milliseconds_(sum|count))' "$out/metrics-$name-prefill.txt" \
      >"$out/dkv-metrics.txt" || true
  fi
  cut -d' ' -f1 /proc/loadavg >>"$out/load-$name.txt"
  stop_all
  # The prompt length the server counted (words are about one token each).
  tokens=$(python3 -c 'import json,sys; r=json.load(open(sys.argv[1]))["results"][0]; print(round(r["prompt_tokens"]/max(r["completed"],1)))' \
    "$out/measured-$name.json")
  say "$t: predicting ($tokens prompt tokens)"
  # shellcheck disable=SC2086
  "$tandem" plan --profile "$profile_file" --topology "$t" --rate "$t_rate" --input-len "$tokens" \
    --output-len "$output_len" --requests 2000 --seed "$seed" ${PLAN_FLAGS:-} \
    --json "$out/predicted-$name.json" >"$out/predicted-$name.txt"
  echo "$profile_file" >"$out/profile-of-$name.txt"
done

python3 - "$out" $topologies <<'PY'
import json, sys
out, tops = sys.argv[1], sys.argv[2:]
print()
print("# tandem plan (predicted) vs tandem bench (measured)")
hdr = ("topology", "metric", "predicted", "measured", "pred/meas")
fmt = "| {:<10} | {:<16} | {:>9} | {:>9} | {:>9} |"
print(fmt.format(*hdr))
print(fmt.format(*["-" * 10, "-" * 16, "-" * 9, "-" * 9, "-" * 9]))
within = total = 0
for t in tops:
    n = t.replace(":", "")
    m = json.load(open(f"{out}/measured-{n}.json"))["results"][0]
    p = json.load(open(f"{out}/predicted-{n}.json"))["results"][0]
    rows = [
        ("TTFT p50 ms", p["ttft"]["p50"] * 1e3, m["ttft"]["p50_ms"]),
        ("TTFT p99 ms", p["ttft"]["p99"] * 1e3, m["ttft"]["p99_ms"]),
        ("TPOT p50 ms", p["tpot"]["p50"] * 1e3, m["tpot"]["p50_ms"]),
        ("TPOT p99 ms", p["tpot"]["p99"] * 1e3, m["tpot"]["p99_ms"]),
        ("out tok/s", p["output_throughput"], m["output_throughput"]),
        ("req/s", p["request_throughput"], m["request_throughput"]),
    ]
    load = " -> ".join(open(f"{out}/load-{n}.txt").read().split())
    print(fmt.format(t, "load avg", "", load, ""))
    for name, a, b in rows:
        r = a / b if a and b else float("nan")
        total += 1
        within += abs(r - 1) <= 0.2
        print(fmt.format(t, name, f"{a:.1f}", f"{b:.1f}", f"{r:.2f}"))
print()
print(f"{within} of {total} predictions within 20% of the measurement")
try:
    print("dkv (1P1D prefill node):", " ".join(l.strip() for l in open(f"{out}/dkv-metrics.txt")))
except OSError:
    pass

# Where a miss comes from: each node's mean forward-pass time per step
# kind while serving (tandem.forward_time), next to what its profile gives
# for a step of that mean size (prefill: the mean prompt tokens of a CE
# step; decode: the mean batch, at the mean context).
import glob, re
def interp(pts, x):
    pts = sorted(pts)
    if len(pts) == 1:
        return pts[0][1] * (x / pts[0][0])
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x <= x1:
            break
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
def sample(text, name, ty):
    m = re.search(rf'^{name}{{batch_type="{ty}"[^}}]*}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0
print("served forward passes vs the profile (mean step; ratio > 1: slower while serving)")
for t in tops:
    n = t.replace(":", "")
    prof = json.load(open(open(f"{out}/profile-of-{n}.txt").read().strip()))
    m = json.load(open(f"{out}/measured-{n}.json"))["results"][0]
    ctx = m["prompt_tokens"] / max(m["completed"], 1) + m["output_tokens"] / max(m["completed"], 1) / 2
    for f in sorted(glob.glob(f"{out}/metrics-{n}-*.txt")):
        node = f.rsplit("-", 1)[1][:-4]
        text = open(f).read()
        parts = []
        for ty in ("CE", "TG"):
            cnt = sample(text, "tandem_forward_time_milliseconds_count", ty)
            if not cnt:
                continue
            ms = sample(text, "tandem_forward_time_milliseconds_sum", ty) / cnt
            size = sample(text, "tandem_batch_input_tokens_sum", ty) / cnt
            if ty == "CE":
                want = 1e3 * interp([(q["tokens"], q["seconds"]) for q in prof["prefill"]], size)
                what = f"{size:.0f} tokens"
            else:
                by_ctx = {}
                for d in prof["decode"]:
                    by_ctx.setdefault(d["context"], []).append((d["batch"], d["seconds"]))
                want = 1e3 * interp([(c, interp(b, size)) for c, b in by_ctx.items()], ctx)
                what = f"batch {size:.2f}"
            parts.append(f"{ty} {ms:.1f} ms at {what} (profile {want:.1f}: {ms / want:.2f}x)")
        if parts:
            print(f"  {t} {node}: " + "; ".join(parts))
print(f"raw outputs: {out}")
PY
