#!/usr/bin/env python3
"""Produces the independent references the engine is tested against.

- engine/tests/data/greedy_refs.json: greedy continuations from llama.cpp's
  llama-server (built by shared/tools/build-llama-cpp.sh, llama.cpp vendored in
  llama-cpp-python 0.3.36) on the same GGUF, single slot, 2 threads, prompt given
  as token ids. Run once with flash attention off and once on; both are stored.
  Chat prompts are rendered with Python's jinja2 from the GGUF's template
  (trim_blocks/lstrip_blocks, as HF's apply_chat_template), tokenized by
  llama-server's /tokenize.
- engine/tests/data/logits_refs.json: last-position logits from an independent
  float32 numpy implementation of the Llama forward pass over weights
  dequantized by the `gguf` Python package (no activation quantization, f32 KV),
  plus llama.cpp's top-20 log-probabilities for the same position.

usage: scripts/reference/model_refs.py GGUF LLAMA_CPP_BIN_DIR
"""
import json, os, socket, subprocess, sys, time, urllib.request

import numpy as np
import jinja2
from gguf import GGUFReader
from gguf.quants import dequantize

GGUF, BIN = sys.argv[1], sys.argv[2]
OUT = os.path.join(os.path.dirname(__file__), "..", "..", "engine", "tests", "data")

PLAIN = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village at the edge of a great forest, there lived",
    "List of prime numbers: 2, 3, 5, 7,",
    "The theory of relativity, developed by Albert Einstein, states that",
    "import numpy as np\n\n# Compute the mean and standard deviation of a list of numbers\n",
    "Recipe for pancakes:\nIngredients:\n-",
    "Water boils at 100 degrees Celsius at sea level. At higher altitudes,",
]
CHATS = [
    [{"role": "user", "content": "Write a detailed paragraph explaining why the sky is blue."}],
    [{"role": "system", "content": "You are a concise assistant who answers in full sentences."},
     {"role": "user", "content": "Describe how a bicycle works, step by step."}],
    [{"role": "user", "content": "What is 12 times 13?"},
     {"role": "assistant", "content": "12 times 13 is 156."},
     {"role": "user", "content": "Now explain how you computed it, in detail, and give two more examples."}],
    [{"role": "user", "content": "Give me three tips for staying healthy, with a short explanation for each."}],
    [{"role": "user", "content": "Write a short poem about the ocean."}],
]
N_PREDICT = 64


def post(port, path, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def free_port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p


def server(fa):
    port = free_port()
    p = subprocess.Popen([os.path.join(BIN, "llama-server"), "-m", GGUF, "--port", str(port), "--host", "127.0.0.1",
                          "-t", "2", "-np", "1", "-c", "2048", "-fa", fa, "--no-warmup"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(300):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return p, port
        except Exception:
            time.sleep(0.2)
    p.kill(); raise SystemExit("llama-server did not start")


def render_chat(template, messages):
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template).render(messages=messages, add_generation_prompt=True,
                                            bos_token="<|im_start|>", eos_token="<|im_end|>")


reader = GGUFReader(GGUF)
field = reader.fields["tokenizer.chat_template"]
template = bytes(field.parts[field.data[0]]).decode()
prompts = [{"kind": "plain", "text": t} for t in PLAIN] + \
          [{"kind": "chat", "messages": m, "text": render_chat(template, m)} for m in CHATS]

results = {}
for fa in ["off", "on"]:
    proc, port = server(fa)
    try:
        for pr in prompts:
            ids = post(port, "/tokenize", {"content": pr["text"], "add_special": False, "parse_special": True})["tokens"]
            pr["prompt_ids"] = ids
            r = post(port, "/completion", {"prompt": ids, "n_predict": N_PREDICT, "temperature": 0, "top_k": 1,
                                           "cache_prompt": False, "return_tokens": True, "n_probs": 20,
                                           "post_sampling_probs": False})
            first = r["completion_probabilities"][0]
            results.setdefault(pr["text"], {})[fa] = {
                "tokens": r["tokens"], "text": r["content"], "stop_type": r.get("stop_type"),
                "first_top_logprobs": [[t["id"], t["logprob"]] for t in first["top_logprobs"]],
            }
    finally:
        proc.kill(); proc.wait()

greedy = []
for pr in prompts:
    off, on = results[pr["text"]]["off"], results[pr["text"]]["on"]
    agree = 0
    while agree < min(len(off["tokens"]), len(on["tokens"])) and off["tokens"][agree] == on["tokens"][agree]:
        agree += 1
    greedy.append({**pr, "flash_attn_off": off, "flash_attn_on": on, "fa_on_off_agree_tokens": agree})
    print(f"{pr['kind']:5} {len(pr['prompt_ids']):3} prompt tokens, {len(off['tokens'])} generated, "
          f"fa on/off agree on {agree}: {off['text'][:60]!r}", file=sys.stderr)
with open(os.path.join(OUT, "greedy_refs.json"), "w") as f:
    json.dump({"model_sha256": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
               "llama_cpp": "vendored in llama-cpp-python 0.3.36", "n_predict": N_PREDICT,
               "prompts": greedy}, f, indent=1, ensure_ascii=False)

# ---- independent numpy reference of the forward pass ----
T = {t.name: t for t in reader.tensors}
def W(name):
    t = T[name]
    return dequantize(t.data, t.tensor_type).reshape([int(x) for x in reversed(t.shape)]).astype(np.float32)
def meta(k):
    f = reader.fields[k]; return f.parts[f.data[0]][0]
L, D = int(meta("llama.block_count")), int(meta("llama.embedding_length"))
H, HKV = int(meta("llama.attention.head_count")), int(meta("llama.attention.head_count_kv"))
HD, EPS, THETA = D // H, float(meta("llama.attention.layer_norm_rms_epsilon")), float(meta("llama.rope.freq_base"))
emb = W("token_embd.weight")
layers = [{k: W(f"blk.{i}.{k}.weight") for k in ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                                                   "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"]} for i in range(L)]
out_norm = W("output_norm.weight")

def rms(x, w):
    return x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + EPS).astype(np.float32) * w

def rope(x, pos):  # x: [T, heads, HD], GGUF (interleaved-pair) convention
    inv = THETA ** (-np.arange(0, HD, 2, dtype=np.float64) / HD)
    ang = pos[:, None].astype(np.float64) * inv[None, :]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x0, x1 = x[..., 0::2].astype(np.float64), x[..., 1::2].astype(np.float64)
    y = np.empty_like(x, dtype=np.float64)
    y[..., 0::2] = x0 * c - x1 * s
    y[..., 1::2] = x0 * s + x1 * c
    return y.astype(np.float32)

def forward(ids):
    n = len(ids); pos = np.arange(n)
    x = emb[ids]
    mask = np.triu(np.full((n, n), -np.inf, dtype=np.float32), 1)
    for l in layers:
        h = rms(x, l["attn_norm"])
        q = rope((h @ l["attn_q"].T).reshape(n, H, HD), pos)
        k = rope((h @ l["attn_k"].T).reshape(n, HKV, HD), pos)
        v = (h @ l["attn_v"].T).reshape(n, HKV, HD)
        rep = H // HKV
        k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
        att = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(HD) + mask
        att = np.exp(att - att.max(-1, keepdims=True)); att /= att.sum(-1, keepdims=True)
        o = np.einsum("hqk,khd->qhd", att, v).reshape(n, D)
        x = x + o @ l["attn_output"].T
        h = rms(x, l["ffn_norm"])
        g, u = h @ l["ffn_gate"].T, h @ l["ffn_up"].T
        x = x + ((g / (1 + np.exp(-g))) * u) @ l["ffn_down"].T
    return rms(x[-1:], out_norm)[0] @ emb.T

logit_refs = []
for pr in [prompts[0], prompts[2], prompts[len(PLAIN)], prompts[len(PLAIN) + 2]]:  # 2 plain, 2 chat: keeps the file small
    lg = forward(np.array(pr["prompt_ids"]))
    logit_refs.append({"text": pr["text"], "prompt_ids": pr["prompt_ids"],
                       "numpy_f32_logits": [round(float(v), 3) for v in lg],
                       "llama_cpp_top_logprobs": results[pr["text"]]["off"]["first_top_logprobs"]})
    print(f"numpy argmax {int(lg.argmax())} vs llama.cpp first token {results[pr['text']]['off']['tokens'][0]}", file=sys.stderr)
with open(os.path.join(OUT, "logits_refs.json"), "w") as f:
    json.dump({"note": "numpy float32 reference forward, dequantized weights", "prompts": logit_refs}, f)
