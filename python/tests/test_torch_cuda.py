"""switchyard.torch.MoE on CUDA tensors against the same module on the CPU (docs/gpu.md).
Run on a machine with an NVIDIA GPU and a build with SY_BUILD_CUDA (CTest label "cuda")."""
import copy

import pytest
import torch

from switchyard import _switchyard
from switchyard.torch import MoE


def rel(a, b):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def make(**kw):
    torch.manual_seed(0)
    return MoE(model_dim=64, hidden_size_per_expert=96, num_experts=8, top_k=2,
               capacity_factor=1.0, activation="gelu", config={"z_loss_coef": 0.001}, **kw)


def run(moe, x, dy):
    x = x.clone().requires_grad_()
    y = moe(x)
    (y.float() * dy).sum().add(0.01 * y.l_aux).backward()
    grads = {n: p.grad for n, p in moe.named_parameters()}
    return y, x.grad, grads


@pytest.mark.parametrize("dtype,bound", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_cuda_matches_cpu(dtype, bound):
    assert _switchyard.has_cuda and torch.cuda.is_available()
    cpu = make()
    gpu = copy.deepcopy(cpu).cuda()
    x = torch.randn(300, 64)
    dy = torch.randn(300, 64)
    # The CPU reference sees the same (rounded) input as the GPU.
    x_ref = x.to(dtype).float()
    y_ref, dx_ref, g_ref = run(cpu, x_ref, dy)
    y, dx, g = run(gpu, x.to(dtype).cuda(), dy.cuda())
    assert y.is_cuda and y.dtype == dtype and dx.dtype == dtype
    assert rel(y, y_ref) < bound
    assert abs(float(y.l_aux) - float(y_ref.l_aux)) <= 1e-4 * abs(float(y_ref.l_aux))
    assert rel(dx, dx_ref) < bound
    for name, ref in g_ref.items():
        assert g[name].is_cuda, name
        assert rel(g[name], ref) < bound, name
    assert gpu.routing()["expert_counts"] == list(cpu.routing()["expert_counts"])


def test_backward_of_an_older_forward_is_refused():
    gpu = make().cuda()
    x = torch.randn(50, 64, device="cuda", requires_grad=True)
    y1 = gpu(x)
    gpu(x)
    with pytest.raises(RuntimeError, match="its own forward"):
        y1.sum().backward()
