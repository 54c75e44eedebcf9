"""switchyard's MoE layer as a torch.nn.Module (docs/python.md).

    from switchyard.torch import MoE
    moe = MoE(gate_type={'type': 'top', 'k': 2, 'capacity_factor': 1.0}, model_dim=512,
              experts={'type': 'ffn', 'count_per_node': 8, 'hidden_size_per_expert': 2048,
                       'activation_fn': torch.nn.functional.relu})
    y = moe(x)              # x [..., model_dim] float32 on the CPU; y has x's shape
                            # (float32 / bfloat16 CUDA tensors with SY_BUILD_CUDA, docs/gpu.md)
    loss = task_loss(y) + 0.01 * y.l_aux

The arguments and parameter names are those of tutel.moe.moe_layer, so swapping one for the other
is a one-line change: gates[0].wg.weight [E, M], experts.batched_fc1_w [E_l, H, M],
experts.batched_fc1_bias [E_l, H], experts.batched_fc2_w [E_l, H, M], experts.batched_fc2_bias
[E_l, M]. The flat switchyard spelling works too: MoE(model_dim=, hidden_size_per_expert=,
num_experts=, top_k=, capacity_factor=, activation=, normalize_gate=).

Memory: the C++ layer reads x and the parameters in place (torch and NumPy share the memory, the
C++ tensors wrap it); y and every gradient are torch tensors over memory the C++ layer allocated
(returned to autograd, which accumulates them into .grad). batched_fc2_w is stored in switchyard's
[E_l, M, H] order and the Parameter is its transposed view, so it has Tutel's shape without a copy.
"""
import torch
import torch.nn.functional as F

import switchyard as _sy

__all__ = ["MoE", "moe_layer"]

_ACTIVATIONS = {F.relu: "relu", torch.relu: "relu", F.gelu: "gelu", F.silu: "silu",
                torch.nn.functional.silu: "silu"}


def _activation_name(fn):
    if fn is None:
        return "relu"  # Tutel's default
    if isinstance(fn, str):
        return fn
    if isinstance(fn, torch.nn.Module):
        for cls, name in ((torch.nn.ReLU, "relu"), (torch.nn.GELU, "gelu"), (torch.nn.SiLU, "silu")):
            if isinstance(fn, cls) and getattr(fn, "approximate", "none") == "none":
                return name
    if fn in _ACTIVATIONS:
        return _ACTIVATIONS[fn]
    raise ValueError("activation: expected 'relu', 'gelu', 'silu' or the torch function of one of "
                     "them (F.relu, F.gelu, F.silu), got %r" % (fn,))


def _numpy(t):
    """A NumPy view of a float32 CPU tensor (a contiguous copy only if t is not contiguous)."""
    return t.detach().contiguous().numpy()


class _Gate(torch.nn.Module):
    def __init__(self, model_dim, num_experts):
        super().__init__()
        self.wg = torch.nn.Linear(model_dim, num_experts, bias=False)


class _Experts(torch.nn.Module):
    def __init__(self, local_experts, hidden, model_dim, fc2_bias_dim, bias):
        super().__init__()
        self.batched_fc1_w = torch.nn.Parameter(torch.empty(local_experts, hidden, model_dim))
        # switchyard's [E_l, M, H] storage; the parameter is its [E_l, H, M] view (Tutel's shape).
        self.batched_fc2_w = torch.nn.Parameter(
            torch.empty(local_experts, model_dim, hidden).transpose(1, 2))
        if bias:
            self.batched_fc1_bias = torch.nn.Parameter(torch.empty(local_experts, hidden))
            self.batched_fc2_bias = torch.nn.Parameter(torch.empty(local_experts, fc2_bias_dim))
        else:
            self.register_parameter("batched_fc1_bias", None)
            self.register_parameter("batched_fc2_bias", None)


def _cuda_pointers(names, tensors):
    """Device pointers of float32 CUDA tensors by switchyard name (contiguous ones: no copy)."""
    out = {}
    for name, t in zip(names, tensors):
        if t is None:
            continue
        if t.dtype != torch.float32 or not t.is_cuda or not t.is_contiguous():
            raise TypeError("MoE on CUDA: parameter '%s' must be a contiguous float32 CUDA tensor, "
                            "got %s on %s" % (name, t.dtype, t.device))
        out[name] = t.data_ptr()
    return out


class _CudaMoeFunction(torch.autograd.Function):
    """The GPU layer (docs/gpu.md) on CUDA tensors: pointers and the current stream go to C++; y,
    dx and the gradients are torch tensors it writes in place."""

    @staticmethod
    def forward(ctx, module, x, *params):
        impl = module._cuda_layer(x.dtype)
        x = x.contiguous()
        y = torch.empty_like(x)
        stream = torch.cuda.current_stream(x.device).cuda_stream
        ptrs = _cuda_pointers(module._names, params)
        out = impl.forward(ptrs, x.data_ptr(), x.shape[0], y.data_ptr(), stream)
        module._last_forward = out
        # The GPU layer keeps the state of its last forward only (docs/gpu.md).
        calls = module.__dict__.setdefault("_cuda_calls", {})
        calls[id(impl)] = calls.get(id(impl), 0) + 1
        ctx.call = calls[id(impl)]
        ctx.module, ctx.impl, ctx.ptrs = module, impl, ptrs
        ctx.save_for_backward(x, *[p for p in params if p is not None])
        ctx.param_present = [p is not None for p in params]
        return y, torch.tensor(out["l_aux"]), torch.tensor(out["z_loss"])

    @staticmethod
    def backward(ctx, dy, dl_aux, dz_loss):
        if ctx.module._cuda_calls[id(ctx.impl)] != ctx.call:
            raise RuntimeError("MoE on CUDA: backward must follow its own forward (the GPU layer "
                               "keeps the state of its last forward only; docs/gpu.md)")
        saved = ctx.saved_tensors
        x, present = saved[0], iter(saved[1:])
        params = [next(present) if p else None for p in ctx.param_present]
        dy = dy.contiguous()
        dx = torch.empty_like(x)
        grads = [torch.empty_like(p) if p is not None else None for p in params]
        gptrs = {n: g.data_ptr() for n, g in zip(ctx.module._names, grads) if g is not None}
        dl_aux, dz_loss = float(dl_aux), float(dz_loss)
        if dl_aux < 0 or dz_loss < 0:
            raise ValueError("MoE backward: the loss weights of l_aux (%g) and z_loss (%g) must be "
                             ">= 0 (a negative weight rewards imbalance)" % (dl_aux, dz_loss))
        stream = torch.cuda.current_stream(x.device).cuda_stream
        ctx.impl.backward(ctx.ptrs, dy.data_ptr(), dx.data_ptr(), gptrs, stream, dl_aux, dz_loss)
        return (None, dx, *grads)


class _MoeFunction(torch.autograd.Function):
    """y, l_aux = the C++ layer's forward; backward = its backward with the loss weights autograd
    passes in (the incoming gradients of l_aux and z_loss)."""

    @staticmethod
    def forward(ctx, module, x, *params):
        names = module._names
        arrays = {n: _numpy(p) for n, p in zip(names, params) if p is not None}
        fwd = module._impl.forward(arrays, _numpy(x), **module._call_options())
        ctx.module, ctx.arrays, ctx.fwd = module, arrays, fwd
        ctx.param_present = [p is not None for p in params]
        module._last_forward = fwd
        y = torch.from_numpy(fwd.y)
        return y, torch.tensor(fwd.l_aux), torch.tensor(fwd.z_loss)

    @staticmethod
    def backward(ctx, dy, dl_aux, dz_loss):
        module = ctx.module
        grads = module._backward(ctx.arrays, ctx.fwd, _numpy(dy), float(dl_aux), float(dz_loss))
        out = [None, torch.from_numpy(grads["x"])]
        for name, present in zip(module._names, ctx.param_present):
            out.append(torch.from_numpy(grads[name]) if present else None)
        ctx.fwd = None
        return tuple(out)


class MoE(torch.nn.Module):
    """A Tutel-compatible MoE layer whose forward and backward run switchyard's C++ layer.

    Arguments (Tutel's names): gate_type {'type': 'top', 'k', 'capacity_factor', 'gate_noise'},
    model_dim, experts {'type': 'ffn', 'count_per_node', 'hidden_size_per_expert',
    'activation_fn', 'has_fc1_bias', 'has_fc2_bias'}, normalize_gate, batch_prioritized_routing,
    is_gshard_loss, a2a_ffn_overlap_degree (with parallel), seeds (gate seed, experts seed).
    switchyard's: num_experts (global; instead of count_per_node), hidden_size_per_expert, top_k,
    capacity_factor, activation, config (more layer.json keys, docs/moe.md), threads (compute
    threads of the C++ layer; default torch.get_num_threads()), parallel (a dict of
    ParallelMoeLayer options: this process is one rank of the MPI job and holds its shard of the
    experts; docs/python.md).
    forward(x [..., M]) returns y of x's shape with y.l_aux (also self.l_aux); self.z_loss and
    self.routing() describe the last call.
    """

    def __init__(self, gate_type=None, model_dim=None, experts=None, *, num_experts=None,
                 hidden_size_per_expert=None, top_k=None, capacity_factor=None, activation=None,
                 normalize_gate=True, batch_prioritized_routing=False, is_gshard_loss=True,
                 a2a_ffn_overlap_degree=1, use_2dh=False, config=None, threads=None,
                 parallel=None, seeds=None, **unused):
        super().__init__()
        if unused:
            raise ValueError("MoE: unsupported argument(s) %s" % sorted(unused))
        if model_dim is None:
            raise ValueError("MoE: model_dim is required")
        gate_type = dict(gate_type or {})
        if isinstance(gate_type.get("type", "top"), str) and gate_type.get("type", "top") != "top":
            raise ValueError("gate_type['type']: expected 'top', got %r" % gate_type["type"])
        experts = dict(experts or {})
        if experts.get("type", "ffn") != "ffn":
            raise ValueError("experts['type']: expected 'ffn', got %r" % experts["type"])
        parallel = dict(parallel) if parallel is not None else None
        if use_2dh:
            raise ValueError("use_2dh: pass parallel={'hierarchical_ranks_per_node': n, ...} "
                             "(switchyard's 2DH all-to-all needs the ranks per node)")

        k = top_k if top_k is not None else gate_type.get("k", 2)
        cf = capacity_factor if capacity_factor is not None else gate_type.get("capacity_factor",
                                                                               1.0)
        hidden = (hidden_size_per_expert if hidden_size_per_expert is not None
                  else experts.get("hidden_size_per_expert"))
        if hidden is None:
            raise ValueError("MoE: hidden_size_per_expert is required (or experts="
                             "{'hidden_size_per_expert': H})")
        self._world = 1
        if parallel is not None:
            from mpi4py import MPI  # noqa: F401  (MPI initialized by mpi4py, used by switchyard)
            self._world = MPI.COMM_WORLD.Get_size()
        if num_experts is None:
            count = experts.get("count_per_node", 1)
            if count <= 0:
                raise ValueError("experts['count_per_node']: expected >= 1 (sharded experts: pass "
                                 "num_experts and parallel options), got %r" % count)
            num_experts = count * self._world  # Tutel: experts per rank x ranks
        bias = experts.get("has_fc1_bias", True)
        if experts.get("has_fc2_bias", True) != bias:
            raise ValueError("experts: has_fc1_bias and has_fc2_bias must be equal (fc_bias)")
        act = activation if activation is not None else experts.get("activation_fn")
        cfg = {"model_dim": model_dim, "hidden_dim": hidden, "num_experts": num_experts,
               "top_k": k, "capacity_factor": cf, "normalize_gate": normalize_gate,
               "batch_prioritized_routing": batch_prioritized_routing,
               "aux_loss": "gshard" if is_gshard_loss else "importance_load",
               "activation": _activation_name(act), "fc_bias": bias}
        noise = gate_type.get("gate_noise", 0.0)
        if noise:
            cfg.update(noise="tutel_normal", noise_std=noise)
        cfg.update(config or {})
        self.model_dim, self.num_global_experts, self.top_k = model_dim, num_experts, k
        self.threads = threads
        self._step = 0
        self._last_forward = None

        if parallel is None:
            self._impl = _sy.MoeLayer(cfg)
            local, hs, shards = num_experts, hidden, 1
        else:
            if a2a_ffn_overlap_degree != 1:
                parallel.setdefault("overlap_degree", a2a_ffn_overlap_degree)
            self._impl = _sy.ParallelMoeLayer(cfg, **parallel)
            local = self._impl.local_experts
            shards = self._impl.shards
            hs = hidden // shards
        self.config = cfg
        self.num_local_experts, self.sharded_count = local, shards

        # Tutel's seeds: (gate seed, experts seed), each None or an int seeding torch before that
        # part is initialized.
        seeds = tuple(seeds or ()) + (None, None)
        if seeds[0] is not None:
            torch.manual_seed(seeds[0])
        self.gates = torch.nn.ModuleList([_Gate(model_dim, num_experts)])
        self.experts = _Experts(local, hs, model_dim, -(-model_dim // shards), bias)
        if seeds[1] is not None:
            torch.manual_seed(seeds[1])
        self._init_parameters(num_experts, hidden, model_dim, bias)

    # The parameters in the order the autograd function takes them, with switchyard's names.
    _names = ("gate.weight", "experts.fc1.weight", "experts.fc1.bias", "experts.fc2.weight",
              "experts.fc2.bias")

    def _params(self):
        e = self.experts
        return (self.gates[0].wg.weight, e.batched_fc1_w, e.batched_fc1_bias,
                e.batched_fc2_w.transpose(1, 2), e.batched_fc2_bias)

    @torch.no_grad()
    def _init_parameters(self, num_experts, hidden, model_dim, bias):
        # torch.nn.Linear's default per expert (as Tutel): U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
        # The full tensors are drawn on every rank (same seed -> same model as on one rank) and
        # each rank keeps its shard.
        b1, b2 = model_dim ** -0.5, hidden ** -0.5
        full = {"gate.weight": self.gates[0].wg.weight.detach().clone(),
                "experts.fc1.weight": torch.empty(num_experts, hidden, model_dim).uniform_(-b1, b1),
                "experts.fc2.weight": torch.empty(num_experts, model_dim, hidden).uniform_(-b2, b2)}
        if bias:
            full["experts.fc1.bias"] = torch.empty(num_experts, hidden).uniform_(-b1, b1)
            full["experts.fc2.bias"] = torch.empty(num_experts, model_dim).uniform_(-b2, b2)
        self.load_switchyard_params(full)

    @torch.no_grad()
    def load_switchyard_params(self, full):
        """Sets the parameters from full tensors with switchyard's names and shapes (docs/moe.md,
        "Tensors"); each rank keeps its shard."""
        full = {n: (t.detach().float().contiguous() if torch.is_tensor(t) else torch.as_tensor(t))
                for n, t in full.items()}
        if isinstance(self._impl, _sy.ParallelMoeLayer):
            arrays = self._impl.shard_params({n: t.numpy() for n, t in full.items()})
            full = {n: torch.from_numpy(a) for n, a in arrays.items()}
        for name, p in zip(self._names, self._params()):
            if p is not None:
                p.copy_(full[name])

    def _call_options(self):
        opts = {"training": self.training, "step": self._step,
                "threads": self.threads or torch.get_num_threads()}
        if self.training:
            self._step += 1
        return opts

    def _backward(self, arrays, fwd, dy, dl_aux, dz_loss):
        threads = self.threads or torch.get_num_threads()
        if dl_aux < 0 or dz_loss < 0:
            raise ValueError("MoE backward: the loss weights of l_aux (%g) and z_loss (%g) must be "
                             ">= 0 (a negative weight rewards imbalance)" % (dl_aux, dz_loss))
        return self._impl.backward(arrays, fwd, dy, threads=threads, aux_loss_coef=dl_aux,
                                   z_loss_coef=dz_loss)

    def _cuda_layer(self, dtype):
        """The GPU layer for x's dtype (built once per dtype; needs a build with SY_BUILD_CUDA)."""
        if not getattr(_sy._switchyard, "has_cuda", False):
            raise TypeError("MoE: x is a CUDA tensor, but this switchyard was built without "
                            "SY_BUILD_CUDA (docs/gpu.md)")
        if isinstance(self._impl, _sy.ParallelMoeLayer):
            raise TypeError("MoE: the parallel layer runs on the CPU only (docs/gpu.md)")
        name = "bfloat16" if dtype == torch.bfloat16 else "float32"
        layers = self.__dict__.setdefault("_cuda_layers", {})
        if name not in layers:
            layers[name] = _sy._switchyard.CudaMoeLayer(self._impl._impl.config_json, name)
        return layers[name]

    def forward(self, x):
        if x.is_cuda:
            if x.dtype not in (torch.float32, torch.bfloat16):
                raise TypeError("MoE: expected x on CUDA as float32 or bfloat16, got %s" % x.dtype)
        elif x.dtype != torch.float32 or x.device.type != "cpu":
            raise TypeError("MoE: expected x as float32 on the CPU (or float32 / bfloat16 on "
                            "CUDA), got %s on %s" % (x.dtype, x.device))
        if x.shape[-1] != self.model_dim:
            raise ValueError("MoE: expected x [..., %d], got %s" % (self.model_dim,
                                                                     list(x.shape)))
        x2 = x.reshape(-1, self.model_dim)
        fn = _CudaMoeFunction if x.is_cuda else _MoeFunction
        y, l_aux, z_loss = fn.apply(self, x2, *self._params())
        y = y.view(x.shape)
        y.l_aux = l_aux
        self.l_aux, self.z_loss = l_aux, z_loss
        return y

    def routing(self):
        """The last forward's routing (docs/moe.md, "Tensors"), as NumPy arrays (on CUDA: a dict
        of the loads and counts; the routing arrays from the GPU layer's routing())."""
        if self._last_forward is None:
            return None
        if isinstance(self._last_forward, dict):
            return self._last_forward
        return self._last_forward.routing


def moe_layer(*args, **kwargs):
    """Tutel's spelling: switchyard.torch.moe_layer(...) is MoE(...)."""
    return MoE(*args, **kwargs)
