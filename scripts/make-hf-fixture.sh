#!/usr/bin/env bash
# Makes the HF-style model directory that engine/tests/hf_dir.rs loads:
#   TANDEM_TEST_GGUF=.../SmolLM2-135M-Instruct.Q4_1.gguf scripts/make-hf-fixture.sh OUTDIR
# converts the GGUF with scripts/reference/gguf_to_hf.py (F32 weights in two
# safetensors files, tokenizer.json, tokenizer_config.json, config.json).
# Does nothing when OUTDIR/config.json already exists (written last, and the
# directory is only moved into place once complete).
set -euo pipefail
cd "$(dirname "$0")/.."

out=${1:?usage: TANDEM_TEST_GGUF=FILE.gguf scripts/make-hf-fixture.sh OUTDIR}
gguf=${TANDEM_TEST_GGUF:?set TANDEM_TEST_GGUF to the SmolLM2-135M-Instruct Q4_1 GGUF}
if [[ -f $out/config.json ]]; then
  exit 0
fi

# Exact versions the converter was written and checked against.
python3 -m pip install -q --disable-pip-version-check \
  gguf==0.19.0 numpy==2.4.6 safetensors==0.7.0 tokenizers==0.22.2

tmp="$out.tmp.$$"
trap 'rm -rf "$tmp"' EXIT
rm -rf "$tmp"
python3 scripts/reference/gguf_to_hf.py "$gguf" "$tmp" --dtype f32
rm -rf "$out"
mkdir -p "$(dirname "$out")"
mv "$tmp" "$out"
