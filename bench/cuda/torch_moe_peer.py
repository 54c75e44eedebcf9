#!/usr/bin/env python3
"""A plain PyTorch MoE layer, the peer of bench/cuda/cuda_layer_bench (docs/gpu.md).

Same layer as switchyard's default path: softmax gate, top-k, normalized gates, choice-major slots
with Tutel's capacity k * floor(cf * ceil(T / E)) and first-come drops (or dropless), GELU expert
FFNs with biases, the weighted combine, the GShard aux loss and the z-loss; forward + backward by
autograd, bf16 activations and weights. Tokens are sorted by expert (a stable argsort), then the
experts run as torch._grouped_mm (where this torch has it) or as a loop of torch.matmul per expert.
Prints useful TFLOP/s (the expert GEMMs of the kept pairs, forward + backward = 3x forward).

  python3 bench/cuda/torch_moe_peer.py --tokens 32768 --model 2048 --hidden 8192 --experts 8 \\
      --top-k 2 --cf 1.25 --impl grouped_mm
"""
import argparse
import math

import torch
import torch.nn.functional as F


def moe_forward(x, wg, w1, b1, w2, b2, k, cf, dropless, impl, aux_coef=0.01, z_coef=0.001):
    t, _ = x.shape
    e = wg.shape[0]
    logits = x.float() @ wg.t()
    probs = logits.softmax(-1)
    topv, topi = probs.topk(k, dim=-1)
    gates = topv / topv.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).eps)
    flat_e = topi.t().reshape(-1)  # choice-major: all 1st choices, then all 2nd, ...
    order = torch.argsort(flat_e, stable=True)
    sorted_e = flat_e[order]
    loads = torch.bincount(flat_e, minlength=e)
    starts = torch.cumsum(loads, 0) - loads
    slot = torch.arange(k * t, device=x.device) - starts[sorted_e]
    if not dropless:
        cap = k * math.floor(cf * math.ceil(t / e))
        keep = slot < cap
        order, sorted_e = order[keep], sorted_e[keep]
    tok = order % t
    choice = order // t
    xs = x[tok]
    counts = torch.bincount(sorted_e, minlength=e)
    if impl == "grouped_mm":
        offs = torch.cumsum(counts, 0).to(torch.int32)
        h = torch._grouped_mm(xs, w1.transpose(1, 2), offs=offs) + b1[sorted_e]
        h = F.gelu(h)
        ys = torch._grouped_mm(h, w2.transpose(1, 2), offs=offs) + b2[sorted_e]
    else:
        outs = []
        for i, xe in enumerate(torch.split(xs, counts.tolist())):
            he = F.gelu(xe @ w1[i].t() + b1[i])
            outs.append(he @ w2[i].t() + b2[i])
        ys = torch.cat(outs)
    w = gates[tok, choice]
    y = torch.zeros(t, x.shape[1], device=x.device, dtype=torch.float32)
    y = y.index_add(0, tok, ys.float() * w[:, None]).to(x.dtype)
    first = torch.bincount(topi[:, 0], minlength=e).float() / t
    l_aux = e * torch.sum(probs.mean(0) * first)
    z = torch.logsumexp(logits, -1).pow(2).mean()
    return y, aux_coef * l_aux + z_coef * z, int(counts.sum())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--model", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=8192)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--cf", type=float, default=1.25)
    ap.add_argument("--dropless", action="store_true")
    ap.add_argument("--impl", choices=["grouped_mm", "loop"], default="grouped_mm")
    ap.add_argument("--iters", type=int, default=20)
    a = ap.parse_args()
    if a.impl == "grouped_mm" and not hasattr(torch, "_grouped_mm"):
        raise SystemExit("torch_moe_peer: this torch has no torch._grouped_mm; use --impl loop")
    dev, bf = "cuda", torch.bfloat16
    t, m, h, e = a.tokens, a.model, a.hidden, a.experts
    g = torch.Generator(device=dev).manual_seed(0)

    def param(*shape, scale):
        return ((torch.rand(*shape, device=dev, generator=g) * 2 - 1) * scale).requires_grad_()

    wg = param(e, m, scale=m ** -0.5)
    w1 = param(e, h, m, scale=m ** -0.5).to(bf).detach().requires_grad_()
    b1 = param(e, h, scale=0.1).to(bf).detach().requires_grad_()
    w2 = param(e, m, h, scale=h ** -0.5).to(bf).detach().requires_grad_()
    b2 = param(e, m, scale=0.1).to(bf).detach().requires_grad_()
    x = (torch.rand(t, m, device=dev, generator=g) * 2 - 1).to(bf).requires_grad_()
    dy = (torch.rand(t, m, device=dev, generator=g) * 2 - 1).to(bf)

    kept = 0

    def step():
        nonlocal kept
        for p in (wg, w1, b1, w2, b2, x):
            p.grad = None
        y, loss, kept = moe_forward(x, wg, w1, b1, w2, b2, a.top_k, a.cf, a.dropless, a.impl)
        torch.autograd.backward([y, loss], [dy, torch.ones_like(loss)])

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(a.iters):
        s, f = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        step()
        f.record()
        f.synchronize()
        times.append(s.elapsed_time(f))
    times.sort()
    ms = times[len(times) // 2]
    useful = 3 * 2 * 2.0 * kept * m * h
    print(f"torch {torch.__version__} {a.impl}: T {t}, M {m}, H {h}, E {e}, k {a.top_k}, "
          f"cf {a.cf}{', dropless' if a.dropless else ''}: kept {kept}")
    print(f"  forward+backward {ms:.3f} ms (median of {a.iters}), useful "
          f"{useful / ms / 1e9:.1f} TFLOP/s")
    print(f"RESULT torch_{a.impl}_tflops={useful / ms / 1e9:.1f} step_ms={ms:.3f}")


if __name__ == "__main__":
    main()
