# shellcheck shell=bash
# Shared set-up for the bench/ scripts; source it, then call the functions in
# order. Each sets variables the caller uses:
#   bench_build_tandem   -> tandem  (release binary, built if needed; or
#                                    $TANDEM_BIN, used as it is)
#   bench_resolve_gguf   -> gguf    ($GGUF, else the alias $MODEL or the
#                                    default model, fetched)
#   bench_llama_cpp      -> bin     (llama.cpp bin dir with llama-bench,
#                                    llama-batched-bench and llama-server)
#   bench_cache_dir      prints tandem's cache directory ($TANDEM_CACHE, else
#                        $XDG_CACHE_HOME/tandem, else ~/.cache/tandem)
# Callers set: repo, threads, out. See bench/README.md.
#
# Processes the scripts start and stop (clusters, routers, peers). Each logs
# to $out/NAME.log; `trap stop_all EXIT` stops whatever is left.
#   pids                  the ids of the processes started and not yet stopped
#   free_port             prints a free TCP port on 127.0.0.1
#   start_bg NAME CMD...  runs CMD in the background, output to $out/NAME.log;
#                         appends its id to pids (so it is ${pids[-1]})
#   wait_log NAME MARKER [PID]
#                         waits until $out/NAME.log has a line matching MARKER;
#                         exits the script if PID (default ${pids[-1]}) dies
#                         first (printing the log's tail) or after
#                         $start_timeout seconds (default 120)
#   start NAME MARKER CMD...
#                         start_bg, then wait_log: a process that says when it
#                         is ready
#   wait_http URL [PATTERN]
#                         waits until URL answers 2xx (and, with PATTERN, its
#                         body matches that grep pattern); exits the script
#                         after $start_timeout seconds
#   stop_pids PID...      stops those processes (SIGTERM, their children
#                         first), waits for them, and drops them from pids
#   stop_all              stop_pids on all of pids, then removes $out/etcd-data
#   start_etcd            -> etcd_url: a fresh one-member etcd (log
#                         $out/etcd.log, data $out/etcd-data); needs etcd
#   port_of NAME WORDS    prints PORT from the first "WORDS http://127.0.0.1:PORT"
#                         in $out/NAME.log (e.g. port_of decode "metrics on")
#   cpu_tree PID          prints CPU seconds (user + system) of PID and its
#                         children, all threads, from /proc
#   rss_tree PID          prints the resident memory in KiB of PID and its
#                         children, from /proc

say() { echo "== $*" >&2; }

bench_build_tandem() {
  if [[ -n ${TANDEM_BIN:-} ]]; then
    tandem=$(realpath "$TANDEM_BIN")
    [[ -x $tandem ]] || { echo "TANDEM_BIN=$TANDEM_BIN is not an executable" >&2; exit 1; }
    say "using $tandem (TANDEM_BIN; not rebuilt)"
    return 0
  fi
  say "building tandem (release)"
  (cd "$repo" && cargo build --release -q -p tandem-cli >&2)
  tandem=${CARGO_TARGET_DIR:-$repo/target}/release/tandem
  # cargo resolves a relative CARGO_TARGET_DIR against the workspace root.
  [[ $tandem == /* ]] || tandem=$repo/$tandem
}

# Same lookup as tandem_modelfile::fetch::cache_dir.
bench_cache_dir() {
  if [[ -n ${TANDEM_CACHE:-} ]]; then echo "$TANDEM_CACHE"
  elif [[ -n ${XDG_CACHE_HOME:-} ]]; then echo "$XDG_CACHE_HOME/tandem"
  else echo "$HOME/.cache/tandem"; fi
}

bench_resolve_gguf() {
  if [[ -n ${GGUF:-} ]]; then
    gguf=$GGUF
  else
    # MODEL names a tandem alias (smollm2-135m, qwen2.5-coder-0.5b,
    # gemma3-270m): fetched into the cache by tandem itself, the same way
    # `--model ALIAS` does.
    local cache alias=${MODEL:-smollm2-135m}
    cache=$(bench_cache_dir)
    [[ $alias =~ ^[a-z0-9.-]+$ ]] || { echo "MODEL must be a tandem alias" >&2; exit 2; }
    gguf=$(ls "$cache/$alias"/*.gguf 2>/dev/null | head -n1 || true)
    if [[ -z $gguf ]]; then
      say "fetching $alias"
      "$tandem" generate --model "$alias" --prompt hi --max-tokens 1 --temperature 0 >/dev/null
      gguf=$(ls "$cache/$alias"/*.gguf | head -n1)
    fi
  fi
  [[ -f $gguf ]] || { echo "model not found: $gguf" >&2; exit 1; }
}

# Builds llama.cpp with ../shared/tools/build-llama-cpp.sh. That build uses
# GGML_NATIVE=ON, which compiles AMX tile code on CPUs that advertise it and
# dies (SIGILL / GPF on ldtilecfg) where the VM does not enable tiles: then
# rebuild with the CPU's ISA flags spelled out and AMX off.
bench_llama_cpp() {
  local targets=(llama-bench llama-batched-bench llama-server)
  say "building llama.cpp (shared/tools/build-llama-cpp.sh)"
  bin=$("$repo/../shared/tools/build-llama-cpp.sh" ${LLAMA_CPP_VERSION:+"$LLAMA_CPP_VERSION"} | tail -n1)
  local build src cpuflags reason="" rc=0
  build=$(dirname "$bin")
  src=$(dirname "$build")
  [[ -x $bin/llama-bench ]] || { echo "no llama-bench in $bin" >&2; exit 1; }
  cpuflags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
  has() { [[ $cpuflags == *" $1 "* ]]; }
  onoff() { if has "$1"; then echo ON; else echo OFF; fi; }
  smoke() {
    # A 32-token prompt takes the batched matmul path, where AMX kernels live.
    "$bin/llama-bench" -m "$gguf" -t "$threads" -p 32 -n 1 -r 1 -o json \
      >"$out/smoke.json" 2>"$out/smoke.err"
  }
  if grep -q '^GGML_NATIVE:BOOL=ON' "$build/CMakeCache.txt" 2>/dev/null && has amx_tile; then
    reason="GGML_NATIVE=ON on a CPU that advertises amx_tile"
  elif grep -qE '^GGML_AMX_(TILE|INT8|BF16):BOOL=ON' "$build/CMakeCache.txt" 2>/dev/null; then
    reason="built with GGML_AMX_*=ON"
  else
    smoke || rc=$?
    # 132 SIGILL, 139 SIGSEGV (a GPF on ldtilecfg shows up as one), ...
    ((rc == 0)) || reason="llama-bench smoke test failed (exit $rc; see $out/smoke.err)"
  fi
  if [[ -n $reason ]]; then
    say "rebuilding llama.cpp without AMX: $reason"
    local isa=(-DGGML_NATIVE=OFF
      -DGGML_AVX="$(onoff avx)" -DGGML_AVX2="$(onoff avx2)" -DGGML_FMA="$(onoff fma)"
      -DGGML_F16C="$(onoff f16c)" -DGGML_BMI2="$(onoff bmi2)" -DGGML_AVX_VNNI="$(onoff avx_vnni)"
      -DGGML_AVX512="$(onoff avx512f)" -DGGML_AVX512_VNNI="$(onoff avx512_vnni)"
      -DGGML_AVX512_BF16="$(onoff avx512_bf16)" -DGGML_AVX512_VBMI="$(onoff avx512vbmi)"
      -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
    say "cmake ${isa[*]}"
    cmake -S "$src" -B "$build" "${isa[@]}" >&2
    cmake --build "$build" -j"$(nproc)" --target "${targets[@]}" >&2
    smoke || { echo "llama-bench still fails after the rebuild; see $out/smoke.err" >&2; exit 1; }
  else
    local t
    for t in "${targets[@]}"; do
      [[ -x $bin/$t ]] || { say "building $t"; cmake --build "$build" -j"$(nproc)" --target "$t" >&2; }
    done
  fi
  llama_flags=$(grep -E '^GGML_(NATIVE|AVX[A-Z0-9_]*|AMX[A-Z_]*):BOOL=ON' "$build/CMakeCache.txt" \
    | cut -d: -f1 | tr '\n' ' ' || true)
}

# --- processes ----------------------------------------------------------------
pids=()
start_timeout=${start_timeout:-120}

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

start_bg() { # name cmd...
  local name=$1; shift
  # Emptied here, not by the background job's redirection: wait_log must
  # not find the marker in a previous run's log of the same name.
  : >"$out/$name.log"
  "$@" >>"$out/$name.log" 2>&1 &
  pids+=($!)
}

wait_log() { # name marker [pid]
  local name=$1 marker=$2 pid=${3:-${pids[-1]}} i
  for ((i = 0; i < start_timeout * 5; i++)); do
    grep -qs "$marker" "$out/$name.log" && return 0
    kill -0 "$pid" 2>/dev/null || { echo "$name died:" >&2; tail -n 20 "$out/$name.log" >&2; exit 1; }
    sleep 0.2
  done
  echo "$name not ready after ${start_timeout}s (see $out/$name.log)" >&2; exit 1
}

start() { # name marker cmd...
  local name=$1 marker=$2; shift 2
  start_bg "$name" "$@"
  wait_log "$name" "$marker"
}

wait_http() { # url [pattern]
  local i body
  for ((i = 0; i < start_timeout * 5; i++)); do
    if body=$(curl -sf "$1" 2>/dev/null) && { [[ -z ${2:-} ]] || grep -q "$2" <<<"$body"; }; then
      return 0
    fi
    sleep 0.2
  done
  echo "no answer${2:+ matching $2} from $1" >&2; exit 1
}

stop_pids() { # pid...
  local p keep=()
  for p in "$@"; do pkill -P "$p" 2>/dev/null || true; kill "$p" 2>/dev/null || true; done
  for p in "$@"; do wait "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do [[ " $* " == *" $p "* ]] || keep+=("$p"); done
  pids=("${keep[@]}")
}

stop_all() {
  stop_pids "${pids[@]}"
  rm -rf "$out/etcd-data"
}

start_etcd() {
  local ec ep
  ec=$(free_port); ep=$(free_port)
  etcd_url=http://127.0.0.1:$ec
  rm -rf "$out/etcd-data"
  start etcd "ready to serve client requests" etcd --data-dir "$out/etcd-data" \
    --listen-client-urls "$etcd_url" --advertise-client-urls "$etcd_url" \
    --listen-peer-urls "http://127.0.0.1:$ep" --initial-advertise-peer-urls "http://127.0.0.1:$ep" \
    --initial-cluster "default=http://127.0.0.1:$ep"
}

port_of() { grep -o "$2 http://127.0.0.1:[0-9]*" "$out/$1.log" | head -n1 | grep -o '[0-9]*$'; }

cpu_tree() { # pid -> seconds
  local total=0 p
  for p in $1 $(pgrep -P "$1" 2>/dev/null || true); do
    [[ -r /proc/$p/stat ]] || continue
    total=$(awk -v t="$total" -v hz="$(getconf CLK_TCK)" '{ sub(/^.*\) /, ""); printf "%.3f", t + ($12 + $13) / hz }' "/proc/$p/stat")
  done
  echo "$total"
}

rss_tree() { # pid -> KiB
  local total=0 p kib
  for p in $1 $(pgrep -P "$1" 2>/dev/null || true); do
    # A process that exits meanwhile (or a kernel thread) has no VmRSS.
    kib=$(awk '/VmRSS/ {print $2}' "/proc/$p/status" 2>/dev/null || true)
    total=$((total + ${kib:-0}))
  done
  echo "$total"
}
