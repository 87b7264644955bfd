"""Trainer features that would silently do something else on a model whose ranks hold different parts.

A split model (TP shards, pipeline stages, placed experts, or ZeRO-2/3 rows) is refused, before any
process group exists, with Trainer features that assume every rank holds the whole model or runs
Lightning's backward: stochastic weight averaging under pipeline parallelism (it switches Lightning's
backward on again at each epoch end; elsewhere each rank averages its own part: ``strategy/averaging.py``),
``sync_batchnorm`` under ZeRO-2/3 (layers replaced after the parameters were sharded), and a
``CheckpointIO`` plugin (a split model writes a directory of shards itself).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import StochasticWeightAveraging

from lightning_parallel.checkpoint.background import writes_default_files
from lightning_parallel.errors import LaunchError
from lightning_parallel.options import ParallelOptions


def split_layout(options: ParallelOptions) -> str:
    parts = [f"tensor_parallel={options.tp}", f"pipeline_parallel={options.pp}"]
    if options.ep > 1:
        parts.append(f"expert_parallel={options.ep}")
    if options.shards_parameters:
        parts.append(f"zero_stage={options.zero}")
    return ", ".join(parts)


def refuse_split_model_flags(trainer: Any, options: ParallelOptions, layer_sync: Any, checkpoint_io: Any) -> None:
    """Raise ``LaunchError`` for a Trainer feature ``trainer`` uses that a split model would not honour."""
    split = split_layout(options)
    if options.pp > 1 and any(isinstance(callback, StochasticWeightAveraging) for callback in trainer.callbacks):
        raise LaunchError(
            f"Trainer(callbacks=[StochasticWeightAveraging(...)]) is not supported with {split}: it switches "
            "Lightning's backward back on at every epoch end, and the pipeline runs backward itself inside "
            "training_step. Average weights with EMAWeightAveraging or WeightAveraging(avg_fn=...) "
            "(lightning.pytorch.callbacks), which work with pipeline_parallel, or train with pipeline_parallel=1."
        )
    if options.shards_parameters and layer_sync is not None:
        raise LaunchError(
            f"Trainer(sync_batchnorm=True) is not supported with {split}: it replaces the BatchNorm layers "
            "once the model is set up, after ZeRO has sharded their parameters, so the new layers would hold "
            "the shards. Train with zero_stage 0 or 1 (optimizer state sharded), or without sync_batchnorm."
        )
    if not writes_default_files(checkpoint_io):
        raise LaunchError(
            f"Trainer(plugins=[{_plugin(checkpoint_io)}]) is not supported with {split}: a split model writes "
            "its checkpoint as a Distributed Checkpoint directory, one file per rank, without a CheckpointIO "
            "plugin. Remove the plugin, or write in the background with Trainer(plugins=[AsyncCheckpointIO()]) "
            "or the strategy's async_checkpoint=True; or use the plugin with DataParallelStrategy (zero_stage "
            "0 or 1)."
        )


def _plugin(checkpoint_io: Any) -> str:
    inner = getattr(checkpoint_io, "checkpoint_io", None)
    wrapped = f"{type(inner).__name__}(...)" if inner is not None and inner is not checkpoint_io else "..."
    return f"{type(checkpoint_io).__name__}({wrapped})"
