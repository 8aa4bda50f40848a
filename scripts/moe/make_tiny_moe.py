#!/usr/bin/env python3
"""Writes two tiny random Mixtral-style checkpoints and reference logits
computed by HuggingFace transformers, for tandem-engine's MoE tests.

    engine/tests/data/tiny-moe/          softmax top-2 routing (Mixtral)
    engine/tests/data/tiny-moe-sigmoid/  sigmoid routing + selection bias,
                                         normalised top-k, scaling 2.5
                                         (DeepSeek-V3 style)

Each holds config.json, model.safetensors (classic Mixtral hub tensor
names, float32) and reference.json (logits at every position of four
prompts, from a float64 run of transformers' MixtralForCausalLM).

Run from the repository root:
    python3 -m venv /tmp/moe-venv && /tmp/moe-venv/bin/pip install -r scripts/moe/requirements.txt
    /tmp/moe-venv/bin/python scripts/moe/make_tiny_moe.py
"""

import json
import math
import os
import sys

import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import save_file
from transformers import MixtralConfig, MixtralForCausalLM
from transformers.models.mixtral import modeling_mixtral

SEED = 20261122
OUT = "engine/tests/data"
HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, EXPERTS, TOP_K, VOCAB = 64, 128, 2, 8, 4, 8, 2, 256
SIGMOID_SCALING = 2.5
# Routing must not hinge on rounding: the k-th and (k+1)-th selection
# scores of every token differ by at least this much.
MIN_GAP = 1e-3

HF_CONFIG = {
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "intermediate_size": FFN,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "head_dim": HIDDEN // HEADS,
    "hidden_act": "silu",
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "sliding_window": None,
    "num_local_experts": EXPERTS,
    "num_experts_per_tok": TOP_K,
    "router_jitter_noise": 0.0,
    "attention_dropout": 0.0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}


def build_model():
    cfg = MixtralConfig(**{k: v for k, v in HF_CONFIG.items() if k not in ("architectures", "model_type", "torch_dtype")})
    cfg._attn_implementation = "eager"
    # The plain per-expert loop (grouped_mm has no float64 kernel).
    cfg._experts_implementation = "eager"
    torch.manual_seed(SEED)
    model = MixtralForCausalLM(cfg).eval()
    # Scales that give spread-out logits and decisive routing (the default
    # std 0.02 init makes everything near-uniform, a useless test).
    g = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.endswith("gate.weight"):  # router
                p.copy_(torch.randn(p.shape, generator=g) * 2.0 / math.sqrt(HIDDEN))
            elif "down_proj" in name and p.dim() == 3:  # experts' down
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(FFN))
            elif "lm_head" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 2.0 / math.sqrt(HIDDEN))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
    return model.double()


def classic_state_dict(model):
    """The weights under the Mixtral hub names, float32, experts unfused."""
    out = {}
    for name, t in model.state_dict().items():
        t = t.detach().to(torch.float32).contiguous()
        if name.endswith("experts.gate_up_proj"):
            prefix = name[: -len("experts.gate_up_proj")].replace(".mlp.", ".block_sparse_moe.")
            for e in range(EXPERTS):
                out[f"{prefix}experts.{e}.w1.weight"] = t[e, :FFN].clone()
                out[f"{prefix}experts.{e}.w3.weight"] = t[e, FFN:].clone()
        elif name.endswith("experts.down_proj"):
            prefix = name[: -len("experts.down_proj")].replace(".mlp.", ".block_sparse_moe.")
            for e in range(EXPERTS):
                out[f"{prefix}experts.{e}.w2.weight"] = t[e].clone()
        elif name.endswith("gate.weight"):
            out[name.replace(".mlp.", ".block_sparse_moe.")] = t
        elif "rotary_emb" in name:
            continue
        else:
            out[name] = t
    return out


def sigmoid_router_forward(self, hidden_states):
    """DeepSeek-V3 routing in place of Mixtral's softmax: select by
    sigmoid score + bias, weight by the unbiased scores, normalise, scale."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states, self.weight)
    scores = router_logits.sigmoid()
    _, idx = torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1)
    weights = scores.gather(-1, idx)
    weights = weights / weights.sum(dim=-1, keepdim=True) * SIGMOID_SCALING
    return router_logits, weights, idx


def min_routing_gap(model, prompts, biased):
    """Smallest gap between the k-th and (k+1)-th selection score."""
    gaps = []

    def hook(module, args, output):
        logits = output[0]
        if biased:
            sel = logits.sigmoid() + module.e_score_correction_bias
        else:
            sel = logits.softmax(dim=-1)
        top = torch.topk(sel, TOP_K + 1, dim=-1).values
        gaps.append((top[:, TOP_K - 1] - top[:, TOP_K]).min().item())

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, modeling_mixtral.MixtralTopKRouter)]
    with torch.no_grad():
        for p in prompts:
            model(torch.tensor([p]))
    for h in handles:
        h.remove()
    return min(gaps)


def write(dirname, model, config, tensors, prompts):
    path = os.path.join(OUT, dirname)
    os.makedirs(path, exist_ok=True)
    with torch.no_grad():
        logits = [model(torch.tensor([p])).logits[0].tolist() for p in prompts]
    flat = torch.tensor([v for l in logits for row in l for v in row])
    print(f"{dirname}: logits std {flat.std().item():.3f}, max |logit| {flat.abs().max().item():.3f}")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    save_file(tensors, os.path.join(path, "model.safetensors"))
    ref = {
        "generator": "scripts/moe/make_tiny_moe.py",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "dtype": "float64 forward of float32 weights",
        "prompts": prompts,
        "logits": [[[float(f"{v:.7g}") for v in row] for row in l] for l in logits],
    }
    with open(os.path.join(path, "reference.json"), "w") as f:
        json.dump(ref, f, separators=(",", ":"))
        f.write("\n")


def main():
    if not os.path.isdir(OUT):
        sys.exit(f"run from the repository root ({OUT} not found)")
    model = build_model()
    g = torch.Generator().manual_seed(SEED + 1)
    prompts = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (1, 5, 12, 17)]

    tensors = classic_state_dict(model)
    gap = min_routing_gap(model, prompts, biased=False)
    print(f"tiny-moe: min routing gap {gap:.2e}")
    assert gap > MIN_GAP, f"softmax routing gap {gap} too small: pick another seed"
    write("tiny-moe", model, HF_CONFIG, tensors, prompts)

    # Same weights, sigmoid routing with a per-layer selection bias.
    routers = [m for m in model.modules() if isinstance(m, modeling_mixtral.MixtralTopKRouter)]
    biased = dict(tensors)
    for i, r in enumerate(routers):
        bias = torch.randn(EXPERTS, generator=g, dtype=torch.float64) * 0.5
        bias = bias.to(torch.float32)
        r.e_score_correction_bias = bias.to(torch.float64)
        biased[f"model.layers.{i}.block_sparse_moe.gate.e_score_correction_bias"] = bias
    modeling_mixtral.MixtralTopKRouter.forward = sigmoid_router_forward
    gap = min_routing_gap(model, prompts, biased=True)
    print(f"tiny-moe-sigmoid: min routing gap {gap:.2e}")
    assert gap > MIN_GAP, f"sigmoid routing gap {gap} too small: pick another seed"
    config = dict(HF_CONFIG, scoring_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=SIGMOID_SCALING)
    write("tiny-moe-sigmoid", model, config, biased, prompts)


if __name__ == "__main__":
    main()
