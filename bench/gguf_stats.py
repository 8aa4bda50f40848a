"""GGUF facts the benchmark summaries need, read with the standard library
only: each tensor's name, dims, element count and stored bytes, and a dense
decoder's per-token weight bytes and multiply-accumulates."""

import struct


def read_tensors(path):
    """(metadata without vocabularies, [(name, dims, elements, bytes)])."""
    # ggml type -> (elements per block, bytes per block)
    blk = {0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24),
           8: (32, 34), 9: (32, 36), 10: (256, 84), 11: (256, 110), 12: (256, 144),
           13: (256, 176), 14: (256, 210), 15: (256, 292), 30: (1, 2)}
    scalar = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?",
              10: "Q", 11: "q", 12: "d"}
    with open(path, "rb") as f:
        def rd(fmt):
            return struct.unpack("<" + fmt, f.read(struct.calcsize("<" + fmt)))[0]

        def rstr():
            return f.read(rd("Q")).decode("utf-8", "replace")

        def rval(t):
            if t == 8:
                return rstr()
            if t == 9:
                et, n = rd("I"), rd("Q")
                if et in scalar and n > 64:  # vocabularies: skipped
                    f.seek(n * struct.calcsize(scalar[et]), 1)
                    return None
                return [rval(et) for _ in range(n)]
            return rd(scalar[t])

        assert f.read(4) == b"GGUF", "not a GGUF file"
        rd("I")
        n_t, n_kv = rd("Q"), rd("Q")
        meta = {}
        for _ in range(n_kv):
            k = rstr()
            meta[k] = rval(rd("I"))
        tensors = []
        for _ in range(n_t):
            name = rstr()
            dims = [rd("Q") for _ in range(rd("I"))]
            ty = rd("I")
            rd("Q")
            n = 1
            for d in dims:
                n *= d
            e, b = blk[ty]
            tensors.append((name, dims, n, n // e * b))
    return meta, tensors


def gguf_model_stats(path):
    """Per-token weight bytes and multiply-accumulates of a dense GGUF decoder."""
    meta, tensors = read_tensors(path)
    arch = meta.get("general.architecture", "")
    g = lambda k, d=None: meta.get(f"{arch}.{k}", d)
    n_layer, n_embd, n_head = g("block_count"), g("embedding_length"), g("attention.head_count")
    n_kv_head = g("attention.head_count_kv", n_head)
    if isinstance(n_kv_head, list):
        n_kv_head = max(n_kv_head)
    head_dim = g("attention.key_length", n_embd // n_head)
    tied = "output.weight" not in {t[0] for t in tensors}
    head = "token_embd.weight" if tied else "output.weight"
    return {
        # A decode step reads every tensor once, except the embedding table
        # (one row per token) unless it is also the output head.
        "read_bytes": sum(b for name, _, _, b in tensors
                          if name != "token_embd.weight" or tied),
        # Multiply-accumulates per prompt token: the layers' 2-D weights
        # (prefill runs the output head for the last token only).
        "macs": sum(n for name, dims, n, _ in tensors
                    if name.startswith("blk.") and len(dims) == 2),
        "head_macs": next(n for name, _, n, _ in tensors if name == head),
        # f16 K and V bytes per context position, all layers.
        "kv_bytes_per_pos": n_layer * 2 * n_kv_head * head_dim * 2,
    }
