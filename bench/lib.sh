# Shared set-up for the bench/ scripts; source it, then call the functions in
# order. Each sets variables the caller uses:
#   bench_build_tandem   -> tandem  (release binary, built if needed)
#   bench_resolve_gguf   -> gguf    ($GGUF, else the alias $MODEL or the
#                                    default model, fetched)
#   bench_llama_cpp      -> bin     (llama.cpp bin dir with llama-bench,
#                                    llama-batched-bench and llama-server)
# Callers set: repo, threads, out. See bench/README.md.

say() { echo "== $*" >&2; }

bench_build_tandem() {
  say "building tandem (release)"
  (cd "$repo" && cargo build --release -q -p tandem-cli >&2)
  tandem=${CARGO_TARGET_DIR:-$repo/target}/release/tandem
  # cargo resolves a relative CARGO_TARGET_DIR against the workspace root.
  [[ $tandem == /* ]] || tandem=$repo/$tandem
}

bench_resolve_gguf() {
  if [[ -n ${GGUF:-} ]]; then
    gguf=$GGUF
  else
    # MODEL names a tandem alias (smollm2-135m, qwen2.5-coder-0.5b,
    # gemma3-270m): fetched into the cache by tandem itself, the same way
    # `--model ALIAS` does. Same lookup as tandem_modelfile::fetch::cache_dir.
    local cache alias=${MODEL:-smollm2-135m}
    if [[ -n ${TANDEM_CACHE:-} ]]; then cache=$TANDEM_CACHE
    elif [[ -n ${XDG_CACHE_HOME:-} ]]; then cache=$XDG_CACHE_HOME/tandem
    else cache=$HOME/.cache/tandem; fi
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
