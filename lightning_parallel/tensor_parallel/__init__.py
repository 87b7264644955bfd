"""Megatron-style tensor parallelism for unchanged models (Shoeybi et al. 2019, arXiv 1909.08053).

``parallelize(module, mesh, plan=None, sequence_parallel=False)`` shards a model in place from a
plan (module-name globs -> styles) that is given, carried by a Hugging Face model, or detected
from structure. Sharded parameters carry ``param.tp_shard``; with sequence parallelism (Korthikanti
et al. 2022) replicated ones whose gradient is partial carry ``param.sequence_parallel``.
"""

from .attention import ParallelMultiheadAttention
from .comm import (
    copy_to_region,
    gather_from_region,
    gather_from_sequence_region,
    reduce_from_region,
    reduce_scatter_to_sequence_region,
    scatter_to_region,
)
from .cross_entropy import vocab_parallel_cross_entropy
from .detect import detect_plan
from .grads import sync_sequence_parallel_grads
from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from .parallelize import parallelize
from .plan import PlanEntry, TensorParallelError, parse_plan
from .random import ShardedDropout, TPRandom
from .shard import TPShard, gather_full_tensor, shard_tensor

__all__ = [
    "ColumnParallelLinear",
    "ParallelMultiheadAttention",
    "PlanEntry",
    "RowParallelLinear",
    "ShardedDropout",
    "TPRandom",
    "TPShard",
    "TensorParallelError",
    "VocabParallelEmbedding",
    "copy_to_region",
    "detect_plan",
    "gather_from_region",
    "gather_from_sequence_region",
    "gather_full_tensor",
    "parallelize",
    "parse_plan",
    "reduce_from_region",
    "reduce_scatter_to_sequence_region",
    "scatter_to_region",
    "shard_tensor",
    "sync_sequence_parallel_grads",
    "vocab_parallel_cross_entropy",
]
