"""Expert parallelism from Python: every MPI process is one rank (mpi4py's world). The parallel
layer (NumPy API and switchyard.torch.MoE) must equal the single-rank layer on the whole batch:
outputs and x gradients of each rank's tokens, the gate gradient, and each rank's expert shard of
the gradients. Run: scripts/mpirun.sh -np 2 /usr/bin/python3 python/tests/mpi_parallel.py
(ctest: python_mpi_np2, python_mpi_np4). Exits non-zero on any mismatch, on any rank."""
import sys
import traceback

from mpi4py import MPI  # initializes MPI (thread level multiple); switchyard uses it
import numpy as np
import torch

import switchyard
from switchyard.torch import MoE

comm = MPI.COMM_WORLD
rank, world = comm.Get_rank(), comm.Get_size()
torch.set_num_threads(1)
TOL = dict(rtol=2e-4, atol=2e-5)
checks = 0


def close(name, got, want):
    global checks
    np.testing.assert_allclose(got, want, err_msg="rank %d: %s" % (rank, name), **TOL)
    checks += 1


def split(total):
    """Tokens per rank: uneven, and rank 1 (if any) holds none."""
    sizes = [total // world] * world
    sizes[0] += total - sum(sizes)
    if world > 1:
        sizes[0] += sizes[1]
        sizes[1] = 0
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    return offsets[rank], offsets[rank + 1]


def shard_of(full, layer, name):
    """The rank's shard of a full expert tensor (docs/parallel.md: experts [first, first + local),
    and with n H-shards, shard i of the hidden dimension; fc2's bias in chunks of ceil(M / n))."""
    f, l, n, i = layer.first_expert, layer.local_experts, layer.shards, layer.shard
    t = full[name][f:f + l]
    if name in ("experts.fc1.weight", "experts.fc1.bias"):
        hs = t.shape[1] // n
        return t[:, i * hs:(i + 1) * hs]
    if name == "experts.fc2.weight":
        hs = t.shape[2] // n
        return t[:, :, i * hs:(i + 1) * hs]
    if name == "experts.fc2.bias":
        mc = -(-t.shape[1] // n)
        chunk = np.zeros((l, mc), t.dtype)
        part = t[:, i * mc:(i + 1) * mc]
        chunk[:, :part.shape[1]] = part
        return chunk
    raise KeyError(name)


def check_numpy_layer(experts, dropless, options):
    cfg = dict(model_dim=8, hidden_dim=12, num_experts=experts, top_k=2,
               capacity_factor=0.0 if dropless else 0.75, dropless=dropless, aux_loss_coef=0.02)
    single = switchyard.MoeLayer(cfg)
    params = single.init_params(seed=4)
    rng = np.random.default_rng(12)
    x = rng.standard_normal((45, 8)).astype(np.float32)
    dy = rng.standard_normal((45, 8)).astype(np.float32)
    ref = single.forward(params, x)
    ref_g = single.backward(params, ref, dy)

    par = switchyard.ParallelMoeLayer(cfg, **options)
    shard = par.shard_params(params)
    b, e = split(45)
    out = par.forward(shard, x[b:e], global_token_offset=b)
    grads = par.backward(shard, out, dy[b:e])
    tag = "%s E=%d %s" % (options, experts, "dropless" if dropless else "capacity")
    close(tag + " y", out.y, ref.y[b:e])
    assert abs(out.l_aux - ref.l_aux) <= 1e-5 * max(1.0, abs(ref.l_aux)), tag
    close(tag + " grad x", grads["x"], ref_g["x"][b:e])
    close(tag + " grad gate", grads["gate.weight"], ref_g["gate.weight"])
    for name in ("experts.fc1.weight", "experts.fc1.bias", "experts.fc2.weight",
                 "experts.fc2.bias"):
        close(tag + " grad " + name, grads[name], shard_of(ref_g, par, name))


def check_torch_module():
    # The same model (same seed) on one rank and across the ranks, three SGD steps; every rank
    # feeds its part of each global batch and adds 0.01 * l_aux (the whole batch's l_aux, the same
    # on every rank) to its loss: the synced gradients are those of the whole batch's
    # sum(y * w) + 0.01 * l_aux.
    kw = dict(gate_type={"type": "top", "k": 2, "capacity_factor": 1.0}, model_dim=8,
              experts={"type": "ffn", "count_per_node": 2, "hidden_size_per_expert": 12,
                       "activation_fn": torch.nn.functional.gelu}, threads=1)
    torch.manual_seed(5)
    single = MoE(**kw, num_experts=2 * world)
    torch.manual_seed(5)
    par = MoE(**kw, parallel={"ep": world})
    assert par.num_global_experts == 2 * world and par.num_local_experts == 2
    opt_s = torch.optim.SGD(single.parameters(), lr=0.05)
    opt_p = torch.optim.SGD(par.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(21)
    b, e = split(24)
    first = rank * 2
    for step in range(3):
        x = torch.randn(24, 8, generator=gen)
        w = torch.randn(24, 8, generator=gen)
        opt_s.zero_grad()
        y = single(x)
        ((y * w).sum() + 0.01 * y.l_aux).backward()
        opt_p.zero_grad()
        xp = x[b:e].clone().requires_grad_(True)
        yp = par(xp)
        ((yp * w[b:e]).sum() + 0.01 * yp.l_aux).backward()
        tag = "torch step %d" % step
        close(tag + " y", yp.detach().numpy(), y.detach()[b:e].numpy())
        close(tag + " gate grad", par.gates[0].wg.weight.grad.numpy(),
              single.gates[0].wg.weight.grad.numpy())
        for n in ("batched_fc1_w", "batched_fc2_w", "batched_fc1_bias", "batched_fc2_bias"):
            close(tag + " " + n, getattr(par.experts, n).grad.numpy(),
                  getattr(single.experts, n).grad[first:first + 2].numpy())
        opt_s.step()
        opt_p.step()


def main():
    layouts = [{"ep": world}, {"ep": world, "dispatch": "alltoallv"},
               {"ep": world, "dispatch": "allgather"}, {"ep": world, "overlap_degree": 2},
               {"ep": max(1, world // 2)}]  # expert replicas (expert-data-parallel groups)
    if world >= 2:
        # Megatron's folding with expert tensor parallelism: each expert split along H over 2.
        layouts.append({"arrangement": "megatron", "etp": 2, "ep": world // 2})
    for options in layouts:
        check_numpy_layer(world, dropless=False, options=options)
        check_numpy_layer(2 * world, dropless=True, options=options)
    if world >= 2:
        # Sharded experts (Tutel: fewer experts than ranks, each split along H).
        cfg_opts = {"ep": world}
        check_numpy_layer_sharded(cfg_opts)
    check_torch_module()


def check_numpy_layer_sharded(options):
    cfg = dict(model_dim=8, hidden_dim=12, num_experts=1 if world == 2 else 2, top_k=1,
               capacity_factor=0.0, aux_loss_coef=0.02)
    single = switchyard.MoeLayer(cfg)
    params = single.init_params(seed=6)
    rng = np.random.default_rng(13)
    x = rng.standard_normal((30, 8)).astype(np.float32)
    dy = rng.standard_normal((30, 8)).astype(np.float32)
    ref = single.forward(params, x)
    ref_g = single.backward(params, ref, dy)
    par = switchyard.ParallelMoeLayer(cfg, **options)
    assert par.shards == world // cfg["num_experts"]
    shard = par.shard_params(params)
    b, e = split(30)
    out = par.forward(shard, x[b:e])
    grads = par.backward(shard, out, dy[b:e])
    close("sharded y", out.y, ref.y[b:e])
    close("sharded grad x", grads["x"], ref_g["x"][b:e])
    close("sharded grad gate", grads["gate.weight"], ref_g["gate.weight"])
    for name in ("experts.fc1.weight", "experts.fc1.bias", "experts.fc2.weight",
                 "experts.fc2.bias"):
        close("sharded grad " + name, grads[name], shard_of(ref_g, par, name))


if __name__ == "__main__":
    failed = 0
    try:
        main()
    except Exception:  # report on this rank, then agree on the result
        traceback.print_exc()
        failed = 1
    failed = comm.allreduce(failed, op=MPI.MAX)
    if rank == 0:
        print("mpi_parallel: %d ranks, %d checks on rank 0: %s"
              % (world, checks, "FAILED" if failed else "ok"))
    sys.exit(failed)
