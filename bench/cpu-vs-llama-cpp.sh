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

# The machine's limits (kernels/benches/decode.rs): DRAM streaming-read
# bandwidth with $threads threads and one core's 512-bit vpdpbusd rate.
# Measured before and after the runs; the best of each counts.
limits() {
  for what in membw peak; do
    (cd "$repo" && TANDEM_THREADS=$threads TANDEM_BENCH=$what \
      cargo bench -q -p tandem-kernels --bench decode) >>"$out/limits.$what.txt" 2>>"$out/limits.err"
  done
}
say "machine limits: DRAM bandwidth, vpdpbusd peak"
limits

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

say "machine limits again"
limits

# --- summary --------------------------------------------------------------------
PYTHONPATH="$repo/bench" python3 - "$out" "$rounds" "$threads" "$gguf" <<'PY'
import glob, json, os, re, sys

out, rounds, threads, gguf = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]


from gguf_stats import gguf_model_stats  # bench/gguf_stats.py

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

# --- shares of the machine's limits ------------------------------------------------
def best_in(path, pattern):
    vals = []
    with open(path) as f:
        for line in f:
            m = re.search(pattern, line)
            if m:
                vals.append(float(m.group(1)))
    return max(vals) if vals else None

bw = best_in(f"{out}/limits.membw.txt", rf"membw\s+1024 MB\s+threads={threads}\s+([0-9.]+) GB/s")
if bw is None:  # a single-thread run prints threads=1 once
    bw = best_in(f"{out}/limits.membw.txt", r"membw\s+1024 MB\s+threads=\d+\s+([0-9.]+) GB/s")
peak_core = best_in(f"{out}/limits.peak.txt", r"peak vpdpbusd \(512-bit\)\s+([0-9.]+) GMAC/s")
st = gguf_model_stats(gguf)
cores = min(int(threads), os.cpu_count() or int(threads))
limits = {"dram_gb_s": bw, "vpdpbusd_gmac_s_per_core": peak_core, "cores": cores, **st}
npp, ntg = 128, 128
bounds = {}
if bw:
    # tg128: weights plus the K/V of the context (mean 1 + 64.5 positions).
    per_tok = st["read_bytes"] + st["kv_bytes_per_pos"] * 65.5
    bounds["tg128"] = (bw * 1e9 / per_tok,
                       f"bandwidth: {per_tok / 1e6:.1f} MB/token at {bw:.1f} GB/s")
if peak_core:
    peak = peak_core * 1e9 * cores
    bounds["pp512"] = (peak / st["macs"],
                       f"VNNI: {st['macs'] / 1e6:.1f}M MAC/token at {cores} x {peak_core:.0f} GMAC/s")
if bw and peak_core:
    # B=32 decode, roofline: a step reads the weights once and each
    # sequence's K/V (mean context npp + ntg/2), and runs 32 tokens' MACs
    # including the output head.
    b = 32
    step_bytes = st["read_bytes"] + b * st["kv_bytes_per_pos"] * (npp + ntg / 2)
    step_macs = b * (st["macs"] + st["head_macs"])
    t = max(step_bytes / (bw * 1e9), step_macs / (peak_core * 1e9 * cores))
    bounds["B=32 gen"] = (b / t, f"roofline: max({step_bytes / 1e6:.0f} MB, "
                                 f"{step_macs / 1e9:.2f} GMAC) per step")
print()
print(f"# Shares of this machine's limits: DRAM read {bw or float('nan'):.1f} GB/s "
      f"({threads} threads), vpdpbusd {peak_core or float('nan'):.0f} GMAC/s per core x {cores}")
print()
fmt = "| {:<9} | {:>10} | {:>13} | {:>12} | {:>10} | {:<52} |"
print(fmt.format("metric", "bound t/s", "tandem best", "tandem share", "llama share", "bound"))
print(fmt.format(*["-" * 9, "-" * 10, "-" * 13, "-" * 12, "-" * 10, "-" * 52]))
shares = []
for key, (bound, what) in bounds.items():
    if key not in tandem:
        continue
    tb = max(tandem[key])[0]
    lb = max(llama[key])[0] if key in llama else None
    print(fmt.format(key, f"{bound:.1f}", f"{tb:.1f}", f"{100 * tb / bound:.1f}%",
                     "-" if lb is None else f"{100 * lb / bound:.1f}%", what))
    shares.append({"metric": key, "bound": bound, "bound_basis": what,
                   "tandem_share": tb / bound,
                   "llama_cpp_share": None if lb is None else lb / bound})
with open(f"{out}/summary.json") as f:
    summary_json = json.load(f)
summary_json["limits"] = limits
summary_json["shares"] = shares
with open(f"{out}/summary.json", "w") as f:
    json.dump(summary_json, f, indent=2)
PY
