#!/usr/bin/env bash
# Cost of constrained decoding: output tokens/s of `tandem serve` with and
# without a constraint, at 1 and 32 concurrent requests, in one run. The
# constraints never end the text early (every request produces max_tokens
# tokens), so the ratio is the per-token cost of computing the masks.
#   bench/structured.sh [--threads N]
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
threads=${THREADS:-}
[[ ${1:-} == --threads ]] && threads=$2
source "$repo/bench/lib.sh"
bench_build_tandem
bench_resolve_gguf
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
args=(serve --model "$gguf" --host 127.0.0.1 --port "$port" --max-length 1024 --max-batch-size 32)
[[ -n $threads ]] && args+=(--threads "$threads")
"$tandem" "${args[@]}" >/dev/null 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null' EXIT
for _ in $(seq 1 120); do
  curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break
  sleep 0.5
done
python3 - "$port" <<'PY'
import json, sys, threading, time, urllib.request
port = int(sys.argv[1])
MAX = 64
formats = {
    "none": None,
    "regex": {"type": "regex", "regex": "[A-Za-z ,.]{400}"},
    "json_schema": {"type": "json_schema", "json_schema": {"name": "t", "schema": {
        "type": "object",
        "properties": {"story": {"type": "string", "minLength": 400, "maxLength": 800}},
        "required": ["story"], "additionalProperties": False}}},
}
def one(rf, seed):
    body = {"messages": [{"role": "user", "content": "Tell me a story about a fox."}],
            "max_tokens": MAX, "temperature": 0.8, "seed": seed}
    if rf: body["response_format"] = rf
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions",
        data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req) as r:
        return json.load(r)["usage"]["completion_tokens"]
def run(rf, conc, n):
    out = []
    def worker(seeds):
        for s in seeds: out.append(one(rf, s))
    t0 = time.time()
    ts = [threading.Thread(target=worker, args=(range(i, n, conc),)) for i in range(conc)]
    for t in ts: t.start()
    for t in ts: t.join()
    return sum(out) / (time.time() - t0), sum(out)
one(formats["json_schema"], 0)  # build the vocabulary index once
print(f"{'format':<12} {'conc':>4} {'tok/s':>8} {'tokens':>7} {'vs none':>8}")
for conc, n in [(1, 6), (32, 64)]:
    base = None
    for name, rf in formats.items():
        tps, toks = run(rf, conc, n)
        base = base or tps
        print(f"{name:<12} {conc:>4} {tps:>8.1f} {toks:>7} {tps / base:>8.2f}")
PY
