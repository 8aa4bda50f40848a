#!/usr/bin/env python3
"""Produces engine/tests/data/tokenizer_llama_tokenize_refs.json: token ids
from llama.cpp's own `llama-tokenize` (the llama.cpp vendored in
llama-cpp-python 0.3.36, built by shared/tools/build-llama-cpp.sh plus the
llama-tokenize target) for varied strings on the real Gemma 3 and Qwen2.5
Coder GGUFs and llama.cpp's SentencePiece test vocabularies, each with no
BOS and no special parsing, BOS and special parsing, and special parsing
alone. Checked by engine/tests/tokenizer.rs::encode_matches_llama_tokenize.

usage: scripts/reference/llama_tokenize_refs.py
"""
import json, os, subprocess, sys, tempfile
B = os.path.expanduser("~/.cache/tandem-anchors/llama-cpp-0.3.36/src/vendor/llama.cpp/build/bin")
V = os.path.expanduser("~/.cache/tandem/llama-vocab")
models = {
    "gemma3": os.path.expanduser("~/.cache/tandem/gemma3-270m/gemma-3-270m-q4_k_m.gguf"),
    "qwen2.5-coder": os.path.expanduser("~/.cache/tandem/qwen2.5-coder-0.5b/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"),
    "llama-spm": f"{V}/ggml-vocab-llama-spm.gguf",
    "phi-3": f"{V}/ggml-vocab-phi-3.gguf",
    "baichuan": f"{V}/ggml-vocab-baichuan.gguf",
}
texts = [
    "Hello world",
    " Hello world",
    "   leading spaces and trailing   ",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "fn main() {\n\tlet x = vec![1, 2, 3];\n\tprintln!(\"{x:?}\");\n}\n",
    "a\n\nb\n\n\n\nc\r\n\td\t\t\te",
    "emoji 🦙👋🏽🇫🇷 ❤️ 👨‍👩‍👧",
    "你好，世界！今天天气很好。 こんにちは 안녕하세요",
    "مرحبا بالعالم नमस्ते दुनिया Привет, мир",
    "<table><tr><td>1</td></tr></table> <b>bold</b>",
    "<start_of_turn>user\nhi there<end_of_turn>\n<start_of_turn>model\n",
    "<s>[INST] Hello [/INST]</s> <unk> <0x41>",
    "<|user|>\nWhat is 2+2?<|end|>\n<|assistant|>\n",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n",
    "                                        forty spaces then text",
    "\n" * 40 + "x",
    "1234567890 3.14159 -42 1e10 0xDEADBEEF",
    "ied 4 ½ months Äpfel ▁ ▁▁ \u2581x",
    "",
    " ",
    "\u00a0nbsp\u3000ideographic\u200bzero-width",
]
out = []
tmp = tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False, encoding="utf-8", newline="")
tmp.close()
for name, path in models.items():
    for text in texts:
        for add_special, parse_special in [(False, False), (True, True), (False, True)]:
            with open(tmp.name, "w", encoding="utf-8", newline="") as f:
                f.write(text)
            args = [f"{B}/llama-tokenize", "-m", path, "-f", tmp.name, "--no-escape", "--ids", "--log-disable"]
            if not add_special: args.append("--no-bos")
            if not parse_special: args.append("--no-parse-special")
            r = subprocess.run(args, capture_output=True, text=True, env={**os.environ, "LD_LIBRARY_PATH": B})
            if r.returncode != 0:
                print(name, repr(text), r.stderr[-500:], file=sys.stderr); sys.exit(1)
            line = [l for l in r.stdout.splitlines() if l.startswith("[")][-1]
            ids = json.loads(line)
            out.append({"model": name, "text": text, "add_special": add_special, "parse_special": parse_special, "ids": ids})
os.unlink(tmp.name)
dest = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "engine", "tests", "data",
                    "tokenizer_llama_tokenize_refs.json")
with open(dest, "w", encoding="utf-8") as f:
    json.dump(out, f, ensure_ascii=False, indent=None)
print(len(out), "cases ->", dest)
