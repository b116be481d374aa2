"""Tensor parallelism (Megatron, Shoeybi et al. 2019) and sequence parallelism (Korthikanti et al. 2022):
f/g mappings, parallel layers, activation layouts, tp plans."""

from paraloom.tensor_parallel.apply import (
    apply_tensor_parallel,
    full_state_dict,
    load_full_state_dict,
    param_bytes,
    sharded_parameters,
    tp_loss,
    trace_tensor_parallel,
)
from paraloom.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from paraloom.tensor_parallel.layouts import LAYOUTS, relayout
from paraloom.tensor_parallel.mappings import (
    all_gather_to_region,
    copy_to_region,
    gather_from_region,
    reduce_from_region,
    reduce_scatter_from_region,
    scatter_to_region,
)
from paraloom.tensor_parallel.module_plan import (
    apply_tp_plan,
    check_tp_plan,
    is_tp_sharded,
    plan_for,
    sync_weights_from_first,
)

__all__ = [
    "LAYOUTS",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "all_gather_to_region",
    "apply_tensor_parallel",
    "apply_tp_plan",
    "check_tp_plan",
    "copy_to_region",
    "full_state_dict",
    "gather_from_region",
    "is_tp_sharded",
    "load_full_state_dict",
    "param_bytes",
    "plan_for",
    "reduce_from_region",
    "reduce_scatter_from_region",
    "relayout",
    "scatter_to_region",
    "sharded_parameters",
    "sync_weights_from_first",
    "tp_loss",
    "trace_tensor_parallel",
    "vocab_parallel_cross_entropy",
]
