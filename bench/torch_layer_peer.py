#!/usr/bin/env python3
"""A plain PyTorch MoE layer on the CPU, the peer of `switchyard bench layer` (docs/PERFORMANCE.md).

The same layer as switchyard's default path, in float32: softmax gate, top-k, normalized gate
values, the GShard aux loss; tokens sorted by expert (a stable argsort of the choices, Tutel's
first-come capacity k * floor(cf * ceil(T / E)) unless dropless), gathered, one torch.matmul per
expert (expert FFNs with biases: GELU, or SwiGLU silu(x W1^T + b1) * (x W3^T) when gated), the
weighted combine (index_add); forward + backward by autograd. Prints useful GFLOP/s with the FLOP
count of `bench layer`: the expert GEMMs of the kept pairs, forward + backward = 3x forward.

Threads: OPENBLAS_NUM_THREADS, OMP_NUM_THREADS and torch.set_num_threads are all set to --threads
before torch is imported (Debian's torch calls libblas.so.3, i.e. OpenBLAS, for matmul on the
CPU; OpenBLAS ignores torch's thread setting).

With --switchyard PATH it also runs `PATH bench layer --preset P --threads N --json`
interleaved with its own rounds and prints both rates, their ratio and the FMA peak that
`bench layer` measured in the same round:

  python3 bench/torch_layer_peer.py --preset F --threads 1 --rounds 3 \\
      --switchyard build/release/src/cli/switchyard
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

PRESETS = {  # tokens, model, hidden, experts, top-k, cf, dropless, activation, gated
    "A": (4096, 512, 2048, 8, 2, 1.25, False, "gelu", False),
    "B": (8192, 1024, 4096, 16, 2, 1.0, False, "gelu", False),
    "C": (2048, 256, 1024, 64, 1, 1.0, False, "gelu", False),
    "F": (4096, 512, 256, 64, 8, 1.0, True, "silu", True),
}


def moe_forward(torch, F, x, wg, w1, b1, w3, w2, b2, k, cf, dropless, act, aux_coef=0.01):
    t, _ = x.shape
    e = wg.shape[0]  # w1, b1, w3, w2, b2: lists of one tensor per expert
    logits = x @ wg.t()
    probs = logits.softmax(-1)
    topv, topi = probs.topk(k, dim=-1)
    gates = topv / topv.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).eps)
    flat_e = topi.t().reshape(-1)  # choice-major: all first choices, then all second, ...
    order = torch.argsort(flat_e, stable=True)
    sorted_e = flat_e[order]
    if not dropless:
        loads = torch.bincount(flat_e, minlength=e)
        starts = torch.cumsum(loads, 0) - loads
        slot = torch.arange(k * t) - starts[sorted_e]
        cap = k * math.floor(cf * math.ceil(t / e))
        keep = slot < cap
        order, sorted_e = order[keep], sorted_e[keep]
    tok = order % t
    choice = order // t
    xs = x[tok]
    counts = torch.bincount(sorted_e, minlength=e).tolist()
    outs = []
    for i, xe in enumerate(torch.split(xs, counts)):
        if xe.shape[0] == 0:
            continue
        a = xe @ w1[i].t() + b1[i]
        he = F.silu(a) * (xe @ w3[i].t()) if w3 is not None else F.gelu(a)
        outs.append(he @ w2[i].t() + b2[i])
    ys = torch.cat(outs)
    w = gates[tok, choice]
    y = torch.zeros_like(x).index_add(0, tok, ys * w[:, None])
    first = torch.bincount(topi[:, 0], minlength=e).float() / t
    l_aux = e * torch.sum(probs.mean(0) * first)
    return y, aux_coef * l_aux, sum(counts)


def loaded_blas():
    """The BLAS libraries mapped into this process (which file libblas.so.3 resolved to)."""
    with open("/proc/self/maps") as f:
        libs = {line.split()[-1] for line in f if "blas" in line.lower() and "/" in line}
    return ", ".join(sorted(os.path.realpath(p) for p in libs)) or "none mapped yet"


def run_switchyard(path, preset, threads, repeat):
    out = subprocess.run([path, "bench", "layer", "--preset", preset, "--threads", str(threads),
                          "--repeat", str(repeat), "--json"], check=True, capture_output=True,
                         text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="F")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--iters", type=int, default=5, help="timed steps per round (median)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--switchyard", help="also run this switchyard binary's `bench layer`")
    a = ap.parse_args()
    if a.threads < 1:
        ap.error("--threads: expected at least 1")
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(a.threads)
    import torch  # after the thread settings: OpenBLAS reads them when it loads
    import torch.nn.functional as F
    torch.set_num_threads(a.threads)

    t, m, h, e, k, cf, dropless, act, gated = PRESETS[a.preset]
    g = torch.Generator().manual_seed(0)

    def param(*shape, scale):
        return ((torch.rand(*shape, generator=g) * 2 - 1) * scale).requires_grad_()

    def per_expert(*shape, scale):
        # One tensor per expert, as an nn.ModuleList of experts has them: indexing one [E, ...]
        # parameter instead makes autograd build a zero [E, ...] gradient per expert (select's
        # backward), which costs more than the GEMMs.
        return [param(*shape, scale=scale) for _ in range(e)]

    wg = param(e, m, scale=m ** -0.5)
    w1 = per_expert(h, m, scale=m ** -0.5)
    w3 = per_expert(h, m, scale=m ** -0.5) if gated else None
    b1 = per_expert(h, scale=0.1)
    w2 = per_expert(m, h, scale=h ** -0.5)
    b2 = per_expert(m, scale=0.1)
    x = (torch.rand(t, m, generator=g) * 2 - 1).requires_grad_()
    dy = torch.rand(t, m, generator=g) * 2 - 1
    params = [wg, x] + [p for ps in (w1, w3, b1, w2, b2) if ps is not None for p in ps]
    kept = 0

    def step():
        nonlocal kept
        for p in params:
            p.grad = None
        y, loss, kept = moe_forward(torch, F, x, wg, w1, b1, w3, w2, b2, k, cf, dropless, act)
        torch.autograd.backward([y, loss], [dy, torch.ones_like(loss)])

    step()
    useful = 3 * 2.0 * kept * m * h * (3 if gated else 2)
    print(f"torch {torch.__version__}, BLAS {loaded_blas()}, {a.threads} thread(s): layer {a.preset} T {t} M {m} H {h} E {e} k {k} "
          f"{'dropless' if dropless else f'cf {cf}'} {act}{' gated' if gated else ''}, kept {kept}")
    for r in range(a.rounds):
        times, cpu = [], []
        for _ in range(a.iters):
            t0, c0 = time.perf_counter(), time.process_time()
            step()
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        s, c = statistics.median(times), statistics.median(cpu)
        line = (f"  round {r + 1}: torch {s * 1e3:.1f} ms/step, {useful / s / 1e9:.1f} useful "
                f"GFLOP/s ({useful / c / 1e9:.1f} per CPU-second)")
        if a.switchyard:
            j = run_switchyard(a.switchyard, a.preset, a.threads, a.iters)
            sy = j["useful_gflops"]
            peak = j["peak_gflops"]
            sy_cpu = j["useful_gflops_per_cpu_s"]
            line += (f"; switchyard {j['step_ms']:.1f} ms, {sy:.1f} GFLOP/s ({sy_cpu:.1f} per "
                     f"CPU-second; {j['gemm_backend']}, expert products "
                     f"{j.get('expert_gemm', 'backend')}), FMA peak {peak:.1f}: torch "
                     f"{useful / s / 1e9 / peak:.2f} / switchyard {sy / peak:.2f} of peak, "
                     f"switchyard / torch {sy / (useful / s / 1e9):.2f}x wall, "
                     f"{sy_cpu / (useful / c / 1e9):.2f}x CPU")
        print(line, flush=True)


if __name__ == "__main__":
    sys.exit(main())
