#!/usr/bin/env python3
"""Writes tiny random Hugging Face model directories for the families switchyard exchanges.

Written from the format's description (docs/models.md), not from the `transformers` package
(Debian has none): for each family a config.json with the keys Hugging Face reads, and the
weights in safetensors under Hugging Face's parameter names and shapes, in one file or sharded
with model.safetensors.index.json. numpy is all it needs.

When PyTorch is importable it also writes, per family, a plain PyTorch forward and backward of
the architecture (RMSNorm, RoPE "rotate half", grouped-query attention, SwiGLU, the family's
router, shared expert and load-balancing loss), for equality tests of switchyard's model:
  tokens.json           {"input_ids": [[...], ...]}
  reference.safetensors logits [B, T, V], ce_loss, aux_loss, loss (= ce_loss + coef * aux_loss,
                        as the ForCausalLM classes compute it with labels = input_ids) and
                        grad.<name> (d loss / d parameter) for every parameter.

Usage: make_tiny_hf.py --out DIR [--family mixtral ...] [--dtype f32|bf16|f16]
                       [--max-shard-bytes N] [--seed S] [--no-reference]
"""
import argparse
import json
import os
import struct
import sys

import numpy as np

# ---- the families: tiny configs (every key Hugging Face reads) ----

COMMON = {
    "vocab_size": 64, "hidden_size": 16, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 64, "initializer_range": 0.02, "hidden_act": "silu",
    "rope_scaling": None, "attention_dropout": 0.0, "tie_word_embeddings": False,
    "torch_dtype": "float32", "use_cache": True,
}

CONFIGS = {
    "mixtral": dict(COMMON, architectures=["MixtralForCausalLM"], model_type="mixtral",
                    intermediate_size=24, num_hidden_layers=2, rope_theta=1e6, rms_norm_eps=1e-5,
                    num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.02,
                    output_router_logits=True, router_jitter_noise=0.0, sliding_window=None,
                    bos_token_id=1, eos_token_id=2, pad_token_id=None),
    "qwen2_moe": dict(COMMON, architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe",
                      intermediate_size=32, moe_intermediate_size=12,
                      shared_expert_intermediate_size=20, num_hidden_layers=3, rope_theta=10000.0,
                      rms_norm_eps=1e-6, num_experts=6, num_experts_per_tok=2,
                      norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[1],
                      router_aux_loss_coef=0.001, output_router_logits=True,
                      use_sliding_window=False, sliding_window=32, max_window_layers=3,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None),
    "olmoe": dict(COMMON, architectures=["OlmoeForCausalLM"], model_type="olmoe",
                  num_key_value_heads=4, intermediate_size=8, num_hidden_layers=2,
                  rope_theta=10000.0, rms_norm_eps=1e-5, num_experts=8, num_experts_per_tok=2,
                  norm_topk_prob=False, router_aux_loss_coef=0.01, output_router_logits=True,
                  attention_bias=False, clip_qkv=None, pad_token_id=1, bos_token_id=None,
                  eos_token_id=50),
    "llama": dict(COMMON, architectures=["LlamaForCausalLM"], model_type="llama",
                  intermediate_size=32, num_hidden_layers=2, rope_theta=10000.0,
                  rms_norm_eps=1e-6, attention_bias=False, mlp_bias=False, bos_token_id=1,
                  eos_token_id=2, pad_token_id=None),
    "qwen2": dict(COMMON, architectures=["Qwen2ForCausalLM"], model_type="qwen2",
                  intermediate_size=32, num_hidden_layers=2, rope_theta=10000.0,
                  rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False,
                  sliding_window=32, max_window_layers=2, bos_token_id=None, eos_token_id=None,
                  pad_token_id=None),
}

MOE = {"mixtral", "qwen2_moe", "olmoe"}


def num_experts(c):
    return c.get("num_local_experts", c.get("num_experts", 0))


def is_moe_layer(c, layer):
    if c["model_type"] not in MOE:
        return False
    if c["model_type"] == "qwen2_moe":
        return layer not in c["mlp_only_layers"] and (layer + 1) % c["decoder_sparse_step"] == 0
    return True


def parameter_table(c):
    """Hugging Face's state_dict names and shapes, in model order."""
    m, heads, kv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    d = m // heads
    fam = c["model_type"]
    qkv_bias = fam in ("qwen2", "qwen2_moe")
    t = [("model.embed_tokens.weight", (c["vocab_size"], m))]

    def mlp(p, inter):
        t.extend([(p + "gate_proj.weight", (inter, m)), (p + "up_proj.weight", (inter, m)),
                  (p + "down_proj.weight", (m, inter))])

    for layer in range(c["num_hidden_layers"]):
        p = "model.layers.%d." % layer
        t.append((p + "input_layernorm.weight", (m,)))
        for proj, rows in (("q_proj", heads * d), ("k_proj", kv * d), ("v_proj", kv * d)):
            t.append((p + "self_attn.%s.weight" % proj, (rows, m)))
            if qkv_bias:
                t.append((p + "self_attn.%s.bias" % proj, (rows,)))
        t.append((p + "self_attn.o_proj.weight", (m, heads * d)))
        if fam == "olmoe":
            t.append((p + "self_attn.q_norm.weight", (heads * d,)))
            t.append((p + "self_attn.k_norm.weight", (kv * d,)))
        t.append((p + "post_attention_layernorm.weight", (m,)))
        if not is_moe_layer(c, layer):
            mlp(p + "mlp.", c["intermediate_size"])
            continue
        e_num = num_experts(c)
        if fam == "mixtral":
            inter = c["intermediate_size"]
            t.append((p + "block_sparse_moe.gate.weight", (e_num, m)))
            for e in range(e_num):
                q = p + "block_sparse_moe.experts.%d." % e
                t.extend([(q + "w1.weight", (inter, m)), (q + "w3.weight", (inter, m)),
                          (q + "w2.weight", (m, inter))])
        else:
            inter = c["moe_intermediate_size"] if fam == "qwen2_moe" else c["intermediate_size"]
            t.append((p + "mlp.gate.weight", (e_num, m)))
            for e in range(e_num):
                mlp(p + "mlp.experts.%d." % e, inter)
            if fam == "qwen2_moe":
                mlp(p + "mlp.shared_expert.", c["shared_expert_intermediate_size"])
                t.append((p + "mlp.shared_expert_gate.weight", (1, m)))
    t.append(("model.norm.weight", (m,)))
    if not c["tie_word_embeddings"]:
        t.append(("lm_head.weight", (c["vocab_size"], m)))
    return t


def random_weights(c, seed):
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in parameter_table(c):
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            out[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:  # larger than initializer_range so that the tests see non-trivial numbers
            out[name] = (0.2 * rng.standard_normal(shape)).astype(np.float32)
    return out


# ---- safetensors, written from the format's description ----

def to_bf16_bits(a):
    u = a.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16  # round to nearest even
    return rounded.astype(np.uint16)


def tensor_bytes(a, dtype):
    if dtype == "F32":
        return np.ascontiguousarray(a, dtype="<f4").tobytes()
    if dtype == "BF16":
        return to_bf16_bits(a).astype("<u2").tobytes()
    if dtype == "F16":
        return np.ascontiguousarray(a, dtype="<f2").tobytes()
    raise ValueError(dtype)


def write_safetensors(path, tensors, dtype):
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name in sorted(tensors):
        b = tensor_bytes(tensors[name], dtype)
        header[name] = {"dtype": dtype, "shape": list(tensors[name].shape),
                        "data_offsets": [offset, offset + len(b)]}
        blobs.append(b)
        offset += len(b)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)
    os.replace(tmp, path)


def write_weights(out, weights, dtype, max_shard_bytes):
    """model.safetensors, or shards (Hugging Face's rule: a new shard when the next tensor would
    exceed the maximum) with model.safetensors.index.json."""
    width = {"F32": 4, "BF16": 2, "F16": 2}[dtype]
    shards, current, size = [], {}, 0
    for name, _ in weights["__order__"]:
        nbytes = weights[name].size * width
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = weights[name]
        size += nbytes
    shards.append(current)
    if len(shards) == 1:
        write_safetensors(os.path.join(out, "model.safetensors"), shards[0], dtype)
        return
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        fname = "model-%05d-of-%05d.safetensors" % (i + 1, len(shards))
        write_safetensors(os.path.join(out, fname), shard, dtype)
        for name, a in shard.items():
            weight_map[name] = fname
            total += a.size * width
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)


# ---- the plain PyTorch forward, from the architectures' definitions ----

def reference(torch, c, weights, input_ids):
    F = torch.nn.functional
    fam = c["model_type"]
    p = {n: torch.tensor(weights[n], dtype=torch.float32, requires_grad=True)
         for n, _ in weights["__order__"]}
    m, heads, kv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    d, eps, theta = m // heads, c["rms_norm_eps"], c["rope_theta"]
    ids = torch.tensor(input_ids, dtype=torch.int64)
    b_num, t_num = ids.shape

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def lin(x, name, bias=False):
        y = x @ p[name + ".weight"].T
        return y + p[name + ".bias"] if bias else y

    def rope(x):  # x [B, h, T, d]
        inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        freqs = torch.arange(t_num).float()[:, None] * inv[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        rot = torch.cat([-x[..., d // 2:], x[..., : d // 2]], dim=-1)
        return x * emb.cos() + rot * emb.sin()

    def swiglu(x, pre, names=("gate_proj", "up_proj", "down_proj")):
        return lin(F.silu(lin(x, pre + names[0])) * lin(x, pre + names[1]), pre + names[2])

    # nn.Embedding(vocab, hidden, padding_idx=pad_token_id): the pad row gets no gradient from
    # the lookup (a tied head still adds to it).
    h = F.embedding(ids, p["model.embed_tokens.weight"], padding_idx=c.get("pad_token_id"))
    router_logits = []
    for layer in range(c["num_hidden_layers"]):
        pre = "model.layers.%d." % layer
        x = rms(h, p[pre + "input_layernorm.weight"])
        bias = fam in ("qwen2", "qwen2_moe")
        q = lin(x, pre + "self_attn.q_proj", bias)
        k = lin(x, pre + "self_attn.k_proj", bias)
        v = lin(x, pre + "self_attn.v_proj", bias)
        if fam == "olmoe":
            q = rms(q, p[pre + "self_attn.q_norm.weight"])
            k = rms(k, p[pre + "self_attn.k_norm.weight"])
        q = rope(q.view(b_num, t_num, heads, d).transpose(1, 2))
        k = rope(k.view(b_num, t_num, kv, d).transpose(1, 2))
        v = v.view(b_num, t_num, kv, d).transpose(1, 2)
        k = k.repeat_interleave(heads // kv, dim=1)  # repeat_kv
        v = v.repeat_interleave(heads // kv, dim=1)
        s = q @ k.transpose(2, 3) / d ** 0.5
        s = s.masked_fill(torch.triu(torch.ones(t_num, t_num, dtype=torch.bool), 1), float("-inf"))
        att = (F.softmax(s, dim=-1) @ v).transpose(1, 2).reshape(b_num, t_num, heads * d)
        h = h + lin(att, pre + "self_attn.o_proj")
        x = rms(h, p[pre + "post_attention_layernorm.weight"])
        if not is_moe_layer(c, layer):
            h = h + swiglu(x, pre + "mlp.")
            continue
        blk = pre + ("block_sparse_moe." if fam == "mixtral" else "mlp.")
        flat = x.reshape(-1, m)
        logits = lin(flat, blk + "gate")
        router_logits.append(logits)
        probs = F.softmax(logits, dim=-1, dtype=torch.float)
        top_w, top_i = torch.topk(probs, c["num_experts_per_tok"], dim=-1)
        if fam == "mixtral" or c["norm_topk_prob"]:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        y = torch.zeros_like(flat)
        for e in range(num_experts(c)):
            ep = blk + "experts.%d." % e
            out = swiglu(flat, ep, ("w1", "w3", "w2") if fam == "mixtral" else
                         ("gate_proj", "up_proj", "down_proj"))
            weight = (top_w * (top_i == e)).sum(dim=-1, keepdim=True)
            y = y + weight * out
        if fam == "qwen2_moe":
            gate = torch.sigmoid(lin(flat, blk + "shared_expert_gate"))
            y = y + gate * swiglu(flat, blk + "shared_expert.")
        h = h + y.view(b_num, t_num, m)
    h = rms(h, p["model.norm.weight"])
    head = p["model.embed_tokens.weight"] if c["tie_word_embeddings"] else p["lm_head.weight"]
    logits = h @ head.T
    ce = F.cross_entropy(logits[:, :-1].reshape(-1, c["vocab_size"]), ids[:, 1:].reshape(-1))
    aux = torch.zeros(())
    coef = c.get("router_aux_loss_coef", 0.0)
    if router_logits:  # load_balancing_loss_func: all layers concatenated, one loss
        cat = torch.cat(router_logits, dim=0)
        rw = F.softmax(cat, dim=-1)
        _, sel = torch.topk(rw, c["num_experts_per_tok"], dim=-1)
        mask = F.one_hot(sel, num_experts(c)).float()
        aux = (mask.mean(dim=0) * rw.mean(dim=0).unsqueeze(0)).sum() * num_experts(c)
    loss = ce + coef * aux
    loss.backward()
    out = {"logits": logits.detach().numpy(), "ce_loss": np.array(ce.item(), np.float32),
           "aux_loss": np.array(aux.item(), np.float32), "loss": np.array(loss.item(), np.float32)}
    for n, t in p.items():
        out["grad." + n] = t.grad.numpy()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--family", action="append", choices=sorted(CONFIGS))
    ap.add_argument("--dtype", default="f32", choices=["f32", "bf16", "f16"])
    ap.add_argument("--max-shard-bytes", type=int, default=5_000_000_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-reference", action="store_true")
    args = ap.parse_args()
    torch = None
    if not args.no_reference:
        try:
            import torch
        except ImportError:
            pass
    dtype = {"f32": "F32", "bf16": "BF16", "f16": "F16"}[args.dtype]
    for i, fam in enumerate(args.family or sorted(CONFIGS)):
        c = CONFIGS[fam]
        out = os.path.join(args.out, fam)
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(c, f, indent=2)
        weights = random_weights(c, args.seed + 1000 * i)
        weights["__order__"] = parameter_table(c)
        write_weights(out, weights, dtype, args.max_shard_bytes)
        if torch is not None and not args.no_reference:
            rng = np.random.default_rng(args.seed + 7)
            ids = rng.integers(0, c["vocab_size"], size=(2, 6)).tolist()
            if c.get("pad_token_id") is not None:  # the pad token as an input and a label
                ids[0][2] = ids[1][4] = c["pad_token_id"]
            with open(os.path.join(out, "tokens.json"), "w") as f:
                json.dump({"input_ids": ids}, f)
            ref = reference(torch, c, weights, ids)
            write_safetensors(os.path.join(out, "reference.safetensors"), ref, "F32")
        print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
