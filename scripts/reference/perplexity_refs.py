#!/usr/bin/env python3
"""Produces engine/tests/data/perplexity_refs.json: llama.cpp's perplexity
of the GGUF on engine/tests/data/perplexity_text.txt, the reference for
engine/tests/model.rs::perplexity_matches_llama_cpp.

llama.cpp is the one vendored in llama-cpp-python 0.3.36, built by
shared/tools/build-llama-cpp.sh (plus the llama-tokenize target, which this
script builds if missing). `llama-perplexity` runs with its default scheme:
the text (less one trailing newline) is tokenized without BOS for this vocab,
cut into floor(n / n_ctx) chunks of n_ctx tokens (the rest is dropped); each
chunk is evaluated from an empty cache at positions 0..n_ctx-1 and only its
second half is scored: logits at positions n_ctx/2 .. n_ctx-2 against the
next token, n_ctx/2 - 1 tokens per chunk. It prints the running perplexity
after each chunk and the final one. Run once with flash attention off and
once on (llama.cpp's own spread between its two attention paths), 2 threads.
Each run also saves its log-probabilities (--kl-divergence-base, which
changes nothing in the computation): the file holds the tokens it scored and,
per scored position, the whole vocabulary's log-probabilities quantized to 16
bits over [max - 16, max]; kept here is the log-probability of the token that
follows (resolution 16/65535; null where it lies below max - 16). The token
ids also come from `llama-tokenize`, which must agree.

usage: scripts/reference/perplexity_refs.py GGUF LLAMA_CPP_BIN_DIR
"""
import array, hashlib, json, os, re, struct, subprocess, sys, tempfile

GGUF, BIN = sys.argv[1], sys.argv[2]
DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "engine", "tests", "data")
TEXT = os.path.join(DATA, "perplexity_text.txt")
N_CTX = 512
THREADS = 2


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def run(cmd, **kw):
    return subprocess.run(cmd, check=True, capture_output=True, text=True, **kw)


def read_logits_file(path):
    """Tokens and each scored position's next-token log-probability from
    llama-perplexity's --kl-divergence-base file."""
    with open(path, "rb") as f:
        data = f.read()
    assert data[:8] == b"_logits_"
    n_ctx, n_vocab, n_chunk = struct.unpack_from("<iii", data, 8)
    off = 20
    toks = list(struct.unpack_from(f"<{n_chunk * n_ctx}i", data, off))
    off += 4 * n_chunk * n_ctx
    nv = 2 * ((n_vocab + 1) // 2) + 4
    first = n_ctx // 2
    rows = array.array("H", data[off:])
    assert len(rows) == n_chunk * (n_ctx - 1 - first) * nv
    out = []
    for c in range(n_chunk):
        for i in range(n_ctx - 1 - first):
            row = (c * (n_ctx - 1 - first) + i) * nv
            scale, min_log_prob = struct.unpack("<ff", rows[row:row + 4].tobytes())
            q = rows[row + 4 + toks[c * n_ctx + first + i + 1]]
            out.append(round(min_log_prob + scale * q, 5) if q else None)
    return toks, out


if not os.path.exists(os.path.join(BIN, "llama-tokenize")):
    run(["cmake", "--build", os.path.join(BIN, ".."), "--target", "llama-tokenize"])

text = open(TEXT, encoding="utf-8").read()
# llama-perplexity's -f drops one trailing newline; feed llama-tokenize the same.
if text.endswith("\n"):
    text = text[:-1]
tokens = json.loads(run(
    [os.path.join(BIN, "llama-tokenize"), "-m", GGUF, "--stdin", "--ids", "--no-escape",
     "--no-parse-special", "--log-disable"], input=text).stdout.strip())

version = run([os.path.join(BIN, "llama-perplexity"), "--version"]).stderr.strip().splitlines()
runs = []
for fa in ["off", "on"]:
    cmd = ["llama-perplexity", "-m", os.path.basename(GGUF), "-f", "engine/tests/data/perplexity_text.txt",
           "--ctx-size", str(N_CTX), "--batch-size", str(N_CTX), "-t", str(THREADS), "-fa", fa]
    with tempfile.TemporaryDirectory() as tmp:
        base = os.path.join(tmp, "logits.bin")
        out = run([os.path.join(BIN, cmd[0]), "-m", GGUF, "-f", TEXT] + cmd[5:] + ["--kl-divergence-base", base])
        scored_tokens, logprobs = read_logits_file(base)
    assert scored_tokens == tokens[:len(scored_tokens)], "llama-perplexity and llama-tokenize disagree"
    log = out.stdout + out.stderr
    chunks = [float(x) for x in re.findall(r"\[\d+\]([0-9.]+),", log)]
    m = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", log)
    m_chunks = re.search(r"calculating perplexity over (\d+) chunks, n_ctx=(\d+)", log)
    assert m and m_chunks, log
    assert int(m_chunks.group(1)) == len(chunks) == len(tokens) // N_CTX, (len(chunks), len(tokens))
    assert int(m_chunks.group(2)) == N_CTX
    runs.append({
        "flash_attn": fa,
        "command": " ".join(cmd),
        "running_ppl": chunks,
        "ppl": float(m.group(1)),
        "ppl_stderr": float(m.group(2)),
        "next_token_logprobs": logprobs,
    })
    print(f"flash attention {fa}: PPL {m.group(1)} +/- {m.group(2)}, running {chunks}", file=sys.stderr)

refs = {
    "about": "llama-perplexity on perplexity_text.txt; made by scripts/reference/perplexity_refs.py",
    "llama_cpp": {"source": "llama-cpp-python==0.3.36 sdist (vendor/llama.cpp)", "version": version},
    "gguf": {"file": os.path.basename(GGUF), "sha256": sha256(GGUF)},
    "text": {"file": "perplexity_text.txt", "sha256": sha256(TEXT)},
    "n_ctx": N_CTX,
    "scheme": "chunks of n_ctx tokens from an empty cache, no BOS (the vocab adds none); "
              "logits at positions n_ctx/2..n_ctx-2 score the next token; running_ppl[i] = "
              "exp(mean NLL over chunks 0..=i)",
    "tokens": tokens,
    "runs": runs,
}
# One key per line, runs one per line: the long arrays stay on one line each.
with open(os.path.join(DATA, "perplexity_refs.json"), "w") as f:
    f.write("{\n")
    for i, (k, v) in enumerate(refs.items()):
        if k == "runs":
            body = "[\n" + ",\n".join("  " + json.dumps(r) for r in v) + "\n ]"
        else:
            body = json.dumps(v)
        f.write(f" {json.dumps(k)}: {body}{',' if i + 1 < len(refs) else ''}\n")
    f.write("}\n")
