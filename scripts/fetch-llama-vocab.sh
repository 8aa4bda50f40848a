#!/usr/bin/env bash
# Fetches llama.cpp's tokenizer test vocabularies (ggml-vocab-NAME.gguf with
# its .inp inputs and .out expected token ids) for engine/tests/tokenizer.rs.
# They ship in the llama-cpp-python source distribution on PyPI, which
# vendors llama.cpp; only the files the test reads are kept. Prints the
# folder (also the test's TANDEM_LLAMA_VOCAB_DIR). Idempotent: a second run
# downloads nothing.
#   usage: scripts/fetch-llama-vocab.sh [DIR]   (default ~/.cache/tandem/llama-vocab)
set -euo pipefail

version=0.3.36
sha256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
dest=${1:-${TANDEM_LLAMA_VOCAB_DIR:-$HOME/.cache/tandem/llama-vocab}}
# Vocabularies of the tokenizer types Tandem implements, with their test
# cases (.inp inputs, .out expected ids): byte-level BPE ("gpt2") whose
# pre-tokenizer we have, and SentencePiece ("llama").
vocabs=(command-r deepseek-coder deepseek-llm falcon gpt-2 llama-bpe mpt qwen2 qwen35
  refact starcoder llama-spm phi-3)
# SentencePiece vocabularies the sdist ships without test cases.
vocabs_bare=(baichuan)

# The stamp names what was extracted: a changed list re-extracts.
list_sum=$(echo "${vocabs[*]} / ${vocabs_bare[*]}" | sha256sum | cut -c1-12)
stamp=$dest/.llama-cpp-python-$version-$list_sum
if [[ -f $stamp ]]; then echo "$dest"; exit 0; fi

mkdir -p "$dest"
work=$(mktemp -d "$dest/.fetch.XXXXXX")
trap 'rm -rf "$work"' EXIT
sdist=llama_cpp_python-$version.tar.gz
# shared/tools/build-llama-cpp.sh keeps the same sdist: reuse it if present.
anchor=${LLAMA_CPP_HOME:-$HOME/.cache/tandem-anchors/llama-cpp-$version}/dl/$sdist
if [[ -f $anchor ]] && echo "$sha256  $anchor" | sha256sum -c --status; then
  cp "$anchor" "$work/"
else
  # pip reads the sdist's metadata in an isolated environment (its build
  # backend from wheels) and builds nothing.
  python3 -m pip download -q --no-deps --no-binary llama-cpp-python \
    "llama-cpp-python==$version" -d "$work" >&2
fi
echo "$sha256  $work/$sdist" | sha256sum -c --status ||
  { echo "checksum mismatch for $sdist" >&2; exit 1; }

members=()
for v in "${vocabs[@]}"; do
  for ext in "" .inp .out; do
    members+=("llama_cpp_python-$version/vendor/llama.cpp/models/ggml-vocab-$v.gguf$ext")
  done
done
for v in "${vocabs_bare[@]}"; do
  members+=("llama_cpp_python-$version/vendor/llama.cpp/models/ggml-vocab-$v.gguf")
done
tar xzf "$work/$sdist" -C "$work" "${members[@]}"
mv "$work/llama_cpp_python-$version/vendor/llama.cpp/models/"ggml-vocab-* "$dest/"
touch "$stamp"
echo "$dest"
