#!/usr/bin/env bash
# The GPU checks for a lent NVIDIA machine (no Rust toolchain there), from
# binaries built here:
#   usage: bench/gpu-device-check.sh BIN_DIR [GGUF]
# BIN_DIR holds, stripped: tandem, test-kernels and test-llama (tandem-gpu's
# tests/kernels.rs and tests/llama.rs), bench-kernels (benches/kernels.rs),
# and lib/ with the shared libraries tandem links (UCX, libnuma).
# Runs: every kernel against its CPU reference on the device, the device's
# copy bandwidth and decode matmuls against it; with GGUF also SmolLM2
# teacher-forced against the CPU engine and bench/gpu.sh (CPU vs GPU).
# The GPU is reached through Vulkan (NVIDIA's ICD); libvulkan1 must be
# installed (the device tool's notes say how to carry it).
# CHECKS=kernels,model (default both) picks the parts to run.
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

checks=${CHECKS:-kernels,model}
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
  GPU_BW_GBS=$bw check "$bin/bench-kernels" gpu:0
fi
if [[ -n $gguf && $checks == *model* ]]; then
  step "SmolLM2 on the GPU vs the CPU engine (teacher-forced greedy)"
  TANDEM_TEST_GGUF=$gguf check "$bin/test-llama" --nocapture
  step "bench/gpu.sh"
  TANDEM_BIN="$bin/tandem" GGUF=$gguf ROUNDS=${ROUNDS:-2} check "$repo/bench/gpu.sh" gpu:0
fi
exit $status
