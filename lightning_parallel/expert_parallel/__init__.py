"""Expert parallelism: whole experts of each Mixture-of-Experts layer placed on the ranks of an
expert-parallel group, tokens sent to their expert's rank and back with all-to-all (GShard, arXiv
2006.16668; Switch Transformer, arXiv 2101.03961), on an unchanged Hugging Face MoE model."""

from lightning_parallel.expert_parallel.apply import ExpertParallel, parallelize_experts
from lightning_parallel.expert_parallel.placement import (
    ExpertShard,
    find_experts,
    owned_experts,
)

__all__ = ["ExpertParallel", "ExpertShard", "find_experts", "owned_experts", "parallelize_experts"]
