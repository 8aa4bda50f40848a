#!/usr/bin/env bash
# Fetches NVRTC (CUDA's run-time C++ compiler) from PyPI's
# nvidia-cuda-nvrtc-cu12 wheel, for tandem-gpu's check that every kernel's
# CUDA form compiles (gpu/src/kernels/cuda_form.rs). NVRTC needs no GPU and
# no driver. Prints the folder holding libnvrtc.so.12 (put it on
# LD_LIBRARY_PATH). Idempotent: a second run downloads nothing.
#   usage: scripts/fetch-nvrtc.sh [DIR]   (default ~/.cache/tandem/nvrtc)
set -euo pipefail

version=12.9.86
sha256=210cf05005a447e29214e9ce50851e83fc5f4358df8b453155d5e1918094dcb4
wheel=nvidia_cuda_nvrtc_cu12-$version-py3-none-manylinux2010_x86_64.manylinux_2_12_x86_64.whl
dest=${1:-$HOME/.cache/tandem/nvrtc}
lib=$dest/$version
if [[ -f $lib/.complete ]]; then echo "$lib"; exit 0; fi

mkdir -p "$dest"
work=$(mktemp -d "$dest/.fetch.XXXXXX")
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --platform manylinux_2_12_x86_64 \
  "nvidia-cuda-nvrtc-cu12==$version" -d "$work" >&2
echo "$sha256  $work/$wheel" | sha256sum -c --status ||
  { echo "checksum mismatch for $wheel" >&2; exit 1; }
# The compiler and its builtins library; the wheel's .alt variants and
# header are not needed.
python3 - "$work/$wheel" "$work/lib" <<'PY'
import os, sys, zipfile
wheel, out = sys.argv[1], sys.argv[2]
os.makedirs(out)
with zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        base = os.path.basename(name)
        if name.startswith("nvidia/cuda_nvrtc/lib/") and ".alt." not in base:
            with z.open(name) as src, open(os.path.join(out, base), "wb") as dst:
                dst.write(src.read())
PY
rm -rf "$lib"
mv "$work/lib" "$lib"
touch "$lib/.complete"
echo "$lib"
