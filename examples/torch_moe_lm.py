"""A small byte-level transformer language model whose FFN blocks are MoE layers, trained on the
fortunes corpus (/usr/share/games/fortunes, Debian fortunes-min and fortune-mod) twice in
lockstep: once with switchyard.torch.MoE (the C++ layer) and once with PlainMoE below (the same
layer written in plain PyTorch, Tutel-style: one-hot-free index dispatch into an [E, C, M]
buffer, batched expert matmuls). Both start from the same parameters and see the same batches;
their losses and step times are recorded side by side (docs/python.md, "Example").

    PYTHONPATH=build/release/python /usr/bin/python3 examples/torch_moe_lm.py --steps 300 \
        --out build/example_lm

writes <out>/losses.csv (step, loss of each model, step time of each) and <out>/losses.svg.
The MoE class is chosen by one line (see make_moe): that is the swap a Tutel user makes.
"""
import argparse
import math
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import switchyard.torch as sy_torch


class PlainMoE(nn.Module):
    """The MoE layer of docs/moe.md (softmax gate, top-k, capacity k*floor(cf*ceil(T/E)) with
    choice-major slots and position drops, normalized gates, per-expert FFN, GShard l_aux) in
    plain PyTorch, with Tutel's parameter names and shapes (as switchyard.torch.MoE)."""

    def __init__(self, model_dim, num_experts, hidden, k=2, capacity_factor=1.0, act=F.gelu):
        super().__init__()
        self.gates = nn.ModuleList([nn.Module()])
        self.gates[0].wg = nn.Linear(model_dim, num_experts, bias=False)
        self.experts = nn.Module()
        e = self.experts
        e.batched_fc1_w = nn.Parameter(torch.empty(num_experts, hidden, model_dim))
        e.batched_fc2_w = nn.Parameter(torch.empty(num_experts, hidden, model_dim))
        e.batched_fc1_bias = nn.Parameter(torch.empty(num_experts, hidden))
        e.batched_fc2_bias = nn.Parameter(torch.empty(num_experts, model_dim))
        self.k, self.cf, self.act, self.E = k, capacity_factor, act, num_experts

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        T, M = x.shape
        E, k = self.E, self.k
        scores = torch.softmax(self.gates[0].wg(x), dim=-1)
        top_s, top_e = torch.topk(scores, k, dim=-1)
        g = top_s / top_s.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).eps)
        C = k * int(math.floor(self.cf * math.ceil(T / E)))
        e_flat = top_e.t().reshape(-1)  # choice-major: all 1st choices, then all 2nd
        onehot = F.one_hot(e_flat, E)
        slot = ((torch.cumsum(onehot, 0) - 1) * onehot).sum(-1)
        keep = slot < C
        rows = (e_flat * C + slot)[keep]
        src = x.repeat(k, 1)[keep]
        buf = x.new_zeros(E * C, M).index_copy(0, rows, src).view(E, C, M)
        ex = self.experts
        h = self.act(torch.baddbmm(ex.batched_fc1_bias.unsqueeze(1), buf,
                                   ex.batched_fc1_w.transpose(1, 2)))
        o = torch.baddbmm(ex.batched_fc2_bias.unsqueeze(1), h, ex.batched_fc2_w).view(E * C, M)
        w = (g.t().reshape(-1) * keep)[keep].unsqueeze(1)
        y = x.new_zeros(k * T, M).index_copy(0, keep.nonzero().squeeze(1), o[rows] * w)
        y = y.view(k, T, M).sum(0)
        first = F.one_hot(top_e[:, 0], E).float().mean(0)
        y = y.view(shape)
        y.l_aux = E * (scores.mean(0) * first).sum()
        return y


class Block(nn.Module):
    def __init__(self, d, heads, moe):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.moe = moe

    def forward(self, x, mask):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        y = self.moe(self.ln2(x))
        return x + y, y.l_aux


class LM(nn.Module):
    def __init__(self, make_moe, layers=2, d=64, heads=4, seq=64, vocab=256):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList([Block(d, heads, make_moe()) for _ in range(layers)])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.register_buffer("mask", torch.triu(torch.full((seq, seq), float("-inf")), 1))

    def forward(self, idx):
        T = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(T))
        l_aux = 0.0
        for b in self.blocks:
            x, la = b(x, self.mask[:T, :T])
            l_aux = l_aux + la
        return self.head(self.ln(x)), l_aux


def corpus(directory="/usr/share/games/fortunes"):
    data = bytearray()
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if name.endswith((".dat", ".u8")) or os.path.islink(path) or not os.path.isfile(path):
            continue
        with open(path, "rb") as f:
            data += f.read()
    if not data:
        sys.exit("no fortune files in %s (install fortunes-min: bash scripts/setup.sh)" % directory)
    return torch.frombuffer(data, dtype=torch.uint8).long()


def svg(path, steps, curves, title):
    """A line plot written by hand (no plotting package needed)."""
    W, H, L, B = 640, 360, 60, 40
    lo = min(min(c) for _, c, _ in curves)
    hi = max(max(c) for _, c, _ in curves)
    sx = lambda s: L + (W - L - 20) * (s - steps[0]) / max(1, steps[-1] - steps[0])
    sy = lambda v: 20 + (H - 20 - B) * (hi - v) / max(1e-9, hi - lo)
    out = ['<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" font-family="sans-serif" '
           'font-size="12">' % (W, H), '<rect width="100%" height="100%" fill="white"/>',
           '<text x="%d" y="14">%s</text>' % (L, title)]
    for i in range(5):
        v = lo + (hi - lo) * i / 4
        out.append('<line x1="%d" x2="%d" y1="%.1f" y2="%.1f" stroke="#ddd"/>' % (L, W - 20, sy(v),
                                                                                  sy(v)))
        out.append('<text x="4" y="%.1f">%.3f</text>' % (sy(v) + 4, v))
    out.append('<text x="%d" y="%d">step (0 .. %d)</text>' % (W // 2 - 40, H - 8, steps[-1]))
    for n, (label, c, color) in enumerate(curves):
        pts = " ".join("%.1f,%.1f" % (sx(s), sy(v)) for s, v in zip(steps, c))
        dash = ' stroke-dasharray="5,4"' if n else ""
        out.append('<polyline fill="none" stroke="%s" stroke-width="1.5"%s points="%s"/>'
                   % (color, dash, pts))
        out.append('<text x="%d" y="%d" fill="%s">%s</text>' % (W - 260, 36 + 16 * n, color, label))
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="")
    ap.add_argument("--smoke", action="store_true", help="check the run, write nothing")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    d = 64

    # The one line that chooses the MoE implementation of a block.
    def make_moe():
        return sy_torch.MoE(gate_type={"type": "top", "k": 2, "capacity_factor": 1.0},
                            model_dim=d, experts={"type": "ffn", "count_per_node": args.experts,
                                                  "hidden_size_per_expert": args.hidden,
                                                  "activation_fn": F.gelu},
                            threads=args.threads)

    def make_plain():
        return PlainMoE(d, args.experts, args.hidden, k=2, capacity_factor=1.0, act=F.gelu)

    torch.manual_seed(0)
    model_sy = LM(make_moe, d=d, seq=args.seq)
    model_pl = LM(make_plain, d=d, seq=args.seq)
    # Same starting point: switchyard's stores batched_fc2_w as a view; load_state_dict copies.
    missing = model_pl.load_state_dict(model_sy.state_dict())
    assert not missing.missing_keys and not missing.unexpected_keys

    data = corpus()
    gen = torch.Generator().manual_seed(1)
    opts = [torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.0)
            for m in (model_sy, model_pl)]
    rows = []
    for step in range(args.steps):
        starts = torch.randint(0, len(data) - args.seq - 1, (args.batch,), generator=gen)
        batch = torch.stack([data[s:s + args.seq + 1] for s in starts.tolist()])
        inp, tgt = batch[:, :-1], batch[:, 1:]
        losses, times = [], []
        for model, opt in zip((model_sy, model_pl), opts):  # interleaved: same time window
            t0 = time.perf_counter()
            opt.zero_grad()
            logits, l_aux = model(inp)
            loss = F.cross_entropy(logits.reshape(-1, 256), tgt.reshape(-1))
            (loss + 0.01 * l_aux).backward()
            opt.step()
            times.append(time.perf_counter() - t0)
            losses.append(loss.item())
        rows.append((step, *losses, *times))
        if step % 50 == 0 or step == args.steps - 1:
            print("step %4d  loss switchyard %.4f  plain %.4f  step ms %.1f / %.1f"
                  % (step, losses[0], losses[1], 1e3 * times[0], 1e3 * times[1]), flush=True)
    for r in rows:
        assert all(math.isfinite(v) for v in r[1:3]), r
    skip = min(10, len(rows) // 2)  # warm-up steps left out of the medians
    med = lambda v: sorted(v)[len(v) // 2]
    t_sy = med([r[3] for r in rows[skip:]])
    t_pl = med([r[4] for r in rows[skip:]])
    print("median step time (steps %d..%d): switchyard.torch.MoE %.1f ms, plain PyTorch MoE "
          "%.1f ms (ratio %.2f)" % (skip, len(rows) - 1, 1e3 * t_sy, 1e3 * t_pl, t_pl / t_sy))
    print("final loss (mean of the last 20 steps): switchyard %.4f, plain %.4f; largest "
          "difference of the two losses at one step %.2e"
          % (sum(r[1] for r in rows[-20:]) / len(rows[-20:]),
             sum(r[2] for r in rows[-20:]) / len(rows[-20:]),
             max(abs(r[1] - r[2]) for r in rows)))
    # The MoE layers alone: forward + backward of one block's MoE on a batch of activations,
    # interleaved, median of the repetitions.
    x = torch.randn(args.batch * args.seq, d)
    dy = torch.randn_like(x)
    layer_times = ([], [])
    for _ in range(5 if args.smoke else 60):
        for i, model in enumerate((model_sy, model_pl)):
            moe = model.blocks[0].moe
            xi = x.clone().requires_grad_(True)
            t0 = time.perf_counter()
            y = moe(xi)
            ((y * dy).sum() + 0.01 * y.l_aux).backward()
            layer_times[i].append(time.perf_counter() - t0)
    print("MoE layer alone, forward + backward of [%d, %d] (median): switchyard.torch.MoE %.2f ms, "
          "plain PyTorch MoE %.2f ms (ratio %.2f)"
          % (args.batch * args.seq, d, 1e3 * med(layer_times[0]), 1e3 * med(layer_times[1]),
             med(layer_times[1]) / med(layer_times[0])))
    if args.out and not args.smoke:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "losses.csv"), "w") as f:
            f.write("step,loss_switchyard,loss_plain,step_s_switchyard,step_s_plain\n")
            for r in rows:
                f.write("%d,%.6f,%.6f,%.6f,%.6f\n" % r)
        steps = [r[0] for r in rows]
        svg(os.path.join(args.out, "losses.svg"), steps,
            [("switchyard.torch.MoE", [r[1] for r in rows], "#1f77b4"),
             ("plain PyTorch MoE", [r[2] for r in rows], "#d62728")],
            "training loss (cross-entropy, nats per byte)")


if __name__ == "__main__":
    main()
