#!/usr/bin/env python3
"""Converts a Llama-family GGUF (SmolLM2-135M-Instruct here) into an HF-style
`LlamaForCausalLM` directory, independently of Tandem's Rust code, so the
engine's safetensors loader can be tested against the GGUF path.

- Weights: dequantized by the `gguf` package (`gguf.quants.dequantize`),
  reshaped to reversed(GGUF shape) = (out, in), renamed to HF names. llama.cpp's
  convert_hf_to_gguf permutes the rows of q_proj/k_proj for its interleaved
  rope (`w.reshape(n_head, 2, hd//2, dim).swapaxes(1, 2)`); HF checkpoints use
  NeoX-style rotate_half, so the inverse permutation is applied here (k_proj
  with n_kv_head). Saved with the `safetensors` package, split into 2 files
  plus a model.safetensors.index.json.
- Tokenizer: transformers' GGUF tokenizer loader needs torch, so tokenizer.json
  is built with the `tokenizers` package from the GGUF vocabulary and merges
  (ByteLevel BPE; pre-tokenizer Sequence[Digits(individual_digits=True),
  ByteLevel(add_prefix_space=False)] as in SmolLM2's own tokenizer.json;
  ByteLevel decoder; token_type 3/4 tokens as special added tokens).
  tokenizer_config.json carries the GGUF's chat template and BOS/EOS.

Pinned versions (scripts/make-hf-fixture.sh installs exactly these):
  gguf==0.19.0 numpy==2.4.6 safetensors==0.7.0 tokenizers==0.22.2

usage: scripts/reference/gguf_to_hf.py GGUF OUTDIR [--dtype f32|f16|bf16]
"""
import argparse
import json
import os
import sys

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors import serialize_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

N_FILES = 2


def field(r, key, default=None):
    f = r.fields.get(key)
    return default if f is None else f.contents()


def unpermute(w, n_head):
    """Inverse of convert_hf_to_gguf's `permute` (interleaved -> NeoX rows)."""
    rows, cols = w.shape
    hd = rows // n_head
    return w.reshape(n_head, hd // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def to_dtype(a, dtype):
    """(numpy-compatible dtype name for safetensors, little-endian bytes)."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    if dtype == "f32":
        return "float32", a.astype("<f4").tobytes()
    if dtype == "f16":
        return "float16", a.astype("<f2").tobytes()
    # bf16 (numpy has no bfloat16): round to nearest even on the f32 bits.
    bits = a.view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(a)
    rounded[nan] = 0x7FC0
    return "bfloat16", rounded.astype("<u2").tobytes()


def convert_weights(r, out, dtype):
    arch = field(r, "general.architecture")
    if arch != "llama":
        sys.exit(f"unsupported architecture {arch!r}")
    n_head = int(field(r, "llama.attention.head_count"))
    n_kv = int(field(r, "llama.attention.head_count_kv", n_head))
    n_layers = int(field(r, "llama.block_count"))
    names = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    per_layer = {
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }
    for i in range(n_layers):
        for g, h in per_layer.items():
            names[f"blk.{i}.{g}.weight"] = f"model.layers.{i}.{h}.weight"

    tensors = {}
    for t in r.tensors:
        if t.name not in names:
            sys.exit(f"unexpected tensor {t.name}")
        w = dequantize(t.data, t.tensor_type).astype(np.float32)
        w = w.reshape(tuple(int(d) for d in reversed(t.shape)))
        if t.name.endswith("attn_q.weight"):
            w = unpermute(w, n_head)
        elif t.name.endswith("attn_k.weight"):
            w = unpermute(w, n_kv)
        tensors[names[t.name]] = w
    tied = "lm_head.weight" not in tensors

    # Split into N_FILES files of about equal size, in a stable order.
    order = sorted(tensors)
    total = sum(tensors[k].nbytes for k in order)
    files, acc = [[] for _ in range(N_FILES)], 0
    for k in order:
        files[min(N_FILES - 1, acc * N_FILES // total)].append(k)
        acc += tensors[k].nbytes
    weight_map = {}
    for n, keys in enumerate(files):
        fname = f"model-{n + 1:05d}-of-{N_FILES:05d}.safetensors"
        flat = {}
        for k in keys:
            dt, data = to_dtype(tensors[k], dtype)
            flat[k] = {"dtype": dt, "shape": list(tensors[k].shape), "data": data}
            weight_map[k] = fname
        serialize_file(flat, os.path.join(out, fname), metadata={"format": "pt"})
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)

    emb = tensors["model.embed_tokens.weight"]
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": int(field(r, "llama.embedding_length")),
        "intermediate_size": int(field(r, "llama.feed_forward_length")),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "num_hidden_layers": n_layers,
        "head_dim": int(field(r, "llama.embedding_length")) // n_head,
        "vocab_size": int(emb.shape[0]),
        "rms_norm_eps": float(np.float32(field(r, "llama.attention.layer_norm_rms_epsilon"))),
        "rope_theta": float(field(r, "llama.rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "max_position_embeddings": int(field(r, "llama.context_length")),
        "tie_word_embeddings": tied,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": int(field(r, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(field(r, "tokenizer.ggml.eos_token_id")),
        "torch_dtype": {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}[dtype],
    }
    if "llama.rope.dimension_count" in r.fields:
        assert int(field(r, "llama.rope.dimension_count")) == config["head_dim"], "partial rope"
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def convert_tokenizer(r, out):
    model = field(r, "tokenizer.ggml.model")
    if model != "gpt2":
        sys.exit(f"unsupported tokenizer model {model!r}")
    tokens = list(field(r, "tokenizer.ggml.tokens"))
    types = list(field(r, "tokenizer.ggml.token_type"))
    merges = [tuple(m.split(" ", 1)) for m in field(r, "tokenizer.ggml.merges")]
    vocab = {t: i for i, t in enumerate(tokens)}
    assert len(vocab) == len(tokens), "duplicate tokens"

    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, fuse_unk=False,
                              byte_fallback=False))
    tk.normalizer = None
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
    ])
    tk.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
    tk.post_processor = processors.ByteLevel(add_prefix_space=True, trim_offsets=False,
                                             use_regex=True)
    special = [tokens[i] for i, ty in enumerate(types) if ty in (3, 4)]
    tk.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in special])
    for s in special:
        assert tk.token_to_id(s) == vocab[s], f"special token {s!r} moved"
    tk.save(os.path.join(out, "tokenizer.json"))

    bos = tokens[int(field(r, "tokenizer.ggml.bos_token_id"))]
    eos = tokens[int(field(r, "tokenizer.ggml.eos_token_id"))]
    unk_id = field(r, "tokenizer.ggml.unknown_token_id")
    pad_id = field(r, "tokenizer.ggml.padding_token_id")
    cfg = {
        "add_bos_token": bool(field(r, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(field(r, "tokenizer.ggml.add_eos_token", False)),
        "added_tokens_decoder": {
            str(vocab[s]): {"content": s, "lstrip": False, "normalized": False,
                            "rstrip": False, "single_word": False, "special": True}
            for s in special
        },
        "additional_special_tokens": [s for s in special if s not in (bos, eos)],
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": tokens[int(unk_id)] if unk_id is not None else None,
        "pad_token": tokens[int(pad_id)] if pad_id is not None else None,
        "chat_template": field(r, "tokenizer.chat_template"),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(field(r, "llama.context_length")),
        "tokenizer_class": "GPT2Tokenizer",
    }
    assert cfg["chat_template"], "GGUF has no chat template"
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2, ensure_ascii=False)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("gguf")
    ap.add_argument("outdir")
    ap.add_argument("--dtype", choices=["f32", "f16", "bf16"], default="f32")
    a = ap.parse_args()
    os.makedirs(a.outdir, exist_ok=True)
    r = GGUFReader(a.gguf)
    convert_tokenizer(r, a.outdir)
    convert_weights(r, a.outdir, a.dtype)


if __name__ == "__main__":
    main()
