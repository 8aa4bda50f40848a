#!/usr/bin/env bash
# Tandem vs llama.cpp on the CPU, same GGUF, same thread count, one run.
#   usage: bench/cpu-vs-llama-cpp.sh [THREADS]        (default 2)
# Environment:
#   GGUF=path       model (default: SmolLM2-135M-Instruct Q4_1, fetched by tandem)
#   MODEL=alias     a tandem alias instead (qwen2.5-coder-0.5b, gemma3-270m, ...)
#   ROUNDS=n        alternating llama.cpp/tandem rounds (default 2); best wins
#   BENCH_OUT=dir   where raw outputs go (default: a new /tmp/tandem-bench.*)
#   LLAMA_CPP_VERSION  llama-cpp-python version whose llama.cpp is built (0.3.36)
# See bench/README.md.
set -euo pipefail

threads=${1:-2}
rounds=${ROUNDS:-2}
[[ $threads =~ ^[1-9][0-9]*$ ]] || { echo "THREADS must be a positive integer" >&2; exit 2; }
[[ $rounds =~ ^[1-9][0-9]*$ ]] || { echo "ROUNDS must be a positive integer" >&2; exit 2; }
repo=$(git -C "$(dirname "${BASH_SOURCE[0]}")" rev-parse --show-toplevel)
out=${BENCH_OUT:-$(mktemp -d /tmp/tandem-bench.XXXXXX)}
mkdir -p "$out"
# shellcheck source=bench/lib.sh
source "$repo/bench/lib.sh"
bench_build_tandem
bench_resolve_gguf
bench_llama_cpp

say "model $gguf, $threads threads, $rounds rounds, raw output in $out"
say "llama.cpp $bin (ON: $llama_flags)"
say "tandem $tandem"

# --- the runs: llama.cpp and tandem alternate, the machine is noisy ----------
for r in $(seq 1 "$rounds"); do
  say "round $r/$rounds: llama-bench pp512 tg128 (-fa on,off)"
  "$bin/llama-bench" -m "$gguf" -t "$threads" -p 512 -n 128 -r 3 -fa on,off -o json \
    >"$out/llama-bench.$r.json" 2>"$out/llama-bench.$r.err"
  for fa in on off; do
    say "round $r/$rounds: llama-batched-bench npp128 ntg128 npl 1,8,32 -fa $fa"
    "$bin/llama-batched-bench" -m "$gguf" -t "$threads" -c 16384 -npp 128 -ntg 128 \
      -npl 1,8,32 -fa "$fa" --output-format jsonl \
      >"$out/llama-batched.$r.fa-$fa.jsonl" 2>"$out/llama-batched.$r.fa-$fa.err"
  done
  say "round $r/$rounds: tandem bench-engine"
  "$tandem" bench-engine --model "$gguf" --threads "$threads" --pp 512 --tg 128 \
    --batch 1,8,32 --npp 128 --ntg 128 --reps 3 --json "$out/tandem.$r.json" \
    2>"$out/tandem.$r.err" | tee "$out/tandem.$r.txt"
done

# --- summary --------------------------------------------------------------------
python3 - "$out" "$rounds" "$threads" "$gguf" <<'PY'
import glob, json, os, sys

out, rounds, threads, gguf = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
# metric -> list of (tokens/s, round, detail)
llama, tandem = {}, {}

def add(d, key, ts, r, detail):
    d.setdefault(key, []).append((ts, r, detail))

for r in range(1, rounds + 1):
    with open(f"{out}/llama-bench.{r}.json") as f:
        for t in json.load(f):
            fa = "fa on" if t["flash_attn"] == 1 else "fa off"
            key = (f"pp{t['n_prompt']}" if t["n_gen"] == 0 else
                   f"tg{t['n_gen']}" if t["n_prompt"] == 0 else None)
            if key:
                for ts in t["samples_ts"]:
                    add(llama, key, ts, r, fa)
    for fa in ("on", "off"):
        with open(f"{out}/llama-batched.{r}.fa-{fa}.jsonl") as f:
            for line in f:
                line = line.strip()
                if not line.startswith("{"):
                    continue
                t = json.loads(line)
                add(llama, f"B={t['pl']} gen", t["speed_tg"], r, f"fa {fa}")
                add(llama, f"B={t['pl']} prefill", t["speed_pp"], r, f"fa {fa}")
    with open(f"{out}/tandem.{r}.json") as f:
        tj = json.load(f)
    for t in tj["results"]:
        key = {"pp": t["test"], "tg": t["test"],
               "batched_gen": f"B={t['batch']} gen",
               "batched_prefill": f"B={t['batch']} prefill"}[t["kind"]]
        for ms in t["ms_samples"]:
            add(tandem, key, t["n_tokens"] / (ms / 1e3), r, "")

rows = [  # metric, target ratio (None: reported only)
    ("pp512", 1.0), ("tg128", 1.25),
    ("B=1 gen", None), ("B=8 gen", None), ("B=32 gen", 3.0),
    ("B=1 prefill", None), ("B=8 prefill", None), ("B=32 prefill", None),
]
print()
print(f"# Tandem vs llama.cpp: {os.path.basename(gguf)}, {threads} threads, "
      f"{rounds} rounds, best sample per engine (tokens/s)")
print(f"# tandem kernels: {tj['isa']}; raw outputs: {out}")
print()
hdr = ("metric", "llama.cpp best", "llama.cpp median", "tandem best", "tandem median",
       "tandem/llama", "target", "")
fmt = "| {:<12} | {:>14} | {:>16} | {:>11} | {:>13} | {:>12} | {:>7} | {:<4} |"
print(fmt.format(*hdr))
print(fmt.format(*["-" * 12, "-" * 14, "-" * 16, "-" * 11, "-" * 13, "-" * 12, "-" * 7, "-" * 4]))
summary = []
for key, target in rows:
    if key not in llama or key not in tandem:
        continue
    lb = max(llama[key])
    tb = max(tandem[key])
    med = lambda xs: sorted(x[0] for x in xs)[len(xs) // 2]
    ratio = tb[0] / lb[0]
    ok = "" if target is None else ("ok" if ratio >= target else "MISS")
    print(fmt.format(key, f"{lb[0]:.1f}" + (f" ({lb[2]})" if lb[2] else ""),
                     f"{med(llama[key]):.1f}", f"{tb[0]:.1f}", f"{med(tandem[key]):.1f}",
                     f"{ratio:.2f}x", "-" if target is None else f">={target:g}x", ok))
    summary.append({"metric": key, "llama_cpp_best": lb[0], "llama_cpp_best_config": lb[2],
                    "tandem_best": tb[0], "ratio": ratio, "target": target,
                    "llama_cpp_samples": [x[0] for x in llama[key]],
                    "tandem_samples": [x[0] for x in tandem[key]]})
with open(f"{out}/summary.json", "w") as f:
    json.dump({"model": gguf, "threads": int(threads), "rounds": rounds,
               "tandem_isa": tj["isa"], "rows": summary}, f, indent=2)
print()
print("llama.cpp B=N rows: llama-batched-bench S_TG / S_PP (best of -fa on/off); "
      "tandem B=N prefill: whole sequences batched up to 512 tokens per forward call.")
PY
