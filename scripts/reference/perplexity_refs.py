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

With a PREFIX (another model family: qwen2, gemma3) the file is
PREFIX-perplexity_refs.json, or PREFIX-perplexity_ctxN_refs.json for an
N_CTX other than 512. Where the vocab adds BOS (gemma3), llama-perplexity
tokenizes the text with BOS first and, in each chunk, overwrites the chunk's
first token with BOS for the evaluation (restoring it afterwards: `tokens`
and the scored next tokens are the originals, and the overwritten token is
never scored); the file then says "bos_per_chunk": true.

usage: scripts/reference/perplexity_refs.py GGUF LLAMA_CPP_BIN_DIR [PREFIX [N_CTX]]
"""
import array, hashlib, json, os, re, struct, subprocess, sys, tempfile

GGUF, BIN = sys.argv[1], sys.argv[2]
PREFIX = sys.argv[3] if len(sys.argv) > 3 else None
DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "engine", "tests", "data")
TEXT = os.path.join(DATA, "perplexity_text.txt")
OUT = os.environ.get("TANDEM_REFS_OUT") or DATA
N_CTX = int(sys.argv[4]) if len(sys.argv) > 4 else 512
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
bos_per_chunk = False
if PREFIX is not None:
    from gguf import GGUFReader
    meta = GGUFReader(GGUF).fields
    bos_per_chunk = bool(meta["tokenizer.ggml.add_bos_token"].contents()) if "tokenizer.ggml.add_bos_token" in meta else False
    bos_id = meta["tokenizer.ggml.bos_token_id"].contents() if bos_per_chunk else None
    assert not bos_per_chunk or tokens[0] == bos_id, "llama-tokenize did not put BOS first"
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

scheme = ("chunks of n_ctx tokens from an empty cache, no BOS (the vocab adds none); "
          "logits at positions n_ctx/2..n_ctx-2 score the next token; running_ppl[i] = "
          "exp(mean NLL over chunks 0..=i)")
if bos_per_chunk:
    scheme = ("the text tokenized with BOS first (the vocab adds BOS), cut into chunks of n_ctx tokens; each chunk "
              "is evaluated from an empty cache with its first token replaced by BOS (`tokens` holds the "
              "originals); logits at positions n_ctx/2..n_ctx-2 score the next (original) token; running_ppl[i] = "
              "exp(mean NLL over chunks 0..=i)")
refs = {
    "about": "llama-perplexity on perplexity_text.txt; made by scripts/reference/perplexity_refs.py"
             + ("" if PREFIX is None else f" GGUF LLAMA_CPP_BIN_DIR {PREFIX} {N_CTX}"),
    "llama_cpp": {"source": "llama-cpp-python==0.3.36 sdist (vendor/llama.cpp)", "version": version},
    "gguf": {"file": os.path.basename(GGUF), "sha256": sha256(GGUF)},
    "text": {"file": "perplexity_text.txt", "sha256": sha256(TEXT)},
    "n_ctx": N_CTX,
    "scheme": scheme,
    **({} if PREFIX is None else {"bos_per_chunk": bos_per_chunk, "bos_id": bos_id, "threads": THREADS}),
    "tokens": tokens,
    "runs": runs,
}
# One key per line, runs one per line: the long arrays stay on one line each.
name = "perplexity_refs.json" if N_CTX == 512 else f"perplexity_ctx{N_CTX}_refs.json"
with open(os.path.join(OUT, name if PREFIX is None else f"{PREFIX}-{name}"), "w") as f:
    f.write("{\n")
    for i, (k, v) in enumerate(refs.items()):
        if k == "runs":
            body = "[\n" + ",\n".join("  " + json.dumps(r) for r in v) + "\n ]"
        else:
            body = json.dumps(v)
        f.write(f" {json.dumps(k)}: {body}{',' if i + 1 < len(refs) else ''}\n")
    f.write("}\n")
