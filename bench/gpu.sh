#!/usr/bin/env bash
# Tandem on a GPU against Tandem on the CPU, same GGUF, one run.
#   usage: bench/gpu.sh [DEVICE]        (default gpu:0)
# Environment:
#   GGUF=path / MODEL=alias  the model (default: SmolLM2-135M-Instruct Q4_1;
#                     qwen2.5-coder-0.5b and gemma3-270m run on the GPU too)
#   ROUNDS=n          alternating CPU/GPU rounds (default 2); best wins
#   PROMPT_WORDS=n    prompt length in words (default 200)
#   GEN_TOKENS=n      generated tokens (default 128)
#   GPU_BW_GBS=x      the device's memory bandwidth in GB/s, for the share of
#                     the bandwidth bound (default: looked up from the name
#                     nvidia-smi reports: H100 3350, H200 4800; else none)
#   BENCH_OUT=dir     raw outputs (default: a new /tmp/tandem-gpu-bench.*)
#   SERVE_CONCURRENCY=list  the batched serving sweep (default 1,8,32; empty
#                     skips it); SERVE_REQUESTS=n per point (default 32),
#                     SERVE_OUT=n tokens generated per request (default 64)
#   TP_DEVICES=list   tensor-parallel serving in the same sweep: --devices for
#                     it (default gpu:0,1,2 where nvidia-smi lists 3 or more
#                     GPUs: SmolLM2's 9 heads split 3 ways; gpu:0,1 with
#                     MODEL=qwen2.5-coder-0.5b for 2 ways), TP_RANKS=n its
#                     --tp (default: one rank per listed GPU; gpu:0 with
#                     TP_RANKS=3 runs three ranks on one device)
# What runs: `tandem generate --devices DEVICE` (GpuLlama: one sequence, the
# prompt in one forward pass, greedy on the device) and the same command on
# the CPU; then `tandem serve` on each (the scheduler's batches; on the GPU
# over GpuRunner) under `tandem bench` at each concurrency, 128-token
# prompts, and on TP_DEVICES when set: tensor-parallel ranks that add
# partial sums through host memory (two round trips per layer), so its
# scaling is the cost of that staging, not NCCL's.
set -euo pipefail

device=${1:-gpu:0}
rounds=${ROUNDS:-2}
words=${PROMPT_WORDS:-200}
gen=${GEN_TOKENS:-128}
for v in rounds words gen; do
  [[ ${!v} =~ ^[1-9][0-9]*$ ]] || { echo "$v must be a positive integer" >&2; exit 2; }
done
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=${BENCH_OUT:-$(mktemp -d /tmp/tandem-gpu-bench.XXXXXX)}
mkdir -p "$out"
# shellcheck source=bench/lib.sh
source "$repo/bench/lib.sh"
bench_build_tandem
bench_resolve_gguf
export XDG_RUNTIME_DIR=${XDG_RUNTIME_DIR:-$(mktemp -d)}

prompt=$(python3 -c "import sys; w='the quick brown fox jumps over the lazy dog'.split(); n=int(sys.argv[1]); print(' '.join((w * (n // len(w) + 1))[:n]))" "$words")
say "model $gguf; $device vs cpu; $rounds rounds; prompt $words words, $gen generated; raw output in $out"

run() { # where round
  "$tandem" generate --model "$gguf" --devices "$1" --prompt "$prompt" --max-tokens "$gen" \
    --temperature 0 --ignore-eos >"$out/$2.out" 2>"$out/$2.err" ||
    { echo "tandem generate --devices $1 failed:" >&2; cat "$out/$2.err" >&2; exit 1; }
}
for r in $(seq 1 "$rounds"); do
  say "round $r/$rounds: cpu"
  run cpu "cpu.$r"
  say "round $r/$rounds: $device"
  run "$device" "gpu.$r"
done

bw=${GPU_BW_GBS:-}
if [[ -z $bw ]] && command -v nvidia-smi >/dev/null; then
  name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
  case $name in
    *H200*) bw=4800 ;;
    *H100*) bw=3350 ;;
  esac
fi

PYTHONPATH="$repo/bench" python3 - "$out" "$rounds" "$gguf" "${bw:-}" "$device" <<'PY'
import glob, re, sys

from gguf_stats import read_tensors  # bench/gguf_stats.py

out, rounds, gguf, bw, device = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
line = re.compile(r"prompt (\d+) tokens in ([\d.]+) ms \(([\d.]+) tok/s\); "
                  r"generated (\d+) tokens in ([\d.]+) ms \(([\d.]+) tok/s\)")
best = {}
adapter = ""
for path in sorted(glob.glob(f"{out}/*.err")):
    kind = path.rsplit("/", 1)[1].split(".")[0]
    text = open(path).read()
    m = line.search(text)
    if not m:
        sys.exit(f"no speed line in {path}")
    a = re.search(r"on gpu:\d+, (.*), in [\d.]+ ms", text)
    if a:
        adapter = a.group(1)
    pp, tg = float(m.group(3)), float(m.group(6))
    b = best.setdefault(kind, [0.0, 0.0])
    b[0], b[1] = max(b[0], pp), max(b[1], tg)

_, tensors = read_tensors(gguf)
t = {name: (n, b) for name, _, n, b in tensors}
# A GPU decode step reads every layer tensor as stored and the output head
# as f32 (the GPU dequantises a tied Q8_0 head at load); one embedding row
# per token is noise.
head = "output.weight" if "output.weight" in t else "token_embd.weight"
per_tok = sum(b for name, (_, b) in t.items() if name.startswith("blk.")) + t[head][0] * 4
print()
print(f"# Tandem on {device} ({adapter or 'adapter not reported'}) vs the CPU: best of {rounds} rounds")
print()
print("| metric | cpu best tok/s | gpu best tok/s | gpu/cpu |")
print("| --- | --- | --- | --- |")
for i, metric in enumerate(["prompt (one forward pass)", "decode"]):
    c, g = best["cpu"][i], best["gpu"][i]
    print(f"| {metric} | {c:.1f} | {g:.1f} | {g / c:.2f}x |")
print()
if bw:
    bound = float(bw) * 1e9 / per_tok
    share = best["gpu"][1] / bound
    print(f"decode: {per_tok / 1e6:.1f} MB read per token at {float(bw):.0f} GB/s bounds it at "
          f"{bound:.0f} tok/s; measured {best['gpu'][1]:.1f} tok/s = {100 * share:.1f}% of the bound")
else:
    print(f"decode reads {per_tok / 1e6:.1f} MB per token; set GPU_BW_GBS for the share of the "
          "device's bandwidth bound")
PY

conc=${SERVE_CONCURRENCY-1,8,32}
[[ -z $conc ]] && exit 0
tp_devices=${TP_DEVICES:-}
if [[ -z $tp_devices ]] && command -v nvidia-smi >/dev/null &&
  (($(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l) >= 3)); then
  tp_devices=gpu:0,1,2
fi
tp_ranks=${TP_RANKS:-}
if [[ -n $tp_devices && -z $tp_ranks ]]; then
  ids=${tp_devices#gpu:}
  tp_ranks=$(tr ',' '\n' <<<"$ids" | grep -c .)
fi
serve_bench() { # devices name [tp]
  local log="$out/serve.$2.log" pid port
  "$tandem" serve --model "$gguf" --devices "$1" --tp "${3:-1}" --port 0 --max-length 1024 \
    --max-batch-size 32 >"$log" 2>&1 &
  pid=$!
  for _ in $(seq 240); do grep -q "tandem: serving" "$log" && break; sleep 0.5; done
  port=$(grep -o 'http://127.0.0.1:[0-9]*' "$log" | head -1 | cut -d: -f3)
  if [[ -z $port ]]; then
    echo "serve --devices $1 did not start:" >&2; cat "$log" >&2; kill "$pid"; exit 1
  fi
  "$tandem" bench --url "http://127.0.0.1:$port" --endpoint completions \
    --num-requests "${SERVE_REQUESTS:-32}" --sweep-concurrency "$conc" --input-len 128 \
    --output-len "${SERVE_OUT:-64}" --ignore-eos --temperature 0 \
    --quiet --json "$out/serve.$2.json" >"$out/serve.$2.txt" 2>&1 ||
    { echo "tandem bench against $1 failed:" >&2; cat "$out/serve.$2.txt" >&2; }
  kill "$pid"; wait "$pid" 2>/dev/null || true
}
say "serving: cpu"
serve_bench cpu cpu
say "serving: $device"
serve_bench "$device" gpu
if [[ -n $tp_devices ]]; then
  say "serving: $tp_devices, $tp_ranks tensor-parallel ranks"
  serve_bench "$tp_devices" tp "$tp_ranks"
fi
python3 - "$out" "$device" "${SERVE_REQUESTS:-32}" "${SERVE_OUT:-64}" "$tp_devices" "$tp_ranks" <<'PY'
import json, os, sys
out, device, n, gen, tp_devices, tp_ranks = sys.argv[1:7]
kinds = ("cpu", "gpu", "tp") if tp_devices else ("cpu", "gpu")
runs = {k: json.load(open(f"{out}/serve.{k}.json"))["results"] for k in kinds}
print()
print(f"# tandem serve, batched: {device} vs the CPU ({n} requests per point, 128-token prompts, {gen} tokens out)")
print()
def table(base, other, a, b):
    """Batched serving of `other` (named b) against `base` (named a)."""
    p50 = lambda r: (r["tpot"] or {}).get("p50_ms")
    fmt = lambda x: "-" if x is None else f"{x:.1f}"
    print(f"| concurrency | {a} output tok/s | {b} output tok/s | {b}/{a} | {a} TPOT p50 ms | "
          f"{b} TPOT p50 ms | errors {a}/{b} |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for x, y in zip(base, other):
        xt, yt = x["output_throughput"] or 0, y["output_throughput"] or 0
        print(f"| {x['concurrency']} | {xt:.1f} | {yt:.1f} | {yt / xt if xt else 0:.2f}x | "
              f"{fmt(p50(x))} | {fmt(p50(y))} | {x['errors']}/{y['errors']} |")
    print()
table(runs["cpu"], runs["gpu"], "cpu", "gpu")
if not tp_devices:
    print("tensor-parallel scaling: not measured (set TP_DEVICES: gpu:0,1 with "
          "MODEL=qwen2.5-coder-0.5b, whose 14 heads split 2 ways; gpu:0,1,2 for SmolLM2's 9)")
    sys.exit(0)
print(f"# tensor parallelism: {tp_ranks} ranks on {tp_devices} vs one rank on {device}")
print()
table(runs["gpu"], runs["tp"], "1 rank", "TP")
PY
