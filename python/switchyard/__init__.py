"""switchyard's MoE layer from Python (docs/python.md).

    import numpy as np, switchyard
    layer = switchyard.MoeLayer(dict(model_dim=8, hidden_dim=16, num_experts=4, top_k=2))
    params = layer.init_params(seed=1)          # {"gate.weight": array [E, M], ...}
    out = layer.forward(params, x)              # out.y, out.l_aux, out.routing
    grads = layer.backward(params, out, dy)     # {"x": ..., "gate.weight": ..., ...}

Config keys are those of layer.json (docs/moe.md). Arrays: C-contiguous float32 arrays are read in
place (no copy); results are arrays over the C++ layer's own memory (no copy).
switchyard.torch holds the torch.nn.Module.
"""
import atexit as _atexit
import json as _json

from . import _switchyard
from ._switchyard import Error, InvalidArgument, Forward, wraps_without_copy

__version__ = _switchyard.__version__
__all__ = ["MoeLayer", "ParallelMoeLayer", "Forward", "Error", "InvalidArgument",
           "wraps_without_copy", "config_json"]


def config_json(config):
    """The layer.json text of `config`: a dict of layer.json keys or a JSON string."""
    if isinstance(config, str):
        return config
    if not isinstance(config, dict):
        raise TypeError("config: expected a dict of layer.json keys or a JSON string, got "
                        + type(config).__name__)
    return _json.dumps(config)


class MoeLayer:
    """The MoE layer on one rank (docs/moe.md) over NumPy arrays.

    forward(params, x [T, M], training=True, step=0, global_token_offset=0, threads=1) -> Forward
        with .y [T, M], .l_aux, .z_loss, .capacity, .dropped and .routing (topk_idx, locations,
        gates, combine_weights [T, k]; expert_loads, expert_counts [E]).
    backward(params, forward, dy [T, M], threads=1) -> dict of gradients of
        sum(y * dy) + aux_loss_coef * l_aux + z_loss_coef * z_loss: "x" and every parameter name.
    """

    def __init__(self, config):
        self._impl = _switchyard.MoeLayer(config_json(config))

    @property
    def config(self):
        return _json.loads(self._impl.config_json)

    @property
    def top_k(self):
        return self._impl.top_k

    def param_shapes(self):
        """[(name, shape)] of the parameters the config needs (docs/moe.md, "Tensors")."""
        return [(n, tuple(s)) for n, s in self._impl.param_shapes()]

    def init_params(self, seed=0):
        return self._impl.init_params(seed)

    def forward(self, params, x, training=True, step=0, global_token_offset=0, threads=1,
                save_for_backward=True):
        return self._impl.forward(params, x, training, step, global_token_offset, threads,
                                  save_for_backward)

    def backward(self, params, forward, dy, threads=1, aux_loss_coef=None, z_loss_coef=None):
        """aux_loss_coef / z_loss_coef (>= 0), when given, replace the config's loss weights."""
        return self._impl.backward(params, forward, dy, threads, aux_loss_coef, z_loss_coef)


class ParallelMoeLayer:
    """The MoE layer across the processes of an MPI job (docs/parallel.md, docs/python.md).

    Every process of the job is one rank; each holds its own tokens and its shard of the experts
    (shard_params). options: ep, tp, etp, arrangement ("deepspeed" | "megatron"), dispatch
    ("alltoall" | "alltoallv" | "allgather"), batch_scope ("global" | "per_rank"), adaptive_r,
    overlap_degree, smart_group, hierarchical_ranks_per_node, sequence_parallel, tp_dedup,
    dispatch_dedup.
    Construction, forward and backward are collective: call them in the same order on every rank.
    """

    def __init__(self, config, **options):
        _register_mpi_cleanup()
        self._impl = _switchyard.ParallelMoeLayer(config_json(config), options)

    rank = property(lambda self: self._impl.rank)
    world_size = property(lambda self: self._impl.world_size)
    first_expert = property(lambda self: self._impl.first_expert)
    local_experts = property(lambda self: self._impl.local_experts)
    shards = property(lambda self: self._impl.shards)
    shard = property(lambda self: self._impl.shard)
    data_shards = property(lambda self: self._impl.data_shards)

    def shard_params(self, full_params):
        """This rank's parameters (gate: the same array; experts: its shard) out of the full."""
        return self._impl.shard_params(full_params)

    def forward(self, params, x, training=True, step=0, global_token_offset=0, threads=1,
                save_for_backward=True):
        return self._impl.forward(params, x, training, step, global_token_offset, threads,
                                  save_for_backward)

    def backward(self, params, forward, dy, threads=1, sync=True, mean=False, aux_loss_coef=None,
                 z_loss_coef=None):
        """Gradients of this rank's shard; with sync (default) summed over the ranks sharing each
        parameter, so that every rank holds the gradient of the whole batch's objective.
        aux_loss_coef / z_loss_coef (>= 0), when given, replace the config's loss weights."""
        return self._impl.backward(params, forward, dy, threads, sync, mean, aux_loss_coef,
                                   z_loss_coef)


_cleanup_registered = False


def _register_mpi_cleanup():
    # Registered after mpi4py's import (if any), so it runs before mpi4py finalizes MPI.
    global _cleanup_registered
    if not _cleanup_registered:
        _atexit.register(_switchyard.close_mpi)
        _cleanup_registered = True
