"""A plain-PyTorch MoE layer, written independently of switchyard, as the tests' reference
(docs/moe.md, "What the layer computes"): softmax gate, top-k, capacity k * floor(cf * ceil(T / E))
with slots in choice-major order and position-order dropping, normalized gate values, one FFN per
expert, weighted combine, GShard's l_aux. Everything is differentiable by torch.autograd."""
import math

import torch
import torch.nn.functional as F

EPS = torch.finfo(torch.float32).eps
ACT = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu}


def capacity(tokens, experts, k, cf):
    if cf == 0:
        return None  # no drops
    return k * int(math.floor(cf * math.ceil(tokens / experts)))


def reference_moe(x, wg, w1, b1, w2, b2, k=2, cf=1.0, activation="gelu", normalize=True):
    """x [T, M], wg [E, M], w1 [E, H, M], b1 [E, H] or None, w2 [E, M, H], b2 [E, M] or None.
    Returns y [T, M], l_aux, kept [T, k] (bool) and the chosen experts [T, k]."""
    T, M = x.shape
    E = wg.shape[0]
    k = min(k, E)
    scores = torch.softmax(x @ wg.t(), dim=-1)
    top_s, top_e = torch.topk(scores, k, dim=-1)
    g = top_s / top_s.sum(-1, keepdim=True).clamp_min(EPS) if normalize and k > 1 else top_s
    cap = capacity(T, E, k, cf)
    # Slots: every token's 1st choice in token order, then every 2nd choice, ...
    counts = [0] * E
    kept = torch.zeros(T, k, dtype=torch.bool)
    for j in range(k):
        for t in range(T):
            e = int(top_e[t, j])
            if cap is None or counts[e] < cap:
                kept[t, j] = True
            counts[e] += 1
    act = ACT[activation]
    rows = []
    for t in range(T):
        out = torch.zeros(M, dtype=x.dtype)
        for j in range(k):
            if not kept[t, j]:
                continue
            e = int(top_e[t, j])
            h = x[t] @ w1[e].t() + (b1[e] if b1 is not None else 0)
            o = act(h) @ w2[e].t() + (b2[e] if b2 is not None else 0)
            out = out + g[t, j] * o
        rows.append(out)
    y = torch.stack(rows)
    # GShard: E * sum_e mean_t scores[t, e] * (fraction of tokens whose 1st choice is e).
    first = F.one_hot(top_e[:, 0], E).to(x.dtype).mean(0)
    l_aux = E * (scores.mean(0) * first).sum()
    return y, l_aux, kept, top_e
