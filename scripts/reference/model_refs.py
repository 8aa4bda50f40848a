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

With a PREFIX (another model family: qwen2, gemma3), the files are
PREFIX-greedy_refs.json and PREFIX-logits_refs.json, each recording how it
was made (llama.cpp version, server flags, GGUF sha256). Prompts are then
tokenized with the vocab's own add_special rule (BOS first where the GGUF
says add_bos: llama-server adds none to a prompt given as ids), chat prompts
come only from a GGUF with a chat template (tool-calling ones for qwen2,
rendered with HF's `tojson`: json.dumps, no HTML escaping), and the numpy
float32 reference (qwen2: biases, NEOX RoPE; gemma3: see forward_gemma3)
stores, per prompt, its log-sum-exp and its logits at its top 64 tokens
and at llama.cpp's top 20 (flash attention off and on) instead of the whole
vocabulary.

usage: scripts/reference/model_refs.py GGUF LLAMA_CPP_BIN_DIR [PREFIX]
"""
import hashlib, json, os, socket, subprocess, sys, time, urllib.request

import numpy as np
import jinja2
from gguf import GGUFReader
from gguf.quants import dequantize

GGUF, BIN = sys.argv[1], sys.argv[2]
PREFIX = sys.argv[3] if len(sys.argv) > 3 else None
OUT = os.environ.get("TANDEM_REFS_OUT") or os.path.join(os.path.dirname(__file__), "..", "..", "engine", "tests", "data")

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
# Qwen2.5's template renders tool definitions, assistant tool calls and tool
# results itself. Keys are in sorted order at every level so that a `tojson`
# that sorts keys renders the same text.
WEATHER_TOOL = {"function": {"description": "Get the current weather in a city.", "name": "get_weather",
                             "parameters": {"properties": {"city": {"description": "The city name.", "type": "string"},
                                                           "unit": {"enum": ["celsius", "fahrenheit"], "type": "string"}},
                                            "required": ["city"], "type": "object"}},
                "type": "function"}
QWEN_CHATS = [
    ({"messages": [{"role": "user", "content": "Write a Python function that checks whether a string is a palindrome, and explain it."}]}),
    ({"messages": [{"role": "system", "content": "You are a concise assistant who answers in full sentences."},
                   {"role": "user", "content": "Describe how a bicycle works, step by step."}]}),
    ({"messages": [{"role": "user", "content": "What is 12 times 13?"},
                   {"role": "assistant", "content": "12 times 13 is 156."},
                   {"role": "user", "content": "Now explain how you computed it, in detail, and give two more examples."}]}),
    ({"tools": [WEATHER_TOOL],
      "messages": [{"role": "user", "content": "What is the weather like in Paris right now? Use celsius."}]}),
    ({"tools": [WEATHER_TOOL],
      "messages": [{"role": "user", "content": "What is the weather like in Paris right now? Use celsius."},
                   {"role": "assistant", "content": "",
                    "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                                                                     "arguments": {"city": "Paris", "unit": "celsius"}}}]},
                   {"role": "tool", "content": "{\"city\": \"Paris\", \"condition\": \"light rain\", \"temperature\": 14}"}]}),
]
N_PREDICT = 64
THREADS = 2
SERVER_FLAGS = ["-t", str(THREADS), "-np", "1", "-c", "2048", "--no-warmup"]


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
                          *SERVER_FLAGS[:6], "-fa", fa, *SERVER_FLAGS[6:]],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(300):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return p, port
        except Exception:
            time.sleep(0.2)
    p.kill(); raise SystemExit("llama-server did not start")


def hf_tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' apply_chat_template replaces jinja2's tojson (which
    # escapes HTML and sorts keys) with this.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def render_chat(template, messages, tools=None, bos="<|im_start|>", eos="<|im_end|>"):
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = hf_tojson
    extra = {"tools": tools} if tools is not None else {}
    return env.from_string(template).render(messages=messages, add_generation_prompt=True,
                                            bos_token=bos, eos_token=eos, **extra)


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def field_value(reader, key, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


reader = GGUFReader(GGUF)
ARCH = field_value(reader, "general.architecture")
ADD_BOS = bool(field_value(reader, "tokenizer.ggml.add_bos_token", False))
field = reader.fields.get("tokenizer.chat_template")
template = bytes(field.parts[field.data[0]]).decode() if field is not None else None
if PREFIX is None:
    prompts = [{"kind": "plain", "text": t} for t in PLAIN] + \
              [{"kind": "chat", "messages": m, "text": render_chat(template, m)} for m in CHATS]
else:
    vocab = field_value(reader, "tokenizer.ggml.tokens")
    tok_text = lambda key: vocab[field_value(reader, key)] if field_value(reader, key) is not None else ""
    bos_text, eos_text = tok_text("tokenizer.ggml.bos_token_id"), tok_text("tokenizer.ggml.eos_token_id")
    chats = [] if template is None else QWEN_CHATS if ARCH == "qwen2" else [{"messages": m} for m in CHATS]
    # A plain prompt gets BOS where the vocab adds it (llama-server's
    # /completion adds none to ids); a chat template writes its own.
    prompts = [{"kind": "plain", "text": t, "add_special": ADD_BOS} for t in PLAIN] + \
              [{"kind": "chat", **c, "text": render_chat(template, c["messages"], c.get("tools"), bos_text, eos_text),
                "add_special": False} for c in chats]

results = {}
for fa in ["off", "on"]:
    proc, port = server(fa)
    try:
        for pr in prompts:
            ids = post(port, "/tokenize", {"content": pr["text"], "add_special": pr.get("add_special", False),
                                           "parse_special": True})["tokens"]
            pr["prompt_ids"] = ids
            r = post(port, "/completion", {"prompt": ids, "n_predict": N_PREDICT, "temperature": 0, "top_k": 1,
                                           "cache_prompt": False, "return_tokens": True, "n_probs": 20,
                                           "post_sampling_probs": False})
            if PREFIX is not None:
                assert r["tokens_evaluated"] == len(ids), (r["tokens_evaluated"], len(ids))
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
if PREFIX is None:
    with open(os.path.join(OUT, "greedy_refs.json"), "w") as f:
        json.dump({"model_sha256": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
                   "llama_cpp": "vendored in llama-cpp-python 0.3.36", "n_predict": N_PREDICT,
                   "prompts": greedy}, f, indent=1, ensure_ascii=False)
    made_with = None
else:
    version = subprocess.run([os.path.join(BIN, "llama-server"), "--version"], capture_output=True,
                             text=True).stderr.strip().splitlines()
    made_with = {
        "script": "scripts/reference/model_refs.py GGUF LLAMA_CPP_BIN_DIR " + PREFIX,
        "llama_cpp": {"source": "llama-cpp-python==0.3.36 sdist (vendor/llama.cpp), built by "
                                "shared/tools/build-llama-cpp.sh", "version": version},
        "llama_server_flags": SERVER_FLAGS + ["-fa", "off|on"],
        "request": {"n_predict": N_PREDICT, "temperature": 0, "top_k": 1, "cache_prompt": False,
                    "n_probs": 20, "post_sampling_probs": False, "prompt": "token ids from /tokenize"},
        "tokenize": {"add_special": "per prompt (BOS first for plain prompts where the vocab adds BOS)",
                     "parse_special": True},
        "chat_rendering": "jinja2 (trim_blocks, lstrip_blocks) from tokenizer.chat_template, add_generation_prompt, "
                          "tojson = json.dumps(ensure_ascii=False) as transformers' apply_chat_template",
        "gguf": {"file": os.path.basename(GGUF), "sha256": sha256(GGUF), "architecture": ARCH, "add_bos": ADD_BOS},
    }
    with open(os.path.join(OUT, f"{PREFIX}-greedy_refs.json"), "w") as f:
        json.dump({"model_sha256": made_with["gguf"]["sha256"], "made_with": made_with, "n_predict": N_PREDICT,
                   "prompts": greedy}, f, indent=1, ensure_ascii=False)

# ---- independent numpy float32 references of other families' forward passes ----
def family_numpy_refs():
    T = {t.name: t for t in reader.tensors}
    def W(name):
        t = T[name]
        return dequantize(t.data, t.tensor_type).reshape([int(x) for x in reversed(t.shape)]).astype(np.float32)
    meta = lambda k: field_value(reader, f"{ARCH}.{k}")
    L, D = int(meta("block_count")), int(meta("embedding_length"))
    H, HKV = int(meta("attention.head_count")), int(meta("attention.head_count_kv"))
    HD = int(meta("attention.key_length") or D // H)
    EPS = float(meta("attention.layer_norm_rms_epsilon"))

    def rms(x, w):
        return x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + EPS).astype(np.float32) * w

    def rope_neox(x, pos, theta):  # x: [T, heads, HD]; rotates pairs (i, i + HD/2)
        inv = theta ** (-np.arange(0, HD, 2, dtype=np.float64) / HD)
        ang = pos[:, None].astype(np.float64) * inv[None, :]
        c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        x0, x1 = x[..., :HD // 2].astype(np.float64), x[..., HD // 2:].astype(np.float64)
        return np.concatenate([x0 * c - x1 * s, x0 * s + x1 * c], axis=-1).astype(np.float32)

    def attend(q, k, v, scale, mask):
        rep = q.shape[1] // k.shape[1]
        k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
        att = np.einsum("qhd,khd->hqk", q, k) * np.float32(scale) + mask
        att = np.exp(att - att.max(-1, keepdims=True)); att /= att.sum(-1, keepdims=True)
        return np.einsum("hqk,khd->qhd", att, v).reshape(q.shape[0], -1)

    def causal(n, window=None):
        p = np.arange(n)
        masked = p[None, :] > p[:, None]  # [query, key]
        if window is not None:  # llama.cpp's is_masked_swa (standard): query - key >= window
            masked |= (p[:, None] - p[None, :]) >= window
        return np.where(masked, -np.inf, 0.0).astype(np.float32)

    emb = W("token_embd.weight")
    out_norm = W("output_norm.weight")
    head = W("output.weight") if "output.weight" in T else emb
    if ARCH == "qwen2":
        THETA = float(meta("rope.freq_base"))
        names = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"]
        layers = [{**{k: W(f"blk.{i}.{k}.weight") for k in names},
                   **{k + "_b": W(f"blk.{i}.{k}.bias") for k in ["attn_q", "attn_k", "attn_v"]}} for i in range(L)]

        def forward(ids):
            n = len(ids); pos = np.arange(n); mask = causal(n)
            x = emb[ids]
            for l in layers:
                h = rms(x, l["attn_norm"])
                q = rope_neox((h @ l["attn_q"].T + l["attn_q_b"]).reshape(n, H, HD), pos, THETA)
                k = rope_neox((h @ l["attn_k"].T + l["attn_k_b"]).reshape(n, HKV, HD), pos, THETA)
                v = (h @ l["attn_v"].T + l["attn_v_b"]).reshape(n, HKV, HD)
                x = x + attend(q, k, v, 1 / np.sqrt(HD), mask) @ l["attn_output"].T
                h = rms(x, l["ffn_norm"])
                g, u = h @ l["ffn_gate"].T, h @ l["ffn_up"].T
                x = x + ((g / (1 + np.exp(-g))) * u) @ l["ffn_down"].T
            return rms(x[-1:], out_norm)[0] @ head.T
        about = "qwen2: RMSNorm, q/k/v biases, NEOX RoPE base %g, SiLU-gated FFN, scale 1/sqrt(%d)" % (THETA, HD)
    elif ARCH == "gemma3":
        # As llama.cpp's src/models/gemma3.cpp with this GGUF's metadata: no
        # sliding_window_pattern key, so layer i slides iff i % 6 < 5; sliding
        # layers use RoPE base 10000 (rope_freq_base_train_swa's default, no
        # rope.freq_base_swa key), global ones rope.freq_base; Q scaled by
        # 1/sqrt(head_dim) before QK^T; the GGUF's norm weights already hold
        # Gemma's (1 + w); GELU with the tanh approximation; no softcapping key.
        THETA, THETA_SWA, SWA = float(meta("rope.freq_base")), 10000.0, int(meta("attention.sliding_window"))
        assert meta("final_logit_softcapping") is None and meta("rope.freq_base_swa") is None
        assert meta("attention.sliding_window_pattern") is None
        names = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm",
                 "post_attention_norm", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down", "post_ffw_norm"]
        layers = [{k: W(f"blk.{i}.{k}.weight") for k in names} for i in range(L)]

        def gelu_tanh(x):
            return 0.5 * x * (1 + np.tanh(np.float32(np.sqrt(2 / np.pi)) * (x + np.float32(0.044715) * x ** 3)))

        def forward(ids):
            n = len(ids); pos = np.arange(n)
            masks = {False: causal(n), True: causal(n, SWA)}
            x = emb[ids] * np.float32(np.sqrt(D))
            for i, l in enumerate(layers):
                swa = i % 6 < 5
                theta = THETA_SWA if swa else THETA
                h = rms(x, l["attn_norm"])
                q = rope_neox(rms((h @ l["attn_q"].T).reshape(n, H, HD), l["attn_q_norm"]), pos, theta)
                k = rope_neox(rms((h @ l["attn_k"].T).reshape(n, HKV, HD), l["attn_k_norm"]), pos, theta)
                v = (h @ l["attn_v"].T).reshape(n, HKV, HD)
                o = attend(q * np.float32(1 / np.sqrt(HD)), k, v, 1.0, masks[swa]) @ l["attn_output"].T
                x = x + rms(o, l["post_attention_norm"])
                h = rms(x, l["ffn_norm"])
                f = (gelu_tanh(h @ l["ffn_gate"].T) * (h @ l["ffn_up"].T)) @ l["ffn_down"].T
                x = x + rms(f, l["post_ffw_norm"])
            return rms(x[-1:], out_norm)[0] @ head.T
        about = ("gemma3: embeddings x sqrt(%d); layer i sliding (window %d, RoPE base %g) iff i %% 6 < 5, else "
                 "global (RoPE base %g); NEOX RoPE; RMS QK-norm per head; Q x 1/sqrt(%d); post-attention and "
                 "post-FFN RMSNorm; GELU(tanh)-gated FFN; tied output" % (D, SWA, THETA_SWA, THETA, HD))
    else:
        raise SystemExit(f"no numpy reference for {ARCH}")

    refs = []
    for pr in prompts:
        lg = forward(np.array(pr["prompt_ids"])).astype(np.float64)
        lse = float(np.log(np.exp(lg - lg.max()).sum()) + lg.max())
        off, on = results[pr["text"]]["off"], results[pr["text"]]["on"]
        keep = set(int(i) for i in np.argsort(-lg)[:64])
        keep |= {t[0] for t in off["first_top_logprobs"]} | {t[0] for t in on["first_top_logprobs"]}
        top2 = np.sort(lg)[-2:]
        refs.append({"text": pr["text"], "prompt_ids": pr["prompt_ids"],
                     "numpy_f32_argmax": int(lg.argmax()), "numpy_f32_top2_gap": round(float(top2[1] - top2[0]), 4),
                     "numpy_f32_logsumexp": round(lse, 4),
                     "numpy_f32_logits": [[i, round(float(lg[i]), 4)] for i in sorted(keep, key=lambda i: -lg[i])],
                     "llama_cpp_top_logprobs": off["first_top_logprobs"],
                     "llama_cpp_top_logprobs_fa_on": on["first_top_logprobs"]})
        d = max(abs(lp - (lg[i] - lse)) for i, lp in off["first_top_logprobs"])
        print(f"numpy argmax {int(lg.argmax())} (gap {top2[1] - top2[0]:.3f}) vs llama.cpp first token "
              f"{off['tokens'][0] if off['tokens'] else None}; llama.cpp top-20 vs numpy max |dlogprob| {d:.3f}",
              file=sys.stderr)
    with open(os.path.join(OUT, f"{PREFIX}-logits_refs.json"), "w") as f:
        json.dump({"note": "last prompt position: llama.cpp's top-20 log-probabilities (flash attention off, on) "
                           "and a numpy float32 reference forward over weights dequantized by the gguf package "
                           "(no activation quantization, f32 K/V): its log-sum-exp and its logits at its top 64 "
                           "and llama.cpp's top-20 tokens (log-probability = logit - logsumexp)",
                   "numpy_forward": about, "made_with": made_with, "prompts": refs}, f)


if PREFIX is not None:
    family_numpy_refs()
    sys.exit(0)

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
