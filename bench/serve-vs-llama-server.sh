#!/usr/bin/env bash
# Serving benchmark: `tandem serve` vs `llama-server` (continuous batching),
# same GGUF, same thread count, measured by `tandem bench` over the OpenAI API.
#   usage: bench/serve-vs-llama-server.sh [THREADS]        (default 2)
# Environment:
#   GGUF=path            model (default: SmolLM2-135M-Instruct Q4_1, fetched by tandem)
#   CONCURRENCY="1 8 32" concurrency levels
#   INPUT_LEN=128 OUTPUT_LEN=64   prompt words / max_tokens per request
#   SEED=0               prompt seed (the same prompts go to both servers)
#   LLAMA_SERVER=path    use this llama-server instead of building one
#   BENCH_OUT=dir        where raw outputs go (default: a new /tmp/tandem-serve-bench.*)
#   PORT=n               first of two ports used (default 18431)
# Requests per level: 2*C+8, all with ignore_eos so every one generates OUTPUT_LEN.
set -euo pipefail

threads=${1:-2}
[[ $threads =~ ^[1-9][0-9]*$ ]] || { echo "THREADS must be a positive integer" >&2; exit 2; }
levels=${CONCURRENCY:-1 8 32}
input_len=${INPUT_LEN:-128}
output_len=${OUTPUT_LEN:-64}
seed=${SEED:-0}
port=${PORT:-18431}
repo=$(git -C "$(dirname "${BASH_SOURCE[0]}")" rev-parse --show-toplevel)
out=${BENCH_OUT:-$(mktemp -d /tmp/tandem-serve-bench.XXXXXX)}
mkdir -p "$out"
# shellcheck source=bench/lib.sh
source "$repo/bench/lib.sh"
bench_build_tandem
bench_resolve_gguf
if [[ -n ${LLAMA_SERVER:-} ]]; then
  server=$LLAMA_SERVER
else
  bench_llama_cpp
  server=$bin/llama-server
fi
[[ -x $server ]] || { echo "no llama-server at $server" >&2; exit 1; }

say "model $gguf, $threads threads, concurrency $levels, raw output in $out"
say "tandem $tandem"
say "llama-server $server"

pid=""
stop() {
  if [[ -n $pid ]]; then
    kill "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    pid=""
  fi
}
trap stop EXIT
wait_ready() { # url log
  for _ in $(seq 1 600); do
    curl -sf "$1" >/dev/null 2>&1 && return 0
    kill -0 "$pid" 2>/dev/null || { echo "server died; see $2" >&2; tail -n 20 "$2" >&2; exit 1; }
    sleep 0.2
  done
  echo "server not ready: $1" >&2; exit 1
}
bench() { # name C
  local n=$((2 * $2 + 8))
  say "$1 C=$2: $n requests"
  "$tandem" bench --url "http://127.0.0.1:$port" --num-requests "$n" --concurrency "$2" \
    --input-len "$input_len" --output-len "$output_len" --seed "$seed" --ignore-eos \
    --json "$out/$1.c$2.json" >"$out/$1.c$2.txt"
  cat "$out/$1.c$2.txt" >&2
}

for c in $levels; do
  "$tandem" serve --model "$gguf" --port "$port" --threads "$threads" --max-batch-size 32 \
    --allow-extra-request-fields >"$out/tandem-serve.c$c.log" 2>&1 &
  pid=$!
  wait_ready "http://127.0.0.1:$port/v1/models" "$out/tandem-serve.c$c.log"
  bench tandem "$c"
  stop
  "$server" -m "$gguf" --port "$port" -t "$threads" --parallel "$c" -c $((c * 512)) -cb \
    >"$out/llama-server.c$c.log" 2>&1 &
  pid=$!
  wait_ready "http://127.0.0.1:$port/health" "$out/llama-server.c$c.log"
  bench llama "$c"
  stop
done

python3 - "$out" "$threads" "$gguf" $levels <<'PY'
import json, os, sys

out, threads, gguf, levels = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
def load(name, c):
    with open(f"{out}/{name}.c{c}.json") as f:
        return json.load(f)["results"][0]
print()
print(f"# tandem serve vs llama-server: {os.path.basename(gguf)}, {threads} threads; "
      f"raw outputs: {out}")
print()
fmt = "| {:>3} | {:<12} | {:>9} | {:>9} | {:>9} | {:>9} | {:>9} | {:>6} |"
print(fmt.format("C", "server", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99",
                 "errors"))
print(fmt.format(*["-" * 3, "-" * 12] + ["-" * 9] * 5 + ["-" * 6]))
f = lambda x: "-" if x is None else f"{x:.1f}"
rows = []
for c in levels:
    t, l = load("tandem", c), load("llama", c)
    for name, r in (("tandem", t), ("llama-server", l)):
        print(fmt.format(c, name, f(r["output_throughput"]), f(r["ttft"]["p50_ms"]),
                         f(r["ttft"]["p99_ms"]), f(r["tpot"]["p50_ms"]), f(r["tpot"]["p99_ms"]),
                         r["errors"]))
    ratio = lambda a, b: "-" if not a or not b else f"{a / b:.2f}x"
    print(fmt.format(c, "tandem/llama", ratio(t["output_throughput"], l["output_throughput"]),
                     ratio(t["ttft"]["p50_ms"], l["ttft"]["p50_ms"]),
                     ratio(t["ttft"]["p99_ms"], l["ttft"]["p99_ms"]),
                     ratio(t["tpot"]["p50_ms"], l["tpot"]["p50_ms"]),
                     ratio(t["tpot"]["p99_ms"], l["tpot"]["p99_ms"]), ""))
    rows.append({"concurrency": int(c), "tandem": t, "llama_server": l})
with open(f"{out}/summary.json", "w") as fh:
    json.dump({"model": gguf, "threads": int(threads), "rows": rows}, fh, indent=2)
print()
print("ms for TTFT/TPOT (lower is better); tok/s higher is better. "
      "Target at C=32: tandem >= 2x llama-server output tok/s, lower TPOT p99.")
PY
