"""switchyard.torch.MoE against the plain-PyTorch reference (reference_moe.py): outputs, l_aux,
routing and the gradients of x and of every parameter, through torch.autograd on both sides."""
import os
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from reference_moe import reference_moe  # noqa: E402

from switchyard.torch import MoE  # noqa: E402

torch.set_num_threads(1)

CASES = [
    # (k, capacity factor, activation, normalize, bias, tokens); cf 0.5/1.0 drop pairs, 0 none
    (2, 1.0, "gelu", True, True, 24),
    (2, 0.5, "relu", True, True, 24),
    (1, 1.0, "relu", True, True, 20),
    (2, 0.0, "silu", False, True, 17),
    (3, 1.25, "gelu", True, False, 30),
]


def make(k, cf, act, normalize, bias, seed=0, experts=4, model_dim=8, hidden=12):
    torch.manual_seed(seed)
    return MoE(gate_type={"type": "top", "k": k, "capacity_factor": cf}, model_dim=model_dim,
               experts={"type": "ffn", "count_per_node": experts, "hidden_size_per_expert": hidden,
                        "activation_fn": act, "has_fc1_bias": bias, "has_fc2_bias": bias},
               normalize_gate=normalize, threads=1)


def reference_params(moe):
    e = moe.experts
    p = [moe.gates[0].wg.weight, e.batched_fc1_w, e.batched_fc1_bias,
         e.batched_fc2_w.transpose(1, 2), e.batched_fc2_bias]
    return [None if t is None else t.detach().clone().requires_grad_(True) for t in p]


@pytest.mark.parametrize("k,cf,act,normalize,bias,tokens", CASES)
def test_equals_plain_pytorch(k, cf, act, normalize, bias, tokens):
    moe = make(k, cf, act, normalize, bias)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(tokens, 8, generator=gen, requires_grad=True)
    w = torch.randn(tokens, 8, generator=gen)  # objective sum(y * w) + 0.03 * l_aux
    y = moe(x)
    loss = (y * w).sum() + 0.03 * y.l_aux
    loss.backward()

    xr = x.detach().clone().requires_grad_(True)
    wg, w1, b1, w2, b2 = reference_params(moe)
    yr, l_aux_r, kept, top_e = reference_moe(xr, wg, w1, b1, w2, b2, k=k, cf=cf, activation=act,
                                             normalize=normalize)
    ((yr * w).sum() + 0.03 * l_aux_r).backward()

    routing = moe.routing()
    np.testing.assert_array_equal(routing["topk_idx"], top_e.numpy())
    np.testing.assert_array_equal(routing["locations"] >= 0, kept.numpy())
    if cf == 0.5:
        assert not kept.all(), "this case is meant to drop pairs"
    tol = dict(rtol=2e-4, atol=2e-5)
    torch.testing.assert_close(y, yr, **tol)
    torch.testing.assert_close(y.l_aux, l_aux_r, **tol)
    torch.testing.assert_close(x.grad, xr.grad, **tol)
    e = moe.experts
    torch.testing.assert_close(moe.gates[0].wg.weight.grad, wg.grad, **tol)
    torch.testing.assert_close(e.batched_fc1_w.grad, w1.grad, **tol)
    torch.testing.assert_close(e.batched_fc2_w.grad.transpose(1, 2), w2.grad, **tol)
    if bias:
        torch.testing.assert_close(e.batched_fc1_bias.grad, b1.grad, **tol)
        torch.testing.assert_close(e.batched_fc2_bias.grad, b2.grad, **tol)
    else:
        assert e.batched_fc1_bias is None and e.batched_fc2_bias is None


def test_unused_l_aux_contributes_no_gradient():
    # l_aux left out of the loss: its gradient (and so the gate's share from it) is zero.
    moe = make(2, 1.0, "gelu", True, True)
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(3))
    moe(x).sum().backward()
    wg, w1, b1, w2, b2 = reference_params(moe)
    yr, _, _, _ = reference_moe(x, wg, w1, b1, w2, b2)
    yr.sum().backward()
    torch.testing.assert_close(moe.gates[0].wg.weight.grad, wg.grad, rtol=2e-4, atol=2e-5)


def test_tutel_parameter_names_shapes_and_batch_dims():
    moe = make(2, 1.0, "relu", True, True, experts=4, model_dim=8, hidden=12)
    shapes = {n: tuple(p.shape) for n, p in moe.named_parameters()}
    assert shapes == {"gates.0.wg.weight": (4, 8), "experts.batched_fc1_w": (4, 12, 8),
                      "experts.batched_fc2_w": (4, 12, 8), "experts.batched_fc1_bias": (4, 12),
                      "experts.batched_fc2_bias": (4, 8)}
    x = torch.randn(3, 5, 8)  # [batch, sequence, model_dim]
    y = moe(x)
    assert y.shape == x.shape
    torch.testing.assert_close(y.reshape(15, 8), moe(x.reshape(15, 8)))


def test_zero_copy_parameters_and_outputs():
    moe = make(2, 1.0, "gelu", True, True)
    x = torch.randn(16, 8)
    y1 = moe(x).detach().clone()
    # The C++ layer reads the parameters in place: an in-place change is seen by the next call.
    with torch.no_grad():
        moe.experts.batched_fc2_bias.add_(1.0)
    y2 = moe(x).detach()
    routing = moe.routing()
    kept = torch.from_numpy(routing["combine_weights"]).sum(1, keepdim=True)
    torch.testing.assert_close(y2 - y1, kept.expand(-1, 8), rtol=1e-4, atol=1e-4)
    # The fc2 parameter is a view of switchyard's [E, M, H] storage (no copy per call).
    assert moe.experts.batched_fc2_w.transpose(1, 2).is_contiguous()


def test_training_loop_matches_reference_over_steps():
    # Three SGD steps: the same parameters and losses as the reference trained the same way.
    moe = make(2, 1.0, "gelu", True, True)
    ref = [p for p in reference_params(moe)]
    opt = torch.optim.SGD(moe.parameters(), lr=0.1)
    opt_r = torch.optim.SGD([p for p in ref if p is not None], lr=0.1)
    gen = torch.Generator().manual_seed(11)
    for _ in range(3):
        x = torch.randn(20, 8, generator=gen)
        t = torch.randn(20, 8, generator=gen)
        opt.zero_grad()
        y = moe(x)
        loss = ((y - t) ** 2).mean() + 0.01 * y.l_aux
        loss.backward()
        opt.step()
        opt_r.zero_grad()
        yr, l_aux_r, _, _ = reference_moe(x, *ref)
        loss_r = ((yr - t) ** 2).mean() + 0.01 * l_aux_r
        loss_r.backward()
        opt_r.step()
        torch.testing.assert_close(loss, loss_r, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(moe.experts.batched_fc1_w.detach(), ref[1].detach(), rtol=1e-4,
                               atol=1e-5)


def test_bad_input_is_a_clear_error():
    moe = make(2, 1.0, "gelu", True, True)
    with pytest.raises(ValueError, match="model_dim|expected x"):
        moe(torch.randn(4, 9))
    with pytest.raises(TypeError, match="float32"):
        moe(torch.randn(4, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="activation"):
        MoE(model_dim=8, experts={"hidden_size_per_expert": 4, "activation_fn": torch.tanh})
    with pytest.raises(ValueError, match="top_k"):
        MoE(model_dim=8, hidden_size_per_expert=4, num_experts=2, top_k=0)


def test_tutel_seeds():
    kw = dict(model_dim=8, experts={"count_per_node": 2, "hidden_size_per_expert": 4})
    a, b, c = MoE(**kw, seeds=(1, 2)), MoE(**kw, seeds=(1, 2)), MoE(**kw, seeds=(1, 3))
    for (n, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), n
        assert torch.equal(pa, pc) == n.startswith("gates"), n
    with pytest.raises(ValueError, match="hierarchical_ranks_per_node"):
        MoE(**kw, use_2dh=True)


def test_megatron_router_keys_reach_the_layer():
    # DeepSeek-V3's router through config= (docs/moe.md): sigmoid scores, 8 experts in 4 groups,
    # the best 2 groups eligible, top-4 normalized and scaled by 2.5, the sequence-level aux loss.
    # Every token's experts lie in at most 2 groups and its gate values sum to 2.5 (no drops); the
    # sequence loss differs from the batch-level one; a bad group count is an error naming it.
    def build(**keys):
        torch.manual_seed(0)
        return MoE(gate_type={"k": 4, "capacity_factor": 0.0}, model_dim=8,
                   experts={"count_per_node": 8, "hidden_size_per_expert": 12}, threads=1,
                   config=dict({"score_function": "sigmoid", "num_groups": 4, "group_topk": 2,
                                "topk_scaling_factor": 2.5}, **keys))

    moe = build(aux_loss="sequence", sequence_length=5)
    x = torch.randn(20, 8, generator=torch.Generator().manual_seed(5), requires_grad=True)
    y = moe(x)
    routing = moe.routing()
    groups = routing["topk_idx"] // 2
    assert max(len(set(row)) for row in groups.tolist()) <= 2
    ungrouped = build(num_groups=1, group_topk=0)
    ungrouped(x)
    assert max(len(set(row)) for row in (ungrouped.routing()["topk_idx"] // 2).tolist()) > 2
    np.testing.assert_allclose(routing["combine_weights"].sum(1), 2.5, rtol=1e-5)
    batch = build(aux_loss="gshard_all_choices")
    assert float(batch(x).l_aux) != float(y.l_aux)
    (y.sum() + 0.1 * y.l_aux).backward()
    assert torch.isfinite(x.grad).all() and moe.gates[0].wg.weight.grad.abs().sum() > 0
    with pytest.raises(Exception, match="num_groups"):
        build(num_groups=3)
