#!/usr/bin/env bash
# The GPU checks for a lent NVIDIA machine (no Rust toolchain there), from
# binaries built here:
#   usage: bench/gpu-device-check.sh BIN_DIR [GGUF]
# BIN_DIR holds, stripped: tandem, test-kernels and test-llama (tandem-gpu's
# tests/kernels.rs and tests/llama.rs), bench-kernels and bench-step
# (benches/kernels.rs, benches/step.rs), and lib/ with the shared libraries
# tandem links (UCX, libnuma). GGUF is SmolLM2's; the Qwen2.5 test runs only
# with TANDEM_TEST_QWEN2_GGUF set (its file is 4x larger to carry), the
# Gemma 3 one only with TANDEM_TEST_GEMMA3_GGUF, the safetensors one only
# with TANDEM_TEST_HF_DIR (SmolLM2's F32 fixture).
# Runs: every kernel against its CPU reference on the device, the device's
# copy bandwidth and decode matmuls against it; with GGUF also SmolLM2
# teacher-forced against the CPU engine, the scheduler's GPU runner
# (batches, KV round trips) and bench/gpu.sh (CPU vs GPU, one sequence and
# batched serving).
# The GPU is reached through Vulkan (NVIDIA's ICD); libvulkan1 must be
# installed (the device tool's notes say how to carry it).
# CHECKS=kernels,model,serve (default all) picks the parts to run; serve
# starts `tandem serve --devices gpu:0` and sends it a few requests.
set -uo pipefail
bin=$(realpath "$1")
gguf=${2:-}
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export LD_LIBRARY_PATH="$bin/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export XDG_RUNTIME_DIR=${XDG_RUNTIME_DIR:-$(mktemp -d)}
icd=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
[[ -z ${VK_DRIVER_FILES:-} && -f $icd ]] && export VK_DRIVER_FILES=$icd
status=0
step() { echo; echo "== $*"; }
check() { "$@" || { echo "FAILED ($?): $*"; status=1; }; }

checks=${CHECKS:-kernels,model,serve}
step device
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv || true
if [[ $checks == *kernels* ]]; then
  step "kernels vs the CPU reference"
  check "$bin/test-kernels" --test-threads 1
  step "copy bandwidth and decode matmuls"
  bw=${GPU_BW_GBS:-}
  case $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1) in
    *H200*) bw=${bw:-4800} ;;
    *H100*) bw=${bw:-3350} ;;
  esac
  if [[ -x $bin/bench-kernels ]]; then
    GPU_BW_GBS=$bw check "$bin/bench-kernels" gpu:0
  else
    echo "(no bench-kernels in $bin: skipped)"
  fi
fi
if [[ -n $gguf && $checks == *model* ]]; then
  step "SmolLM2 on the GPU vs the CPU engine (teacher-forced greedy)"
  skip=()
  [[ -n ${TANDEM_TEST_QWEN2_GGUF:-} ]] || skip+=(--skip qwen2_5)
  [[ -n ${TANDEM_TEST_GEMMA3_GGUF:-} ]] || skip+=(--skip gemma3)
  [[ -n ${TANDEM_TEST_HF_DIR:-} ]] || skip+=(--skip bf16_safetensors)
  TANDEM_TEST_GGUF=$gguf check "$bin/test-llama" --nocapture "${skip[@]}"
  if [[ -x $bin/bench-step ]]; then
    step "a decode step's host enqueue time against the whole step"
    check "$bin/bench-step" "$gguf"
  fi
  step "bench/gpu.sh"
  TANDEM_BIN="$bin/tandem" GGUF=$gguf ROUNDS=${ROUNDS:-2} check "$repo/bench/gpu.sh" gpu:0
fi
if [[ -n $gguf && $checks == *serve* ]]; then
  step "tandem serve --devices gpu:0"
  log=$(mktemp)
  "$bin/tandem" serve --model "$gguf" --devices gpu:0 --port 0 --max-length 1024 >"$log" 2>&1 &
  pid=$!
  for _ in $(seq 120); do grep -q "tandem: serving" "$log" && break; sleep 0.5; done
  cat "$log"
  port=$(grep -o 'http://127.0.0.1:[0-9]*' "$log" | head -1 | cut -d: -f3)
  if [[ -z $port ]]; then
    echo "FAILED: serve did not start"; status=1
  else
    check python3 - "$port" <<'PY'
import json, sys, time, urllib.request
port = sys.argv[1]
def call(path, body=None):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}",
                                 data=None if body is None else json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req) as r:
        return json.load(r)
print("health:", call("/health"))
name = call("/v1/models")["data"][0]["id"]
for prompt, n in [("The capital of France is", 12), ("def fibonacci(n):", 128)]:
    t = time.time()
    v = call("/v1/completions", {"model": name, "prompt": prompt, "max_tokens": n,
                                 "temperature": 0, "ignore_eos": True})
    dt = time.time() - t
    u = v["usage"]
    print(f"{prompt!r}: {u['completion_tokens']} tokens in {dt:.2f} s "
          f"({u['completion_tokens'] / dt:.1f} tok/s end to end): {v['choices'][0]['text'][:80]!r}")
PY
  fi
  kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null
fi
exit $status
