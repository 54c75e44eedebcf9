"""switchyard.MoeLayer over NumPy arrays: memory (zero copy where the layout allows), forward and
backward against finite differences and the plain-PyTorch reference, errors."""
import gc
import os
import sys

import numpy as np
import pytest

import switchyard

sys.path.insert(0, os.path.dirname(__file__))

CONFIG = dict(model_dim=6, hidden_dim=10, num_experts=4, top_k=2, capacity_factor=1.0,
              activation="gelu", aux_loss_coef=0.05)


def inputs(tokens=16, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((tokens, 6)).astype(np.float32),
            rng.standard_normal((tokens, 6)).astype(np.float32))


def test_param_shapes_and_init():
    layer = switchyard.MoeLayer(CONFIG)
    shapes = dict(layer.param_shapes())
    assert shapes == {"gate.weight": (4, 6), "experts.fc1.weight": (4, 10, 6),
                      "experts.fc1.bias": (4, 10), "experts.fc2.weight": (4, 6, 10),
                      "experts.fc2.bias": (4, 6)}
    params = layer.init_params(seed=3)
    assert {n: a.shape for n, a in params.items()} == shapes
    assert all(a.dtype == np.float32 for a in params.values())
    assert layer.top_k == 2 and layer.config["num_experts"] == 4


def test_forward_outputs_and_routing():
    layer = switchyard.MoeLayer(CONFIG)
    params = layer.init_params(seed=1)
    x, _ = inputs()
    out = layer.forward(params, x)
    assert out.y.shape == (16, 6) and out.y.dtype == np.float32
    r = out.routing
    assert r["topk_idx"].shape == (16, 2) and r["topk_idx"].dtype == np.int32
    assert out.capacity == 2 * 4  # k * floor(cf * ceil(T / E))
    kept = r["locations"] >= 0
    assert (r["locations"][kept] < out.capacity).all()
    assert r["expert_counts"].sum() == kept.sum()
    assert r["expert_loads"].sum() == 32 and out.dropped == 32 - kept.sum()
    np.testing.assert_array_equal(r["combine_weights"] == 0, ~kept)


def test_zero_copy_in_and_out():
    layer = switchyard.MoeLayer(CONFIG)
    params = layer.init_params(seed=1)
    x, dy = inputs()
    assert switchyard.wraps_without_copy(x)
    assert not switchyard.wraps_without_copy(x.astype(np.float64))
    assert not switchyard.wraps_without_copy(np.asfortranarray(np.ones((4, 6), np.float32)))
    assert not switchyard.wraps_without_copy(x[::2])
    out = layer.forward(params, x)
    # Results are arrays over the C++ layer's memory (no owned NumPy buffer), writable.
    assert not out.y.flags.owndata and out.y.flags.writeable
    # Other layouts are converted (copied) first and give the same result.
    np.testing.assert_array_equal(layer.forward(params, x.astype(np.float64)).y, out.y)
    xs = np.repeat(x, 2, axis=0)[::2]
    assert not switchyard.wraps_without_copy(xs)
    np.testing.assert_array_equal(layer.forward(params, xs).y, out.y)
    # Parameters are read in place: changing an array changes the next call.
    params["experts.fc2.bias"] += 1.0
    y2 = layer.forward(params, x).y
    np.testing.assert_allclose(y2 - out.y, np.repeat(out.routing["combine_weights"].sum(1,
                               keepdims=True), 6, axis=1), rtol=1e-4, atol=1e-4)


def test_lifetimes():
    # The forward state keeps x and the parameters alive; results outlive the layer.
    layer = switchyard.MoeLayer(CONFIG)
    params = layer.init_params(seed=2)
    x, dy = inputs()
    expected = layer.backward(params, layer.forward(params, x.copy()), dy)["x"].copy()
    out = layer.forward(params, x.copy())  # the only reference to this x is the forward's
    gc.collect()
    grads = layer.backward(params, out, dy)
    del layer, out, params
    gc.collect()
    np.testing.assert_array_equal(grads["x"], expected)


def objective(layer, params, x, dy):
    out = layer.forward(params, x, training=False)
    value = float(np.sum(out.y.astype(np.float64) * dy)) + CONFIG["aux_loss_coef"] * out.l_aux
    return value, out.routing["topk_idx"].copy()


def test_backward_against_finite_differences():
    # No drops (cf 0); float64 differences of the float32 layer with a step large enough for
    # float32 rounding. The objective jumps where a token's top-k set changes: a probe whose
    # perturbation changes the routing is replaced by another (at least 4 checked per tensor).
    cfg = dict(CONFIG, capacity_factor=0.0)
    layer = switchyard.MoeLayer(cfg)
    params = layer.init_params(seed=5)
    x, dy = inputs(tokens=12, seed=4)
    grads = layer.backward(params, layer.forward(params, x), dy)
    _, routing = objective(layer, params, x, dy)
    rng = np.random.default_rng(9)
    h = 1e-2
    for name, array in list(params.items()) + [("x", x)]:
        checked = 0
        for _ in range(40):
            idx = tuple(rng.integers(0, s) for s in array.shape)
            old = array[idx]
            array[idx] = old + h
            up, r_up = objective(layer, params, x, dy)
            array[idx] = old - h
            down, r_down = objective(layer, params, x, dy)
            array[idx] = old
            if not (np.array_equal(r_up, routing) and np.array_equal(r_down, routing)):
                continue
            numeric = (up - down) / (2 * h)
            assert grads[name][idx] == pytest.approx(numeric, rel=2e-2, abs=2e-3), (name, idx)
            checked += 1
            if checked == 4:
                break
        assert checked == 4, name


def test_equals_plain_pytorch_reference():
    import torch
    from reference_moe import reference_moe
    cfg = dict(CONFIG, capacity_factor=0.5, activation="relu")  # drops pairs
    layer = switchyard.MoeLayer(cfg)
    params = layer.init_params(seed=8)
    x, dy = inputs(tokens=20, seed=6)
    out = layer.forward(params, x)
    grads = layer.backward(params, out, dy)
    t = {n: torch.tensor(a, requires_grad=True) for n, a in params.items()}
    xt = torch.tensor(x, requires_grad=True)
    y, l_aux, kept, _ = reference_moe(xt, t["gate.weight"], t["experts.fc1.weight"],
                                      t["experts.fc1.bias"], t["experts.fc2.weight"],
                                      t["experts.fc2.bias"], k=2, cf=0.5, activation="relu")
    assert not kept.all()
    ((y * torch.tensor(dy)).sum() + cfg["aux_loss_coef"] * l_aux).backward()
    np.testing.assert_allclose(out.y, y.detach().numpy(), rtol=2e-4, atol=2e-5)
    assert out.l_aux == pytest.approx(float(l_aux), rel=1e-5)
    np.testing.assert_allclose(grads["x"], xt.grad.numpy(), rtol=2e-4, atol=2e-5)
    for n in params:
        np.testing.assert_allclose(grads[n], t[n].grad.numpy(), rtol=2e-4, atol=2e-5, err_msg=n)


def test_loss_weight_override():
    # backward(aux_loss_coef=a) equals a layer configured with aux_loss_coef a.
    layer = switchyard.MoeLayer(CONFIG)
    other = switchyard.MoeLayer(dict(CONFIG, aux_loss_coef=0.7))
    params = layer.init_params(seed=1)
    x, dy = inputs()
    g1 = layer.backward(params, layer.forward(params, x), dy, aux_loss_coef=0.7)
    g2 = other.backward(params, other.forward(params, x), dy)
    for n in g2:
        np.testing.assert_array_equal(g1[n], g2[n])
    g0 = layer.backward(params, layer.forward(params, x), dy)
    assert not np.array_equal(g0["gate.weight"], g2["gate.weight"])


def test_errors_name_what_was_wrong():
    with pytest.raises(ValueError, match="top_k"):
        switchyard.MoeLayer(dict(CONFIG, top_k=0))
    with pytest.raises(ValueError, match="no_such_key"):
        switchyard.MoeLayer(dict(CONFIG, no_such_key=1))
    layer = switchyard.MoeLayer(CONFIG)
    params = layer.init_params()
    with pytest.raises(ValueError, match="x"):
        layer.forward(params, np.zeros((4, 5), np.float32))
    bad = dict(params)
    bad["gate.weight"] = np.zeros((4, 7), np.float32)
    with pytest.raises(ValueError, match="gate.weight"):
        layer.forward(bad, np.zeros((4, 6), np.float32))
    del bad["gate.weight"]
    with pytest.raises(ValueError, match="gate.weight"):
        layer.forward(bad, np.zeros((4, 6), np.float32))
    out = layer.forward(params, np.zeros((4, 6), np.float32), save_for_backward=False)
    with pytest.raises(ValueError, match="save_for_backward"):
        layer.backward(params, out, np.zeros((4, 6), np.float32))
