#!/usr/bin/env bash
# dkv write bandwidth against ucx_perftest (ucp_put_bw), same transports and
# sizes, in one run. Two processes each: a server that registers a region,
# grants it once per write of the client's plan (a granted byte lands once)
# and progresses, a client that writes into it, a grant per write.
#   usage: bench/dkv.sh
# Environment:
#   ROUNDS=n         alternating perftest/dkv rounds (default 2); best wins
#   REPS=n           timed writes per size and mode (default 10, plus 3 warm-up)
#   SIZES_MIB="..."  total sizes in MiB (default "1 4 16 64")
#   BLOCK=bytes      KV block size of the per-block mode (default 65536)
#   TRANSPORTS="..." tcp and/or shm (posix,sysv,cma,self), or any UCX_TLS value
#   MEMS="..."       the server's target memory: alloc (Dkv::alloc, what UCX
#                    allocates; what ucx_perftest uses) and/or heap (ordinary
#                    memory registered with Dkv::register); default both
#   BENCH_OUT=dir    raw outputs (default: a new /tmp/tandem-dkv-bench.*)
# MB/s below are ucx_perftest's: 2^20 bytes per second. ucx_perftest runs with
# the tcp segment sizes dkv sets (UCX_TCP_TX_SEG_SIZE=64K,
# UCX_TCP_RX_SEG_SIZE=256K) so both use the same transport configuration;
# its tag_bw (two-sided) is shown as a second reference.
set -euo pipefail

rounds=${ROUNDS:-2}
reps=${REPS:-10}
sizes=${SIZES_MIB:-1 4 16 64}
block=${BLOCK:-65536}
transports=${TRANSPORTS:-tcp shm}
mems=${MEMS:-alloc heap}
for m in $mems; do
  [[ $m == alloc || $m == heap ]] || { echo "MEMS: alloc and/or heap, not $m" >&2; exit 2; }
done
export UCX_TCP_TX_SEG_SIZE=${UCX_TCP_TX_SEG_SIZE:-64K} UCX_TCP_RX_SEG_SIZE=${UCX_TCP_RX_SEG_SIZE:-256K}
for n in "$rounds" "$reps" "$block" $sizes; do
  [[ $n =~ ^[1-9][0-9]*$ ]] || { echo "not a positive integer: $n" >&2; exit 2; }
done
repo=$(git -C "$(dirname "${BASH_SOURCE[0]}")" rev-parse --show-toplevel)
out=${BENCH_OUT:-$(mktemp -d /tmp/tandem-dkv-bench.XXXXXX)}
mkdir -p "$out"
say() { echo "== $*" >&2; }

command -v ucx_perftest >/dev/null || { echo "ucx_perftest not found (apt-get install ucx-utils)" >&2; exit 1; }
say "building dkv_bench (release)"
(cd "$repo" && cargo build --release -q -p tandem-dkv --example dkv_bench >&2)
bench=${CARGO_TARGET_DIR:-$repo/target}/release/examples/dkv_bench
[[ $bench == /* ]] || bench=$repo/$bench

tls_of() {
  case $1 in
    tcp) echo tcp ;;
    shm) echo posix,sysv,cma,self ;;
    *) echo "$1" ;;
  esac
}
free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
sizes_csv=$(echo $sizes | tr ' ' ',')
max_bytes=$(( $(echo $sizes | tr ' ' '\n' | sort -n | tail -n1) << 20 ))
results=$out/results.txt
: >"$results"

# ucx_perftest -t ucp_put_bw: SIZE-byte puts back to back, one flush at the end.
run_perftest() { # test name tls size round
  local test=$1 name=$2 tls=$3 size=$4 r=$5 port n w log spid try bw
  n=$(( (256 << 20) / size )); (( n >= 8 )) || n=8
  w=$(( n / 8 )); (( w >= 2 )) || w=2
  port=$(free_port)
  log=$out/perftest.$test.$name.$size.$r
  UCX_TLS=$tls ucx_perftest -p "$port" >"$log.server" 2>&1 &
  spid=$!
  for try in $(seq 1 50); do
    # The client fails fast until the server listens.
    if UCX_TLS=$tls timeout 300 ucx_perftest 127.0.0.1 -p "$port" -t "$test" \
        -s "$size" -n "$n" -w "$w" -f >"$log" 2>&1; then
      break
    fi
    (( try < 50 )) || { echo "ucx_perftest failed, see $log" >&2; kill "$spid" 2>/dev/null || true; exit 1; }
    sleep 0.1
  done
  wait "$spid" || true
  # Final line: iters, 50%ile, avg, overall overhead, bw avg, bw overall, ...
  bw=$(awk '$1 ~ /^[0-9]+$/ && NF >= 8 { bw = $6 } END { print bw }' "$log")
  [[ -n $bw ]] || { echo "no bandwidth in $log" >&2; exit 1; }
  echo "$test $name - $size - $bw $bw" >>"$results"
}

# dkv_bench: the client writes every size as one op per block, merged, and
# per block with four writes in flight.
run_dkv() { # name tls mem round
  local name=$1 tls=$2 mem=$3 r=$4 ctl spid line sargs=()
  local log=$out/dkv.$name.$mem.$r
  # The client's plan: the server grants once per write of it.
  local plan=(--sizes "$sizes_csv" --block "$block" --reps "$reps" --warmup 3 --lat-reps 1000)
  [[ $mem == heap ]] && sargs=(--register)
  ctl=$out/ctl.$name.$mem.$r
  mkfifo "$ctl"
  "$bench" server --tls "$tls" --size "$max_bytes" "${sargs[@]}" "${plan[@]}" <"$ctl" >"$log.desc" 2>"$log.server" &
  spid=$!
  exec 3>"$ctl"
  # One DESC line per grant, then END once all are out.
  for _ in $(seq 1 200); do grep -q '^END' "$log.desc" && break; sleep 0.05; done
  if ! "$bench" client --tls "$tls" --desc-file "$log.desc" "${plan[@]}" >"$log" 2>"$log.err"; then
    exec 3>&-; wait "$spid" || true
    echo "dkv_bench client failed, see $log.err" >&2; exit 1
  fi
  exec 3>&-
  wait "$spid" || { echo "dkv_bench server failed, see $log.server" >&2; exit 1; }
  grep -q verified "$log.server" || { echo "server did not verify, see $log.server" >&2; exit 1; }
  rm -f "$ctl"
  while read -r line; do
    # RESULT size=B mode=M ops=N best=X median=Y
    set -- $line
    echo "dkv $name $mem ${2#size=} ${3#mode=} ${5#best=} ${6#median=}" >>"$results"
  done < <(grep '^RESULT' "$log")
  # LATENCY bytes=64 p50=X p90=Y p99=Z us
  set -- $(grep '^LATENCY' "$log")
  echo "latency $name $mem 64 - ${3#p50=} ${5#p99=}" >>"$results"
}

say "sizes ${sizes// /,} MiB, block $block B, $rounds rounds, raw output in $out"
for r in $(seq 1 "$rounds"); do
  for t in $transports; do
    tls=$(tls_of "$t")
    for s in $sizes; do
      for test in ucp_put_bw tag_bw; do
        say "round $r/$rounds: ucx_perftest $test UCX_TLS=$tls ${s} MiB"
        run_perftest "$test" "$t" "$tls" $((s << 20)) "$r"
      done
    done
    for m in $mems; do
      say "round $r/$rounds: dkv_bench UCX_TLS=$tls target memory $m"
      run_dkv "$t" "$tls" "$m" "$r"
    done
  done
done

python3 - "$results" "$transports" "$sizes" "$mems" <<'PY'
import statistics, sys
path, transports, mems = sys.argv[1], sys.argv[2].split(), sys.argv[4].split()
sizes = [int(s) << 20 for s in sys.argv[3].split()]
best, med = {}, {}
for line in open(path):
    tool, name, mem, size, mode, b, m = line.split()
    key = (tool, name, mem, int(size), mode)
    best[key] = max(best.get(key, 0.0), float(b))
    med.setdefault(key, []).append(float(m))

def cell(key):
    return f"{best.get(key, 0.0):.0f} ({statistics.median(med.get(key, [0.0])):.0f})"

modes = ("blocks", "merged", "blocks-q4")
fmt = "{:>7} {:>9} {:>6} " + "{:>13} " * 4 + "{:>11} " * 3 + "{:>13}"
print(fmt.format("size", "transport", "target", "dkv blocks", "dkv merged", "dkv q4",
                 "perftest put", "x blocks", "x merged", "x q4", "perftest tag"))
for name in transports:
    for mem in mems:
        for size in sizes:
            put = best.get(("ucp_put_bw", name, "-", size, "-"), 0.0)
            row = [f"{size >> 20} MiB", name, mem]
            row += [cell(("dkv", name, mem, size, m)) for m in modes]
            row.append(cell(("ucp_put_bw", name, "-", size, "-")))
            for m in modes:
                x = best.get(("dkv", name, mem, size, m), 0.0) / put if put else 0.0
                row.append(f"{x:.2f}" + ("" if x >= 0.9 else " MISS"))
            row.append(cell(("tag_bw", name, "-", size, "-")))
            print(fmt.format(*row))
print("MB/s = 2^20 B/s: best of all rounds (median of the rounds' medians). x = dkv / perftest put.")
print("dkv blocks: one write() of one op per 64 KiB block, timed to remote completion (flush);")
print("merged: the same bytes as one op; q4: four block writes in flight at once.")
print("ucx_perftest: back-to-back puts of the size, one flush at the end. Target: x >= 0.9.")
print("target alloc = Dkv::alloc memory (UCX-allocated, as ucx_perftest's); heap = Dkv::register'ed heap.")
print()
print("64-byte write() latency, us (p50 best of rounds / p99 median of rounds):")
for name in transports:
    for mem in mems:
        k = ("latency", name, mem, 64, "-")
        if k in med:
            p50 = min(float(l.split()[5]) for l in open(path) if l.split()[:3] == ["latency", name, mem])
            print(f"  {name:>5} {mem:>5}: p50 {p50:.1f}  p99 {statistics.median(med[k]):.1f}")
PY

# KV handoff latency of a ~1k-token prompt and 1P1D vs `tandem serve` under
# `tandem bench`, in the same run (SKIP_CLUSTER=1 leaves them out).
if [[ -z ${SKIP_CLUSTER:-} ]]; then
  BENCH_OUT=${out}/cluster "$repo/bench/cluster.sh"
fi
