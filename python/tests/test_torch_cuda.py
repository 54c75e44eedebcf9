"""switchyard.torch.MoE on CUDA tensors (docs/gpu.md) against tests/reference_moe.py, a plain
PyTorch layer evaluated in float64 on the CPU with the same parameters. Run on a machine with an
NVIDIA GPU and a build with SY_BUILD_CUDA (CTest label "cuda")."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from reference_moe import reference_moe  # noqa: E402

from switchyard import _switchyard  # noqa: E402
from switchyard.torch import MoE  # noqa: E402


def rel(a, b):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def make():
    torch.manual_seed(0)
    return MoE(model_dim=64, hidden_size_per_expert=96, num_experts=8, top_k=2,
               capacity_factor=1.0, activation="gelu")


@pytest.mark.parametrize("dtype,bound", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_cuda_matches_reference(dtype, bound):
    assert _switchyard.has_cuda and torch.cuda.is_available()
    gpu = make().cuda()
    leaves = [p.detach().double().cpu().requires_grad_() for p in gpu._params()]
    x = torch.randn(300, 64).to(dtype)
    dy = torch.randn(300, 64)
    x_ref = x.double().requires_grad_()
    y_ref, l_aux_ref, kept, top_e = reference_moe(x_ref, *leaves, k=2, cf=1.0,
                                                  activation="gelu")
    (y_ref * dy.double()).sum().add(0.01 * l_aux_ref).backward()

    x_gpu = x.cuda().requires_grad_()
    y = gpu(x_gpu)
    assert y.is_cuda and y.dtype == dtype
    (y.float() * dy.cuda()).sum().add(0.01 * y.l_aux).backward()
    assert x_gpu.grad.dtype == dtype
    assert rel(y, y_ref) < bound
    assert abs(float(y.l_aux) - float(l_aux_ref)) <= 1e-4 * abs(float(l_aux_ref))
    assert rel(x_gpu.grad, x_ref.grad) < bound
    e = gpu.experts
    pairs = [(gpu.gates[0].wg.weight.grad, leaves[0].grad),
             (e.batched_fc1_w.grad, leaves[1].grad), (e.batched_fc1_bias.grad, leaves[2].grad),
             (e.batched_fc2_w.grad, leaves[3].grad.transpose(1, 2)),
             (e.batched_fc2_bias.grad, leaves[4].grad)]
    for i, (got, want) in enumerate(pairs):
        assert got.is_cuda and rel(got, want) < bound, i
    counts = torch.bincount(top_e[kept], minlength=8).tolist()
    assert gpu.routing()["expert_counts"] == counts


def test_backward_of_an_older_forward_is_refused():
    gpu = make().cuda()
    x = torch.randn(50, 64, device="cuda", requires_grad=True)
    y1 = gpu(x)
    gpu(x)
    with pytest.raises(RuntimeError, match="its own forward"):
        y1.sum().backward()
